"""Torch reference for paged attention over a mixed batch of prefill chunks and decodes.

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
A step's tokens are flat (``[num_tokens, ...]``); each sequence brings one or more query
tokens, writes their K/V into its blocks by slot mapping, then attends causally to everything
its block table holds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
import torch.nn.functional as F

from mmserve.kernels.transfer import int_tensor


@dataclass
class PrefillSeq:
    """A sequence with several query tokens (a prompt chunk)."""

    query_start: int  # first row in the flat batch
    query_len: int
    context_len: int  # cached tokens before the chunk + query_len
    context_slots: torch.Tensor | None  # [context_len]; None when nothing was cached before
    mask: torch.Tensor | None  # [query_len, context_len] bool; None means plain causal


@dataclass
class AttentionMetadata:
    """Batch layout shared by every attention layer of one forward pass."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each scheduled token
    prefills: list[PrefillSeq]
    decode_rows: torch.Tensor  # [num_decodes] rows of single-token sequences in the flat batch
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] block ids, padded with 0
    decode_lens: torch.Tensor  # [num_decodes] context length of each decode
    block_size: int  # tokens per KV block

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor:
        """``[num_decodes, 1, 1, max_blocks * block_size]`` bool, True = attend: what torch's
        decode path masks with (built on first use: the compiled kernels read the lengths)."""
        width = self.decode_block_tables.shape[1] * self.block_size
        positions = torch.arange(width, device=self.decode_lens.device)
        return (positions.unsqueeze(0) < self.decode_lens.unsqueeze(1))[:, None, None, :]


