"""CLIP and SigLIP vision towers (bidirectional ViTs) with Hugging Face parameter names."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.kernels.cpu_ops import encoder_attention
from mmserve.models import parallel
from mmserve.models.layers import MergedLinear, add_layer_norm, get_activation, quick_gelu
from mmserve.models.parallel import Window


class VisionAttention(nn.Module):
    """Attention over this rank's heads where the tower is split (``parallel.split_encoder``),
    over all of them otherwise. q, k and v are one matmul (the checkpoint's three layers
    merged): on a 2-core Xeon with AMX, 1,050 rows of CLIP-B's 768 took 1.1-1.2 ms in one
    bfloat16 matmul where three took 2.2."""

    def __init__(self, config) -> None:
        super().__init__()
        d = config.hidden_size
        self.head_dim = d // config.num_attention_heads
        first, self.num_heads = parallel.even_share(config.num_attention_heads,
                                                    "vision attention heads", encoder=True)
        width = self.num_heads * self.head_dim
        rows = Window(0, first * self.head_dim, width)
        self.qkv_proj = MergedLinear(
            d, {"q_proj": width, "k_proj": width, "v_proj": width}, bias=True,
            windows=dict.fromkeys(("q_proj", "k_proj", "v_proj"), rows)
            if parallel.split_encoder() else None)
        self.out_proj = nn.Linear(width, d)
        if parallel.split_encoder():
            parallel.row_parallel(self.out_proj, first * self.head_dim, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        # [b, n, 3, heads, head_dim]: q, k and v are strided views of the one output.
        q, k, v = self.qkv_proj(x).view(b, n, 3, self.num_heads, self.head_dim).unbind(2)
        o = encoder_attention(q, k, v, self.head_dim ** -0.5)
        return parallel.encoder_all_reduce(self.out_proj(o.reshape(b, n, -1)))


class VisionMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        start, size = parallel.even_share(config.intermediate_size, "vision MLP size",
                                          encoder=True)
        self.fc1 = nn.Linear(config.hidden_size, size)
        self.fc2 = nn.Linear(size, config.hidden_size)
        parallel.split_encoder_mlp([self.fc1], self.fc2, start, size)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = quick_gelu(h, in_place=True) if self.act is quick_gelu else self.act(h)
        return parallel.encoder_all_reduce(self.fc2(h))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = VisionAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, normed = add_layer_norm(self.self_attn(self.layer_norm1(x)), x, self.layer_norm2)
        return x + self.mlp(normed)


class VisionEncoder(nn.Module):
    def __init__(self, config, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(num_layers))


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d = config.hidden_size
        self.class_embedding = nn.Parameter(torch.zeros(d))
        self.patch_embedding = nn.Conv2d(config.num_channels, d, config.patch_size,
                                         stride=config.patch_size, bias=False)
        num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, d)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # [b, n, d]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d = config.hidden_size
        self.patch_embedding = nn.Conv2d(config.num_channels, d, config.patch_size,
                                         stride=config.patch_size)
        num_positions = (config.image_size // config.patch_size) ** 2
        self.position_embedding = nn.Embedding(num_positions, d)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # [b, n, d]
        return patches + self.position_embedding.weight


class VisionTransformer(nn.Module):
    """Runs the tower only as deep as the selected feature layer(s) need.

    ``feature_layers`` index Hugging Face's ``hidden_states`` tuple: 0 is the embedding output
    and ``num_hidden_layers`` the last layer's output. Layers past the deepest selected one are
    never built, and their checkpoint weights are skipped.
    """

    def __init__(self, config, feature_layers: list[int]) -> None:
        super().__init__()
        if config.model_type not in ("clip_vision_model", "siglip_vision_model"):
            raise ValueError(f"unsupported vision tower {config.model_type!r}; "
                             "supported: clip_vision_model, siglip_vision_model")
        self.model_type = config.model_type
        self.num_hidden_layers = config.num_hidden_layers
        self.feature_layers = [i % (config.num_hidden_layers + 1) for i in feature_layers]
        depth = max(self.feature_layers)
        if self.model_type == "clip_vision_model":
            self.embeddings = CLIPVisionEmbeddings(config)
            self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        else:
            self.embeddings = SiglipVisionEmbeddings(config)
        # Hidden states are taken before the tower's post-layernorm, which LLaVA never uses.
        self.encoder = VisionEncoder(config, depth)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        x = self.embeddings(pixel_values)
        if self.model_type == "clip_vision_model":
            x = self.pre_layrnorm(x)
        hidden_states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            hidden_states.append(x)
        return [hidden_states[i] for i in self.feature_layers]
