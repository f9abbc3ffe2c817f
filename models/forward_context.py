"""One scoped forward context carries batch metadata and the attention backend to the layers.

The runner chooses the backend (the torch reference with a compiled decode kernel on the CPU,
Triton kernels on the GPU) and the metadata type that goes with it; models only call
``get_forward_context().attention``, so they never branch on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from mmserve.kernels.paged_attention import paged_attention

# (query, key, value, kv_cache, metadata, scale) -> output; see kernels/paged_attention.py.
AttentionBackend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any, float], torch.Tensor]


@dataclass(frozen=True)
class ForwardContext:
    meta: Any  # the metadata type the backend reads
    attention: AttentionBackend


_current: ForwardContext | None = None


@contextmanager
def forward_context(
    meta: Any, attention: AttentionBackend = paged_attention
) -> Iterator[None]:
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is already active; forward passes do not nest")
    _current = ForwardContext(meta, attention)
    try:
        yield
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention layers must run inside `with forward_context(meta):`")
    return _current
