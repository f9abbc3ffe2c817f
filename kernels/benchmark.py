"""Triton paged attention against torch on the same shapes: ``python -m mmserve.kernels.benchmark``.

For each batch it times three ways to compute the same attention on a GPU:
- ``triton``: the Triton KV write + paged attention (``triton_attention.py``);
- ``torch paged``: the torch reference (``paged_attention.py``), which gathers each sequence's
  context out of the paged cache and calls scaled-dot-product attention;
- ``sdpa dense``: scaled-dot-product attention on K/V already laid out contiguously per sequence,
  with no cache at all: a lower bound that no paged kernel has to beat.
Needs CUDA; prints one table row per batch with times in microseconds.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from mmserve.kernels.paged_attention import build_attention_metadata, paged_attention

# (name, query tokens per sequence, context length per sequence, number of sequences)
BATCHES = [
    ("decode", 1, 1024, 1), ("decode", 1, 1024, 16), ("decode", 1, 1024, 64),
    ("decode", 1, 1024, 256), ("decode", 1, 4096, 32),
    ("prefill", 2048, 2048, 1), ("prefill", 512, 512, 4),
    ("chunk", 512, 2048, 2),
]


def bench_batch(q_len: int, ctx: int, num_seqs: int, num_heads: int, num_kv_heads: int,
                head_dim: int, dtype: torch.dtype, block_size: int = 16,
                device: str = "cuda") -> dict[str, float]:
    """Microseconds per call of each implementation for one batch shape, and the largest
    difference between the Triton and torch outputs."""
    from triton.testing import do_bench

    from mmserve.kernels.triton_attention import TritonAttentionMetadata, triton_paged_attention

    dev = torch.device(device)
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    # Shuffled blocks, as a long-running server's cache would hand them out.
    tables = torch.randperm(num_blocks - 1, device=dev)[:num_seqs * blocks_per_seq].view(
        num_seqs, blocks_per_seq).int()
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                        device=dev)
    tokens = num_seqs * q_len
    q = torch.randn(tokens, num_heads, head_dim, dtype=dtype, device=dev)
    k = torch.randn(tokens, num_kv_heads, head_dim, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    scale = head_dim ** -0.5
    meta = TritonAttentionMetadata.build([q_len] * num_seqs, [ctx] * num_seqs,
                                         tables.tolist(), block_size, dev)
    ref_meta = build_attention_metadata([q_len] * num_seqs, [ctx] * num_seqs, tables.tolist(),
                                        block_size, dev)
    # Dense K/V per sequence: [num_seqs, heads, ctx, head_dim].
    dense_q = q.view(num_seqs, q_len, num_heads, head_dim).transpose(1, 2)
    dense_k = torch.randn(num_seqs, num_kv_heads, ctx, head_dim, dtype=dtype, device=dev)
    dense_v = torch.randn_like(dense_k)
    causal = q_len == ctx
    out = triton_paged_attention(q, k, v, cache.clone(), meta, scale)
    ref = paged_attention(q, k, v, cache.clone(), ref_meta, scale)
    max_diff = (out.float() - ref.float()).abs().max().item()
    times = {
        "triton": do_bench(lambda: triton_paged_attention(q, k, v, cache, meta, scale)),
        "torch paged": do_bench(lambda: paged_attention(q, k, v, cache, ref_meta, scale)),
        "sdpa dense": do_bench(lambda: F.scaled_dot_product_attention(
            dense_q, dense_k, dense_v, is_causal=causal, scale=scale,
            enable_gqa=num_heads != num_kv_heads)),
    }
    return {**{name: ms * 1000 for name, ms in times.items()}, "max diff": max_diff}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the kernel benchmark needs a CUDA device; torch sees none")
        return 1
    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}, {args.num_heads} query heads, {args.num_kv_heads} KV "
          f"heads, head_dim {args.head_dim}, {args.dtype}; microseconds per call")
    print(f"{'batch':<8}{'q/seq':>7}{'ctx':>7}{'seqs':>6}{'triton':>10}{'torch paged':>13}"
          f"{'sdpa dense':>12}{'max diff':>10}")
    for name, q_len, ctx, num_seqs in BATCHES:
        t = bench_batch(q_len, ctx, num_seqs, args.num_heads, args.num_kv_heads, args.head_dim,
                        dtype)
        print(f"{name:<8}{q_len:>7}{ctx:>7}{num_seqs:>6}{t['triton']:>10.1f}"
              f"{t['torch paged']:>13.1f}{t['sdpa dense']:>12.1f}{t['max diff']:>10.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
