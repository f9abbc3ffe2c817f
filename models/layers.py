"""Building blocks shared by the decoders: RMSNorm, rotary embedding, paged attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.kernels import elementwise
from mmserve.kernels.fused import fused_kernels
from mmserve.models.forward_context import OutputRows, get_forward_context
from mmserve.models.parallel import Window


def quick_gelu(x: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``x * sigmoid(1.702 x)``; with ``in_place``, into ``x`` where the CPU kernels can (a
    layer's output that nothing else reads: no second tensor of its size to write)."""
    ops = fused_kernels(x)
    if in_place and ops is not None and hasattr(ops, "quick_gelu_") and x.is_contiguous():
        return ops.quick_gelu_(x)
    return (ops or elementwise).quick_gelu(x)


def get_activation(name: str):
    acts = {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "quick_gelu": quick_gelu,
        "relu": F.relu,
    }
    if name not in acts:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(acts)}")
    return acts[name]


class MergedLinear(nn.Linear):
    """Linear layers that read one input (q, k and v; gate and up) as one: their output rows
    stacked in ``shards`` order, so a step runs one matmul where it ran one each (a decode
    step's few rows make each call cost more than its arithmetic). The checkpoint keeps them
    apart: ``<parent>.<shard>.weight`` (and ``.bias``) loads into the shard's rows
    (``models/loader.py``). The parent splits the output by the shards' sizes, which it keeps
    itself: on the CPU the layer is replaced by a packed one once loaded. Under tensor
    parallelism ``shards`` are this rank's sizes and ``windows`` say which rows of each
    checkpoint tensor they are (``models/parallel.py``)."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool,
                 windows: dict[str, Window] | None = None,
                 fused_activation: str | None = None) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)
        self.shard_windows = dict(windows or {})
        # "silu_and_mul" (two equal shards, gate then up): a kernel may replace the layer by
        # one whose output is silu(gate) * up (``applies_activation`` then says so).
        self.fused_activation = fused_activation

    def shard_rows(self) -> dict[str, slice]:
        """Each shard's output rows."""
        rows, start = {}, 0
        for name, size in self.shards.items():
            rows[name] = slice(start, start + size)
            start += size
        return rows


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dim() == 2 and x.stride(-1) == 1 and self.weight.dtype == x.dtype
                and (ops := fused_kernels(x)) is not None):
            return ops.rms_norm(x, self.weight, self.eps)
        return elementwise.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += x`` in place (the decoder's residual stream), then the norm of the sum:
        one pass on the CPU, the same rounding as ``self(residual + x)``."""
        if (x.dim() == 2 and x.stride(-1) == 1 and residual.is_contiguous()
                and self.weight.dtype == x.dtype == residual.dtype
                and (ops := fused_kernels(x)) is not None):
            return ops.add_rms_norm(x, residual, self.weight, self.eps)
        return elementwise.rms_norm(residual.add_(x), self.weight, self.eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor,
                   norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + x`` (a new tensor) and ``norm`` of it: one pass over bfloat16 on the CPU,
    the sum bit for bit torch's, the norm within a rounding of it."""
    ops = fused_kernels(x)
    if (ops is not None and hasattr(ops, "add_layer_norm") and x.dtype == torch.bfloat16
            and norm.weight is not None and norm.bias is not None
            and norm.weight.dtype == residual.dtype == x.dtype
            and x.is_contiguous() and residual.is_contiguous()):
        return ops.add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps)
    total = residual + x
    return total, norm(total)


def rope_theta_of(config) -> float:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    rope_type = (params or {}).get("rope_type", (params or {}).get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"rope type {rope_type!r} is not supported yet; supported: 'default' "
                         "(and M-RoPE's sections over it)")
    theta = (params or {}).get("rope_theta") or getattr(config, "rope_theta", None)
    return float(theta if theta is not None else 10000.0)