def padded_block_tables(tables: list[list[int]], rows: int, width: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """``[rows, width]``: row ``i < len(tables)`` starts with ``tables[i]``, zeros elsewhere.
    One tensor from one flat list, not one per table: at a few hundred sequences a step, a
    tensor per table cost milliseconds."""
    out = torch.zeros(rows, width, dtype=dtype)
    if tables:
        counts = torch.tensor([len(t) for t in tables])
        filled = torch.arange(width) < counts.unsqueeze(1)
        out[:len(tables)][filled] = torch.tensor(list(chain.from_iterable(tables)), dtype=dtype)
    return out


def block_table_tensor(block_tables: list[list[int]] | torch.Tensor) -> torch.Tensor:
    """``[num_seqs, width]`` int64 on the CPU: a list of tables zero-padded, or a tensor of
    rows as it is (ids past a row's blocks may be left over: ``zero_past_blocks``)."""
    if isinstance(block_tables, torch.Tensor):
        return block_tables.long()
    width = max((len(t) for t in block_tables), default=1)
    return padded_block_tables(block_tables, len(block_tables), max(width, 1), torch.long)


def zero_past_blocks(tables: np.ndarray, seq_lens: np.ndarray, block_size: int) -> np.ndarray:
    """``tables`` (``[num_seqs, width]``) with every id past row ``i``'s first
    ``ceil(seq_lens[i] / block_size)`` set to 0: a kernel that reads whole rows (torch's
    decode path gathers them, then masks) reads block 0 there, as for a padded list."""
    blocks = -(-seq_lens // block_size)
    return np.where(np.arange(tables.shape[1]) < blocks[:, None], tables, 0)


def slot_mapping(query_lens: np.ndarray, seq_lens: np.ndarray, tables: np.ndarray,
                 block_size: int) -> np.ndarray:
    """``[num_tokens]`` int64: the cache slot of each of the batch's tokens, sequence ``i``'s
    being the last ``query_lens[i]`` of its ``seq_lens[i]``, its blocks row ``i`` of
    ``tables``. A few numpy operations, whatever the number of sequences and tokens (each
    costs a fraction of a torch operation's dispatch on arrays this small)."""
    if (query_lens == 1).all():  # decodes: each sequence's last position
        seq, pos = np.arange(len(query_lens)), seq_lens - 1
    else:
        seq = np.repeat(np.arange(len(query_lens)), query_lens)
        pos = (np.arange(len(seq)) - (np.cumsum(query_lens) - query_lens)[seq]
               + (seq_lens - query_lens)[seq])
    return tables[seq, pos // block_size] * block_size + pos % block_size


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]] | torch.Tensor,
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata of a flat batch: sequence ``i`` brings ``query_lens[i]`` tokens, the last ones of
    its ``context_lens[i]`` tokens, whose KV live in the blocks of ``block_tables[i]`` (a list
    per sequence, or rows of a tensor as the runner keeps them; each holds at least its
    sequence's blocks)."""
    if len(query_lens) != len(context_lens):
        raise ValueError(f"{len(query_lens)} query lengths for {len(context_lens)} sequences")
    tables = block_table_tensor(block_tables)
    # Tensor operations over every sequence, a Python loop over the prefill chunks alone: a
    # decode step of hundreds of sequences would otherwise pay for each.
    q, ctx = int_tensor(query_lens), int_tensor(context_lens)
    starts = torch.cumsum(q, 0) - q  # each sequence's first row in the flat batch
    is_decode = q == 1
    all_decodes = bool(is_decode.all())
    prefills: list[PrefillSeq] = []
    if not all_decodes:
        for i in (~is_decode).nonzero().squeeze(1).tolist():
            q_len, ctx_len, row = query_lens[i], context_lens[i], int(starts[i])
            if q_len == ctx_len:
                prefills.append(PrefillSeq(row, q_len, ctx_len, None, None))
                continue
            blocks = tables[i, :-(-ctx_len // block_size)]
            seq_slots = (blocks.unsqueeze(-1) * block_size + torch.arange(block_size)).flatten()
            q_pos = torch.arange(ctx_len - q_len, ctx_len).unsqueeze(1)
            mask = torch.arange(ctx_len).unsqueeze(0) <= q_pos  # [q_len, ctx_len]
            prefills.append(PrefillSeq(row, q_len, ctx_len, seq_slots[:ctx_len].to(device),
                                       mask.to(device)))
    decodes = None if all_decodes else is_decode.nonzero().squeeze(1)
    decode_lens = ctx if decodes is None else ctx.index_select(0, decodes)
    decode_rows = starts if decodes is None else starts.index_select(0, decodes)
    longest = int(decode_lens.max()) if len(decode_lens) else 1
    max_blocks = max(1, -(-longest // block_size))
    picked = (tables[:len(q)] if decodes is None
              else tables.index_select(0, decodes))[:, :max_blocks]
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(
            slot_mapping(q.numpy(), ctx.numpy(), tables.numpy(), block_size)).to(device),
        prefills=prefills,
        decode_rows=decode_rows.to(device),
        decode_block_tables=torch.from_numpy(
            zero_past_blocks(picked.numpy(), decode_lens.numpy(), block_size)).to(device),
        decode_lens=decode_lens.to(device),
        block_size=block_size,
    )


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


# (decode queries [num_decodes, num_heads, head_dim], kv_cache, metadata, scale) -> output
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]
# (chunk queries [query_len, num_heads, head_dim], keys and values [context_len, num_kv_heads,
#  head_dim], the chunk, scale) -> output [query_len, num_heads, head_dim]
PrefillAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, PrefillSeq, float], torch.Tensor]


def prefill_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    value: torch.Tensor,
    seq: PrefillSeq,
    scale: float,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """One prompt chunk attending causally to its context, with torch's fused attention."""
    o = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),  # [1, num_heads, q, head_dim]
        key.transpose(0, 1).unsqueeze(0),  # [1, num_kv_heads, ctx, head_dim]
        value.transpose(0, 1).unsqueeze(0),
        attn_mask=seq.mask,
        is_causal=seq.mask is None,
        scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return o[0].transpose(0, 1)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    decode: DecodeAttention | None = None,
    prefill: PrefillAttention | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Write the step's K/V, then attend. ``prefill`` and ``decode`` replace the torch paths
    for prompt chunks and single-token rows (the CPU runner passes the compiled kernels of
    ``cpu_ops.py``)."""
    write_kv_cache(key, value, kv_cache, meta.slot_mapping)
    decode = decode or decode_attention
    if not meta.prefills and meta.decode_rows.numel() == query.shape[0]:
        return decode(query, kv_cache, meta, scale)  # a decode-only step: every row, in order
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    key_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(query)
    prefill = prefill or prefill_attention

    for seq in meta.prefills:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        if seq.context_slots is None:  # the whole context is this chunk: skip the gather
            k, v = key[rows], value[rows]
        else:
            k = key_flat.index_select(0, seq.context_slots)
            v = value_flat.index_select(0, seq.context_slots)
        out[rows] = prefill(query[rows], k, v, seq, scale)

    if meta.decode_rows.numel():
        out[meta.decode_rows] = decode(query[meta.decode_rows], kv_cache, meta, scale)
    return out


def decode_attention(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
    """One query token per sequence, as batched matmuls over the gathered blocks.

    The CPU's fused attention kernel is built for long queries: with a single query row per
    sequence it is an order of magnitude slower than plain matmuls. Query heads are grouped by
    the KV head they share (GQA), so K and V are never repeated.
    """
    n, num_heads, head_dim = query.shape
    num_blocks, _, num_kv_heads, _ = kv_cache.shape[1:]
    rows = meta.decode_block_tables.flatten()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # Whole blocks as rows: one memcpy each. [n, max_blocks * block_size, kv_heads, dim]
        return cache.view(num_blocks, -1).index_select(0, rows).view(n, -1, num_kv_heads,
                                                                      head_dim)

    k, v = gather(kv_cache[0]), gather(kv_cache[1])
    q = query.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = meta.decode_mask[:, 0]  # [n, 1, max_blocks * block_size]
    out = torch.empty_like(q)
    for h in range(num_kv_heads):
        # A contiguous copy of one head's keys costs less than the batched matmul loses
        # reading them transposed with a stride of num_kv_heads * head_dim.
        scores = torch.bmm(q[:, h], k[:, :, h].contiguous().transpose(1, 2))  # [n, group, ctx]
        scores = scores.float() * scale
        scores.masked_fill_(~mask, float("-inf"))
        out[:, h] = torch.bmm(scores.softmax(-1).to(query.dtype), v[:, :, h])
    return out.view(n, num_heads, head_dim)
