"""vLLM's two log-probability fields on both endpoints: ``prompt_logprobs`` (each prompt
token's log-probability, rank and most likely alternatives, as vLLM shapes them, equal to the
Python API's, images' placeholders included) and ``return_tokens_as_token_ids`` (tokens named
"token_id:N", per request or by the server's ``--return-tokens-as-token-ids``), whole and
streamed; and ``return_token_ids`` (the prompt's and the answer's token ids)."""

from __future__ import annotations

import asyncio
import functools
import json

import pytest
from starlette.testclient import TestClient

from mmserve import LLM, SamplingParams
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.http_middleware import LargeParts
from mmserve.entrypoints.serve_args import ServerConfig
from tests.conftest import assert_no_leaks, make_image
from tests.test_server import data_url

PROMPT = "the red fox and the blue bird"
MESSAGES = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": data_url(make_image(2, (40, 30)))}},
    {"type": "text", "text": "what is this?"}]}]


@pytest.fixture(scope="module")
def served(clip_llama: str):
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        # The Python API's answers, made before the server's loop steps the engine.
        image = make_image(2, (40, 30))
        chat = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "what is this?"}]}]
        params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, prompt_logprobs=3)
        references = {"chat": llm.generate({"messages": chat, "images": [image]}, params)[0],
                      "text": llm.generate({"prompt": PROMPT}, params)[0]}
        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as http:
            yield llm, http, references
        assert_no_leaks(llm.engine)  # once the server's loop has stopped


def _post(http: TestClient, path: str, **body) -> dict:
    resp = http.post(path, json={"model": "tiny", "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _expected(llm: LLM, reference) -> list:
    text = llm.engine.processor.tokenizer.decode
    out: list = [None]
    for token, e in zip(reference.prompt_token_ids[1:], reference.prompt_logprobs[1:],
                        strict=True):
        found = {str(token): (e.rank, e.logprob, text([token]))}
        for rank, (t, v) in enumerate(e.top, 1):
            found.setdefault(str(t), (rank, v, text([t])))
        out.append(found)
    return out


def _shown(entries: list) -> list:
    return [None if e is None else {t: (v["rank"], pytest.approx(v["logprob"], abs=1e-5),
                                        v["decoded_token"]) for t, v in e.items()}
            for e in entries]


def test_prompt_logprobs_on_both_endpoints_equal_the_python_apis(served) -> None:
    llm, http, references = served
    chat = _post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=4,
                 prompt_logprobs=3, n=2)
    expected = _expected(llm, references["chat"])
    assert _shown(chat["prompt_logprobs"]) == expected
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    image_token = str(llm.engine.processor.image_token_id)
    assert any(image_token in e for e in chat["prompt_logprobs"][1:])  # placeholders too
    assert chat["choices"][0]["message"]["content"] == references["chat"].text
    assert all(3 <= len(e) <= 4 for e in chat["prompt_logprobs"][1:])
    completion = _post(http, "/v1/completions", prompt=PROMPT, max_tokens=4,
                       prompt_logprobs=3)
    choice = completion["choices"][0]
    assert _shown(choice["prompt_logprobs"]) == _expected(llm, references["text"])
    assert choice["text"] == references["text"].text and choice["logprobs"] is None
    # Without the field, none; with echo, the echo shows logprobs' alternatives for every
    # token and prompt_logprobs its own, whichever is more.
    assert "prompt_logprobs" not in _post(http, "/v1/chat/completions", messages=MESSAGES,
                                          max_tokens=2)
    num_prompt = len(references["text"].prompt_token_ids)
    for logprobs, prompt_logprobs in ((2, 1), (1, 3)):
        echoed = _post(http, "/v1/completions", prompt=PROMPT, max_tokens=2, echo=True,
                       logprobs=logprobs, prompt_logprobs=prompt_logprobs)["choices"][0]
        tops = echoed["logprobs"]["top_logprobs"]
        assert tops[0] is None and len(tops) == num_prompt + 2
        assert all(len(top) == logprobs for top in tops[1:]), (logprobs, prompt_logprobs)
        assert [len(e) for e in echoed["prompt_logprobs"][1:]] == [
            prompt_logprobs + (e.rank > prompt_logprobs)
            for e in references["text"].prompt_logprobs[1:]]
        # The shown ones are the most likely, in the engine's order.
        assert [list(top.values()) for top in tops[1:num_prompt]] == [
            pytest.approx([max(v, -9999.0) for _, v in e.top[:logprobs]], abs=1e-5)
            for e in references["text"].prompt_logprobs[1:]]
    assert_no_leaks(llm.engine)


def test_prompt_logprobs_refusals(served) -> None:
    _, http, _ = served
    for path, body, message in (
            ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 21},
             "between 0 and 20"),
            ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1}, "between 0 and 20"),
            ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True},
             "whole answer"),
            ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 2,
                                      "stream": True}, "whole answer"),
            ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": True},
             "must be an integer"),
            ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 1, "n": 2,
                                      "use_beam_search": True}, "use_beam_search"),
            ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True,
                                      "return_tokens_as_token_ids": "yes"},
             "must be a boolean")):
        resp = http.post(path, json={"model": "tiny", "max_tokens": 2, **body})
        assert resp.status_code == 400, (body, resp.text)
        error = resp.json()["error"]
        assert message in error["message"]
        assert error["param"] in ("prompt_logprobs", "return_tokens_as_token_ids")


