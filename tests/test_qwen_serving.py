"""Qwen2.5-VL served end to end: the OpenAI endpoint against the Python API for images of
different sizes, video parts refused at both front doors, ``mmserve plan``'s tokens per image
under the processor settings and declared image sizes that bound them, and the start-up error
that names a ``max_pixels`` that fits when the largest image does not.

Expected numbers come from the engine's Python API and from transformers' own image processor
on the same checkpoint, never from constants.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import openai
import pytest
from PIL import Image
from transformers import AutoConfig

from mmserve import LLM, SamplingParams
from mmserve.engine.memory_plan import InfeasiblePlanError
from mmserve.entrypoints.cli import main
from mmserve.errors import InvalidInputError
from mmserve.processing.registry import family_for
from mmserve.testing import build_tiny_checkpoint
from mmserve.testing.oracle import load_hf_processor
from tests.conftest import make_image
from tests.test_server import Server, data_url, image_message, wait_drained

MODEL_NAME = "tiny-qwen"
MAX_TOKENS = 12
# The serving checkpoint: up to 256 tokens per square-ish image, so sizes spread out.
SERVE_MAX_PIXELS = 28 * 28 * 256
# Tiny (scaled up to min_pixels), mid-size, wide and thin, and larger than max_pixels allows.
SIZES = [(60, 40), (300, 200), (500, 120), (640, 480)]
IMAGES = [make_image(i, size) for i, size in enumerate(SIZES)]
# The start-up checkpoint: one image can become about 1024 tokens, and a KV cache of 256
# tokens (16 blocks of 16) is too small for one of them.
LARGE_MAX_PIXELS = 28 * 28 * 1024
SMALL_KV_TOKENS = 256


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("qwen_serving")


@pytest.fixture(scope="module")
def qwen(root) -> str:
    return str(build_tiny_checkpoint("qwen2_5_vl", root / "serve", max_pixels=SERVE_MAX_PIXELS))


@pytest.fixture(scope="module")
def qwen_large(root) -> str:
    return str(build_tiny_checkpoint("qwen2_5_vl", root / "large", layout="published",
                                     max_pixels=LARGE_MAX_PIXELS, seed=3))


@pytest.fixture(scope="module")
def small_kv_bytes(qwen_large: str) -> int:
    """Bytes of a KV cache of ``SMALL_KV_TOKENS`` float32 tokens of the large checkpoint."""
    text = AutoConfig.from_pretrained(qwen_large).text_config
    head_dim = text.hidden_size // text.num_attention_heads
    return SMALL_KV_TOKENS * 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 4


@pytest.fixture(scope="module")
def llm(qwen: str) -> LLM:
    return LLM(qwen, dtype="float32")


@pytest.fixture(scope="module")
def server(qwen: str, root) -> Iterator[Server]:
    srv = Server(qwen, "--served-model-name", MODEL_NAME, log=root / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def hf_tokens(path: str, image: Image.Image, max_pixels: int | None = None) -> int:
    """Tokens transformers' image processor makes of ``image`` (optionally under another
    ``max_pixels``): the merged patch grid."""
    image_processor = load_hf_processor(path).image_processor
    kwargs = {}
    if max_pixels is not None:
        kwargs["size"] = {"shortest_edge": min(image_processor.size["shortest_edge"],
                                               max_pixels), "longest_edge": max_pixels}
    grid = image_processor(images=[image], return_tensors="pt", **kwargs)["image_grid_thw"]
    return int(grid.prod()) // image_processor.merge_size ** 2


def python_api(llm: LLM, text: str, images: list[Image.Image]):
    """``LLM.generate`` on one chat prompt, greedy; (output, the processed prompt)."""
    prompt = {"messages": [{"role": "user", "content": [{"type": "image"}] * len(images)
                            + [{"type": "text", "text": text}]}], "images": images}
    out = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    return out, llm.engine.processor.process(prompt)


def assert_http_equals_python_api(client: openai.OpenAI, llm: LLM, text: str,
                                  images: list[Image.Image]) -> int:
    """Plain and streamed greedy chat over HTTP give the Python API's text and prompt length;
    returns that length."""
    expected, processed = python_api(llm, text, images)
    assert expected.num_prompt_tokens == len(processed.token_ids)
    messages = image_message(text, *[data_url(im) for im in images])

    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert plain.choices[0].message.content == expected.text
    assert plain.choices[0].finish_reason == expected.finish_reason
    assert plain.usage.prompt_tokens == expected.num_prompt_tokens
    assert plain.usage.completion_tokens == len(expected.token_ids)

    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        expected.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == expected.finish_reason and not any(reasons[:-1])
    assert chunks[-1].usage.prompt_tokens == expected.num_prompt_tokens
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    return plain.usage.prompt_tokens


# --------------------------------------------------------------------- serving
def test_chat_over_http_equals_the_python_api_for_images_of_every_size(
        client: openai.OpenAI, llm: LLM, server: Server, qwen: str) -> None:
    """Each image size is its own number of tokens: the HTTP usage counts them as the engine
    and transformers' processor do, and the greedy text is the Python API's."""
    text = "what is in this picture?"
    prompt_tokens = [assert_http_equals_python_api(client, llm, text, [im]) for im in IMAGES]
    image_tokens = []
    for im in IMAGES:
        (placeholder,) = llm.engine.processor.process(
            {"messages": image_message(text, data_url(im))}).images
        assert placeholder.length == hf_tokens(qwen, im), im.size
        assert placeholder.length <= llm.engine.processor.tokens_per_image
        image_tokens.append(placeholder.length)
    assert len(set(image_tokens)) == len(IMAGES), image_tokens  # the sizes really differ
    # Same text, so the prompts differ by exactly their images' tokens.
    for n, k in zip(prompt_tokens, image_tokens, strict=True):
        assert n - k == prompt_tokens[0] - image_tokens[0]
    # Larger images, longer prompts: the tiny one is the shortest, the oversized one the longest.
    smallest, *middle, largest = prompt_tokens
    assert smallest < min(middle) and max(middle) < largest, prompt_tokens

    # Two images of different sizes in one prompt.
    both = assert_http_equals_python_api(client, llm, "compare them", [IMAGES[0], IMAGES[2]])
    alone = assert_http_equals_python_api(client, llm, "compare them", [IMAGES[2]])
    assert both > alone
    wait_drained(server.url)


def test_video_is_refused_and_the_server_keeps_serving(client: openai.OpenAI, llm: LLM,
                                                       server: Server) -> None:
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAAIGZ0eXA="}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME, max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}},
                video, {"type": "text", "text": "what happens?"}]}])
    assert caught.value.status_code == 400
    error = caught.value.body
    assert "video is not supported" in error["message"], error
    assert error["param"] == "messages[0].content[1].type", error
    # The next request is answered, and answered right.
    assert_http_equals_python_api(client, llm, "and this?", [IMAGES[1]])
    wait_drained(server.url)


def test_a_requests_own_max_pixels_over_http(client: openai.OpenAI, llm: LLM, server: Server,
                                             qwen: str) -> None:
    """vLLM's per-request ``mm_processor_kwargs``: the chat endpoint and the Responses API
    resize the request's images within its ``max_pixels``, as the Python API and
    transformers' processor do; more than the server's is a 400 that names the field."""
    image, small = IMAGES[3], {"max_pixels": 28 * 28 * 4}
    prompt = {"messages": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "what is it?"}]}], "images": [image],
        "mm_processor_kwargs": small}
    expected = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    (placeholder,) = llm.engine.processor.process(prompt).images
    assert placeholder.length == hf_tokens(qwen, image, small["max_pixels"]) <= 4
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=image_message("what is it?", data_url(image)),
        max_tokens=MAX_TOKENS, temperature=0, extra_body={"mm_processor_kwargs": small})
    assert answer.choices[0].message.content == expected.text
    assert answer.usage.prompt_tokens == expected.num_prompt_tokens
    response = client.responses.create(
        model=MODEL_NAME, max_output_tokens=MAX_TOKENS, temperature=0,
        input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(image)},
            {"type": "input_text", "text": "what is it?"}]}],
        extra_body={"mm_processor_kwargs": small})
    assert response.usage.input_tokens == expected.num_prompt_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME, messages=image_message("what is it?", data_url(image)),
            max_tokens=2, extra_body={"mm_processor_kwargs": {"max_pixels": 10 ** 8}})
    assert caught.value.body["param"] == "mm_processor_kwargs"
    assert f"at most max_pixels={SERVE_MAX_PIXELS}" in caught.value.body["message"]
    wait_drained(server.url)


@pytest.mark.parametrize("part", [{"type": "video", "video": "clip.mp4"},
                                  {"type": "video_url", "video_url": {"url": "clip.mp4"}},
                                  {"type": "input_video", "input_video": "clip.mp4"}],
                         ids=lambda p: p["type"])
def test_python_api_refuses_video(llm: LLM, part: dict) -> None:
    prompt = {"messages": [{"role": "user", "content": [
        part, {"type": "text", "text": "what happens?"}]}]}
    with pytest.raises(InvalidInputError, match="video is not supported"):
        llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0))
    assert not llm.engine.has_unfinished_requests()
    # Still serving.
    out, _ = python_api(llm, "and this?", [IMAGES[1]])
    assert out.token_ids


# --------------------------------------------------------------------- mmserve plan
def plan_tokens_per_image(capsys: pytest.CaptureFixture, path: str, *flags: str) -> int:
    """``mmserve plan``'s printed tokens per image."""
    assert main(["plan", path, "--dtype=float32", "--device=cpu", *flags]) == 0
    out = capsys.readouterr().out
    found = re.findall(r"; (\d+) tokens per image", out)
    assert len(found) == 1, out
    return int(found[0])


