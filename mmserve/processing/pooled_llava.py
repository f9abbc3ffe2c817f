"""Pooled LLaVA's processing rules: LLaVA's processor and pixels, a quarter of the tokens per
image (the model pools the patch grid 2 x 2; ``models/pooled_llava.py``)."""

from __future__ import annotations

from typing import Any

from mmserve.models.pooled_llava import POOL
from mmserve.processing.llava import LlavaFamily


class PooledLlavaFamily(LlavaFamily):
    def __init__(self, model_dir: str, hf_config, mm_processor_kwargs: dict[str, Any] | None = None,
                 max_image_size: tuple[int, int] | None = None) -> None:
        # LLaVA's probe and checks: every image becomes the tower's one input size.
        super().__init__(model_dir, hf_config, mm_processor_kwargs, max_image_size)
        height, width = self._side
        patch = self.processor.patch_size
        self.tokens_per_image = (height // patch // POOL) * (width // patch // POOL)
