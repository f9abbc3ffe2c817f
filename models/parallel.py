"""Tensor parallelism inside the models: which share of each layer this process holds, and the
collectives that join the shares.

Rank ``r`` of ``N`` holds a slice of the decoder, as vLLM and Megatron-LM cut it: the q/k/v
and gate/up projections by output rows (column-parallel: each rank computes its own heads and
its share of the MLP), the output and down projections by input columns (row-parallel: partial
sums that one all-reduce adds up), the embedding and the LM head by vocabulary rows (lookups
outside a rank's rows are zero and an all-reduce adds them; logits are gathered). KV heads are
split like the query heads, or replicated when there are fewer of them than ranks. The vision
tower is not cut: every rank holds all of it and encodes its share of a step's images
(``worker/model_runner.py``).

A layer says what it holds with ``Window``s on the checkpoint's tensors, which the loader reads
(``models/loader.py``, slices straight from the safetensors files). The state is the process's:
a worker sets it once before building its model (``init_tensor_parallel``); planning builds a
rank's model on the meta device inside ``tensor_parallel(rank, size)``, where collectives pass
meta tensors through. With one rank every helper here is the plain layer and nothing is
communicated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class CollectiveError(RuntimeError):
    """A collective failed (a peer died, or it timed out): the group is unusable, so the
    runner must not contain this like a bad request; the worker reports it and stops."""


@dataclass(frozen=True)
class _State:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed's process group; None: planning on one process
    # The vision tower split like the decoder (``--mm-encoder-tp-mode weights``) instead of
    # whole on every rank (``data``).
    split_encoder: bool = False


_state = _State()


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.size


def split_encoder() -> bool:
    """Whether the vision tower is split across the ranks (else each holds all of it)."""
    return _state.split_encoder and _state.size > 1


def init_tensor_parallel(rank: int, size: int, group: Any, split_encoder: bool = False) -> None:
    """This process serves ``rank`` of ``size`` in ``group`` (a worker, once, at start)."""
    global _state
    _state = _State(rank, size, group, split_encoder)


@contextlib.contextmanager
def tensor_parallel(rank: int, size: int, split_encoder: bool = False) -> Iterator[None]:
    """Build (on the meta device) the model as rank ``rank`` of ``size`` holds it: planning."""
    global _state
    saved = _state
    _state = _State(rank, size, None, split_encoder)
    try:
        yield
    finally:
        _state = saved


# ----------------------------------------------------------------------- collectives
def _collective(op, *args) -> None:
    import torch.distributed as dist

    try:
        getattr(dist, op)(*args, group=_state.group)
    except Exception as e:  # noqa: BLE001 (every failure of the group means the same)
        raise CollectiveError(f"tensor-parallel {op} failed on rank {_state.rank}: "
                              f"{type(e).__name__}: {str(e).strip()[:300]}") from e


def _communicates(x: torch.Tensor) -> bool:
    return _state.size > 1 and not x.is_meta and _state.group is not None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's ``x``, in place (row-parallel layers' partial sums)."""
    if _communicates(x):
        _collective("all_reduce", x)
    return x


