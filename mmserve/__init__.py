"""mmserve: serving image+text language models with one budget for the KV and encoder caches."""

from mmserve.config import EngineConfig
from mmserve.entrypoints.llm import LLM
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
