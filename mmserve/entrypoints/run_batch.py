"""``mmserve run-batch``: a file of OpenAI batch requests answered offline, each line as the
server answers it, with no socket in between.

The input is OpenAI's batch format, one JSON object a line: ``custom_id`` (a string, unique in
the file), ``method`` (``POST``), ``url`` (``/v1/chat/completions``, ``/v1/completions`` or
``/v1/responses``) and ``body`` (the request). Each is posted to the server's own app in this
process (``OpenAIServer``: the same validation, answers and errors), many at a time so that
the engine batches them, and answered by one output line, in the input's order::

    {"id": "batch_req_...", "custom_id": ..., "error": null,
     "response": {"status_code": 200, "request_id": ..., "body": {...}}}

A request the server refuses or fails keeps its status and OpenAI error body in
``response``; a line that is no request (not JSON, no ``custom_id``, a repeated one, another
URL or method) gets ``response: null`` and ``error: {"code", "message"}``, and the lines
after it go on. Memory stays bounded whatever the file holds: each line is read up to a cap
(``--max-request-body-bytes`` and a little for the rest of the line), and the lines read but
not yet written are bounded in count and in bytes, so a long answer early in the file holds
back the reading, not the memory.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TextIO

from mmserve.entrypoints.api_server import OpenAIServer

logger = logging.getLogger(__name__)

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
LINE_OVERHEAD_BYTES = 64 * 1024  # a line's custom_id, method and url beside its body
MAX_CUSTOM_ID_CHARS = 1024
# Lines read but not yet written: at most this many per request the engine runs at once,
# holding at most this many bytes of requests (a larger line goes alone).
LINES_PER_SEQ = 4
WINDOW_BYTES = 256 * 1024 * 1024


class LineError(Exception):
    """A line that is no request; ``code`` and the message go in its ``error``."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.custom_id = custom_id


@dataclass(frozen=True)
class BatchRequest:
    custom_id: str
    url: str
    body: bytes  # the request's JSON, as a client would post it
    stream: bool  # asks for a stream, which a batch cannot give


def parse_line(line: bytes, seen: set[bytes]) -> BatchRequest:
    """One input line as a request; ``LineError`` for one that is none. ``seen``: digests of
    the custom ids so far (this line's is added)."""
    try:
        item = json.loads(line)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise LineError("invalid_json_line", f"the line is not a JSON object: "
                        f"{str(e) or type(e).__name__}") from None
    if not isinstance(item, dict):
        raise LineError("invalid_json_line", "the line is not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("invalid_custom_id", "'custom_id' must be a non-empty string that "
                        "names the request in the output")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise LineError("invalid_custom_id", f"'custom_id' is over {MAX_CUSTOM_ID_CHARS} "
                        "characters")
    digest = hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    if digest in seen:
        raise LineError("duplicate_custom_id", f"the custom_id {custom_id!r} names an earlier "
                        "line too; give each line its own", custom_id)
    seen.add(digest)
    if item.get("method") != "POST":
        raise LineError("invalid_method", f"'method' must be \"POST\", got "
                        f"{json.dumps(item.get('method'))}", custom_id)
    url = item.get("url")
    if url not in URLS:
        raise LineError("invalid_url", f"'url' must be one of {', '.join(URLS)}; got "
                        f"{json.dumps(url)}", custom_id)
    body = item.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_body", "'body' must be a JSON object: the request",
                        custom_id)
    return BatchRequest(custom_id, url, _as_json(body), body.get("stream") is True)


def _as_json(body: dict[str, Any]) -> bytes:
    """``body`` as a client would post it: compact and unescaped, so never longer than in
    the line, which the cap allowed (escaped where it holds lone surrogates, for the server
    to refuse as it refuses them from a client)."""
    compact = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    try:
        return compact.encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()