def gather_vocab(local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's ``[rows, vocab share]`` logits side by side, cut to ``vocab_size``."""
    if _state.size == 1:
        return local
    if not _communicates(local):  # planning: the shape a real gather makes
        return local.new_empty(*local.shape[:-1], vocab_size)
    parts = [torch.empty_like(local) for _ in range(_state.size)]
    _collective("all_gather", parts, local.contiguous())
    return torch.cat(parts, dim=-1)[..., :vocab_size]


def broadcast(x: torch.Tensor, src: int) -> torch.Tensor:
    """``x`` as rank ``src`` has it, on every rank (in place)."""
    if _communicates(x):
        _collective("broadcast", x, src)
    return x


def gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value`` (small, picklable), by rank."""
    if _state.size == 1 or _state.group is None:
        return [value]
    found: list[Any] = [None] * _state.size
    _collective("all_gather_object", found, value)
    return found


# ----------------------------------------------------------------------- shards
@dataclass(frozen=True)
class Window:
    """The part of a checkpoint tensor this rank loads: ``length`` entries from ``start``
    along ``dim`` (and, for ``count`` > 1, as many from ``start + stride``, ``start + 2 *
    stride``...: this rank's rows of q, k and v stacked in one tensor). ``rank0_only``: the
    whole tensor on rank 0 and zeros elsewhere (the bias of a row-parallel layer, added once
    by the all-reduce)."""

    dim: int = 0
    start: int = 0
    length: int = 0
    rank0_only: bool = False
    stride: int = 0
    count: int = 1

    @property
    def size(self) -> int:
        """Entries along ``dim`` this rank holds."""
        return self.length * self.count

    @property
    def end(self) -> int:
        """One past the last entry read along ``dim``."""
        return self.start + (self.count - 1) * self.stride + self.length

    def read(self, source) -> torch.Tensor:
        """This window of ``source``: a tensor, or a lazy safetensors slice (read partly)."""
        if self.rank0_only:
            return source if isinstance(source, torch.Tensor) else source[:]
        parts = []
        for i in range(self.count):
            start = self.start + i * self.stride
            if isinstance(source, torch.Tensor):
                parts.append(source.narrow(self.dim, start, self.length))
            else:
                parts.append(source[(slice(None),) * self.dim
                                    + (slice(start, start + self.length),)])
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def even_share(total: int, what: str, encoder: bool = False) -> tuple[int, int]:
    """This rank's ``(start, length)`` of ``total`` split evenly; ``what`` names it in the
    error when it does not split. ``encoder``: a vision-tower layer, whole unless the tower
    is split."""
    size = _state.size
    if encoder and not split_encoder():
        return 0, total
    if total % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {total} {what}; "
                         f"choose a size that does")
    share = total // size
    return _state.rank * share, share


def kv_heads_of_rank(num_kv_heads: int) -> tuple[int, int]:
    """This rank's ``(first KV head, count)``: an even share, or one head (replicated) when
    there are fewer KV heads than ranks (rank ``r`` serves query heads of group
    ``r * num_kv_heads // size``)."""
    size = _state.size
    if num_kv_heads >= size:
        return even_share(num_kv_heads, "KV heads")
    if size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} must divide or be divided by the "
                         f"model's {num_kv_heads} KV heads")
    return _state.rank * num_kv_heads // size, 1


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads each of ``size`` ranks holds (its share, or one replicated head)."""
    return max(1, num_kv_heads // size)


def set_windows(layer: nn.Module, **windows: Window) -> nn.Module:
    """Record which part of the checkpoint's tensors ``layer``'s parameters hold (by
    parameter name); nothing is recorded where they hold all of it."""
    if _state.size > 1:
        layer.checkpoint_windows = dict(windows)
    return layer


def column_parallel(layer: nn.Linear, start: int, length: int, stride: int = 0,
                    count: int = 1) -> nn.Linear:
    """``layer`` holds output rows ``start : start + length`` (of each of ``count`` stacked
    blocks ``stride`` rows apart), its bias the same rows."""
    window = Window(0, start, length, stride=stride, count=count)
    windows = {"weight": window}
    if layer.bias is not None:
        windows["bias"] = window
    return set_windows(layer, **windows)


def row_parallel(layer: nn.Linear, start: int, length: int) -> nn.Linear:
    """``layer`` holds input columns ``start : start + length``; its bias (if any) counts on
    rank 0 only. Its output is a partial sum: the caller all-reduces it."""
    windows = {"weight": Window(1, start, length)}
    if layer.bias is not None:
        windows["bias"] = Window(rank0_only=True)
    return set_windows(layer, **windows)


def split_encoder_mlp(into: list[nn.Linear], out: nn.Linear, start: int, size: int) -> None:
    """A vision-tower MLP, where the tower is split: the layers ``into`` the hidden units
    column-parallel, the one ``out`` of them row-parallel."""
    if split_encoder():
        for layer in into:
            column_parallel(layer, start, size)
        row_parallel(out, start, size)


def encoder_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """``all_reduce`` for a vision-tower layer's partial sums: only where the tower is
    split."""
    return all_reduce(x) if split_encoder() else x


def vocab_share(vocab_size: int) -> tuple[int, int, int]:
    """This rank's vocabulary rows: ``(start, rows it loads, rows it holds)``. Every rank
    holds ``ceil(vocab / size)`` rows (the last one's tail is zero padding)."""
    held = -(-vocab_size // _state.size)
    start = min(vocab_size, _state.rank * held)
    return start, min(vocab_size, start + held) - start, held


class VocabParallelEmbedding(nn.Embedding):
    """The token embedding, its rows split across ranks: each rank looks up the ids it holds
    (zeros elsewhere) and an all-reduce adds the ranks' lookups."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        start, rows, held = vocab_share(vocab_size)
        super().__init__(held, hidden_size)
        self.vocab_start, self.vocab_rows, self.vocab_size = start, rows, vocab_size
        set_windows(self, weight=Window(0, self.vocab_start, self.vocab_rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if _state.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


def vocab_parallel_head(hidden_size: int, vocab_size: int) -> nn.Linear:
    """The LM head, its rows split like ``VocabParallelEmbedding``'s (logits through
    ``gather_vocab``)."""
    start, rows, held = vocab_share(vocab_size)
    head = nn.Linear(hidden_size, held, bias=False)
    return set_windows(head, weight=Window(0, start, rows))
