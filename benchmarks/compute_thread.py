"""Decode steps on the thread that built the engine, and on others (ComputeThread).

torch's OpenMP runtime keeps a pool of worker threads for each thread that has started a
parallel region. This measures what that costs an engine on the CPU: the median decode step of
16 requests (the LLaVA bench checkpoint unless ``--model``, one 224x224 image and 64 text
tokens each), each setting in a fresh process:

- ``same``: built and stepped on the main thread (``LLM`` called where it was made);
- ``other``: built on the main thread, stepped on another (the server before ``ComputeThread``);
- ``fresh``: the main thread runs one parallel region, then the engine is built and stepped on a
  new thread (an engine on a ``ComputeThread`` in a process whose main thread used torch).

    python benchmarks/compute_thread.py
    python benchmarks/compute_thread.py --settings same,other --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

SETTINGS = ("same", "other", "fresh")


def measure(model: str, dtype: str, setting: str) -> dict:
    """The decode steps of one setting, in this process."""
    import numpy as np
    import torch
    from PIL import Image

    from mmserve import LLM, SamplingParams

    result: dict = {}

    def build() -> LLM:
        return LLM(model, dtype=dtype, max_model_len=1024, max_num_seqs=16,
                   max_num_batched_tokens=2048, kv_cache_memory=1 << 30)

    def step(llm: LLM) -> None:
        engine = llm.engine
        rng = np.random.default_rng(0)
        tokenizer = engine.processor.tokenizer
        for i in range(16):
            image = Image.fromarray(rng.integers(0, 255, (224, 224, 3), dtype=np.uint8))
            text = tokenizer.decode(rng.integers(100, 30000, 64).tolist())
            engine.add_request({"prompt": f"USER: <image>\n{text} ASSISTANT:",
                                "images": [image]},
                               SamplingParams(max_tokens=48, ignore_eos=True), str(i))
        steps = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            _, record = engine.step_with_record()
            end = time.perf_counter()
            if len(record.scheduler_output.decodes) == 16:  # all 16 decoding
                steps.append(end - start)
        result["decode_step_ms"] = 1000 * statistics.median(steps)
        result["steps"] = len(steps)

    if setting == "same":
        step(build())
    elif setting == "other":
        llm = build()
        thread = threading.Thread(target=step, args=(llm,))
        thread.start()
        thread.join()
    else:
        a = torch.randn(2000, 2000)
        (a @ a).sum()  # one parallel region on the main thread
        thread = threading.Thread(target=lambda: step(build()))
        thread.start()
        thread.join()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint (default: mmserve's LLaVA bench checkpoint)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--repeats", type=int, default=2, help="turns of each setting, alternating")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child process: measure this setting
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.model, args.dtype, args.one)))
        return 0

    from compare_vllm import machine

    from mmserve.bench.checkpoint import ensure_bench_checkpoint

    model = args.model or str(ensure_bench_checkpoint())
    settings = args.settings.split(",")
    print(f"machine: {machine()}\nmodel: {model}, dtype {args.dtype}; 16 decode rows\n")
    found: dict[str, list[float]] = {s: [] for s in settings}
    for _ in range(args.repeats):
        for setting in settings:
            out = subprocess.run([sys.executable, __file__, "--one", setting, "--model", model,
                                  "--dtype", args.dtype], capture_output=True, text=True,
                                 check=True)
            found[setting].append(json.loads(out.stdout.strip().splitlines()[-1])
                                  ["decode_step_ms"])
    for setting, values in found.items():
        print(f"{setting:6} decode step median {statistics.median(values):6.1f} ms  "
              f"(turns: {', '.join(f'{v:.1f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
