"""The fused elementwise kernels (``kernels/cpu_elementwise.cpp``) on this CPU, in bfloat16, at
the shapes of the LLaVA bench checkpoint's prompt steps: torch's ops, the kernels as the avx2
path builds them (plain loops the compiler vectorizes), and as the avx512 path does (the
16-lane loops where the CPU has AVX512-BF16). ms a call, the median of the repeats.

    python benchmarks/cpu_elementwise.py
    python benchmarks/cpu_elementwise.py --rows 16 --threads 1

Not part of the test suite: the figures depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from cpu_attention import median_ms  # this folder is on the path when a script here runs

from mmserve.kernels import cpu_ops, elementwise
from mmserve.worker.cpu_allocator import keep_freed_memory

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VISION_MLP = 768, 12, 4, 64, 2048, 3072


def cases(rows: int) -> list[tuple[str, object, object]]:
    """(name, torch's ops, the kernel's call given the module) at ``rows`` tokens."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 2).bfloat16()

    x, residual, weight = rand(rows, HIDDEN), rand(rows, HIDDEN), rand(HIDDEN)
    qkv = rand(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q = qkv[:, :HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)  # a strided view, as in a layer
    cos, sin = rand(rows, 1, HEAD_DIM), rand(rows, 1, HEAD_DIM)
    gate_up = rand(rows, 2 * INTERMEDIATE)
    gate, up = gate_up[:, :INTERMEDIATE], gate_up[:, INTERMEDIATE:]
    fc1 = rand(rows, VISION_MLP)
    norm = torch.nn.LayerNorm(HIDDEN).bfloat16()
    return [
        (f"rms_norm {rows} x {HIDDEN}",
         lambda: elementwise.rms_norm(x, weight, 1e-5),
         lambda m: m.rms_norm(x, weight, 1e-5)),
        (f"add_rms_norm {rows} x {HIDDEN}",
         lambda: elementwise.rms_norm(residual.clone().add_(x), weight, 1e-5),
         lambda m: m.add_rms_norm(x, residual.clone(), weight, 1e-5)),
        (f"rotary {rows} x {HEADS} x {HEAD_DIM}",
         lambda: elementwise.rotary(q, cos, sin),
         lambda m: m.rotary(q, cos, sin)),
        (f"silu_and_mul {rows} x {INTERMEDIATE}",
         lambda: F.silu(gate) * up,
         lambda m: m.silu_and_mul(gate, up)),
        (f"quick_gelu {rows} x {VISION_MLP}",
         lambda: fc1 * torch.sigmoid(1.702 * fc1),
         lambda m: m.quick_gelu(fc1)),
        (f"add_layer_norm {rows} x {HIDDEN}",
         lambda: norm(residual + x),
         lambda m: m.add_layer_norm(x, residual, norm.weight, norm.bias, 1e-5)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2048, help="tokens (default: 2048)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the engine runs: no page faults on each call's new output
    flags = sorted(cpu_ops.cpu_flags() & {"avx2", "avx512f", "avx512_bf16"})
    print(f"CPU flags: {' '.join(flags)}; {torch.get_num_threads()} threads; bfloat16, ms a call")
    paths = [p for p in ("avx2", "avx512") if p in cpu_ops.supported_paths()]
    modules = {}
    for path in paths:
        with cpu_ops.using_path(path) as module:
            if module is not None:
                modules[path] = module
    names = {"avx2": "avx2 path", "avx512": "avx512 path"}
    header = f"{'':32s} {'torch':>9s}" + "".join(f" {names[p]:>12s}" for p in modules)
    print(header)
    with torch.inference_mode():
        for name, torch_ops, kernel in cases(args.rows):
            line = f"{name:32s} {median_ms(torch_ops, args.repeats):9.3f}"
            for module in modules.values():
                line += f" {median_ms(functools.partial(kernel, module), args.repeats):12.3f}"
            print(line)


if __name__ == "__main__":
    main()
