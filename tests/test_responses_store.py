"""The Responses API's stored responses (``store``, ``previous_response_id``, ``background``,
and ``GET``/``DELETE /v1/responses/{id}``, ``.../input_items``, ``.../cancel``) through the
openai client: a continued conversation is the prompt the chat endpoint gets for the whole
conversation; the store stays within its bytes, forgetting the least recently used; a
cancelled or abandoned background response leaves no KV block or encoder entry behind."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import openai
import pytest
from starlette.testclient import TestClient

from mmserve import LLM
from mmserve.entrypoints import responses_protocol as responses
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.response_store import (
    MAX_LOG_SHARE,
    EventLog,
    InProgressError,
    ResponseStore,
)
from mmserve.entrypoints.serve_args import ServerConfig
from tests.conftest import assert_no_leaks, make_image, openai_app, slow_down_steps
from tests.test_server import Server, data_url, wait_drained

IMAGE = data_url(make_image(5, (48, 40)))


@pytest.fixture(scope="module")
def served(clip_llama: str):
    with openai_app(clip_llama, max_model_len=512) as app:
        yield app


@pytest.fixture
def slow_steps(served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of at least 5 ms: a 400-token answer takes 2 s or more on any machine, long
    enough to be cancelled while it runs."""
    slow_down_steps(served[0].engine, 0.005, monkeypatch)


def _chat(http: TestClient, messages: list, max_tokens: int) -> dict:
    resp = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages,
                                                   "temperature": 0, "max_tokens": max_tokens})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_previous_response_id_continues_the_conversation(served) -> None:
    """Two turns on an image: the second's prompt is the chat endpoint's for the whole
    conversation (the first turn's input, its answer, the new input), without the first
    turn's instructions (as OpenAI: they are not carried over)."""
    _, http, client = served
    question = [{"type": "input_text", "text": "what is this?"},
                {"type": "input_image", "image_url": IMAGE}]
    first = client.responses.create(model="tiny", instructions="Be brief.", temperature=0,
                                    max_output_tokens=6,
                                    input=[{"role": "user", "content": question}])
    assert first.store is True and first.previous_response_id is None
    second = client.responses.create(model="tiny", previous_response_id=first.id,
                                     input="and its colours?", temperature=0,
                                     max_output_tokens=5)
    assert second.previous_response_id == first.id
    chat = _chat(http, [
        {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                     {"type": "image_url", "image_url": {"url": IMAGE}}]},
        {"role": "assistant", "content": [{"type": "text", "text": first.output_text}]},
        {"role": "user", "content": "and its colours?"}], max_tokens=5)
    assert second.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert second.output_text == chat["choices"][0]["message"]["content"]
    # A third turn continues the whole chain.
    third = client.responses.create(model="tiny", previous_response_id=second.id,
                                    input="thanks", temperature=0, max_output_tokens=3)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_retrieve_list_input_items_and_delete(served) -> None:
    _, http, client = served
    made = client.responses.create(model="tiny", temperature=0, max_output_tokens=3, input=[
        {"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
        {"role": "user", "content": [{"type": "input_text", "text": "three"}]}])
    assert client.responses.retrieve(made.id).model_dump() == made.model_dump()
    items = client.responses.input_items.list(made.id)  # newest first, by default
    assert [item.content[0].text for item in items.data] == ["three", "two", "one"]
    assert [item.content[0].type for item in items.data] == [
        "input_text", "output_text", "input_text"]  # a string content as OpenAI lists it
    assert all(item.id for item in items.data) and not items.has_more
    ascending = http.get(f"/v1/responses/{made.id}/input_items",
                         params={"order": "asc", "limit": 2}).json()
    assert [i["content"][0]["text"] for i in ascending["data"]] == ["one", "two"]
    assert ascending["has_more"] and ascending["last_id"] == ascending["data"][1]["id"]
    rest = http.get(f"/v1/responses/{made.id}/input_items",
                    params={"order": "asc", "after": ascending["last_id"]}).json()
    assert len(rest["data"]) == 1 and not rest["has_more"]
    for params, param in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"),
                          ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")):
        resp = http.get(f"/v1/responses/{made.id}/input_items", params=params)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param
    deleted = http.delete(f"/v1/responses/{made.id}")
    assert deleted.json() == {"id": made.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError, match="cannot be continued") as caught:
        client.responses.create(model="tiny", previous_response_id=made.id, input="hi")
    assert caught.value.body["param"] == "previous_response_id"
    assert http.delete(f"/v1/responses/{made.id}").status_code == 404
    # A streamed response is stored as its last event has it.
    events = list(client.responses.create(model="tiny", input="hi", max_output_tokens=3,
                                          temperature=0, stream=True))
    final = events[-1].response
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    # store: false keeps nothing.
    unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=2,
                                       store=False)
    assert unstored.store is False
    assert http.get(f"/v1/responses/{unstored.id}").status_code == 404


