"""LoRA adapters: what they cost. Requests of one shape through an engine without LoRA, and
through one started with ``enable_lora`` running them without an adapter, all with one
adapter, and half with each of two (``max_loras=2``), in one run, on the same machine and
checkpoint.

Each request is a chat turn with a distinct image (new ones for every run, prefix caching off,
so that every prompt is computed and no encoder output is found) and ``--max-tokens`` greedy
output tokens (end tokens ignored). The adapters are random, of ``--rank`` on every projection
of the decoder (q, k, v, o, gate, up, down): the most an adapter of that rank computes. Each
round runs every configuration once, in an order rotated from round to round (none always
first or last); the report gives each one's output tokens per second and its ratio to the
engine without LoRA in the same round.

    python benchmarks/lora.py                         # the bench checkpoint, float32
    python benchmarks/lora.py --rank 64 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from mmserve import LLM, LoRARequest, SamplingParams
from mmserve.bench.checkpoint import ensure_bench_checkpoint
from mmserve.bench.workload import synthesize_image
from mmserve.testing.lora import build_lora_adapter


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint (default: the bench checkpoint, built if needed)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    model_dir = args.model or str(ensure_bench_checkpoint())
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    n = args.num_requests
    with tempfile.TemporaryDirectory() as folder:
        adapters = [LoRARequest(name, i, str(build_lora_adapter(
            model_dir, f"{folder}/{name}", rank=args.rank, alpha=2 * args.rank, seed=i,
            std=0.02))) for i, name in enumerate(("a", "b"), 1)]
        runs = {
            "no LoRA engine": (False, None),
            "LoRA engine, no adapter": (True, None),
            "one adapter": (True, [adapters[0]] * n),
            "two adapters, half each": (True, [adapters[i % 2] for i in range(n)]),
        }
        common = {"dtype": args.dtype, "enable_prefix_caching": False, "max_model_len": 1024}
        print(f"{n} requests, one {args.image_size}x{args.image_size} image each, "
              f"{args.max_tokens} output tokens, adapters of rank {args.rank} on every "
              f"projection, {args.dtype}")
        with LLM(model_dir, **common) as plain, LLM(model_dir, enable_lora=True, max_loras=2,
                                                    max_lora_rank=args.rank, **common) as lora:
            for round_ in range(args.rounds + 1):  # the first warms both engines up
                rates = {}
                names = list(runs)
                turn = round_ % len(names)
                for name in names[turn:] + names[:turn]:
                    with_lora, loras = runs[name]
                    prompts = [{"messages": [{"role": "user", "content": [
                        {"type": "image"},
                        {"type": "text", "text": f"Image {i}: what is in it?"}]}],
                        "images": [synthesize_image(rng, (args.image_size,) * 2)]}
                        for i in range(n)]
                    llm = lora if with_lora else plain
                    start = time.perf_counter()
                    outs = llm.generate(prompts, params, lora_request=loras)
                    seconds = time.perf_counter() - start
                    for out in outs:  # (a request that failed would only look fast)
                        assert out.outputs[0].finish_reason == "length", out.outputs[0].error
                    rates[name] = n * args.max_tokens / seconds
                if round_ == 0:
                    continue
                base = rates["no LoRA engine"]
                print(f"round {round_}: " + "; ".join(
                    f"{name} {rates[name]:7.1f} out tok/s ({rates[name] / base:.2f}x)"
                    for name in runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
