"""``echo`` on ``/v1/completions``, as lm-eval-harness scores text with it: the prompt's text,
tokens and log-probabilities (the first token's null) before the generated ones, equal to the
Python API's ``prompt_logprobs``; ``max_tokens`` 0 scores the prompt alone; streamed, the
prompt's text comes first. And vLLM's ``include_stop_str_in_output`` through the server."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from mmserve import LLM, SamplingParams
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.serve_args import ServerConfig
from tests.conftest import assert_no_leaks

PROMPT = "the red fox and the blue bird"


@pytest.fixture(scope="module")
def served(clip_llama: str):
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        # The Python API's answer, made before the server's loop steps the engine (one
        # thread steps an engine).
        (reference,) = llm.generate({"prompt": PROMPT}, SamplingParams(
            max_tokens=2, temperature=0.0, logprobs=2, prompt_logprobs=2))
        server = OpenAIServer(llm.engine, ServerConfig("tiny"))
        with TestClient(server.app()) as http:
            yield llm, http, reference
        assert_no_leaks(llm.engine)  # once the server's loop has stopped


def _post(http: TestClient, **body) -> dict:
    resp = http.post("/v1/completions", json={"model": "tiny", "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_echo_puts_the_prompt_first(served) -> None:
    llm, http, _ = served
    plain = _post(http, prompt=PROMPT, max_tokens=5)["choices"][0]
    echoed = _post(http, prompt=PROMPT, max_tokens=5, echo=True)["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"] and plain["text"]
    ids = llm.engine.processor.tokenizer.encode("a cat", add_special_tokens=False)
    by_ids = _post(http, prompt=ids, max_tokens=3, echo=True)["choices"][0]
    assert by_ids["text"].startswith(llm.engine.processor.tokenizer.decode(ids))


def test_echo_with_logprobs_scores_the_prompt(served) -> None:
    llm, http, reference = served
    body = _post(http, prompt=PROMPT, max_tokens=2, echo=True, logprobs=2)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    token_text = llm.engine.processor.tokenizer.decode
    prompt_ids = reference.prompt_token_ids
    assert lp["tokens"] == [token_text([t]) for t in prompt_ids + reference.token_ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = [e.logprob for e in reference.prompt_logprobs[1:]] + [
        e.logprob for e in reference.logprobs]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-6)
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
    assert choice["text"] == PROMPT + reference.text
    assert body["usage"]["completion_tokens"] == 2
    # max_tokens 0: the prompt alone, scored (what lm-eval-harness's loglikelihood reads).
    only = _post(http, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = only["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(prompt_ids)
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(expected[:-2], abs=1e-6)
    assert only["usage"]["completion_tokens"] == 0
    assert only["usage"]["prompt_tokens"] == len(prompt_ids)


def test_a_streamed_echo_sends_the_prompt_first(served) -> None:
    _, http, _ = served
    whole = _post(http, prompt=[PROMPT, "a cat"], max_tokens=4, echo=True)["choices"]
    resp = http.post("/v1/completions", json={
        "model": "tiny", "prompt": [PROMPT, "a cat"], "max_tokens": 4, "temperature": 0,
        "echo": True, "stream": True})
    events = [json.loads(line[5:]) for line in resp.text.splitlines()
              if line.startswith("data:") and line != "data: [DONE]"]
    texts = ["", ""]
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in whole]
    assert [e["choices"][0]["text"] for e in events[:2]] == [PROMPT, "a cat"]
    only = http.post("/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 0, "echo": True, "stream": True})
    chunks = [json.loads(line[5:])["choices"][0] for line in only.text.splitlines()
              if line.startswith("data:") and line != "data: [DONE]"]
    assert "".join(c["text"] for c in chunks) == PROMPT
    assert chunks[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("body, fragment", [
    ({"echo": True, "stream": True, "logprobs": 1}, "send 'stream': false"),
    ({"max_tokens": 0}, "max_tokens must be between 1"),
    ({"echo": "yes"}, "must be a boolean"),
])
def test_what_echo_refuses(served, body: dict, fragment: str) -> None:
    _, http, _ = served
    resp = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, **body})
    assert resp.status_code == 400 and fragment in resp.json()["error"]["message"], resp.text


def test_the_stop_string_kept_when_asked(served) -> None:
    _, http, _ = served
    plain = _post(http, prompt=PROMPT, max_tokens=12)["choices"][0]["text"]
    stop = plain.strip()[1:3]
    cut = _post(http, prompt=PROMPT, max_tokens=12, stop=[stop])["choices"][0]
    kept = _post(http, prompt=PROMPT, max_tokens=12, stop=[stop],
                 include_stop_str_in_output=True)["choices"][0]
    assert cut["finish_reason"] == kept["finish_reason"] == "stop"
    assert kept["text"] == cut["text"] + stop and plain.startswith(kept["text"])
