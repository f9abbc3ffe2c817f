"""Qwen2-VL and Qwen2.5-VL: greedy float32 output equals transformers' generate(), token for
token, with images of different sizes and aspect ratios (each a different number of tokens,
three rows of positions), through chunked prefill, preemption, encoder- and prefix-cache hits
and processor settings that change ``max_pixels``."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from mmserve import LLM, SamplingParams
from mmserve.processing.hf_processors import load_qwen2_vl_processor
from mmserve.testing import build_tiny_checkpoint
from mmserve.testing.oracle import hf_greedy_generate
from tests.conftest import assert_no_leaks, generate_all_at_once, make_image, record_steps

MAX_TOKENS = 10
# Tiny and upscaled, square, thin, wide, tall, and larger than max_pixels allows.
SIZES = [(40, 30), (64, 64), (23, 57), (200, 90), (90, 180), (300, 260)]
IMAGES = [make_image(i, size) for i, size in enumerate(SIZES)]
SYSTEM = ("You are a careful assistant who looks at every picture closely and answers "
          "questions about shapes, colours and positions in short sentences.")
# name -> (family, builder options): both families, both checkpoint layouts, tied embeddings.
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_vl": ("qwen2_vl", {"layout": "transformers"}),
    "qwen2_5_vl-published": ("qwen2_5_vl", {"layout": "published"}),
    "qwen2_5_vl-tied": ("qwen2_5_vl", {"tie_word_embeddings": True, "seed": 5}),
}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("qwen")
    return {name: str(build_tiny_checkpoint(family, root / name, **options))
            for name, (family, options) in CHECKPOINTS.items()}


def _conversation(text: str, images: list[int], system: bool = False) -> dict:
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    return {"messages": messages + [{"role": "user", "content": content}],
            "images": [IMAGES[i] for i in images]}


def mixed_batch() -> list[dict]:
    """0 to 3 images of different sizes per request, prompts short to long."""
    return [_conversation(t, imgs) for t, imgs in [
        ("hi", []), ("what is in this picture?", [0]), ("describe both", [1, 2]),
        ("a long story about a red fox and a blue bird who live near the river", []),
        ("compare these three", [3, 4, 5]), ("count the shapes", [2]), ("ok", [5]),
        ("where is the square and what colour is the circle", [4, 0])]]


def shared_batch() -> list[dict]:
    """A long shared system prompt; three distinct images used again and again."""
    return [_conversation(t, imgs, system=True) for t, imgs in [
        ("what is this?", [3]), ("describe it", [1]), ("and this one?", [3]),
        ("compare them", [1, 5]), ("colours?", [5]), ("what is this?", [3]), ("hello", [])]]


@functools.cache
def _template(path: str):
    return load_qwen2_vl_processor(path)


def reference(path: str, prompts: list[dict], **processor_kwargs: Any) -> list[list[int]]:
    out = []
    for p in prompts:
        text = _template(path).apply_chat_template(p["messages"], add_generation_prompt=True,
                                                  tokenize=False)
        out.append(hf_greedy_generate(path, text, p["images"], MAX_TOKENS, **processor_kwargs))
    return out


def run(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert_no_leaks(llm.engine)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_parity_chunked_prefill_splits_images_and_their_positions(qwen: dict[str, str],
                                                                   name: str) -> None:
    path = qwen[name]
    prompts = mixed_batch()
    llm = LLM(path, dtype="float32", max_num_batched_tokens=24, max_num_seqs=4)
    steps = record_steps(llm)
    assert run(llm, prompts) == reference(path, prompts)
    lengths = {im.length for p in prompts
               for im in llm.engine.processor.process(p).images}
    assert len(lengths) >= 4, lengths  # the images really are of different token counts
    assert max(lengths) <= llm.engine.processor.tokens_per_image
    split = [(r, s) for out in steps for r in out.requests for s in r.image_slices
             if 0 < s.src_start]
    assert split, "no image was split across steps"
    # The chunk that continues an image carries three rows of positions, not a counter.
    sched, _ = split[0]
    assert len(sched.positions) == 3 and sched.positions[1] != sched.positions[2]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_parity_under_preemption(qwen: dict[str, str], name: str) -> None:
    path = qwen[name]
    prompts = mixed_batch()
    # Scheduled in step: scheduled ahead (a GPU's default) nobody is preempted.
    llm = LLM(path, dtype="float32", block_size=16, max_model_len=256, max_num_seqs=8,
              kv_cache_memory=16 * 16 * _kv_bytes_per_token(path), enable_prefix_caching=False,
              async_scheduling=False)
    outs = generate_all_at_once(llm, prompts, SamplingParams(max_tokens=MAX_TOKENS,
                                                             temperature=0.0))
    assert_no_leaks(llm.engine)
    assert [o.token_ids for o in outs] == reference(path, prompts)
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_parity_with_encoder_and_prefix_cache_hits(qwen: dict[str, str], name: str) -> None:
    path = qwen[name]
    prompts = shared_batch()
    llm = LLM(path, dtype="float32", max_num_batched_tokens=96, max_num_seqs=3)
    assert run(llm, prompts) == reference(path, prompts)
    stats = llm.stats()
    assert stats["encoder_cache_hits"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["encoder_items_computed"] == 3  # one encoder run per distinct image


def test_parity_with_max_pixels_from_processor_kwargs(qwen: dict[str, str]) -> None:
    """``mm_processor_kwargs`` lowering ``max_pixels``: fewer tokens per image, the same
    tokens as transformers' processor given the same setting."""
    path = qwen["qwen2_vl"]
    prompts = mixed_batch()
    small = {"max_pixels": 28 * 28 * 12}
    llm = LLM(path, dtype="float32", mm_processor_kwargs=small)
    # transformers' processor is given the setting as ``size`` (shortest and longest edge in
    # pixels of area): some versions ignore ``max_pixels`` in a call, others warn it is going.
    size = {"shortest_edge": _template(path).image_processor.size["shortest_edge"],
            "longest_edge": small["max_pixels"]}
    assert run(llm, prompts) == reference(path, prompts, size=size)
    default = LLM(path, dtype="float32")

    def lengths(engine) -> list[int]:
        return [im.length for p in prompts for im in engine.processor.process(p).images]

    assert max(lengths(llm.engine)) <= 12 < max(lengths(default.engine))
    # The budget follows: the largest item (a 200:1 image keeps a row of whole tokens) shrinks.
    assert llm.engine.processor.tokens_per_image < default.engine.processor.tokens_per_image


