"""OpenAI's Files and Batch APIs through the openai client: an uploaded file of requests is
answered line by line as the server answers each request (chat with images, embeddings), the
200s in the output file and the rest in the error file, counted and summed as OpenAI's batch
object says; a file with bad lines fails whole before anything runs; a batch cancelled or
expired mid-run keeps what it answered, writes the lines it did not answer to its error file
and leaves no request behind; the store's bytes are
bounded; every refusal names what to change."""

from __future__ import annotations

import io
import json
import os
import time

import openai
import pytest

from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.batch_api import BATCH_PRIORITY
from mmserve.entrypoints.serve_args import ServerConfig
from tests.conftest import load_benchmark, make_image, openai_app, slow_down_steps
from tests.test_run_batch import _line, _without_ids
from tests.test_server import data_url, image_message

IMAGES = [data_url(make_image(seed, (40 + 8 * seed, 36))) for seed in range(3)]


@pytest.fixture(scope="module")
def served(clip_llama: str):
    with openai_app(clip_llama, max_model_len=512, max_num_seqs=8) as app:
        yield app


@pytest.fixture
def slow_steps(served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of at least 20 ms: a line of 60 tokens takes over a second on any machine."""
    slow_down_steps(served[0].engine, 0.02, monkeypatch)


def _wait(client: openai.OpenAI, batch_id: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} did not finish in {timeout} s: {batch}")


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def _upload(client: openai.OpenAI, lines: list[bytes]):
    return client.files.create(file=("requests.jsonl", b"".join(lines)), purpose="batch")


def _drained(engine, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not engine.has_unfinished_requests()


def test_a_batch_answers_each_line_as_the_server_does(served) -> None:
    llm, http, client = served
    chats = [(f"chat-{i}", {"model": "tiny", "max_tokens": 12 - i, "temperature": 0,
                            "messages": image_message(f"describe {i}", IMAGES[i % 3])})
             for i in range(5)]
    refused = [("other-model", {"model": "other", "max_tokens": 4,
                                "messages": [{"role": "user", "content": "hi"}]}),
               ("bad-tokens", {"max_tokens": -1,
                               "messages": [{"role": "user", "content": "hi"}]})]
    requests = [*chats[:2], refused[0], *chats[2:], refused[1]]
    data = [_line(cid, "/v1/chat/completions", body) for cid, body in requests]
    uploaded = _upload(client, data)
    assert (uploaded.purpose, uploaded.filename, uploaded.bytes) == (
        "batch", "requests.jsonl", len(b"".join(data)))
    assert client.files.retrieve(uploaded.id).bytes == uploaded.bytes
    assert uploaded.expires_at == uploaded.created_at + 30 * 24 * 3600  # OpenAI's default
    assert client.files.content(uploaded.id).content == b"".join(data)

    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "captions"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {
        "job": "captions"}
    batch = _wait(client, batch.id)
    assert batch.status == "completed" and batch.errors is None, batch
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (7, 5, 2)
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    assert batch.expires_at == batch.created_at + 24 * 3600 and batch.model == "tiny"

    output = _lines(client, batch.output_file_id)
    assert [line["custom_id"] for line in output] == [cid for cid, _ in chats]
    for line, (_, body) in zip(output, chats, strict=True):
        assert line["error"] is None and line["response"]["status_code"] == 200
        expected = http.post("/v1/chat/completions", json=body)
        assert _without_ids(line["response"]["body"]) == _without_ids(expected.json())
    errors = _lines(client, batch.error_file_id)
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [
        ("other-model", 404), ("bad-tokens", 400)]
    assert errors[1]["response"]["body"]["error"]["param"] == "max_tokens"

    usages = [line["response"]["body"]["usage"] for line in output]
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in usages) > 0
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in usages) > 0
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens

    outputs = client.files.list(purpose="batch_output").data
    assert {f.id for f in outputs} >= {batch.output_file_id, batch.error_file_id}
    assert client.files.retrieve(batch.output_file_id).filename == f"{batch.id}_output.jsonl"
    assert any(b.id == batch.id for b in client.batches.list().data)
    assert client.files.delete(batch.output_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(batch.output_file_id)
    with pytest.raises(openai.ConflictError, match="completed already"):
        client.batches.cancel(batch.id)
    assert _drained(llm.engine)


def test_an_embeddings_batch_gives_the_endpoints_vectors(served) -> None:
    _, http, client = served
    bodies = [{"input": text, "encoding_format": "base64"}
              for text in ("the red fox", "once upon a time", "a cat")]
    uploaded = _upload(client, [_line(f"e{i}", "/v1/embeddings", body)
                                for i, body in enumerate(bodies)])
    batch = _wait(client, client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h").id)
    assert batch.status == "completed" and batch.error_file_id is None
    for line, body in zip(_lines(client, batch.output_file_id), bodies, strict=True):
        expected = http.post("/v1/embeddings", json=body).json()
        assert line["response"]["body"]["data"] == expected["data"]


def test_a_file_with_bad_lines_fails_before_anything_runs(served) -> None:
    llm, _, client = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    lines = [_line("a", "/v1/chat/completions", body),
             _line("b", "/v1/completions", {"prompt": "hi"}),
             b"not json\n",
             _line("a", "/v1/chat/completions", body),
             _line("c", "/v1/chat/completions", {**body, "stream": True}),
             _line("d", "/v1/chat/completions", {**body, "background": True}),
             _line("x" * 5000, "/v1/chat/completions", body),
             _line("e", "x" * 5000, body)]
    steps = llm.engine.stats()["num_steps"]
    batch = _wait(client, client.batches.create(
        input_file_id=_upload(client, lines).id, endpoint="/v1/chat/completions",
        completion_window="24h").id)
    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e.line, e.code, e.param) for e in batch.errors.data] == [
        (2, "mismatched_url", "url"), (3, "invalid_json_line", None),
        (4, "duplicate_custom_id", None), (5, "invalid_request", "body.stream"),
        (6, "invalid_request", "body.background"), (7, "invalid_custom_id", None),
        (8, "invalid_url", None)]
    assert "/v1/completions" in batch.errors.data[0].message
    assert max(len(e.message) for e in batch.errors.data) < 300  # no field echoed whole
    assert batch.output_file_id is None and batch.error_file_id is None
    assert batch.request_counts.completed == batch.request_counts.failed == 0
    assert llm.engine.stats()["num_steps"] == steps  # nothing ran
    empty = _wait(client, client.batches.create(
        input_file_id=_upload(client, [b"\n"]).id, endpoint="/v1/chat/completions",
        completion_window="24h").id)
    assert [e.code for e in empty.errors.data] == ["empty_file"]


def _long_lines(count: int, tokens: int = 60) -> list[bytes]:
    return [_line(f"long-{i}", "/v1/chat/completions", {
        "messages": image_message(f"tell {i}", IMAGES[i % 3]), "max_tokens": tokens,
        "min_tokens": tokens, "temperature": 0}) for i in range(count)]


def test_a_cancelled_batch_keeps_its_answers_and_leaves_no_request(served,
                                                                    slow_steps) -> None:
    llm, http, client = served
    batch = client.batches.create(input_file_id=_upload(client, _long_lines(12)).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    deadline, peak = time.monotonic() + 60, 0
    while client.batches.retrieve(batch.id).request_counts.completed < 1:
        assert time.monotonic() < deadline
        peak = max(peak, llm.engine.stats()["num_running"])
        time.sleep(0.02)
    # Half the engine's 8 seats: a client's request runs beside the batch's.
    assert peak == 4
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    batch = _wait(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    answered = _lines(client, batch.output_file_id)
    assert 1 <= len(answered) == batch.request_counts.completed < 12
    assert all(line["response"]["status_code"] == 200 for line in answered)
    _assert_left_with(client, batch, "batch_cancelled", 12)
    assert _drained(llm.engine)


def _assert_left_with(client: openai.OpenAI, batch, code: str, total: int) -> None:
    """Each line the batch did not answer is in its error file with ``code``: every line is
    in one of its files once, and the counts add up."""
    answered = _lines(client, batch.output_file_id)
    left = _lines(client, batch.error_file_id)
    assert left and all(line["error"]["code"] == code and line["response"] is None
                        for line in left)
    assert sorted(line["custom_id"] for line in answered + left) == sorted(
        f"long-{i}" for i in range(total))
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (total, len(answered), len(left))


def test_a_batch_past_its_window_expires_with_what_it_answered(served, slow_steps,
                                                                monkeypatch) -> None:
    llm, _, client = served
    monkeypatch.setattr(llm.server.batch_api, "completion_window_s", 2.0)
    batch = _wait(client, client.batches.create(
        input_file_id=_upload(client, _long_lines(16)).id,
        endpoint="/v1/chat/completions", completion_window="24h").id)
    assert batch.status == "expired" and batch.expired_at is not None
    assert len(_lines(client, batch.output_file_id)) == batch.request_counts.completed < 16
    _assert_left_with(client, batch, "batch_expired", 16)
    assert _drained(llm.engine)


def test_the_store_is_bounded(served, monkeypatch) -> None:
    llm, _, client = served
    store = llm.server.batch_api.store
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "min_tokens": 8, "temperature": 0}
    data = [_line(f"r{i}", "/v1/chat/completions", body) for i in range(6)]
    before = store.used
    monkeypatch.setattr(store, "capacity", store.used + len(b"".join(data)) + 3000)
    with pytest.raises(openai.APIStatusError, match="file store") as refused:
        client.files.create(file=("big.jsonl", b"x" * (store.room + 1)), purpose="batch")
    assert refused.value.status_code == 413
    uploaded = _upload(client, data)
    # Room for a line or two of answers (about 1 KB each), not six.
    batch = _wait(client, client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions",
        completion_window="24h").id)
    assert batch.status == "failed" and batch.errors.data[0].code == "file_store_full"
    assert 1 <= batch.request_counts.completed < 6
    assert len(_lines(client, batch.output_file_id)) == batch.request_counts.completed
    assert store.used <= store.capacity
    client.files.delete(batch.output_file_id)
    assert store.used == before + len(b"".join(data))  # the input's bytes only
    # A file whose time has come is forgotten, and its bytes with it.
    short = client.files.create(file=("short.jsonl", b"{}\n"), purpose="batch",
                                expires_after={"anchor": "created_at", "seconds": 3600})
    assert short.expires_at == short.created_at + 3600
    used = store.used
    store.files[short.id].expires_at = store.files[uploaded.id].expires_at = int(time.time())
    monkeypatch.setattr(store, "_swept", 0.0)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(short.id)
    assert store.used == used - 3 - len(b"".join(data))
    assert _drained(llm.engine)


def test_refusals_say_what_to_change(served) -> None:
    _, http, client = served
    uploaded = _upload(client, [_line("a", "/v1/chat/completions", {"messages": []})])

    def refused(call, status: int, param: str | None, words: str) -> None:
        with pytest.raises(openai.APIStatusError) as e:
            call()
        assert e.value.status_code == status, e.value
        error = e.value.body
        assert error["param"] == param and words in error["message"], error

    create = client.batches.create
    refused(lambda: client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune"),
            400, "purpose", "'batch'")
    refused(lambda: client.files.create(file=("a.jsonl", b"{}\n"), purpose="batch",
                                        expires_after={"anchor": "created_at",
                                                       "seconds": 10}),
            400, "expires_after", "3600")
    refused(lambda: create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                           completion_window="24h"), 404, "input_file_id", "no file")
    refused(lambda: create(input_file_id=uploaded.id, endpoint="/v1/moderations",
                           completion_window="24h"), 400, "endpoint", "/v1/embeddings")
    refused(lambda: create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                           completion_window="48h"), 400, "completion_window", "24h")
    refused(lambda: create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                           completion_window="24h", metadata={str(i): "v" for i in range(17)}),
            400, "metadata", "16 keys")
    refused(lambda: client.batches.retrieve("batch_nope"), 404, "batch_id", "no batch")
    refused(lambda: client.files.list(limit=0), 400, "limit", "from 1")
    as_json = http.post("/v1/files", json={"purpose": "batch"})
    assert as_json.status_code == 400 and "multipart" in as_json.json()["error"]["message"]
    done = _wait(client, create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                completion_window="24h").id)
    refused(lambda: create(input_file_id=done.error_file_id, endpoint="/v1/chat/completions",
                           completion_window="24h"), 400, "input_file_id", "purpose 'batch'")
    assert client.files.delete(uploaded.id).deleted


def test_batches_run_in_turn_and_an_input_deleted_mid_run_is_read_to_its_end(
        served, slow_steps) -> None:
    llm, _, client = served
    first_file = _upload(client, _long_lines(6, tokens=20))
    second_file = _upload(client, _long_lines(2, tokens=4))
    first = client.batches.create(input_file_id=first_file.id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    second = client.batches.create(input_file_id=second_file.id,
                                   endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while client.batches.retrieve(first.id).status == "validating":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert client.files.delete(first_file.id).deleted  # while the first runs
    assert client.batches.retrieve(second.id).status == "validating"  # its turn is next
    first, second = _wait(client, first.id), _wait(client, second.id)
    assert (first.status, first.request_counts.completed) == ("completed", 6)
    assert (second.status, second.request_counts.completed) == ("completed", 2)
    assert second.in_progress_at >= first.completed_at
    # An input deleted before its batch's turn fails it.
    third_file = _upload(client, _long_lines(2, tokens=4))
    blocker = client.batches.create(input_file_id=second_file.id,
                                    endpoint="/v1/chat/completions", completion_window="24h")
    third = client.batches.create(input_file_id=third_file.id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    client.files.delete(third_file.id)
    third = _wait(client, third.id)
    assert third.status == "failed" and third.errors.data[0].code == "input_file_deleted"
    assert _wait(client, blocker.id).status == "completed"
    assert _drained(llm.engine)


def test_a_batchs_responses_are_stored_only_where_a_line_asks(served) -> None:
    _, http, client = served
    body = {"input": "hi", "max_output_tokens": 3}
    batch = _wait(client, client.batches.create(
        input_file_id=_upload(client, [_line("plain", "/v1/responses", body),
                                       _line("kept", "/v1/responses",
                                             {**body, "store": True})]).id,
        endpoint="/v1/responses", completion_window="24h").id)
    plain, kept = (line["response"]["body"] for line in _lines(client, batch.output_file_id))
    assert (plain["store"], kept["store"]) == (False, True)
    assert http.get(f"/v1/responses/{plain['id']}").status_code == 404
    assert http.get(f"/v1/responses/{kept['id']}").status_code == 200


def test_a_server_stopping_mid_batch_leaves_no_request(clip_llama: str, monkeypatch) -> None:
    with openai_app(clip_llama, max_model_len=512) as served:
        llm, _, client = served
        slow_down_steps(llm.engine, 0.02, monkeypatch)
        batch = client.batches.create(input_file_id=_upload(client, _long_lines(4)).id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while llm.engine.stats()["num_running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        folder = llm.server.batch_api.store.folder
    # (openai_app checks for leaks once the server's loop has stopped)
    assert llm.server.batch_api.batches[batch.id].status == "cancelled"
    assert not os.path.exists(folder)


def test_under_priority_scheduling_a_batchs_lines_run_last(clip_llama: str,
                                                          monkeypatch) -> None:
    """``--scheduling-policy priority``: a batch's lines that name no priority get the lowest
    (after clients' requests of any priority, preempted first); a line's own is kept, and a
    client's request keeps the default."""
    with openai_app(clip_llama, max_model_len=512, scheduling_policy="priority") as served:
        llm, http, client = served
        engine, seen = llm.server.engine, []
        add = engine.add_completions

        async def recorded(request_ids, prompt, params):
            seen.append(params.priority)
            return await add(request_ids, prompt, params)

        monkeypatch.setattr(engine, "add_completions", recorded)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        beams = {**body, "use_beam_search": True, "n": 2, "temperature": 0}
        batch = _wait(client, client.batches.create(
            input_file_id=_upload(client, [_line("a", "/v1/chat/completions", body),
                                           _line("b", "/v1/chat/completions",
                                                 {**body, "priority": 5}),
                                           _line("c", "/v1/chat/completions", beams)]).id,
            endpoint="/v1/chat/completions", completion_window="24h").id)
        # (a beam search's rounds run at priority 0: its line keeps that)
        assert batch.status == "completed" and batch.request_counts.completed == 3, batch
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        assert sorted(seen[:2]) == [5, BATCH_PRIORITY] and seen[2:] == [0]


def test_lines_pass_the_servers_api_key(clip_llama: str) -> None:
    with openai_app(clip_llama, server={"api_key": "sekret"}, max_model_len=512) as served:
        _, http, client = served
        assert http.get("/v1/files").status_code == 401
        uploaded = _upload(client, [_line("a", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})])
        batch = _wait(client, client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions",
            completion_window="24h").id)
        assert batch.status == "completed" and batch.request_counts.completed == 1, batch


