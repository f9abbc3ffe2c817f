"""Request validation, response shapes and the image URL policy, without a server or a model."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from mmserve.entrypoints import openai_protocol as proto
from mmserve.entrypoints import openai_shapes as shapes
from mmserve.entrypoints.media import MediaPolicy, load_image_url
from mmserve.entrypoints.openai_protocol import (
    ApiError,
    parse_chat_request,
    parse_completion_request,
)
from mmserve.processing.images import InvalidInputError


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, "PNG")
    return buf.getvalue()


def _body(**extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "b"}]}], **extra}


def test_parse_maps_openai_fields_to_sampling_params() -> None:
    chat = parse_chat_request(_body(max_completion_tokens=7, max_tokens=99, temperature=0,
                                    top_p=0.5, top_k=-1, seed=3, stop="END", stream=True,
                                    stream_options={"include_usage": True}, ignore_eos=True),
                              max_model_len=100, max_images=4)
    p = chat.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.ignore_eos) == (
        7, 0.0, 0.5, 0, 3, ["END"], True)
    assert chat.stream and chat.include_usage and chat.model == "m"
    # image_url parts become image placeholders, in order, with their URLs beside.
    assert chat.messages[0]["content"] == [{"type": "text", "text": "a"}, {"type": "image"},
                                           {"type": "text", "text": "b"}]
    assert chat.image_urls == ["data:image/png;base64,AAAA"]


def test_logprobs_map_to_the_number_of_alternatives() -> None:
    def params(**extra):
        return parse_chat_request(_body(**extra), max_model_len=100, max_images=4).params

    assert params().logprobs is None and params(logprobs=False).logprobs is None
    assert params(logprobs=True).logprobs == 0
    assert params(logprobs=True, top_logprobs=5).logprobs == 5


def test_logprobs_content_shape() -> None:
    from mmserve.step import TokenLogprobs

    text = {7: " caf\u00e9", 8: "!", 9: ""}.__getitem__
    content = shapes.logprobs_content(
        [7, 8], [TokenLogprobs(-0.25, 1, ((7, -0.25), (9, -2.0))),
                 TokenLogprobs(float("-inf"), 9, ())], text)
    assert content == {"content": [
        {"token": " caf\u00e9", "logprob": -0.25, "bytes": [32, 99, 97, 102, 195, 169],
         "top_logprobs": [{"token": " caf\u00e9", "logprob": -0.25,
                           "bytes": [32, 99, 97, 102, 195, 169]},
                          {"token": "", "logprob": -2.0, "bytes": []}]},
        # JSON has no -inf: a token the model rules out gets OpenAI's floor.
        {"token": "!", "logprob": -9999.0, "bytes": [33], "top_logprobs": []}]}


def test_completion_prompts_in_every_form() -> None:
    def parse(**body):
        return proto.parse_completion_request(body, max_model_len=100)

    assert parse(prompt="hi").prompts == [{"prompt": "hi"}]
    assert parse(prompt=[1, 2]).prompts == [{"prompt_token_ids": [1, 2]}]
    assert parse(prompt=["a", [3], "b"]).prompts == [
        {"prompt": "a"}, {"prompt_token_ids": [3]}, {"prompt": "b"}]
    request = parse(prompt="hi", logprobs=3, stream=True, stream_options={"include_usage": True})
    assert request.params.max_tokens == 16  # OpenAI's default for this endpoint
    assert request.params.logprobs == 3 and request.stream and request.include_usage
    with pytest.raises(ApiError, match="max_tokens must be between 1 and"):
        parse(prompt="hi", max_tokens=500)
    with pytest.raises(ApiError, match="'prompt' must be a string, a list of token ids"):
        parse(prompt={"text": "hi"})


def test_defaults() -> None:
    chat = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]},
                              max_model_len=100, max_images=4)
    assert chat.params.max_tokens == 100  # up to the context limit, as OpenAI does
    assert chat.params.temperature == 1.0 and not chat.stream and chat.model is None
    assert chat.messages == [{"role": "user", "content": "hi"}]


def test_every_form_of_output_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    forms = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "schema": schema, "strict": True}}}, ("json", json.dumps(schema))),
        ({"response_format": {"type": "json_object"}}, ("json_object", "")),
        ({"guided_json": json.dumps(schema)}, ("json", json.dumps(schema))),
        ({"guided_regex": "[a-z]+"}, ("regex", "[a-z]+")),
        ({"guided_choice": ["yes", "no"]}, ("choice", '["yes", "no"]')),
        ({"guided_grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"')),
        ({"structured_outputs": {"choice": ["x"]}}, ("choice", '["x"]')),
    ]
    for change, key in forms:
        params = parse_chat_request(_body(**change), max_model_len=100, max_images=4).params
        assert params.structured_outputs.key == key, change
        completion = parse_completion_request({"prompt": "hi", **change}, max_model_len=100)
        assert completion.params.structured_outputs.key == key, change
    for plain in ({}, {"response_format": {"type": "text"}}):
        params = parse_chat_request(_body(**plain), max_model_len=100, max_images=4).params
        assert params.structured_outputs is None


@pytest.mark.parametrize("change, param, fragment", [
    ({"n": 129}, "n", "n must be an integer from 1 to 128"),
    ({"n": 0}, "n", "n must be an integer from 1 to 128"),
    ({"n": True}, "n", "must be an integer"),
    ({"max_tokens": 2.5}, "max_tokens", "must be an integer"),
    ({"temperature": 3}, "temperature", "between 0 and 2"),
    ({"top_k": -2}, "top_k", "top_k must be"),
    ({"seed": "1"}, "seed", "must be an integer"),
    ({"stop": ["a", 2]}, "stop", "stop must be"),
    ({"logprobs": 1}, "logprobs", "must be a boolean"),
    ({"top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ({"presence_penalty": 2.5}, "presence_penalty", "from -2 to 2"),
    ({"frequency_penalty": "1"}, "frequency_penalty", "must be a number"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "keys must be token ids, got 'abc'"),
    ({"logit_bias": {"-3": 1}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {"5": "x"}}, "logit_bias", "numbers from -100 to 100, got 'x'"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "numbers from -100 to 100"),
    ({"logit_bias": {"5": True}}, "logit_bias", "numbers from -100 to 100"),
    ({"logit_bias": [1, 2]}, "logit_bias", "must be an object"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024 tokens"),
    # A field that changes the answer and that mmserve does not implement: never ignored.
    ({"tool_choice": "auto"}, "tool_choice", "needs 'tools'"),
    ({"modalities": ["text", "audio"]}, "modalities", "text only"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "not supported"),
    ({"web_search_options": {}}, "web_search_options", "not supported"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats", "must be a boolean"),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens", "from 0 to max_tokens (16)"),
    ({"min_tokens": 1.5}, "min_tokens", "must be an integer"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty list"),
    ({"allowed_token_ids": [1, "2"]}, "allowed_token_ids", "integers >= 0"),
    ({"min_p": 1.1}, "min_p", "from 0 to 1"),
    ({"repetition_penalty": 0}, "repetition_penalty", "from 0.01 to 100 (1 is off)"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be {'type': 'text'}"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs 'json_schema'"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "send one output constraint, not 2 (response_format, guided_regex)"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of"),
    ({"structured_outputs": {"jsonschema": {}}}, "structured_outputs", "unknown fields"),
    ({"structured_outputs": "a+"}, "structured_outputs", "must be an object"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage", "must be a boolean"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "'function'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0].text", "must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url", "non-empty string"),
])
def test_invalid_fields_name_the_parameter(change: dict, param: str, fragment: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_chat_request(_body(**change), max_model_len=100, max_images=4)
    assert e.value.status == 400
    assert e.value.param == param
    assert fragment in e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("neutral", [
    {"logit_bias": {}}, {"logit_bias": None}, {"tool_choice": "none"}, {"min_tokens": 0},
    {"min_p": 0}, {"repetition_penalty": 1}, {"presence_penalty": 0}])
def test_neutral_values_leave_the_logits_alone(neutral: dict) -> None:
    for parsed in (parse_chat_request(_body(**neutral), max_model_len=100, max_images=4),
                   parse_completion_request({"prompt": "hi", **neutral}, max_model_len=100)):
        assert not parsed.params.adjusts_logits
        assert parsed.params.min_p == 0


def test_vllms_text_fields_reach_the_sampling_params() -> None:
    fields = {"skip_special_tokens": False, "include_stop_str_in_output": True}
    for parsed in (parse_chat_request(_body(**fields), max_model_len=100, max_images=4),
                   parse_completion_request({"prompt": "hi", **fields}, max_model_len=100)):
        assert not parsed.params.skip_special_tokens
        assert parsed.params.include_stop_str_in_output
    with pytest.raises(ApiError, match="'skip_special_tokens' must be a boolean"):
        parse_completion_request({"prompt": "hi", "skip_special_tokens": "no"},
                                 max_model_len=100)


def test_logit_adjustments_reach_the_sampling_params() -> None:
    fields = {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
              "min_p": 0.05, "min_tokens": 3, "logit_bias": {"7": -100, "12": 2.5, "9": 0},
              "max_tokens": 8}
    for parsed in (parse_chat_request(_body(**fields), max_model_len=100, max_images=4),
                   parse_completion_request({"prompt": "hi", **fields}, max_model_len=100)):
        p = parsed.params
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p,
                p.min_tokens) == (0.5, -1.0, 1.2, 0.05, 3)
        assert p.logit_bias == {7: -100.0, 12: 2.5}  # ids as integers, zeros dropped
        assert p.adjusts_logits and p.uses_history


def test_too_many_images_rejected_before_fetching() -> None:
    with pytest.raises(ApiError, match="carry 1 images but at most 0"):
        parse_chat_request(_body(), max_model_len=100, max_images=0)


def test_response_and_chunk_shapes() -> None:
    body = shapes.completion("id1", "m", [shapes.chat_choice(0, "hello", "length"),
                                          shapes.chat_choice(1, "hi", "stop")],
                             shapes.usage(30, 4, cached_tokens=16))
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "hello"}, "logprobs": None,
         "finish_reason": "length"},
        {"index": 1, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
         "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 30, "completion_tokens": 4, "total_tokens": 34,
                             "prompt_tokens_details": {"cached_tokens": 16}}
    chunk = shapes.chunk("id1", "m", 5, {"content": "he"}, include_usage=True)
    assert chunk["usage"] is None and chunk["choices"][0]["delta"] == {"content": "he"}
    assert "usage" not in shapes.chunk("id1", "m", 5, {"content": "he"})
    assert shapes.chunk("id1", "m", 5, {"content": "x"}, index=2)["choices"][0]["index"] == 2
    last = shapes.chunk("id1", "m", 5, None, include_usage=True,
                        usage_counts=shapes.usage(3, 2))
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 5


# --------------------------------------------------------------------- media policy
def test_data_url_and_format_sniffing() -> None:
    png = _png()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert load_image_url(url, MediaPolicy()) == png
    with pytest.raises(InvalidInputError, match="over the limit of 10 bytes"):
        load_image_url(url, MediaPolicy(max_bytes=10))
    bmp = io.BytesIO()
    Image.new("RGB", (4, 4)).save(bmp, "BMP")
    with pytest.raises(InvalidInputError, match="not a PNG, JPEG, WebP or GIF"):
        load_image_url("data:image/bmp;base64," + base64.b64encode(bmp.getvalue()).decode(),
                       MediaPolicy())


def test_remote_hosts_must_be_listed() -> None:
    # Refused before any connection is made.
    for url in ("http://sub.example.com/a.png", "https://EXAMPLE.com.evil.net/a.png",
                "http://example.com@evil.net/a.png", "http://127.0.0.1:9/a.png"):
        with pytest.raises(InvalidInputError, match="is not allowed"):
            load_image_url(url, MediaPolicy(allowed_domains=("example.com",)))


def test_local_files(tmp_path: Path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(_png())
    (tmp_path / "outside.png").write_bytes(_png())
    with pytest.raises(InvalidInputError, match="local image files are disabled"):
        load_image_url(f"file://{root}/a.png", MediaPolicy())
    policy = MediaPolicy(allowed_local_path=str(root))
    assert load_image_url(f"file://{root}/a.png", policy) == _png()
    for url in (f"file://{root}/../outside.png", f"file://{root}/%2E%2E/outside.png",
                f"file://{tmp_path}/outside.png"):
        with pytest.raises(InvalidInputError, match="outside the allowed"):
            load_image_url(url, policy)
    with pytest.raises(InvalidInputError, match="must not name a host"):
        load_image_url(f"file://otherhost{root}/a.png", policy)
    with pytest.raises(ValueError, match="is not a directory"):
        MediaPolicy(allowed_local_path=str(root / "a.png"))


# --------------------------------------------------------------------- mmserve serve
def test_serve_without_a_model_explains_and_exits_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from mmserve.demo import checkpoint
    from mmserve.entrypoints.cli import main

    monkeypatch.setattr(checkpoint, "DEMO_MODEL_DIR", tmp_path / "no-demo-here")
    assert main(["serve", "--port", "1"]) == 2
    assert "demo model is not at" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "missing"), "--port", "1"]) == 2
    assert "model directory not found" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--allowed-local-media-path",
                 str(tmp_path / "nope"), "--port", "1"]) == 2
    assert "is not a directory" in capsys.readouterr().err
