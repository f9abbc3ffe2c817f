"""Incremental detokenization: the Rust tokenizer's stream decoder (one call a token) gives the
text the two-decode algorithm of slow tokenizers gives, byte-fallback pieces and special tokens
included, and stop strings cut the text the same way."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from mmserve.demo.checkpoint import demo_model_path
from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.testing import build_tiny_checkpoint


@pytest.fixture(scope="module")
def tokenizers(clip_llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    qwen = build_tiny_checkpoint("qwen2_vl", tmp_path_factory.mktemp("detok") / "qwen")
    return {name: AutoTokenizer.from_pretrained(path) for name, path in
            {"llama": clip_llama, "qwen2": str(qwen), "demo": str(demo_model_path())}.items()}


def _stream(tokenizer, ids: list[int], stop: list[str], fast: bool) -> tuple[str, bool, str]:
    detok = IncrementalDetokenizer(tokenizer, stop)
    if not fast:
        detok._stream = None  # the two-decode algorithm
    streamed = ""
    for i in ids:
        detok.add(i)
        streamed += detok.take_new_text(final=False)
        if detok.stopped:
            break
    streamed += detok.take_new_text(final=True)
    return detok.text, detok.stopped, streamed


@pytest.mark.parametrize("name", ["llama", "qwen2", "demo"])
def test_stream_decoder_equals_the_two_decode_algorithm(tokenizers: dict, name: str) -> None:
    tokenizer = tokenizers[name]
    assert tokenizer.backend_tokenizer is not None  # the fast path is what runs
    rng = random.Random(name)
    texts = []
    for _ in range(100):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        fast = _stream(tokenizer, ids, [], fast=True)
        assert fast == _stream(tokenizer, ids, [], fast=False), ids
        assert fast[0] == fast[2]  # everything streamed, in order
        texts.append((ids, fast[0]))
    # Stop strings taken from the text itself cut it at the same place either way.
    for ids, text in texts[:30]:
        if len(text) > 6:
            stop = [text[len(text) // 2: len(text) // 2 + 3]]
            fast = _stream(tokenizer, ids, stop, fast=True)
            assert fast == _stream(tokenizer, ids, stop, fast=False), (ids, stop)
            assert fast[1] and stop[0] not in fast[0]


@pytest.mark.parametrize("fast", [True, False], ids=["stream decoder", "two decodes"])
def test_special_tokens_and_the_stop_string_kept_when_asked(tokenizers: dict,
                                                            fast: bool) -> None:
    """vLLM's ``skip_special_tokens=False`` keeps a special token's text;
    ``include_stop_str_in_output`` keeps the stop string at the end of the text."""
    tokenizer = tokenizers["llama"]
    ids = tokenizer.encode("the cat sat on the mat", add_special_tokens=False)
    eos = tokenizer.eos_token_id

    def run(**options) -> tuple[str, bool]:
        detok = IncrementalDetokenizer(tokenizer, options.pop("stop", []), **options)
        if not fast:
            detok._stream = None
        for t in [*ids, eos]:
            detok.add(t)
            if detok.stopped:
                break
        return detok.text, detok.stopped

    assert run() == ("the cat sat on the mat", False)
    text, _ = run(skip_special_tokens=False)
    assert text.endswith(tokenizer.eos_token) and text.startswith("the cat sat on the mat")
    assert run(stop=["sat"]) == ("the cat ", True)
    assert run(stop=["sat"], include_stop_str=True) == ("the cat sat", True)
