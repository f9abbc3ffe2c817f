"""Compiled CPU kernels, built on first use with the machine's C++ compiler.

``decode_attention`` (``cpu_decode_attention.cpp``) reads each sequence's keys and values in
place from its KV blocks. The torch reference in ``paged_attention.py`` must first gather the
blocks into contiguous tensors and copy each head's keys again for ``bmm``: three to four times
the memory traffic of the one pass over K and one over V that decode attention needs.

``flash_attention`` (``cpu_flash_attention.cpp``) serves prompt chunks and the vision tower in
bfloat16 on CPUs with AVX512-BF16, whose instruction multiplies bfloat16 pairs into float32
sums. For short sequences (a 238-token prompt, a 197-patch image) torch's fused CPU attention
spends more time in its blocking than in arithmetic; the kernel is 2-4x faster there.
``flash_attention_f32`` (``cpu_attention_f32.cpp``, from the linear layers' register tile)
serves float32 prompt chunks on CPUs with AVX2 and FMA, 1.2-2x torch's; for a vision tower's
bidirectional attention torch's stays faster in float32. Other dtypes, head sizes and CPUs
keep torch's attention.

``rms_norm``, ``rotary``, ``silu_and_mul`` and ``quick_gelu`` (``cpu_elementwise.cpp``) do in
one pass over bfloat16 or float32 activations what torch does in three to six, rounding where
torch's ops round. The models call them through ``fused_kernels``; other devices keep torch's
ops.

``PackedLinear`` (``cpu_linear.cpp``) replaces a bfloat16 ``nn.Linear`` once its weights are
loaded, with the weight repacked into the panels of the pair dot-product instruction. On decode
steps, where a few dozen rows meet every weight once, it reaches about 1.5 times torch's
bfloat16 matmul, which reads the [out, in] layout. ``PackedLinearF32`` (``cpu_linear_f32.cpp``)
does the same for float32 on CPUs with AVX2 and FMA but without AVX-512, about twice MKL's speed
on decode steps; ``OneDNNLinear`` (oneDNN's prepacked matmul, through torch) serves float32 on
the others. The CPU is known when the module builds (``-march=native``, one build per CPU
model and flags), so each function is compiled for the instructions it has, and
``float32_linear`` / ``_flash_kernel`` choose among them.

Building takes about 50 s on two cores the first time; torch caches the library (under
``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) for later starts. Without
a compiler, or with ``MMSERVE_CPU_KERNELS=0``, ``load()`` returns None and the CPU runner uses
the torch reference, with one warning saying why.

Builds are serialized by an OS lock (``flock``) on ``<build directory>.mmserve-lock``, which
the kernel releases when its holder exits, however it exits. A start killed mid-build leaves
torch's own ``lock`` file in the build directory, on which torch's builder would wait forever;
the next start, holding the OS lock, knows no other start is building and removes it. A start
waits at most ``MMSERVE_CPU_KERNELS_BUILD_TIMEOUT`` seconds (default 600) for another
process's build, then uses the torch reference, with a warning naming the lock.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import itertools
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.kernels.paged_attention import PrefillSeq, paged_attention
from mmserve.kernels.paged_attention import prefill_attention as torch_prefill_attention

logger = logging.getLogger(__name__)

DISABLE_ENV = "MMSERVE_CPU_KERNELS"
BUILD_TIMEOUT_ENV = "MMSERVE_CPU_KERNELS_BUILD_TIMEOUT"
# Ten times a two-core build: a start waits out any real build, but not a hung one.
DEFAULT_BUILD_TIMEOUT_S = 600.0
_SOURCES = [Path(__file__).with_name(name) for name in
            ("cpu_ops.cpp", "cpu_decode_attention.cpp", "cpu_flash_attention.cpp",
             "cpu_elementwise.cpp", "cpu_linear.cpp", "cpu_linear_f32.cpp",
             "cpu_attention_f32.cpp")]
_HEADERS = [Path(__file__).with_name(name) for name in ("cpu_math.h", "cpu_tile_f32.h")]
_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None


def _cpu_signature() -> str:
    """A short hash of this CPU's model and instruction-set flags. The build uses
    ``-march=native``, so machines that share a home directory (and torch's extension cache)
    but differ in CPU each get their own build instead of one that may not run."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor(), platform.machine()]
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:10]


T = TypeVar("T")


class BuildLockTimeout(RuntimeError):
    """Another process held the build lock longer than this start would wait."""


def build_lock_path(build_dir: Path) -> Path:
    """mmserve's OS lock for ``build_dir``: beside it, not in it, so that clearing the build
    directory never removes a lock file someone holds."""
    return build_dir.with_name(build_dir.name + ".mmserve-lock")


