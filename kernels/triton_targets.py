"""The Triton kernels compiled for NVIDIA GPUs, on a machine that has none.

The suite runs the Triton kernels in Triton's CPU interpreter, which checks what they compute
but not that a GPU can run them: a construct the GPU compiler rejects, or a tile that needs
more shared memory than the GPU has (which Triton reports only when it launches the kernel),
shows up first on a GPU. Triton compiles for a named architecture without one (it ships
``ptxas``), so this module calls each kernel's wrapper with the shapes of the model families
mmserve serves, in each dtype, records the launches instead of running them, and compiles
every distinct launch for each architecture asked. It reports each kernel's shared memory
against the architecture's limit, its registers and spilled bytes (``cuobjdump`` reads them off
the compiled binary), and its fused multiply-adds in float32, which the kernels that round as
torch's separate ops do must not have.

    python -m mmserve.kernels.triton_targets                     # sm_80, 86, 89, 90
    python -m mmserve.kernels.triton_targets --arch 90 --dtype bfloat16

Run it without ``TRITON_INTERPRET=1``: Triton reads that once, when it is imported, and an
interpreted kernel cannot be compiled. The exit status is 1 when a launch fails to compile or
needs more shared memory than its architecture has.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

# The largest shared memory a block may have on each architecture (the opt-in limit, which is
# what Triton compares a kernel's with), and GPUs that have it.
ARCHS: dict[int, tuple[int, str]] = {
    80: (166_912, "A100, A30"),
    86: (101_376, "A10, A40, RTX 30xx"),
    89: (101_376, "L4, L40, RTX 40xx"),
    90: (232_448, "H100, H200"),
}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a model family that choose its kernels' variants."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vision_hidden: int  # the vision tower's norms
    vision_heads: int
    vision_head_dim: int  # rotary in the tower (Qwen2-VL's), else 0
    vision_intermediate: int  # a gated SiLU MLP in the tower (Qwen2.5-VL's), else 0


# LLaVA-1.5 7B and 13B (CLIP ViT-L/14: quick GELU, attention through torch), the 1.4B bench
# checkpoint, LLaVA-1.6 on Mistral-7B, Qwen2-VL 2B and 7B (a tower of quick GELU and rotary
# heads of 80), Qwen2.5-VL 3B and 7B (the tower's MLP a gated SiLU, its norms RMSNorms).
MODELS = (
    ModelShape("llava-1.5-7b", 4096, 32, 32, 128, 11008, 1024, 16, 0, 0),
    ModelShape("llava-1.5-13b", 5120, 40, 40, 128, 13824, 1024, 16, 0, 0),
    ModelShape("llava-bench-1.4b", 2048, 32, 4, 64, 5632, 1024, 16, 0, 0),
    ModelShape("llava-1.6-mistral-7b", 4096, 32, 8, 128, 14336, 1024, 16, 0, 0),
    ModelShape("qwen2-vl-2b", 1536, 12, 2, 128, 8960, 1280, 16, 80, 0),
    ModelShape("qwen2-vl-7b", 3584, 28, 4, 128, 18944, 1280, 16, 80, 0),
    ModelShape("qwen2.5-vl-3b", 2048, 16, 2, 128, 11008, 1280, 16, 80, 3420),
    ModelShape("qwen2.5-vl-7b", 3584, 28, 4, 128, 18944, 1280, 16, 80, 3420),
)

# Triton's argument types by torch dtype.
_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64"}
_DIVISIBLE = [["tt.divisibility", 16]]


@dataclass
class Launch:
    """One kernel launch as Triton would compile it: its argument types, constants, the
    arguments it specializes on (16-divisible pointers and integers) and compile options."""

    kernel: object  # a triton JITFunction
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], object]
    attrs: dict[tuple[int, ...], list] = field(default_factory=dict)
    options: dict[str, object] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.kernel.__name__.strip("_").removesuffix("_kernel")

    def key(self) -> tuple:
        return (self.name, tuple(self.signature.items()), repr(sorted(self.constexprs.items())),
                repr(sorted(self.attrs.items())), tuple(sorted(self.options.items())))

    def describe(self) -> str:
        """Its dtype and constants, e.g. ``bf16 HEAD_DIM=128 BLOCK_Q=4``."""
        names = self.kernel.arg_names
        floats = [t[1:] for t in self.signature.values() if t in ("*fp16", "*bf16", "*fp32")]
        consts = " ".join(f"{names[path[0]]}={str(value).removeprefix('triton.language.')}"
                          for path, value in self.constexprs.items())
        return f"{floats[0] if floats else '-'} {consts}".strip()


def _launch(kernel, args: tuple, kwargs: dict) -> Launch:
    """What Triton's launcher would compile for ``kernel(*args, **kwargs)`` (its rules: a
    pointer or an integer divisible by 16 is marked so, an integer 1 becomes a constant)."""
    names = kernel.arg_names
    bound = dict(zip(names, args, strict=False))
    options = {}
    for key, value in kwargs.items():
        (bound if key in names else options)[key] = value
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], object] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, param in enumerate(kernel.params):
        value = bound[param.name]
        if param.is_constexpr or (type(value) is int and value == 1):
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = _DIVISIBLE
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and i not in kernel.do_not_specialize:
                attrs[(i,)] = _DIVISIBLE
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: no Triton type for {param.name}={value!r}")
    return Launch(kernel, signature, constexprs, attrs, options)


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](...)`` records the launch and runs nothing."""

    def __init__(self, kernel, launches: list[Launch]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launches.append(_launch(self.kernel, args, kwargs))


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """While open, the Triton kernels' wrappers record their launches in the list it gives."""
    from mmserve.kernels import triton_attention, triton_fused, triton_kv_cache

    launches: list[Launch] = []
    patched = [(module, name, getattr(module, name))
               for module in (triton_attention, triton_fused, triton_kv_cache)
               for name in vars(module) if name.endswith("_kernel") and name.startswith("_")]
    try:
        for module, name, kernel in patched:
            setattr(module, name, _Recorder(kernel, launches))
        yield launches
    finally:
        for module, name, kernel in patched:
            setattr(module, name, kernel)


def model_launches(models: tuple[ModelShape, ...], dtypes: list[torch.dtype]) -> list[Launch]:
    """Every distinct launch the models' forward passes make on a GPU, in the order found:
    each wrapper called on host tensors of the models' dimensions (the token counts do not
    choose a variant; a decode step and a prompt chunk do)."""
    from mmserve.kernels import triton_fused
    from mmserve.kernels.triton_attention import TritonAttentionMetadata, triton_paged_attention

    block_size, blocks = 16, 8
    with recording() as launches:
        for model in models:
            for dtype in dtypes:
                def empty(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
                    return torch.zeros(*shape, dtype=dtype)

                for hidden in (model.hidden, model.vision_hidden):
                    triton_fused.rms_norm(empty(2, hidden), empty(hidden), 1e-6)
                    triton_fused.add_rms_norm(empty(2, hidden), empty(2, hidden), empty(hidden),
                                              1e-6)
                for heads, dim in ((model.heads, model.head_dim),
                                   (model.kv_heads, model.head_dim),
                                   (model.vision_heads, model.vision_head_dim)):
                    if dim:
                        triton_fused.rotary(empty(2, heads, dim), empty(2, 1, dim),
                                            empty(2, 1, dim))
                for width in (model.intermediate, model.vision_intermediate):
                    if width:
                        merged = empty(2, 2 * width)
                        triton_fused.silu_and_mul(merged[:, :width], merged[:, width:])
                triton_fused.quick_gelu(empty(2, 64))  # one variant a dtype, any size
                cache = empty(2, blocks, block_size, model.kv_heads, model.head_dim)
                for query_len in (1, 24):  # a decode step, a prompt chunk
                    seqs = 2  # of 50 tokens, in 4 blocks each
                    meta = TritonAttentionMetadata.build(
                        [query_len] * seqs, [50] * seqs, [[0, 1, 2, 3]] * seqs, block_size)
                    q = empty(seqs * query_len, model.heads, model.head_dim)
                    kv = empty(seqs * query_len, model.kv_heads, model.head_dim)
                    triton_paged_attention(q, kv, kv, cache, meta, model.head_dim ** -0.5)
    unique: dict[tuple, Launch] = {}
    for launch in launches:
        unique.setdefault(launch.key(), launch)
    return list(unique.values())


@dataclass
class Compiled:
    launch: Launch
    arch: int
    seconds: float
    shared: int = 0
    registers: int | None = None
    spilled: int | None = None  # bytes of local memory a thread uses: spilled registers
    fma: int = 0  # fused multiply-adds in the PTX
    error: str | None = None

    @property
    def fits(self) -> bool:
        return self.error is None and self.shared <= ARCHS[self.arch][0]


def compile_launch(launch: Launch, arch: int) -> Compiled:
    """Compile ``launch`` for ``sm_<arch>``; a compile error is kept in ``error``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    try:
        kernel = triton.compile(
            ASTSource(launch.kernel, launch.signature, launch.constexprs, launch.attrs),
            target=GPUTarget("cuda", arch, 32), options=launch.options)
    except Exception as e:  # what the GPU compiler rejects: reported, not raised
        message = str(e).strip().splitlines()
        return Compiled(launch, arch, time.perf_counter() - start,
                        error=f"{type(e).__name__}: {message[-1] if message else ''}")
    done = Compiled(launch, arch, time.perf_counter() - start, shared=kernel.metadata.shared)
    ptx = kernel.asm.get("ptx", "")
    done.fma = len(re.findall(r"\bfma\.rn(?:\.ftz)?\.f32\b", ptx))
    done.registers, done.spilled = _resource_usage(kernel.asm["cubin"])
    return done


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, local bytes) of the binary's one function, read by the ``cuobjdump`` that
    Triton ships; (None, None) where it is missing or says something else."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not os.access(tool, os.X_OK):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, timeout=60).stdout
    regs, local = re.search(r"REG:(\d+)", out), re.search(r"LOCAL:(\d+)", out)
    return (int(regs.group(1)) if regs else None, int(local.group(1)) if local else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default=",".join(map(str, ARCHS)),
                        help=f"compute capabilities x 10, comma-separated (of {list(ARCHS)})")
    parser.add_argument("--dtype", default=",".join(DTYPES),
                        help="comma-separated, of " + ", ".join(DTYPES))
    parser.add_argument("--models", help="comma-separated names (default: every family): "
                        + ", ".join(m.name for m in MODELS))
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("TRITON_INTERPRET is set: Triton then interprets the kernels and cannot "
                     "compile them; run this without it")
    archs = [int(a) for a in args.arch.split(",")]
    if unknown := [a for a in archs if a not in ARCHS]:
        parser.error(f"--arch {unknown}: this knows the limits of {list(ARCHS)} only")
    dtypes = [DTYPES[d] for d in args.dtype.split(",")]
    models = MODELS if not args.models else tuple(
        m for m in MODELS if m.name in args.models.split(","))
    launches = model_launches(models, dtypes)
    print(f"{len(launches)} distinct launches of {len({lc.name for lc in launches})} kernels "
          f"({len(models)} model families, {args.dtype}), compiled for "
          + ", ".join(f"sm_{a} ({ARCHS[a][1]})" for a in archs))
    print(f"{'arch':>5}  {'kernel':<16} {'variant':<62} {'shared B':>9} {'regs':>5} "
          f"{'spill B':>7} {'fma':>4} {'s':>5}")
    failed = 0
    for arch in archs:
        for launch in launches:
            done = compile_launch(launch, arch)
            verdict = ("" if done.fits else f"  FAILS: {done.error}" if done.error
                       else f"  FAILS: over sm_{arch}'s {ARCHS[arch][0]:,} B")
            failed += not done.fits
            print(f"sm_{arch}  {launch.name:<16} {launch.describe():<62} {done.shared:>9,} "
                  f"{done.registers if done.registers is not None else '?':>5} "
                  f"{done.spilled if done.spilled is not None else '?':>7} {done.fma:>4} "
                  f"{done.seconds:>5.1f}{verdict}", flush=True)
    print(f"{failed} of {len(launches) * len(archs)} failed" if failed else "all compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
