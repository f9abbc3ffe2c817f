"""Pooled LLaVA: LLaVA whose patch features are average-pooled 2 x 2 before the projector, so
an image is a quarter of the tokens. No published checkpoint has this architecture; it exists
to show that a family with its own tokens per image is one module, its registration and its
tests (its processing rules: ``mmserve/processing/pooled_llava.py``)."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from mmserve.models.llava import LlavaForConditionalGeneration

POOL = 2  # patches per pooled token along each side


class PooledLlavaForConditionalGeneration(LlavaForConditionalGeneration):
    def __init__(self, config) -> None:
        super().__init__(config)
        if not self.model.drop_cls:
            raise ValueError("PooledLlavaForConditionalGeneration pools a square grid of "
                             "patches: vision_feature_select_strategy must be 'default'")

    def encode_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[num_images, 3, H, W]`` -> ``[num_images, (H/patch/2) * (W/patch/2), hidden]``."""
        features = self.model.vision_tower(pixel_values)
        x = torch.cat([f[:, 1:] for f in features], dim=-1)  # [n, side * side, dim]
        n, num_patches, dim = x.shape
        side = math.isqrt(num_patches)
        grid = x.transpose(1, 2).reshape(n, dim, side, side)
        pooled = F.avg_pool2d(grid, POOL)  # [n, dim, side / 2, side / 2]
        return self.model.multi_modal_projector(pooled.flatten(2).transpose(1, 2))
