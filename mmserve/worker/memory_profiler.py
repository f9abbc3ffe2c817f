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
    a kernel (scratch buffers) are invisible here; they are small next to the activations.
    Tensors without a plain storage (oneDNN's packed weights, sparse tensors) are neither
    inputs that outputs could share nor allocations the tracker can follow: weights are packed
    once at load time, never inside a step.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs:
            return out
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs or {}))
                  if _has_storage(t)}
        for t in outputs:
            if not _has_storage(t):
                continue
            # Storages keep one Python object for their whole life, so its id is stable and
            # its finalizer runs exactly when the memory is released.
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, key)
        return out


def _has_storage(t: object) -> bool:
    """Whether ``t`` is a tensor with a storage to follow: a strided one (a oneDNN tensor's
    layout is ``torch._mkldnn``, and its ``untyped_storage()`` raises)."""
    return isinstance(t, torch.Tensor) and t.layout == torch.strided


def track_peak_bytes(fn: Callable[[], T]) -> tuple[T, int]:
    """Run ``fn`` and return its result and the peak bytes of tensors it had alive at once.

    Tensors that existed before the call (weights, caches) are not counted; tensors the result
    still holds are counted while they were alive.
    """
    tracker = _PeakTracker()
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