class RotaryEmbedding(nn.Module):
    """Default rotary position embedding over the rotate-half layout."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        if not self.cos.is_meta:
            self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = emb.cos().to(self.cos.device)
        self.sin = emb.sin().to(self.sin.device)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_tokens, 1, head_dim]`` tables for ``positions``, gathered once per forward and
        shared by every layer."""
        return (self.cos[positions].to(dtype).unsqueeze(1),
                self.sin[positions].to(dtype).unsqueeze(1))


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary embedding (Qwen2-VL's M-RoPE): positions have three rows (temporal,
    height, width), and each frequency takes its angle from one row. ``sections`` splits the
    ``head_dim / 2`` frequencies into consecutive runs, run ``i`` reading row ``i % 3``; for text
    the three rows are equal and this is the default rotary embedding."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 sections: list[int]) -> None:
        super().__init__(head_dim, max_positions, theta)
        if sum(sections) != head_dim // 2:
            raise ValueError(f"mrope_section {sections} must add up to head_dim / 2 = "
                             f"{head_dim // 2}")
        self.sections = list(sections)
        self.register_buffer("row_of_dim", torch.empty(head_dim, dtype=torch.long,
                                                       device=self.cos.device), persistent=False)
        if not self.cos.is_meta:
            self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        super().reset_buffers()
        if hasattr(self, "sections"):  # not yet during the base constructor
            rows = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(self.sections)])
            self.row_of_dim = torch.cat([rows, rows]).to(self.cos.device)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[3, num_tokens]`` -> ``[num_tokens, 1, head_dim]`` tables."""
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        index = self.row_of_dim.view(1, 1, -1).expand(1, positions.shape[1], -1)

        def gather(table: torch.Tensor) -> torch.Tensor:
            per_row = table[positions]  # [3, num_tokens, head_dim]
            return per_row.gather(0, index).squeeze(0).to(dtype).unsqueeze(1)

        return gather(self.cos), gather(self.sin)


def rotary_embedding_for(config, head_dim: int) -> RotaryEmbedding:
    """The decoder's rotary embedding: M-RoPE when the config names sections, else default."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    theta = rope_theta_of(config)
    sections = (params or {}).get("mrope_section")
    if sections is None and getattr(config, "model_type", "") in MROPE_TEXT_MODELS:
        sections = [16, 24, 24]  # transformers' default for these models
    if sections is None:
        return RotaryEmbedding(head_dim, config.max_position_embeddings, theta)
    return MRotaryEmbedding(head_dim, config.max_position_embeddings, theta, list(sections))


# Decoders whose positions have three rows (and default to M-RoPE's sections).
MROPE_TEXT_MODELS = ("qwen2_vl_text", "qwen2_5_vl_text")


def apply_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin
    # The kernel rounds where torch's ops round (no fused multiply-add): bit for bit equal.
    if ((ops := fused_kernels(q)) is not None and cos.dtype == q.dtype and q.stride(-1) == 1
            and k.stride(-1) == 1):
        return ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)
    return elementwise.rotary(q, cos, sin), elementwise.rotary(k, cos, sin)


class PagedAttention(nn.Module):
    """Attention over the paged KV cache; the runner binds ``kv_cache`` before serving."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                output_rows: OutputRows | None = None) -> torch.Tensor:
        """Every row's attention output; with ``output_rows``, every row's K/V written and the
        output of those rows alone (``[len(index), heads, head_dim]``)."""
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound to this attention layer")
        ctx = get_forward_context()  # the runner chose the backend for its device
        if output_rows is None:
            return ctx.attention(q, k, v, self.kv_cache, ctx.meta, self.scale)
        output_rows.write_kv(k, v, self.kv_cache)
        index = output_rows.index
        if not len(index):
            return q.new_empty(0, *q.shape[1:])
        # The backend writes these rows' K/V again (the same values in the same slots).
        return ctx.attention(q.index_select(0, index), k.index_select(0, index),
                             v.index_select(0, index), self.kv_cache, output_rows.meta,
                             self.scale)
