"""mmserve against Hugging Face transformers' batched ``generate()``, in one run, same machine.

Both get the same checkpoint, prompts, images and output lengths (greedy, EOS ignored so the
lengths hold). transformers runs the requests in their given order in batches with left
padding; each batch generates until its longest request is done, and only the requested tokens
count. Its batch size is the fastest of ``--hf-batch-sizes``, chosen on the first workload by
timing one batch of each size (``--hf-batch-size`` skips the search). Both sides include
preprocessing (the HF processor) in their time.

Workloads (as in issue 5): ``mixed`` has K = N/2 distinct images each used twice, a shared
system prompt and output lengths drawn from 16..96; ``uniform`` has N distinct images and 64
output tokens each. Both draw their images at ``--image-sizes`` (one size, several, or the preset
``mixed``: small, medium, large and wide images, which a Qwen2.5-VL checkpoint makes 4 to 999
tokens each).

Texts are compared for the requests both completed: in bfloat16, two correct implementations
can drift apart after some tokens (different reduction orders round differently and greedy
argmax amplifies a tie), so the agreement is reported as exact matches and common-prefix
lengths. ``--fp32-check M`` re-runs the first M mixed requests in float32 on both sides,
where the outputs must be identical token for token; with ``--dtype bfloat16`` it also runs
them in bfloat16 on both sides and reports how many tokens of each agree with
transformers-float32 (transformers' own bfloat16 is the yardstick for mmserve's).

``--device cuda`` (the default where a GPU is visible) runs both on the GPU: transformers in its
process, mmserve's engine beside it with ``--gpu-memory-utilization`` of the GPU (default 0.5).
mmserve's report then gives the GPU's busy share of its runs from CUDA events.

    python benchmarks/compare_transformers.py            # builds the bench checkpoint if needed
    python benchmarks/compare_transformers.py --bench-checkpoint qwen2_5_vl \
        --image-sizes mixed --max-model-len 2048
    python benchmarks/compare_transformers.py --device cuda --bench-checkpoint llava-1.4b \
        --num-prompts 256 --image-sizes mixed --fp32-check 32 --fp32-max-tokens 48
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import multiprocessing
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from mmserve.bench.checkpoint import (
    BENCH_CHECKPOINTS,
    DEFAULT_BENCH_CHECKPOINT,
    ensure_bench_checkpoint,
)
from mmserve.bench.report import grid_table
from mmserve.bench.throughput import run_throughput
from mmserve.bench.workload import (
    Workload,
    WorkloadConfig,
    build_workload,
    format_sizes,
    parse_sizes,
)
from mmserve.config import EngineConfig
from mmserve.engine.llm_engine import LLMEngine
from mmserve.worker.cpu_allocator import keep_freed_memory

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


Sizes = tuple[tuple[int, int], ...]


def workload_configs(n: int, image_sizes: Sizes, shared_prefix_len: int,
                     seed: int) -> dict[str, WorkloadConfig]:
    return {
        "mixed": WorkloadConfig(num_prompts=n, image_sizes=image_sizes, unique_images=n // 2,
                                output_len=(16, 96), shared_prefix_len=shared_prefix_len,
                                seed=seed),
        "uniform": WorkloadConfig(num_prompts=n, image_sizes=image_sizes, output_len=(64, 64),
                                  seed=seed + 1),
    }


def warm_up_workload(image_sizes: Sizes, tokenizer) -> Workload:
    """Short requests with images of their own, one of each size (at least two), so that
    first-call costs are not timed."""
    return build_workload(WorkloadConfig(num_prompts=max(2, len(image_sizes)),
                                         image_sizes=image_sizes, output_len=(2, 2),
                                         seed=10_000), tokenizer)


# ----------------------------------------------------------------- transformers
class HFRunner:
    """transformers' own model class of the checkpoint (``architectures`` in its config, e.g.
    ``LlavaForConditionalGeneration``) with batched, left-padded greedy generate."""

    def __init__(self, model_dir: str, dtype: torch.dtype, device: str = "cpu") -> None:
        import transformers

        from mmserve.testing.oracle import load_hf_processor

        config = transformers.AutoConfig.from_pretrained(model_dir)
        model_class = getattr(transformers, config.architectures[0])
        self.model = model_class.from_pretrained(model_dir, dtype=dtype).to(device)
        self.model.eval()
        self.device = device
        # AutoProcessor, or for Qwen2-VL the same processor less its video processor (which
        # needs torchvision).
        self.processor = load_hf_processor(model_dir)
        self.processor.tokenizer.padding_side = "left"

    @torch.inference_mode()
    def generate(self, workload: Workload, indices: list[int]) -> list[list[int]]:
        """One batch: new token ids of each request, cut to its own output length."""
        from transformers import GenerationConfig

        reqs = [workload.requests[i] for i in indices]
        texts = [self.processor.apply_chat_template(r.messages, add_generation_prompt=True)
                 for r in reqs]
        images = [im for r in reqs for im in r.images]
        inputs = self.processor(text=texts, images=images or None, padding=True,
                                return_tensors="pt").to(self.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        tok = self.processor.tokenizer
        # eos_token_id=None: EOS does not stop a row, so every request gets its length.
        config = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in reqs),
                                  eos_token_id=None, pad_token_id=tok.pad_token_id,
                                  bos_token_id=tok.bos_token_id)
        out = self.model.generate(**inputs, generation_config=config)
        new = out[:, inputs["input_ids"].shape[1]:].tolist()
        return [ids[:r.output_len] for ids, r in zip(new, reqs, strict=True)]

    def run(self, workload: Workload, batch_size: int) -> tuple[list[list[int]], float]:
        """All requests in order, ``batch_size`` at a time; returns token ids and seconds."""
        n = len(workload.requests)
        start = time.perf_counter()
        outputs: list[list[int]] = []
        for b in range(0, n, batch_size):
            outputs += self.generate(workload, list(range(b, min(n, b + batch_size))))
            print(f"  transformers: {len(outputs)}/{n} requests, "
                  f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
        return outputs, time.perf_counter() - start

    def fastest_batch_size(self, workload: Workload, sizes: list[int]) -> dict[int, float]:
        """Output tokens/s of one batch (the first ``size`` requests) at each size."""
        rates = {}
        for size in sizes:
            size = min(size, len(workload.requests))
            if size in rates:
                continue
            start = time.perf_counter()
            outs = self.generate(workload, list(range(size)))
            rates[size] = sum(len(o) for o in outs) / (time.perf_counter() - start)
            print(f"  transformers batch size {size}: {rates[size]:.1f} output tokens/s",
                  file=sys.stderr)
        return rates


# transformers runs in a worker process of its own (see main); these run there.
_hf: HFRunner | None = None


def hf_start(model_dir: str, dtype: str, device: str, threads: int | None, keep_heap: bool,
             image_sizes: Sizes) -> None:
    global _hf
    if threads:
        torch.set_num_threads(threads)
    if keep_heap:
        keep_freed_memory()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    _hf = HFRunner(model_dir, _DTYPES[dtype], device)
    warm = warm_up_workload(image_sizes, _hf.processor.tokenizer)
    _hf.generate(warm, list(range(len(warm.requests))))


def hf_fastest_batch_size(workload: Workload, sizes: list[int]) -> dict[int, float]:
    assert _hf is not None
    return _hf.fastest_batch_size(workload, sizes)


def hf_run(workload: Workload, batch_size: int) -> tuple[list[list[int]], float]:
    assert _hf is not None
    return _hf.run(workload, batch_size)


# ----------------------------------------------------------------- mmserve
def mmserve_engine(model_dir: str, dtype: str, max_model_len: int,
                   **settings: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, dtype=dtype, max_model_len=max_model_len,
                                  **settings))


def release(device: str) -> None:
    """Memory of models and engines dropped back to the allocator, and on a GPU to the
    driver (the next one's free-memory check counts only what is free there)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# mmserve's encoder-cache configurations, each compared in the same turns: the defaults (a
# reserve of items for one step plus one, and borrowing of free KV blocks beyond it), the same
# reserve with borrowing off, and a reserve sized by hand to hold every distinct image.
CACHE_CONFIGS = ("default", "no-borrowing", "hand-sized")


def cache_settings(config: str, hand_sized_tokens: int) -> dict[str, Any]:
    return {"default": {},
            "no-borrowing": {"encoder_cache_borrowing": False},
            "hand-sized": {"encoder_cache_size": hand_sized_tokens,
                           "encoder_cache_borrowing": False}}[config]


def distinct_image_tokens(model_dir: str, workload: Workload) -> int:
    """Embedding tokens of the workload's distinct images, by the checkpoint's processor
    rules: a reserve this large holds them all."""
    from transformers import AutoConfig

    from mmserve.processing.registry import family_for

    family = family_for(model_dir, AutoConfig.from_pretrained(model_dir), None, None)
    return sum(family.num_image_tokens(*image.size) for image in workload.pool)


def warm_up_mmserve(engine: LLMEngine, image_sizes: Sizes) -> None:
    run_throughput(engine, warm_up_workload(image_sizes, engine.processor.tokenizer),
                   use_tqdm=False)
    engine.reset_caches()


def cache_table_rows(name: str, configs: list[str], rates: dict[str, list[float]],
                     runs: dict[str, Any], workload: Workload) -> list[list[Any]]:
    hand = statistics.median(rates["hand-sized"]) if "hand-sized" in rates else None
    rows = []
    for c in configs:
        r, rate = runs[c].results, statistics.median(rates[c])
        rows.append([name, c, rate, "" if hand is None else f"{rate / hand:.1%}",
                     f"{r['encoder_items_computed']} of {workload.num_distinct_images}",
                     r["encoder_cache_hit_rate"], r["encoder_cache_tokens"],
                     r["peak_encoder_cache_borrowed_tokens"], r["encoder_cache_restores"],
                     f"{r['encoder_cache_evictions']}/{r['encoder_cache_kv_pressure_evictions']}",
                     r["num_preemptions"]])
    return rows


# ----------------------------------------------------------------- agreement
def agreement(a: list[list[int]], b: list[list[int]], tokenizer) -> dict[str, Any]:
    prefixes = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    exact = sum(x == y for x, y in zip(a, b, strict=True))
    text_exact = sum(tokenizer.decode(x, skip_special_tokens=True)
                     == tokenizer.decode(y, skip_special_tokens=True)
                     for x, y in zip(a, b, strict=True))
    lengths = [len(x) for x in a]
    return {"requests": len(a), "token_exact": exact, "text_exact": text_exact,
            "prefix_mean": statistics.mean(prefixes), "prefix_median": statistics.median(prefixes),
            "prefix_min": min(prefixes), "mean_length": statistics.mean(lengths),
            "tokens_agreeing": sum(prefixes) / sum(lengths)}


def precision_check(model_dir: str, workload: Workload, count: int, max_len: int,
                    max_model_len: int, device: str, dtype: str) -> dict[str, Any]:
    """The first ``count`` requests, outputs cut to ``max_len`` tokens, each side's outputs
    against transformers in float32 one request at a time (no padding), the oracle:
    ``"float32"``, mmserve in float32 (which must equal it); with ``dtype`` bfloat16 also
    ``"hf_bfloat16"`` and ``"mmserve_bfloat16"``, both sides in bfloat16."""
    reqs = [dataclasses.replace(r, output_len=min(r.output_len, max_len))
            for r in workload.requests[:count]]
    sub = dataclasses.replace(workload, requests=reqs)
    dtypes = ["float32"] + ([dtype] if dtype != "float32" else [])
    hf_out: dict[str, list[list[int]]] = {}
    for name in dtypes:
        hf = HFRunner(model_dir, _DTYPES[name], device)
        hf_out[name] = [hf.generate(sub, [i])[0] for i in range(len(reqs))]
        tokenizer = hf.processor.tokenizer
        del hf
        release(device)
    found = {}
    for name in dtypes:
        engine = mmserve_engine(model_dir, name, max_model_len=max_model_len, device=device)
        got = [o.token_ids for o in run_throughput(engine, sub, use_tqdm=False).outputs]
        engine.close()
        release(device)
        found["float32" if name == "float32" else f"mmserve_{name}"] = agreement(
            hf_out["float32"], got, tokenizer)
        if name != "float32":
            found[f"hf_{name}"] = agreement(hf_out["float32"], hf_out[name], tokenizer)
    return found


# ----------------------------------------------------------------- main
def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {torch.get_num_threads()} torch threads{gpu}, torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint (default: the bench checkpoint, built if needed)")
    p.add_argument("--bench-checkpoint", choices=sorted(BENCH_CHECKPOINTS),
                   help="without --model: the benchmark checkpoint (mmserve/bench/checkpoint.py), "
                   "'llava' (the default) or 'qwen2_5_vl'")
    p.add_argument("--workloads", default="mixed,uniform")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--image-sizes", "--image-size", dest="image_sizes", type=parse_sizes,
                   default=((256, 200),), metavar="WxH[,WxH...]|mixed",
                   help="size of the drawn images, or several they take in turn; 'mixed': "
                   "small, medium, large and wide (default: 256x200)")
    p.add_argument("--shared-prefix-len", type=int, default=64,
                   help="tokens of the mixed workload's shared system prompt")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where both run (default: cuda when a GPU is visible)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="on a GPU, mmserve's share of it (transformers runs beside it)")
    p.add_argument("--hf-batch-sizes", default="16,32,64",
                   help="batch sizes to try for transformers (one batch each, first workload)")
    p.add_argument("--hf-batch-size", type=int, help="use this batch size, no search")
    p.add_argument("--fp32-check", type=int, default=4, metavar="M",
                   help="float32 exactness check on the first M mixed requests (0: skip)")
    p.add_argument("--fp32-max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="mmserve's longest sequence (default: 1024); the qwen2_5_vl checkpoint "
                   "makes up to 1024 tokens of an image: give 2048 with --image-sizes mixed")
    p.add_argument("--mmserve-configs", default=",".join(CACHE_CONFIGS),
                   help="mmserve's encoder-cache configurations to run, in each turn, the first "
                   "one compared with transformers: 'default' (the reserve the scheduler limits "
                   "need, borrowing free KV blocks beyond it), 'no-borrowing' (the same reserve "
                   "alone), 'hand-sized' (a reserve holding every distinct image, no borrowing)"
                   "; default: all three")
    p.add_argument("--encoder-cache-size", type=int,
                   help="the hand-sized reserve in embedding tokens (default: the tokens of the "
                   "workload's distinct images, at least the default reserve)")
    p.add_argument("--repeats", type=int, default=1,
                   help="turns per workload (transformers, then each mmserve configuration, each "
                   "in a fresh engine); medians reported")
    p.add_argument("--hf-keep-heap", action="store_true",
                   help="give transformers the C heap settings mmserve's CPU runner uses "
                   "(mmserve/worker/cpu_allocator.py); by default it runs as a user runs it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int,
                   help="torch threads for both sides (default: torch's choice); on a shared, "
                   "oversubscribed machine one thread avoids waits at parallel-region barriers")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    on_gpu = ({"gpu_memory_utilization": args.gpu_memory_utilization} if device == "cuda"
              else {})
    if args.model and args.bench_checkpoint:
        p.error("give --model or --bench-checkpoint, not both")
    model_dir = args.model or str(ensure_bench_checkpoint(
        name=args.bench_checkpoint or DEFAULT_BENCH_CHECKPOINT))
    print(f"machine: {machine()}")
    print(f"model: {model_dir}, dtype {args.dtype}, device {device}, "
          f"images {format_sizes(args.image_sizes)}")
    configs = workload_configs(args.num_prompts, args.image_sizes, args.shared_prefix_len,
                               args.seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    names = args.workloads.split(",")
    workloads = {name: build_workload(configs[name], tokenizer) for name in names}
    sizes = [int(s) for s in args.hf_batch_sizes.split(",")]

    # transformers runs in a process of its own: mmserve's engine changes process-wide state
    # (the C heap's settings, cpu_allocator.py) that transformers must not inherit unless
    # --hf-keep-heap asks for it. The two sides take turns, each run right after the other,
    # so that a change in the machine's speed moves both figures of one ratio alike.
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    pool.submit(hf_start, model_dir, args.dtype, device, args.threads, args.hf_keep_heap,
                args.image_sizes).result()
    configs_run = args.mmserve_configs.split(",")
    for c in configs_run:
        if c not in CACHE_CONFIGS:
            p.error(f"--mmserve-configs: {c!r} is not one of {', '.join(CACHE_CONFIGS)}")

    def run_mmserve(config: str, workload: Workload, hand_sized: int):
        """A fresh, warmed-up engine of ``config`` runs ``workload`` once."""
        engine = mmserve_engine(model_dir, args.dtype, args.max_model_len, device=device,
                                **on_gpu, **cache_settings(config, hand_sized))
        warm_up_mmserve(engine, args.image_sizes)
        run = run_throughput(engine, workload, use_tqdm=False)
        engine.close()
        release(device)
        return run

    rows, details, cache_rows = [], [], []
    best = args.hf_batch_size
    for name in names:
        workload = workloads[name]
        tokens = workload.num_output_tokens
        hand_sized = args.encoder_cache_size
        if hand_sized is None:
            hand_sized = distinct_image_tokens(model_dir, workload)
        print(f"\n== {name}: {len(workload.requests)} requests, {workload.num_distinct_images} "
              f"distinct images, {tokens} output tokens; mmserve {', '.join(configs_run)} "
              f"(hand-sized reserve: {hand_sized} tokens)", file=sys.stderr)
        rates: dict[int, float] = {}
        if best is None:
            rates = pool.submit(hf_fastest_batch_size, workload, sizes).result()
            best = max(rates, key=rates.get)
        hf_rates, ratios = [], []
        mm_rates: dict[str, list[float]] = {c: [] for c in configs_run}
        last: dict[str, Any] = {}
        for _ in range(args.repeats):
            hf_out, hf_s = pool.submit(hf_run, workload, best).result()
            hf_rates.append(tokens / hf_s)
            line = f"  transformers {tokens / hf_s:.1f}"
            for c in configs_run:
                last[c] = run_mmserve(c, workload, hand_sized)
                if c == "default" and args.encoder_cache_size is None:
                    # Never smaller than the default reserve (a workload with few distinct
                    # images needs less than the scheduler limits do).
                    hand_sized = max(hand_sized, last[c].results["encoder_cache_tokens"])
                mm_s = last[c].results["elapsed_s"]
                mm_rates[c].append(tokens / mm_s)
                line += f", mmserve {c} {tokens / mm_s:.1f}"
            ratios.append(mm_rates[configs_run[0]][-1] / hf_rates[-1])
            print(line + f" output tokens/s: {ratios[-1]:.2f}x", file=sys.stderr)
        run = last[configs_run[0]]
        mm_out = [o.token_ids for o in run.outputs]
        done = [i for i, (h, m) in enumerate(zip(hf_out, mm_out, strict=True))
                if len(h) == len(m) == workload.requests[i].output_len]
        agree = agreement([hf_out[i] for i in done], [mm_out[i] for i in done], tokenizer)
        rows.append([name, f"{best}", statistics.median(hf_rates),
                     statistics.median(mm_rates[configs_run[0]]), statistics.median(ratios),
                     f"{agree['token_exact']}/{agree['requests']}",
                     f"{agree['prefix_mean']:.1f}/{agree['mean_length']:.1f}"])
        details.append((name, rates, run.results, ratios))
        cache_rows += cache_table_rows(name, configs_run, mm_rates, last, workload)
    pool.shutdown()

    print("\n" + grid_table(
        ["workload", "HF batch", "HF out tok/s", f"mmserve ({configs_run[0]}) out tok/s",
         "ratio", "exact match", "common prefix/len"], rows))
    if args.repeats > 1:
        print(f"\n(medians of {args.repeats} turns each; ratios of each turn: " + "; ".join(
            f"{name} " + ", ".join(f"{x:.2f}" for x in ratios)
            for name, _, _, ratios in details) + ")")
    if len(configs_run) > 1:
        print("\nmmserve's encoder cache, in the same turns (the last turn's counts):")
        print(grid_table(["workload", "config", "out tok/s", "vs hand-sized", "images encoded",
                          "enc hit rate", "reserve", "peak borrowed", "restores",
                          "evictions cap/KV", "preemptions"], cache_rows))
    for name, rates, r, _ in details:
        if rates:
            print(f"\n{name}: transformers output tokens/s of one batch, by batch size: "
                  + ", ".join(f"{b}: {v:.1f}" for b, v in sorted(rates.items())))
        share = r["time_share"]
        print(f"{name}: mmserve images encoded {r['encoder_items_computed']} of "
              f"{r['encoder_items_requested']}, prefix-cache hit tokens "
              f"{r['prefix_cache_hit_tokens']}, peak running {r['peak_running']}, "
              f"preemptions {r['num_preemptions']}")
        t = r["tokens_per_image"]
        print(f"{name}: mmserve tokens per image min / median / max {t['min']} / "
              f"{t['median']:g} / {t['max']}, image tokens encoded {r['encoder_tokens_computed']}, "
              f"peak encoder cache {r['peak_encoder_cache_used_tokens']} of "
              f"{r['encoder_cache_tokens']} tokens ({r['peak_encoder_cache_usage']:.0%}) + "
              f"{r['peak_encoder_cache_borrowed_tokens']} borrowed, vision encoder "
              f"{r['encoder_share_of_step_time']:.1%} of step time")
        print(f"{name}: mmserve time shares: " + ", ".join(
            f"{k} {v:.1%}" for k, v in share.items()))
        print(f"{name}: mmserve's device busy {r['device_busy_share']:.1%} of the run "
              f"({r['device_busy_s']:.2f} of {r['elapsed_s']:.2f} s, from "
              f"{r['device_busy_from']}: the spans of its encoder, forward and sampling)")
        print(f"{name}: mmserve sched+prep share at ~{r['full_batch_mean_running']:.0f} running: "
              f"{r['full_batch_sched_prep_share']:.1%} of {r['full_batch_mean_step_ms']:.0f} ms "
              f"per step")
    if args.fp32_check:
        found = precision_check(model_dir, build_workload(configs["mixed"], tokenizer),
                                args.fp32_check, args.fp32_max_tokens, args.max_model_len,
                                device, args.dtype)
        check = found["float32"]
        print(f"\nfloat32 check ({check['requests']} mixed requests, up to "
              f"{args.fp32_max_tokens} tokens, transformers one request at a time): "
              f"{check['token_exact']}/{check['requests']} identical token for token")
        if args.dtype != "float32":
            hf, mm = found[f"hf_{args.dtype}"], found[f"mmserve_{args.dtype}"]
            print(f"{args.dtype} against transformers-float32 (same requests): tokens agreeing "
                  f"(common prefix) transformers-{args.dtype} {hf['tokens_agreeing']:.1%}, "
                  f"mmserve-{args.dtype} {mm['tokens_agreeing']:.1%}; identical requests "
                  f"{hf['token_exact']} and {mm['token_exact']} of {hf['requests']}")
        if check["token_exact"] != check["requests"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
