"""Llama-family decoders (Llama, Mistral, Qwen2, and Qwen2-VL's with M-RoPE) over the paged KV
cache.

Parameter names follow the Hugging Face checkpoints so weights load by name.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.kernels.fused import fused_kernels
from mmserve.models import parallel
from mmserve.models.forward_context import OutputRows, get_forward_context
from mmserve.models.layers import (
    MergedLinear,
    PagedAttention,
    RMSNorm,
    apply_rotary,
    get_activation,
    rotary_embedding_for,
)
from mmserve.models.parallel import Window

SUPPORTED_TEXT_MODELS = ("llama", "mistral", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text")
# Qwen2's attention: q/k/v biases always, none on the output projection.
_QWEN2_ATTENTION = ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    """Self-attention over this rank's heads (all of them with one rank): q/k/v rows of its
    heads, o_proj's matching input columns, and an all-reduce of o_proj's partial sums."""

    def __init__(self, config) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = d = head_dim_of(config)
        first_head, self.num_heads = parallel.even_share(total_heads, "attention heads")
        first_kv_head, self.num_kv_heads = parallel.kv_heads_of_rank(total_kv_heads)
        # Qwen2 always has q/k/v biases; Llama and Mistral only when the config says so.
        qwen2 = config.model_type in _QWEN2_ATTENTION
        qkv_bias = qwen2 or bool(getattr(config, "attention_bias", False))
        o_bias = not qwen2 and bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        kv_rows = Window(0, first_kv_head * d, kv_size)
        self.qkv_proj = MergedLinear(
            hidden, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, bias=qkv_bias,
            windows={"q_proj": Window(0, first_head * d, q_size), "k_proj": kv_rows,
                     "v_proj": kv_rows} if parallel.tp_size() > 1 else None)
        self.qkv_sizes = [q_size, kv_size, kv_size]
        self.o_proj = nn.Linear(q_size, hidden, bias=o_bias)
        parallel.row_parallel(self.o_proj, first_head * d, q_size)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                output_rows: OutputRows | None = None) -> torch.Tensor:
        """Every row's output; with ``output_rows``, every row's K/V written and the output of
        those rows alone."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        # Its own copy, so that the merged output (q and k are rotated into new tensors) is
        # freed before attention rather than held through it: the step's peak stays as low as
        # with three projections.
        v = v.reshape(n, self.num_kv_heads, self.head_dim).contiguous()
        q, k = apply_rotary(q, k, rope)
        o = self.attn(q, k, v, output_rows)
        return parallel.all_reduce(self.o_proj(o.flatten(1)))


class DecoderMLP(nn.Module):
    """The gated MLP over this rank's share of the intermediate size (all of it with one
    rank), down_proj's partial sums all-reduced."""

    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        start, size = parallel.even_share(config.intermediate_size, "MLP intermediate size")
        rows = Window(0, start, size)
        self.fused_silu = config.hidden_act == "silu"
        self.gate_up_proj = MergedLinear(
            config.hidden_size, {"gate_proj": size, "up_proj": size}, bias=bias,
            windows={"gate_proj": rows, "up_proj": rows} if parallel.tp_size() > 1 else None,
            fused_activation="silu_and_mul" if self.fused_silu else None)
        self.intermediate_size = size
        self.down_proj = nn.Linear(size, config.hidden_size, bias=bias)
        parallel.row_parallel(self.down_proj, start, size)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.gate_up_proj, "applies_activation", False):
            # The CPU's packed layer computes silu(gate) * up from its sums (PackedSiluAndMul).
            return parallel.all_reduce(self.down_proj(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        if self.fused_silu and (ops := fused_kernels(x)) is not None:
            h = ops.silu_and_mul(gate, up)
        else:  # in place: a third tensor beside the merged output would raise the peak
            h = self.act(gate).mul_(up)
        del gate, up  # the merged output goes before down_proj allocates its own
        return parallel.all_reduce(self.down_proj(h))


class DecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config)
        self.mlp = DecoderMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def _attend(self, residual: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                carry: list[torch.Tensor], output_rows: OutputRows | None = None) -> torch.Tensor:
        """The attention output, after the last layer's MLP output (taken from ``carry``,
        where there is one) is added into the residual stream, in place, fused with the norm
        after it."""
        norm = self.input_layernorm
        normed = norm.add_and_norm(carry.pop(), residual) if carry else norm(residual)
        return self.self_attn(normed, rope, output_rows)

    def forward(self, residual: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                carry: list[torch.Tensor]) -> None:
        """Add the last layer's MLP output and this layer's attention output into the residual
        stream, in place, each add fused with the norm after it. ``carry`` holds the last
        layer's MLP output (empty before the first layer) and is left holding this layer's,
        for the next norm to add: a list the output leaves, so that no caller keeps it alive
        through the next layer."""
        attn_out = self._attend(residual, rope, carry)
        normed = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        del attn_out  # gone before the MLP allocates
        carry.append(self.mlp(normed))

    def forward_rows(self, residual: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                     carry: list[torch.Tensor], output_rows: OutputRows) -> torch.Tensor:
        """The layer for the rows that leave the pass: every row's K/V written, the rest
        computed for ``output_rows`` alone. Returns their residual stream (a new tensor
        ``[len(index), hidden]``), their MLP output left in ``carry`` as ``forward`` does."""
        attn_out = self._attend(residual, rope, carry, output_rows)
        residual = residual.index_select(0, output_rows.index)
        normed = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        del attn_out
        carry.append(self.mlp(normed))
        return residual


class LlamaModel(nn.Module):
    """The decoder stack without its LM head: ``[num_tokens, hidden]`` in and out."""

    def __init__(self, config) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_TEXT_MODELS:
            raise ValueError(f"unsupported language model {config.model_type!r}; "
                             f"supported: {', '.join(SUPPORTED_TEXT_MODELS)}")
        window = getattr(config, "sliding_window", None)
        if window is not None and getattr(config, "use_sliding_window", True):
            raise ValueError(
                f"sliding-window attention (sliding_window={window}) is not supported yet; "
                "use a checkpoint without it.")
        self.embed_tokens = parallel.VocabParallelEmbedding(config.vocab_size,
                                                            config.hidden_size)
        self.rotary = rotary_embedding_for(config, head_dim_of(config))
        self.layers = nn.ModuleList(DecoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """Every row's final hidden state, or only those of the forward context's
        ``output_rows`` (in their order) when the runner names some."""
        rope = self.rotary.cos_sin(positions, inputs_embeds.dtype)
        # The residual stream, which every layer adds into in place: the embeddings are the
        # forward pass's own tensor (the runner builds them for it).
        # Each layer's MLP output is added by the next norm, in its pass over the stream.
        residual, carry = inputs_embeds, []
        *body, last = self.layers
        for layer in body:
            layer(residual, rope, carry)
        output_rows = get_forward_context().output_rows
        if output_rows is None:
            last(residual, rope, carry)
        else:
            # Only these rows' hidden states are read: the last layer computes theirs alone.
            residual = last.forward_rows(residual, rope, carry, output_rows)
        return self.norm.add_and_norm(carry.pop(), residual)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]
