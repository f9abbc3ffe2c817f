"""``mmserve run-batch``: each line of an OpenAI batch file gets what the server answers for its
request (chat with images, completions, the Responses API), in the input's order; a line that
is no request gets an error of its own and the others go on; the lines held in memory stay
bounded; a broken engine stops the reading; the command reads and writes files or pipes."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys

import pytest
from starlette.testclient import TestClient

from mmserve import LLM
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.cli import main
from mmserve.entrypoints.run_batch import run_batch
from mmserve.entrypoints.serve_args import ServerConfig
from tests.conftest import assert_no_leaks, make_image
from tests.test_server import data_url, image_message

IMAGES = [data_url(make_image(seed, (40 + 8 * seed, 36))) for seed in range(3)]


def _line(custom_id: str, url: str, body: dict) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": body}).encode() + b"\n"


def _requests() -> list[tuple[str, str, dict]]:
    """Requests of every endpoint, long ones first so that later ones finish before them."""
    chat = [(f"chat-{i}", "/v1/chat/completions", {
        "model": "tiny", "messages": image_message(f"describe {i}", IMAGES[i % 3]),
        "max_tokens": 24 - 2 * i, "temperature": 0}) for i in range(6)]
    return [*chat,
            ("cmpl-n", "/v1/completions", {"prompt": ["the red fox", "once upon"],
                                          "max_tokens": 6, "temperature": 0, "n": 2,
                                          "logprobs": 2}),
            ("resp", "/v1/responses", {"model": "tiny", "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": IMAGES[1]},
                {"type": "input_text", "text": "what is it"}]}], "max_output_tokens": 5,
                "temperature": 0}),
            ("chat-logprobs", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "temperature": 0, "logprobs": True, "top_logprobs": 3}),
            ("embed", "/v1/embeddings", {"input": ["the red fox", "once upon"],
                                         "encoding_format": "base64"})]


def _without_ids(value):
    """An answer less what differs between two answers to one request (the second reads
    the first one's prompt from the prefix cache)."""
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items()
                if k not in ("id", "created", "created_at", "completed_at", "cached_tokens")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


@pytest.fixture(scope="module")
def served(clip_llama: str):
    with LLM(clip_llama, dtype="float32", max_model_len=512) as llm:
        app = OpenAIServer(llm.engine, ServerConfig("tiny", max_queue=None)).app()
        with TestClient(app) as http:
            yield http, app
        assert_no_leaks(llm.engine)  # once the server's loop has stopped


def _run(http: TestClient, app, data: bytes, **options) -> tuple[list[dict], object]:
    out = io.StringIO()
    options = {"max_line_bytes": 1 << 20, "window_lines": 8, **options}
    summary = http.portal.call(lambda: run_batch(app, io.BytesIO(data), out, **options))
    return [json.loads(line) for line in out.getvalue().splitlines()], summary


def test_each_line_gets_the_servers_answer_in_order(served) -> None:
    http, app = served
    requests = _requests()
    lines, summary = _run(http, app, b"".join(_line(*r) for r in requests))
    assert [line["custom_id"] for line in lines] == [r[0] for r in requests]
    for line, (_, url, body) in zip(lines, requests, strict=True):
        assert line["error"] is None and line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200, response
        assert response["body"]["id"].endswith(response["request_id"])
        expected = http.post(url, json=body)
        assert expected.status_code == 200
        assert _without_ids(response["body"]) == _without_ids(expected.json())
    bodies = [line["response"]["body"] for line in lines]
    assert summary.answered == summary.lines == len(requests)
    assert summary.output_tokens == sum(
        b["usage"].get("completion_tokens", b["usage"].get("output_tokens", 0)) for b in bodies)
    assert summary.statuses == {"200": len(requests)} and summary.stopped is None


def test_lines_that_are_no_requests_get_errors_and_the_rest_go_on(served) -> None:
    http, app = served
    good = _line("good", "/v1/completions", {"prompt": "the red fox", "max_tokens": 4,
                                             "temperature": 0})
    data = b"".join([
        b"{not json\n", b"[1, 2]\n", b"\xff\xfe{}\n", b"\n", b"   \n",
        b'{"method": "POST", "url": "/v1/completions", "body": {}}\n',
        _line("x" * 1025, "/v1/completions", {"prompt": "hi"}),
        good,
        _line("good", "/v1/completions", {"prompt": "again"}),
        b'{"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}}\n',
        _line("embed", "/v1/audio/speech", {"input": "hi"}),
        b'{"custom_id": "no-body", "method": "POST", "url": "/v1/completions", "body": 3}\n',
        _line("stream", "/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}],
                                                 "stream": True}),
        _line("hot", "/v1/completions", {"prompt": "hi", "temperature": 9}),
        _line("model", "/v1/completions", {"prompt": "hi", "model": "other"}),
        _line("surrogate", "/v1/completions", {"prompt": "a\ud800b"}),
        _line("huge", "/v1/completions", {"prompt": "word " * 2000}),
        good.replace(b'"good"', b'"good-2"'),
    ])
    lines, summary = _run(http, app, data, max_line_bytes=4096)
    errors = [(line["custom_id"], (line["error"] or {}).get("code")) for line in lines]
    assert errors == [
        (None, "invalid_json_line"), (None, "invalid_json_line"), (None, "invalid_json_line"),
        (None, "invalid_custom_id"), (None, "invalid_custom_id"), ("good", None),
        ("good", "duplicate_custom_id"), ("get", "invalid_method"), ("embed", "invalid_url"),
        ("no-body", "invalid_body"), ("stream", None), ("hot", None), ("model", None),
        ("surrogate", None), (None, "line_too_long"), ("good-2", None)]
    by_id = {line["custom_id"]: line for line in lines if line["custom_id"]}
    for custom_id, status, param in (("stream", 400, "stream"), ("hot", 400, "temperature"),
                                     ("model", 404, "model")):
        response = by_id[custom_id]["response"]
        assert (response["status_code"], response["body"]["error"]["param"]) == (status, param)
    assert by_id["surrogate"]["response"]["status_code"] == 400
    assert "surrogate" in by_id["surrogate"]["response"]["body"]["error"]["message"]
    assert lines[5]["response"]["body"]["choices"] == lines[-1]["response"]["body"]["choices"]
    assert "4096" in lines[-2]["error"]["message"]
    assert summary.answered == 2 and summary.lines == 16
    assert summary.statuses["invalid_json_line"] == 3 and summary.statuses["400"] == 3


