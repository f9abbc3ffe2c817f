"""Host-to-device copies that do not make the host wait for the device.

A copy from ordinary (pageable) host memory to a GPU returns only once it is done, and it is
done only after the work queued on the stream before it: the thread preparing a step's inputs
would wait there for the step before to finish, and the GPU would then wait for the rest of
the preparation. From pinned memory, with ``non_blocking``, the copy is queued and the thread
goes on (torch keeps a pinned buffer from reuse until its copy has run).
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``, without waiting on a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def tensor_on(data: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device``, through ``to_device``."""
    return to_device(torch.tensor(data, dtype=dtype), device)
