"""How a chat prompt ends, as vLLM's ``add_generation_prompt`` and ``continue_final_message``
say: by default with the start of a new assistant turn, whoever spoke last; with
``continue_final_message`` inside the last message, an assistant's, which the model goes on
writing (a prefilled answer)."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient
from transformers import AutoConfig

from mmserve import LLM, SamplingParams
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.serve_args import ServerConfig
from mmserve.errors import InvalidInputError
from mmserve.processing.processor import InputProcessor
from mmserve.testing import build_tiny_checkpoint
from tests.conftest import assert_no_leaks

PREFILLED = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": "The answer is"}]
# What each family's template makes of PREFILLED: a new turn, and the last one left open.
ENDINGS = {
    "llava": ("USER: hi\nASSISTANT: The answer is</s>\nASSISTANT:", "ASSISTANT: The answer is"),
    "qwen2_vl": ("<|im_start|>assistant\nThe answer is<|im_end|>\n<|im_start|>assistant\n",
                 "<|im_start|>assistant\nThe answer is"),
}


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_checkpoint("qwen2_vl", tmp_path_factory.mktemp("qwen2_vl") / "ckpt"))


@pytest.mark.parametrize("family", sorted(ENDINGS))
def test_the_prompt_ends_as_asked(family: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue("clip_llama" if family == "llava" else "qwen2_vl")
    processor = InputProcessor(model, AutoConfig.from_pretrained(model, local_files_only=True),
                               1_000_000)
    new_turn, continued = ENDINGS[family]
    assert processor.render_chat(PREFILLED, [])[0].endswith(new_turn)
    text = processor.render_chat(PREFILLED, [], add_generation_prompt=False,
                                 continue_final_message=True)[0]
    assert text.endswith(continued)
    closed = processor.render_chat(PREFILLED, [], add_generation_prompt=False)[0]
    assert closed == processor.render_chat(PREFILLED, [])[0][:len(closed)]
    assert not closed.endswith(continued)
    for kwargs, fragment in (({"continue_final_message": True}, "send 'add_generation_prompt'"),
                             ({"add_generation_prompt": "yes"}, "must be a boolean")):
        with pytest.raises(InvalidInputError, match=fragment):
            processor.render_chat(PREFILLED, [], **kwargs)
    with pytest.raises(InvalidInputError, match="must be the assistant's"):
        processor.render_chat(PREFILLED[:1], [], add_generation_prompt=False,
                              continue_final_message=True)


@pytest.fixture(scope="module")
def served(clip_llama: str):
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        reference = llm.chat(PREFILLED, greedy, add_generation_prompt=False,
                             continue_final_message=True)[0]
        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as http:
            yield http, reference
        assert_no_leaks(llm.engine)  # once the server's loop has stopped


def test_a_prefilled_answer_goes_on_over_http(served) -> None:
    """The server continues the message as the Python API does, and as a completions
    request of the continued text would; /tokenize counts the same prompt."""
    http, reference = served
    body = {"model": "tiny", "messages": PREFILLED, "temperature": 0, "max_tokens": 6,
            "add_generation_prompt": False, "continue_final_message": True}
    chat = http.post("/v1/chat/completions", json=body).json()
    assert chat["choices"][0]["message"]["content"] == reference.outputs[0].text
    assert chat["usage"]["prompt_tokens"] == len(reference.prompt_token_ids)
    tokens = http.post("/tokenize", json={
        "messages": PREFILLED, "add_generation_prompt": False,
        "continue_final_message": True}).json()["tokens"]
    assert tokens == reference.prompt_token_ids
    completion = http.post("/v1/completions", json={
        "model": "tiny", "prompt": tokens, "temperature": 0, "max_tokens": 6}).json()
    assert completion["choices"][0]["text"] == reference.outputs[0].text
    # By default a new turn starts, so the prompt differs.
    default = http.post("/v1/chat/completions", json={**body, "add_generation_prompt": True,
                                                      "continue_final_message": False}).json()
    assert default["usage"]["prompt_tokens"] != chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize("fields, param", [
    ({"continue_final_message": True}, "continue_final_message"),
    ({"add_generation_prompt": "no"}, "add_generation_prompt"),
])
def test_fields_that_disagree_are_400s(served, fields: dict, param: str) -> None:
    http, _ = served
    resp = http.post("/v1/chat/completions", json={"model": "tiny", "messages": PREFILLED,
                                                   "max_tokens": 2, **fields})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_chat_template_kwargs_reach_the_template(clip_llama: str) -> None:
    from mmserve.entrypoints.openai_protocol import parse_chat_request

    template = ("{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")  # (string content)
    processor = InputProcessor(clip_llama, AutoConfig.from_pretrained(
        clip_llama, local_files_only=True), 1_000_000, chat_template=template)
    messages = [{"role": "user", "content": "hi"}]
    assert processor.render_chat(messages, [])[0] == "hi"
    body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
    turn = parse_chat_request(body, 256, 4).turn
    assert turn == {"chat_template_kwargs": {"enable_thinking": False}}
    assert processor.process({"messages": messages, **turn}).token_ids == \
        processor.tokenizer(["/no_think hi"])["input_ids"][0]
    for bad in ({"messages": []}, {"add_generation_prompt": False}, {"1x": 1}, [1],
                {"deep": json.loads("[" * 70 + "]" * 70)}):
        with pytest.raises(InvalidInputError, match="chat_template_kwargs"):
            processor.render_chat(messages, [], chat_template_kwargs=bad)


def test_reserved_template_kwargs_are_a_400(served) -> None:
    http, _ = served
    resp = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": PREFILLED, "max_tokens": 2,
        "chat_template_kwargs": {"tools": []}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template_kwargs"
    ok = http.post("/tokenize", json={"messages": PREFILLED,
                                      "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200, ok.text