def build_locked(build_dir: Path, build: Callable[[], T], timeout_s: float,
                 poll_s: float = 0.1) -> T:
    """``build()``, run while holding mmserve's lock on ``build_dir``; raises
    ``BuildLockTimeout`` if another process holds it for more than ``timeout_s``.

    The lock is an ``flock``, which the kernel drops when its holder exits, so a killed build
    never blocks later starts. Holding it, no other mmserve process is building: a torch
    ``lock`` file in ``build_dir`` is left by a killed build, and is removed, since torch's
    builder would otherwise wait on it forever."""
    lock_path = build_lock_path(build_dir)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    # os.open descriptors are not inherited across exec, so the compilers that torch's builder
    # starts do not hold the lock after this process is gone.
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:  # closing the descriptor releases the lock, whether build() returns or raises
        _acquire(fd, lock_path, timeout_s, poll_s)
        # The holder's pid, only for the message of a start that gives up waiting.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        torch_lock = build_dir / "lock"
        if torch_lock.exists():
            torch_lock.unlink(missing_ok=True)
            logger.info("Removed %s, left by a CPU kernel build that was interrupted.",
                        torch_lock)
        return build()
    finally:
        os.close(fd)


def _acquire(fd: int, lock_path: Path, timeout_s: float, poll_s: float) -> None:
    """Take the flock on ``fd``, polling rather than blocking so the wait has a bound."""
    start = time.monotonic()
    announced = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise BuildLockTimeout(
                f"another process{_lock_holder(lock_path)} has been building the CPU kernels "
                f"for {waited:.0f} s and holds {lock_path}; restart once it has finished (or "
                f"stop it if it is stuck), or wait longer with {BUILD_TIMEOUT_ENV} "
                f"(now {timeout_s:g} s)")
        if not announced:
            logger.info("Waiting up to %g s for another process%s that is building the CPU "
                        "kernels (lock %s).", timeout_s, _lock_holder(lock_path), lock_path)
            announced = True
        time.sleep(min(poll_s, timeout_s - waited))


def _lock_holder(lock_path: Path) -> str:
    """`` (pid N)`` as written by the lock's holder, or nothing if it cannot be read."""
    try:
        pid = lock_path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""


def _build_timeout_s() -> float:
    raw = os.environ.get(BUILD_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_BUILD_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also rejects nan
        raise ValueError(f"{BUILD_TIMEOUT_ENV}={raw!r}: expected seconds, a number >= 0")
    return value


def _build_directory(name: str) -> Path:
    """Where torch builds and caches extension ``name``. torch's own (private) rule, so the
    cache stays where earlier versions built it; ``_build_extension`` passes the directory
    back explicitly, so the lock and the build agree on it whatever torch's rule becomes."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def _build_extension(name: str, build_dir: Path) -> ModuleType:
    """torch's builder: compiles what is out of date (all of it, the first time), loads it."""
    from torch.utils.cpp_extension import load as load_extension

    # Only chooses the message; ninja decides what to rebuild (flag changes included).
    library = build_dir / f"{name}.so"
    newest_source = max(p.stat().st_mtime for p in _SOURCES + _HEADERS)
    if not library.exists() or library.stat().st_mtime < newest_source:
        logger.info("Building the CPU kernels, about a minute the first time (cached in %s).",
                    build_dir)
    return load_extension(
        name=name,
        sources=[str(p) for p in _SOURCES],
        # Reassociated float math (vectorized dot products and sums) but IEEE
        # inf/NaN handling; compile flags only, so the process's FP mode is untouched.
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno",
                      "-funsafe-math-optimizations"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )


def load() -> ModuleType | None:
    """The compiled module, building it if needed; None when it cannot be had."""
    global _module, _failure
    with _lock:
        if _module is not None or _failure is not None:
            return _module
        if os.environ.get(DISABLE_ENV, "1") == "0":
            _failure = f"{DISABLE_ENV}=0"
            return None
        try:
            name = f"mmserve_cpu_ops_{_cpu_signature()}"
            build_dir = _build_directory(name)
            _module = build_locked(build_dir, lambda: _build_extension(name, build_dir),
                                   _build_timeout_s())
        except Exception as e:  # no compiler, no ninja, a build error: fall back, say why
            _failure = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''}"
            logger.warning("CPU attention kernels unavailable (%s); using the torch reference "
                           "(slower attention). Set %s=0 to skip the build.", _failure,
                           DISABLE_ENV)
        return _module


def unavailable_reason() -> str | None:
    """Why ``load()`` returned None, once it has been called."""
    return _failure


