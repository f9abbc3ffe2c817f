"""mmserve: serving image+text language models with one budget for the KV and encoder caches.

The names below are imported on first use, so that a process importing one part of the
package (a tensor-parallel worker imports the worker and the models) does not load the
engine, the processors and the structured-output library with them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmserve.beam_search import BeamSearchOutput, BeamSearchParams
    from mmserve.config import EngineConfig
    from mmserve.entrypoints.llm import LLM
    from mmserve.inputs import ImageEmbeds
    from mmserve.lora_request import LoRARequest
    from mmserve.outputs import EmbeddingRequestOutput, RequestOutput
    from mmserve.sampling_params import SamplingParams

_EXPORTS = {
    "BeamSearchOutput": "mmserve.beam_search",
    "BeamSearchParams": "mmserve.beam_search",
    "EmbeddingRequestOutput": "mmserve.outputs",
    "EngineConfig": "mmserve.config",
    "ImageEmbeds": "mmserve.inputs",
    "LLM": "mmserve.entrypoints.llm",
    "LoRARequest": "mmserve.lora_request",
    "RequestOutput": "mmserve.outputs",
    "SamplingParams": "mmserve.sampling_params",
}

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "EmbeddingRequestOutput",
           "EngineConfig", "ImageEmbeds", "LoRARequest", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mmserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