class AsgiClient:
    """Posts requests to an ASGI app in this process: the app sees what a socket would have
    given it (a client that stays until the answer is whole)."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app

    async def post(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """The status, headers and body of the app's answer to ``body`` posted to ``path``."""
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "root_path": "", "query_string": b"", "client": ("run-batch", 0),
            "server": ("run-batch", 0), "state": {},
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())]}
        answered = asyncio.Event()
        pending = [{"type": "http.request", "body": body, "more_body": False}]
        status, headers, chunks = 500, {}, []

        async def receive() -> dict[str, Any]:
            if pending:
                return pending.pop()
            await answered.wait()  # the client never leaves before its answer
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers.update((k.decode("latin-1").lower(), v.decode("latin-1"))
                               for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    answered.set()

        try:
            await self.app(scope, receive, send)
        finally:
            answered.set()
        return status, headers, b"".join(chunks)


class Window:
    """Lines read and not yet written: at most ``lines`` of them, holding at most ``size``
    bytes (a line larger than that goes alone)."""

    def __init__(self, lines: int, size: int) -> None:
        self.lines, self.size = lines, size
        self._count = self._bytes = 0
        self._changed = asyncio.Condition()

    async def enter(self, size: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._count == 0 or (
                self._count < self.lines and self._bytes + size <= self.size))
            self._count += 1
            self._bytes += size

    async def leave(self, size: int) -> None:
        async with self._changed:
            self._count -= 1
            self._bytes -= size
            self._changed.notify_all()


@dataclass
class BatchSummary:
    lines: int = 0  # output lines written
    answered: int = 0  # of them, with status 200
    output_tokens: int = 0
    statuses: dict[str, int] = field(default_factory=dict)  # "400", "invalid_url", ...
    last_line: int = 0  # the input's physical line the last request read came from
    stopped: str | None = None  # why reading stopped early (the engine broke)


def _output_line(custom_id: str | None, response: str | None,
                 error: dict[str, str] | None) -> str:
    head = json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id})
    # The response's JSON is spliced in as the app wrote it (no raw line break can be in it).
    return (f'{head[:-1]}, "response": {"null" if response is None else response}, '
            f'"error": {json.dumps(error)}}}\n')


def _usage_tokens(body: Any) -> int:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0
    return usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0


async def run_batch(app: Callable[..., Any], source: BinaryIO, out: TextIO, *,
                    max_line_bytes: int, window_lines: int, window_bytes: int = WINDOW_BYTES,
                    broken: Callable[[], BaseException | None] = lambda: None,
                    on_written: Callable[[], None] = lambda: None) -> BatchSummary:
    """Answer every line of ``source`` (bytes, one request a line; blank lines skipped) by
    posting it to ``app``, writing one output line each to ``out`` in the input's order.
    Reading stops early where ``broken()`` names an error (the engine is gone)."""
    client = AsgiClient(app)
    window = Window(window_lines, window_bytes)
    loop = asyncio.get_running_loop()
    summary = BatchSummary()
    ready: dict[int, tuple[str, int]] = {}
    written = 0
    seen: set[bytes] = set()
    tasks: set[asyncio.Task] = set()

    async def put(index: int, line: str, size: int, status: str) -> None:
        nonlocal written
        ready[index] = (line, size)
        summary.statuses[status] = summary.statuses.get(status, 0) + 1
        while written in ready:
            text, held = ready.pop(written)
            out.write(text)
            written += 1
            summary.lines += 1
            on_written()
            await window.leave(held)
        out.flush()

    async def answer(index: int, request: BatchRequest, size: int) -> None:
        try:
            status, headers, body = await client.post(request.url, request.body)
            parsed = json.loads(body)
        except Exception as e:  # the app answers every request; this is a defect
            logger.exception("run-batch: line %d (custom_id %r) failed", index + 1,
                             request.custom_id)
            status, headers = 500, {}
            parsed = {"error": {"message": f"internal error: {type(e).__name__}",
                                "type": "server_error", "param": None, "code": None}}
            body = json.dumps(parsed).encode()
        if status == 200:
            summary.answered += 1
            summary.output_tokens += _usage_tokens(parsed)
        text = body.decode() if b"\n" not in body else json.dumps(parsed)
        response = (f'{{"status_code": {status}, "request_id": '
                    f'{json.dumps(headers.get("x-request-id"))}, "body": {text}}}')
        await put(index, _output_line(request.custom_id, response, None), size, str(status))

    index = physical = 0
    try:
        while True:
            if (error := broken()) is not None:
                summary.stopped = f"the engine stopped: {error}"
                break
            line = await loop.run_in_executor(None, source.readline, max_line_bytes + 1)
            if not line:
                break
            physical += 1
            if len(line) > max_line_bytes:  # skip the rest of it, a piece at a time
                while line and not line.endswith(b"\n"):
                    line = await loop.run_in_executor(None, source.readline, 1 << 20)
                failure = LineError("line_too_long", f"the line is over {max_line_bytes} "
                                    "bytes (--max-request-body-bytes); send smaller images "
                                    "or fewer of them")
            elif not line.strip():
                continue
            else:
                failure = None
            await window.enter(len(line))
            summary.last_line = physical
            try:
                if failure is not None:
                    raise failure
                request = parse_line(line, seen)
            except LineError as e:
                await put(index, _output_line(e.custom_id, None, {
                    "code": e.code, "message": str(e)}), len(line), e.code)
            else:
                if request.stream:
                    refusal = _refusal(f"{request.url} is answered whole in a batch; leave "
                                       "'stream' out", "stream")
                    await put(index, _output_line(request.custom_id, refusal, None),
                              len(line), "400")
                else:
                    task = asyncio.create_task(answer(index, request, len(line)))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            index += 1
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return summary


