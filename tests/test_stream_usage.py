"""vLLM's ``stream_options.continuous_usage_stats``: with ``include_usage`` every chunk of a
choice carries that choice's usage so far, growing to the whole answer's; without it only the
last chunk has usage, as OpenAI's."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from mmserve import LLM
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.serve_args import ServerConfig
from tests.conftest import assert_no_leaks


@pytest.fixture(scope="module")
def http(clip_llama: str):
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as client:
            yield client
        assert_no_leaks(llm.engine)  # once the server's loop has stopped


def _events(http: TestClient, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={"model": "tiny", "temperature": 0, "max_tokens": 6,
                                         "stream": True, **body}) as resp:
        assert resp.status_code == 200
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "n": 2}),
    ("/v1/completions", {"prompt": ["the cat", "a dog sat"]}),
])
def test_every_chunk_carries_its_choices_usage_so_far(http: TestClient, path: str,
                                                      body: dict) -> None:
    whole = http.post(path, json={"model": "tiny", "temperature": 0, "max_tokens": 6,
                                  **body}).json()["usage"]
    events = _events(http, path, {**body, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == whole
    seen: dict[int, list[int]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        seen.setdefault(choice["index"], []).append(usage["completion_tokens"])
    assert sorted(seen) == [0, 1]
    for counts in seen.values():
        assert counts == sorted(counts) and counts[-1] == 6
        if path == "/v1/chat/completions":  # the role's chunk, before any token
            assert counts[0] == 0
    # Without it, usage is null until the last chunk; without include_usage, never there.
    plain = _events(http, path, {**body, "stream_options": {"include_usage": True}})
    assert all(e["usage"] is None for e in plain[:-1]) and plain[-1]["usage"] == whole
    alone = _events(http, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in e for e in alone)


def test_version(http: TestClient) -> None:
    import mmserve

    assert http.get("/version").json() == {"version": mmserve.__version__}
