"""OpenAI's stored chat completions through the openai client: a chat request sent with
``store: true`` is kept with its metadata and messages, listed (by model and metadata, in
pages), retrieved as it was answered (whole or streamed), its metadata updated, and deleted;
requests without it are not kept; the store is bounded."""

from __future__ import annotations

import json

import openai
import pytest

from mmserve.entrypoints.completion_store import CompletionStore
from tests.conftest import make_image, openai_app
from tests.test_server import data_url

IMAGE = data_url(make_image(2, (40, 30)))


@pytest.fixture(scope="module")
def served(clip_llama: str):
    with openai_app(clip_llama, max_model_len=512) as app:
        yield app


def _chat(client: openai.OpenAI, text: str, **kwargs):
    return client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=6,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": IMAGE}},
                                               {"type": "text", "text": text}]}], **kwargs)


def test_a_stored_completion_is_retrieved_listed_updated_and_deleted(served) -> None:
    _, _, client = served
    answer = _chat(client, "what is it?", store=True, metadata={"run": "a", "user": "x"})
    stored = client.chat.completions.retrieve(answer.id)
    assert stored.choices[0].message.content == answer.choices[0].message.content
    assert stored.usage == answer.usage and stored.metadata == {"run": "a", "user": "x"}

    messages = client.chat.completions.messages.list(answer.id)
    assert [m.id for m in messages.data] == [f"{answer.id}-0", f"{answer.id}-1"]
    assert messages.data[0].content == "Be brief." and messages.data[0].content_parts is None
    parts = messages.data[1].content_parts
    assert messages.data[1].content == "what is it?"
    assert [p.type for p in parts] == ["image_url", "text"] and parts[0].image_url.url == IMAGE
    newest = client.chat.completions.messages.list(answer.id, order="desc", limit=1)
    assert [m.id for m in newest.data] == [f"{answer.id}-1"] and newest.has_more

    other = _chat(client, "and now?", store=True, metadata={"run": "b"})
    listed = [c.id for c in client.chat.completions.list(metadata={"run": "a"})]
    assert answer.id in listed and other.id not in listed
    assert client.chat.completions.list(model="another").data == []
    updated = client.chat.completions.update(answer.id, metadata={"run": "c"})
    assert updated.metadata == {"run": "c"}
    assert answer.id in [c.id for c in client.chat.completions.list(metadata={"run": "c"})]

    deleted = client.chat.completions.delete(answer.id)
    assert deleted.deleted and deleted.id == answer.id
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(answer.id)
    assert answer.id not in [c.id for c in client.chat.completions.list(limit=100)]


def test_a_streamed_answer_is_stored_whole_and_unstored_ones_are_not(served,
                                                                    monkeypatch) -> None:
    from types import SimpleNamespace

    from mmserve.entrypoints import openai_shapes

    _, _, client = served
    # A body made at the end would say 0: the stored one keeps the stream's ``created``.
    monkeypatch.setattr(openai_shapes, "time", SimpleNamespace(time=lambda: 0.0))
    chunks = list(_chat(client, "tell me", store=True, stream=True, n=2))
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    stored = client.chat.completions.retrieve(chunks[0].id)
    assert [c.message.content for c in stored.choices] == texts
    assert stored.usage.completion_tokens > 0 and stored.created == chunks[0].created > 0

    unstored = _chat(client, "not kept")
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.retrieve(unstored.id)
    assert "'store': true" in e.value.body["message"]


def test_pages_go_on_after_the_last_id(served) -> None:
    _, _, client = served
    ids = [_chat(client, f"page {i}", store=True, metadata={"pages": "yes"}).id
           for i in range(3)]
    first = client.chat.completions.list(metadata={"pages": "yes"}, limit=2)
    assert [c.id for c in first.data] == ids[:2] and first.has_more
    rest = client.chat.completions.list(metadata={"pages": "yes"}, limit=2, after=ids[1])
    assert [c.id for c in rest.data] == ids[2:] and not rest.has_more
    newest = client.chat.completions.list(metadata={"pages": "yes"}, order="desc", limit=1)
    assert [c.id for c in newest.data] == [ids[2]]
    assert [c.id for c in client.chat.completions.list(metadata={"pages": "yes"})] == ids


