"""Build tiny, randomly initialised LLaVA checkpoints entirely offline.

`build_tiny_llava` writes a complete Hugging Face checkpoint directory (config, safetensors weights,
byte-level BPE tokenizer, image processor, processor config and chat template) that both
``transformers.AutoProcessor.from_pretrained`` and
``transformers.LlavaForConditionalGeneration.from_pretrained`` load without network access.

The weights are re-initialised with a fixed, seeded scheme (unit-variance embeddings,
``1/sqrt(fan_in)`` projections with sharpened attention, non-trivial norm weights and biases) so
that greedy generation is varied, images visibly change the output, and a serving engine that
forgets to load a norm weight or a bias produces different tokens than the reference. The
``lm_head`` rows of ``<unk>``, ``<s>``, ``<pad>`` and ``<image>`` are zero, so greedy decoding
never emits them; ``</s>`` can be generated normally.

`hf_greedy_generate` runs the reference Hugging Face implementation on such a checkpoint and is
meant to be used as the correctness oracle in tests.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
import random
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "IMAGE_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "UNK_TOKEN",
    "build_tiny_llava",
    "hf_greedy_generate",
    "llava_chat_template",
    "train_bpe_tokenizer",
]

UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
IMAGE_TOKEN = "<image>"
# Trained first, so their ids are 0..4 in this order.
SPECIAL_TOKENS: tuple[str, ...] = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IMAGE_TOKEN)

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

_TEXT_ARCHS = ("llama", "qwen2", "mistral")
_VISION_ARCHS = ("clip", "siglip")

# Standard deviations of the weight initialisation (see `_init_weights`).
_EMBED_STD = 1.0
_BIAS_STD = 0.1
_NORM_WEIGHT_NOISE = 0.1
_QK_GAIN = 2.0
_PROJECTOR_GAIN = 2.0

_WORDS = (
    "the a an this that these those some many few one two three four five six seven eight nine ten "
    "image picture photo scene view frame cat dog bird horse cow sheep fish mouse rabbit bear lion "
    "tiger zebra elephant giraffe monkey car bus truck train plane boat bike road street city town "
    "house room kitchen table chair bed sofa window door wall floor roof garden tree flower grass "
    "sky cloud sun moon star rain snow water river lake sea beach mountain hill field forest stone "
    "red green blue yellow orange purple pink black white gray brown bright dark light small large "
    "big tiny tall short long wide old new young happy sad quiet loud fast slow warm cold soft hot "
    "is are was were be been has have had do does did can could will would should may might must "
    "sit sits sitting stand stands standing run runs running walk walks walking look looks looking "
    "eat eats eating play plays playing hold holds holding show shows showing wear wears wearing "
    "man woman child children person people boy girl friend family group team player driver cook "
    "on in at of to from with without under over near behind between above below inside outside "
    "and or but so because while when where what which who why how there here then now very not "
    "describe explain answer question tell me you it they we he she what's it's there's color "
    "left right top bottom middle center corner side front back first second last next other same "
    "hello thanks please yes no maybe sure okay system user assistant model token text vision"
).split()

_SYLLABLES = (
    "ba be bi bo bu ka ke ki ko ku la le li lo lu ma me mi mo mu na ne ni no nu ra re ri ro ru "
    "sa se si so su ta te ti to tu va ve vi vo vu za ze zi zo zu qua pre pro con dis ing tion ment "
    "able ous ive ly er est ed"
).split()


@functools.cache
def _training_corpus() -> tuple[str, ...]:
    """Return a deterministic English-like corpus used to train the tiny tokenizer."""
    rng = random.Random(1234)
    lines = [
        "SYSTEM: You are a helpful assistant.",
        "USER: What is in this picture?",
        "ASSISTANT: The picture shows a cat sitting on a red chair.",
        "The quick brown fox jumps over the lazy dog.",
        "0123456789 !?.,;:'\"()[]{}<>/\\|-_+=*&^%$#@~`",
    ]
    for _ in range(1500):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))))
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2048)))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(".?!")
        if rng.random() < 0.25:
            sentence = rng.choice(("SYSTEM: ", "USER: ", "ASSISTANT: ")) + sentence
        lines.append(sentence)
    return tuple(lines)


def train_bpe_tokenizer(corpus: Iterable[str], vocab_size: int, model_max_length: int) -> Any:
    """Train a byte-level BPE tokenizer of at most ``vocab_size`` entries on ``corpus``.

    The special tokens get ids 0..4 (see `SPECIAL_TOKENS`) and every encoding starts with
    ``<s>``, as LLaVA-1.5's Llama tokenizer does.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    min_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be at least {min_size}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, tokenizer.token_to_id(BOS_TOKEN))],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    for index, token in enumerate(SPECIAL_TOKENS):
        if fast.convert_tokens_to_ids(token) != index:
            raise RuntimeError(f"special token {token!r} did not get id {index}")
    return fast


