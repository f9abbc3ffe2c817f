"""Host-to-device copies that do not make the host wait for the device.

A copy from ordinary (pageable) host memory to a GPU returns only once it is done, and it is
done only after the work queued on the stream before it: the thread preparing a step's inputs
would wait there for the step before to finish, and the GPU would then wait for the rest of
the preparation. From pinned memory, with ``non_blocking``, the copy is queued and the thread
goes on (torch keeps a pinned buffer from reuse until its copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``, without waiting on a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def to_device_all(tensors: Sequence[torch.Tensor],
                  device: torch.device | str) -> list[torch.Tensor]:
    """``to_device`` of each host tensor, in one transfer on a GPU: their bytes packed into one
    pinned buffer (``pack``), copied at once, and each returned as a view of the copy. A
    step's inputs are several small tensors, and each copy costs the host a few microseconds
    of pinning and launching."""
    device = torch.device(device)
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    buffer, layout = pack(tensors, pin=True)
    return unpack(buffer.to(device, non_blocking=True), layout)


# Where each tensor's bytes start in a packed buffer: a multiple of this, so that every dtype
# can view its part and a Triton kernel always sees 16-byte aligned pointers (it compiles a
# variant for each alignment it meets).
PACK_ALIGN = 64

Layout = list[tuple[int, torch.dtype, torch.Size]]  # (byte offset, dtype, shape) of each


def pack(tensors: Sequence[torch.Tensor], pin: bool = False) -> tuple[torch.Tensor, Layout]:
    """The tensors' bytes one after another in one uint8 tensor (pinned with ``pin``), each
    from a multiple of ``PACK_ALIGN``, and where each lies (``unpack``'s layout)."""
    layout: Layout = []
    end = 0
    for t in tensors:
        layout.append((end, t.dtype, t.shape))
        end += -(-t.numel() * t.element_size() // PACK_ALIGN) * PACK_ALIGN
    buffer = torch.empty(end, dtype=torch.uint8, pin_memory=pin)
    for t, (start, dtype, _) in zip(tensors, layout, strict=True):
        buffer[start:start + t.numel() * t.element_size()].view(dtype).copy_(t.reshape(-1))
    return buffer, layout


def unpack(buffer: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The tensors ``pack`` put in ``buffer`` (or in a copy of it), as views of it."""
    return [buffer[start:start + shape.numel() * dtype.itemsize].view(dtype).view(shape)
            for start, dtype, shape in layout]


def tensor_on(data: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device``, through ``to_device``."""
    return to_device(host_tensor(data, dtype), device)


def host_tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)``; a flat list of integers through numpy, which reads
    it in a quarter of torch's time (40 against 10 us at 256 values): a step makes several
    such tensors of one value per request or per token."""
    if dtype == torch.long and (not data or isinstance(data[0], int)):
        return int_tensor(data)
    return torch.tensor(data, dtype=dtype)


def int_tensor(values: Sequence[int]) -> torch.Tensor:
    """A flat sequence of Python integers as an int64 tensor on the host (one that does not
    fit raises ``OverflowError``)."""
    return torch.from_numpy(np.fromiter(values, np.int64, len(values)))
