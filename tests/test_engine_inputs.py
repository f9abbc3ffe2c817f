"""Bad input gets a clear error when the request is added, and the engine keeps serving."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from mmserve import LLM, SamplingParams
from mmserve.processing.images import InvalidInputError
from tests.conftest import assert_no_leaks, make_image

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def llm(clip_llama: str) -> LLM:
    return LLM(clip_llama, dtype="float32", max_model_len=96, limit_mm_per_prompt=2,
               max_num_seqs=4, max_image_pixels=1_000_000)


def _chat(text: str, images: list) -> dict:
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}], "images": images}


def _png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _bad_inputs(tmp_path) -> dict[str, tuple[dict, str]]:
    png = _png_bytes(make_image(1, (48, 48)))
    tmp_path.joinpath("truncated.png").write_bytes(png[: len(png) // 2])
    return {
        "too many images": (_chat("x", [make_image(i, (20, 20)) for i in range(3)]),
                            "limit_mm_per_prompt"),
        "prompt too long": (_chat("word " * 200, []), "max_model_len"),
        # Over max_model_len x 2 x the longest token's characters (96 x 2 x 9): refused
        # before the template and the tokenizer run, and before any image is decoded.
        "text no prompt of max_model_len holds": (
            _chat("word " * 400, [b"not an image"]), "more than 96 tokens can hold"),
        "unreadable bytes": (_chat("x", [b"definitely not an image"]), "cannot decode"),
        "truncated file": (_chat("x", [str(tmp_path / "truncated.png")]), "cannot decode"),
        "missing file": (_chat("x", [str(tmp_path / "nope.png")]), "not found"),
        "bad data url": ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}]},
            "base64"),
        "image bomb": (_chat("x", [Image.new("RGB", (10_000, 6_000))]), "exceeds the limit"),
        "unknown role": ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
        "unknown part": ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
                         "supported"),
        "placeholder mismatch": ({"prompt": "USER: <image>\nhi\nASSISTANT:", "images": []},
                                 "placeholder"),
        "image without part": ({"messages": [{"role": "user", "content": "hi"}],
                                "images": [make_image(0, (20, 20))]}, "no {'type': 'image'}"),
        "remote url": (_chat("x", ["https://example.com/cat.png"]), "remote"),
        "video in multi_modal_data": ({"prompt": "USER: <image>\nhi\nASSISTANT:",
                                       "multi_modal_data": {"image": [make_image(0, (20, 20))],
                                                            "video": [b"frames"]}},
                                      "images only.*'video'"),
        "images given twice": ({"prompt": "USER: <image>\nhi\nASSISTANT:",
                                "images": [make_image(0, (20, 20))],
                                "multi_modal_data": {"image": make_image(1, (20, 20))}},
                               "both in 'images' and in 'multi_modal_data'"),
        "multi_modal_data not a dict": ({"prompt": "USER: <image>\nhi\nASSISTANT:",
                                         "multi_modal_data": [make_image(0, (20, 20))]},
                                        "'multi_modal_data' must be a dict"),
    }


def test_each_bad_input_is_rejected_and_engine_keeps_serving(llm: LLM, tmp_path) -> None:
    engine = llm.engine
    good = _chat("what is this?", [make_image(3, (30, 30))])
    expected = llm.generate(good, GREEDY)[0].token_ids
    for name, (prompt, message) in _bad_inputs(tmp_path).items():
        # A request already running when the bad one arrives must be unaffected.
        running = engine.add_request(good, GREEDY)
        engine.step()
        with pytest.raises(InvalidInputError, match=message):
            engine.add_request(prompt, GREEDY)
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out
        assert outputs[running].token_ids == expected, name
        assert_no_leaks(engine)


@pytest.mark.parametrize("prompt, param", [
    ({"prompt": "hello world " * 2_600_000}, "prompt"),  # 31 MB: refused untokenized
    ({"prompt": "word " * 200}, "prompt"),  # tokenized: 201 tokens
    ({"messages": [{"role": "user", "content": "hello world " * 2_600_000}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "word " * 200}]}]},
     "messages"),
])
def test_a_prompt_over_max_model_len_names_its_field(llm: LLM, prompt: dict,
                                                     param: str) -> None:
    with pytest.raises(InvalidInputError, match="max_model_len") as e:
        llm.engine.add_request(prompt, GREEDY)
    assert e.value.param == param
    assert ("characters" in str(e.value)) == (len(str(prompt)) > 1_000_000)
    assert_no_leaks(llm.engine)


def test_data_url_and_bytes_and_path_images_agree(llm: LLM, tmp_path) -> None:
    img = make_image(5, (33, 21))
    png = _png_bytes(img)
    path = tmp_path / "img.png"
    path.write_bytes(png)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    prompts = [
        _chat("what?", [img]),
        _chat("what?", [png]),
        _chat("what?", [str(path)]),
        {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "what?"}]}]},
    ]
    outs = llm.generate(prompts, GREEDY)
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert_no_leaks(llm.engine)


def test_vllm_multi_modal_data_gives_the_images(llm: LLM) -> None:
    """vLLM's prompt form, ``multi_modal_data={"image": ...}`` with one image or a list,
    reads as mmserve's ``images``."""
    text = "USER: <image>\n<image>\nwhat differs?\nASSISTANT:"
    images = [make_image(6, (30, 20)), make_image(7, (20, 30))]
    one = "USER: <image>\nwhat is it?\nASSISTANT:"
    outs = llm.generate([{"prompt": text, "images": images},
                         {"prompt": text, "multi_modal_data": {"image": images}},
                         {"prompt": one, "images": images[:1]},
                         {"prompt": one, "multi_modal_data": {"image": images[0]}}], GREEDY)
    assert outs[0].token_ids == outs[1].token_ids and outs[2].token_ids == outs[3].token_ids
    assert outs[0].token_ids != outs[2].token_ids  # two prompts that differ, told apart
    assert_no_leaks(llm.engine)


