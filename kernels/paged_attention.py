"""Torch reference for paged attention over a mixed batch of prefill chunks and decodes.

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
A step's tokens are flat (``[num_tokens, ...]``); each sequence brings one or more query
tokens, writes their K/V into its blocks by slot mapping, then attends causally to everything
its block table holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    decode_slots: torch.Tensor  # [num_decodes, max_context] cache slots, padded
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_context] bool, True = attend


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    write_kv_cache(key, value, kv_cache, meta.slot_mapping)
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    key_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
    gqa = query.shape[1] != num_kv_heads
    out = torch.empty_like(query)

    for seq in meta.prefills:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        if seq.context_slots is None:  # the whole context is this chunk: skip the gather
            k, v = key[rows], value[rows]
        else:
            k, v = key_flat[seq.context_slots], value_flat[seq.context_slots]
        o = F.scaled_dot_product_attention(
            query[rows].transpose(0, 1).unsqueeze(0),  # [1, num_heads, q, head_dim]
            k.transpose(0, 1).unsqueeze(0),  # [1, num_kv_heads, ctx, head_dim]
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=seq.mask,
            is_causal=seq.mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[rows] = o[0].transpose(0, 1)

    if meta.decode_rows.numel():
        k = key_flat[meta.decode_slots].transpose(1, 2)  # [num_decodes, num_kv_heads, ctx, hd]
        v = value_flat[meta.decode_slots].transpose(1, 2)
        q = query[meta.decode_rows].unsqueeze(2)  # [num_decodes, num_heads, 1, head_dim]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa)
        out[meta.decode_rows] = o.squeeze(2)
    return out
