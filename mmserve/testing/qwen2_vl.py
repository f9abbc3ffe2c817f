"""The Qwen2-VL family's tiny checkpoints: Qwen2-VL and Qwen2.5-VL, in two directory layouts.

`build_tiny_qwen2_vl` writes a complete ``Qwen2VLForConditionalGeneration`` (or, with
``variant="qwen2_5_vl"``, ``Qwen2_5_VLForConditionalGeneration``) checkpoint directory that
transformers loads offline, with the tokenizer of `mmserve.testing.tokenizer` under Qwen's special
tokens `QWEN_SPECIAL_TOKENS` (no bos; eos ``<|im_end|>``, pad ``<|endoftext|>``), the ChatML chat
template `CHAT_TEMPLATE` and the PIL image processor ``Qwen2VLImageProcessorPil`` (both variants
use it), whose ``min_pixels``/``max_pixels`` default small so that an image is at most 64 tokens.

Two layouts of the same weights: ``"transformers"`` is transformers' own (nested
``text_config``, weights named ``model.language_model.*`` and ``model.visual.*``, as
``save_pretrained(save_original_format=False)`` writes them, and as transformers 4.52 to 4.57
saved them by default); ``"published"`` is Qwen's layout on the Hub (a flat config with
``rope_scaling: {"type": "mrope", ...}`` and Qwen's vision field names, weights named
``model.*``, ``visual.*`` and ``lm_head.*``, the published ``preprocessor_config.json`` and a
``chat_template.json``), which transformers renames when it loads them.

The ``lm_head`` rows of every special token but ``<|im_end|>`` and ``<|endoftext|>`` are zero, so
greedy decoding never emits them. With ``tie_word_embeddings=True`` the checkpoint has no
``lm_head`` and those rows are the embedding rows: the special tokens then enter the model as zero
vectors (the image placeholders are replaced by image features anyway).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import torch

from mmserve.testing.checkpoint import random_model, save_checkpoint
from mmserve.testing.tokenizer import SpecialTokens, build_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "IMAGE_PLACEHOLDER",
    "QWEN_SPECIAL_TOKENS",
    "build_tiny_qwen2_5_vl",
    "build_tiny_qwen2_vl",
]

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VISION_PAD = "<|vision_pad|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# Ids 0..7 in this order (Qwen's own order, from 151643 on, less the object/box tokens).
QWEN_SPECIAL_TOKENS = SpecialTokens(
    (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, VISION_PAD, IMAGE_PAD, VIDEO_PAD),
    eos=IM_END,
    pad=ENDOFTEXT,
)
# What an image part renders as; the processor repeats ``<|image_pad|>`` once per image token.
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END

# A Qwen2-VL-like ChatML template: "<|im_start|>ROLE\n...<|im_end|>\n" per message, a default
# system message when the first message is not one, the parts of a list content concatenated in
# order (text as is, each image as `IMAGE_PLACEHOLDER`), and "<|im_start|>assistant\n" as the
# generation prompt, e.g. "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n
# <|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what is this?<|im_end|>\n
# <|im_start|>assistant\n".
DEFAULT_SYSTEM_MESSAGE = "You are a helpful assistant."


def _output(text: str) -> str:
    """A Jinja expression statement that writes ``text``."""
    return "{{- " + repr(text) + " -}}"


CHAT_TEMPLATE = "".join([
    "{%- for message in messages -%}",
    "{%- if loop.first and message['role'] != 'system' -%}",
    _output(f"{IM_START}system\n{DEFAULT_SYSTEM_MESSAGE}{IM_END}\n"),
    "{%- endif -%}",
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}",
    "{{- raise_exception('Unsupported role: ' ~ message['role']) -}}",
    "{%- endif -%}",
    _output(IM_START), "{{- message['role'] -}}", _output("\n"),
    "{%- if message['content'] is string -%}{{- message['content'] -}}",
    "{%- elif message['content'] is not none -%}",
    "{%- for part in message['content'] -%}",
    "{%- if part['type'] in ['image', 'image_url'] -%}", _output(IMAGE_PLACEHOLDER),
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}",
    "{%- else -%}{{- raise_exception('Unsupported content part: ' ~ part['type']) -}}",
    "{%- endif -%}",
    "{%- endfor -%}",
    "{%- endif -%}",
    _output(f"{IM_END}\n"),
    "{%- endfor -%}",
    "{%- if add_generation_prompt -%}", _output(f"{IM_START}assistant\n"), "{%- endif -%}",
])

# transformers' config and model classes by variant (its ``model_type``).
_VARIANTS = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
}
_LAYOUTS = ("transformers", "published")


def _vision_config(variant: str, *, hidden: int, layers: int, heads: int, intermediate_size: int,
                   out_hidden_size: int, patch_size: int, temporal_patch_size: int,
                   spatial_merge_size: int, window_size: int,
                   fullatt_block_indexes: list[int]) -> dict[str, Any]:
    """The vision tower's config in transformers' field names."""
    common = {"depth": layers, "num_heads": heads, "in_channels": 3, "patch_size": patch_size,
              "temporal_patch_size": temporal_patch_size, "spatial_merge_size": spatial_merge_size}
    if variant == "qwen2_vl":
        # Qwen2-VL's vision ``hidden_size`` is the merger's output (the text hidden size).
        return {**common, "embed_dim": hidden, "mlp_ratio": intermediate_size // hidden,
                "hidden_size": out_hidden_size, "hidden_act": "quick_gelu"}
    return {**common, "hidden_size": hidden, "intermediate_size": intermediate_size,
            "out_hidden_size": out_hidden_size, "hidden_act": "silu", "window_size": window_size,
            "fullatt_block_indexes": list(fullatt_block_indexes), "tokens_per_second": 2}


def _published_config(config: Any, variant: str, dtype: torch.dtype,
                      vision_token_id: int) -> dict[str, Any]:
    """``config`` as Qwen published it: text fields at the top level, M-RoPE as
    ``rope_scaling``, Qwen's vision field names (``in_chans``, ``spatial_patch_size``)."""
    text, vision = config.text_config, config.vision_config
    rope = text.rope_parameters
    vision_fields = {
        "qwen2_vl": ("depth", "embed_dim", "mlp_ratio", "num_heads", "in_chans", "hidden_size",
                     "patch_size", "spatial_merge_size", "spatial_patch_size",
                     "temporal_patch_size"),
        "qwen2_5_vl": ("depth", "hidden_act", "hidden_size", "intermediate_size", "num_heads",
                       "in_chans", "out_hidden_size", "patch_size", "spatial_merge_size",
                       "spatial_patch_size", "window_size", "fullatt_block_indexes",
                       "tokens_per_second", "temporal_patch_size"),
    }[variant]
    renamed = {"in_chans": "in_channels", "spatial_patch_size": "patch_size"}
    return {
        "architectures": list(config.architectures),
        "attention_dropout": text.attention_dropout,
        "bos_token_id": text.bos_token_id,
        "eos_token_id": text.eos_token_id,
        "vision_start_token_id": config.vision_start_token_id,
        "vision_end_token_id": config.vision_end_token_id,
        "vision_token_id": vision_token_id,
        "image_token_id": config.image_token_id,
        "video_token_id": config.video_token_id,
        "hidden_act": text.hidden_act,
        "hidden_size": text.hidden_size,
        "initializer_range": text.initializer_range,
        "intermediate_size": text.intermediate_size,
        "max_position_embeddings": text.max_position_embeddings,
        "max_window_layers": text.max_window_layers,
        "model_type": variant,
        "num_attention_heads": text.num_attention_heads,
        "num_hidden_layers": text.num_hidden_layers,
        "num_key_value_heads": text.num_key_value_heads,
        "rms_norm_eps": text.rms_norm_eps,
        "rope_theta": rope["rope_theta"],
        "sliding_window": text.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "transformers_version": "4.41.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": {name: getattr(vision, renamed.get(name, name))
                          for name in vision_fields},
        "rope_scaling": {"type": "mrope", "mrope_section": list(rope["mrope_section"])},
        "vocab_size": text.vocab_size,
    }


