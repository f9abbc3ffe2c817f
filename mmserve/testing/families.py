"""Tiny checkpoints by family: `build_tiny_checkpoint` and the builders it dispatches to.

A family is named by its Hugging Face ``model_type``. Adding one is a module
(``mmserve/testing/<family>.py``) with a builder ``(path, **options) -> Path`` that writes a
complete checkpoint directory through `mmserve.testing.checkpoint`, plus its line in `_BUILDERS`.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

from mmserve.testing.llava import build_tiny_llava
from mmserve.testing.qwen2_vl import build_tiny_qwen2_5_vl, build_tiny_qwen2_vl

__all__ = ["FAMILIES", "build_tiny_checkpoint"]

_BUILDERS: dict[str, Callable[..., pathlib.Path]] = {
    "llava": build_tiny_llava,
    "qwen2_vl": build_tiny_qwen2_vl,
    "qwen2_5_vl": build_tiny_qwen2_5_vl,
}
FAMILIES = tuple(sorted(_BUILDERS))


def build_tiny_checkpoint(
    family: str, path: str | os.PathLike[str], **options: Any
) -> pathlib.Path:
    """Write a tiny random checkpoint of ``family`` to ``path`` and return the directory.

    ``options`` are the family builder's keywords (shapes, architecture choices, ``dtype``,
    ``seed``; see e.g. `build_tiny_llava`, `build_tiny_qwen2_vl`); the same options and seed give
    the same files.
    """
    if family not in _BUILDERS:
        raise ValueError(f"unknown checkpoint family {family!r}; families: {', '.join(FAMILIES)}")
    return _BUILDERS[family](path, **options)