def _family(path: str, kwargs: dict | None = None, max_image_size=None):
    return family_for(path, AutoConfig.from_pretrained(path), kwargs, max_image_size)


def test_plan_prints_the_engines_tokens_per_image(qwen: str, llm: LLM, capsys) -> None:
    free = plan_tokens_per_image(capsys, qwen)
    assert free == llm.engine.processor.tokens_per_image
    assert free == llm.engine.encoder_budget.max_tokens_per_item
    # The largest image: nothing transformers' processor makes is more, and one image is that.
    assert free == hf_tokens(qwen, llm.engine.processor.family.dummy_image())
    assert max(hf_tokens(qwen, im) for im in IMAGES) <= free


def test_plan_tokens_per_image_under_a_smaller_max_pixels(qwen: str, llm: LLM,
                                                          capsys) -> None:
    max_pixels = 3136
    free = llm.engine.processor.tokens_per_image
    bounded = plan_tokens_per_image(capsys, qwen, "--mm-processor-kwargs",
                                    json.dumps({"max_pixels": max_pixels}))
    assert bounded < free
    family = _family(qwen, {"max_pixels": max_pixels})
    assert bounded == family.max_tokens_per_item
    # transformers' processor under the same max_pixels: the largest image is that many tokens,
    # and images of other shapes and sizes are no more.
    assert hf_tokens(qwen, family.dummy_image(), max_pixels) == bounded
    others = [Image.new("RGB", size) for size in
              [(2000, 2000), (4000, 30), (30, 4000), (640, 480), (1, 1), (3000, 15)]]
    assert max(hf_tokens(qwen, im, max_pixels) for im in others) <= bounded