def _published_weight_name(name: str) -> str:
    """transformers' weight name -> Qwen's: ``model.language_model.X`` -> ``model.X``,
    ``model.visual.X`` -> ``visual.X``; ``lm_head.weight`` stays."""
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    if name.startswith("model.visual."):
        return name.removeprefix("model.")
    return name


def _to_published_layout(out: pathlib.Path, config: Any, variant: str, processor_class: str,
                         image_processor: Any, dtype: torch.dtype, vision_token_id: int) -> None:
    """Rewrite the directory transformers saved at ``out`` in Qwen's published layout."""
    from safetensors.torch import load_file, save_file

    weights_file = out / "model.safetensors"
    weights = load_file(weights_file)
    save_file({_published_weight_name(name): t for name, t in weights.items()}, weights_file,
              metadata={"format": "pt"})
    published = _published_config(config, variant, dtype, vision_token_id)
    (out / "config.json").write_text(json.dumps(published, indent=2) + "\n", encoding="utf-8")
    size = image_processor.size
    preprocessor = {
        "min_pixels": size["shortest_edge"],
        "max_pixels": size["longest_edge"],
        "patch_size": image_processor.patch_size,
        "temporal_patch_size": image_processor.temporal_patch_size,
        "merge_size": image_processor.merge_size,
        "image_mean": list(image_processor.image_mean),
        "image_std": list(image_processor.image_std),
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor_class,
    }
    (out / "preprocessor_config.json").write_text(
        json.dumps(preprocessor, indent=2) + "\n", encoding="utf-8")
    # Qwen published no processor_config.json, and the chat template as chat_template.json.
    (out / "processor_config.json").unlink()
    template_file = out / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8")
    template_file.unlink()
    (out / "chat_template.json").write_text(
        json.dumps({"chat_template": template}, indent=2) + "\n", encoding="utf-8")


