"""OpenAI's Conversations API through the openai client: a conversation's items are kept,
listed, added and deleted; a Responses API request that names it reads its items before its
input, as the same history sent whole would be read, and adds its input and output once it
has completed; refusals name the field; the store of conversations is bounded."""

from __future__ import annotations

import time

import openai
import pytest

from mmserve.entrypoints.conversations import ConversationStore
from tests.conftest import make_image, openai_app, slow_down_steps
from tests.test_server import data_url

IMAGE = data_url(make_image(1, (40, 30)))


@pytest.fixture(scope="module")
def served(clip_llama: str):
    with openai_app(clip_llama, max_model_len=512) as app:
        yield app


def _user(text: str, image: str | None = None) -> dict:
    content = [{"type": "input_text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "input_image", "image_url": image})
    return {"type": "message", "role": "user", "content": content}


def _ask(client: openai.OpenAI, **kwargs):
    return client.responses.create(model="tiny", temperature=0, max_output_tokens=5, **kwargs)


def test_a_conversations_items_are_kept_listed_added_and_deleted(served) -> None:
    _, _, client = served
    conversation = client.conversations.create(items=[_user("hello", IMAGE)],
                                               metadata={"topic": "fox"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "fox"}
    assert client.conversations.retrieve(conversation.id).created_at == conversation.created_at
    updated = client.conversations.update(conversation.id, metadata={"topic": "bird"})
    assert updated.metadata == {"topic": "bird"}

    added = client.conversations.items.create(conversation.id, items=[
        {"role": "assistant", "content": "hi there"}, _user("and then?")])
    assert [item.type for item in added.data] == ["message", "message"]
    newest_first = client.conversations.items.list(conversation.id)
    assert [item.role for item in newest_first.data] == ["user", "assistant", "user"]
    oldest_first = client.conversations.items.list(conversation.id, order="asc", limit=2)
    assert [item.id for item in oldest_first.data] == [
        newest_first.data[2].id, newest_first.data[1].id] and oldest_first.has_more
    assert oldest_first.data[1].content[0].text == "hi there"  # (as an output_text part)
    item = client.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id)
    assert item.id == added.data[0].id
    client.conversations.items.delete(added.data[0].id, conversation_id=conversation.id)
    assert len(client.conversations.items.list(conversation.id).data) == 2
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id)

    deleted = client.conversations.delete(conversation.id)
    assert deleted.deleted and deleted.id == conversation.id
    with pytest.raises(openai.NotFoundError) as e:
        client.conversations.retrieve(conversation.id)
    assert e.value.body["code"] == "conversation_not_found"


def test_a_response_reads_its_conversation_and_adds_to_it(served) -> None:
    """Two turns through a conversation answer as the same history sent whole does, and the
    conversation ends up holding that history."""
    _, _, client = served
    first = [_user("what is in the picture?", IMAGE)]
    conversation = client.conversations.create(items=first)
    one = _ask(client, conversation=conversation.id, input="describe it")
    assert one.conversation.id == conversation.id and one.status == "incomplete"
    two = _ask(client, conversation={"id": conversation.id}, input="and the colours?",
               store=False)
    history = [*first, _user("describe it"),
               {"role": "assistant", "content": one.output_text},
               _user("and the colours?")]
    whole = _ask(client, input=history, store=False)
    assert two.output_text == whole.output_text
    assert two.usage.input_tokens == whole.usage.input_tokens
    items = client.conversations.items.list(conversation.id, order="asc", limit=100).data
    assert [item.role for item in items] == ["user", "user", "assistant", "user", "assistant"]
    assert items[2].content[0].text == one.output_text
    assert items[4].content[0].text == two.output_text


def test_a_background_response_adds_to_its_conversation_once_it_ends(served) -> None:
    _, _, client = served
    conversation = client.conversations.create()
    queued = _ask(client, conversation=conversation.id, input="hello", background=True)
    deadline = time.monotonic() + 60
    while client.responses.retrieve(queued.id).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [item.role for item in items] == ["user", "assistant"]


@pytest.mark.parametrize("body, status, param", [
    ({"conversation": "conv_missing"}, 404, "conversation"),
    ({"conversation": 5}, 400, "conversation"),
    ({"conversation": "CONV", "previous_response_id": "resp_x"}, 400, "conversation"),
])
def test_responses_refusals_name_the_field(served, body: dict, status: int, param: str) -> None:
    _, http, client = served
    if body.get("conversation") == "CONV":
        body = {**body, "conversation": client.conversations.create().id}
        stored = _ask(client, input="hi")
        body["previous_response_id"] = stored.id
    resp = http.post("/v1/responses", json={"model": "tiny", "input": "hi", **body})
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param


@pytest.mark.parametrize("items, param", [
    ([_user("ok"), {"type": "web_search_call"}], "items[1].type"),
    ([{"role": "robot", "content": "hi"}], "items[0].role"),
    ([{"role": "user", "content": [{"type": "input_image"}]}], "items[0].content[0]"),
    ([_user("x")] * 21, "items"),
    ([{"role": "user", "content": 123}], "items[0].content"),
    ([{"role": "user", "content": [{"type": "input_text", "text": None}]}],
     "items[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": 5}]}],
     "items[0].content[0].image_url"),
])
def test_items_are_checked_as_a_requests_input(served, items: list, param: str) -> None:
    _, http, client = served
    resp = http.post("/v1/conversations", json={"items": items})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    conversation = client.conversations.create()
    resp = http.post(f"/v1/conversations/{conversation.id}/items", json={"items": items})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    assert client.conversations.items.list(conversation.id).data == []


