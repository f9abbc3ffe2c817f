"""Architectures by their Hugging Face name (``config.json``'s ``architectures``)."""

from __future__ import annotations

from torch import nn

from mmserve.models.llava import LlavaForConditionalGeneration
from mmserve.models.pooled_llava import PooledLlavaForConditionalGeneration
from mmserve.models.qwen2_vl import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
)

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "PooledLlavaForConditionalGeneration": PooledLlavaForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
}
SUPPORTED_ARCHITECTURES = tuple(sorted(_REGISTRY))


def get_model_class(hf_config) -> type[nn.Module]:
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in _REGISTRY:
            return _REGISTRY[name]
    raise ValueError(
        f"unsupported architecture {names or '(none in config.json)'}; mmserve supports: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}")
