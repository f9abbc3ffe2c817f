"""One scoped forward context carries batch metadata and the attention backend to the layers.

The runner chooses the backend (the torch reference with a compiled decode kernel on the CPU,
Triton kernels on the GPU) and the metadata type that goes with it; models only call
``get_forward_context().attention``, so they never branch on the device.

A runner that needs only some rows' hidden states (those it samples) may name them
(``OutputRows``): the decoder then returns theirs alone, and its last layer computes its attention
output and MLP for them only, beside every row's keys and values.
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
class OutputRows:
    """The rows of the flat batch whose hidden states leave the forward pass, in this order.

    Nothing reads the other rows' outputs of the last layer: the step only needs their keys and
    values, for later tokens. So that layer writes every row's K/V (``write_kv``) and then
    attends with these rows alone, each a single query over its sequence's cache as far as its
    own position (``meta``, the backend's metadata for them as decode rows): in a prompt step of
    a few thousand rows that samples a handful, most of a layer's arithmetic.
    """

    index: torch.Tensor  # [n] rows of the flat batch
    meta: Any  # the backend's metadata for those rows as single-token queries
    write_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (k, v, kv_cache)


@dataclass(frozen=True)
class ForwardContext:
    meta: Any  # the metadata type the backend reads
    attention: AttentionBackend
    output_rows: OutputRows | None = None  # None: every row's hidden state leaves the pass
    lora: Any = None  # the rows of each LoRA adapter's slot (models/lora.py: LoRARows)


_current: ForwardContext | None = None


@contextmanager
def forward_context(
    meta: Any, attention: AttentionBackend = paged_attention,
    output_rows: OutputRows | None = None, lora: Any = None,
) -> Iterator[None]:
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is already active; forward passes do not nest")
    _current = ForwardContext(meta, attention, output_rows, lora)
    try:
        yield
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention layers must run inside `with forward_context(meta):`")
    return _current
