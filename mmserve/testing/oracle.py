"""The correctness oracle of the tests: greedy generation with transformers' own implementation.

`hf_greedy_generate` loads a checkpoint directory with the transformers class named in its
``config.json`` (``architectures``) and its ``AutoProcessor``, in float32, so it serves every
family the fixtures build.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["hf_greedy_generate"]

_HF_CACHE: dict[str, tuple[Any, Any]] = {}


def _load_hf(path: str | os.PathLike[str]) -> tuple[Any, Any]:
    """Load (and cache per resolved path) the float32 reference model and its processor."""
    key = str(pathlib.Path(path).resolve())
    if key not in _HF_CACHE:
        import transformers

        config = json.loads((pathlib.Path(key) / "config.json").read_text(encoding="utf-8"))
        model_class = getattr(transformers, config["architectures"][0])
        model = model_class.from_pretrained(key, dtype=torch.float32)
        model.eval()
        _HF_CACHE[key] = (model, transformers.AutoProcessor.from_pretrained(key))
    return _HF_CACHE[key]


@torch.no_grad()
def hf_greedy_generate(
    path: str | os.PathLike[str],
    prompt_text: str,
    images: list[Image.Image],
    max_new_tokens: int,
) -> list[int]:
    """Greedily generate with the reference Hugging Face model and return the new token ids.

    ``prompt_text`` is the already-templated prompt with one image placeholder per image (LLaVA:
    ``<image>``); the processor expands the placeholders and adds what the tokenizer adds (LLaVA:
    a leading ``<s>``). Generation stops at the eos token (included in the result) or after
    ``max_new_tokens`` tokens.
    """
    model, processor = _load_hf(path)
    inputs = processor(text=prompt_text, images=images or None, return_tensors="pt")
    output = model.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=processor.tokenizer.pad_token_id,
    )
    prompt_len = inputs["input_ids"].shape[1]
    return [int(token) for token in output[0, prompt_len:].tolist()]
