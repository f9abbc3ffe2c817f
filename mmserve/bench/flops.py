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
    """FLOPs per unit of work of one LLaVA checkpoint."""

    decoder_per_token: int  # linear layers of all decoder layers
    attention_per_context_token: int  # QK^T and PV, all layers, per (query, key) pair
    lm_head_per_row: int
    encoder_per_image: int  # vision tower up to the feature layer + projector

    @classmethod
    def from_hf_config(cls, config) -> ModelFlops:
        text, vision = config.text_config, config.vision_config
        h, layers = text.hidden_size, text.num_hidden_layers
        head_dim = getattr(text, "head_dim", None) or h // text.num_attention_heads
        q_dim = text.num_attention_heads * head_dim
        kv_dim = (text.num_key_value_heads or text.num_attention_heads) * head_dim
        per_layer = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * text.intermediate_size
        # Vision: a ViT run up to the feature layer (the layers past it are never built).
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
        return cls(
            decoder_per_token=2 * layers * per_layer,
            attention_per_context_token=4 * layers * q_dim,
            lm_head_per_row=2 * h * text.vocab_size,
            encoder_per_image=patch_embed + vlayers * vlayer + projector,
        )

    def step(self, scheduled: SchedulerOutput) -> tuple[int, int]:
        """(decoder FLOPs, encoder FLOPs) of one scheduled step."""
        decoder = 0
        for r in scheduled.requests:
            n, start = len(r.token_ids), r.start_pos
            # Query at position p attends to p + 1 keys: sum over the chunk's positions.
            context = n * start + n * (n + 1) // 2
            decoder += n * self.decoder_per_token + context * self.attention_per_context_token
            if r.sample:
                decoder += self.lm_head_per_row
        return decoder, len(scheduled.images_to_encode) * self.encoder_per_image


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
