"""vLLM's ``/tokenize`` and ``/detokenize``: the tokens a request of the same prompt or
messages reads (images' placeholders expanded by each image's size, the tools given to the
template), and the text of token ids; bad bodies are 400s naming the field."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from mmserve import LLM, SamplingParams
from mmserve.entrypoints import api_server
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.serve_args import ServerConfig
from mmserve.testing import build_tiny_checkpoint
from tests.conftest import assert_no_leaks, make_image
from tests.test_server import data_url
from tests.test_tool_calls import TEMPLATE, TOOLS

SMALL, LARGE = make_image(1, (40, 32)), make_image(2, (300, 200))


def _messages(*images) -> list[dict]:
    return [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": data_url(im)}} for im in images),
        {"type": "text", "text": "what is this?"}]}]


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_checkpoint("qwen2_vl", tmp_path_factory.mktemp("qwen2_vl") / "ckpt"))


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def served(request: pytest.FixtureRequest):
    """A server, and the Python API's prompts (made before its loop steps the engine): a
    text prompt's, and a chat's with a small and a large image."""
    model = request.getfixturevalue("clip_llama" if request.param == "llava" else "qwen2_vl")
    with LLM(model, dtype="float32", max_model_len=1024) as llm:
        one = SamplingParams(max_tokens=1)
        text = llm.generate({"prompt": "the red fox"}, one)[0].prompt_token_ids
        chat = llm.chat(_messages(SMALL, LARGE), one)[0].prompt_token_ids
        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as http:
            yield request.param, http, {"text": text, "chat": chat,
                                        "image_token": llm.engine.processor.image_token_id,
                                        "image_text": llm.engine.processor.image_token}
        assert_no_leaks(llm.engine)


def _post(http: TestClient, path: str, **body) -> dict:
    resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_prompts_tokens_are_those_a_request_reads(served) -> None:
    _, http, reference = served
    body = _post(http, "/tokenize", model="tiny", prompt="the red fox")
    assert body == {"count": len(reference["text"]), "max_model_len": 1024,
                    "tokens": reference["text"], "token_strs": None}
    usage = _post(http, "/v1/completions", prompt="the red fox", max_tokens=1)["usage"]
    assert usage["prompt_tokens"] == body["count"]
    strs = _post(http, "/tokenize", prompt="the red fox", return_token_strs=True)["token_strs"]
    assert len(strs) == body["count"] and "".join(strs).replace("Ġ", " ").endswith("fox")


def test_a_chats_tokens_count_each_images_placeholders(served) -> None:
    family, http, reference = served
    body = _post(http, "/tokenize", messages=_messages(SMALL, LARGE))
    assert body["tokens"] == reference["chat"]
    usage = _post(http, "/v1/chat/completions", messages=_messages(SMALL, LARGE),
                  max_tokens=1)["usage"]
    assert usage["prompt_tokens"] == body["count"]
    small = _post(http, "/tokenize", messages=_messages(SMALL))["count"]
    large = _post(http, "/tokenize", messages=_messages(LARGE))["count"]
    if family == "qwen2_vl":  # dynamic resolution: more pixels, more tokens
        assert large > small
    else:  # LLaVA: every image the same
        assert large == small
    placeholders = [_post(http, "/tokenize", messages=_messages(im))["tokens"].count(
        reference["image_token"]) for im in (SMALL, LARGE)]
    assert body["tokens"].count(reference["image_token"]) == sum(placeholders) > 0


def test_detokenize_gives_the_ids_text(served) -> None:
    _, http, reference = served
    text = _post(http, "/detokenize", model="tiny", tokens=reference["text"])["prompt"]
    assert text.endswith("the red fox")
    assert _post(http, "/detokenize", tokens=[])["prompt"] == ""


@pytest.mark.parametrize("path, body, param, fragment", [
    ("/tokenize", {"prompt": ""}, "prompt", "non-empty string"),
    ("/tokenize", {"prompt": 5}, "prompt", "non-empty string"),
    ("/tokenize", {"prompt": "a", "messages": []}, "prompt", "not both"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens",
     "leave it out"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}],
                   "add_special_tokens": True}, "add_special_tokens", "leave it out"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}],
                   "continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message", "must be the assistant's"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "a"}]}, "messages[0].role",
     "use one of"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "tools": [{"x": 1}]},
     "tools[0]", "'type': 'function'"),
    ("/tokenize", {"messages": _messages(SMALL, SMALL, SMALL, SMALL, SMALL)}, "messages",
     "at most 4"),
    ("/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     None, "image"),
    ("/detokenize", {"tokens": "1 2"}, "tokens", "list of token ids"),
    ("/detokenize", {"tokens": [1, True]}, "tokens", "list of token ids"),
    ("/detokenize", {"tokens": [1, 10**40]}, "tokens", "not in the vocabulary"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "not in the vocabulary"),
    ("/detokenize", {"tokens": [1] * 1025}, "tokens", "at most 1024"),
])
def test_bad_bodies_are_400s_naming_the_field(served, path, body, param, fragment) -> None:
    _, http, _ = served
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert fragment in error["message"], error
    if param is not None:
        assert error["param"] == param


def test_the_image_placeholder_typed_as_text_is_a_400(served) -> None:
    _, http, reference = served
    resp = http.post("/tokenize", json={"prompt": f"a {reference['image_text']} b"})
    assert resp.status_code == 400 and "placeholder" in resp.json()["error"]["message"]


def test_another_model_is_a_404(served) -> None:
    _, http, _ = served
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        resp = http.post(path, json={"model": "other", **body})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_tools_reach_the_template(clip_llama: str) -> None:
    with LLM(clip_llama, dtype="float32", max_model_len=1024, chat_template=TEMPLATE) as llm:
        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as http:
            plain = _post(http, "/tokenize", messages=_messages())
            tools = _post(http, "/tokenize", messages=_messages(), tools=TOOLS)
            usage = _post(http, "/v1/chat/completions", messages=_messages(), tools=TOOLS,
                          max_tokens=1)["usage"]
    assert tools["count"] > plain["count"] and usage["prompt_tokens"] == tools["count"]
    text = llm.engine.processor.tokenizer.decode(tools["tokens"])
    assert "get_weather" in text and "get_weather" not in llm.engine.processor.tokenizer.decode(
        plain["tokens"])


def test_a_flood_of_tokenize_requests_is_bounded(served, monkeypatch) -> None:
    _, http, _ = served
    monkeypatch.setattr(api_server, "MAX_TOKENIZE_WAITING", 0)
    resp = http.post("/tokenize", json={"prompt": "a"})
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