def test_a_repeated_request_id_never_replaces_a_stored_response(served) -> None:
    _, http, _ = served
    headers = {"X-Request-Id": "same-id"}
    ids = [http.post("/v1/responses", headers=headers,
                     json={"input": f"turn {i}", "max_output_tokens": 1}).json()["id"]
           for i in range(2)]
    # The header names the first; the second's id has a suffix of its own.
    assert ids[0] == "resp_same-id" and ids[1].startswith("resp_same-id-")
    assert all(http.get(f"/v1/responses/{rid}").status_code == 200 for rid in ids)
    assert http.get(f"/v1/responses/{ids[0]}/input_items").json()["data"][0]["content"][0][
        "text"] == "turn 0"


def _wait(http: TestClient, response_id: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = http.get(f"/v1/responses/{response_id}").json()
        if body["status"] not in ("queued", "in_progress") or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def test_a_background_response_runs_on_and_is_fetched(served) -> None:
    llm, http, client = served
    body = {"model": "tiny", "input": "tell me a story", "temperature": 0,
            "max_output_tokens": 8}
    queued = client.responses.create(**body, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _wait(http, queued.id)
    assert done["status"] == "incomplete"  # its 8 tokens, as the same request answered now
    waited = client.responses.create(**body)
    assert done["output"][0]["content"][0]["text"] == waited.output_text
    assert done["usage"]["output_tokens"] == 8
    # Cancelling one that ended answers it as it is; one made without background is refused.
    assert http.post(f"/v1/responses/{queued.id}/cancel").json()["status"] == "incomplete"
    refused = http.post(f"/v1/responses/{waited.id}/cancel")
    assert refused.status_code == 400 and "background" in refused.json()["error"]["message"]
    # Continued from, as any stored response.
    more = client.responses.create(model="tiny", previous_response_id=queued.id,
                                   input="go on", max_output_tokens=2)
    assert more.status == "incomplete"


def test_cancelled_and_deleted_background_responses_free_their_requests(served,
                                                                       slow_steps) -> None:
    llm, http, client = served
    long = {"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "describe"}, {"type": "input_image", "image_url": IMAGE}]}],
        "max_output_tokens": 400, "temperature": 0, "background": True}
    running = client.responses.create(**long)
    # Its answer is not there yet: continuing from it is refused, not answered without it.
    with pytest.raises(openai.BadRequestError, match="still running"):
        client.responses.create(model="tiny", previous_response_id=running.id, input="and?")
    # One made without 'stream' is fetched whole, not streamed.
    resp = http.get(f"/v1/responses/{running.id}", params={"stream": "true"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream"
    assert "'background' and 'stream'" in resp.json()["error"]["message"]
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(cancelled.id).status == "cancelled"
    running = client.responses.create(**long)
    assert http.delete(f"/v1/responses/{running.id}").status_code == 200
    # Both engine requests end: nothing holds a KV block or an encoder-cache entry.
    deadline = time.monotonic() + 30
    while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not llm.engine.has_unfinished_requests()
    assert http.get(f"/v1/responses/{running.id}").status_code == 404


def _events(text: str) -> list[dict]:
    """The data of each server-sent event of a body, checked against its ``event:`` line."""
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {out[-1]['type']}"
    return out


def test_a_background_stream_is_streamed_again_from_any_event(served) -> None:
    """``background`` with ``stream``: the events come as a stream does (created and queued
    first), and ``GET ?stream=true&starting_after=N`` streams the same events numbered above
    N, while it runs and after; the openai client reads them."""
    _, http, client = served
    body = {"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "describe"}, {"type": "input_image", "image_url": IMAGE}]}],
        "temperature": 0, "max_output_tokens": 12}
    made = http.post("/v1/responses", json={**body, "background": True, "stream": True})
    assert made.status_code == 200, made.text
    assert made.headers["content-type"].startswith("text/event-stream")
    events = _events(made.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:3]] == ["response.created", "response.queued",
                                               "response.in_progress"]
    assert events[0]["response"]["status"] == "queued"
    assert events[0]["response"]["background"] is True
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    # The same answer as the request made plainly, and stored as its last event has it.
    plain = client.responses.create(**body)
    assert final["output"][0]["content"][0]["text"] == plain.output_text
    assert http.get(f"/v1/responses/{final['id']}").json() == final
    # Streamed again: all of it, or the events after one, byte for byte the same.
    again = http.get(f"/v1/responses/{final['id']}", params={"stream": "true"})
    assert again.text == made.text
    after = http.get(f"/v1/responses/{final['id']}",
                     params={"stream": "true", "starting_after": "4"})
    assert _events(after.text) == events[5:]
    past = http.get(f"/v1/responses/{final['id']}",
                    params={"stream": "true", "starting_after": str(len(events) + 5)})
    assert past.status_code == 200 and past.text == ""
    read = list(client.responses.retrieve(final["id"], stream=True, starting_after=2))
    assert [e.type for e in read] == [e["type"] for e in events[3:]]
    assert read[-1].response.id == final["id"]
    assert read[-1].response.output_text == plain.output_text
    # Refused: a bad number, a number without a stream, a stream that is neither.
    for params in ({"stream": "true", "starting_after": "-1"},
                   {"stream": "true", "starting_after": "x"},
                   {"starting_after": "3"}, {"stream": "no"}):
        resp = http.get(f"/v1/responses/{final['id']}", params=params)
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == ("stream" if "stream" in params
                                                 and params["stream"] == "no"
                                                 else "starting_after")
    # A plain stream (not background) is not kept to be streamed again.
    streamed = list(client.responses.create(**body, stream=True))
    resp = http.get(f"/v1/responses/{streamed[-1].response.id}", params={"stream": "true"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream"


def test_followers_of_a_background_stream_end_when_it_is_cancelled(served,
                                                                    slow_steps) -> None:
    """Two clients follow a long background stream; cancelling it ends both streams (no
    follower waits for ever) with the same events, the last an error event that says it was
    cancelled, and frees its engine request."""
    llm, http, client = served
    body = {"model": "tiny", "input": "tell me a long story", "temperature": 0,
            "max_output_tokens": 400, "background": True, "stream": True}
    rid = "resp_followed"  # (named by the request id: the POST answers only as it ends)
    pool = concurrent.futures.ThreadPoolExecutor(2)  # (a follower left waiting fails)
    try:
        made = pool.submit(http.post, "/v1/responses", json=body,
                           headers={"X-Request-Id": "followed"})
        deadline = time.monotonic() + 60
        while (http.get(f"/v1/responses/{rid}").status_code != 200
               and time.monotonic() < deadline):
            time.sleep(0.02)
        follower = pool.submit(http.get, f"/v1/responses/{rid}",
                               params={"stream": "true", "starting_after": "1"})
        time.sleep(0.1)  # (its 400 tokens take about a second)
        assert client.responses.cancel(rid).status == "cancelled"
        first, second = made.result(timeout=30), follower.result(timeout=30)
    finally:
        pool.shutdown(wait=False)
    events = _events(first.text)
    assert _events(second.text) == events[2:]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "error" and events[-1]["code"] == "response_cancelled"
    assert not any(e["type"] == "response.completed" for e in events)
    deadline = time.monotonic() + 30
    while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not llm.engine.has_unfinished_requests()


def test_a_background_response_cancelled_before_it_ran_ends_its_stream(served,
                                                                       slow_steps) -> None:
    """Cancelled in the event loop's turn that started it (a DELETE or a shutdown before
    its task first ran): its engine request is aborted and its stream ends all the same."""
    llm, http, _ = served
    server = llm.server

    async def cancelled_at_once() -> tuple[bool, bool]:
        req = responses.parse_responses_request(
            {"input": "tell me a long story", "max_output_tokens": 400, "background": True,
             "stream": True}, 512, 4, can_store=True)
        (stream,) = await server.engine.add_completions(
            ["early"], await server._prompt_of(req.chat), req.chat.params)
        events = responses.ResponseEvents("resp_early", "tiny", req.echo)
        server._run_in_background(req, events, stream, None, release=lambda: None)
        entry = server.response_store.get("resp_early")
        entry.task.cancel()  # (before its first turn)
        await asyncio.sleep(0.2)
        followed = [e async for e in entry.log.follow()]  # ends at once
        server.response_store.delete("resp_early")
        return entry.log.ended, followed

    ended, followed = http.portal.call(cancelled_at_once)
    assert ended and followed == []
    # Aborted, not left to run its 400 tokens (2 s or more at these steps).
    assert server.engine.num_in_flight == 0
    deadline = time.monotonic() + 10
    while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_a_dropped_background_stream_is_resumed(clip_llama: str, tmp_path) -> None:
    """Over a real socket: a client reads a background stream's first events and drops the
    connection; the response runs on, and the client resumes after the last event it read,
    getting the rest, the same answer as the request made plainly."""
    server = Server(clip_llama, "--served-model-name", "tiny", "--max-model-len", "256",
                    log=tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        body = {"model": "tiny", "input": "tell me a story", "temperature": 0,
                "max_output_tokens": 48}
        read = []
        with client.responses.create(**body, background=True, stream=True) as stream:
            for event in stream:
                read.append(event)
                if event.sequence_number == 6:
                    break  # the connection drops here
        rest = list(client.responses.retrieve(read[0].response.id, stream=True,
                                              starting_after=read[-1].sequence_number))
        events = read + rest
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type == "response.incomplete"
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == events[-1].response.output_text == client.responses.create(
            **body).output_text
        wait_drained(server.url)
    finally:
        assert server.stop() == 0


def _tokens(http: TestClient, messages: list) -> int:
    resp = http.post("/tokenize", json={"model": "tiny", "messages": messages})
    assert resp.status_code == 200, resp.text
    return resp.json()["count"]


def test_truncation_auto_drops_the_earliest_turns(served) -> None:
    """``truncation: "auto"``: a conversation longer than max_model_len (512) loses its
    earliest turns, no more than it must (the latest start at a user message, earliest
    first, that fits), its images with them, and is answered as the chat endpoint answers
    what is left, the instructions kept; without it, a 400 that names it."""
    _, http, client = served
    other = data_url(make_image(9, (40, 48)))
    turns = []
    for i, text in enumerate(["first " * 120, "second " * 100, "third " * 40, "fourth " * 40]):
        content = [{"type": "input_text", "text": text}]
        if i in (0, 2):  # an image in a dropped turn and in a kept one
            content.append({"type": "input_image", "image_url": IMAGE if i == 0 else other})
        turns.append({"role": "user", "content": content})
        if i < 3:
            turns.append({"role": "assistant", "content": [
                {"type": "output_text", "text": f"answer {i} " * 20}]})
    chat_messages = [{"role": "system", "content": "Be brief."}]
    for turn in turns:
        parts = [{"type": "text", "text": p["text"]} if p["type"] != "input_image" else
                 {"type": "image_url", "image_url": {"url": p["image_url"]}}
                 for p in turn["content"]]
        chat_messages.append({"role": turn["role"], "content": parts})
    assert _tokens(http, chat_messages) > 512
    # The latest user turn from which the rest fits, found by counting each (what the
    # server's binary search must agree with).
    fits = [i for i in range(1, len(chat_messages)) if chat_messages[i]["role"] == "user"
            and _tokens(http, chat_messages[:1] + chat_messages[i:]) <= 512]
    start = fits[0]
    assert start == 5  # two turns dropped (an image with them), one with an image kept
    body = {"model": "tiny", "instructions": "Be brief.", "input": turns, "temperature": 0,
            "max_output_tokens": 6}
    refused = http.post("/v1/responses", json=body)
    assert refused.status_code == 400
    assert "'truncation': \"auto\"" in refused.json()["error"]["message"]
    made = client.responses.create(**body, truncation="auto")
    assert made.truncation == "auto" and made.status == "incomplete"
    kept = chat_messages[:1] + chat_messages[start:]
    assert made.usage.input_tokens == _tokens(http, kept)
    counted = client.responses.input_tokens.count(
        model="tiny", instructions="Be brief.", input=turns, truncation="auto")
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == made.usage.input_tokens
    untruncated = http.post("/v1/responses/input_tokens", json={
        "model": "tiny", "instructions": "Be brief.", "input": turns})
    assert untruncated.json()["input_tokens"] == _tokens(http, chat_messages)  # (> 512)
    assert made.output_text == _chat(http, kept, 6)["choices"][0]["message"]["content"]
    # What is stored is the request's input, whole.
    stored = http.get(f"/v1/responses/{made.id}/input_items", params={"order": "asc",
                                                                      "limit": 100}).json()
    assert len(stored["data"]) == len(turns)
    # Where even the last turn is too long, a 400 that says so.
    resp = http.post("/v1/responses", json={**body, "truncation": "auto",
                                            "input": [turns[0], {"role": "user",
                                                                 "content": "long " * 600}]})
    assert resp.status_code == 400 and "does not fit either" in resp.text
    resp = http.post("/v1/responses", json={**body, "truncation": "sometimes"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "truncation"


def test_truncated_turns_take_their_images_with_them() -> None:
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}]},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": [{"type": "image"}, {"type": "image"}]},
                {"role": "tool", "tool_call_id": "c", "content": "d"},
                {"role": "user", "content": "e"}]
    images = ["A", "B", "C"]
    assert responses.truncation_starts(messages) == [3, 5]
    assert responses.without_turns(messages, 3, images) == ([messages[0], *messages[3:]],
                                                            ["B", "C"])
    assert responses.without_turns(messages, 5, images) == ([messages[0], messages[5]], [])
    assert responses.truncation_starts(messages[1:]) == [2, 4]  # no instructions
    # Leading system and developer messages stay, with their images, before the turns kept.
    leading = [{"role": "developer", "content": [{"type": "image"}]},
               {"role": "system", "content": "t"}, *messages[1:]]
    assert responses.truncation_starts(leading) == [4, 6]
    assert responses.without_turns(leading, 4, ["S", *images]) == (
        [*leading[:2], *leading[4:]], ["S", "B", "C"])


def test_a_server_without_a_store(clip_llama: str) -> None:
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        config = ServerConfig("tiny", responses_store_bytes=0)
        with TestClient(OpenAIServer(llm.engine, config).app()) as http:
            made = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
            assert made.status_code == 200 and made.json()["store"] is False
            assert http.get(f"/v1/responses/{made.json()['id']}").status_code == 404
            resp = http.post("/v1/responses", json={"input": "hi", "background": True})
            assert resp.status_code == 400 and "--responses-store-mib" in resp.text
            resp = http.post("/v1/responses", json={"input": "hi",
                                                    "previous_response_id": "resp_x"})
            assert resp.status_code == 404 and "stores no responses" in resp.text
        assert_no_leaks(llm.engine)


def test_the_stores_size_flag(capsys) -> None:
    from mmserve.entrypoints.cli import build_parser, main

    args = build_parser().parse_args(["serve", "--responses-store-mib", "0.5", "/ckpt"])
    assert args.responses_store_mib == 0.5 and args.model_path == "/ckpt"
    assert main(["serve", "--responses-store-mib", "-1", "/nonexistent"]) == 2
    assert "--responses-store-mib must be >= 0" in capsys.readouterr().err


def _response(rid: str, text: str = "") -> dict:
    return {"id": rid, "output": [{"type": "message", "role": "assistant",
                                   "content": [{"type": "output_text", "text": text}]}]}


def test_the_store_forgets_the_least_recently_used_within_its_bytes() -> None:
    item = [{"type": "message", "role": "user", "content": "x" * 100, "id": "msg_1"}]
    one = ResponseStore(10**9).put(_response("a"), item, None)
    assert one is not None
    store = ResponseStore(3 * one.nbytes + 10)  # three responses of this size
    a = store.put(_response("a"), item, None)
    store.put(_response("b"), item, "a")
    store.put(_response("c"), item, None)
    assert [i["type"] for i in store.conversation("b")] == ["message"] * 4  # uses a and b
    store.put(_response("d"), item, None)  # c, the least recently used, goes
    assert "c" not in store and all(r in store for r in "abd")
    assert store.nbytes <= store.max_bytes
    # A running (background) response is never forgotten to make room: a is the oldest.
    store.start(a, object(), None)
    store.put(_response("e"), item, None)
    assert "a" in store and "b" not in store and store.nbytes <= store.max_bytes
    # A new response that does not fit beside the running ones is not stored.
    b = store.put(_response("b"), item, None)
    store.start(b, object(), None)
    assert store.running_bytes == 2 * one.nbytes
    assert store.put(_response("big", "y" * (store.max_bytes - 2 * one.nbytes)), item,
                     None) is None
    assert "a" in store and "b" in store and "e" in store  # nothing forgotten for it
    assert store.nbytes <= store.max_bytes
    with pytest.raises(InProgressError):
        store.conversation("b")
    store.update(_response("b"))  # b ended
    assert store.running_bytes == one.nbytes
    # An id taken is never replaced (a client's request id sent twice at once).
    taken = store.get("e").response
    assert store.put(_response("e", "other"), item, None) is None
    assert store.get("e").response is taken
    # A conversation with a forgotten link cannot be continued.
    store.put(_response("g"), item, "c")
    assert store.conversation("g") is None
    # One larger than the whole store is not kept, and forgets nothing.
    before = len(store)
    assert store.put(_response("big", "y" * store.max_bytes), item, None) is None
    assert len(store) == before and "big" not in store
    # An ended background response that grew past the store is dropped, not kept over it.
    store.update(_response("a", "z" * store.max_bytes))
    assert "a" not in store and store.nbytes <= store.max_bytes


def test_a_streams_events_are_kept_within_the_stores_bytes() -> None:
    """A running background stream's events count as its bytes (the least recently used
    responses forgotten for them), up to a quarter of the store: past it the rest is not
    kept, so that one long stream cannot empty the store. Its followers get what was kept
    and an ``error`` event; once it ends the events are freed, the response itself kept."""
    item = [{"type": "message", "role": "user", "content": "x", "id": "msg_1"}]
    store = ResponseStore(4000)
    for i in range(40):
        store.put(_response(f"old-{i}"), item, None)
    entry = store.put(_response("bg"), item, None)
    entry.log = EventLog()
    store.start(entry, object(), None)
    old = sum(f"old-{i}" in store for i in range(40))
    event = "event: e\ndata: " + "y" * 80 + "\n\n"
    followed: list[str] = []

    async def follow() -> None:
        async for e in entry.log.follow(after=0):
            followed.append(e)

    async def run() -> None:
        task = asyncio.ensure_future(follow())
        for _ in range(40):
            store.record(entry, event)
            assert store.nbytes <= store.max_bytes
            await asyncio.sleep(0)
        await asyncio.wait_for(task, 5)  # (it ends: the log was cut)

    asyncio.run(run())
    kept = len(entry.log.events)
    assert entry.log.cut and kept == store.max_bytes // MAX_LOG_SHARE // len(event)
    # Older responses were forgotten to make room for its events, not all of them.
    assert 0 < sum(f"old-{i}" in store for i in range(40)) < old
    assert store.running_bytes == entry.nbytes
    assert followed[:-1] == entry.log.events[1:]
    error = json.loads(followed[-1].split("data: ")[1])
    assert error["type"] == "error" and error["sequence_number"] == kept
    assert "--responses-store-mib" in error["message"]
    store.update(_response("bg", "done"))  # it ended: the cut events are freed
    assert entry.log.events == [] and store.running_bytes == 0
    assert entry.nbytes < 300 and "bg" in store and store.nbytes <= store.max_bytes


def test_a_loop_of_links_is_no_conversation() -> None:
    """Ids can come back (a client's request id, deleted and sent again), so links could
    close a loop: continuing one ends, as a conversation that cannot be continued."""
    store = ResponseStore(10**6)
    store.put(_response("a"), [], "b")
    store.put(_response("b"), [], "a")
    assert store.conversation("a") is None and store.conversation("b") is None


def test_input_item_pages() -> None:
    from mmserve.entrypoints.openai_protocol import ApiError, paged

    def input_items_page(items: list, query: dict) -> dict:
        return paged(items, query, 20, 100, "input item", "in this response")

    items = [{"id": f"i{n}"} for n in range(5)]
    page = input_items_page(items, {"limit": "2"})
    assert [i["id"] for i in page["data"]] == ["i4", "i3"] and page["has_more"]
    page = input_items_page(items, {"limit": "2", "after": "i3"})
    assert [i["id"] for i in page["data"]] == ["i2", "i1"] and page["has_more"]
    page = input_items_page(items, {"order": "asc", "after": "i3"})
    assert [i["id"] for i in page["data"]] == ["i4"] and not page["has_more"]
    assert input_items_page([], {})["first_id"] is None
    with pytest.raises(ApiError, match="limit") as e:
        input_items_page(items, {"limit": "101"})
    assert e.value.status == 400 and e.value.param == "limit"


def test_input_tokens_counts_what_a_response_would_read(served, slow_steps) -> None:
    """``POST /v1/responses/input_tokens`` counts a request's tokens as the response made of
    it reads them (its usage's ``input_tokens``): images, tools, a stored response's chain
    or a conversation's items before the input; a conversation alone; a conversation a
    running response holds is read, not held."""
    llm, http, client = served
    image = {"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(make_image(3, (40, 30)))},
        {"type": "input_text", "text": "what is this?"}]}
    tool = {"type": "function", "name": "look", "parameters": {
        "type": "object", "properties": {"what": {"type": "string"}}}}
    first = client.responses.create(model="tiny", input=[image], tools=[tool],
                                    max_output_tokens=3, temperature=0)
    counted = client.responses.input_tokens.count(model="tiny", input=[image], tools=[tool])
    assert counted.input_tokens == first.usage.input_tokens
    follow = {"previous_response_id": first.id, "input": "and then?"}
    counted = client.responses.input_tokens.count(model="tiny", **follow)
    assert counted.input_tokens == client.responses.create(
        model="tiny", max_output_tokens=3, **follow).usage.input_tokens

    conversation = client.conversations.create(items=[image])
    alone = client.responses.input_tokens.count(conversation=conversation.id)
    running = client.responses.create(model="tiny", conversation=conversation.id,
                                      input="go on", max_output_tokens=400, background=True)
    counted = client.responses.input_tokens.count(conversation=conversation.id,
                                                  input="go on")
    assert alone.input_tokens < counted.input_tokens
    client.responses.cancel(running.id)
    made = client.responses.create(model="tiny", conversation=conversation.id,
                                   input="go on", max_output_tokens=3)
    assert made.usage.input_tokens == counted.input_tokens
    for body, param in (({"input": "hi", "model": "other"}, "model"),
                        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
                        ({"conversation": "conv_missing"}, "conversation"),
                        ({}, "input")):
        resp = http.post("/v1/responses/input_tokens", json=body)
        assert resp.status_code in (400, 404), resp.text
        assert resp.json()["error"]["param"] == param, resp.text