def test_without_a_store_the_endpoints_say_how_to_have_one(served) -> None:
    from starlette.testclient import TestClient

    llm = served[0]
    app = OpenAIServer(llm.engine, ServerConfig("tiny", files_store_bytes=0)).app()
    http = TestClient(app)  # (no lifespan: these answers need no engine loop)
    for method, path in (("GET", "/v1/files"), ("POST", "/v1/batches"),
                         ("GET", "/v1/batches/batch_x")):
        answer = http.request(method, path)
        assert answer.status_code == 404
        assert "--files-store-mib" in answer.json()["error"]["message"]


@pytest.mark.slow
def test_through_a_socket_with_the_openai_client(clip_llama: str, tmp_path) -> None:
    """``mmserve serve``: an upload over HTTP, a batch, its answers downloaded; on SIGTERM
    the files' folder goes with the process."""
    from tests.test_server import Server

    folder = tmp_path / "tmp"
    folder.mkdir()
    server = Server(clip_llama, "--served-model-name", "tiny", "--max-model-len", "256",
                    "--api-key", "sekret", "--files-store-mib", "1", log=tmp_path / "log",
                    env={"TMPDIR": str(folder)})
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekret", max_retries=0)
        body = {"messages": image_message("describe", IMAGES[0]), "max_tokens": 6,
                "temperature": 0}
        uploaded = _upload(client, [_line("one", "/v1/chat/completions", body)])
        assert [p.name for p in folder.iterdir()][0].startswith("mmserve-files-")
        batch = _wait(client, client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions",
            completion_window="24h").id)
        assert batch.status == "completed", batch
        [line] = _lines(client, batch.output_file_id)
        direct = client.chat.completions.create(model="tiny", **body)
        assert line["response"]["body"]["choices"][0]["message"]["content"] == (
            direct.choices[0].message.content)
        with pytest.raises(openai.APIStatusError) as e:
            _upload(client, [b"x" * (1 << 20)])
        assert e.value.status_code == 413
    finally:
        assert server.stop() == 0
    assert not any(p.name.startswith("mmserve-files-") for p in folder.iterdir())


