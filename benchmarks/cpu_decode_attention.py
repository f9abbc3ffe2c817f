"""The CPU decode attention kernel (``kernels/cpu_decode_attention.cpp``) on its own: one
query token per sequence against its paged K/V, as a decode step calls it once per layer.

Each figure is the time of one call per layer over ``--layers`` layers, each with a KV cache of
its own (on huge pages, as the CPU runner allocates it), so that the rows come from memory as
in a model rather than from the cache the layer before left warm; the median of ``--rounds``.
"Shuffled" scatters each sequence's blocks over a cache twice the size needed, as a server's
blocks are after a while; "in order" is a fresh server's. GB/s counts the K and V bytes read.

    python benchmarks/cpu_decode_attention.py
    python benchmarks/cpu_decode_attention.py --dtype float32 --threads 1

Not part of the test suite: the figures depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mmserve.kernels import cpu_ops
from mmserve.worker.cpu_allocator import advise_huge_pages

# (sequences, tokens each, blocks shuffled): a decode step of 16 and of 64 requests, long
# contexts, a single long sequence, and a batch small enough to stay in cache.
CASES = [(16, 310, False), (16, 310, True), (64, 310, True), (16, 1500, False), (1, 2000, True),
         (4, 100, True)]


def caches(layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
           dtype: torch.dtype) -> list[torch.Tensor]:
    """One [2, blocks, block_size, kv_heads, head_dim] cache per layer, on huge pages."""
    out = []
    for _ in range(layers):
        cache = torch.empty(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
        advise_huge_pages(cache)  # before the first touch
        out.append(cache.normal_())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--threads", type=int, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = cpu_ops.load()
    if kernel is None:
        raise SystemExit("the CPU kernels are not loaded: MMSERVE_CPU_KERNELS=0 chose torch's "
                         "operators, or they did not build here (see the log above)")
    dtype = getattr(torch, args.dtype)
    bs, element = args.block_size, dtype.itemsize
    print(f"{args.dtype}, {args.heads} heads over {args.kv_heads} KV heads of {args.head_dim}, "
          f"blocks of {bs}, {args.layers} layers, {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    for seqs, tokens, shuffled in CASES:
        needed = seqs * -(-tokens // bs)
        num_blocks = 2 * needed if shuffled else needed
        layers = caches(args.layers, num_blocks, bs, args.kv_heads, args.head_dim, dtype)
        order = torch.randperm(num_blocks)[:needed] if shuffled else torch.arange(needed)
        tables = order.view(seqs, -1).contiguous()
        lens = torch.full((seqs,), tokens, dtype=torch.long)
        query = torch.randn(seqs, args.heads, args.head_dim, dtype=dtype)
        scale = args.head_dim ** -0.5

        times = []
        for _ in range(args.rounds + 1):  # the first round warms up
            start = time.perf_counter()
            for cache in layers:
                kernel.decode_attention(query, cache[0], cache[1], tables, lens, scale)
            times.append(time.perf_counter() - start)
        times = times[1:]
        median = statistics.median(times)
        read = args.layers * seqs * tokens * args.kv_heads * args.head_dim * 2 * element
        print(f"{seqs:3d} x {tokens:5d} {'shuffled' if shuffled else 'in order':>8}: "
              f"{median * 1e3:7.2f} ms for {args.layers} layers, {read / median / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
