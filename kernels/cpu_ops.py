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
torch's ops round. The models call them through ``kernels/fused.py``, which gives a GPU's
tensors the Triton kernels of the same names (``triton_fused``).

``PackedLinear`` (``cpu_linear.cpp``) replaces a bfloat16 ``nn.Linear`` once its weights are
loaded, with the weight repacked into the panels of the pair dot-product instruction. On decode
steps, where a few dozen rows meet every weight once, it reaches about 1.5 times torch's
bfloat16 matmul, which reads the [out, in] layout. ``PackedLinearF32`` (``cpu_linear_f32.cpp``)
does the same for float32 on CPUs with AVX2 and FMA but without AVX-512, about twice MKL's speed
on decode steps; ``OneDNNLinear`` (oneDNN's prepacked matmul, through torch) serves float32 on
CPUs with AVX-512, where it is twice as fast as the AVX2 kernel on decode steps of 8 rows or
more, and bfloat16 on CPUs with AMX, whose tile instructions it uses (5 times the AVX512-BF16
kernel on prompt-sized inputs of a 2-core Xeon; ``bfloat16_linear`` says what it costs). The
module is compiled for the instructions of the path (below), so each function is built for
what it may use, and ``float32_linear`` / ``bfloat16_linear`` / ``_flash_kernel`` choose among
them.

Which of these run is a *path*, chosen once per process (``MMSERVE_CPU_KERNELS``, see
``PATHS``): ``torch`` (torch's operators only), ``avx2`` (the module compiled for AVX2 and
FMA, as an AVX2-only CPU runs it, on any CPU that has them) or ``avx512`` (compiled for this
CPU's AVX-512, with the AVX512-BF16 kernels where it has them). ``auto``, the default, takes
the fastest path the CPU supports, by the measurements in ``benchmarks/README.md``; a path the
CPU lacks the instructions for is refused with the reason. On CPUs with AMX the avx512 path's
packed linear layers and bfloat16 flash attention multiply on AMX tiles (``cpu_amx.h``), where
the kernel asks Linux for them first. Tests and benchmarks switch paths with ``select_path``.

Building takes about a minute on two cores the first time (the sources include only the
headers they use: all of torch's would take half as long again); torch caches the library
(under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``, one build per path,
CPU model and flags, version of the sources, and environment: where the sources, torch and
Python's headers are) for later starts. Without a compiler the ``auto`` path runs torch's
operators (float32 linear layers still through oneDNN), with one warning saying why; a path
asked for by name fails to start instead.

Builds are serialized by an OS lock (``flock``) on ``<build directory>.mmserve-lock``, which
the kernel releases when its holder exits, however it exits. A start killed mid-build leaves
torch's own ``lock`` file in the build directory, on which torch's builder would wait forever;
the next start, holding the OS lock, knows no other start is building and removes it. A start
waits at most ``MMSERVE_CPU_KERNELS_BUILD_TIMEOUT`` seconds (default 600) for another
process's build, then uses torch's operators, with a warning naming the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import itertools
import logging
import os
import platform
import sysconfig
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.kernels.paged_attention import PrefillSeq, paged_attention
from mmserve.kernels.paged_attention import prefill_attention as torch_prefill_attention
from mmserve.profiling import phase

logger = logging.getLogger(__name__)

KERNELS_ENV = "MMSERVE_CPU_KERNELS"
BUILD_TIMEOUT_ENV = "MMSERVE_CPU_KERNELS_BUILD_TIMEOUT"
# Ten times a two-core build: a start waits out any real build, but not a hung one.
DEFAULT_BUILD_TIMEOUT_S = 600.0
_SOURCES = [Path(__file__).with_name(name) for name in
            ("cpu_ops.cpp", "cpu_decode_attention.cpp", "cpu_flash_attention.cpp",
             "cpu_elementwise.cpp", "cpu_linear.cpp", "cpu_linear_f32.cpp",
             "cpu_attention_f32.cpp")]
_HEADERS = [Path(__file__).with_name(name)
            for name in ("cpu_amx.h", "cpu_math.h", "cpu_tile_f32.h")]


@dataclass(frozen=True)
class KernelPath:
    """One way to run the CPU runner's hot operators."""

    name: str
    needs: tuple[str, ...]  # /proc/cpuinfo flags the CPU must have
    target: tuple[str, ...] | None  # compiler target flags of its module; None: nothing built
    float32_linear: str | None  # "packed" (cpu_linear_f32.cpp), "onednn", or None (torch's)
    description: str


PATHS: dict[str, KernelPath] = {p.name: p for p in (
    KernelPath("torch", (), None, None, "torch's operators only, nothing compiled"),
    KernelPath("avx2", ("avx2", "fma"), ("-march=native", "-mno-avx512f"), "packed",
               "kernels compiled for AVX2 and FMA (what an AVX2-only CPU runs); float32 "
               "linear layers in cpu_linear_f32.cpp, bfloat16 ones in torch"),
    KernelPath("avx512", ("avx512f",), ("-march=native",), "onednn",
               "kernels compiled for this CPU's AVX-512, the bfloat16 ones where it has "
               "AVX512-BF16; float32 linear layers through oneDNN"),
)}
# ``auto``: the first of these the CPU supports. On an AVX-512 CPU (AMD EPYC, 2 cores) the
# avx512 path's oneDNN float32 linear layers take half the AVX2 kernel's time from 8 rows up,
# and only it has the bfloat16 kernels (benchmarks/README.md, "CPU kernel paths").
_AUTO_ORDER = ("avx512", "avx2", "torch")

_lock = threading.Lock()
_path: KernelPath | None = None  # the active path, once load() or select_path() chose it
_module: ModuleType | None = None  # its compiled module; None for torch or a failed build
_failure: str | None = None  # why _module is None
_built: dict[str, ModuleType] = {}  # compiled modules by path name, loaded once per process


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags, as Linux lists them (empty where it does not)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_paths() -> list[str]:
    """The paths this CPU can run, fastest first."""
    return [name for name in _AUTO_ORDER if set(PATHS[name].needs) <= cpu_flags()]


def path_refusal(name: str) -> str | None:
    """Why this CPU cannot run path ``name``; None when it can."""
    if name not in PATHS:
        return f"{name!r} is not a CPU kernel path; choose one of auto, {', '.join(PATHS)}"
    missing = [f for f in PATHS[name].needs if f not in cpu_flags()]
    if missing:
        return (f"this CPU lacks {' and '.join(missing)}, which the {name} path needs; it "
                f"runs {', '.join(supported_paths())}")
    return None


def _requested_path() -> tuple[KernelPath, bool]:
    """The path ``MMSERVE_CPU_KERNELS`` asks for (``auto`` resolved), and whether it was
    named; raises ValueError, saying what to set, for a path this CPU cannot run."""
    raw = os.environ.get(KERNELS_ENV, "").strip().lower() or "auto"
    if raw == "0":  # the older switch for "no compiled kernels"
        raw = "torch"
    if raw == "auto":
        return PATHS[supported_paths()[0]], False
    refusal = path_refusal(raw)
    if refusal is not None:
        raise ValueError(f"{KERNELS_ENV}={raw}: {refusal}")
    return PATHS[raw], True


def _cpu_signature() -> str:
    """A short hash of this CPU's model and instruction-set flags. The builds use
    ``-march=native``, so machines that share a home directory (and torch's extension cache)
    but differ in CPU each get their own build instead of one that may not run."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor(), platform.machine()]
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:10]


@functools.cache
def _build_signature() -> str:
    """A short hash of the kernels' sources and of what compiles them. ninja rebuilds by
    modification times, which an upgrade (a wheel's files keep their archive's times) or a
    checkout may set older than the cached objects: a build named by content is never stale.
    It also rebuilds everything when the compile command changes, and the command names the
    sources' directory, torch's headers and Python's: named by those too, two environments
    (two virtual environments, two checkouts) keep a build each instead of rebuilding in
    turn."""
    digest = hashlib.sha256()
    for source in _SOURCES + _HEADERS:
        digest.update(source.read_bytes())
    for part in (str(_SOURCES[0].parent), torch.__version__, str(Path(torch.__file__).parent),
                 sysconfig.get_paths()["include"]):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:8]


def build_name(path: KernelPath) -> str:
    """The extension's name for ``path`` on this CPU, these sources and this environment (also
    its build directory's name)."""
    return f"mmserve_cpu_ops_{_cpu_signature()}_{_build_signature()}_{path.name}"


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


def _build_extension(name: str, build_dir: Path, target: tuple[str, ...]) -> ModuleType:
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
        extra_cflags=["-O3", *target, "-fopenmp", "-fno-math-errno",
                      "-funsafe-math-optimizations"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )


def _module_for(path: KernelPath) -> ModuleType:
    """The compiled module of ``path``, built (or found in torch's cache) once per process;
    raises what the build raised. Call with ``_lock`` held."""
    if path.name not in _built:
        name = build_name(path)
        build_dir = _build_directory(name)
        _built[path.name] = build_locked(
            build_dir, lambda: _build_extension(name, build_dir, path.target),
            _build_timeout_s())
    return _built[path.name]


def _activate(path: KernelPath, named: bool) -> None:
    """Make ``path`` the process's path. A build that fails on a path asked for by name
    raises; on ``auto`` the runner uses torch's operators, with a warning saying why. Call
    with ``_lock`` held."""
    global _path, _module, _failure
    module = failure = None
    if path.target is None:
        failure = f"{KERNELS_ENV}={path.name}"
    else:
        try:
            module = _module_for(path)
        except Exception as e:  # no compiler, no ninja, a build error, a bad timeout
            if named:
                raise RuntimeError(f"{KERNELS_ENV}={path.name}: the CPU kernels are "
                                   f"unavailable ({_reason(e)})") from e
            failure = _reason(e)
            logger.warning("CPU kernels unavailable (%s); using torch's operators (slower "
                           "attention). Set %s=torch to skip the build.", failure,
                           KERNELS_ENV)
    _path, _module, _failure = path, module, failure
    logger.info("CPU kernel path %s%s: %s", path.name, "" if named else " (auto)",
                path.description if failure is None or path.target is None else
                f"torch's operators, since {failure}")


def _reason(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def load() -> ModuleType | None:
    """The compiled module of the process's path, building it if needed; None for the torch
    path or when the build failed (``unavailable_reason`` says why). The first call reads
    ``MMSERVE_CPU_KERNELS``; a path this CPU cannot run raises ValueError."""
    with _lock:
        if _path is None:
            _activate(*_requested_path())
        return _module


def active_path() -> KernelPath:
    """The process's path (``load()`` chooses it on first use)."""
    load()
    assert _path is not None
    return _path


def select_path(name: str) -> ModuleType | None:
    """Switch the process to path ``name``, for tests and benchmarks: an engine keeps the
    layers it packed when it started. Returns the path's module; raises ValueError for a path
    this CPU cannot run, RuntimeError when its build fails."""
    refusal = path_refusal(name)
    if refusal is not None:
        raise ValueError(refusal)
    with _lock:
        _activate(PATHS[name], named=True)
        return _module


@contextlib.contextmanager
def using_path(name: str) -> Iterator[ModuleType | None]:
    """``select_path(name)`` for the block; the path in force before it comes back after."""
    global _path, _module, _failure
    load()
    saved = _path, _module, _failure
    try:
        yield select_path(name)
    finally:
        with _lock:
            _path, _module, _failure = saved


def unavailable_reason() -> str | None:
    """Why ``load()`` returned None, once it has been called."""
    return _failure


def decode_attention(query, kv_cache, meta, scale: float):
    """``paged_attention``'s decode path (same arguments and result as the torch
    ``decode_attention``), with keys and values read in place by the compiled kernel."""
    if _module is None:  # per layer and step: no lock, the backend only exists after load()
        raise RuntimeError("the compiled CPU decode attention is not loaded; call load() first")
    with phase("cpu.decode_attn"):
        return _module.decode_attention(query.contiguous(), kv_cache[0], kv_cache[1],
                                        meta.decode_block_tables, meta.decode_lens, scale)


def fused_kernels(tensor: torch.Tensor) -> ModuleType | None:
    """The compiled module if the CPU runner has loaded it and ``tensor`` is a bfloat16 or
    float32 CPU tensor, the dtypes of its fused norm, rotary and activations; None means: use
    torch."""
    if (_module is not None and tensor.dtype in (torch.bfloat16, torch.float32)
            and tensor.device.type == "cpu"):
        return _module
    return None


def _flash_kernel(tensor: torch.Tensor, causal: bool, context_len: int = 0) -> Callable | None:
    """The loaded module's flash attention for this query (dtype, head size, CPU): the
    bfloat16 one on AVX512-BF16 (on AMX CPUs, short prompt chunks' only where it lacks the
    tile path); the float32 one on AVX2 with FMA for prompt chunks (causal) only, since for a
    vision tower's bidirectional attention torch's is faster in float32
    (``benchmarks/README.md``); None means torch's."""
    if tensor.device.type != "cpu":
        return None
    return compiled_attention(tensor.dtype, tensor.shape[-1], causal, context_len)


# On CPUs with AMX whose kernel lacks the tile path (an old compiler, or a kernel that refuses
# the tiles), the longest context a bfloat16 prompt chunk attends to with the vector kernel;
# from here on torch's fused attention, which multiplies on AMX tiles, is faster.
AMX_KERNEL_CONTEXT = 512


def compiled_attention(dtype: torch.dtype, head_dim: int, causal: bool,
                       context_len: int = 0) -> Callable | None:
    """The loaded module's flash attention for queries of this dtype and head size (causal:
    a prompt chunk attending to ``context_len`` positions, its cached prefix and itself; else
    a vision tower's bidirectional attention), or None for torch's. Device-blind, for the
    memory plan's dry run, which runs on the meta device."""
    module = _module
    if module is None:
        return None
    if dtype == torch.bfloat16 and _flash_head_dim(module, head_dim):
        if ("amx_bf16" in cpu_flags() and not module.flash_attention_amx_supported()
                and (not causal or context_len >= AMX_KERNEL_CONTEXT)):
            # torch's fused attention multiplies on AMX tiles there, the vector kernel does not
            # (2-core Xeon, benchmarks/README.md): a vision tower's attention in a quarter to
            # two thirds of the kernel's time, prompt chunks of 512 positions and more in
            # 0.3-0.7 of it. The kernel's own tile path is as fast as torch's or faster at
            # every size measured there, 2.3-4.5 times on 277-token prompts.
            return None
        return module.flash_attention
    if causal and dtype == torch.float32 and _flash_f32_head_dim(module, head_dim):
        return module.flash_attention_f32
    return None


@functools.cache
def _flash_head_dim(module: ModuleType, head_dim: int) -> bool:
    return module.flash_attention_supported(head_dim)


@functools.cache
def _flash_f32_head_dim(module: ModuleType, head_dim: int) -> bool:
    return module.flash_attention_f32_supported(head_dim)


def prefill_attention(query, key, value, seq: PrefillSeq, scale: float):
    """``paged_attention``'s prompt-chunk path (same arguments and result as the torch
    ``prefill_attention``), with the compiled flash attention where it applies."""
    flash = _flash_kernel(query, causal=True, context_len=seq.context_len)
    if flash is None:
        return torch_prefill_attention(query, key, value, seq, scale)
    causal_offset = seq.context_len - seq.query_len
    key, value = _same_strides(key, value)
    with phase("cpu.prefill_attn"):
        return flash(query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), scale,
                     causal_offset)[0]


def _same_strides(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value with one set of strides, as the flash kernels pack them (views of one
    projection's output may differ: a rotated key is a new tensor, the value a view)."""
    if key.stride() != value.stride():
        return key.contiguous(), value.contiguous()
    return key, value


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Bidirectional attention of a vision tower: ``[batch, tokens, heads, head_dim]`` in and
    out, any strides. The compiled flash attention once the CPU runner has loaded it (bfloat16
    on AVX512-BF16), torch's fused attention otherwise (other devices, dtypes, CPUs)."""
    flash = _flash_kernel(query, causal=False)
    if flash is not None:
        with phase("cpu.encoder_attn"):
            return flash(query, *_same_strides(key, value), scale, -1)
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

    def __init__(self, linear: nn.Linear, order: torch.Tensor | None = None) -> None:
        """``order``: the layer's output rows in the order the panels hold them (None: as
        they are)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
        if order is not None:
            weight = weight[order]
            bias = None if bias is None else bias[order]
        packed = getattr(_module, self._pack)(weight.contiguous())
        self.register_buffer("packed", packed)
        if bias is not None:  # float32, zero-padded to whole panels
            padded = torch.zeros(packed.shape[0] * self.PANEL)
            padded[:self.out_features] = bias.float()
            bias = padded
        self.register_buffer("bias", bias)
        self._kernel = getattr(_module, self._matmul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        with phase("cpu.linear"):
            out = self._kernel(rows, self.packed, self.bias, self.out_features)
        return out.view(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class PackedLinear(_PanelLinear):
    """A bfloat16 ``nn.Linear`` whose weight lives as the AVX512-BF16 kernel's 32-output
    panels (``cpu_linear.cpp``)."""

    PANEL, _pack, _matmul = 32, "pack_linear_weight", "packed_linear"


class PackedSiluAndMul(PackedLinear):
    """A gated MLP's merged gate and up layers (``MergedLinear`` rows ``[gate; up]``, each
    ``halves`` outputs, a multiple of 16) as the packed kernel's panels in halves: 16 outputs of
    gate, then the same 16 of up. Its output is ``silu(gate) * up``, ``[..., halves]``, computed
    from the sums as the separate ``silu_and_mul`` would from the merged output, without
    writing that output (twice the size) and reading it back."""

    _matmul = "packed_linear_silu_and_mul"
    applies_activation = True

    def __init__(self, linear: nn.Linear) -> None:
        # Row i of the panels' order: gate and up alternate in blocks of 16.
        halves = linear.out_features // 2
        order = torch.arange(linear.out_features).view(2, halves // 16, 16).transpose(0, 1)
        super().__init__(linear, order.reshape(-1))

    @staticmethod
    def applies(linear: nn.Linear) -> bool:
        """Whether ``linear`` (gate and up merged) fills whole panels in halves."""
        return linear.out_features % 32 == 0


class PackedLinearF32(_PanelLinear):
    """A float32 ``nn.Linear`` whose weight lives as the AVX2/FMA kernel's 16-output panels
    (``cpu_linear_f32.cpp``). The sums run in another order than torch's, so results differ
    from ``F.linear`` in the last bits (tests/test_cpu_kernels.py states the tolerance)."""

    PANEL, _pack, _matmul = 16, "pack_linear_weight_f32", "packed_linear_f32"


class OneDNNLinear(nn.Module):
    """A float32 or bfloat16 ``nn.Linear`` whose weight oneDNN (through torch) has reordered
    once, at load time, into the blocked layout its matmul kernels read (in bfloat16 on a CPU
    with AMX, its tile instructions).

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
        with phase("cpu.linear"):
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [],
                                                     "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


# The rows oneDNN is told to expect when it picks the weight's layout; on AVX2 and AVX-512
# machines it picks one layout for every row count, so decode steps and prompt chunks share it.
_ONEDNN_BATCH_HINT = 64


def onednn_linear_supported() -> bool:
    """Whether this torch build has oneDNN's packed float32 linear (x86 CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_linear_pointwise")


def float32_linear() -> type[nn.Module] | None:
    """The float32 linear layer of the process's path: the AVX2/FMA kernel on the avx2 path
    (where it reads weights faster than oneDNN and MKL on AVX2 CPUs, ``benchmarks/README.md``),
    oneDNN's on the avx512 path and wherever the kernel did not build; None (torch's) on the
    torch path or without oneDNN."""
    path = active_path()
    if path.float32_linear is None:
        return None
    if path.float32_linear == "packed" and _module is not None:
        return PackedLinearF32
    return OneDNNLinear if onednn_linear_supported() else None


def bfloat16_linear() -> type[nn.Module] | None:
    """The bfloat16 linear layer of the process's path, on CPUs with AVX512-BF16 where the
    path's module built (else None: torch's): the packed kernel (``PackedLinear``). Its vector
    tiles multiply with AVX512-BF16's pair dot product or, from 16 rows on where the core runs
    them faster (a Xeon that does not expose AMX: twice the multiply-adds a cycle), with float32
    FMAs on inputs widened to float32; the same bits either way. On a CPU with AMX it
    multiplies on AMX tiles. There (a 2-core Xeon, ``benchmarks/cpu_linear.py
    --dtype bfloat16``, ``benchmarks/README.md``) it reads a decode step's weights 1.1-1.4 times
    as fast as oneDNN's AMX matmul at 1-32 rows, where the time goes into reading them, and
    takes 0.8-1.4 times oneDNN's time on prompt-sized inputs (the most on layers of 768 inputs,
    whose 32-row chunks are short); the bench checkpoint's offline throughput rose 5-8%. A CPU
    with AMX whose module lacks the tile path (a compiler without AMX, or a kernel that refuses
    the tiles to the process) gets oneDNN's layer, which uses them."""
    if load() is None or not _module.packed_linear_supported():
        return None
    if ("amx_bf16" in cpu_flags() and not _module.packed_linear_amx_supported()
            and onednn_linear_supported()):
        return OneDNNLinear
    return PackedLinear


def bfloat16_prompt_linear(in_features: int, out_features: int) -> type[nn.Module] | None:
    """The bfloat16 linear layer for a layer of this shape whose inputs are always
    prompt-sized (a vision tower's: an image's hundreds of tokens at a time). On a CPU with
    AMX, oneDNN's, where the packed kernel's tiles took 0.8-1.4 times its time on 64 to 3,152
    rows (``bfloat16_linear``), except for layers of few outputs from not many inputs (CLIP-B's
    768 x 768 and 3072 x 768, CLIP-L's 1024 x 1024): there oneDNN takes twice its usual time a
    row over a band of row counts (394 to 1,182 rows of 768 x 768, 591 to 1,379 of 3072 x 768:
    five images of 197 tokens), and the packed kernel keeps its pace (benchmarks/README.md).
    Elsewhere ``bfloat16_linear()``'s."""
    bf16 = bfloat16_linear()
    narrow = out_features <= 1024 and in_features <= 3072
    if (bf16 is not None and not narrow and "amx_bf16" in cpu_flags()
            and onednn_linear_supported()):
        return OneDNNLinear
    return bf16


def pack_linear_layers(model: nn.Module, prompt_only: Iterable[nn.Module] = ()) -> int:
    """Replace the CPU ``nn.Linear`` layers of ``model`` whose weight no other module shares:
    bfloat16 ones (even input size) by ``bfloat16_linear()``'s layer, or inside the modules of
    ``prompt_only`` (the model's ``encoder_modules()``) by ``bfloat16_prompt_linear()``'s, and
    a gated MLP's merged gate and up layers whose ``fused_activation`` is ``"silu_and_mul"``
    by ``PackedSiluAndMul`` where the packed kernel serves and they fill its panels (their
    output then is the activation's); float32 ones by ``float32_linear()``'s; how many were
    replaced. The torch path keeps torch's layers."""
    bf16 = bfloat16_linear()
    fp32 = float32_linear()
    if not (bf16 or fp32):
        return 0
    prompt_layers = {id(m) for module in prompt_only for m in module.modules()}
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
                if id(child) in prompt_layers:
                    layer = bfloat16_prompt_linear(child.in_features, child.out_features)
                elif (getattr(child, "fused_activation", None) == "silu_and_mul"
                      and bf16 is PackedLinear and PackedSiluAndMul.applies(child)):
                    layer = PackedSiluAndMul
                else:
                    layer = bf16
                setattr(parent, name, layer(child))
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