def test_requests_name_uploaded_images_by_file_id(served) -> None:
    """An image uploaded with purpose "vision" is the same image to a request that names it
    (a Responses API input_image's file_id, a chat file part) as its data: URL."""
    _, http, client = served
    image = make_image(7, (44, 40))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    uploaded = client.files.create(file=("cat.png", buf.getvalue()), purpose="vision")
    assert uploaded.purpose == "vision"

    def response(image_part: dict) -> dict:
        answer = http.post("/v1/responses", json={
            "input": [{"role": "user", "content": [
                image_part, {"type": "input_text", "text": "what is it"}]}],
            "max_output_tokens": 8, "temperature": 0, "store": False})
        assert answer.status_code == 200, answer.text
        return answer.json()

    by_file = response({"type": "input_image", "file_id": uploaded.id})
    by_url = response({"type": "input_image", "image_url": data_url(image)})
    assert by_file["output"][0]["content"][0]["text"] == (
        by_url["output"][0]["content"][0]["text"])
    other = response({"type": "input_image", "image_url": data_url(make_image(8, (44, 40)))})
    assert other["output"][0]["content"][0]["text"] != by_file["output"][0]["content"][0]["text"]
    text_only = response({"type": "input_text", "text": ""})
    assert by_file["usage"]["input_tokens"] == by_url["usage"]["input_tokens"] > (
        text_only["usage"]["input_tokens"])  # the image is in the prompt

    def chat(part: dict) -> dict:
        return http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}],
            "max_tokens": 8, "temperature": 0})

    by_file = chat({"type": "file", "file": {"file_id": uploaded.id}}).json()
    by_url = chat({"type": "image_url", "image_url": {"url": data_url(image)}}).json()
    assert by_file["choices"][0]["message"] == by_url["choices"][0]["message"]
    assert by_file["usage"] == by_url["usage"]

    as_user_data = client.files.create(file=("cat.png", buf.getvalue()), purpose="user_data")
    assert chat({"type": "file", "file": {"file_id": as_user_data.id}}).json()["choices"] == (
        by_url["choices"])

    jsonl = _upload(client, [b"{}\n"])
    text = client.files.create(file=("notes.txt", b"not an image"), purpose="vision")
    for part, words in (({"type": "file", "file": {"file_id": "file-nope"}}, "no file has"),
                        ({"type": "file", "file": {"file_id": "f" * 10_000}}, "no file has"),
                        ({"type": "file", "file": {"file_data": "aGk="}}, "file_id"),
                        ({"type": "file", "file": {"file_id": jsonl.id}}, "purpose 'batch'"),
                        ({"type": "file", "file": {"file_id": text.id}}, "not a PNG")):
        refused = chat(part)
        assert refused.status_code == 400 and words in refused.json()["error"]["message"], (
            refused.text)
        assert len(refused.json()["error"]["message"]) < 400
    for part, param in (({"type": "input_image"}, "input[0].content[0]"),
                        ({"type": "input_image", "file_id": uploaded.id,
                          "image_url": data_url(image)}, "input[0].content[0]"),
                        ({"type": "input_image", "file_id": 123},
                         "input[0].content[0].file_id")):
        refused = http.post("/v1/responses", json={"input": [{"role": "user",
                                                              "content": [part]}]})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (
            refused.text)
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    client.files.delete(uploaded.id)
    refused = chat({"type": "file", "file": {"file_id": uploaded.id}})
    assert refused.status_code == 400 and "no file has" in refused.json()["error"]["message"]