def test_the_store_forgets_the_least_recently_used_to_make_room() -> None:
    store = ConversationStore(max_bytes=600)
    item = {"id": "msg_1", "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "x" * 100}]}
    old, new = store.create({}, [item]), store.create({}, [item])
    assert old is not None and new is not None
    assert store.get(old.id) is old  # used now: ``new`` is the least recently used
    third = store.create({}, [item, {**item, "id": "msg_2"}])
    assert third is not None and store.get(new.id) is None and store.get(old.id) is old
    assert not store.add(third, [{**item, "id": "msg_3"}] * 4)  # never fits: nothing added
    assert len(third.items) == 2 and store.nbytes == sum(
        c.nbytes for c in (old, third)) <= store.max_bytes
    kept = len(store)
    assert store.create({}, [{**item, "content": "y" * 700}]) is None
    assert len(store) == kept  # (none forgotten for what could not fit anyway)


def test_without_a_store_the_endpoints_say_how_to_have_one(clip_llama: str) -> None:
    with openai_app(clip_llama, server={"responses_store_bytes": 0}, max_model_len=256) as app:
        _, http, _ = app
        resp = http.post("/v1/conversations", json={})
        assert resp.status_code == 404 and "--responses-store-mib" in resp.text
        resp = http.post("/v1/responses", json={"input": "hi", "conversation": "conv_1",
                                                "store": False})
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == "conversations_disabled"


def test_items_sent_again_get_ids_of_their_own(served) -> None:
    """A client that sends an answer's items back (their ids included) adds copies with new
    ids: every id names one item, and the pages after it go on."""
    _, _, client = served
    conversation = client.conversations.create()
    item = {**_user("again"), "id": "msg_same"}
    client.conversations.items.create(conversation.id, items=[item, item])
    client.conversations.items.create(conversation.id, items=[item])
    ids = [i.id for i in client.conversations.items.list(conversation.id, order="asc").data]
    assert len(ids) == len(set(ids)) == 3 and ids[0] == "msg_same"
    paged = client.conversations.items.list(conversation.id, order="asc", limit=1,
                                            after=ids[0])
    assert [i.id for i in paged.data] == [ids[1]]


def test_a_streamed_response_is_in_its_conversation_before_it_says_it_completed(
        served) -> None:
    """The finished response is added (``on_final``) before the event that says it
    completed goes out, so that a client's next turn finds it there."""
    import asyncio

    from mmserve.entrypoints import responses_protocol as responses
    from mmserve.outputs import RequestOutput

    llm, _, client = served
    conversation = client.conversations.create()

    class Finished:
        request_id = "fake-stream"

        async def __aiter__(self):
            yield RequestOutput("fake-stream", "hello", [1, 2], 3, finished=True,
                                finish_reason="stop", new_text="hello", new_token_ids=[1, 2])

    async def run() -> list[str]:
        seen: list[str] = []
        events = responses.ResponseEvents("resp_fake", "tiny", {}, 0)
        async for event in llm.server._response_events(
                events, Finished(), None, on_final=lambda final: seen.append("final")):
            seen.append(event.partition("\n")[0])
        return seen

    seen = asyncio.run(run())
    assert seen[-1] == "event: response.completed" and "final" in seen[:-1]
    # Through the server: the turn is in the conversation once the stream ends.
    for _ in _ask(client, conversation=conversation.id, input="hi", stream=True):
        pass
    assert [i.role for i in client.conversations.items.list(conversation.id).data] == [
        "assistant", "user"]


def test_a_function_call_cut_off_is_left_out_of_the_conversation(served) -> None:
    """A call cut off by ``max_output_tokens`` has arguments that are no JSON: the
    conversation keeps the turn's input without it, and goes on."""
    _, _, client = served
    conversation = client.conversations.create()
    tool = {"type": "function", "name": "look", "parameters": {
        "type": "object", "properties": {"what": {"type": "string"}}, "required": ["what"]}}
    cut = client.responses.create(model="tiny", temperature=0, max_output_tokens=2,
                                  conversation=conversation.id, input="call it",
                                  tools=[tool], tool_choice={"type": "function",
                                                             "name": "look"})
    assert cut.status == "incomplete" and cut.output[0].type == "function_call"
    items = client.conversations.items.list(conversation.id).data
    assert [i.type for i in items] == ["message"]
    assert _ask(client, conversation=conversation.id, input="go on").status in (
        "completed", "incomplete")


def test_a_conversation_runs_one_response_at_a_time(served, monkeypatch) -> None:
    """While a response naming a conversation runs, another naming it is refused with
    OpenAI's ``conversation_locked``; once it has ended, however it ended, the next one
    runs. A request refused before it ran holds nothing."""
    llm, http, client = served
    conversation = client.conversations.create()
    refused = http.post("/v1/responses", json={"model": "tiny", "input": "hi",
                                               "conversation": conversation.id,
                                               "temperature": 9})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature"

    slow_down_steps(llm.engine, 0.05, monkeypatch)
    running = client.responses.create(model="tiny", input="hello", max_output_tokens=40,
                                      temperature=0, conversation=conversation.id,
                                      background=True)
    for body in ({"input": "again"}, {"input": "streamed", "stream": True},
                 {"input": "later", "background": True}):
        locked = http.post("/v1/responses", json={"model": "tiny", "max_output_tokens": 2,
                                                  "conversation": conversation.id, **body})
        assert locked.status_code == 400, locked.text
        error = locked.json()["error"]
        assert error["code"] == "conversation_locked" and error["param"] == "conversation"
    other = client.conversations.create()  # (other conversations are not held)
    assert _ask(client, conversation=other.id, input="hi").conversation.id == other.id
    client.responses.cancel(running.id)
    assert _ask(client, conversation=conversation.id, input="next").status in (
        "completed", "incomplete")
    for _ in _ask(client, conversation=conversation.id, input="streamed", stream=True):
        pass
    assert _ask(client, conversation=conversation.id, input="last").status in (
        "completed", "incomplete")
    roles = [i.role for i in client.conversations.items.list(conversation.id,
                                                             order="asc").data]
    assert roles == ["user", "assistant"] * 3  # (the cancelled one added nothing)


def test_a_held_conversation_is_not_forgotten_to_make_room() -> None:
    store = ConversationStore(max_bytes=400)
    item = {"id": "msg_1", "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "x" * 100}]}
    held = store.create({}, [item])
    assert held is not None and store.hold(held) and not store.hold(held)
    assert store.create({}, [item, {**item, "id": "msg_2"}]) is None  # (only by forgetting it)
    assert store.held_in_the_way  # (a 503 to retry, not a 400 to send less)
    assert store.get(held.id) is held
    assert store.create({}, [{**item, "content": "y" * 500}]) is None
    assert not store.held_in_the_way  # (too large alone)
    store.release(held.id)
    assert store.create({}, [item, {**item, "id": "msg_2"}]) is not None
    assert store.get(held.id) is None and store.hold(held) is True  # (free again)


def test_a_stream_closed_before_its_first_event_still_ends_its_request() -> None:
    """A client gone while the answer's headers are sent cancels the stream before its
    body's generator starts, so the generator's own ``finally`` never runs; the stream's
    ``on_close`` (the engine request's abort, the conversation's release) still does."""
    import asyncio

    from mmserve.entrypoints.http_middleware import ClosingStream

    started, closed = [], []

    async def events():
        started.append(True)
        yield "data: never\n\n"

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        await asyncio.sleep(1)  # (the headers still going out when the client leaves)

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    asyncio.run(ClosingStream(events(), lambda: closed.append(True))(scope, receive, send))
    assert closed == [True] and started == []


def test_a_streamed_response_lets_its_conversation_go_before_its_last_event(served) -> None:
    """The conversation is released once the response's items are added, before the event
    that says it completed reaches the client, so that the client's next turn is not
    refused."""
    import json

    llm, http, client = served
    store = llm.server.conversations.store
    conversation = client.conversations.create()
    body = json.dumps({"model": "tiny", "input": "hi", "max_output_tokens": 3,
                       "temperature": 0, "stream": True,
                       "conversation": conversation.id}).encode()
    held_at: dict[str, bool] = {}

    async def run() -> None:
        import asyncio

        sent, done = False, asyncio.Event()

        async def receive():
            nonlocal sent
            if sent:
                await done.wait()  # (the client stays until the answer is done)
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            if message["type"] == "http.response.body" and not message.get("more_body"):
                done.set()
            if message["type"] == "http.response.body":
                for event in (b"response.created", b"response.completed",
                              b"response.incomplete"):
                    if b"event: " + event in message.get("body", b""):
                        held_at[event.decode()] = conversation.id in store._held

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/responses", "raw_path": b"/v1/responses", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("test", 1), "server": ("testserver", 80), "state": {}}
        await llm.server.app()(scope, receive, send)

    http.portal.call(run)
    assert held_at.pop("response.created") is True
    assert list(held_at.values()) == [False], held_at  # (completed or incomplete)
    assert conversation.id not in store._held


def test_a_store_full_of_held_conversations_is_a_503_to_retry(clip_llama: str,
                                                               monkeypatch) -> None:
    """Where only conversations that running responses hold stand in the way, a new
    conversation is a 503 with Retry-After (retry once they end), not a 400 to send less."""
    with openai_app(clip_llama, server={"responses_store_bytes": 4000},
                    max_model_len=512) as (llm, http, client):
        slow_down_steps(llm.engine, 0.05, monkeypatch)
        def metadata(n: int) -> dict:  # (bytes that cost no tokens)
            return {f"k{i}": "v" * 500 for i in range(n)}

        held = client.conversations.create(metadata=metadata(5))
        running = client.responses.create(model="tiny", conversation=held.id, input="go",
                                          max_output_tokens=200, temperature=0,
                                          background=True)
        busy = http.post("/v1/conversations", json={"metadata": metadata(4)})
        assert busy.status_code == 503 and busy.headers["Retry-After"] == "1", busy.text
        assert busy.json()["error"]["code"] == "conversations_busy"
        too_large = http.post("/v1/conversations", json={"metadata": metadata(16)})
        assert too_large.json()["error"]["code"] == "conversation_too_large"
        client.responses.cancel(running.id)
        assert http.post("/v1/conversations", json={"metadata": metadata(4)}).status_code == 200
