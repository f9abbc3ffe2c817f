"""Model FLOPs of engine steps, and the machine's measured matmul peak to compare them with.

Counts are of matmul work (2 FLOPs per multiply-add): the linear layers, attention scores and
weighted sums, the LM head on sampled rows, and the vision tower plus projector per encoded
image. Norms, activations and rotary embeddings are a few percent and are left out, so the
achieved figure slightly understates the work done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mmserve.step import SchedulerOutput


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs per unit of work of one checkpoint (LLaVA, Qwen2-VL or Qwen2.5-VL).

    An image's encoder FLOPs are a function of its embedding tokens: LLaVA's are one figure for
    every image (`encoder_per_item`); Qwen2-VL's vision tower runs over ``merge^2`` patches per
    token (`patches_per_token`), each costing `encoder_per_patch` in linear layers, and attention
    over the whole image in full-attention layers and over windows of at most `window_patches`
    patches in Qwen2.5-VL's others. Windows are counted whole: at an image's edges they are
    clipped smaller, so the count is exact for images whose patch grid the windows tile and an
    overcount of the window layers' attention otherwise.
    """

    decoder_per_token: int  # linear layers of all decoder layers
    attention_per_context_token: int  # QK^T and PV, all layers, per (query, key) pair
    lm_head_per_row: int
    encoder_per_item: int = 0  # LLaVA: vision tower up to the feature layer + projector
    patches_per_token: int = 0
    encoder_per_patch: int = 0  # patch embedding, every layer's linears, the merger's share
    vision_attention_per_pair: int = 0  # QK^T and PV of one layer, per (query, key) patch pair
    full_attention_layers: int = 0
    window_attention_layers: int = 0
    window_patches: int = 0

    @classmethod
    def from_hf_config(cls, config) -> ModelFlops:
        text = config.text_config
        h, layers = text.hidden_size, text.num_hidden_layers
        head_dim = getattr(text, "head_dim", None) or h // text.num_attention_heads
        q_dim = text.num_attention_heads * head_dim
        kv_dim = (text.num_key_value_heads or text.num_attention_heads) * head_dim
        per_layer = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * text.intermediate_size
        decoder = {"decoder_per_token": 2 * layers * per_layer,
                   "attention_per_context_token": 4 * layers * q_dim,
                   "lm_head_per_row": 2 * h * text.vocab_size}
        if config.model_type in ("qwen2_vl", "qwen2_5_vl"):
            return cls(**decoder, **_qwen2_vl_encoder(config.vision_config, h))
        return cls(**decoder, encoder_per_item=_llava_encoder(config, h))

    def encoder(self, num_tokens: int) -> int:
        """FLOPs of encoding one image into ``num_tokens`` embeddings."""
        patches = num_tokens * self.patches_per_token
        contexts = (self.full_attention_layers * patches
                    + self.window_attention_layers * min(patches, self.window_patches))
        return (self.encoder_per_item + patches * self.encoder_per_patch
                + patches * contexts * self.vision_attention_per_pair)

    def step(self, scheduled: SchedulerOutput) -> tuple[int, int]:
        """(decoder FLOPs, encoder FLOPs) of one scheduled step."""
        decodes = scheduled.decodes
        # Decode rows: one token at position p, attending to p + 1 keys.
        decoder = (len(decodes) * (self.decoder_per_token + self.lm_head_per_row)
                   + (sum(decodes.start_pos) + len(decodes)) * self.attention_per_context_token)
        for r in scheduled.chunks:
            n, start = len(r.token_ids), r.start_pos
            # Query at position p attends to p + 1 keys: sum over the chunk's positions.
            context = n * start + n * (n + 1) // 2
            decoder += n * self.decoder_per_token + context * self.attention_per_context_token
            if r.sample:
                decoder += self.lm_head_per_row
        return decoder, sum(self.encoder(n) for n in scheduled.images_to_encode.values())


def _llava_encoder(config, h: int) -> int:
    """A ViT run up to the feature layer (the layers past it are never built) + projector."""
    vision = config.vision_config
    vh, patch = vision.hidden_size, vision.patch_size
    num_patches = (vision.image_size // patch) ** 2
    seq = num_patches + 1  # CLIP's class token (SigLIP has none: a 0.5% overcount)
    # Feature layers index hidden_states: 0 is the embeddings, L the last layer's output.
    layers_sel = config.vision_feature_layer
    layers_sel = [layers_sel] if isinstance(layers_sel, int) else layers_sel
    vlayers = max(i % (vision.num_hidden_layers + 1) for i in layers_sel)
    vlayer = 2 * seq * (4 * vh * vh + 2 * vh * vision.intermediate_size) + 4 * seq * seq * vh
    patch_embed = 2 * num_patches * 3 * patch * patch * vh
    projector = 2 * num_patches * (vh * h + h * h)
    return patch_embed + vlayers * vlayer + projector


def _qwen2_vl_encoder(vision, h: int) -> dict[str, int]:
    """Qwen2-VL's tower (fc1/fc2 MLP, full attention) or Qwen2.5-VL's (gated MLP, windows)."""
    windowed = hasattr(vision, "window_size")
    # Qwen2-VL names the tower's width embed_dim (its hidden_size is the merger's output).
    vh = vision.hidden_size if windowed else vision.embed_dim
    mlp = 3 * vh * vision.intermediate_size if windowed else 2 * vh * vh * vision.mlp_ratio
    merge, patch = vision.spatial_merge_size, vision.patch_size
    merged = vh * merge * merge
    per_patch = (3 * vision.temporal_patch_size * patch * patch * vh  # 3-D patch embedding
                 + vision.depth * (4 * vh * vh + mlp)  # qkv, proj and the MLP of every layer
                 + vh * (merged + h))  # the merger's linears, per patch (merge^2 a token)
    full = len(vision.fullatt_block_indexes) if windowed else vision.depth
    return {"patches_per_token": merge * merge, "encoder_per_patch": 2 * per_patch,
            "vision_attention_per_pair": 4 * vh, "full_attention_layers": full,
            "window_attention_layers": vision.depth - full,
            "window_patches": (vision.window_size // patch) ** 2 if windowed else 0}


def measure_matmul_peak(dtype: torch.dtype, seconds: float = 1.0, size: int = 2048) -> float:
    """Best FLOP/s of square matmuls in ``dtype`` over about ``seconds`` (all torch threads)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # warm up (thread pool, packing)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        torch.mm(a, b)
        elapsed = time.perf_counter() - start
        best = max(best, 2 * size**3 / elapsed)
        if time.perf_counter() > deadline:
            return best
