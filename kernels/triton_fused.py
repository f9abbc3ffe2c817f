"""Triton kernels for a decoder's elementwise work on a GPU, one launch where torch's ops take
several: RMSNorm (with the residual add before it), the rotary embedding, SiLU-and-mul and quick
GELU. The same functions, arguments and results as the CPU module's (``cpu_ops``), so the
models call either through ``kernels/fused.py``.

Why: a step that mixes prompt chunks and decodes runs the decoder eagerly (CUDA graphs hold
decode batches only), and there the GPU waits for the host to launch its kernels. On an H200
with the 1.4B bench checkpoint such a step launched about 830 kernels, 38 a layer, the norms
and the rotary embedding 30 of them, and took its host several times the GPU's time.

Rounding follows torch's ops: each op's result is rounded to the tensor's dtype where torch
rounds it (a bfloat16 product is rounded before the sum it enters), and the rotary kernel is
compiled without fused multiply-adds, so it gives torch's bits. The norm's sum of squares is
added in another order than torch's reduction, as the CPU kernel's is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels import elementwise

# One rounding per op, as torch's separate kernels round: no fused multiply-add in between.
_NO_FMA = {"enable_fp_fusion": False}
_ELEMENTS_PER_PROGRAM = 1024


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_r, stride_o,
    rows, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (row < rows) & (cols < hidden)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # residual += x, rounded to the dtype as torch's add_ rounds it
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(out_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, s, mask=mask)
        x = s.to(tl.float32)
    # torch's rsqrt of the mean square, in float32
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)[:, None]
    normed = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> torch.Tensor:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"RMSNorm expects [rows, hidden] with contiguous rows, got "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(f"RMSNorm weight {tuple(weight.shape)} {weight.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()
                                 or residual.dtype != x.dtype):
        raise ValueError("the residual must be contiguous, of x's shape and dtype")
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    if rows:
        block = triton.next_power_of_2(hidden)
        block_rows = max(1, _ELEMENTS_PER_PROGRAM // block)  # one row a program from 1024 on
        _rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
            x, x if residual is None else residual, weight, out,
            x.stride(0), hidden if residual is None else residual.stride(0), out.stride(0),
            rows, hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
            BLOCK_ROWS=block_rows, num_warps=min(16, max(1, block // 256)))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` per row, normalized in float32 and scaled in
    ``x``'s dtype; a new tensor."""
    return _norm(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``residual += x`` in place, then the norm of the sum (a new tensor)."""
    return _norm(x, residual, weight, eps)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_x_tok, stride_x_head,
    heads, rows,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    # A row is one head of one token: BLOCK_ROWS of them a program, each rotated by its
    # token's row of the tables.
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (row < rows) & (i < HALF)
    tok, h = row // heads, row % heads
    dtype = out_ptr.dtype.element_ty
    src = x_ptr + tok * stride_x_tok + h * stride_x_head + i
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    table = tok * (2 * HALF) + i
    c1 = tl.load(cos_ptr + table, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + table + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + table, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + table + HALF, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]: each product rounded to the
    # dtype, then their sum, as torch's mul and add round.
    lo = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    hi = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    dst = out_ptr + row * (2 * HALF) + i
    tl.store(dst, lo.to(dtype), mask=mask)
    tl.store(dst + HALF, hi.to(dtype), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding (rotate-half layout) of ``x`` ``[tokens, heads, dim]`` (rows may be
    strided, the last dimension contiguous) by ``[tokens, 1, dim]`` tables of its dtype; a new
    contiguous tensor."""
    if x.dim() != 3 or x.stride(2) != 1 or x.shape[2] % 2:
        raise ValueError(f"rotary expects [tokens, heads, dim] with an even, contiguous last "
                         f"dimension, got {tuple(x.shape)} with strides {x.stride()}")
    tokens, heads, dim = x.shape
    for name, table in (("cos", cos), ("sin", sin)):
        if (not table.is_contiguous() or table.numel() != tokens * dim
                or table.dtype != x.dtype):
            raise ValueError(f"rotary expects a contiguous {name} table [tokens, 1, dim] of "
                             f"x's dtype, got {tuple(table.shape)} {table.dtype}")
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    rows = tokens * heads
    if rows:
        half_pad = triton.next_power_of_2(dim // 2)
        block_rows = max(1, _ELEMENTS_PER_PROGRAM // half_pad)
        _rotary_kernel[(triton.cdiv(rows, block_rows),)](
            x, cos, sin, out, x.stride(0), x.stride(1), heads, rows,
            HALF=dim // 2, HALF_PAD=half_pad, BLOCK_ROWS=block_rows, **_NO_FMA)
    return out


@triton.jit
def _silu_and_mul_kernel(
    gate_ptr, up_ptr, out_ptr,
    stride_g, stride_u, n,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # silu, rounded as F.silu's
    tl.store(out_ptr + row * n + cols, (act * u).to(dtype), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``[rows, n]`` halves of a merged projection (rows may be strided,
    each contiguous); a new tensor."""
    if gate.dim() != 2 or gate.shape != up.shape or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError("silu_and_mul expects gate and up of one shape [rows, n], rows "
                         "contiguous")
    rows, n = gate.shape
    out = torch.empty(rows, n, dtype=gate.dtype, device=gate.device)
    if rows and n:
        grid = (rows, triton.cdiv(n, _ELEMENTS_PER_PROGRAM))
        _silu_and_mul_kernel[grid](gate, up, out, gate.stride(0), up.stride(0), n,
                                   BLOCK=_ELEMENTS_PER_PROGRAM)
    return out


@triton.jit
def _quick_gelu_kernel(x_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # (x * 1.702).sigmoid_().mul_(x), each op rounded to the dtype
    scaled = (x * 1.702).to(dtype).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-scaled))).to(dtype).to(tl.float32)
    tl.store(out_ptr + offs, (gate * x).to(dtype), mask=mask)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)`` (CLIP's activation); a new tensor of ``x``'s shape."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        grid = (triton.cdiv(x.numel(), _ELEMENTS_PER_PROGRAM),)
        _quick_gelu_kernel[grid](x, out, x.numel(), BLOCK=_ELEMENTS_PER_PROGRAM)
    return out


def check(device: torch.device, dtype: torch.dtype) -> None:
    """Run every kernel once on small inputs of ``device`` and ``dtype`` against torch's ops
    (which compiles them); raises what failed. The engine checks once per device and dtype
    before a model uses them, so that a Triton that cannot compile or run them costs speed,
    not the engine's start."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    # Wide enough for every rounding difference (Triton's interpreter truncates to bfloat16):
    # what this catches is a kernel that computes something else.
    tol = {torch.float32: 1e-4, torch.float16: 1e-2}.get(dtype, 1e-1)

    def same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=tol,
                                                         atol=tol):
            raise RuntimeError(f"{name} differs from torch's ops by "
                               f"{(got.float() - want.float()).abs().max().item():g}")

    x, residual, weight = rand(3, 64), rand(3, 64), rand(64)
    same("rms_norm", rms_norm(x, weight, 1e-6), elementwise.rms_norm(x, weight, 1e-6))
    summed = residual.clone()
    same("add_rms_norm", add_rms_norm(x, summed, weight, 1e-6),
         elementwise.rms_norm(residual + x, weight, 1e-6))
    same("add_rms_norm's residual", summed, residual + x)
    q, cos, sin = rand(3, 2, 16), rand(3, 1, 16), rand(3, 1, 16)
    same("rotary", rotary(q, cos, sin), elementwise.rotary(q, cos, sin))
    gate, up = rand(3, 40), rand(3, 40)
    same("silu_and_mul", silu_and_mul(gate, up), elementwise.silu_and_mul(gate, up))
    same("quick_gelu", quick_gelu(x), elementwise.quick_gelu(x))
