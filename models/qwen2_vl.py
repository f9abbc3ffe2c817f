"""Qwen2-VL and Qwen2.5-VL: a dynamic-resolution vision tower and a Qwen2 decoder with M-RoPE.

An image of any size (``grid_h x grid_w`` patches, as the processor resized it) is one segment
of a packed patch sequence: the tower runs every image of a step in one pass, attention stays
within each image's boundaries (Qwen2.5-VL: within windows of the image, except in the layers
``fullatt_block_indexes`` names), and every ``merge x merge`` block of patches becomes one
embedding. Nothing is padded to the largest image. The decoder is Qwen2's, its rotary
embedding taking three rows of positions (``MRotaryEmbedding``); the positions themselves are
the family's (``mmserve/processing/qwen2_vl.py``).

Parameter names follow transformers 5 (``model.visual.*``, ``model.language_model.*``); the
published checkpoints' names (``visual.*``, ``model.layers.*``) are mapped onto them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional as F

from mmserve.kernels import elementwise
from mmserve.kernels.cpu_ops import packed_encoder_attention
from mmserve.models import parallel
from mmserve.models.layers import PagedAttention, RMSNorm, get_activation
from mmserve.models.llama import LlamaModel

# One image's encoder input: the processor's named tensors for it alone ("pixel_values":
# [patches, channels * temporal * patch * patch], "image_grid_thw": [1, 3]).
EncoderInput = Mapping[str, torch.Tensor]


class PatchEmbed(nn.Module):
    """The 3-D patch convolution; its kernel equals its stride, so it is one matrix product
    over the flattened patches the processor makes."""

    def __init__(self, patch_size: int, temporal_patch_size: int, in_channels: int,
                 embed_dim: int) -> None:
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel_size=kernel, stride=kernel,
                              bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1))


class VisionRotary(nn.Module):
    """2-D rotary embedding: half of each head's frequencies turn with the patch's row, half
    with its column."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.dim, self.theta = head_dim // 2, theta

    def cos_sin(self, rows_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[patches, 2]`` (row, column) -> float32 ``[patches, 1, head_dim]`` tables."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float) / self.dim
        inv_freq = 1.0 / (self.theta ** exponents)
        freqs = (rows_cols.unsqueeze(-1).float() * inv_freq).flatten(1)  # [n, dim]
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    """Attention over this rank's heads where the tower is split (``parallel.split_encoder``;
    its rows of q, k and v, stacked in one checkpoint tensor), over all of them otherwise."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        first, self.num_heads = parallel.even_share(num_heads, "vision attention heads",
                                                    encoder=True)
        width = self.num_heads * self.head_dim
        self.qkv = nn.Linear(dim, 3 * width)
        self.proj = nn.Linear(width, dim)
        if parallel.split_encoder():
            parallel.column_parallel(self.qkv, first * self.head_dim, width, stride=dim,
                                     count=3)
            parallel.row_parallel(self.proj, first * self.head_dim, width)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                boundaries: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = rope  # rotated in float32, as the reference does
        q = elementwise.rotary(q.float(), cos, sin).to(x.dtype)
        k = elementwise.rotary(k.float(), cos, sin).to(x.dtype)
        out = packed_encoder_attention(q, k, v, boundaries, self.head_dim ** -0.5)
        return parallel.encoder_all_reduce(self.proj(out.reshape(n, -1)))


class VisionMLP(nn.Module):
    """Qwen2-VL's: fc1, activation, fc2."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        start, hidden = parallel.even_share(hidden, "vision MLP size", encoder=True)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = get_activation(act)
        self.fc2 = nn.Linear(hidden, dim)
        parallel.split_encoder_mlp([self.fc1], self.fc2, start, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return parallel.encoder_all_reduce(self.fc2(self.act(self.fc1(x))))


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL's: a gated MLP with biases."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        start, hidden = parallel.even_share(hidden, "vision MLP size", encoder=True)
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = get_activation(act)
        parallel.split_encoder_mlp([self.gate_proj, self.up_proj], self.down_proj, start, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return parallel.encoder_all_reduce(
            self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, norm: type[nn.Module]) -> None:
        super().__init__()
        self.norm1 = norm(dim, 1e-6)
        self.norm2 = norm(dim, 1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                boundaries: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, boundaries)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm, then each ``merge x merge`` block of patches (consecutive in the processor's
    order) concatenated and projected to the decoder's width."""

    def __init__(self, out_dim: int, dim: int, merge: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = norm(dim, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(),
                                 nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


def _layer_norm(dim: int, eps: float) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=eps)


class VisionTransformer(nn.Module):
    """Qwen2-VL's tower (``windowed=False``) or Qwen2.5-VL's (RMSNorm, gated MLP, window
    attention)."""

    def __init__(self, config, windowed: bool) -> None:
        super().__init__()
        self.windowed = windowed
        self.merge = config.spatial_merge_size
        self.patch_size = config.patch_size
        if windowed:
            dim, out_dim = config.hidden_size, config.out_hidden_size
            self.window_size = config.window_size
            self.full_attention_layers = set(config.fullatt_block_indexes)

            def mlp() -> nn.Module:
                return GatedVisionMLP(dim, config.intermediate_size, config.hidden_act)
            norm = RMSNorm
        else:
            dim, out_dim = config.embed_dim, config.hidden_size

            def mlp() -> nn.Module:
                return VisionMLP(dim, int(dim * config.mlp_ratio), config.hidden_act)
            norm = _layer_norm
        self.patch_embed = PatchEmbed(config.patch_size, config.temporal_patch_size,
                                      config.in_channels, dim)
        params = getattr(config, "rope_parameters", None) or {}
        self.rotary = VisionRotary(dim // config.num_heads, float(params.get("rope_theta", 1e4)))
        self.blocks = nn.ModuleList(VisionBlock(dim, config.num_heads, mlp(), norm)
                                    for _ in range(config.depth))
        self.merger = PatchMerger(out_dim, dim, self.merge, norm)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Packed patches of the images with ``grids`` (t, h, w) -> their embeddings, packed
        in the same order: ``[sum(t * h * w) / merge^2, out_dim]``."""
        device = patches.device
        x = self.patch_embed(patches)
        rows_cols = _rows_cols(grids, self.merge)
        images = _boundaries([t * h * w for t, h, w in grids])
        if self.windowed:
            # Put each window's patches together (whole merge blocks move), run, put back.
            order, windows = self._window_order(grids)
            unit = self.merge * self.merge
            patch_order = (order.unsqueeze(1) * unit + torch.arange(unit)).flatten()
            x = x[patch_order.to(device)]
            rows_cols = rows_cols[patch_order]
        cos, sin = self.rotary.cos_sin(rows_cols)
        rope = (cos.to(device), sin.to(device))
        for i, block in enumerate(self.blocks):
            full = not self.windowed or i in self.full_attention_layers
            x = block(x, rope, images if full else windows)
        merged = self.merger(x)
        if self.windowed:
            merged = merged[torch.argsort(order).to(device)]
        return merged

    def _window_order(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """Merge blocks reordered window by window (row-major windows of
        ``window_size / patch_size / merge`` blocks a side, clipped at the image's edges), and
        the boundaries of the windows in patches."""
        side = self.window_size // self.patch_size // self.merge
        unit = self.merge * self.merge
        order, lengths, first = [], [], 0
        for t, h, w in grids:
            bh, bw = h // self.merge, w // self.merge
            index = torch.arange(t * bh * bw).view(t, bh, bw)
            for frame in index:
                for top in range(0, bh, side):
                    for left in range(0, bw, side):
                        window = frame[top:top + side, left:left + side].flatten()
                        order.append(window + first)
                        lengths.append(window.numel() * unit)
            first += t * bh * bw
        return torch.cat(order), _boundaries(lengths)


def _boundaries(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _rows_cols(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """Each patch's (row, column) in its image, in the processor's order: merge blocks
    row-major, and row-major patches within a block. ``[patches, 2]``."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        rows = rows.permute(0, 2, 1, 3).flatten()
        cols = cols.permute(0, 2, 1, 3).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


class Qwen2VLModel(nn.Module):
    def __init__(self, config, windowed: bool) -> None:
        super().__init__()
        self.visual = VisionTransformer(config.vision_config, windowed)
        self.language_model = LlamaModel(config.text_config)


class Qwen2VLForConditionalGeneration(nn.Module):
    """Entry points used by the runner: ``encode_images``, ``embed_tokens``, ``forward``,
    ``compute_logits``."""

    windowed = False
    checkpoint_renames = (
        (r"^visual\.", "model.visual."),
        (r"^model\.(?!language_model\.|visual\.)", "model.language_model."),
    )

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen2VLModel(config, self.windowed)
        text = config.text_config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False)
                                        or getattr(text, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = parallel.vocab_parallel_head(text.hidden_size, text.vocab_size)
        self.image_token_id = config.image_token_id
        self.hidden_size = text.hidden_size
        self.vocab_size = text.vocab_size

    def skipped_checkpoint_weight(self, name: str) -> bool:
        return self.tie_word_embeddings and name == "lm_head.weight"

    def attention_layers(self) -> list[PagedAttention]:
        return self.model.language_model.attention_layers()

    def encoder_modules(self) -> list[nn.Module]:
        """The modules that only encode images, so only ever see an image's tokens at a time
        (the CPU runner picks their linear layers' matmul for that)."""
        return [self.model.visual]

    def encode_images(self, items: list[EncoderInput]) -> list[torch.Tensor]:
        """Every image in one packed pass of the tower; one ``[tokens, hidden]`` per image."""
        grids = [tuple(int(v) for v in item["image_grid_thw"].reshape(3).tolist())
                 for item in items]
        patches = torch.cat([item["pixel_values"] for item in items])
        embeds = self.model.visual(patches, grids)
        merge = self.model.visual.merge
        return list(embeds.split([t * h * w // (merge * merge) for t, h, w in grids]))

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.language_model.embed_tokens(input_ids)

    def forward(self, positions: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return self.model.language_model(positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tie_word_embeddings:
            logits = hidden @ self.model.language_model.embed_tokens.weight.T
        else:
            logits = self.lm_head(hidden)
        return parallel.gather_vocab(logits, self.vocab_size).float()


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801
    windowed = True
