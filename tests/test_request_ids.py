"""A client's ``X-Request-Id``, as vLLM takes it: the answer's id (``chatcmpl-``, ``cmpl-``,
``resp_`` before it, in streamed chunks too) and the response header carry it; clients that
send the same id at once each get their own answer (the engine's ids stay unique); an id not
of the allowed form is replaced by a fresh one."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from starlette.testclient import TestClient

from mmserve import LLM, SamplingParams
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.serve_args import ServerConfig
from tests.conftest import assert_no_leaks

PROMPTS = ["the red fox", "a blue bird sat on", "once upon a time", "tell me"]


@pytest.fixture(scope="module")
def served(clip_llama: str):
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        expected = [o.text for o in llm.generate(
            [{"prompt": p} for p in PROMPTS], SamplingParams(max_tokens=8, temperature=0.0))]
        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as http:
            yield http, expected
        assert_no_leaks(llm.engine)


def test_a_clients_id_names_the_answer(served) -> None:
    http, _ = served
    trace = {"X-Request-Id": "trace-42.a:b_C"}
    for path, body, prefix in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
             "chatcmpl-"),
            ("/v1/completions", {"prompt": "hi"}, "cmpl-"),
            ("/v1/responses", {"input": "hi"}, "resp_")):
        resp = http.post(path, headers=trace, json={"model": "tiny", "max_tokens": 2, **body}
                         if path != "/v1/responses" else {"model": "tiny",
                                                          "max_output_tokens": 2, **body})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-request-id"] == "trace-42.a:b_C"
        assert resp.json()["id"] == f"{prefix}trace-42.a:b_C"
    stream = http.post("/v1/chat/completions", headers=trace, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "stream": True})
    ids = {json.loads(line[6:])["id"] for line in stream.text.splitlines()
           if line.startswith("data: {")}
    assert ids == {"chatcmpl-trace-42.a:b_C"}
    refused = http.post("/v1/completions", headers=trace, json={"model": "tiny"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "trace-42.a:b_C"


def test_clients_sending_one_id_at_once_each_get_their_answer(served) -> None:
    http, expected = served

    def ask(i: int) -> tuple[str, str]:
        resp = http.post("/v1/completions", headers={"X-Request-Id": "same"}, json={
            "model": "tiny", "prompt": PROMPTS[i % 4], "max_tokens": 8, "temperature": 0,
            "n": 1 + i % 2})
        assert resp.status_code == 200, resp.text
        return resp.json()["id"], [c["text"] for c in resp.json()["choices"]]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(16)))
    for i, (rid, texts) in enumerate(answers):
        assert rid == "cmpl-same" and texts == [expected[i % 4]] * (1 + i % 2)


@pytest.mark.parametrize("given", ["has space", "x" * 129, "caf\u00e9", "a/b", ""])
def test_an_id_of_another_form_is_replaced(served, given: str) -> None:
    http, _ = served
    resp = http.post("/v1/completions", headers={"X-Request-Id": given.encode()}, json={
        "model": "tiny", "prompt": "hi", "max_tokens": 1})
    assert resp.status_code == 200
    fresh = resp.headers["x-request-id"]
    assert fresh != given and len(fresh) == 32 and resp.json()["id"] == f"cmpl-{fresh}"