def test_vllm_image_pil_part_in_chat(llm: LLM) -> None:
    """vLLM's ``{"type": "image_pil", "image_pil": PIL image}`` chat part is an image part."""
    img = make_image(8, (26, 26))
    outs = llm.generate([_chat("what?", [img]),
                         {"messages": [{"role": "user", "content": [
                             {"type": "image_pil", "image_pil": img},
                             {"type": "text", "text": "what?"}]}]}], GREEDY)
    assert outs[0].token_ids == outs[1].token_ids
    with pytest.raises(InvalidInputError, match="image_pil must be a PIL image"):
        llm.generate({"messages": [{"role": "user", "content": [
            {"type": "image_pil", "image_pil": "/etc/hostname"}]}]}, GREEDY)
    assert_no_leaks(llm.engine)


def test_bad_prompt_in_a_batch_queues_nothing(llm: LLM) -> None:
    with pytest.raises(InvalidInputError):
        llm.generate([_chat("fine", []), _chat("word " * 200, [])], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert_no_leaks(llm.engine)


def test_image_larger_than_encoder_cache_is_rejected(clip_llama: str) -> None:
    with pytest.raises(ValueError, match="encoder_cache_size"):
        LLM(clip_llama, dtype="float32", encoder_cache_size=8)


def test_abort_releases_everything(llm: LLM) -> None:
    engine = llm.engine
    ids = [engine.add_request(_chat(f"story {i}", [make_image(i, (30, 30))]),
                              SamplingParams(max_tokens=40, temperature=0.0)) for i in range(4)]
    engine.step()
    engine.step()
    for rid in ids[:3]:
        engine.abort_request(rid)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert list(finished) == [ids[3]]
    assert_no_leaks(engine)


def test_sampling_seed_reproducible_and_stop_strings(llm: LLM) -> None:
    prompt = _chat("tell me a story", [make_image(2, (30, 30))])
    sampled = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    a = llm.generate([prompt, _chat("other", [])], [sampled, GREEDY])[0]
    b = llm.generate([_chat("x", []), prompt], [GREEDY, sampled])[1]
    assert a.token_ids == b.token_ids  # the seed, not the batch, decides

    full = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0))[0]
    stop_tok = full.token_ids[3]
    cut = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0,
                                              stop_token_ids=[stop_tok]))[0]
    assert cut.token_ids == full.token_ids[:full.token_ids.index(stop_tok) + 1]
    assert cut.finish_reason == "stop"

    stop_str = full.text[len(full.text) // 2:][:3]
    assert stop_str
    stopped = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0,
                                                  stop=[stop_str]))[0]
    assert stop_str not in stopped.text
    assert full.text.startswith(stopped.text)
    assert stopped.finish_reason == "stop"
    assert full.finish_reason == "length" and len(full.token_ids) == 10
    assert_no_leaks(llm.engine)


def test_chat_and_caption_front_doors(llm: LLM) -> None:
    images = [make_image(i, (30 + i, 30)) for i in range(3)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    captions = llm.caption(images, prompt="Describe this image.", sampling_params=greedy,
                           use_tqdm=False)
    chats = llm.chat([[{"role": "user", "content": [
        {"type": "image", "image": img}, {"type": "text", "text": "Describe this image."}]}]
        for img in images], greedy)
    assert captions == [c.text for c in chats]
    assert len(set(captions)) == 3  # different pictures, different captions
    assert_no_leaks(llm.engine)


def test_bfloat16_engine_runs(clip_llama: str) -> None:
    llm = LLM(clip_llama, dtype="bfloat16", max_model_len=96)
    assert llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    out = llm.generate(_chat("what is this?", [make_image(1, (30, 30))]),
                       SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert len(out.token_ids) == 8
    assert_no_leaks(llm.engine)


def test_cached_prompt_tokens_are_reported(llm: LLM) -> None:
    prompt = _chat("what colour is the square in the middle of this picture?",
                   [make_image(7, (30, 30))])
    first = llm.generate(prompt, GREEDY)[0]
    again = llm.generate(prompt, GREEDY)[0]
    block_size = llm.engine.config.block_size
    assert first.num_cached_tokens == 0
    # Every full block but the one holding the last prompt token (always recomputed).
    assert again.num_cached_tokens == (again.num_prompt_tokens - 1) // block_size * block_size
    assert again.num_cached_tokens > 0
    assert again.token_ids == first.token_ids
    assert_no_leaks(llm.engine)


def test_reset_caches_makes_the_next_run_cold(llm: LLM) -> None:
    prompt = _chat("describe the picture in detail please", [make_image(11, (40, 30))])
    engine = llm.engine
    first = llm.generate([prompt], GREEDY)[0]
    before = engine.stats()
    again = llm.generate([prompt], GREEDY)[0]
    warm = engine.stats()
    assert again.num_cached_tokens > 0  # a warm run reuses the prefix blocks
    engine.reset_caches()
    cold = llm.generate([prompt], GREEDY)[0]
    after = engine.stats()
    assert cold.token_ids == first.token_ids == again.token_ids
    assert cold.num_cached_tokens == 0
    assert after["encoder_cache_misses"] == warm["encoder_cache_misses"] + 1  # encoded again
    assert warm["encoder_cache_misses"] == before["encoder_cache_misses"]
    assert_no_leaks(engine)
