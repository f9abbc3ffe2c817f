"""OpenAI's Uploads API through the openai client: a file sent in parts (the client's
``upload_file_chunked``) becomes a file of the Files API with the same bytes; the parts are
checked (size, count, order, checksum); a cancelled or expired upload gives its room in the
file store back and leaves no part behind."""

from __future__ import annotations

import hashlib
import json
import os
import time

import openai
import pytest

from mmserve.entrypoints import uploads_api
from tests.conftest import openai_app

LINES = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                             "body": {"prompt": "hi", "max_tokens": 2}}).encode() + b"\n"
                 for i in range(40))


@pytest.fixture(scope="module")
def served(clip_llama: str):
    with openai_app(clip_llama, max_model_len=256) as app:
        yield app


def _store(served):
    return served[0].server.batch_api.files.store


def _parts_on_disk(served) -> list[str]:
    return [name for name in os.listdir(_store(served).folder) if name.startswith("upload_")]


def test_a_file_sent_in_parts_is_the_file(served, tmp_path) -> None:
    _, _, client = served
    path = tmp_path / "requests.jsonl"
    path.write_bytes(LINES)
    used = _store(served).used
    upload = client.uploads.upload_file_chunked(file=path, mime_type="text/jsonl",
                                                purpose="batch", part_size=1000,
                                                md5=hashlib.md5(LINES).hexdigest())
    assert upload.status == "completed" and upload.bytes == len(LINES)
    assert upload.file.filename == "requests.jsonl" and upload.file.purpose == "batch"
    assert client.files.content(upload.file.id).content == LINES
    assert upload.file.id in [f.id for f in client.files.list()]
    assert _store(served).used == used + len(LINES) and not _parts_on_disk(served)
    # It runs as a batch's input as a file sent whole does.
    batch = client.batches.create(input_file_id=upload.file.id, endpoint="/v1/completions",
                                  completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    assert batch.request_counts.completed == 40
    client.files.delete(upload.file.id)


def test_parts_are_checked(served) -> None:
    _, http, client = served
    used = _store(served).used
    upload = client.uploads.create(bytes=10, filename="x.jsonl", mime_type="text/jsonl",
                                   purpose="batch")
    assert upload.status == "pending" and _store(served).used == used + 10
    first = client.uploads.parts.create(upload.id, data=b"01234")
    with pytest.raises(openai.APIStatusError) as e:  # (more than the upload's bytes)
        client.uploads.parts.create(upload.id, data=b"56789!")
    assert e.value.status_code == 413 and e.value.body["code"] == "part_too_large"
    second = client.uploads.parts.create(upload.id, data=b"56789")
    for part_ids, md5, param in (([first.id], None, "part_ids"),
                                 ([first.id, first.id], None, "part_ids"),
                                 ([first.id, "part_nope"], None, "part_ids"),
                                 ([second.id, first.id], hashlib.md5(b"0123456789").hexdigest(),
                                  "md5")):
        with pytest.raises(openai.BadRequestError) as e:
            client.uploads.complete(upload.id, part_ids=part_ids, md5=md5 or openai.omit)
        assert e.value.body["param"] == param
    done = client.uploads.complete(upload.id, part_ids=[second.id, first.id])
    assert client.files.content(done.file.id).content == b"5678901234"
    with pytest.raises(openai.NotFoundError):  # (it has ended)
        client.uploads.parts.create(upload.id, data=b"0")
    for body, param in (({"bytes": 0}, "bytes"), ({"bytes": 10**10}, "bytes"),
                        ({"purpose": "fine-tune"}, "purpose"), ({"filename": 5}, "filename"),
                        ({"mime_type": None}, "mime_type")):
        good = {"bytes": 10, "filename": "x", "mime_type": "text/plain", "purpose": "batch"}
        resp = http.post("/v1/uploads", json={**good, **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    client.files.delete(done.file.id)
    assert _store(served).used == used


def test_a_cancelled_or_expired_upload_leaves_nothing(served, monkeypatch) -> None:
    llm, _, client = served
    used = _store(served).used
    upload = client.uploads.create(bytes=8, filename="x.jsonl", mime_type="text/jsonl",
                                   purpose="batch")
    client.uploads.parts.create(upload.id, data=b"0123")
    assert _parts_on_disk(served)
    assert client.uploads.cancel(upload.id).status == "cancelled"
    assert _store(served).used == used and not _parts_on_disk(served)
    with pytest.raises(openai.NotFoundError):
        client.uploads.cancel(upload.id)

    monkeypatch.setattr(uploads_api, "UPLOAD_LIFE_S", 0.3)
    upload = client.uploads.create(bytes=8, filename="x.jsonl", mime_type="text/jsonl",
                                   purpose="batch")
    client.uploads.parts.create(upload.id, data=b"0123")
    time.sleep(0.6)
    with pytest.raises(openai.NotFoundError):
        client.uploads.parts.create(upload.id, data=b"4567")
    assert _store(served).used == used and not _parts_on_disk(served)
    assert not llm.server.uploads.uploads


def test_pending_uploads_are_bounded(served, monkeypatch) -> None:
    _, _, client = served
    monkeypatch.setattr(uploads_api, "MAX_PENDING_UPLOADS", 2)
    made = [client.uploads.create(bytes=4, filename="x", mime_type="text/plain",
                                  purpose="batch") for _ in range(2)]
    with pytest.raises(openai.APIStatusError) as e:
        client.uploads.create(bytes=4, filename="x", mime_type="text/plain", purpose="batch")
    assert e.value.status_code == 409 and e.value.body["code"] == "too_many_uploads"
    for upload in made:
        client.uploads.cancel(upload.id)




def test_parts_sent_at_once_stay_within_the_upload(served, monkeypatch) -> None:
    """Parts that arrive together may bring no more than the upload lacks, nor more parts
    than it takes; those past it are refused, and the rest make the file."""
    from concurrent.futures import ThreadPoolExecutor

    llm, _, client = served
    monkeypatch.setattr(uploads_api, "MAX_PARTS", 3)
    size = 4096  # (a part's form adds a few hundred bytes: parts much larger than that)
    upload = client.uploads.create(bytes=8 * size, filename="x.jsonl", mime_type="text/jsonl",
                                   purpose="batch")

    def send(i: int):
        try:
            return client.uploads.parts.create(upload.id, data=bytes([i]) * size)
        except openai.APIStatusError as e:
            return e.status_code

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, range(8)))
    parts = [a for a in answers if not isinstance(a, int)]
    assert 1 <= len(parts) <= 3 and all(a in (409, 413) for a in answers if isinstance(a, int))
    pending = llm.server.uploads.uploads[upload.id]
    assert len(pending.parts) == len(parts) and pending.received == size * len(parts)
    assert pending.arriving == pending.parts_arriving == 0
    client.uploads.cancel(upload.id)
    assert not _parts_on_disk(served)


def test_an_upload_holding_the_whole_store_takes_its_parts(clip_llama: str) -> None:
    with openai_app(clip_llama, server={"files_store_bytes": 1000},
                    max_model_len=256) as (llm, _, client):
        upload = client.uploads.create(bytes=1000, filename="x.jsonl", mime_type="text/jsonl",
                                       purpose="batch")
        parts = [client.uploads.parts.create(upload.id, data=bytes([i]) * 500)
                 for i in range(2)]
        with pytest.raises(openai.APIStatusError) as e:
            client.uploads.parts.create(upload.id, data=b"!")
        assert e.value.body["code"] == "part_too_large"
        with pytest.raises(openai.BadRequestError) as e:
            client.uploads.complete(upload.id, part_ids=[p.id for p in parts], md5="0" * 32)
        assert "right order" in e.value.body["message"]
        done = client.uploads.complete(upload.id, part_ids=[p.id for p in parts])
        assert done.file.bytes == 1000
        assert llm.server.batch_api.files.store.used == 1000


def test_parts_that_fill_the_upload_exactly_arrive_together(served) -> None:
    from concurrent.futures import ThreadPoolExecutor

    _, _, client = served
    size = 4096
    upload = client.uploads.create(bytes=3 * size, filename="x.jsonl",
                                   mime_type="text/jsonl", purpose="batch")
    with ThreadPoolExecutor(3) as pool:
        parts = list(pool.map(lambda i: client.uploads.parts.create(
            upload.id, data=bytes([i]) * size), range(3)))
    done = client.uploads.complete(upload.id, part_ids=[p.id for p in parts])
    assert done.status == "completed" and done.file.bytes == 3 * size
    client.files.delete(done.file.id)
