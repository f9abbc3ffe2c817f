"""`mmserve bench throughput | sweep | serve`: flags shared by every subcommand, and the runs."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

from mmserve.bench.checkpoint import BENCH_CHECKPOINTS, DEFAULT_BENCH_CHECKPOINT
from mmserve.bench.workload import (
    add_workload_args,
    build_workload,
    format_sizes,
    workload_config,
)
from mmserve.entrypoints.engine_args import add_engine_args, engine_kwargs

logger = logging.getLogger(__name__)


class BenchUsageError(ValueError):
    """Flags that contradict each other; the message says which."""


def resolve_model(args: argparse.Namespace) -> str:
    """``--model``, or the bench checkpoint ``--bench-checkpoint`` names (built on first use)."""
    if args.model is not None:
        if args.bench_checkpoint is not None:
            raise BenchUsageError("give --model or --bench-checkpoint, not both")
        return args.model
    from mmserve.bench.checkpoint import default_bench_dir, ensure_bench_checkpoint

    name = args.bench_checkpoint or DEFAULT_BENCH_CHECKPOINT
    path = default_bench_dir(name)
    logger.info("no --model given: using the %s bench checkpoint (random weights) at %s; "
                "building it takes under a minute the first time", name, path)
    return str(ensure_bench_checkpoint(path, name))


def _make_engine(model: str, args: argparse.Namespace, overrides: dict[str, Any] | None = None):
    from mmserve.config import EngineConfig
    from mmserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, **{**engine_kwargs(args), **(overrides or {})}))


def _peak(args: argparse.Namespace, engine) -> float | None:
    from mmserve.bench.flops import measure_matmul_peak

    return None if args.no_peak else engine.on_runner_thread(measure_matmul_peak,
                                                             engine.runner.dtype)


def _throughput(args: argparse.Namespace) -> int:
    from mmserve.bench.report import write_json
    from mmserve.bench.throughput import run_throughput, throughput_table

    _check_plot(args)
    window = _profile_window(args)
    _set_threads(args)
    model = resolve_model(args)
    engine = _make_engine(model, args)
    workload = build_workload(workload_config(args), engine.processor.tokenizer)
    peak = _peak(args, engine)
    profiler = None
    if window is not None:  # the GPU's kernels too on one
        from mmserve.bench.profile import StepProfiler

        profiler = StepProfiler(args.profile, *window,
                                cuda=engine.config.resolved_device == "cuda")
    with profiler or contextlib.nullcontext():
        run = run_throughput(engine, workload, peak, use_tqdm=not args.no_progress,
                             profiler=profiler)
    print(throughput_table(run.results))
    if profiler is not None:
        print(profiler.report + "(the run's figures above include the profiler's overhead)")
    if args.json_path:
        write_json(args.json_path, {
            "model": model, "dtype": str(engine.runner.dtype).removeprefix("torch."),
            "engine": _engine_summary(engine), "workload": _workload_summary(workload),
            # The profiler's overhead is in the figures of a profiled run.
            "profiled_steps": None if profiler is None else profiler.steps,
            **run.results, "steps": [vars(s) for s in run.steps]})
    if args.plot:
        from mmserve.bench.plots import plot_timeline

        plot_timeline(run.steps, args.plot)
    return 0 if run.results["failed"] == 0 else 1


def _sweep(args: argparse.Namespace) -> int:
    from mmserve.bench.report import write_json
    from mmserve.bench.sweep import parse_param, run_sweep, sweep_table
    from mmserve.bench.throughput import run_throughput

    try:
        name, values = parse_param(args.param)
    except ValueError as e:
        raise BenchUsageError(str(e)) from None
    _check_plot(args)
    _set_threads(args)
    model = resolve_model(args)
    state: dict[str, Any] = {}

    def run_one(overrides: dict[str, Any]):
        engine = _make_engine(model, args, overrides)
        if "workload" not in state:  # one workload (and one peak measurement) for all values
            state["workload"] = build_workload(workload_config(args), engine.processor.tokenizer)
            state["peak"] = _peak(args, engine)
        logger.info("sweep: %s", overrides)
        return run_throughput(engine, state["workload"], state["peak"],
                              use_tqdm=not args.no_progress)

    if args.repeats < 1:
        raise BenchUsageError(f"--repeats must be >= 1, got {args.repeats}")
    rows = run_sweep(name, values, run_one, args.repeats)
    print(sweep_table(rows))
    if args.json_path:
        write_json(args.json_path, {"model": model, "param": name, "values": values,
                                    "workload": _workload_summary(state["workload"]),
                                    "rows": rows})
    if args.plot:
        from mmserve.bench.plots import plot_sweep

        plot_sweep(rows, args.plot)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def _serve(args: argparse.Namespace) -> int:
    from mmserve.bench.serve import run_serve_command

    _check_plot(args)
    on_results = None
    if args.plot:
        from mmserve.bench.plots import plot_latency_cdf

        def on_results(results) -> None:
            ok = [r for r in results if r.ok]
            rate = ("all at once" if args.request_rate == float("inf")
                    else f"{args.request_rate:g} requests/s")
            title = (f"mmserve bench serve: {len(ok)} requests ({rate}"
                     + (f", at most {args.max_concurrency} in flight"
                        if args.max_concurrency else "") + ")")
            plot_latency_cdf([1e3 * r.ttft_s for r in ok],
                             [1e3 * x for r in ok for x in r.itl_s], args.plot, title=title)

    return run_serve_command(args, resolve_model, on_results=on_results)


def _check_plot(args: argparse.Namespace) -> None:
    """Before any benchmark runs: ``--plot`` needs matplotlib and a format it writes."""
    if args.plot:
        from mmserve.bench.plots import check_plot_path

        try:
            check_plot_path(args.plot)
        except ValueError as e:
            raise BenchUsageError(str(e)) from None


def _engine_summary(engine) -> dict[str, Any]:
    c = engine.config
    return {"max_model_len": c.max_model_len, "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens, "block_size": c.block_size,
            "enable_prefix_caching": c.enable_prefix_caching,
            "encoder_cache_tokens": engine.encoder_budget.cache_tokens,
            "tensor_parallel_size": c.tensor_parallel_size,
            "kv_cache_bytes": engine.plan.kv_cache_bytes * c.tensor_parallel_size,
            "torch_threads": _threads()}


def _workload_summary(workload) -> dict[str, Any]:
    c = workload.config
    return {"num_prompts": c.num_prompts, "image_sizes": format_sizes(c.image_sizes),
            "unique_images": c.unique_images, "images_per_prompt": c.images_per_prompt,
            "output_len": list(c.output_len), "shared_prefix_len": c.shared_prefix_len,
            "prompt_len": c.prompt_len, "image_dir": c.image_dir, "seed": c.seed}


def _profile_window(args: argparse.Namespace) -> tuple[int, int | None] | None:
    """The steps ``--profile`` records (``--profile-steps``), or None without it."""
    if args.profile is None:
        if args.profile_steps is not None:
            raise BenchUsageError("--profile-steps needs --profile DIR")
        return None
    from mmserve.bench.profile import parse_steps

    try:
        return parse_steps(args.profile_steps or ":")
    except ValueError as e:
        raise BenchUsageError(str(e)) from None


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _common(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--bench-checkpoint", choices=sorted(BENCH_CHECKPOINTS),
                   help="without --model: the benchmark checkpoint to run, built offline with "
                   "random weights on first use (mmserve/bench/checkpoint.py): 'llava' "
                   "(LLaVA-1.5 shapes, 196 tokens per image; the default) or 'qwen2_5_vl' "
                   "(Qwen2.5-VL's layers, 4 to 1024 tokens per image by its size)")
    add_workload_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--torch-threads", type=int, metavar="N",
                   help="intra-op threads (default: torch's choice); on a CPU shared with other "
                   "work, fewer threads than cores avoids stalls at parallel-region barriers")


def _offline(p: argparse.ArgumentParser, plot_help: str) -> None:
    """Flags of the subcommands that run the engine in this process."""
    _common(p)
    p.add_argument("--plot", metavar="PATH.png", help=plot_help + " (.svg or .pdf by the "
                   "suffix; needs matplotlib: pip install \"mmserve[bench]\")")
    p.add_argument("--no-peak", action="store_true",
                   help="skip the ~1 s matmul peak measurement")


def _set_threads(args: argparse.Namespace) -> None:
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)


def _usage_errors_exit_2(run: Callable[[argparse.Namespace], int]):
    """``run``, with a `BenchUsageError` printed as ``mmserve bench CMD: message`` and exit 2."""
    @functools.wraps(run)
    def checked(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except BenchUsageError as e:
            print(f"mmserve bench {args.bench_command}: {e}", file=sys.stderr)
            return 2
    return checked


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark the engine (throughput, sweep, serve)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    tp = kinds.add_parser("throughput", help="offline: the engine in this process")
    _offline(tp, "per-step timeline plot")
    tp.add_argument("--profile", metavar="DIR",
                    help="record the run's steps with torch's profiler (the GPU's kernels too "
                    "on one): the step's phases, the operator table and a trace for Perfetto "
                    "go into DIR (mmserve/bench/profile.py); it slows the run")
    tp.add_argument("--profile-steps", metavar="START:END",
                    help="with --profile: only steps START to END - 1, counted from 0 (either "
                    "may be left out; e.g. 40:60 for a stretch of decode steps)")
    tp.set_defaults(func=_usage_errors_exit_2(_throughput))

    sw = kinds.add_parser("sweep", help="one workload across values of one engine setting")
    _offline(sw, "throughput/hit rate/latency plot")
    sw.add_argument("--param", required=True, metavar="NAME=V1,V2,...",
                    help="e.g. encoder_cache_size=196,392,784 (auto lets the engine decide), "
                    "encoder_cache_eviction=queue-aware,lru or encoder_cache_borrowing=on,off")
    sw.add_argument("--repeats", type=int, default=1, metavar="N",
                    help="turns over all the values, each value in a fresh engine per turn; the "
                    "table shows each value's median turn and every turn's tokens/s")
    sw.set_defaults(func=_usage_errors_exit_2(_sweep))

    sv = kinds.add_parser("serve", help="online: an OpenAI-compatible server over HTTP")
    _common(sv)
    from mmserve.bench.serve import add_serve_args

    add_serve_args(sv)
    sv.set_defaults(func=_usage_errors_exit_2(_serve))
