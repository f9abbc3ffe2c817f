"""The benchmark checkpoint: real LLaVA-1.5-like shapes, random weights, built offline.

Shapes (212M parameters, 86M of them in the vision tower; 423 MB in bfloat16):

| part | shape |
| --- | --- |
| vision tower | CLIP ViT-B/16 at 224 px: 12 layers, hidden 768, MLP 3072, 12 heads, patch 16 |
| image tokens | (224 / 16)^2 = 196 per image (CLS dropped, features of layer -2) |
| projector | 768 -> 768 -> 768, GELU |
| decoder | Llama: 12 layers, hidden 768, MLP 2048 (SiLU), 12 query heads, 4 KV heads, head 64 |
| vocabulary | 32000, byte-level BPE; every id decodes to text |
| context | 4096 positions |

The weights are drawn by the tiny-checkpoint builder (`build_tiny_llava`), so the scheme that
makes greedy outputs varied is the same. Its tokenizer would pad a vocabulary this large with
special tokens that decode to nothing; here the tokenizer is trained on a larger synthetic corpus
until all 32000 ids are real text pieces, so detokenization costs what it costs on a real model.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from mmserve.testing.llava import CHAT_TEMPLATE, build_tiny_llava
from mmserve.testing.tokenizer import IMAGE_TOKEN, train_bpe_tokenizer

logger = logging.getLogger(__name__)

BENCH_SHAPES = {
    "image_size": 224,
    "patch_size": 16,
    "vision_hidden": 768,
    "vision_layers": 12,
    "vision_heads": 12,
    "text_hidden": 768,
    "text_layers": 12,
    "text_heads": 12,
    "text_kv_heads": 4,
    "intermediate_size": 2048,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}

# Written last: a directory holding it is complete and was built with these shapes.
_MARKER = "mmserve_bench_checkpoint.json"

_SYLLABLES = ("ba be bi bo bu ka ke ki ko ku la le li lo lu ma me mi mo mu na ne ni no nu ra re "
              "ri ro ru sa se si so su ta te ti to tu va ve vi vo vu za ze zi zo zu qua pre pro "
              "con dis ing tion ment able ous ive ly er est ed").split()


def _corpus(seed: int, num_lines: int) -> Iterator[str]:
    """Words made of random syllables: enough distinct pieces for 32000 BPE merges."""
    rng = random.Random(seed)
    yield CHAT_TEMPLATE
    yield "SYSTEM: You are a helpful assistant.\nUSER: What is in this picture?\nASSISTANT:"
    for _ in range(num_lines):
        yield " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
                       for _ in range(8))


def build_bench_tokenizer(vocab_size: int, model_max_length: int, seed: int = 0):
    """A byte-level BPE tokenizer whose ``vocab_size`` ids are all text, specials at ids 0..4."""
    tokenizer = train_bpe_tokenizer(_corpus(seed, num_lines=200_000), vocab_size,
                                    model_max_length)
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"the tokenizer reached {len(tokenizer)} ids, not {vocab_size}; "
                           "train on a larger corpus")
    return tokenizer


def build_bench_checkpoint(path: str | Path, seed: int = 0) -> Path:
    """Write the benchmark checkpoint to ``path`` (bfloat16 weights) and return the path."""
    from transformers import AutoImageProcessor, LlavaProcessor

    out = Path(path)
    start = time.perf_counter()
    # The tiny builder draws the weights and writes config, image processor and a placeholder
    # tokenizer; the tokenizer and processor files are then replaced by the full-text ones.
    build_tiny_llava(out, **BENCH_SHAPES, dtype=torch.bfloat16, seed=seed)
    tokenizer = build_bench_tokenizer(BENCH_SHAPES["vocab_size"],
                                      BENCH_SHAPES["max_position_embeddings"], seed)
    processor = LlavaProcessor(
        image_processor=AutoImageProcessor.from_pretrained(out, local_files_only=True),
        tokenizer=tokenizer, patch_size=BENCH_SHAPES["patch_size"],
        vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN, num_additional_image_tokens=1)
    processor.save_pretrained(out)
    (out / _MARKER).write_text(json.dumps({"seed": seed, **BENCH_SHAPES}, indent=1))
    logger.info("built the bench checkpoint in %s in %.0f s", out, time.perf_counter() - start)
    return out


def ensure_bench_checkpoint(path: str | Path, seed: int = 0) -> Path:
    """The checkpoint at ``path``, built first unless a complete one with these shapes is there.

    Building takes about a minute on two cores; keep the directory between runs.
    """
    out = Path(path)
    marker = out / _MARKER
    if marker.is_file() and json.loads(marker.read_text()) == {"seed": seed, **BENCH_SHAPES}:
        return out
    return build_bench_checkpoint(out, seed)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build the benchmark checkpoint offline.")
    parser.add_argument("path", help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    print(ensure_bench_checkpoint(args.path, args.seed))
