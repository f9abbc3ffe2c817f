"""Which fused elementwise kernels a tensor's ops take: the compiled CPU module's for a CPU
tensor (``cpu_ops``, when it built and the path uses it), Triton's for a CUDA tensor
(``triton_fused``), else None, which means torch's ops. Both modules have the same functions:
``rms_norm``, ``add_rms_norm``, ``rotary``, ``silu_and_mul``, ``quick_gelu``; the CPU module
also ``quick_gelu_`` (in place) and ``add_layer_norm`` (bfloat16), which callers look up with
``hasattr``.

``MMSERVE_GPU_KERNELS=torch`` keeps torch's ops on a GPU (``triton``, the default, fuses), for
comparing the two there; it is read once per process. The Triton kernels are checked against
torch's ops once per device and dtype before a model uses them; where they fail (a Triton that
cannot compile them) torch's ops serve, with a warning.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType

import torch

from mmserve.kernels import cpu_ops

logger = logging.getLogger(__name__)

GPU_PATHS = ("triton", "torch")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The devices whose tensors take the Triton kernels; tests add "cpu" to run them in Triton's
# interpreter inside a model.
_TRITON_DEVICES = {"cuda"}


def gpu_path() -> str:
    path = os.environ.get("MMSERVE_GPU_KERNELS", "triton")
    if path not in GPU_PATHS:
        raise ValueError(f"MMSERVE_GPU_KERNELS={path!r}: expected one of {', '.join(GPU_PATHS)}")
    return path


def fused_kernels(tensor: torch.Tensor) -> ModuleType | None:
    """The module whose fused kernels ``tensor``'s ops take, or None for torch's ops."""
    if tensor.device.type in _TRITON_DEVICES:
        return _triton_module(tensor.device, tensor.dtype) if tensor.dtype in _DTYPES else None
    return cpu_ops.fused_kernels(tensor)


@functools.cache
def _triton_module(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The Triton kernels, once they have run right on this device and dtype
    (``triton_fused.check``); if they fail, torch's ops, with a warning saying why."""
    if gpu_path() == "torch":
        return None
    # Imported on first use, so that importing mmserve never imports Triton.
    from mmserve.kernels import triton_fused
    try:
        triton_fused.check(device, dtype)
    except Exception as e:  # a Triton that cannot compile or run them: slower, not broken
        logger.warning("the fused Triton kernels failed their check on %s in %s (%s: %s); "
                       "the models use torch's ops there instead", device, dtype,
                       type(e).__name__, e)
        return None
    return triton_fused