def decode_attention(query, kv_cache, meta, scale: float):
    """``paged_attention``'s decode path (same arguments and result as the torch
    ``decode_attention``), with keys and values read in place by the compiled kernel."""
    if _module is None:  # per layer and step: no lock, the backend only exists after load()
        raise RuntimeError("the compiled CPU decode attention is not loaded; call load() first")
    return _module.decode_attention(query.contiguous(), kv_cache[0], kv_cache[1],
                                    meta.decode_block_tables, meta.decode_lens, scale)


def bf16_kernels(tensor: torch.Tensor) -> ModuleType | None:
    """The compiled module if the CPU runner has loaded it and ``tensor`` is a bfloat16 CPU
    tensor, the dtype its flash attention and fused layers serve; None means: use torch."""
    if _module is not None and tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu":
        return _module
    return None


def fused_kernels(tensor: torch.Tensor) -> ModuleType | None:
    """The compiled module if the CPU runner has loaded it and ``tensor`` is a bfloat16 or
    float32 CPU tensor, the dtypes of its fused norm, rotary and activations; None means: use
    torch."""
    if (_module is not None and tensor.dtype in (torch.bfloat16, torch.float32)
            and tensor.device.type == "cpu"):
        return _module
    return None


def _flash_kernel(tensor: torch.Tensor, causal: bool) -> Callable | None:
    """The loaded module's flash attention for this query (dtype, head size, CPU): the
    bfloat16 one on AVX512-BF16; the float32 one on AVX2 with FMA for prompt chunks (causal)
    only, since for a vision tower's bidirectional attention torch's is faster in float32
    (``benchmarks/README.md``); None means torch's."""
    if _module is None or tensor.device.type != "cpu":
        return None
    if tensor.dtype == torch.bfloat16 and _flash_head_dim(tensor.shape[-1]):
        return _module.flash_attention
    if causal and tensor.dtype == torch.float32 and _flash_f32_head_dim(tensor.shape[-1]):
        return _module.flash_attention_f32
    return None


@functools.cache
def _flash_head_dim(head_dim: int) -> bool:
    return _module.flash_attention_supported(head_dim)


@functools.cache
def _flash_f32_head_dim(head_dim: int) -> bool:
    return _module.flash_attention_f32_supported(head_dim)


def prefill_attention(query, key, value, seq: PrefillSeq, scale: float):
    """``paged_attention``'s prompt-chunk path (same arguments and result as the torch
    ``prefill_attention``), with the compiled flash attention where it applies."""
    flash = _flash_kernel(query, causal=True)
    if flash is None:
        return torch_prefill_attention(query, key, value, seq, scale)
    causal_offset = seq.context_len - seq.query_len
    return flash(query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), scale,
                 causal_offset)[0]


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Bidirectional attention of a vision tower: ``[batch, tokens, heads, head_dim]`` in and
    out, any strides. The compiled flash attention once the CPU runner has loaded it (bfloat16
    on AVX512-BF16), torch's fused attention otherwise (other devices, dtypes, CPUs)."""
    flash = _flash_kernel(query, causal=False)
    if flash is not None:
        if key.stride() != value.stride():  # the kernel packs k and v with one set of strides
            key, value = key.contiguous(), value.contiguous()
        return flash(query, key, value, scale, -1)
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2),
                                         value.transpose(1, 2), scale=scale)
    return out.transpose(1, 2)


def packed_encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             boundaries: list[int], scale: float) -> torch.Tensor:
    """Bidirectional attention within each segment of a packed sequence: ``[tokens, heads,
    head_dim]`` in and out, segment ``i`` being rows ``boundaries[i]:boundaries[i + 1]`` (images
    of different sizes, or the windows of one). Never padded: segments of one length run as
    one batch of ``encoder_attention``, so many equal windows cost one call."""
    by_length: dict[int, list[int]] = {}
    for start, end in itertools.pairwise(boundaries):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    if len(by_length) == 1:
        (length, starts), = by_length.items()
        if len(starts) * length == query.shape[0]:  # equal segments tile the whole sequence
            shape = (len(starts), length, *query.shape[1:])
            out = encoder_attention(query.reshape(shape), key.reshape(shape),
                                    value.reshape(shape), scale)
            return out.reshape(query.shape)
    out = torch.empty_like(query)
    for length, starts in by_length.items():
        rows = (torch.tensor(starts).unsqueeze(1) + torch.arange(length)).flatten()
        rows = rows.to(query.device)
        shape = (len(starts), length, *query.shape[1:])
        part = encoder_attention(query[rows].reshape(shape), key[rows].reshape(shape),
                                 value[rows].reshape(shape), scale)
        out[rows] = part.reshape(-1, *query.shape[1:])
    return out