def test_an_id_sent_twice_stores_two_completions(served) -> None:
    """A client's ``X-Request-Id`` names its stored completion, unless a stored one, or
    one being answered (sent at the same time), has it: then the answer's id is its own."""
    llm, http, _ = served
    store = llm.server.stored_completions.store
    body = {"model": "tiny", "max_tokens": 2, "store": True,
            "messages": [{"role": "user", "content": "hi"}]}
    ids = [http.post("/v1/chat/completions", json=body,
                     headers={"X-Request-Id": "mine"}).json()["id"] for _ in range(2)]
    assert ids[0] == "chatcmpl-mine" and ids[1] != ids[0]
    assert store.reserve("chatcmpl-twin")  # (as a request sent just before does)
    for stream in (False, True):
        answer = http.post("/v1/chat/completions", json={**body, "stream": stream},
                           headers={"X-Request-Id": "twin"})
        ids.append(answer.json()["id"] if not stream else
                   json.loads(answer.text.split("\n")[0][len("data: "):])["id"])
    store.unreserve("chatcmpl-twin")
    assert "chatcmpl-twin" not in ids[2:] and len(set(ids)) == 4
    for completion_id in ids:
        assert http.get(f"/v1/chat/completions/{completion_id}").status_code == 200
    assert not store._answering  # (every answer's id let go)


def test_stored_messages_take_openai_shapes(served) -> None:
    """An image sent as vLLM's bare-string ``image_url`` is listed in OpenAI's shape."""
    _, http, client = served
    answer = http.post("/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 2, "store": True, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": IMAGE},
                                         {"type": "text", "text": "one"},
                                         {"type": "text", "text": "two"}]}]}).json()
    (message,) = client.chat.completions.messages.list(answer["id"]).data
    assert message.content == "one\ntwo"
    assert message.content_parts[0].image_url.url == IMAGE


@pytest.mark.parametrize("field, value", [("store", "yes"), ("metadata", {"k": 5}),
                                          ("metadata", {f"k{i}": "v" for i in range(17)})])
def test_bad_fields_are_named(served, field: str, value) -> None:
    _, http, _ = served
    resp = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], field: value})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text


def test_the_oldest_are_forgotten_to_make_room() -> None:
    store = CompletionStore(max_bytes=700)
    message = {"role": "user", "content": "x" * 100}

    def body(i: int) -> dict:
        return {"id": f"chatcmpl-{i}", "model": "m", "metadata": {}, "choices": []}

    assert store.put(body(0), [message]) and store.put(body(1), [message])
    assert store.get("chatcmpl-0") is not None  # (read: still the oldest)
    assert store.put(body(2), [message, message])
    assert "chatcmpl-0" not in store and "chatcmpl-1" in store and "chatcmpl-2" in store
    assert store.nbytes == sum(store.get(i).nbytes for i in ("chatcmpl-1", "chatcmpl-2"))
    kept = len(store)
    assert not store.put(body(3), [{"role": "user", "content": "y" * 800}])
    assert len(store) == kept  # (none forgotten for what could not fit anyway)
    assert not store.put(body(1), [message])  # (its id is kept already)
    assert not store.update(store.get("chatcmpl-1"), {"k": "z" * 500})
    assert store.get("chatcmpl-1").body["metadata"] == {}


def test_without_a_store_the_endpoints_say_how_to_have_one(clip_llama: str) -> None:
    with openai_app(clip_llama, server={"responses_store_bytes": 0}, max_model_len=256) as app:
        _, http, _ = app
        answer = http.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 2, "store": True,
            "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200  # (answered, not kept)
        resp = http.get(f"/v1/chat/completions/{answer.json()['id']}")
        assert resp.status_code == 404 and "--responses-store-mib" in resp.text
        assert http.get("/v1/chat/completions").json()["error"]["code"] == (
            "stored_completions_disabled")