class HeldApp:
    """An ASGI app that answers at once, but line 0 only once released; counts what it holds."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started: list[int] = []
        self.active = self.peak = 0

    async def __call__(self, scope, receive, send) -> None:
        tag = json.loads((await receive())["body"])["prompt"]
        self.started.append(tag)
        self.active += 1
        self.peak = max(self.peak, self.active)
        await (self.release.wait() if tag == 0 else asyncio.sleep(0.001))
        self.active -= 1
        body = json.dumps({"tag": tag, "usage": {"completion_tokens": 2}}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"x-request-id", f"r{tag}".encode())]})
        await send({"type": "http.response.body", "body": body})


def _numbered(count: int, pad: int = 0) -> bytes:
    return b"".join(_line(f"n{i}", "/v1/completions", {"prompt": i, "pad": "x" * pad})
                    for i in range(count))


def test_a_slow_line_holds_back_the_reading_not_the_memory() -> None:
    async def scenario() -> tuple[list[int], list[dict], object]:
        app, out = HeldApp(), io.StringIO()
        task = asyncio.create_task(run_batch(app, io.BytesIO(_numbered(20)), out,
                                             max_line_bytes=4096, window_lines=5))
        for _ in range(200):
            await asyncio.sleep(0.005)
        held = list(app.started)  # line 0 waits; 1-4 are answered but cannot be written
        app.release.set()
        summary = await task
        return held, [json.loads(line) for line in out.getvalue().splitlines()], summary

    held, lines, summary = asyncio.run(scenario())
    assert held == [0, 1, 2, 3, 4]
    assert [line["response"]["body"]["tag"] for line in lines] == list(range(20))
    assert [line["response"]["request_id"] for line in lines] == [f"r{i}" for i in range(20)]
    assert summary.output_tokens == 40 and summary.answered == 20


def test_the_window_bounds_the_bytes_of_the_lines_in_flight() -> None:
    async def scenario() -> int:
        app = HeldApp()
        app.release.set()
        data = _numbered(12, pad=1000)
        await run_batch(app, io.BytesIO(data), io.StringIO(), max_line_bytes=4096,
                        window_lines=100, window_bytes=2 * (len(data) // 12) + 10)
        return app.peak

    assert asyncio.run(scenario()) == 2


def test_a_broken_engine_stops_the_reading() -> None:
    async def scenario() -> tuple[object, int]:
        app, out = HeldApp(), io.StringIO()
        app.release.set()
        summary = await run_batch(
            app, io.BytesIO(_numbered(50)), out, max_line_bytes=4096, window_lines=4,
            broken=lambda: RuntimeError("gone") if len(app.started) >= 6 else None)
        return summary, len(out.getvalue().splitlines())

    summary, written = asyncio.run(scenario())
    assert summary.stopped == "the engine stopped: gone"
    # Every line read is answered; none is read once the engine is gone (lines already
    # handed to tasks may not have reached the app when it broke).
    assert summary.lines == written == summary.last_line
    assert 6 <= written <= 6 + 4


@pytest.mark.slow  # a fresh interpreter that loads the engine: about 9 s
def test_the_command_reads_a_pipe_and_writes_one(clip_llama: str) -> None:
    data = b"".join(_line(*r) for r in _requests()[:3])
    run = subprocess.run(
        [sys.executable, "-m", "mmserve.entrypoints.cli", "run-batch", "-i", "-", "-o", "-",
         clip_llama, "--served-model-name", "tiny", "--dtype", "float32",
         "--max-model-len", "256", "--log-level", "warning"],
        input=data, capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [line["custom_id"] for line in lines] == ["chat-0", "chat-1", "chat-2"]
    assert all(line["response"]["status_code"] == 200 for line in lines)
    assert "3 lines in" in run.stderr.decode()


def test_the_command_refuses_files_it_cannot_use(tmp_path, capsys) -> None:
    batch = tmp_path / "in.jsonl"
    batch.write_bytes(_numbered(2))
    for argv, message in (
            (["-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out.jsonl")],
             "No such file"),
            (["-i", str(batch), "-o", str(batch)], "is the input file"),
            (["-i", str(batch), "-o", str(tmp_path)], "is a directory"),
            (["-i", str(batch), "-o", str(tmp_path / "no" / "out.jsonl")], "cannot write")):
        assert main(["run-batch", *argv, str(tmp_path / "no-model")]) == 2
        assert message in capsys.readouterr().err
    assert batch.read_bytes() == _numbered(2)


class FailingOutput(io.StringIO):
    """An output that takes ``lines`` lines, then fails as a closed pipe does."""

    def __init__(self, lines: int) -> None:
        super().__init__()
        self.left = lines

    def write(self, text: str) -> int:
        if not self.left:
            raise BrokenPipeError(32, "Broken pipe")
        self.left -= 1
        return super().write(text)


@pytest.mark.parametrize("window_lines", [1, 4])
def test_an_output_that_fails_stops_the_run(window_lines: int) -> None:
    async def scenario() -> None:
        app = HeldApp()
        app.release.set()
        await asyncio.wait_for(run_batch(app, io.BytesIO(_numbered(40)), FailingOutput(3),
                                         max_line_bytes=4096, window_lines=window_lines), 20)

    with pytest.raises(BrokenPipeError):
        asyncio.run(scenario())


def test_an_engine_that_breaks_after_the_last_line_is_read_is_reported() -> None:
    async def scenario() -> object:
        app = HeldApp()
        app.release.set()
        return await run_batch(app, io.BytesIO(_numbered(5)), io.StringIO(),
                               max_line_bytes=4096, window_lines=8,
                               broken=lambda: RuntimeError("gone") if len(app.started) == 5
                               else None)

    summary = asyncio.run(scenario())
    assert summary.read_all and summary.lines == 5 and summary.stopped == "the engine stopped: gone"


def test_a_line_of_the_cap_is_taken_and_one_byte_more_is_not() -> None:
    line = _line("x", "/v1/completions", {"prompt": 0})
    cap = len(line) - 1  # without its line break

    async def scenario(data: bytes) -> list[dict]:
        app, out = HeldApp(), io.StringIO()
        app.release.set()
        await run_batch(app, io.BytesIO(data), out, max_line_bytes=cap, window_lines=2)
        return [json.loads(text) for text in out.getvalue().splitlines()]

    taken = asyncio.run(scenario(line + line.replace(b'"x"', b'"y"').rstrip(b"\n")))
    assert [entry["response"]["body"]["tag"] for entry in taken] == [0, 0]
    longer = line.replace(b'"x"', b'"xy"')
    refused = asyncio.run(scenario(longer + line))
    assert [(entry["custom_id"], (entry["error"] or {}).get("code")) for entry in refused] == [
        (None, "line_too_long"), ("x", None)]


def test_answers_with_line_separators_stay_one_line_each() -> None:
    text = "a\u2028b\u2029c\x85d"

    async def app(scope, receive, send) -> None:
        await receive()
        body = json.dumps({"text": text}, ensure_ascii=False).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    out = io.StringIO()
    asyncio.run(run_batch(app, io.BytesIO(_numbered(2)), out, max_line_bytes=4096,
                          window_lines=2))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["response"]["body"]["text"] == text


def test_a_pipe_is_read_once_and_an_idle_one_does_not_hold_up_the_exit(tmp_path) -> None:
    import os
    import threading

    from mmserve.entrypoints.batch_command import _open_input

    fifo = tmp_path / "requests"
    os.mkfifo(fifo)
    data = _numbered(3)
    writer = threading.Thread(target=fifo.write_bytes, args=(data,))
    writer.start()
    source, total = _open_input(str(fifo))
    with source:
        assert total is None and source.read() == data
    writer.join()

    read_end, write_end = os.pipe()  # a pipe no one writes to (till the end of the test)
    idle = open(read_end, "rb")  # noqa: SIM115

    async def cancelled() -> None:
        task = asyncio.create_task(run_batch(HeldApp(), idle, io.StringIO(),
                                             max_line_bytes=4096, window_lines=2))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    runner = threading.Thread(target=asyncio.run, args=(cancelled(),), daemon=True)
    runner.start()
    runner.join(10)
    assert not runner.is_alive()
    os.close(write_end)  # the reading thread, still waiting, gets to the end
    idle.close()


def test_a_busy_server_is_asked_again_and_errors_go_apart() -> None:
    """``retry_busy``: a 503 with Retry-After (the queue is full) is posted again after the
    wait; with ``errors_out``, answers other than 200 go there, each status told."""
    posts: list[int] = []

    async def app(scope, receive, send) -> None:
        tag = json.loads((await receive())["body"])["prompt"]
        posts.append(tag)
        busy = tag == 1 and posts.count(1) <= 2
        status = 503 if busy else 400 if tag == 2 else 200
        headers = [(b"retry-after", b"0")] if busy else []
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(
            {"tag": tag, "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                   "prompt_tokens_details": {"cached_tokens": 3}}}).encode()})

    out, errors, told = io.StringIO(), io.StringIO(), []
    summary = asyncio.run(run_batch(app, io.BytesIO(_numbered(4)), out, errors_out=errors,
                                    max_line_bytes=4096, window_lines=4, retry_busy=True,
                                    on_written=told.append))
    assert posts.count(1) == 3 and told == ["200", "200", "400", "200"]
    assert [json.loads(line)["custom_id"] for line in out.getvalue().splitlines()] == [
        "n0", "n1", "n3"]
    assert [json.loads(line)["response"]["status_code"]
            for line in errors.getvalue().splitlines()] == [400]
    assert (summary.input_tokens, summary.cached_tokens, summary.output_tokens) == (15, 9, 6)
    # Without it, the 503 is the line's answer.
    posts.clear()
    out = io.StringIO()
    asyncio.run(run_batch(app, io.BytesIO(_numbered(2)), out, max_line_bytes=4096,
                          window_lines=4))
    assert [json.loads(line)["response"]["status_code"]
            for line in out.getvalue().splitlines()] == [200, 503]


LEFT = {"code": "batch_cancelled", "message": "cancelled"}


@pytest.mark.parametrize("left", [LEFT, None])
def test_a_cancelled_run_writes_each_line_left_with_the_error_it_is_given(left) -> None:
    """Cancelled with line 0 held in flight, lines 1-4 answered behind it and line 5 waiting
    for room: the answers are written, and ``left_error``'s error for line 0, line 5 and
    every line not yet read (a blank one skipped, a too-long one without its custom id)."""
    data = (_numbered(12) + b"\n" + b"x" * 5000 + b"\n"
            + _line("n19", "/v1/completions", {"prompt": 19}))
    lines_in = [line for line in data.splitlines() if line.strip()]

    async def scenario() -> tuple[object, list[str]]:
        app, told = HeldApp(), []
        out, errors = io.StringIO(), io.StringIO()
        task = asyncio.create_task(run_batch(
            app, io.BytesIO(data), out, errors_out=errors, max_line_bytes=4096,
            window_lines=5, on_written=told.append, left_error=lambda: left))
        while len(app.started) < 5 or app.active > 1:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # line 5 read, waiting for room in the window
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return told, out.getvalue(), errors.getvalue()

    told, out, errors = asyncio.run(scenario())
    if left is None:  # nothing: line 0's place is never filled
        assert told == [] and out == errors == ""
        return
    answered = [json.loads(line) for line in out.splitlines()]
    assert [line["custom_id"] for line in answered] == ["n1", "n2", "n3", "n4"]
    refused = [json.loads(line) for line in errors.splitlines()]
    assert len(lines_in) == 14 and told == ["batch_cancelled"] + ["200"] * 4 + [
        "batch_cancelled"] * 9
    assert [line["custom_id"] for line in refused] == [
        "n0", *(f"n{i}" for i in range(5, 12)), None, "n19"]
    assert all(line["error"] == LEFT and line["response"] is None for line in refused)


def test_a_read_whose_caller_is_cancelled_goes_to_the_next_call() -> None:
    import threading

    from mmserve.entrypoints.run_batch import LineReader

    class Slow(io.BytesIO):
        gate = threading.Event()

        def readline(self, limit=-1):
            self.gate.wait(5)
            return super().readline(limit)

    async def scenario() -> list[bytes]:
        reader = LineReader(Slow(b"one\ntwo\n"))
        first = asyncio.create_task(reader.readline(100))
        await asyncio.sleep(0.02)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        Slow.gate.set()
        lines = [await reader.readline(100) for _ in range(3)]
        reader.close()
        return lines

    assert asyncio.run(scenario()) == [b"one\n", b"two\n", b""]


def test_a_line_counts_the_sequences_it_asks_for() -> None:
    """A line's ``n`` answers of each of its prompts take as many of the window's places:
    with 4, line 0 (held) and line 1 (n=3) fill it and line 2 waits."""
    from mmserve.entrypoints.run_batch import _seats

    async def scenario() -> list[int]:
        app = HeldApp()
        lines = [_line("a", "/v1/completions", {"prompt": 0}),
                 _line("b", "/v1/completions", {"prompt": 1, "n": 3}),
                 _line("c", "/v1/completions", {"prompt": 2})]
        task = asyncio.create_task(run_batch(app, io.BytesIO(b"".join(lines)), io.StringIO(),
                                             max_line_bytes=4096, window_lines=4))
        for _ in range(1000):  # (up to 5 s for lines 0 and 1 to be posted)
            if len(app.started) >= 2:
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)  # time enough for line 2 to go, were there room
        held = list(app.started)
        app.release.set()
        await task
        return held

    assert asyncio.run(scenario()) == [0, 1]
    assert _seats("/v1/completions", {"prompt": ["a", "b"], "n": 2}) == 4
    assert _seats("/v1/completions", {"prompt": [1, 2, 3]}) == 1  # (one prompt of token ids)
    assert _seats("/v1/completions", {"prompt": [[1], [2]]}) == 2
    assert _seats("/v1/embeddings", {"input": ["a", "b", "c"]}) == 3
    assert _seats("/v1/chat/completions", {"messages": [], "n": True}) == 1


def test_a_run_cancelled_with_every_line_in_flight_writes_each_of_them() -> None:
    """Cancelled while its last lines are answered (all read, none written), each of them is
    written with the error it is given."""
    release = asyncio.Event()

    async def app(scope, receive, send) -> None:
        await receive()
        await release.wait()

    async def scenario() -> tuple[list[str], list[dict]]:
        told, errors = [], io.StringIO()
        task = asyncio.create_task(run_batch(
            app, io.BytesIO(_numbered(3)), io.StringIO(), errors_out=errors,
            max_line_bytes=4096, window_lines=5, on_written=told.append,
            left_error=lambda: LEFT))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return told, [json.loads(line) for line in errors.getvalue().splitlines()]

    told, refused = asyncio.run(scenario())
    assert told == ["batch_cancelled"] * 3
    assert [line["custom_id"] for line in refused] == ["n0", "n1", "n2"]
