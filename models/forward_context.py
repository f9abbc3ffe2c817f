"""One scoped forward context carries batch metadata to the attention layers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from mmserve.kernels.paged_attention import AttentionMetadata

_current: AttentionMetadata | None = None


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is already active; forward passes do not nest")
    _current = meta
    try:
        yield
    finally:
        _current = None


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention layers must run inside `with forward_context(meta):`")
    return _current