def test_plan_tokens_per_image_under_a_declared_image_size(qwen: str, llm: LLM,
                                                           capsys) -> None:
    """A declared 100 x 100 image bounds the processor to the area it resizes to: it is
    processed as before, and the budget is the most any image becomes under that area."""
    free = llm.engine.processor.tokens_per_image
    limit = {"image": {"count": 1, "width": 100, "height": 100}}
    bounded = plan_tokens_per_image(capsys, qwen, "--limit-mm-per-prompt", json.dumps(limit))
    assert bounded < free
    square = make_image(7, (100, 100))
    square_tokens = hf_tokens(qwen, square)
    engine = LLM(qwen, dtype="float32", limit_mm_per_prompt=limit)
    assert engine.engine.processor.tokens_per_image == bounded
    (placeholder,) = engine.engine.processor.process(
        {"messages": image_message("hi", data_url(square))}).images
    assert placeholder.length == square_tokens <= bounded
    # The area transformers resizes a 100 x 100 image to, as max_pixels: the worst image
    # under it is exactly the plan's number.
    grid = load_hf_processor(qwen).image_processor(
        images=[square], return_tensors="pt")["image_grid_thw"][0]
    area = int(grid[1] * grid[2]) * engine.engine.processor.family.patch_size ** 2
    assert hf_tokens(qwen, engine.engine.processor.family.dummy_image(), area) == bounded