def test_an_upload_holds_its_room_while_it_arrives(served, monkeypatch) -> None:
    """A body of unknown length (chunked) holds the bytes it has sent so far, not the whole
    store; one that outgrows the room is a 413; either way the hold is given back."""
    llm, http, client = served
    store = llm.server.batch_api.store
    before = store.used
    monkeypatch.setattr(store, "capacity", before + 200_000)
    seen: list[int] = []

    def upload(size: int):
        boundary = "b0undary"
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
                f"batch\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                f"filename=\"a.jsonl\"\r\nContent-Type: application/octet-stream\r\n\r\n")

        def chunks():  # (a generator: sent chunked, with no Content-Length)
            yield head.encode()
            for _ in range(size // 10_000):
                seen.append(store.used)
                yield b"x" * 10_000
            yield f"\r\n--{boundary}--\r\n".encode()

        return http.post("/v1/files", content=chunks(),
                         headers={"content-type": f"multipart/form-data; boundary={boundary}"})

    small = upload(50_000)
    assert small.status_code == 200, small.text
    assert max(seen) < before + 100_000  # what had arrived, not the store's 200 KB
    assert store.used == before + 50_000
    too_big = upload(300_000)
    assert too_big.status_code == 413, too_big.text
    assert store.used == before + 50_000
    client.files.delete(small.json()["id"])
    assert store.used == before


def test_a_batch_line_goes_only_while_nothing_waits_one_a_step() -> None:
    """``_admit``: with lines in flight, the next waits for a step after the last one went
    and for the engine's queue to be empty; with none in flight it goes at once."""
    import asyncio

    from mmserve.entrypoints.batch_api import BatchApi

    stats = {"num_steps": 10, "num_waiting": 0}
    api = BatchApi(1, model="m", max_body_bytes=1024, seats=4, body_timeout_s=1.0,
                   api_key=None, read_json=None, broken=lambda: None,
                   engine_stats=lambda: dict(stats))

    async def scenario() -> list[str]:
        seen: list[str] = []
        await api._admit(0)  # nothing in flight: at once
        seen.append("first")
        second = asyncio.create_task(api._admit(1))
        await asyncio.sleep(0.05)
        seen.append(f"second before a step: {second.done()}")
        stats.update(num_steps=11, num_waiting=2)  # a step, but clients' requests wait
        await asyncio.sleep(0.05)
        seen.append(f"second while requests wait: {second.done()}")
        stats.update(num_waiting=0)
        await asyncio.wait_for(second, 1.0)
        seen.append("second")
        third = asyncio.create_task(api._admit(2))
        await asyncio.sleep(0.05)
        seen.append(f"third in the same step: {third.done()}")
        third.cancel()
        return seen

    assert asyncio.run(scenario()) == [
        "first", "second before a step: False", "second while requests wait: False",
        "second", "third in the same step: False"]


@pytest.mark.slow
def test_the_batch_benchmark_runs(clip_llama: str, capsys) -> None:
    """``benchmarks/batch_api.py`` at a tiny scale: its three runs report (the figures are
    not checked: they depend on the machine)."""
    assert load_benchmark("batch_api").main([
        "--model", clip_llama, "--lines", "3", "--max-tokens", "4", "--clients", "1",
        "--requests", "2", "--image-size", "40", "--serve-args", "--max-model-len 512"]) == 0
    rows = capsys.readouterr().out.splitlines()[-3:]
    assert [row.split()[0] for row in rows] == ["alone", "batch", "flood"]
    assert all(float(row.split()[1]) > 0 for row in rows)
    assert rows[0].split()[3] == "-" and float(rows[1].split()[3]) > 0


def test_a_broken_engine_lets_the_lines_go_to_be_refused() -> None:
    """Once the engine is broken its counters stop (a client's request may look waiting for
    ever): ``_admit`` lets the line go, to be refused, rather than hold the batch."""
    import asyncio

    from mmserve.entrypoints.batch_api import BatchApi

    broken: list[BaseException] = []
    api = BatchApi(1, model="m", max_body_bytes=1024, seats=4, body_timeout_s=1.0,
                   api_key=None, read_json=None, broken=lambda: broken[0] if broken else None,
                   engine_stats=lambda: {"num_steps": 3, "num_waiting": 2})

    async def scenario() -> bool:
        waiting = asyncio.create_task(api._admit(1))
        await asyncio.sleep(0.05)
        held = not waiting.done()
        broken.append(RuntimeError("the engine stopped"))
        await asyncio.wait_for(waiting, 1.0)
        return held

    assert asyncio.run(scenario())


def test_the_file_count_counts_the_outputs_of_batches_to_come(served, monkeypatch) -> None:
    from mmserve.entrypoints import files_api

    llm, _, client = served
    store = llm.server.batch_api.store
    uploaded = _upload(client, [_line("a", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})])
    monkeypatch.setattr(files_api, "MAX_FILES", len(store.files) + 1)
    with pytest.raises(openai.ConflictError, match="at most"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                              completion_window="24h")  # (its two outputs would not fit)
    monkeypatch.setattr(files_api, "MAX_FILES", len(store.files))
    with pytest.raises(openai.ConflictError, match="at most"):
        _upload(client, [b"{}\n"])
    monkeypatch.setattr(files_api, "MAX_FILES", len(store.files) + 2)
    batch = _wait(client, client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions",
        completion_window="24h").id)
    assert batch.status == "completed" and len(store.files) <= files_api.MAX_FILES


