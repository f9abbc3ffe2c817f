"""Memory measurements for the memory plan: device memory, weights, peak activations.

The CPU has no allocator statistics like ``torch.cuda.max_memory_allocated``, so the peak of a
profile run is measured by watching every tensor storage that the run's operators create and
noting when each one dies. The same tracker works on the meta device, where it turns a dry run
with no data into an exact count of the bytes the same run would allocate for real.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

T = TypeVar("T")


class _PeakTracker(TorchDispatchMode):
    """Sum of live tensor storages created by operators inside the mode, and its maximum.

    A storage is new when no input of the operator shares it: views, in-place updates and
    ``out=`` writes return an input's storage and are not allocations. Allocations made inside
    a kernel are invisible here, so the scratch of kernels known to keep some (``scratch_bytes``)
    is added while the kernel runs.
    Tensors without a plain storage (oneDNN's packed weights, sparse tensors) are neither
    inputs that outputs could share nor allocations the tracker can follow: weights are packed
    once at load time, never inside a step.
    """

    def __init__(self, threads: int | None = None) -> None:
        super().__init__()
        self.threads = threads  # for kernels' per-thread scratch; None: torch's count now
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # The kernel's scratch was alive beside its outputs, and is freed when it returns.
        threads = torch.get_num_threads() if self.threads is None else self.threads
        self.peak = max(self.peak, self._count(out, (args, kwargs))
                        + scratch_bytes(func, args, threads))
        return out

    def _count(self, out: Any, inputs: Any) -> int:
        """Count the storages among ``out`` that no input shares; the live bytes after that."""
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs:
            return self.current
        shared = {id(t.untyped_storage()) for t in tree_leaves(inputs) if _has_storage(t)}
        for t in outputs:
            if not _has_storage(t):
                continue
            # Storages keep one Python object for their whole life, so its id is stable and
            # its finalizer runs exactly when the memory is released.
            storage = t.untyped_storage()
            key = id(storage)
            if key in shared or key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, key)
        return self.current


def scratch_bytes(func: Any, args: tuple, threads: int) -> int:
    """Bytes ``func`` allocates for itself while it runs, beyond its outputs: torch's fused
    CPU attention keeps one buffer per thread, float32 scores for a tile of queries against a
    tile of keys plus the tile's output sums (and the scores again in the inputs' dtype when
    that is bfloat16 or float16): 2.5 MiB per thread for 1,024 queries with 128-wide heads,
    which on a many-core host is more than the step's other activations of a small model.
    Under inference mode the tracker sees the attention op itself, before it picks that
    kernel: then the kernel's second output (float32 log-sum-exps, dropped on return) too."""
    if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
        extra = 0
    elif (func is torch.ops.aten.scaled_dot_product_attention.default
          and args[0].device.type == "cpu"):
        extra = 4 * args[0].shape[:-1].numel()
    else:
        return 0
    query, key = args[0], args[1]
    q_len, head_dim, kv_len = query.shape[-2], query.shape[-1], key.shape[-2]
    q_tile = min(q_len, 256 if q_len >= 768 else 64 if q_len >= 192 else 32)
    kv_tile = min(kv_len, 512)
    per_thread = 4 * (q_tile * kv_tile + 2 * q_tile + q_tile * head_dim)
    if query.dtype != torch.float32:
        per_thread += q_tile * kv_tile * query.element_size()
    return extra + threads * per_thread


def _has_storage(t: object) -> bool:
    """Whether ``t`` is a tensor with a storage to follow: a strided one (a oneDNN tensor's
    layout is ``torch._mkldnn``, and its ``untyped_storage()`` raises)."""
    return isinstance(t, torch.Tensor) and t.layout == torch.strided


def track_peak_bytes(fn: Callable[[], T], threads: int | None = None) -> tuple[T, int]:
    """Run ``fn`` and return its result and the peak bytes of tensors it had alive at once.

    Tensors that existed before the call (weights, caches) are not counted; tensors the result
    still holds are counted while they were alive. Kernels with per-thread scratch count it
    for ``threads`` threads (None: torch's thread count now).
    """
    tracker = _PeakTracker(threads)
    with tracker:
        result = fn()
    return result, tracker.peak


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (the weights an engine holds)."""
    tensors: list[Any] = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def device_memory(device: torch.device) -> int:
    """The memory a plan may take a share of: a GPU's total memory, or the RAM available now.

    On a GPU this is the device's capacity, as in vLLM. On the CPU the process shares RAM with
    everything else on the machine, so the base is what the kernel reports as available
    (``MemAvailable``: free memory plus reclaimable page cache) when the engine starts.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
