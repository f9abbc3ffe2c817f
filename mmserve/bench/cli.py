"""`mmserve bench throughput | sweep | serve`: flags shared by every subcommand, and the runs."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from mmserve.bench.workload import add_workload_args, build_workload, workload_config
from mmserve.entrypoints.engine_args import add_engine_args, engine_kwargs

logger = logging.getLogger(__name__)


def default_bench_model() -> Path:
    """Where the benchmark checkpoint is cached when ``--model`` is not given."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "mmserve" / "bench-llava"


def resolve_model(args: argparse.Namespace) -> str:
    """``--model``, or the benchmark checkpoint (built on first use) when it is not given."""
    if args.model is not None:
        return args.model
    from mmserve.bench.checkpoint import ensure_bench_checkpoint

    path = default_bench_model()
    logger.info("no --model given: using the benchmark checkpoint (random weights) at %s; "
                "building it takes about a minute the first time", path)
    return str(ensure_bench_checkpoint(path))


def _make_engine(model: str, args: argparse.Namespace, overrides: dict[str, Any] | None = None):
    from mmserve.config import EngineConfig
    from mmserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, **{**engine_kwargs(args), **(overrides or {})}))


def _peak(args: argparse.Namespace, engine) -> float | None:
    from mmserve.bench.flops import measure_matmul_peak

    return None if args.no_peak else measure_matmul_peak(engine.runner.dtype)


def _throughput(args: argparse.Namespace) -> int:
    from mmserve.bench.report import write_json
    from mmserve.bench.throughput import plot_timeline, run_throughput, throughput_table

    _set_threads(args)
    model = resolve_model(args)
    engine = _make_engine(model, args)
    workload = build_workload(workload_config(args), engine.processor.tokenizer)
    peak = _peak(args, engine)
    run = run_throughput(engine, workload, peak, use_tqdm=not args.no_progress)
    print(throughput_table(run.results))
    if args.json_path:
        write_json(args.json_path, {
            "model": model, "dtype": str(engine.runner.dtype).removeprefix("torch."),
            "engine": _engine_summary(engine), "workload": _workload_summary(workload),
            **run.results, "steps": [vars(s) for s in run.steps]})
    if args.plot:
        plot_timeline(run.steps, args.plot)
    return 0 if run.results["failed"] == 0 else 1


def _sweep(args: argparse.Namespace) -> int:
    from mmserve.bench.report import write_json
    from mmserve.bench.sweep import parse_param, plot_sweep, run_sweep, sweep_table
    from mmserve.bench.throughput import run_throughput

    try:
        name, values = parse_param(args.param)
    except ValueError as e:
        print(f"mmserve bench sweep: {e}", file=sys.stderr)
        return 2
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

    rows = run_sweep(name, values, run_one)
    print(sweep_table(rows))
    if args.json_path:
        write_json(args.json_path, {"model": model, "param": name, "values": values,
                                    "workload": _workload_summary(state["workload"]),
                                    "rows": rows})
    if args.plot:
        plot_sweep(rows, args.plot)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def _serve(args: argparse.Namespace) -> int:
    from mmserve.bench.serve import run_serve_command

    return run_serve_command(args, resolve_model)


def _engine_summary(engine) -> dict[str, Any]:
    c = engine.config
    return {"max_model_len": c.max_model_len, "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens, "block_size": c.block_size,
            "enable_prefix_caching": c.enable_prefix_caching,
            "encoder_cache_tokens": engine.encoder_budget.cache_tokens,
            "kv_cache_bytes": engine.plan.kv_cache_bytes, "torch_threads": _threads()}


def _workload_summary(workload) -> dict[str, Any]:
    c = workload.config
    return {"num_prompts": c.num_prompts, "image_size": f"{c.image_size[0]}x{c.image_size[1]}",
            "unique_images": c.unique_images, "images_per_prompt": c.images_per_prompt,
            "output_len": list(c.output_len), "shared_prefix_len": c.shared_prefix_len,
            "prompt_len": c.prompt_len, "image_dir": c.image_dir, "seed": c.seed}


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _common(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_workload_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--torch-threads", type=int, metavar="N",
                   help="intra-op threads (default: torch's choice); on a CPU shared with other "
                   "work, fewer threads than cores avoids stalls at parallel-region barriers")


def _offline(p: argparse.ArgumentParser, plot_help: str) -> None:
    """Flags of the subcommands that run the engine in this process."""
    _common(p)
    p.add_argument("--plot", metavar="PATH.png", help=plot_help)
    p.add_argument("--no-peak", action="store_true",
                   help="skip the ~1 s matmul peak measurement")


def _set_threads(args: argparse.Namespace) -> None:
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark the engine (throughput, sweep, serve)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    tp = kinds.add_parser("throughput", help="offline: the engine in this process")
    _offline(tp, "per-step timeline plot")
    tp.set_defaults(func=_throughput)

    sw = kinds.add_parser("sweep", help="one workload across values of one engine setting")
    _offline(sw, "throughput/hit rate/latency plot")
    sw.add_argument("--param", required=True, metavar="NAME=V1,V2,...",
                    help="e.g. encoder_cache_size=196,392,784 (auto lets the engine decide)")
    sw.set_defaults(func=_sweep)

    sv = kinds.add_parser("serve", help="online: an OpenAI-compatible server over HTTP")
    _common(sv)
    from mmserve.bench.serve import add_serve_args

    add_serve_args(sv)
    sv.set_defaults(func=_serve)