def build_tiny_qwen2_vl(
    path: str | os.PathLike[str],
    *,
    variant: str = "qwen2_vl",
    layout: str = "transformers",
    text_hidden: int = 64,
    text_layers: int = 2,
    text_heads: int = 4,
    text_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    mrope_section: tuple[int, int, int] = (2, 3, 3),
    rope_theta: float = 100.0,
    vision_hidden: int = 32,
    vision_layers: int | None = None,
    vision_heads: int = 2,
    vision_intermediate_size: int = 64,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    spatial_merge_size: int = 2,
    window_size: int = 56,
    fullatt_block_indexes: tuple[int, ...] | None = None,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 64,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> pathlib.Path:
    """Write a tiny random Qwen2-VL or Qwen2.5-VL checkpoint to ``path``.

    Args:
        path: Output directory (created if needed; existing files are overwritten).
        variant: ``"qwen2_vl"`` (``Qwen2VLForConditionalGeneration``) or ``"qwen2_5_vl"``
            (``Qwen2_5_VLForConditionalGeneration``: RMSNorm and gated-MLP vision blocks, window
            attention but in ``fullatt_block_indexes``).
        layout: ``"transformers"`` (transformers' own weight names and nested config) or
            ``"published"`` (Qwen's layout on the Hub); the same seed gives the same weights in
            both.
        text_hidden: Language model hidden size.
        text_layers: Number of decoder layers.
        text_heads: Number of query heads.
        text_kv_heads: Number of key/value heads.
        intermediate_size: Language model MLP size.
        vocab_size: Exact vocabulary size of both tokenizer and model.
        max_position_embeddings: Maximum sequence length of the language model.
        mrope_section: Rotary frequencies of the temporal, height and width position rows; they
            sum to half the head dimension (``text_hidden // text_heads``).
        rope_theta: Rotary base of the language model. Qwen's is 1e6; with a head dimension of
            16 that turns the height and width rows by so little that wrong image positions
            would hardly change a token, hence the low default.
        vision_hidden: Vision tower width (Qwen2-VL's ``embed_dim``).
        vision_layers: Vision blocks; defaults to 2 for Qwen2-VL and 4 for Qwen2.5-VL.
        vision_heads: Vision attention heads (their dimension a multiple of 4, for 2-D rotary).
        vision_intermediate_size: Vision MLP size (for Qwen2-VL a multiple of ``vision_hidden``:
            its config has an integer ``mlp_ratio``).
        patch_size: Side of a square patch in pixels.
        temporal_patch_size: Frames per patch (an image is repeated to fill them).
        spatial_merge_size: Patches merged per side into one token.
        window_size: Qwen2.5-VL's attention window side in pixels; the default, 56, is a window
            of 2 x 2 tokens, so that small images have several.
        fullatt_block_indexes: Qwen2.5-VL's full-attention blocks; defaults to every second one.
        min_pixels: The image processor's least resized area.
        max_pixels: The image processor's largest resized area; the default is 64 tokens.
        tie_word_embeddings: Share the embedding with the output layer (no ``lm_head`` saved).
        dtype: Dtype of the saved weights (they are drawn in float32 and then cast).
        seed: Seed of the weight initialisation.
        device: Where the weights are drawn (``random_model``); None: the CPU, built as
            transformers builds the model.

    Returns:
        The checkpoint directory as a `pathlib.Path`.
    """
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from mmserve.processing.hf_processors import qwen2_vl_processor

    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {tuple(_VARIANTS)}, got {variant!r}")
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
    if text_hidden % text_heads or text_heads % text_kv_heads:
        raise ValueError("text_hidden must divide by text_heads and text_heads by text_kv_heads")
    if 2 * sum(mrope_section) != text_hidden // text_heads:
        raise ValueError(f"mrope_section {list(mrope_section)} must sum to half the head "
                         f"dimension, {text_hidden // text_heads // 2}")
    if vision_hidden % vision_heads or (vision_hidden // vision_heads) % 4:
        raise ValueError("vision_hidden / vision_heads must be a whole multiple of 4")
    if variant == "qwen2_vl" and vision_intermediate_size % vision_hidden:
        raise ValueError("Qwen2-VL's vision_intermediate_size must be a multiple of "
                         "vision_hidden (its config has an integer mlp_ratio)")
    if vision_layers is None:
        vision_layers = 2 if variant == "qwen2_vl" else 4
    if fullatt_block_indexes is None:
        fullatt_block_indexes = tuple(range(1, vision_layers, 2))

    tokenizer = build_tokenizer(vocab_size, max_position_embeddings, QWEN_SPECIAL_TOKENS)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS.tokens}

    config_name, model_name = _VARIANTS[variant]
    config = getattr(transformers, config_name)(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": text_hidden,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": text_layers,
            "num_attention_heads": text_heads,
            "num_key_value_heads": text_kv_heads,
            "hidden_act": "silu",
            "max_position_embeddings": max_position_embeddings,
            "max_window_layers": text_layers,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "mrope_section": list(mrope_section),
                                "rope_theta": rope_theta},
            "use_sliding_window": False,
            "attention_dropout": 0.0,
            # As Qwen's configs: bos is <|endoftext|>, which the tokenizer never prepends.
            "bos_token_id": ids[ENDOFTEXT],
            "eos_token_id": ids[IM_END],
            "pad_token_id": ids[ENDOFTEXT],
        },
        vision_config=_vision_config(
            variant,
            hidden=vision_hidden,
            layers=vision_layers,
            heads=vision_heads,
            intermediate_size=vision_intermediate_size,
            out_hidden_size=text_hidden,
            patch_size=patch_size,
            temporal_patch_size=temporal_patch_size,
            spatial_merge_size=spatial_merge_size,
            window_size=window_size,
            fullatt_block_indexes=list(fullatt_block_indexes),
        ),
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=tie_word_embeddings,
    )
    config._attn_implementation = "sdpa"

    never_generate = [i for token, i in ids.items() if token not in (IM_END, ENDOFTEXT)]
    model = random_model(getattr(transformers, model_name), config, seed=seed,
                         never_generate=never_generate, projector="merger",
                         device=device)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=patch_size,
        temporal_patch_size=temporal_patch_size,
        merge_size=spatial_merge_size,
    )
    processor = qwen2_vl_processor(variant, image_processor, tokenizer, CHAT_TEMPLATE)
    out = save_checkpoint(path, model, processor, dtype=dtype)
    # transformers 5 saves weights under the names it converts them from at load (Qwen's, here)
    # by default: written again under the model's own names, which each layout starts from.
    model.save_pretrained(out, save_original_format=False)
    if layout == "published":
        _to_published_layout(out, model.config, variant, type(processor).__name__,
                              image_processor, dtype, ids[VISION_PAD])
    return out


def build_tiny_qwen2_5_vl(path: str | os.PathLike[str], **options: Any) -> pathlib.Path:
    """`build_tiny_qwen2_vl` with ``variant="qwen2_5_vl"``."""
    return build_tiny_qwen2_vl(path, variant="qwen2_5_vl", **options)
