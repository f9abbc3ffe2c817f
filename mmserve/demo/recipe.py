"""How the demo checkpoint is made: tokenizer, chat template, model config, training examples.

The training loop itself is ``samples/train_demo_model.py``; this module holds the pieces that
define the checkpoint's format so that the script and the tests agree on them.

The checkpoint is a standard ``LlavaForConditionalGeneration`` (CLIP vision tower, Llama decoder)
in the Hugging Face layout, so transformers and mmserve load it the same way. Its tokenizer is a
byte-level BPE trained on the scene grammar only: every word of the grammar is one token, and any
other text still tokenizes (byte by byte), so arbitrary prompts never fail to encode.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from mmserve.demo.scenes import (
    CAPTION_PROMPTS,
    COLOUR_QUESTIONS,
    COUNT_QUESTIONS,
    KINDS,
    WHERE_QUESTIONS,
    Scene,
    generate_scenes,
)
from mmserve.testing.llava import (
    build_image_processor,
    llava_chat_template,
    llava_text_config,
    llava_vision_config,
)
from mmserve.testing.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    IMAGE_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    train_bpe_tokenizer,
)

# Like LLaVA-1.5's template, except that every role header ends in a newline ("USER:\n"). The
# answer then starts a new pre-token, so the model's first output token carries no leading space
# and the prompt tokenizes the same whether or not the answer follows it.
# "USER:\n<image>\nDescribe this image.\nASSISTANT:\n" is what a single-image question renders.
CHAT_TEMPLATE = llava_chat_template(header_end="\n", generation_prompt="ASSISTANT:\n")

IMAGE_SIZE = 96  # the vision tower's input; scenes are rendered larger and resized by the processor
PATCH_SIZE = 16  # 6x6 patches: each third of the 3x3 position grid is 2x2 patches
MAX_POSITION_EMBEDDINGS = 512


@dataclass(frozen=True)
class ModelShape:
    """Sizes of the demo model (defaults: about 1M parameters, 4 MB in float32)."""

    vision_hidden: int = 96
    vision_layers: int = 2
    vision_heads: int = 4
    text_hidden: int = 128
    text_layers: int = 3
    text_heads: int = 4
    text_kv_heads: int = 2
    intermediate_size: int = 384

    def __post_init__(self) -> None:
        if self.vision_hidden % self.vision_heads or self.text_hidden % self.text_heads:
            raise ValueError("hidden sizes must divide by their head counts")
        if self.text_heads % self.text_kv_heads:
            raise ValueError("text_heads must divide by text_kv_heads")


def tokenizer_corpus() -> list[str]:
    """Every kind of text the model reads or writes, to train the tokenizer on."""
    lines = ["SYSTEM:\nUSER:\nASSISTANT:\n"]
    lines += list(CAPTION_PROMPTS) + list(COUNT_QUESTIONS)
    for kind in KINDS:
        lines += [q.format(kind=kind) for q in COLOUR_QUESTIONS + WHERE_QUESTIONS]
    for scene in generate_scenes(2000, seed=12345):
        lines.append(scene.caption())
        lines += [answer for _, answer in scene.qa_pairs()]
    return lines


def build_tokenizer(vocab_size: int = 400) -> Any:
    """A byte-level BPE tokenizer over the scene grammar (special tokens get ids 0..4).

    ``vocab_size`` is an upper bound: training stops once every word of the grammar is whole.
    """
    fast = train_bpe_tokenizer(tokenizer_corpus(), vocab_size, MAX_POSITION_EMBEDDINGS)
    # Short sequences train fast: insist that each word of the grammar is a single token.
    for line in tokenizer_corpus():
        words = fast.backend_tokenizer.pre_tokenizer.pre_tokenize_str(line)
        if len(fast(line, add_special_tokens=False)["input_ids"]) != len(words):
            raise RuntimeError(f"{line!r} has words of several tokens; raise vocab_size")
    return fast


def build_config(vocab_size: int, shape: ModelShape) -> Any:
    """The ``LlavaConfig`` of the demo model (special token ids as in `SPECIAL_TOKENS`)."""
    from transformers import LlavaConfig

    ids = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    config = LlavaConfig(
        vision_config=llava_vision_config(
            "clip", image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, hidden=shape.vision_hidden,
            layers=shape.vision_layers, heads=shape.vision_heads),
        text_config=llava_text_config(
            "llama", vocab_size=vocab_size, hidden=shape.text_hidden,
            layers=shape.text_layers, heads=shape.text_heads, kv_heads=shape.text_kv_heads,
            intermediate_size=shape.intermediate_size,
            max_position_embeddings=MAX_POSITION_EMBEDDINGS, bos_token_id=ids[BOS_TOKEN],
            eos_token_id=ids[EOS_TOKEN], pad_token_id=ids[PAD_TOKEN]),
        image_token_index=ids[IMAGE_TOKEN],
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        projector_hidden_act="gelu",
        # The last layer's patch features (a 2-layer tower has no depth to spare).
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return config


def build_processor(tokenizer: Any) -> Any:
    """The ``LlavaProcessor`` (CLIP image processing at `IMAGE_SIZE`, the demo chat template)."""
    from transformers import LlavaProcessor

    return LlavaProcessor(
        image_processor=build_image_processor("clip", IMAGE_SIZE), tokenizer=tokenizer,
        patch_size=PATCH_SIZE, vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE, image_token=IMAGE_TOKEN, num_additional_image_tokens=1)


def user_turn(text: str) -> list[dict[str, Any]]:
    """The chat messages of one question about one image, as users send them."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


# Share of each task among training examples (the default; the training script's second phase
# favours the questions that must find a shape by its kind).
TASK_WEIGHTS = {"caption": 0.5, "count": 0.15, "colour": 0.2, "where": 0.15}


def training_example(scene: Scene, rng: random.Random,
                     weights: dict[str, float] | None = None) -> tuple[str, str]:
    """A random (prompt text, reference answer) pair about ``scene``, with varied phrasings.

    ``weights`` gives the share of each task (keys of `TASK_WEIGHTS`, the default).
    """
    weights = weights or TASK_WEIGHTS
    task = rng.choices(list(weights), weights=list(weights.values()))[0]
    if task == "caption":
        return rng.choice(CAPTION_PROMPTS), scene.caption()
    if task == "count":
        return rng.choice(COUNT_QUESTIONS), scene.count_answer()
    # Mostly ask about shapes that are there; sometimes about a missing one.
    present = [s.kind for s in scene.shapes]
    kind = rng.choice(present) if rng.random() < 0.8 else rng.choice(KINDS)
    if task == "colour":
        return rng.choice(COLOUR_QUESTIONS).format(kind=kind), scene.colour_answer(kind)
    return rng.choice(WHERE_QUESTIONS).format(kind=kind), scene.where_answer(kind)
