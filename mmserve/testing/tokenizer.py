"""The offline tokenizer every tiny checkpoint uses: byte-level BPE trained on a built-in corpus.

`train_bpe_tokenizer` trains on any corpus (the demo and bench checkpoints bring their own);
`build_tokenizer` trains on the built-in English-like corpus and pads the vocabulary to an exact
size. A family names its special tokens with `SpecialTokens`; the default, `LLAVA_SPECIAL_TOKENS`,
is LLaVA-1.5's (Llama's ``<unk> <s> </s> <pad>`` plus ``<image>``, ``<s>`` starting every
encoding).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "IMAGE_TOKEN",
    "LLAVA_SPECIAL_TOKENS",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "UNK_TOKEN",
    "SpecialTokens",
    "build_tokenizer",
    "train_bpe_tokenizer",
]

UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
IMAGE_TOKEN = "<image>"
# Trained first, so their ids are 0..4 in this order.
SPECIAL_TOKENS: tuple[str, ...] = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IMAGE_TOKEN)


@dataclass(frozen=True)
class SpecialTokens:
    """A tokenizer's special tokens. `tokens` are trained first, so they get ids 0.. in order;
    ``bos``, when set, starts every encoding (as Llama's tokenizer does, and Qwen2's does not)."""

    tokens: tuple[str, ...]
    eos: str
    pad: str
    bos: str | None = None
    unk: str | None = None

    def __post_init__(self) -> None:
        roles = {"eos": self.eos, "pad": self.pad, "bos": self.bos, "unk": self.unk}
        for role, token in roles.items():
            if token is not None and token not in self.tokens:
                raise ValueError(f"the {role} token {token!r} is not one of {self.tokens}")


LLAVA_SPECIAL_TOKENS = SpecialTokens(
    SPECIAL_TOKENS, eos=EOS_TOKEN, pad=PAD_TOKEN, bos=BOS_TOKEN, unk=UNK_TOKEN
)

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


def train_bpe_tokenizer(
    corpus: Iterable[str],
    vocab_size: int,
    model_max_length: int,
    special_tokens: SpecialTokens = LLAVA_SPECIAL_TOKENS,
) -> Any:
    """Train a byte-level BPE tokenizer of at most ``vocab_size`` entries on ``corpus``.

    The special tokens get ids 0.. in the order of ``special_tokens.tokens``, and every encoding
    starts with ``special_tokens.bos`` when it is set.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = special_tokens
    min_size = len(specials.tokens) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be at least {min_size}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(specials.tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    if specials.bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{specials.bos} $A",
            pair=f"{specials.bos} $A {specials.bos} $B",
            special_tokens=[(specials.bos, tokenizer.token_to_id(specials.bos))],
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=specials.bos,
        eos_token=specials.eos,
        unk_token=specials.unk,
        pad_token=specials.pad,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    for index, token in enumerate(specials.tokens):
        if fast.convert_tokens_to_ids(token) != index:
            raise RuntimeError(f"special token {token!r} did not get id {index}")
    return fast


def build_tokenizer(
    vocab_size: int,
    model_max_length: int,
    special_tokens: SpecialTokens = LLAVA_SPECIAL_TOKENS,
) -> Any:
    """A tokenizer with exactly ``vocab_size`` entries, trained on the built-in corpus: when the
    corpus cannot supply enough merges, the vocabulary is padded with ``<extra_N>`` special
    tokens."""
    fast = train_bpe_tokenizer(_training_corpus(), vocab_size, model_max_length, special_tokens)
    missing = vocab_size - len(fast)
    if missing > 0:
        fast.backend_tokenizer.add_special_tokens([f"<extra_{i}>" for i in range(missing)])
    if len(fast) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(fast)} entries, expected {vocab_size}")
    return fast
