"""The LLaVA family's tiny checkpoints: CLIP or SigLIP tower + projector + Llama/Qwen2/Mistral.

`build_tiny_llava` writes a complete ``LlavaForConditionalGeneration`` checkpoint directory that
``transformers.AutoProcessor`` and ``LlavaForConditionalGeneration`` load offline, with the
LLaVA-1.5-like chat template `CHAT_TEMPLATE` and the tokenizer of `mmserve.testing.tokenizer`.
The ``lm_head`` rows of ``<unk>``, ``<s>``, ``<pad>`` and ``<image>`` are zero, so greedy decoding
never emits them; ``</s>`` can be generated normally. The config and image-processor pieces are
also what the demo checkpoint (`mmserve.demo.recipe`) is made of.

Two layouts of the same weights (``layout=``): ``"transformers"`` is what transformers 5's
``save_pretrained`` writes (``language_model.model.*``, ``language_model.lm_head.*``,
``multi_modal_projector.*`` and the vision tower without its ``vision_model`` level,
``vision_tower.embeddings.*``); ``"published"`` is the layout of the LLaVA checkpoints on the Hub
(llava-hf/llava-1.5-7b-hf: ``vision_tower.vision_model.*``, as transformers 4.x wrote them),
which transformers 5 and mmserve load as well, and which vLLM's LLaVA loader requires.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import torch

from mmserve.testing.checkpoint import random_model, save_checkpoint
from mmserve.testing.tokenizer import IMAGE_TOKEN, build_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "LAYOUTS",
    "build_image_processor",
    "build_tiny_llava",
    "llava_chat_template",
    "llava_text_config",
    "llava_vision_config",
    "published_weight_name",
]

_TEXT_ARCHS = ("llama", "qwen2", "mistral")
_VISION_ARCHS = ("clip", "siglip")
LAYOUTS = ("transformers", "published")

# LLaVA-1.5-like template. The tokenizer's post-processor prepends ``<s>``; the template must not.
# Roles render as "SYSTEM: ", "USER: " and "ASSISTANT: "; every message ends with a newline and
# assistant messages additionally end with "</s>". List contents render their parts in order,
# joined by newlines, with each image part as a single "<image>" placeholder, e.g.
# "SYSTEM: be brief\nUSER: <image>\nwhat is this?\nASSISTANT:".


def llava_chat_template(header_end: str = " ", generation_prompt: str = "ASSISTANT:") -> str:
    """A LLaVA-1.5-like chat template; roles render as ``"USER" + ":" + header_end``."""
    headers = {role: f"{role.upper()}:{header_end}" for role in ("system", "user", "assistant")}
    return (
        "{%- for message in messages -%}"
        f"{{%- if message['role'] == 'system' -%}}{{{{- {headers['system']!r} -}}}}"
        f"{{%- elif message['role'] == 'user' -%}}{{{{- {headers['user']!r} -}}}}"
        f"{{%- elif message['role'] == 'assistant' -%}}{{{{- {headers['assistant']!r} -}}}}"
        "{%- else -%}{{- raise_exception('Unsupported role: ' ~ message['role']) -}}"
        "{%- endif -%}"
        "{%- if message['content'] is string -%}{{- message['content'] -}}"
        "{%- elif message['content'] is not none -%}"
        "{%- for part in message['content'] -%}"
        "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
        "{%- if part['type'] in ['image', 'image_url'] -%}{{- '<image>' -}}"
        "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
        "{%- else -%}{{- raise_exception('Unsupported content part: ' ~ part['type']) -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{%- if message['role'] == 'assistant' -%}{{- '</s>' -}}{%- endif -%}"
        "{{- '\\n' -}}"
        "{%- endfor -%}"
        f"{{%- if add_generation_prompt -%}}{{{{- {generation_prompt!r} -}}}}{{%- endif -%}}"
    )


CHAT_TEMPLATE = llava_chat_template()


def build_image_processor(vision: str, image_size: int) -> Any:
    """Return the image processor matching ``vision`` (PIL backend when torchvision is missing)."""
    from transformers.utils import is_torchvision_available

    use_torchvision = is_torchvision_available()
    if vision == "clip":
        if use_torchvision:
            from transformers import CLIPImageProcessor as clip_cls
        else:
            from transformers import CLIPImageProcessorPil as clip_cls
        return clip_cls(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
            do_resize=True,
            do_center_crop=True,
        )
    if use_torchvision:
        from transformers import SiglipImageProcessor as siglip_cls
    else:
        from transformers import SiglipImageProcessorPil as siglip_cls
    # SigLIP resizes straight to the square input size. ``crop_size`` is recorded (with center
    # cropping disabled) because LlavaProcessor._get_num_multimodal_tokens reads it.
    square = {"height": image_size, "width": image_size}
    return siglip_cls(size=square, crop_size=dict(square), do_resize=True, do_center_crop=False)


def llava_vision_config(
    vision: str,
    *,
    image_size: int,
    patch_size: int,
    hidden: int,
    layers: int,
    heads: int,
) -> Any:
    """Return the vision tower config for ``vision``."""
    common: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_channels": 3,
        "image_size": image_size,
        "patch_size": patch_size,
        "attention_dropout": 0.0,
    }
    if vision == "clip":
        from transformers import CLIPVisionConfig

        return CLIPVisionConfig(
            **common, hidden_act="quick_gelu", layer_norm_eps=1e-5, projection_dim=hidden
        )
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(
        **common, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False
    )


def llava_text_config(
    text: str,
    *,
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    bos_token_id: int,
    eos_token_id: int,
    pad_token_id: int,
) -> Any:
    """Return the language model config for ``text``."""
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
    if text == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if text == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, use_sliding_window=False, sliding_window=None)
    from transformers import MistralConfig

    return MistralConfig(**common, sliding_window=None)


def published_weight_name(name: str) -> str:
    """A LLaVA weight's name in the published (Hub) layout, from any of the names transformers
    uses for it: its 5.x in-memory names (``model.language_model.X``, ``model.vision_tower.X``,
    ``model.multi_modal_projector.X``, ``lm_head.X``), what 5.x ``save_pretrained`` writes
    (``vision_tower.X``, without the ``vision_model`` level), or the published name itself.

    >>> published_weight_name("vision_tower.embeddings.patch_embedding.weight")
    'vision_tower.vision_model.embeddings.patch_embedding.weight'
    >>> published_weight_name("model.language_model.norm.weight")
    'language_model.model.norm.weight'
    """
    if name.startswith("model.language_model."):
        return "language_model.model." + name.removeprefix("model.language_model.")
    if name.startswith("lm_head."):
        return "language_model." + name
    if name.startswith("model.multi_modal_projector."):
        return name.removeprefix("model.")
    if name.startswith(("model.vision_tower.", "vision_tower.")):
        rest = name.removeprefix("model.").removeprefix("vision_tower.")
        return "vision_tower.vision_model." + rest.removeprefix("vision_model.")
    return name


def _to_published_layout(out: pathlib.Path) -> None:
    """Rename the weights transformers saved at ``out`` (one file, or shards and their
    index) to the published layout."""
    from safetensors.torch import load_file, save_file

    seen: set[str] = set()
    for weights_file in sorted(out.glob("model*.safetensors")):
        weights = load_file(weights_file)
        renamed = {published_weight_name(name): t for name, t in weights.items()}
        if len(renamed) != len(weights) or not seen.isdisjoint(renamed):
            raise RuntimeError("two weights map onto one published name")
        seen.update(renamed)
        del weights
        save_file(renamed, weights_file, metadata={"format": "pt"})
    index_file = out / "model.safetensors.index.json"
    if index_file.exists():
        index = json.loads(index_file.read_text())
        index["weight_map"] = {published_weight_name(name): shard
                               for name, shard in index["weight_map"].items()}
        index_file.write_text(json.dumps(index, indent=2))


def build_tiny_llava(
    path: str | os.PathLike[str],
    *,
    vision: str = "clip",
    text: str = "llama",
    image_size: int = 32,
    patch_size: int = 8,
    vision_hidden: int = 32,
    vision_layers: int = 3,
    vision_heads: int = 2,
    text_hidden: int = 64,
    text_layers: int = 2,
    text_heads: int = 4,
    text_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    vision_feature_layer: int | None = None,
    vision_feature_select_strategy: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str | None = None,
    layout: str = "transformers",
) -> pathlib.Path:
    """Write a tiny random ``LlavaForConditionalGeneration`` checkpoint to ``path``.

    Args:
        path: Output directory (created if needed; existing files are overwritten).
        vision: ``"clip"`` (CLIP vision tower, CLS token) or ``"siglip"`` (SigLIP, no CLS token).
        text: Language model architecture: ``"llama"``, ``"qwen2"`` or ``"mistral"``.
        image_size: Square input resolution of the vision tower.
        patch_size: Vision patch size; ``(image_size // patch_size) ** 2`` patches per image.
        vision_hidden: Vision tower hidden size (MLP size is four times this).
        vision_layers: Number of vision encoder layers.
        vision_heads: Number of vision attention heads.
        text_hidden: Language model hidden size.
        text_layers: Number of decoder layers.
        text_heads: Number of query heads.
        text_kv_heads: Number of key/value heads.
        intermediate_size: Language model MLP size.
        vocab_size: Exact vocabulary size of both tokenizer and model.
        max_position_embeddings: Maximum sequence length of the language model.
        vision_feature_layer: Vision hidden state fed to the projector; defaults to ``-2`` for
            CLIP and ``-1`` for SigLIP.
        vision_feature_select_strategy: ``"default"`` (drop the first token) or ``"full"``;
            defaults to ``"default"`` for CLIP and ``"full"`` for SigLIP.
        dtype: Dtype of the saved weights (they are drawn in float32 and then cast).
        seed: Seed of the weight initialisation.
        device: Where the weights are drawn (``random_model``); None: the CPU, built as
            transformers builds the model.
        layout: ``"transformers"`` (the weight names transformers' ``save_pretrained`` writes)
            or ``"published"`` (the Hub's names, ``vision_tower.vision_model.*``; vLLM loads
            only these); the same seed gives the same weights in both.

    Returns:
        The checkpoint directory as a `pathlib.Path`.
    """
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    if vision not in _VISION_ARCHS:
        raise ValueError(f"vision must be one of {_VISION_ARCHS}, got {vision!r}")
    if text not in _TEXT_ARCHS:
        raise ValueError(f"text must be one of {_TEXT_ARCHS}, got {text!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if image_size % patch_size:
        raise ValueError("image_size must be a multiple of patch_size")
    if vision_hidden % vision_heads or text_hidden % text_heads or text_heads % text_kv_heads:
        raise ValueError("hidden sizes must divide by head counts and heads by kv heads")
    if vision_feature_layer is None:
        vision_feature_layer = -2 if vision == "clip" else -1
    if vision_feature_select_strategy is None:
        vision_feature_select_strategy = "default" if vision == "clip" else "full"
    if vision_feature_select_strategy not in ("default", "full"):
        raise ValueError("vision_feature_select_strategy must be 'default' or 'full'")

    tokenizer = build_tokenizer(vocab_size, max_position_embeddings)
    bos_id = tokenizer.bos_token_id
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id
    unk_id = tokenizer.unk_token_id
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)

    num_additional_image_tokens = 1 if vision == "clip" else 0
    num_image_tokens = (image_size // patch_size) ** 2 + num_additional_image_tokens
    if vision_feature_select_strategy == "default":
        num_image_tokens -= 1

    config = LlavaConfig(
        vision_config=llava_vision_config(
            vision,
            image_size=image_size,
            patch_size=patch_size,
            hidden=vision_hidden,
            layers=vision_layers,
            heads=vision_heads,
        ),
        text_config=llava_text_config(
            text,
            vocab_size=vocab_size,
            hidden=text_hidden,
            layers=text_layers,
            heads=text_heads,
            kv_heads=text_kv_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        ),
        image_token_index=image_token_id,
        image_seq_length=num_image_tokens,
        projector_hidden_act="gelu",
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy=vision_feature_select_strategy,
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"

    model = random_model(
        LlavaForConditionalGeneration,
        config,
        seed=seed,
        never_generate=[unk_id, bos_id, pad_id, image_token_id],
        projector="multi_modal_projector",
        device=device,
    )
    processor = LlavaProcessor(
        image_processor=build_image_processor(vision, image_size),
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=vision_feature_select_strategy,
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=num_additional_image_tokens,
    )
    out = save_checkpoint(path, model, processor, dtype=dtype)
    if layout == "published":
        _to_published_layout(out)
    return out