def _refusal(message: str, param: str) -> str:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param,
                      "code": None}}
    return json.dumps({"status_code": 400, "request_id": uuid.uuid4().hex, "body": body})


def run_batch_command(args: argparse.Namespace) -> int:
    """``mmserve run-batch``: status 0 when every line has its output line (whatever its
    status), 1 when the engine broke on the way, 2 for settings or files that cannot work."""
    from tqdm import tqdm

    from mmserve.demo.checkpoint import demo_model_path
    from mmserve.entrypoints.serve_command import close_engine, front_door_config, open_engine

    logging.getLogger().setLevel(args.log_level.upper())
    model = args.model_path or args.model
    try:
        if model is None:
            model = str(demo_model_path())
        # The window bounds the requests in flight; the engine's own queue needs no bound.
        config = front_door_config(args, model, max_queue=None)
        _check_output(args.output_file, args.input_file)
        source, total = _open_input(args.input_file)
        engine, compute, defaults = open_engine(args, model, config.engine_process)
    except (OSError, ValueError) as e:
        print(f"mmserve run-batch: {e}", file=sys.stderr)
        return 2
    server = OpenAIServer(engine, config, compute, defaults)
    app = server.app()
    progress = tqdm(total=total, unit="req", desc="run-batch", disable=None, file=sys.stderr)
    out: TextIO | None = None

    async def run() -> BatchSummary:
        async with app.router.lifespan_context(app):
            return await run_batch(
                app, source, out, max_line_bytes=config.max_request_body_bytes
                + LINE_OVERHEAD_BYTES, window_lines=LINES_PER_SEQ * engine.config.max_num_seqs,
                broken=lambda: server.engine.error, on_written=progress.update)

    start = time.perf_counter()
    try:
        # Opened once the engine is up, so that a checkpoint that cannot load leaves an
        # earlier output file as it was.
        out = sys.stdout if args.output_file == "-" else open(args.output_file, "w",
                                                             encoding="utf-8")
        summary = asyncio.run(run())
    finally:
        progress.close()
        server.engine.stop()
        close_engine(engine, compute)
        if source is not sys.stdin.buffer:
            source.close()
        if out not in (None, sys.stdout):
            out.close()
    elapsed = time.perf_counter() - start
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(summary.statuses.items()))
    print(f"mmserve run-batch: {summary.lines} lines in {elapsed:.1f} s ({counts}); "
          f"{summary.output_tokens} output tokens, {summary.output_tokens / elapsed:.1f} "
          "tokens/s", file=sys.stderr)
    if summary.stopped is not None:
        print(f"mmserve run-batch: {summary.stopped}; input lines after line "
              f"{summary.last_line} were not read", file=sys.stderr)
        return 1
    return 0


def _open_input(path: str) -> tuple[BinaryIO, int | None]:
    """The input's bytes, and how many requests it holds where it can be counted first."""
    if path == "-":
        return sys.stdin.buffer, None
    with open(path, "rb") as f:
        total = sum(1 for line in f if line.strip())
    return open(path, "rb"), total


def _check_output(path: str, input_path: str) -> None:
    """A ``ValueError`` where the answers could not be written to ``path``."""
    if path == "-":
        return
    if os.path.isdir(path):
        raise ValueError(f"--output-file {path} is a directory; name a file")
    if input_path != "-" and os.path.exists(path) and os.path.samefile(path, input_path):
        raise ValueError(f"--output-file {path} is the input file; write the answers "
                         "elsewhere")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"--output-file {path}: cannot write in {folder}")
