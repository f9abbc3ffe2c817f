"""SageMaker's two routes, as vLLM serves them: ``/ping`` (the health check) and
``/invocations``, which answers as the endpoint the body's shape names."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from mmserve import LLM
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.serve_args import ServerConfig
from tests.conftest import assert_no_leaks, make_image
from tests.test_server import data_url

MESSAGES = [{"role": "user", "content": [
    {"type": "text", "text": "what is this?"},
    {"type": "image_url", "image_url": {"url": data_url(make_image(6, (40, 36)))}}]}]


@pytest.fixture(scope="module")
def http(clip_llama: str):
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as client:
            yield client
        assert_no_leaks(llm.engine)


def _texts(body: dict) -> list:
    if body.get("object") == "response":
        return [body["output"][0]["content"][0]["text"]]
    if "results" in body:  # reranked
        return [(r["index"], round(r["relevance_score"], 5)) for r in body["results"]]
    if body.get("data"):  # scores
        return [round(d["score"], 5) for d in body["data"]]
    return [c.get("text", c.get("message", {}).get("content")) for c in body["choices"]]


def test_ping_is_the_health_check(http: TestClient) -> None:
    for method in ("GET", "POST"):
        resp = http.request(method, "/ping")
        assert resp.status_code == 200 and resp.json() == {"status": "ok"}


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5}),
    ("/v1/completions", {"prompt": ["a cat", "a dog"], "max_tokens": 4}),
    ("/v1/responses", {"input": "hello there", "max_output_tokens": 4}),
    ("/score", {"text_1": "a cat", "text_2": ["a dog", "a cat"]}),
    ("/rerank", {"query": "a cat", "documents": ["a dog", "a cat"]}),
])
def test_invocations_answer_as_the_endpoint_the_body_names(http: TestClient, path: str,
                                                           body: dict) -> None:
    body = {"temperature": 0, **body}
    direct = http.post(path, json=body)
    invoked = http.post("/invocations", json=body)
    assert direct.status_code == invoked.status_code == 200, invoked.text
    assert _texts(invoked.json()) == _texts(direct.json())
    assert invoked.json().get("object") == direct.json().get("object")


def test_invocations_stream_and_refuse_what_names_no_endpoint(http: TestClient) -> None:
    streamed = http.post("/invocations", json={"messages": MESSAGES, "max_tokens": 3,
                                               "temperature": 0, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    whole = http.post("/invocations", json={"messages": MESSAGES, "max_tokens": 3,
                                            "temperature": 0}).json()
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"]) == whole["choices"][0]["message"]["content"]
    for body in ({"question": "hi"}, [1, 2]):
        resp = http.post("/invocations", json=body)
        assert resp.status_code == 400 and "'messages'" in resp.json()["error"]["message"]
    bad = http.post("/invocations", content=b"{nope", headers={"content-type":
                                                                 "application/json"})
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    # The endpoint's own checks still apply to a body routed there.
    resp = http.post("/invocations", json={"messages": MESSAGES, "max_tokens": -1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
