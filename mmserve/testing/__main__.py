"""``python -m mmserve.testing FAMILY PATH [KEY=VALUE ...]``: build one tiny checkpoint."""

from __future__ import annotations

import argparse
import ast

from mmserve.testing.families import FAMILIES, build_tiny_checkpoint


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value  # a bare word: a string option such as vision=siglip


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m mmserve.testing",
                                     description="Build a tiny random checkpoint offline.")
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("path", help="output directory")
    parser.add_argument("options", nargs="*", type=_option, metavar="KEY=VALUE",
                        help="builder options, e.g. vision=siglip text=qwen2 seed=1")
    args = parser.parse_args()
    print(build_tiny_checkpoint(args.family, args.path, **dict(args.options)))


if __name__ == "__main__":
    main()