class _PanelLinear(nn.Module):
    """An ``nn.Linear`` whose weight lives as a compiled kernel's panels of ``PANEL`` outputs:
    ``_pack`` and ``_matmul`` name the module's packing and matmul functions."""

    PANEL: int
    _pack: str
    _matmul: str

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = getattr(_module, self._pack)(linear.weight.detach().contiguous())
        self.register_buffer("packed", packed)
        bias = None
        if linear.bias is not None:  # float32, zero-padded to whole panels
            bias = torch.zeros(packed.shape[0] * self.PANEL)
            bias[:self.out_features] = linear.bias.detach().float()
        self.register_buffer("bias", bias)
        self._kernel = getattr(_module, self._matmul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = self._kernel(rows, self.packed, self.bias, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class PackedLinear(_PanelLinear):
    """A bfloat16 ``nn.Linear`` whose weight lives as the AVX512-BF16 kernel's 32-output
    panels (``cpu_linear.cpp``)."""

    PANEL, _pack, _matmul = 32, "pack_linear_weight", "packed_linear"


class PackedLinearF32(_PanelLinear):
    """A float32 ``nn.Linear`` whose weight lives as the AVX2/FMA kernel's 16-output panels
    (``cpu_linear_f32.cpp``). The sums run in another order than torch's, so results differ
    from ``F.linear`` in the last bits (tests/test_cpu_kernels.py states the tolerance)."""

    PANEL, _pack, _matmul = 16, "pack_linear_weight_f32", "packed_linear_f32"


class OneDNNLinear(nn.Module):
    """A float32 ``nn.Linear`` whose weight oneDNN (through torch) has reordered once, at load
    time, into the blocked layout its matmul kernels read.

    torch's float32 ``F.linear`` goes to MKL with the weight in its ``[out, in]`` layout; for
    the few rows of a decode step MKL reads that layout at about half the memory bandwidth
    that oneDNN reaches on its prepacked weight, and the LM head at a third (AVX2 machine,
    ``benchmarks/README.md``). The sums run in another order than torch's, so results differ
    from ``F.linear`` in the last bits (tests/test_cpu_kernels.py states the tolerance)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _ONEDNN_BATCH_HINT)
        # Plain attributes, not buffers: ``Module.to`` and the state dict would try to read the
        # opaque packed tensor. The runner counts the weights' bytes before packing.
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


# The rows oneDNN is told to expect when it picks the weight's layout; on AVX2 and AVX-512
# machines it picks one layout for every row count, so decode steps and prompt chunks share it.
_ONEDNN_BATCH_HINT = 64


def onednn_linear_supported() -> bool:
    """Whether this torch build has oneDNN's packed float32 linear (x86 CPU builds do)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and os.environ.get(DISABLE_ENV, "1") != "0")


def float32_linear() -> type[nn.Module] | None:
    """The float32 linear layer for this CPU: the AVX2/FMA kernel on CPUs without AVX-512
    (where it reads weights faster than oneDNN and MKL, ``benchmarks/README.md``), oneDNN's
    where the CPU has AVX-512 (twice the kernel's vector width) or the kernel did not build;
    None with ``MMSERVE_CPU_KERNELS=0`` or a torch without oneDNN."""
    if load() is not None and _module.packed_linear_f32_supported() and not _module.has_avx512():
        return PackedLinearF32
    return OneDNNLinear if onednn_linear_supported() else None


def pack_linear_layers(model: nn.Module) -> int:
    """Replace the CPU ``nn.Linear`` layers of ``model`` whose weight no other module shares:
    bfloat16 ones (even input size) by a ``PackedLinear`` on CPUs with AVX512-BF16, float32
    ones by ``float32_linear()``'s layer; how many were replaced. ``MMSERVE_CPU_KERNELS=0``
    keeps torch's layers."""
    bf16 = load() is not None and _module.packed_linear_supported()
    fp32 = float32_linear()
    if not (bf16 or fp32):
        return 0
    owners: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        owners[id(param)] = owners.get(id(param), 0) + 1
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (not isinstance(child, nn.Linear) or child.weight.device.type != "cpu"
                    or owners[id(child.weight)] != 1):
                continue
            dtype = child.weight.dtype
            if bf16 and dtype == torch.bfloat16 and child.in_features % 2 == 0:
                setattr(parent, name, PackedLinear(child))
            elif fp32 and dtype == torch.float32:
                setattr(parent, name, fp32(child))
            else:
                continue
            replaced += 1
    return replaced


def cpu_attention_backend():
    """The attention backend of the CPU runner: the compiled kernels when they build (flash
    attention for prompt chunks where it applies, decode attention for single-token rows),
    the torch reference otherwise."""
    if load() is None:
        return paged_attention
    return functools.partial(paged_attention, decode=decode_attention, prefill=prefill_attention)