def _sse(http: TestClient, path: str, **body) -> list[dict]:
    resp = http.post(path, json={"model": "tiny", "temperature": 0, "stream": True, **body})
    assert resp.status_code == 200, resp.text
    return [json.loads(line[6:]) for line in resp.text.splitlines()
            if line.startswith("data: {")]


def test_a_stream_takes_zero_prompt_logprobs_and_shows_none(served) -> None:
    """As vLLM: ``prompt_logprobs: 0`` in a stream is no error (more is, above); the stream
    has no field for them, and its text is the one without the field."""
    _, http, references = served
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        chunks = _sse(http, path, max_tokens=4, prompt_logprobs=0, **body)
        assert not any("prompt_logprobs" in c or any("prompt_logprobs" in choice
                                                     for choice in c["choices"])
                       for c in chunks)
        text = "".join(choice.get("text") or choice.get("delta", {}).get("content") or ""
                       for c in chunks for choice in c["choices"])
        assert text == references["text" if "prompt" in body else "chat"].text


def test_tokens_as_token_ids_whole_and_streamed(served) -> None:
    """Every token and alternative named by its id, the text, bytes and offsets as without;
    a request's field overrides the server's default either way."""
    llm, http, references = served
    ref = references["text"]
    text = llm.engine.processor.tokenizer.decode

    def chat_tokens(content: list[dict]) -> list:
        return [(c["token"], c["bytes"], [t["token"] for t in c["top_logprobs"]])
                for c in content]

    plain = _post(http, "/v1/completions", prompt=PROMPT, max_tokens=4, logprobs=2)
    as_ids = _post(http, "/v1/completions", prompt=PROMPT, max_tokens=4, logprobs=2,
                   return_tokens_as_token_ids=True)
    lp, lp_ids = plain["choices"][0]["logprobs"], as_ids["choices"][0]["logprobs"]
    assert lp_ids["tokens"] == [f"token_id:{t}" for t in ref.token_ids]
    assert lp_ids["text_offset"] == lp["text_offset"]
    assert lp_ids["token_logprobs"] == lp["token_logprobs"]
    assert [list(top) for top in lp_ids["top_logprobs"]] == [
        [f"token_id:{t}" for t, _ in e.top] for e in ref.logprobs]
    assert as_ids["choices"][0]["text"] == plain["choices"][0]["text"]
    streamed = _sse(http, "/v1/completions", prompt=PROMPT, max_tokens=4, logprobs=2,
                    return_tokens_as_token_ids=True)
    pieces = [c["choices"][0]["logprobs"] for c in streamed if c["choices"]
              and c["choices"][0]["logprobs"]]
    assert sum((p["tokens"] for p in pieces), []) == lp_ids["tokens"]
    assert sum((p["text_offset"] for p in pieces), []) == lp["text_offset"]

    chat = _post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=4,
                 logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
    content = chat["choices"][0]["logprobs"]["content"]
    chat_ref = references["chat"]
    assert chat_tokens(content) == [
        (f"token_id:{t}", list(text([t]).encode()), [f"token_id:{a}" for a, _ in e.top])
        for t, e in zip(chat_ref.token_ids, chat_ref.logprobs, strict=True)]
    streamed = _sse(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=4,
                    logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
    assert sum((chat_tokens(c["choices"][0]["logprobs"]["content"]) for c in streamed
                if c["choices"] and c["choices"][0]["logprobs"]), []) == chat_tokens(content)


def test_return_token_ids_whole_and_streamed(served) -> None:
    """vLLM's ``return_token_ids``: the prompt's token ids (images' placeholders expanded) and
    each choice's generated ids, equal to the Python API's; streamed, the prompt's in the
    first chunk alone and each chunk's new ids, which add up to the whole; none without it."""
    llm, http, references = served
    chat_ref, text_ref = references["chat"], references["text"]
    chat = _post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=4, n=2,
                 return_token_ids=True)
    assert chat["prompt_token_ids"] == chat_ref.prompt_token_ids
    assert [c["token_ids"] for c in chat["choices"]] == [chat_ref.token_ids] * 2
    assert chat_ref.prompt_token_ids.count(llm.engine.processor.image_token_id) > 1
    chunks = _sse(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=4,
                  return_token_ids=True)
    assert chunks[0]["prompt_token_ids"] == chat_ref.prompt_token_ids
    assert not any("prompt_token_ids" in c for c in chunks[1:])
    two = _sse(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=4, n=2,
               return_token_ids=True)  # (each choice's first chunk, as vLLM's)
    assert [c["choices"][0]["index"] for c in two if "prompt_token_ids" in c] == [0, 1]
    assert sum((c["choices"][0].get("token_ids") or [] for c in chunks if c["choices"]),
               []) == chat_ref.token_ids

    text = _post(http, "/v1/completions", prompt=[PROMPT, PROMPT], max_tokens=4,
                 return_token_ids=True)
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in text["choices"]] == [
        (text_ref.prompt_token_ids, text_ref.token_ids)] * 2
    chunks = _sse(http, "/v1/completions", prompt=PROMPT, max_tokens=4, return_token_ids=True)
    firsts = [c for c in chunks if c["choices"] and "prompt_token_ids" in c["choices"][0]]
    assert len(firsts) == 1 and firsts[0]["choices"][0]["prompt_token_ids"] == (
        text_ref.prompt_token_ids)
    assert sum((c["choices"][0]["token_ids"] for c in chunks if c["choices"]), []) == (
        text_ref.token_ids)

    plain = _post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=4)
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert not any("token_ids" in c["choices"][0] for c in _sse(
        http, "/v1/completions", prompt=PROMPT, max_tokens=4) if c["choices"])
    refused = http.post("/v1/completions", json={"prompt": PROMPT, "return_token_ids": "yes"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_token_ids"


def test_the_servers_default_and_a_requests_override(clip_llama: str) -> None:
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        config = ServerConfig("tiny", return_tokens_as_token_ids=True)
        with TestClient(OpenAIServer(llm.engine, config).app()) as http:
            named = _post(http, "/v1/completions", prompt=PROMPT, max_tokens=3, logprobs=0)
            text = _post(http, "/v1/completions", prompt=PROMPT, max_tokens=3, logprobs=0,
                         return_tokens_as_token_ids=False)
            chat = _post(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=3,
                         logprobs=True)
            response = _post(http, "/v1/responses", input="hi", max_output_tokens=3,
                             include=["message.output_text.logprobs"])
        assert_no_leaks(llm.engine)
    assert all(t.startswith("token_id:") for t in named["choices"][0]["logprobs"]["tokens"])
    assert not any(t.startswith("token_id:") for t in text["choices"][0]["logprobs"]["tokens"])
    assert all(c["token"].startswith("token_id:")
               for c in chat["choices"][0]["logprobs"]["content"])
    (part,) = response["output"][0]["content"]
    assert part["logprobs"] and all(c["token"].startswith("token_id:") for c in part["logprobs"])


def test_large_parts_are_written_a_piece_at_a_time() -> None:
    """A body's large lists written piece by piece, the event loop free between pieces, and
    the whole the same JSON as the body made at once; small lists made in place."""
    made: list[tuple[int, int]] = []

    def make(start: int, end: int) -> list:
        made.append((start, end))
        return [{"i": i, "s": f"\"{i}\""} for i in range(start, end)]

    large = LargeParts(piece=3)
    body = {"a": large.add(make, 8), "b": [1, {"c": large.add(make, 2)}],
            "d": large.add(make, 4), "e": "\x00part-"}
    assert body["b"][1]["c"] == make(0, 2) and made.pop() == (0, 2)
    made.clear()
    response = large.response(body)
    assert not made  # nothing made before it is written

    async def read() -> tuple[bytes, list[int]]:
        turns: list[int] = []

        async def other() -> None:  # another request's work, meanwhile
            while True:
                turns.append(len(made))
                await asyncio.sleep(0)

        task = asyncio.ensure_future(other())
        chunks = [chunk async for chunk in response.body_iterator]
        task.cancel()
        return b"".join(chunks), turns

    text, turns = asyncio.run(read())
    assert json.loads(text) == {"a": make(0, 8), "b": [1, {"c": make(0, 2)}],
                                "d": make(0, 4), "e": "\x00part-"}
    assert made[:5] == [(0, 3), (3, 6), (6, 8), (0, 3), (3, 4)]
    assert set(range(1, 6)) <= set(turns)  # the other ran between every two pieces
    assert response.media_type == "application/json"


def test_long_answers_come_in_pieces_equal_to_whole(served, monkeypatch) -> None:
    """prompt_logprobs and an echo's log-probabilities written in pieces of 4 tokens: the
    same answers as made at once."""
    llm, http, _ = served
    bodies = [("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3,
                                        "prompt_logprobs": 2, "n": 2}),
              ("/v1/completions", {"prompt": [PROMPT, "a cat"], "max_tokens": 3, "echo": True,
                                   "logprobs": 2, "prompt_logprobs": 1,
                                   "return_tokens_as_token_ids": True})]
    whole = [_post(http, path, **body) for path, body in bodies]
    monkeypatch.setattr(LargeParts, "__init__", functools.partialmethod(
        LargeParts.__init__, piece=4))
    for (path, body), expected in zip(bodies, whole, strict=True):
        resp = http.post(path, json={"model": "tiny", "temperature": 0, **body})
        assert resp.status_code == 200 and "content-length" not in resp.headers
        got = resp.json()
        for answer in (got, expected):
            answer.pop("created")
            answer.pop("id")
        assert got == expected
    assert_no_leaks(llm.engine)


def test_n_choices_score_their_prompt_once(served) -> None:
    """n completions of a prompt with prompt_logprobs: the first choice's request scores the
    prompt, the others read it from the prefix cache; every choice carries the same
    prompt_logprobs, and an echo the same prompt log-probabilities."""
    _, http, _ = served
    long_prompt = " ".join(["the red fox and the blue bird"] * 6)
    before = http.get("/stats").json()["prefix_cache_hit_tokens"]
    body = _post(http, "/v1/completions", prompt=[long_prompt, PROMPT], max_tokens=2, n=3,
                 temperature=1.0, seed=5, echo=True, logprobs=1, prompt_logprobs=2)
    hits = http.get("/stats").json()["prefix_cache_hit_tokens"] - before
    choices = body["choices"]
    num_prompt = len(choices[0]["prompt_logprobs"])
    assert hits >= 2 * 16 * (num_prompt // 16)  # two choices of the long prompt, cached
    for p in range(2):
        group = choices[3 * p:3 * p + 3]
        assert all(c["prompt_logprobs"] == group[0]["prompt_logprobs"] for c in group)
        prompt_len = len(group[0]["prompt_logprobs"])
        assert all(c["logprobs"]["top_logprobs"][:prompt_len]
                   == group[0]["logprobs"]["top_logprobs"][:prompt_len] for c in group)
        assert group[0]["prompt_logprobs"][0] is None and all(group[0]["prompt_logprobs"][1:])
