"""Linear layers on this CPU, on the shapes of a decode step and of a prompt chunk. float32:
torch's ``F.linear`` (MKL), oneDNN's prepacked matmul (``cpu_ops.OneDNNLinear``, the ``avx512``
path's) and mmserve's AVX2/FMA kernel (``cpu_ops.PackedLinearF32``, the ``avx2`` path's).
bfloat16 (``--dtype bfloat16``): torch's ``F.linear``, oneDNN's prepacked matmul and mmserve's
packed kernel (``cpu_ops.PackedLinear``, ``cpu_ops.bfloat16_linear``'s choice): its AVX512-BF16
vector tiles with each of their two multiplies ("mmserve dot": the pair dot product, "mmserve
FMA": float32 FMAs on widened inputs, which the kernel takes from 16 rows on where the core runs
them faster), and on CPUs with AMX its tile multiply beside them ("mmserve AMX"). What
``MMSERVE_CPU_KERNELS=auto`` picks on each CPU comes from these tables.

Each figure is one layer's time, averaged over enough different weights of that shape (at least
``--weights-mb`` in all, more than the L3 cache) that weights come from memory, as in a model.

    python benchmarks/cpu_linear.py
    python benchmarks/cpu_linear.py --rows 1,8,64 --threads 1
    python benchmarks/cpu_linear.py --dtype bfloat16

Not part of the test suite: the figures depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import time

import torch

from mmserve.kernels import cpu_ops

# (inputs, outputs) of the llava bench checkpoint's decoder: QKV, MLP up (gate and up), MLP down,
# attention output, LM head.
SHAPES = [(768, 1280), (768, 4096), (2048, 768), (768, 768), (768, 32000)]


def time_layers(layers, x: torch.Tensor, min_s: float) -> float:
    """Seconds per call, cycling through ``layers`` until at least ``min_s`` has passed."""
    for layer in layers:  # warm-up: first-touch of outputs, oneDNN's primitive cache
        layer(x)
    calls, start = 0, time.perf_counter()
    while True:
        for layer in layers:
            layer(x)
        calls += len(layers)
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / calls


class Switched:
    """``PackedLinear`` with the module's switches set for each call: AMX off (its vector tiles
    on a CPU with AMX), and the vector tiles' multiply, float32 FMAs or the pair dot product."""

    def __init__(self, module, linear: torch.nn.Linear, fma: bool) -> None:
        self.module, self.fma, self.layer = module, fma, cpu_ops.PackedLinear(linear)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        amx = self.module.set_packed_linear_amx(False)
        fma = self.module.set_bf16_fma(self.fma)
        try:
            return self.layer(x)
        finally:
            self.module.set_bf16_fma(fma)
            self.module.set_packed_linear_amx(amx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32,64,256,2048",
                        help="rows per call, comma-separated (a decode step has one per request)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--weights-mb", type=float, default=150.0)
    parser.add_argument("--min-seconds", type=float, default=0.5, help="per figure")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = sorted(cpu_ops.cpu_flags() & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"CPU flags: {' '.join(flags)}; {torch.get_num_threads()} threads; {args.dtype}")
    dtype = getattr(torch, args.dtype)
    size = dtype.itemsize
    if dtype == torch.float32:  # the AVX2 build: the kernel as the avx2 path runs it
        path, impls = "avx2", {"MKL": lambda lin: lin, "oneDNN": cpu_ops.OneDNNLinear,
                               "mmserve avx2": cpu_ops.PackedLinearF32}
    else:
        path, impls = "avx512", {"torch": lambda lin: lin, "oneDNN": cpu_ops.OneDNNLinear}
    with cpu_ops.using_path(path) as module:
        if dtype == torch.bfloat16 and module is not None and module.packed_linear_supported():
            if module.packed_linear_amx_supported():
                impls["mmserve AMX"] = cpu_ops.PackedLinear
            impls["mmserve dot"] = lambda lin: Switched(module, lin, fma=False)
            impls["mmserve FMA"] = lambda lin: Switched(module, lin, fma=True)
            print("the packed kernel's vector tiles multiply inputs of 16 rows or more with "
                  + ("float32 FMAs" if module.bf16_fma() else "the pair dot product")
                  + " on this CPU (mmserve dot / FMA: each forced)")
        print(f"{'K x N':>12} {'rows':>5} " + " ".join(f"{name:>14}" for name in impls)
              + "   fastest: weights read at, arithmetic")
        with torch.no_grad():
            for k, n in SHAPES:
                count = max(1, round(args.weights_mb * 2**20 / (k * n * size)))
                linears = [torch.nn.Linear(k, n, bias=False).to(dtype) for _ in range(count)]
                built = {name: [make(lin) for lin in linears] for name, make in impls.items()}
                for rows in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(rows, k, dtype=dtype)
                    times = {name: time_layers(layers, x, args.min_seconds)
                             for name, layers in built.items()}
                    best = min(times, key=times.get)
                    print(f"{f'{k} x {n}':>12} {rows:>5} "
                          + " ".join(f"{times[name] * 1e3:>11.3f} ms" for name in impls)
                          + f"   {best}: {k * n * size / times[best] / 1e9:.1f} GB/s, "
                          f"{2 * rows * k * n / times[best] / 1e9:.0f} GFLOP/s")
                del linears, built


if __name__ == "__main__":
    main()
