"""The sampling fields added for OpenAI and vLLM clients (and vLLM's ``cache_salt`` beside
them), sent with hostile values in random combinations: every answer is a 200 or a 400
naming a field, never a 500; the engine keeps serving; nothing is left behind."""

from __future__ import annotations

import random

import pytest
from starlette.testclient import TestClient

from mmserve import LLM
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.serve_args import ServerConfig
from tests.conftest import assert_no_leaks

VALUES = {
    "presence_penalty": [0, 2, -2, 2.0001, 1e308, "NaN", "1", None, True],
    "frequency_penalty": [0.5, -2, 3, [], None],
    "repetition_penalty": [1, 0.01, 100, 0, -1, 1e-300, 101, None, "x"],
    "min_p": [0, 1, 0.5, 1.5, -0.1, None],
    "min_tokens": [0, 1, 8, 16, 17, -1, 2.5, 10**30, None],
    "logit_bias": [{}, {"5": 100}, {"5": -100, "6": 100}, {"511": 1}, {"512": 1},
                   {"99999999999": 1}, {"5": 101}, {"-1": 1}, {"a": 1}, {"5": None},
                   {str(i): 1 for i in range(1025)}, {str(i): -100 for i in range(500)},
                   [1], "x", None],
    "stop_token_ids": [[2], [5, 6], [10**9], None],
    "allowed_token_ids": [None, [5], [2, 5, 6], [], [511], [512], [-1], "5", [5.0],
                          list(range(1025)), [True]],
    "bad_words": [None, [], ["a"], ["the", " cat sat"], [""], ["  "], "a", [5], ["x" * 5000],
                  ["a"] * 129, ["\u00e9t\u00e9"]],
    "echo": [True, False, None, 1],
    "prompt_logprobs": [None, 0, 3, 20, 21, -1, True, "2"],
    "return_tokens_as_token_ids": [True, False, None, 1],
    "truncate_prompt_tokens": [None, 1, 2, 128, 129, -1, 0, -2, "3", 2.5],
    "cache_salt": [None, "tenant-a", "tenant-b", "", 5, "x" * 1025],
    "max_tokens": [0, 1, 16, None, -1],
    "logprobs": [None, 0, 5, 20, 21],
    "include_stop_str_in_output": [True, False, "no"],
    "skip_special_tokens": [True, False, 0],
    "stop": [None, "e", ["a", "b"]],
    "temperature": [0, 1, 2, None],
    "n": [1, 2],
    "stream": [False, True],
}


@pytest.fixture(scope="module")
def http(clip_llama: str):
    with LLM(clip_llama, dtype="float32", max_model_len=128, max_num_seqs=8) as llm:
        server = OpenAIServer(llm.engine, ServerConfig("tiny"))
        with TestClient(server.app()) as client:
            yield llm, client
        assert_no_leaks(llm.engine)  # once the server's loop has stopped


def test_random_combinations_answer_200_or_400(http) -> None:
    _, client = http
    rng = random.Random(20261207)
    statuses: dict[int, int] = {}
    for i in range(120):
        body = {"model": "tiny", "prompt": rng.choice(["the cat", [5, 6, 7], ["a", "b"]])}
        for name in rng.sample(sorted(VALUES), 4):
            value = rng.choice(VALUES[name])
            if value is not None:
                body[name] = value
        endpoint = "/v1/completions"
        if i % 3 == 0:  # the chat endpoint takes the same sampling fields (no echo)
            endpoint = "/v1/chat/completions"
            body.pop("echo", None)
            body["messages"] = [{"role": "user", "content": "hello"}]
            del body["prompt"]
            if body.get("logprobs") is not None:
                body["logprobs"] = True
        resp = client.post(endpoint, json=body)
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        assert resp.status_code in (200, 400), (body, resp.text)
        if resp.status_code == 400:
            error = resp.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", body
    assert statuses.get(200, 0) > 20 and statuses.get(400, 0) > 20, statuses
    ok = client.post("/v1/completions", json={"model": "tiny", "prompt": "the cat",
                                              "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


# A beam search's fields, and the sampling fields it refuses or takes, hostile or not.
BEAM_VALUES = {
    "n": [1, 2, 3, 10, 11, 0, "2"],
    "max_tokens": [1, 4, 8, 0, None],
    "length_penalty": [1.0, 0, -2.5, -11, 1e308, "x", None],
    "early_stopping": [True, False, "never", "x", 0, None],
    "ignore_eos": [True, False, None],
    "temperature": [0, 0.0, 0.7, None],
    "logprobs": [None, 0, 2],
    "stop": [None, [], ["a"]],
    "priority": [None, 0, 1],
    "allowed_token_ids": [None, [5, 6]],
    "bad_words": [None, [], ["a"]],
    "prompt_logprobs": [None, 1],
    "truncate_prompt_tokens": [None, 2],
    "cache_salt": [None, "tenant-a", ""],
}


def test_random_beam_searches_answer_200_or_400(http) -> None:
    """``use_beam_search`` with random fields on both endpoints: a 200 whose choices are
    the sequences, or a 400 naming a field; the engine keeps serving, nothing is left."""
    _, client = http
    rng = random.Random(20261207)
    statuses: dict[int, int] = {}
    for i in range(60):
        body = {"model": "tiny", "use_beam_search": True, "prompt": "the cat"}
        for name in rng.sample(sorted(BEAM_VALUES), 3):
            value = rng.choice(BEAM_VALUES[name])
            if value is not None:
                body[name] = value
        endpoint = "/v1/completions"
        if i % 2:
            endpoint = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": "hello"}]
            del body["prompt"]
            if body.get("logprobs") is not None:
                body["logprobs"] = bool(body["logprobs"])
        resp = client.post(endpoint, json=body)
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        assert resp.status_code in (200, 400), (body, resp.text)
        if resp.status_code == 200:
            assert len(resp.json()["choices"]) == body.get("n", 1), body
        else:
            assert resp.json()["error"]["param"], body
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 10, statuses
