"""Model families' processing rules by Hugging Face architecture name (``config.json``'s
``architectures``), as ``mmserve/models/registry.py`` registers their modules."""

from __future__ import annotations

from typing import Any

from mmserve.processing.family import MultiModalFamily
from mmserve.processing.llava import LlavaFamily
from mmserve.processing.pooled_llava import PooledLlavaFamily
from mmserve.processing.qwen2_vl import Qwen2VLFamily

_REGISTRY: dict[str, type[MultiModalFamily]] = {
    "LlavaForConditionalGeneration": LlavaFamily,
    "PooledLlavaForConditionalGeneration": PooledLlavaFamily,
    "Qwen2VLForConditionalGeneration": Qwen2VLFamily,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLFamily,
}


def family_for(model_dir: str, hf_config, mm_processor_kwargs: dict[str, Any] | None = None,
               max_image_size: tuple[int, int] | None = None) -> MultiModalFamily:
    """The family of the checkpoint in ``model_dir`` under these processor settings."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in _REGISTRY:
            return _REGISTRY[name](model_dir, hf_config, mm_processor_kwargs, max_image_size)
    raise ValueError(
        f"unsupported architecture {names or '(none in config.json)'}; mmserve supports: "
        f"{', '.join(sorted(_REGISTRY))}")
