"""bfloat16 attention on this CPU: mmserve's flash attention kernel (AVX512-BF16,
``kernels/cpu_flash_attention.cpp``) against torch's fused attention
(``F.scaled_dot_product_attention``), on a vision tower's images (bidirectional) and on prompt
chunks (causal). The kernel's vector code multiplies with the pair dot product or with float32
FMAs on widened inputs (the same sums; it takes whichever this core runs faster): both are
shown. Where the CPU has AMX, torch's multiplies on its tiles, and so does the kernel's tile
path, shown beside its vector code; what ``cpu_ops.compiled_attention`` picks there comes
from this table.

    python benchmarks/cpu_attention.py
    python benchmarks/cpu_attention.py --heads 16 --head-dim 64 --threads 1

Not part of the test suite: the figures depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from mmserve.kernels import cpu_ops

# (batch, tokens) of a vision tower's attention: CLIP-B/16 images at 224 (197 patches), CLIP-L/14
# at 336 (577), a large dynamic-resolution image; then a prompt chunk's tokens (causal).
VISION = [(1, 197), (4, 197), (16, 197), (1, 577), (2, 1024)]
PROMPTS = [64, 277, 512, 1024, 2048]


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = sorted(cpu_ops.cpu_flags() & {"avx512f", "avx512_bf16", "amx_bf16"})
    print(f"CPU flags: {' '.join(flags)}; {torch.get_num_threads()} threads; bfloat16, "
          f"{args.heads} heads of {args.head_dim}")
    if "avx512_bf16" not in cpu_ops.cpu_flags():
        raise SystemExit("the flash attention kernel needs AVX512-BF16, which this CPU lacks")
    with cpu_ops.using_path("avx512") as module:
        if module is None or not module.flash_attention_supported(args.head_dim):
            raise SystemExit(f"the flash attention kernel needs AVX512-BF16 and did not build, "
                             f"or does not take heads of {args.head_dim}")
        scale = args.head_dim ** -0.5
        # Each path: (AMX tiles, float32 FMAs) forced, or None for the vector code's choice.
        vector = {"dot": (False, False), "FMA": (False, True)}
        if module.flash_attention_amx_supported():
            paths = {"AMX tiles": (True, None), **{f"vector {k}": v for k, v in vector.items()}}
        else:
            paths = {f"kernel {k}": v for k, v in vector.items()}
        print("the vector code multiplies with "
              + ("float32 FMAs" if module.bf16_fma() else "the pair dot product")
              + " on this CPU (dot / FMA: each forced)")
        print(f"{'shape':>22} " + " ".join(f"{p:>10}" for p in paths) + f" {'torch':>10}")
        with torch.inference_mode():
            cases = [(b, n, False) for b, n in VISION] + [(1, n, True) for n in PROMPTS]
            for batch, tokens, causal in cases:
                q, k, v = (torch.randn(batch, tokens, args.heads, args.head_dim,
                                       dtype=torch.bfloat16) for _ in range(3))
                offset = 0 if causal else -1  # the kernel's causal offset; -1: bidirectional
                kernel = []
                fma = module.bf16_fma()
                try:
                    for tiles, fma_forced in paths.values():
                        module.set_flash_attention_amx(tiles)
                        module.set_bf16_fma(fma if fma_forced is None else fma_forced)
                        kernel.append(median_ms(functools.partial(
                            module.flash_attention, q, k, v, scale, offset), args.repeats))
                finally:
                    module.set_flash_attention_amx(True)
                    module.set_bf16_fma(fma)
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                torch_ms = median_ms(functools.partial(F.scaled_dot_product_attention, qt, kt,
                                                       vt, scale=scale, is_causal=causal),
                                     args.repeats)
                name = f"prompt {tokens}" if causal else f"vision {batch} x {tokens}"
                print(f"{name:>22} " + " ".join(f"{ms:>7.2f} ms" for ms in kernel)
                      + f" {torch_ms:>7.2f} ms")


if __name__ == "__main__":
    main()
