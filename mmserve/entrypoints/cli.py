"""The ``mmserve`` command line: ``caption`` here; ``serve``, ``run-batch``, ``plan`` and ``bench``
register their own subcommands."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from mmserve.bench.cli import add_bench_parser
from mmserve.entrypoints.engine_args import add_engine_args, engine_kwargs
from mmserve.entrypoints.plan import add_plan_parser
from mmserve.entrypoints.serve_args import add_run_batch_parser, add_serve_parser
from mmserve.errors import InvalidInputError


def _caption(args: argparse.Namespace) -> int:
    from mmserve import LLM, BeamSearchParams, SamplingParams

    # No --model: LLM() falls back to the bundled demo model, which describes shape scenes.
    try:
        if args.beam_width is not None:  # checked before the weights load
            BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens)
        llm = LLM(args.model, **engine_kwargs(args))
    except (FileNotFoundError, ValueError) as exc:  # no model, settings that cannot work
        print(f"mmserve caption: {exc}", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    with llm:
        try:
            captions = llm.caption(args.images, prompt=args.prompt, sampling_params=params,
                                   beam_width=args.beam_width)
        except InvalidInputError as exc:  # an image, or a beam too wide for this checkpoint
            print(f"mmserve caption: {exc}", file=sys.stderr)
            return 2
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
    cap.add_argument("--beam-width", type=int, metavar="N",
                     help="each caption the best of a beam search N wide (default: greedy)")
    cap.add_argument("--json", action="store_true", help="print a JSON list")
    add_engine_args(cap)
    cap.set_defaults(func=_caption)


def build_parser() -> argparse.ArgumentParser:
    """``mmserve`` and all its subcommands."""
    parser = argparse.ArgumentParser(prog="mmserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    # Each front door registers its own subcommand, which sets ``func``; the server's module
    # is imported only to serve (serve_args.py says why).
    add_caption_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub).set_defaults(func=_serve)
    add_plan_parser(sub)
    add_run_batch_parser(sub).set_defaults(func=_run_batch)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from mmserve.entrypoints.serve_command import serve

    return serve(args)


def _run_batch(args: argparse.Namespace) -> int:
    from mmserve.entrypoints.batch_command import run_batch_command

    return run_batch_command(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "pooler_config"):  # a subcommand of the engine flags
        try:
            engine_kwargs(args)  # (flags that disagree: a usage error, as a bad value is)
        except ValueError as e:
            parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request (bench serve)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