# --------------------------------------------------------------------- start-up
HINT = re.compile(r"One image can become (\d+) tokens under max_pixels=(\d+) .*; bounded to "
                  r"(\d+) tokens the plan fits: max_pixels=(\d+) \(--mm-processor-kwargs "
                  r"'(\{.*?\})', or declare the largest image, e\.g\. --limit-mm-per-prompt "
                  r"'(\{.*?\}\})'\)")


def check_startup_error(message: str, path: str) -> tuple[dict, dict]:
    """The error's numbers are the checkpoint's; returns its two suggested settings."""
    largest = _family(path).max_tokens_per_item
    assert f"less than the {largest + 1} tokens of one image" in message, message
    assert f"holds {SMALL_KV_TOKENS} tokens per sequence" in message, message
    found = HINT.search(message)
    assert found, message
    tokens, pixels, fit_tokens, fit_pixels = map(int, found.groups()[:4])
    assert (tokens, pixels) == (largest, LARGE_MAX_PIXELS)
    assert fit_tokens + 1 <= SMALL_KV_TOKENS < tokens
    kwargs, limit = json.loads(found.group(5)), json.loads(found.group(6))
    assert kwargs == {"max_pixels": fit_pixels}
    assert _family(path, kwargs).max_tokens_per_item == fit_tokens
    return kwargs, limit


def test_startup_error_names_a_max_pixels_that_fits(qwen_large: str,
                                                    small_kv_bytes: int) -> None:
    with pytest.raises(InfeasiblePlanError) as caught:
        LLM(qwen_large, dtype="float32", kv_cache_memory=small_kv_bytes)
    kwargs, limit = check_startup_error(str(caught.value), qwen_large)
    # Either suggestion starts, and an image of the largest kind still fits a sequence.
    for settings in ({"mm_processor_kwargs": kwargs}, {"limit_mm_per_prompt": limit}):
        engine = LLM(qwen_large, dtype="float32", kv_cache_memory=small_kv_bytes, **settings)
        assert engine.engine.processor.tokens_per_image < engine.memory_plan().max_model_len
        worst = make_image(2, engine.engine.processor.family.dummy_image().size)
        out = engine.generate({"prompt": "<|vision_start|><|image_pad|><|vision_end|>hi",
                               "images": [worst]},
                              SamplingParams(max_tokens=2, temperature=0.0))[0]
        assert out.num_prompt_tokens > engine.engine.processor.tokens_per_image
        assert engine.engine.stats()["kv_blocks_free"] == engine.engine.stats()[
            "kv_blocks_total"]


def test_plan_shows_the_same_startup_error(qwen_large: str, small_kv_bytes: int,
                                           capsys) -> None:
    flags = ["--dtype=float32", "--device=cpu", f"--kv-cache-memory={small_kv_bytes}"]
    assert main(["plan", qwen_large, *flags]) == 1
    err = capsys.readouterr().err
    kwargs, _ = check_startup_error(err, qwen_large)
    with pytest.raises(InfeasiblePlanError) as caught:
        LLM(qwen_large, dtype="float32", kv_cache_memory=small_kv_bytes)
    assert err.strip() == f"mmserve plan: {caught.value}"
    # With the suggested setting, the plan fits too.
    assert plan_tokens_per_image(capsys, qwen_large, *flags[2:], "--mm-processor-kwargs",
                                 json.dumps(kwargs)) == _family(qwen_large,
                                                                kwargs).max_tokens_per_item
