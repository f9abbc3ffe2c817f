"""The benchmark checkpoints: real model shapes, random weights, built offline.

Two, chosen by name (``mmserve bench --bench-checkpoint NAME``); on two CPU cores both cost
about the same per request of a small image (a 256 x 200 image: 33 GFLOP in LLaVA's vision
tower, 42 in Qwen2.5-VL's).

``llava`` (the default; 212M parameters, 86M of them in the vision tower; 423 MB in bfloat16):

| part | shape |
| --- | --- |
| vision tower | CLIP ViT-B/16 at 224 px: 12 layers, hidden 768, MLP 3072, 12 heads, patch 16 |
| image tokens | (224 / 16)^2 = 196 per image, whatever its size (CLS dropped, layer -2) |
| projector | 768 -> 768 -> 768, GELU |
| decoder | Llama: 12 layers, hidden 768, MLP 2048 (SiLU), 12 query heads, 4 KV heads, head 64 |

``qwen2_5_vl`` (Qwen2.5-VL's layer types at widths near LLaVA's; 210.5M parameters, 88M of them
in the vision tower and merger; 421 MB in bfloat16):

| part | shape |
| --- | --- |
| vision tower | Qwen2.5-VL's: 16 layers, hidden 640, gated SiLU MLP 1712, 10 heads, RMSNorm |
| patches | 14 x 14 pixels x 2 frames (an image is repeated) |
| attention | in 112 px windows, but over the whole image in layers 3, 7, 11, 15 |
| image tokens | 2 x 2 patches each: 4 to 1024 by the image's size (56 x 56 to 28 x 28 x 1024 px) |
| merger | RMSNorm, 2560 -> 2560 -> 768, GELU |
| decoder | Qwen2: 12 layers, hidden 768, MLP 2048 (SiLU), 12 query heads, 2 KV heads, head 64 |
| positions | M-RoPE, sections 8 / 12 / 12 (temporal, height, width), theta 1e6 |

Two at real sizes, for GPUs (their weights are drawn there when there is one), in the
``llava`` checkpoint's layout and vocabulary:

- ``llava-1.4b`` (1.41B parameters): CLIP ViT-L/14 at 336 px (24 layers, hidden 1024; 576
  tokens an image) and a Llama decoder of TinyLlama's shapes (22 layers, hidden 2048, MLP 5632,
  32 query heads, 4 KV heads);
- ``llava-7b`` (7.06B): the same vision tower and LLaVA-1.5-7B's decoder (32 layers, hidden
  4096, MLP 11008, 32 heads, 32 KV heads).

All: a 32000-piece byte-level BPE vocabulary in which every id decodes to text, and 4096
positions. The weights are drawn by the family's tiny-checkpoint builder (`build_tiny_llava`,
`build_tiny_qwen2_vl`), so the scheme that makes greedy outputs varied is the same. Those
builders would pad a vocabulary this large with special tokens that decode to nothing; here the
tokenizer is trained on a larger synthetic corpus until all 32000 ids are real text pieces (the
family's special tokens first, at the ids the builder gave them), so detokenization costs what it
costs on a real model.

The ``llava`` checkpoint is written in the published layout of LLaVA checkpoints on the Hub
(``vision_tower.vision_model.*``, ``language_model.model.*``, ``multi_modal_projector.*``, as
llava-hf/llava-1.5-7b-hf names its weights; `mmserve.testing.llava.published_weight_name`), so that
vLLM loads it as well as mmserve and transformers (`benchmarks/compare_vllm.py`).

A checkpoint is built into a sibling directory and moved into place when complete, so that a run
reading the old one while another process rebuilds it does not read half-written files.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmserve.testing import build_tiny_checkpoint
from mmserve.testing import llava as llava_fixture
from mmserve.testing import qwen2_vl as qwen2_vl_fixture
from mmserve.testing.tokenizer import LLAVA_SPECIAL_TOKENS, SpecialTokens, train_bpe_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchCheckpoint:
    """A benchmark checkpoint: a tiny-checkpoint family's builder at real shapes, with a
    tokenizer whose every id is text."""

    family: str  # the `build_tiny_checkpoint` family
    shapes: dict[str, Any]  # the family builder's keywords
    special_tokens: SpecialTokens  # at ids 0.., as the builder's tokenizer has them
    chat_template: str
    sample_prompt: str  # one rendered chat, in the tokenizer's training corpus
    # The family builder's other keywords (e.g. the weights' layout), recorded in the marker.
    options: dict[str, Any] = field(default_factory=dict)
    # Weights drawn on the GPU when there is one (``random_model``): billions of parameters
    # take seconds there, many minutes on a CPU.
    draw_on_gpu: bool = False


_LLAVA_SAMPLE_PROMPT = ("SYSTEM: You are a helpful assistant.\nUSER: What is in this picture?\n"
                        "ASSISTANT:")
# CLIP ViT-L/14 at 336 px, LLaVA-1.5's vision tower (MLP 4 x 1024): 576 tokens an image.
_CLIP_L_336 = {"image_size": 336, "patch_size": 14, "vision_hidden": 1024, "vision_layers": 24,
               "vision_heads": 16}


def _llava(shapes: dict[str, Any], draw_on_gpu: bool = False) -> BenchCheckpoint:
    """A LLaVA bench checkpoint of these shapes, in the published layout (the Hub's weight
    names, which vLLM's LLaVA loader requires), with a 32000-piece vocabulary and 4096
    positions."""
    return BenchCheckpoint(
        family="llava",
        shapes={**shapes, "vocab_size": 32000, "max_position_embeddings": 4096},
        special_tokens=LLAVA_SPECIAL_TOKENS,
        chat_template=llava_fixture.CHAT_TEMPLATE,
        sample_prompt=_LLAVA_SAMPLE_PROMPT,
        options={"layout": "published"},
        draw_on_gpu=draw_on_gpu,
    )


BENCH_CHECKPOINTS: dict[str, BenchCheckpoint] = {
    "llava": _llava({"image_size": 224, "patch_size": 16, "vision_hidden": 768,
                     "vision_layers": 12, "vision_heads": 12, "text_hidden": 768,
                     "text_layers": 12, "text_heads": 12, "text_kv_heads": 4,
                     "intermediate_size": 2048}),
    # LLaVA-1.5's vision tower and projector before a TinyLlama-sized decoder: 1.41B
    # parameters.
    "llava-1.4b": _llava({**_CLIP_L_336, "text_hidden": 2048, "text_layers": 22,
                          "text_heads": 32, "text_kv_heads": 4, "intermediate_size": 5632},
                         draw_on_gpu=True),
    # LLaVA-1.5-7B's shapes: 7.06B parameters.
    "llava-7b": _llava({**_CLIP_L_336, "text_hidden": 4096, "text_layers": 32,
                        "text_heads": 32, "text_kv_heads": 32, "intermediate_size": 11008},
                       draw_on_gpu=True),
    "qwen2_5_vl": BenchCheckpoint(
        family="qwen2_5_vl",
        shapes={
            "vision_hidden": 640,
            "vision_layers": 16,
            "vision_heads": 10,
            "vision_intermediate_size": 1712,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": (3, 7, 11, 15),
            "text_hidden": 768,
            "text_layers": 12,
            "text_heads": 12,
            "text_kv_heads": 2,
            "mrope_section": (8, 12, 12),
            "rope_theta": 1e6,
            "intermediate_size": 2048,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
            "min_pixels": 56 * 56,
            "max_pixels": 28 * 28 * 1024,
        },
        special_tokens=qwen2_vl_fixture.QWEN_SPECIAL_TOKENS,
        chat_template=qwen2_vl_fixture.CHAT_TEMPLATE,
        sample_prompt="<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                      "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in "
                      "this picture?<|im_end|>\n<|im_start|>assistant\n",
    ),
}
DEFAULT_BENCH_CHECKPOINT = "llava"

# Written last: a directory holding it is complete and was built with these shapes.
_MARKER = "mmserve_bench_checkpoint.json"
_DRAWN_ON = "weights_drawn_on"  # "cpu" or "cuda", in the marker
# Raised when what a checkpoint's files hold changes for the same shapes, so that a cached one
# is built again. 2: the llava checkpoint's weights in the published layout.
_FORMAT_VERSION = 2
# Lines of synthetic text per vocabulary entry: enough distinct pieces for every merge.
_CORPUS_LINES_PER_ID = 6.25

_SYLLABLES = ("ba be bi bo bu ka ke ki ko ku la le li lo lu ma me mi mo mu na ne ni no nu ra re "
              "ri ro ru sa se si so su ta te ti to tu va ve vi vo vu za ze zi zo zu qua pre pro "
              "con dis ing tion ment able ous ive ly er est ed").split()


def _corpus(checkpoint: BenchCheckpoint, seed: int, num_lines: int) -> Iterator[str]:
    """The chat format, then words made of random syllables."""
    rng = random.Random(seed)
    yield checkpoint.chat_template
    yield checkpoint.sample_prompt
    for _ in range(num_lines):
        yield " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
                       for _ in range(8))


def build_bench_tokenizer(checkpoint: BenchCheckpoint, vocab_size: int, model_max_length: int,
                          seed: int = 0):
    """A byte-level BPE tokenizer whose ``vocab_size`` ids are all text but the checkpoint's
    special tokens, which come first."""
    num_lines = max(1000, int(vocab_size * _CORPUS_LINES_PER_ID))
    tokenizer = train_bpe_tokenizer(_corpus(checkpoint, seed, num_lines), vocab_size,
                                    model_max_length, checkpoint.special_tokens)
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"the tokenizer reached {len(tokenizer)} ids, not {vocab_size}; "
                           "train on a larger corpus")
    return tokenizer


def bench_checkpoint(name: str) -> BenchCheckpoint:
    if name not in BENCH_CHECKPOINTS:
        raise ValueError(f"unknown bench checkpoint {name!r}; choose one of "
                         f"{', '.join(BENCH_CHECKPOINTS)}")
    return BENCH_CHECKPOINTS[name]


def default_bench_dir(name: str = DEFAULT_BENCH_CHECKPOINT) -> Path:
    """Where the bench checkpoint ``name`` is cached: ``$XDG_CACHE_HOME/mmserve/bench-NAME``."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "mmserve" / f"bench-{name}"


def weights_device(checkpoint: BenchCheckpoint) -> str | None:
    """Where the checkpoint's weights are drawn: a GPU if it asks for one and there is one,
    else None (the CPU, as transformers builds the model)."""
    return "cuda" if checkpoint.draw_on_gpu and torch.cuda.is_available() else None


def build_bench_checkpoint(path: str | Path, name: str = DEFAULT_BENCH_CHECKPOINT,
                           seed: int = 0, device: str | None = None, **shapes: Any) -> Path:
    """Write the bench checkpoint ``name`` to ``path`` (bfloat16 weights) and return the path.

    ``shapes`` replace some of its shapes (tests build it scaled down); ``device`` is where
    the weights are drawn (default: ``weights_device``). The files are written into a sibling
    directory first, which then replaces ``path`` (and whatever was there).
    """
    from mmserve.testing.oracle import load_hf_processor

    checkpoint = bench_checkpoint(name)
    shapes = {**checkpoint.shapes, **shapes}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    start = time.perf_counter()
    device = device or weights_device(checkpoint)
    try:
        # The builder draws the weights and writes config, processor and a padded tokenizer;
        # the processor is then saved again with the full-text tokenizer (same special-token
        # ids).
        build_tiny_checkpoint(checkpoint.family, staging, **shapes, **checkpoint.options,
                              dtype=torch.bfloat16, seed=seed, device=device)
        processor = load_hf_processor(staging)
        processor.tokenizer = build_bench_tokenizer(checkpoint, shapes["vocab_size"],
                                                    shapes["max_position_embeddings"], seed)
        processor.save_pretrained(staging)
        # Where the weights were drawn is recorded (a GPU's generator draws other numbers
        # than the CPU's), not required: either is the checkpoint ``name``.
        (staging / _MARKER).write_text(json.dumps(
            {**_marker(name, seed, shapes, checkpoint.options),
             _DRAWN_ON: torch.device(device or "cpu").type}, indent=1))
        _replace_dir(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("built the %s bench checkpoint in %s in %.0f s", name, out,
                time.perf_counter() - start)
    return out


def _replace_dir(new: Path, out: Path) -> None:
    """Move the directory ``new`` to ``out``. An old ``out`` is moved aside first and removed
    (files a running process has open stay readable until it closes them), but only if it
    holds nothing but files of the names ``new`` has: any other directory is left alone."""
    if out.exists():
        ours = {f.name for f in new.iterdir()}
        foreign = [f.name for f in out.iterdir() if not f.is_file() or f.name not in ours]
        if foreign:
            raise FileExistsError(
                f"{out} holds files that are not a bench checkpoint's ({', '.join(foreign[:5])});"
                " give an empty or new directory")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(new, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, out)


def _marker(name: str, seed: int, shapes: dict[str, Any],
            options: dict[str, Any]) -> dict[str, Any]:
    # Through JSON, so that tuples compare equal to the lists read back.
    return json.loads(json.dumps({"checkpoint": name, "format": _FORMAT_VERSION, "seed": seed,
                                  **options, **shapes}))


def ensure_bench_checkpoint(path: str | Path | None = None,
                            name: str = DEFAULT_BENCH_CHECKPOINT, seed: int = 0) -> Path:
    """The bench checkpoint ``name`` at ``path`` (default: `default_bench_dir`), built first
    unless a complete one with these shapes is there.

    Building ``llava`` or ``qwen2_5_vl`` takes about a minute on two cores; keep the directory
    between runs. The larger ones draw their weights on a GPU when there is one (drawing takes
    seconds there; writing ``llava-7b``'s 14 GB takes longer); on a CPU they take many minutes.
    """
    out = Path(path) if path is not None else default_bench_dir(name)
    marker = out / _MARKER
    checkpoint = bench_checkpoint(name)
    expected = _marker(name, seed, checkpoint.shapes, checkpoint.options)
    if marker.is_file():
        found = json.loads(marker.read_text())
        found.pop(_DRAWN_ON, None)
        if found == expected:
            return out
    return build_bench_checkpoint(out, name, seed)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build a benchmark checkpoint offline.")
    parser.add_argument("path", nargs="?", help="output directory (default: the cache)")
    parser.add_argument("--bench-checkpoint", default=DEFAULT_BENCH_CHECKPOINT,
                        choices=sorted(BENCH_CHECKPOINTS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    print(ensure_bench_checkpoint(args.path, args.bench_checkpoint, args.seed))