def _build_tokenizer(vocab_size: int, model_max_length: int) -> Any:
    """A tokenizer with exactly ``vocab_size`` entries: when the built-in corpus cannot supply
    enough merges, the vocabulary is padded with ``<extra_N>`` special tokens."""
    fast = train_bpe_tokenizer(_training_corpus(), vocab_size, model_max_length)
    missing = vocab_size - len(fast)
    if missing > 0:
        fast.backend_tokenizer.add_special_tokens([f"<extra_{i}>" for i in range(missing)])
    if len(fast) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(fast)} entries, expected {vocab_size}")
    return fast


def _build_image_processor(vision: str, image_size: int) -> Any:
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


def _vision_config(
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


def _text_config(
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


@torch.no_grad()
def _init_weights(model: nn.Module, seed: int, never_generate: list[int]) -> None:
    """Deterministically re-initialise every parameter of ``model`` in float32.

    Embeddings get unit variance, linear/conv weights ``N(0, 1/fan_in)`` (scaled by
    `_QK_GAIN` for attention queries/keys to sharpen attention and by `_PROJECTOR_GAIN` in the
    multimodal projector so that images clearly influence the text), biases ``N(0, 0.1^2)``, norm
    weights ``1 + N(0, 0.1^2)`` and any other parameter (e.g. CLIP's class embedding) unit
    variance. Values are drawn from a dedicated generator in module registration order. Finally the
    ``lm_head`` rows of ``never_generate`` are zeroed so that greedy decoding never picks them.
    """
    generator = torch.Generator().manual_seed(seed)

    def normal(shape: torch.Size, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32) * std + mean

    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, nn.Embedding):
                value = normal(param.shape, _EMBED_STD)
            elif isinstance(module, (nn.Linear, nn.Conv2d)) and name == "weight":
                gain = 1.0
                if module_name.endswith(("q_proj", "k_proj")):
                    gain = _QK_GAIN
                elif "multi_modal_projector" in module_name:
                    gain = _PROJECTOR_GAIN
                value = normal(param.shape, gain / math.sqrt(math.prod(param.shape[1:])))
            elif name == "bias":
                value = normal(param.shape, _BIAS_STD)
            elif name == "weight" and param.ndim == 1:
                value = normal(param.shape, _NORM_WEIGHT_NOISE, mean=1.0)
            else:
                value = normal(param.shape, _EMBED_STD)
            param.copy_(value)

    output_embeddings = model.get_output_embeddings()
    if output_embeddings is not None:
        output_embeddings.weight[never_generate] = 0.0


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

    Returns:
        The checkpoint directory as a `pathlib.Path`.
    """
    from transformers import (
        GenerationConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    if vision not in _VISION_ARCHS:
        raise ValueError(f"vision must be one of {_VISION_ARCHS}, got {vision!r}")
    if text not in _TEXT_ARCHS:
        raise ValueError(f"text must be one of {_TEXT_ARCHS}, got {text!r}")
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

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(vocab_size, max_position_embeddings)
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
        vision_config=_vision_config(
            vision,
            image_size=image_size,
            patch_size=patch_size,
            hidden=vision_hidden,
            layers=vision_layers,
            heads=vision_heads,
        ),
        text_config=_text_config(
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

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    _init_weights(model, seed, never_generate=[unk_id, bos_id, pad_id, image_token_id])
    model.to(dtype)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        do_sample=False,
    )
    model.save_pretrained(out)

    image_processor = _build_image_processor(vision, image_size)
    # Also write the standalone preprocessor_config.json for readers that do not parse the
    # image processor section of processor_config.json.
    image_processor.save_pretrained(out)
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=vision_feature_select_strategy,
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=num_additional_image_tokens,
    )
    processor.save_pretrained(out)
    return out


_HF_CACHE: dict[str, tuple[Any, Any]] = {}


def _load_hf(path: str | os.PathLike[str]) -> tuple[Any, Any]:
    """Load (and cache per resolved path) the float32 reference model and its processor."""
    key = str(pathlib.Path(path).resolve())
    if key not in _HF_CACHE:
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        model = LlavaForConditionalGeneration.from_pretrained(key, dtype=torch.float32)
        model.eval()
        _HF_CACHE[key] = (model, AutoProcessor.from_pretrained(key))
    return _HF_CACHE[key]


@torch.no_grad()
def hf_greedy_generate(
    path: str | os.PathLike[str],
    prompt_text: str,
    images: list[Image.Image],
    max_new_tokens: int,
) -> list[int]:
    """Greedily generate with the reference Hugging Face model and return the new token ids.

    ``prompt_text`` is the already-templated prompt containing one ``<image>`` per image; the
    processor expands the placeholders and prepends ``<s>``. Generation stops at ``</s>``
    (included in the result) or after ``max_new_tokens`` tokens.
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


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build a tiny random LLaVA checkpoint offline.")
    parser.add_argument("path", help="output directory")
    parser.add_argument("--vision", default="clip", choices=["clip", "siglip"])
    parser.add_argument("--text", default="llama", choices=["llama", "qwen2", "mistral"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_tiny_llava(args.path, vision=args.vision, text=args.text, seed=args.seed))