def _kv_bytes_per_token(path: str) -> int:
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(path).text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 4


def test_parity_with_borrowed_encoder_outputs_under_kv_pressure(qwen: dict[str, str]) -> None:
    """The encoder cache's reserve holds the largest item (113 tokens); three 56-token images
    take turns, so one not in use waits in free KV blocks (10 blocks in all, a request needs
    8), is taken back on a hit, or is given back as the KV cache fills: the same tokens."""
    path = qwen["qwen2_5_vl-published"]
    large = [make_image(10 + k, (300, 260)) for k in range(3)]

    def ask(text: str, k: int) -> dict:
        return {"messages": [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": text}]}], "images": [large[k]]}

    prompts = [ask("what is this?", 0), ask("and this?", 1), ask("this one?", 2),
               ask("again?", 0), ask("the second again", 1),
               ask("a long question about the colours and the shapes in this picture", 2),
               ask("last", 0)]
    llm = LLM(path, dtype="float32", max_num_seqs=1, enable_prefix_caching=False,
              encoder_cache_size=113, block_size=16,
              kv_cache_memory=10 * 16 * _kv_bytes_per_token(path))
    assert run(llm, prompts) == reference(path, prompts)
    stats = llm.stats()
    assert stats["encoder_cache_spills"] > 0 and stats["encoder_cache_restores"] > 0
    assert stats["encoder_cache_kv_pressure_evictions"] > 0


def test_parity_with_a_requests_own_pixel_bounds(qwen: dict[str, str]) -> None:
    """vLLM's per-request ``mm_processor_kwargs``: each request's images resized within its
    own ``min_pixels`` / ``max_pixels``, in one batch beside requests of the server's
    settings; the same tokens as transformers' processor given each request's setting, and
    the same image under other settings hashes apart (encoded again), under the same, not."""
    path = qwen["qwen2_vl"]
    checkpoint_min = _template(path).image_processor.size["shortest_edge"]
    bounds = [None, {"max_pixels": 28 * 28 * 6}, {"min_pixels": 28 * 28 * 20},
              {"max_pixels": 28 * 28 * 6}, None]
    prompts = [{**_conversation(text, [i]), **({} if b is None else {"mm_processor_kwargs": b})}
               for text, i, b in zip(["describe", "what is it", "colours?", "again", "more"],
                                     [3, 3, 0, 3, 0], bounds, strict=True)]
    llm = LLM(path, dtype="float32", max_num_seqs=8)
    expected = []
    for prompt, b in zip(prompts, bounds, strict=True):
        b = b or {}
        size = {"shortest_edge": b.get("min_pixels", checkpoint_min),
                "longest_edge": b.get("max_pixels", _template(path).image_processor.size[
                    "longest_edge"])}
        expected += reference(path, [prompt], size=size)
    assert run(llm, prompts) == expected
    lengths = [llm.engine.processor.process(p).images[0].length for p in prompts]
    assert lengths[1] == lengths[3] <= 6 < lengths[0] and lengths[2] >= 20 > lengths[4]
    # Image 3 under two settings, image 0 under two: four encoder runs, one hit.
    assert llm.stats()["encoder_items_computed"] == 4