def test_an_engine_that_dies_mid_batch_fails_it_with_what_it_answered() -> None:
    """The engine stops by itself while a batch runs: the lines answered before are kept, the
    rest are refused or never sent, and the batch fails saying why (``engine_stopped``)."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from tests.test_server_async_engine import FakeEngine

    fake = FakeEngine(crash_at_step=25)
    fake.config = SimpleNamespace(max_num_seqs=4, max_model_len=64, limit_mm_per_prompt=1,
                                  max_image_pixels=1 << 20, model="", generation_config="vllm",
                                  scheduling_policy="fcfs")
    server = OpenAIServer(fake, ServerConfig("fake"))
    server.http_server = SimpleNamespace(should_exit=False)  # (told to exit: nothing here)
    with TestClient(server.app()) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                               max_retries=0, http_client=http)
        lines = [_line(f"l{i}", "/v1/completions", {"model": "fake", "prompt": "hi",
                                                    "max_tokens": 5}) for i in range(16)]
        batch = _wait(client, client.batches.create(
            input_file_id=_upload(client, lines).id, endpoint="/v1/completions",
            completion_window="24h").id)
        assert batch.status == "failed" and batch.errors.data[0].code == "engine_stopped"
        assert "boom" in batch.errors.data[0].message
        answered = _lines(client, batch.output_file_id)
        refused = _lines(client, batch.error_file_id)
        assert answered and all(line["response"]["status_code"] == 200 for line in answered)
        assert (batch.request_counts.completed, batch.request_counts.failed) == (
            len(answered), len(refused))
        # Two lines at a time, five steps each: at most 12 sent by step 25, and none after.
        assert len(answered) + len(refused) <= 12
        assert len({line["custom_id"] for line in answered + refused}) == len(answered + refused)
