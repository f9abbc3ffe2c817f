"""Triton paged attention over a mixed batch of prefill chunks and decodes.

One kernel serves every sequence of a step: sequence ``s`` brings the query tokens
``query_start_loc[s]:query_start_loc[s + 1]`` (1 for a decode, many for a prefill chunk) and
attends causally to the ``seq_lens[s]`` tokens its block table holds, the chunk's own tokens
included (they are written to the cache first). The torch reference with the same contract is
``paged_attention.py``.

The metadata is four int tensors and one Python int, so the CUDA runner builds it with one
host-to-device copy per tensor, and a decode batch padded for a CUDA graph is just sequences with
zero query tokens (they return at once) and tokens with slot ``-1`` (the KV write skips them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from mmserve.kernels.paged_attention import block_table_tensor, slot_mapping, zero_past_blocks
from mmserve.kernels.transfer import to_device_all
from mmserve.kernels.triton_kv_cache import triton_write_kv_cache

LOG2E = 1.4426950408889634


@dataclass
class TritonAttentionMetadata:
    """Batch layout of one forward pass, as the Triton kernels read it."""

    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each token, -1 = padding
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32 first row of each sequence, then total
    seq_lens: torch.Tensor  # [num_seqs] int32 cached tokens after this step, chunk included
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 physical block ids, 0-padded
    max_query_len: int  # sets the grid; a host int so launching never syncs with the device
    # Rows may follow the last sequence's (a decode batch padded to a CUDA graph's size): their
    # attention output is zeros, not whatever the memory held (no sequence computes them).
    padded: bool = False

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]] | torch.Tensor,
        block_size: int,
        device: torch.device | str = "cpu",
        num_seqs_padded: int | None = None,
        max_blocks: int | None = None,
    ) -> TritonAttentionMetadata:
        """Metadata for sequences given by query length, length after the step and block table
        (a list per sequence, or rows of a tensor as the runner keeps them, at least as wide as
        each sequence's blocks).

        ``num_seqs_padded`` appends sequences with no query tokens (their tokens' slots are
        -1, their rows' attention output zeros), and ``max_blocks`` fixes the block-table
        width, so a CUDA graph captured at that shape can replay any smaller batch.
        """
        num_seqs = len(query_lens)
        if not len(seq_lens) == len(block_tables) == num_seqs:
            raise ValueError("query_lens, seq_lens and block_tables need one entry per sequence")
        padded = num_seqs if num_seqs_padded is None else num_seqs_padded
        if padded < num_seqs:
            raise ValueError(f"num_seqs_padded={padded} is below the {num_seqs} sequences")
        # NumPy over every sequence (as paged_attention's helpers): hundreds of decodes a step,
        # no loop over them.
        q = np.fromiter(query_lens, np.int64, num_seqs)
        s_lens = np.fromiter(seq_lens, np.int64, num_seqs)
        if isinstance(block_tables, torch.Tensor):
            rows = block_tables.long().numpy()
            lengths = np.full(num_seqs, rows.shape[1])
        else:
            rows = block_table_tensor(block_tables).numpy()
            lengths = np.fromiter(map(len, block_tables), np.int64, num_seqs)
        needed = int((-(-s_lens // block_size)).max()) if num_seqs else 0
        width = max(1, needed if max_blocks is None else max_blocks)
        if needed > width:
            raise ValueError(f"a sequence needs {needed} blocks, over max_blocks={width}")
        bad = ~((0 < q) & (q <= s_lens) & (s_lens <= lengths * block_size))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"sequence {i}: need 0 < query_len ({query_lens[i]}) <= seq_len "
                             f"({seq_lens[i]}) <= blocks x block_size "
                             f"({int(lengths[i]) * block_size})")
        cols = min(width, rows.shape[1])
        tables = np.zeros((padded, width), np.int32)
        tables[:num_seqs, :cols] = zero_past_blocks(rows[:, :cols], s_lens, block_size)
        # Padding sequences own one padding token each: a decode graph of size N has N rows.
        slots = np.concatenate([slot_mapping(q, s_lens, rows, block_size),
                                np.full(padded - num_seqs, -1, np.int64)])
        starts = np.zeros(padded + 1, np.int32)
        starts[1:num_seqs + 1] = np.cumsum(q)
        starts[num_seqs + 1:] = starts[num_seqs]
        lens = np.zeros(padded, np.int32)
        lens[:num_seqs] = s_lens
        slots, starts, lens, tables = to_device_all(
            [torch.from_numpy(a) for a in (slots, starts, lens, tables)], device)
        return cls(
            slot_mapping=slots,
            query_start_loc=starts,
            seq_lens=lens,
            block_tables=tables,
            max_query_len=max(query_lens, default=0),
            padded=num_seqs_padded is not None,
        )

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale_log2,  # softmax scale x log2(e): exp2 replaces exp
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_pos, stride_c_head, stride_bt_seq,
    block_size,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:  # grid is sized for the longest chunk; also graph padding
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this chunk

    # One program computes BLOCK_Q query tokens x all GROUP query heads that share this KV
    # head (GQA), so every K/V tile is loaded once for the whole group. Row r of the tile is
    # token r // GROUP_PAD, head r % GROUP_PAD of the group.
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    token = q_block * BLOCK_Q + rows // GROUP_PAD
    group_idx = rows % GROUP_PAD
    head = kv_head * GROUP + group_idx
    row_ok = (token < q_len) & (group_idx < GROUP)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM  # head sizes 80 and 96 are padded to 128
    q_offs = (q_start + token)[:, None] * stride_q_tok + head[:, None] * stride_q_head
    q = tl.load(q_ptr + q_offs + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :],
                other=0.0).to(DOT_DTYPE)  # [BLOCK_M, HEAD_PAD]
    q_pos = context_len + token  # absolute position of each row's query token

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    # Causal: the last query token of this tile sees positions up to kv_end - 1.
    kv_end = context_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    cols = tl.arange(0, BLOCK_N)
    for kv_start in range(0, kv_end, BLOCK_N):
        pos = kv_start + cols  # [BLOCK_N] logical positions
        pos_ok = pos < kv_end
        # Tiles are independent of block_size: each position finds its own physical block.
        block = tl.load(block_tables_ptr + seq * stride_bt_seq + pos // block_size,
                        mask=pos_ok, other=0).to(tl.int64)
        kv_offs = (block * stride_c_block + (pos % block_size) * stride_c_pos
                   + kv_head * stride_c_head)
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(key_cache_ptr + kv_offs[:, None] + dims[None, :], mask=kv_mask,
                    other=0.0).to(DOT_DTYPE)  # [BLOCK_N, HEAD_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        s = tl.where(pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        # Online softmax. Position 0 is visible to every row, so m_new is finite from the first
        # tile on and no row ever computes exp2(-inf - -inf).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(value_cache_ptr + kv_offs[:, None] + dims[None, :], mask=kv_mask,
                    other=0.0).to(DOT_DTYPE)  # [BLOCK_N, HEAD_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_offs = (q_start + token)[:, None] * stride_o_tok + head[:, None] * stride_o_head
    tl.store(out_ptr + o_offs + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    # Triton's CPU interpreter computes on numpy arrays, and numpy has no bfloat16: bfloat16
    # arithmetic there gives garbage (seen with triton 3.9). Under the interpreter only, tiles
    # are upcast to float32 before the dots; loads, stores and the GPU path keep bfloat16.
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return _TL_DTYPES[dtype]


# Shared memory a program may take: what a block may have on the GPUs with the least of it
# (99 KiB on sm_86 and sm_89: A10, L4, RTX 30xx and 40xx), less room for Triton's own use.
SHARED_MEMORY_BUDGET = 96 * 1024


def paged_attention_tiles(max_query_len: int, group_pad: int, head_pad: int,
                          itemsize: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_N) for a batch: short query tiles for decodes, wide ones for prefills.

    A tile has ``BLOCK_Q x group_pad`` rows and ``tl.dot`` needs at least 16, so a decode tile
    whose GQA group is smaller than 16 carries masked rows (query tokens the sequence lacks).
    The dots' operands sit in shared memory (the query rows, a key and a value tile, the
    probabilities: ``itemsize`` bytes a value); where they would pass
    ``SHARED_MEMORY_BUDGET`` (float32 prompt chunks of heads of 128), the key tiles narrow.
    ``triton_targets`` compiles the kernel for each GPU and checks what it takes.
    """
    rows = 16 if max_query_len <= 1 else 64
    block_n = 64 if max_query_len > 1 else 32

    def shared(n: int) -> int:
        return (rows * head_pad + 2 * n * head_pad + rows * n) * itemsize

    while block_n > 16 and shared(block_n) > SHARED_MEMORY_BUDGET:
        block_n //= 2
    return max(1, rows // group_pad), block_n


def triton_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: TritonAttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Write this step's K/V into the cache, then attend; same contract as the torch reference."""
    triton_write_kv_cache(key, value, kv_cache, meta.slot_mapping)
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if query.dtype not in _TL_DTYPES or kv_cache.dtype != query.dtype:
        raise ValueError(f"query {query.dtype} and cache {kv_cache.dtype} must share one of "
                         "float16, bfloat16, float32")
    out = torch.zeros_like(query) if meta.padded else torch.empty_like(query)
    if meta.max_query_len == 0 or num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    # The tiles the GPU runs (the interpreter's float32 dots for bfloat16 aside).
    block_q, block_n = paged_attention_tiles(meta.max_query_len, group_pad, head_pad,
                                             query.element_size())
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    grid = (meta.num_seqs, triton.cdiv(meta.max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache,
        meta.block_tables, meta.query_start_loc, meta.seq_lens,
        scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), meta.block_tables.stride(0),
        block_size,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n,
        DOT_DTYPE=_dot_dtype(query.dtype),
        # float32 means "exact": keep Triton from rounding the dot inputs to TF32.
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out
