"""Triton kernel: write the K and V of a step's tokens into the paged cache by slot mapping.

Same contract as ``write_kv_cache`` in ``paged_attention.py`` (the torch reference), plus one
rule for CUDA graphs: a slot of ``-1`` marks a padding token, which writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens]
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_block, stride_c_pos, stride_c_head,
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token of a CUDA-graph batch
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    # Head counts and head sizes need not be powers of two: pad the tile and mask.
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    dst = ((slot // block_size) * stride_c_block + (slot % block_size) * stride_c_pos
           + heads * stride_c_head + dims)
    k = tl.load(key_ptr + token * stride_k_tok + heads * stride_k_head + dims, mask=mask)
    tl.store(key_cache_ptr + dst, k, mask=mask)
    v = tl.load(value_ptr + token * stride_v_tok + heads * stride_v_head + dims, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


def triton_write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = padding
) -> None:
    """Copy each token's K/V rows into cache slot ``slot_mapping[token]``."""
    num_tokens = key.shape[0]
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if key.shape != value.shape or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
                         f"[num_tokens, {num_kv_heads}, {head_dim}] to match the cache")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("key, value and the cache must be contiguous in head_dim")
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_size,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_PAD=triton.next_power_of_2(head_dim),
    )
