"""Tiny random checkpoints built offline, for tests and benchmarks, and the transformers oracle.

`build_tiny_checkpoint(family, path, **options)` is the entry point (`mmserve.testing.families`);
each family's builder lives in its own module (`mmserve.testing.llava`,
`mmserve.testing.qwen2_vl`), on the shared tokenizer
(`mmserve.testing.tokenizer`), weights and directory writer (`mmserve.testing.checkpoint`).
`mmserve.testing.oracle.hf_greedy_generate` is the reference the parity tests compare against.
"""

from mmserve.testing.families import FAMILIES, build_tiny_checkpoint

__all__ = ["FAMILIES", "build_tiny_checkpoint"]
