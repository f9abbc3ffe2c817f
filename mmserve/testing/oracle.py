"""The correctness oracle of the tests: greedy generation with transformers' own implementation.

`hf_greedy_generate` loads a checkpoint directory with the transformers class named in its
``config.json`` (``architectures``) and its ``AutoProcessor``, in float32, so it serves every
family the fixtures build. Qwen2-VL's and Qwen2.5-VL's ``AutoProcessor`` needs torchvision (for
its video processor); without it the oracle uses the same processor less the video processor
(`mmserve.processing.hf_processors.load_qwen2_vl_processor`), which is what the serving code
uses too.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["hf_beam_search", "hf_greedy_generate", "hf_image_embeds", "hf_token_logprobs",
           "load_hf_processor"]

_HF_CACHE: dict[str, tuple[Any, Any]] = {}
_QWEN2_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def load_hf_processor(path: str | os.PathLike[str]) -> Any:
    """The checkpoint's ``AutoProcessor``; for Qwen2-VL and Qwen2.5-VL where it cannot be built
    (no torchvision), `load_qwen2_vl_processor`."""
    import transformers

    try:
        return transformers.AutoProcessor.from_pretrained(path, local_files_only=True)
    except ImportError:
        config = json.loads((pathlib.Path(path) / "config.json").read_text(encoding="utf-8"))
        if config.get("model_type") not in _QWEN2_VL_TYPES:
            raise
    from mmserve.processing.hf_processors import load_qwen2_vl_processor

    return load_qwen2_vl_processor(path)


def _load_hf(path: str | os.PathLike[str]) -> tuple[Any, Any]:
    """Load (and cache per resolved path) the float32 reference model and its processor."""
    key = str(pathlib.Path(path).resolve())
    if key not in _HF_CACHE:
        import transformers

        config = json.loads((pathlib.Path(key) / "config.json").read_text(encoding="utf-8"))
        model_class = getattr(transformers, config["architectures"][0])
        model = model_class.from_pretrained(key, dtype=torch.float32)
        model.eval()
        _HF_CACHE[key] = (model, load_hf_processor(key))
    return _HF_CACHE[key]


# The processor's outputs with a value per prompt token.
PER_TOKEN_INPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


def _truncated(inputs: Any, keep_last: int, added: list[int]) -> dict[str, Any]:
    """The processor's ``inputs`` of a prompt cut to its last ``keep_last`` tokens, the
    tokens the tokenizer ``added`` at its start (a BOS) kept there, as transformers'
    truncation keeps them."""
    ids = inputs["input_ids"][0].tolist()
    kept = min(len(added) if added and ids[:len(added)] == added else 0, keep_last)
    keep = list(range(kept)) + list(range(len(ids) - (keep_last - kept), len(ids)))
    if len(ids) <= keep_last:
        return dict(inputs)
    index = torch.tensor(keep)
    return {name: value[:, index] if name in PER_TOKEN_INPUTS else value
            for name, value in inputs.items()}


@torch.no_grad()
def hf_greedy_generate(
    path: str | os.PathLike[str],
    prompt_text: str,
    images: list[Image.Image],
    max_new_tokens: int,
    generate_kwargs: dict[str, Any] | None = None,
    keep_last: int | None = None,
    **processor_kwargs: Any,
) -> list[int]:
    """Greedily generate with the reference Hugging Face model and return the new token ids.

    ``prompt_text`` is the already-templated prompt with one image placeholder per image (LLaVA:
    ``<image>``; Qwen2-VL: ``<|image_pad|>``, inside ``<|vision_start|>...<|vision_end|>``); the
    processor expands the placeholders and adds what the tokenizer adds (LLaVA: a leading
    ``<s>``; Qwen2-VL: nothing). All the processor's outputs go to ``generate`` (Qwen2-VL: the
    image grids and token types its M-RoPE positions are computed from). Generation stops at the
    eos token (included in the result) or after ``max_new_tokens`` tokens. ``processor_kwargs``
    go to the processor's call (image-processor settings such as Qwen2-VL's ``max_pixels``),
    ``generate_kwargs`` to ``generate`` (``repetition_penalty``, ``logits_processor``...).
    ``keep_last``: only the prompt's last tokens, as many (vLLM's ``truncate_prompt_tokens``).
    """
    model, processor = _load_hf(path)
    inputs = processor(text=prompt_text, images=images or None, return_tensors="pt",
                       **processor_kwargs)
    if keep_last is not None:  # the prompt's last tokens (its images among them)
        inputs = _truncated(inputs, keep_last, processor.tokenizer("")["input_ids"])
    output = model.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=processor.tokenizer.pad_token_id,
        **(generate_kwargs or {}),
    )
    prompt_len = inputs["input_ids"].shape[1]
    return [int(token) for token in output[0, prompt_len:].tolist()]


@torch.no_grad()
def hf_image_embeds(path: str | os.PathLike[str], images: list[Image.Image],
                    **processor_kwargs: Any) -> list[tuple[torch.Tensor, tuple[int, ...] | None]]:
    """Each image's embeddings as the reference model makes them (its ``get_image_features``:
    the vision tower and the projector), ``[tokens, hidden]``, with the image's patch grid
    (``image_grid_thw``) where its processor gives one: what a client sends as
    ``image_embeds`` in place of the image."""
    model, processor = _load_hf(path)
    out = []
    for image in images:
        inputs = processor.image_processor([image], return_tensors="pt", **processor_kwargs)
        grid = inputs.get("image_grid_thw")
        features = model.get_image_features(
            pixel_values=inputs["pixel_values"],
            **({} if grid is None else {"image_grid_thw": grid}))
        # transformers 5 returns the projected features as ``pooler_output`` (one tensor per
        # image); earlier versions return them as a tensor.
        pooled = getattr(features, "pooler_output", features)
        embeds = pooled[0] if isinstance(pooled, (list, tuple)) else pooled
        out.append((embeds.reshape(-1, embeds.shape[-1]).clone(),
                    None if grid is None else tuple(int(v) for v in grid[0])))
    return out


@torch.no_grad()
def hf_beam_search(
    path: str | os.PathLike[str],
    prompt_text: str,
    images: list[Image.Image],
    num_beams: int,
    max_new_tokens: int,
    **generate_kwargs: Any,
) -> list[tuple[list[int], float | None]]:
    """transformers' beam search (``generate(num_beams=..., do_sample=False)``) of a
    templated prompt, as `hf_greedy_generate` takes it: every one of the ``num_beams``
    sequences, best first, as its new token ids (up to and including the end-of-sequence
    token that ended it, without the padding after) and its score (None for
    ``num_beams=1``, which transformers runs as greedy search). ``generate_kwargs``:
    ``length_penalty``, ``early_stopping``..."""
    model, processor = _load_hf(path)
    inputs = processor(text=prompt_text, images=images or None, return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, num_beams=num_beams,
                         num_return_sequences=num_beams, max_new_tokens=max_new_tokens,
                         output_scores=True, return_dict_in_generate=True,
                         pad_token_id=processor.tokenizer.pad_token_id, **generate_kwargs)
    eos = model.generation_config.eos_token_id
    ends = set(eos if isinstance(eos, list) else [eos])
    prompt_len = inputs["input_ids"].shape[1]
    scores = getattr(out, "sequences_scores", None)
    found = []
    for tokens, score in zip(out.sequences[:, prompt_len:].tolist(),
                             [None] * num_beams if scores is None else scores.tolist(),
                             strict=True):
        length = next((i + 1 for i, t in enumerate(tokens) if t in ends), len(tokens))
        found.append((tokens[:length], score))
    return found


@torch.no_grad()
def hf_last_hidden_state(path: str | os.PathLike[str], prompt_text: str,
                         images: list[Image.Image], pooling: str = "last",
                         **processor_kwargs: Any) -> torch.Tensor:
    """The reference model's final hidden state (after the decoder's last norm, what the LM
    head reads) at the templated ``prompt_text``'s last token: what an embedding of the
    prompt pools, ``[hidden]``, float32; with ``pooling`` "mean" the mean of every token's,
    "cls" the first token's."""
    model, processor = _load_hf(path)
    inputs = processor(text=prompt_text, images=images or None, return_tensors="pt",
                       **processor_kwargs)
    out = model(**inputs, output_hidden_states=True)
    states = out.hidden_states[-1][0].float()
    if pooling == "mean":
        return states.mean(0)
    return states[0 if pooling == "cls" else -1].clone()


@torch.no_grad()
def hf_token_logprobs(
    path: str | os.PathLike[str],
    prompt_text: str,
    images: list[Image.Image],
    token_ids: list[int],
) -> torch.Tensor:
    """transformers' log-softmax over the vocabulary at each of ``token_ids`` (a continuation of
    the templated ``prompt_text``), teacher-forced in one float32 forward pass: row ``j`` is the
    distribution the model gave token ``j``, ``[len(token_ids), vocab]``."""
    model, processor = _load_hf(path)
    inputs = dict(processor(text=prompt_text, images=images or None, return_tensors="pt"))
    prompt_len = inputs["input_ids"].shape[1]
    given = torch.tensor([token_ids[:-1]], dtype=inputs["input_ids"].dtype)
    for name, value in inputs.items():  # the per-token inputs grow with the continuation
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == prompt_len:
            extra = given if name == "input_ids" else (torch.ones_like(given) if name ==
                                                       "attention_mask" else
                                                       torch.zeros_like(given))
            inputs[name] = torch.cat([value, extra.to(value.dtype)], dim=1)
    logits = model(**inputs).logits[0, prompt_len - 1:prompt_len - 1 + len(token_ids)]
    return torch.log_softmax(logits.float(), dim=-1)
