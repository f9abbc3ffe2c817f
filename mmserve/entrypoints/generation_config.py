"""Default sampling parameters from a checkpoint's ``generation_config.json``, as vLLM takes
them (its ``--generation-config``): a model's authors write there how it should be sampled
(Qwen2-VL's a repetition penalty of 1.05 and near-greedy top-k and top-p), and a request that
leaves a field out gets their value instead of mmserve's own.

The fields taken are vLLM's: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, and ``max_new_tokens`` as the default ``max_tokens``. Like vLLM, and
unlike transformers' ``generate``, ``do_sample`` is not read: a temperature written there is
used. A temperature between 0 and ``MIN_TEMPERATURE`` (Qwen2.5-VL writes 1e-06) is raised to
it, as vLLM does; any other value a request could not have is an error at start-up naming the
file and the field.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mmserve.config import EngineConfig
from mmserve.entrypoints.openai_protocol import MAX_API_TEMPERATURE
from mmserve.errors import InvalidInputError
from mmserve.sampling_params import MIN_TEMPERATURE, SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json's name -> SamplingParams' name.
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(config: EngineConfig) -> dict[str, Any]:
    """The ``SamplingParams`` fields a request that leaves them out gets, by
    ``config.generation_config``: ``auto``, the checkpoint's ``generation_config.json`` (none
    where it has none); ``vllm``, none (mmserve's own defaults); else a folder holding a
    ``generation_config.json``. ``ValueError`` saying what is wrong with the file."""
    setting = config.generation_config
    if setting == "vllm":
        return {}
    path = Path(config.model if setting == "auto" else setting) / "generation_config.json"
    if not path.is_file():
        if setting == "auto":
            return {}
        raise ValueError(f"generation_config={setting!r}: no generation_config.json in that "
                         "folder; give the folder holding one, 'auto' (the checkpoint's) or "
                         "'vllm' (mmserve's defaults).")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}.")
    defaults = {ours: raw[theirs] for theirs, ours in FIELDS.items()
                if raw.get(theirs) is not None}
    temperature = defaults.get("temperature")
    if (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            and 0 < temperature < MIN_TEMPERATURE):
        defaults["temperature"] = MIN_TEMPERATURE
    try:
        SamplingParams(**defaults)
        if defaults.get("temperature", 0) > MAX_API_TEMPERATURE:  # what the server takes
            raise InvalidInputError(f"temperature must be at most {MAX_API_TEMPERATURE:g} "
                                    f"(OpenAI's limit), got {defaults['temperature']!r}.")
    except InvalidInputError as e:
        raise ValueError(f"{path}: {e} Fix the file, or start with generation_config='vllm' "
                         "to leave it out.") from None
    if defaults:
        logger.info("default sampling parameters from %s: %s (a request's own values come "
                    "first; --generation-config vllm leaves the file out)", path,
                    ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults
