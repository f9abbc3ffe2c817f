"""The ``mmserve`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from mmserve.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, named as in vLLM."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", help="local Hugging Face checkpoint directory "
                   "(default: the bundled demo model)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=_int_or_auto, default=None,
                   help="longest sequence (prompt + output), or auto (default): what the KV "
                   "cache holds, capped at the model's limit")
    g.add_argument("--max-num-seqs", type=_int_or_auto, default=None,
                   help="most requests running at once, or auto (default): 256, or how many "
                   "sequences of --max-model-len fit")
    g.add_argument("--gpu-memory-utilization", type=float,
                   help="share of the device's memory to use: of a GPU's total memory "
                   "(default 0.9), or of the RAM available at start-up on the CPU (default 0.8)")
    g.add_argument("--single-user-mode", action="store_true",
                   help="max-num-seqs 1, and the whole KV cache for that one sequence")
    g.add_argument("--max-num-batched-tokens", type=int,
                   default=EngineConfig.max_num_batched_tokens)
    g.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false")
    g.add_argument("--kv-cache-memory", type=int, help="bytes of KV cache")
    g.add_argument("--limit-mm-per-prompt", type=_mm_limit,
                   default=EngineConfig.limit_mm_per_prompt,
                   help='most images in one prompt: N, or JSON as in vLLM: \'{"image": N}\' or '
                   '\'{"image": {"count": N, "width": W, "height": H}}\' (W x H: the largest '
                   "image to provision memory for)")
    g.add_argument("--encoder-cache-size", type=int, help="embedding tokens (default: auto)")
    g.add_argument("--max-image-pixels", type=int, default=EngineConfig.max_image_pixels)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default=EngineConfig.device, choices=["auto", "cpu", "cuda"],
                   help="auto = cuda when a CUDA device is visible")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode batches")


def engine_kwargs(args: argparse.Namespace) -> dict:
    keys = ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
            "enable_prefix_caching", "kv_cache_memory", "limit_mm_per_prompt",
            "encoder_cache_size", "max_image_pixels", "seed", "device", "enforce_eager",
            "gpu_memory_utilization", "single_user_mode")
    return {k: getattr(args, k) for k in keys}


def _mm_limit(value: str) -> int | dict:
    """``--limit-mm-per-prompt``: an integer, or vLLM's JSON form (checked here so that a
    typo is a usage error, not a traceback)."""
    from mmserve.config import parse_mm_limit

    parsed = int(value) if value.strip().lstrip("-").isdigit() else value
    try:
        parse_mm_limit(parsed)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return json.loads(value) if isinstance(parsed, str) else parsed


def _int_or_auto(value: str) -> int | None:
    """An integer flag that also takes ``auto`` (None: the memory plan decides)."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def _caption(args: argparse.Namespace) -> int:
    from mmserve import LLM, SamplingParams

    # No --model: LLM() falls back to the bundled demo model, which describes shape scenes.
    try:
        llm = LLM(args.model, **engine_kwargs(args))
    except FileNotFoundError as exc:
        print(f"mmserve caption: {exc}", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    captions = llm.caption(args.images, prompt=args.prompt, sampling_params=params)
    if args.json:
        print(json.dumps([{"image": str(p), "caption": c}
                          for p, c in zip(args.images, captions, strict=True)], indent=2))
    else:
        for path, caption in zip(args.images, captions, strict=True):
            print(f"{path}: {caption}")
    return 0


def add_caption_parser(sub: argparse._SubParsersAction) -> None:
    cap = sub.add_parser("caption", help="caption images in one batch")
    cap.add_argument("images", nargs="+", type=Path)
    cap.add_argument("--prompt", default="Describe this image.")
    cap.add_argument("--max-tokens", type=int, default=32)
    cap.add_argument("--json", action="store_true", help="print a JSON list")
    add_engine_args(cap)
    cap.set_defaults(func=_caption)


def main(argv: list[str] | None = None) -> int:
    from mmserve.bench.cli import add_bench_parser
    from mmserve.entrypoints.api_server import add_serve_parser
    from mmserve.entrypoints.plan import add_plan_parser

    parser = argparse.ArgumentParser(prog="mmserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    # Each front door registers its own subcommand, which sets ``func``.
    add_caption_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    add_plan_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
