"""torch's ops for what the fused kernels do (``cpu_ops``' and ``triton_fused``'s functions of
the same names): the models' path where no fused kernel applies, and what the Triton kernels
are checked against. The fused kernels round where these round."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalized in float32 and scaled in ``x``'s dtype, as the reference models do."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding over the rotate-half layout."""
    return x * cos + rotate_half(x) * sin


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    # One new tensor, like the fused kernels (the same ops, rounded the same, in place).
    return (x * 1.702).sigmoid_().mul_(x)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate).mul_(up)
