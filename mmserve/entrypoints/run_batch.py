"""A file of OpenAI batch requests answered each line as the server answers it, with no
socket in between: ``mmserve run-batch`` (``batch_command.py``) and the server's Batch API
(``batch_api.py``) both run files through ``run_batch``.

The input is OpenAI's batch format, one JSON object a line: ``custom_id`` (a string, unique in
the file), ``method`` (``POST``), ``url`` (``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses`` or ``/v1/embeddings``) and ``body`` (the request). Each is posted to the
server's own app in this process (``OpenAIServer``: the same validation, answers and
errors), many at a time so that the engine batches them, and answered by one output line, in
the input's order::

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

import asyncio
import hashlib
import json
import logging
import queue
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TextIO

logger = logging.getLogger(__name__)

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
LINE_OVERHEAD_BYTES = 64 * 1024  # a line's custom_id, method and url beside its body
MAX_CUSTOM_ID_CHARS = 1024
# Lines read but not yet written: at most this many sequences (a line's ``n`` answers of each
# of its prompts) per request the engine runs at once,
# holding at most this many bytes of requests and answers (a larger line goes alone).
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
    background: bool  # asks to be answered later (a Responses API request)
    seats: int = 1  # the sequences it asks the engine for (``n`` answers of each prompt)


def parse_line(line: bytes, seen: set[bytes],
               prepare: Callable[[dict[str, Any]], None] | None = None) -> BatchRequest:
    """One input line as a request; ``LineError`` for one that is none. ``seen``: digests of
    the custom ids of the requests so far (this line's is added once it is one);
    ``prepare``: told each request's body, which it may change (defaults of its own)."""
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
        raise LineError("duplicate_custom_id", f"the custom_id {_quoted(custom_id)} names an "
                        "earlier line too; give each line its own", custom_id)
    if item.get("method") != "POST":
        raise LineError("invalid_method", f"'method' must be \"POST\", got "
                        f"{_quoted(item.get('method'))}", custom_id)
    url = item.get("url")
    if url not in URLS:
        raise LineError("invalid_url", f"'url' must be one of {', '.join(URLS)}; got "
                        f"{_quoted(url)}", custom_id)
    body = item.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_body", "'body' must be a JSON object: the request",
                        custom_id)
    seen.add(digest)  # (a line refused is no request: a corrected copy may follow)
    if prepare is not None:
        prepare(body)
    return BatchRequest(custom_id, url, _as_json(body), body.get("stream") is True,
                        body.get("background") is True, _seats(url, body))


def _seats(url: str, body: dict[str, Any]) -> int:
    """The sequences a request asks the engine for: ``n`` answers (or beams) of each of its
    prompts (a completions request's, or an embeddings request's inputs), as far as the body
    says (the server refuses what it must)."""
    n = body.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    prompts = body.get({"/v1/completions": "prompt", "/v1/embeddings": "input"}.get(url, ""))
    many = isinstance(prompts, list) and prompts and not isinstance(prompts[0], int)
    return n * (len(prompts) if many else 1)


def _quoted(value: Any) -> str:
    """``value`` as JSON, cut short: what an error message shows of a line's field."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _as_json(body: dict[str, Any]) -> bytes:
    """``body`` as a client would post it: compact and unescaped, so about as long as in
    the line (escaped where it holds lone surrogates, for the server to refuse as it refuses
    them from a client)."""
    compact = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    try:
        return compact.encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()


class AsgiClient:
    """Posts requests to an ASGI app in this process: the app sees what a socket would have
    given it (a client that stays until the answer is whole). ``headers``: sent with each
    request beside its type and length (the server's API key)."""

    def __init__(self, app: Callable[..., Any],
                 headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        self.app = app
        self.headers = headers

    async def post(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """The status, headers and body of the app's answer to ``body`` posted to ``path``."""
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "root_path": "", "query_string": b"", "client": ("run-batch", 0),
            "server": ("run-batch", 0), "state": {},
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()), *self.headers]}
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
    """Lines read and not yet written: their sequences (a line's ``seats``: the answers it
    asks for) at most ``lines``, holding at most ``size`` bytes (a line's request while it is
    answered, then its answer till it is written; one line larger than either goes alone).
    The reader waits in ``enter``; the rest is synchronous, so that a task's callback may
    ``fail`` it."""

    def __init__(self, lines: int, size: int) -> None:
        self.lines, self.size = lines, size
        self.count = self.bytes = 0
        self.failure: BaseException | None = None
        self._changed = asyncio.Event()

    async def enter(self, size: int, seats: int = 1) -> None:
        """Wait for room for a line of ``size`` bytes and ``seats`` sequences; raise the
        error that ``fail`` gave."""
        while self.failure is None and self.count and (
                self.count + seats > self.lines or self.bytes + size > self.size):
            self._changed.clear()
            await self._changed.wait()
        if self.failure is not None:
            raise self.failure
        self.count += seats
        self.bytes += size

    def resize(self, old: int, new: int) -> None:
        self.bytes += new - old
        self._changed.set()

    def leave(self, size: int, seats: int = 1) -> None:
        self.count -= seats
        self.bytes -= size
        self._changed.set()

    def fail(self, error: BaseException) -> None:
        """Stop the reading: ``enter`` raises ``error`` from now on."""
        if self.failure is None:
            self.failure = error
        self._changed.set()


class LineReader:
    """Reads lines of ``source`` on a daemon thread of its own: a read that blocks (an idle
    pipe) holds up neither the event loop nor, after Ctrl-C, the process's exit."""

    def __init__(self, source: BinaryIO) -> None:
        self._source = source
        self._asks: queue.SimpleQueue = queue.SimpleQueue()
        self._unclaimed: asyncio.Future | None = None  # a read whose caller was cancelled
        threading.Thread(target=self._serve, name="run-batch-reader", daemon=True).start()

    def _serve(self) -> None:
        while (ask := self._asks.get()) is not None:
            loop, future, limit = ask
            try:
                line, error = self._source.readline(limit), None
            except Exception as e:
                line, error = b"", e
            try:
                loop.call_soon_threadsafe(_settle, future, line, error)
            except RuntimeError:  # the loop has closed (the run was cancelled meanwhile)
                return

    async def readline(self, limit: int) -> bytes:
        """The next line, or its first ``limit`` bytes; b"" at the end. A call cancelled
        while the line is read leaves it to the next call (whose ``limit`` is not used)."""
        if self._unclaimed is None:
            loop = asyncio.get_running_loop()
            self._unclaimed = loop.create_future()
            self._asks.put((loop, self._unclaimed, limit))
        try:
            line = await asyncio.shield(self._unclaimed)
        except Exception:  # (not a cancellation: the read goes on for the next call)
            self._unclaimed = None
            raise
        self._unclaimed = None
        return line

    def close(self) -> None:
        self._asks.put(None)


def _settle(future: asyncio.Future, line: bytes, error: Exception | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(line)
    else:
        future.set_exception(error)


@dataclass
class BatchSummary:
    lines: int = 0  # output lines written
    input_tokens: int = 0  # the usage of the answers with status 200, summed
    cached_tokens: int = 0
    output_tokens: int = 0
    statuses: dict[str, int] = field(default_factory=dict)  # "400", "invalid_url", ...
    last_line: int = 0  # the input's physical lines read so far
    read_all: bool = False  # the input was read to its end
    stopped: str | None = None  # the engine broke on the way

    @property
    def answered(self) -> int:
        """Lines answered with status 200."""
        return self.statuses.get("200", 0)


def _output_line(custom_id: str | None, response: str | None,
                 error: dict[str, str] | None) -> str:
    head = json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id})
    return (f'{head[:-1]}, "response": {"null" if response is None else response}, '
            f'"error": {json.dumps(error)}}}\n')


def _response(status: int, request_id: str | None, body: bytes) -> str:
    """A ``response`` object holding the app's JSON ``body`` as it wrote it: compact, so with
    no line break but the separators some readers take for one (escaped here)."""
    text = body.decode()
    if "\n" in text or "\r" in text:  # not written by this server; made compact again
        text = json.dumps(json.loads(text), ensure_ascii=False, separators=(",", ":"))
    for separator in ("\u2028", "\u2029", "\x85"):
        if separator in text:
            text = text.replace(separator, f"\\u{ord(separator):04x}")
    return f'{{"status_code": {status}, "request_id": {json.dumps(request_id)}, "body": {text}}}'


def _usage_tokens(body: bytes) -> tuple[int, int, int]:
    """The input, cached input and output tokens an answer's ``usage`` counts (its last
    ``"usage":`` key, read alone so that a large answer is not parsed again)."""
    key = b'"usage":'
    at = body.rfind(key)
    if at < 0:
        return 0, 0, 0
    start = at + len(key)
    try:
        usage, _ = json.JSONDecoder().raw_decode(
            body[start:start + 4096].decode(errors="ignore").lstrip())
    except ValueError:
        return 0, 0, 0
    if not isinstance(usage, dict):
        return 0, 0, 0
    details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
    counts = (usage.get("prompt_tokens", usage.get("input_tokens", 0)),
              details.get("cached_tokens", 0) if isinstance(details, dict) else 0,
              usage.get("completion_tokens", usage.get("output_tokens", 0)))
    return tuple(n if isinstance(n, int) else 0 for n in counts)  # type: ignore[return-value]


async def run_batch(app: Callable[..., Any], source: BinaryIO, out: TextIO, *,
                    max_line_bytes: int, window_lines: int, window_bytes: int = WINDOW_BYTES,
                    broken: Callable[[], BaseException | None] = lambda: None,
                    on_written: Callable[[str], None] = lambda status: None,
                    summary: BatchSummary | None = None, errors_out: TextIO | None = None,
                    headers: tuple[tuple[bytes, bytes], ...] = (), retry_busy: bool = False,
                    prepare: Callable[[dict[str, Any]], None] | None = None,
                    admit: Callable[[int], Awaitable[None]] | None = None,
                    left_error: Callable[[], dict[str, str] | None] = lambda: None
                    ) -> BatchSummary:
    """Answer every line of ``source`` (bytes, one request a line of at most
    ``max_line_bytes`` bytes; blank lines skipped) by posting it to ``app`` (with
    ``headers``), writing one output line each to ``out`` in the input's order, or to
    ``errors_out`` where given for the lines not answered with status 200. ``on_written``:
    told each written line's status. Reading stops early where ``broken()`` names an error
    (the engine is gone); an output line that cannot be written stops the run with that
    error. ``retry_busy``: a request the server has no room for (503 with Retry-After) waits
    that long and is posted again, until ``broken()``. ``prepare``: told each request's
    body, which it may change (defaults of its own). ``admit(requests in flight)``: awaited before
    each request is posted (a server's batch yields to its clients). ``left_error()``: asked
    when the run is cancelled; an error (``code`` and ``message``) it gives is written, with
    its custom id, for each line not answered by then (those in flight are aborted), the rest
    of ``source`` read for them (OpenAI's ``batch_cancelled`` and ``batch_expired`` lines).
    ``summary``: filled in as the run goes (what an interrupted run did)."""
    client = AsgiClient(app, headers)
    window = Window(window_lines, window_bytes)
    reader = LineReader(source)
    summary = BatchSummary() if summary is None else summary
    ready: dict[int, tuple[str, str, int]] = {}  # line, status, seats
    written = 0
    seen: set[bytes] = set()
    tasks: set[asyncio.Task] = set()
    # Lines posted and not yet answered: index -> custom id, size, seats.
    posted: dict[int, tuple[str, int, int]] = {}

    def put(index: int, line: str, size: int, status: str, seats: int = 1) -> None:
        """Line ``index``'s output (its request, of ``size`` bytes and ``seats`` sequences,
        answered); written with those after it that are ready, once those before it are."""
        nonlocal written
        posted.pop(index, None)
        ready[index] = (line, status, seats)
        window.resize(size, len(line))
        summary.statuses[status] = summary.statuses.get(status, 0) + 1
        while written in ready:
            text, status, seats = ready.pop(written)
            (out if status == "200" or errors_out is None else errors_out).write(text)
            written += 1
            summary.lines += 1
            window.leave(len(text), seats)
            on_written(status)
        out.flush()
        if errors_out is not None:
            errors_out.flush()

    async def answer(index: int, request: BatchRequest, size: int, seats: int) -> None:
        try:
            status, headers, body = await client.post(request.url, request.body)
            while (retry_busy and status == 503 and "retry-after" in headers
                   and broken() is None):
                await asyncio.sleep(_seconds(headers["retry-after"]))
                status, headers, body = await client.post(request.url, request.body)
            response = _response(status, headers.get("x-request-id"), body)
        except Exception as e:  # the app answers every request; this is a defect
            logger.exception("run-batch: line %d (custom_id %r) failed", index + 1,
                             request.custom_id)
            status, body = 500, b""
            response = _refusal(f"internal error: {type(e).__name__}", None, 500,
                                "server_error")
        if status == 200:
            tokens = _usage_tokens(body)
            summary.input_tokens += tokens[0]
            summary.cached_tokens += tokens[1]
            summary.output_tokens += tokens[2]
        put(index, _output_line(request.custom_id, response, None), size, str(status),
            seats)

    def finished(task: asyncio.Task) -> None:
        tasks.discard(task)
        if task.cancelled():
            window.fail(RuntimeError("a line's answer was cancelled"))
        elif task.exception() is not None:  # its output line could not be written
            window.fail(task.exception())

    async def next_line() -> tuple[bytes, LineError | None] | None:
        """The next line that is not blank, with the error of one that is too long (and
        skipped, a piece at a time); None at the end."""
        while line := await reader.readline(max_line_bytes + 2):
            summary.last_line += 1
            if len(line) - line.endswith(b"\n") > max_line_bytes:
                while line and not line.endswith(b"\n"):
                    line = await reader.readline(1 << 20)
                return b"", LineError("line_too_long", f"the line is over {max_line_bytes} "
                                      "bytes (--max-request-body-bytes); send smaller images "
                                      "or fewer of them")
            if line.strip():
                return line, None
        return None

    async def write_left(error: dict[str, str], current: tuple[int, bytes, int, int] | None,
                         index: int) -> None:
        """Abort the lines in flight; write ``error`` for each line not answered, from those
        posted and ``current`` (read, not yet posted) to the end of the input."""
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        left = [(at, *line) for at, line in posted.items()]
        if current is not None:
            at, line, size, seats = current
            left.append((at, _custom_id_of(line), size, seats))
        for at, custom_id, size, seats in sorted(left):
            put(at, _output_line(custom_id, None, error), size, error["code"], seats)
        while (read := await next_line()) is not None:
            line, failure = read
            custom_id = None if failure is not None else _custom_id_of(line)
            put(index, _output_line(custom_id, None, error), len(line), error["code"], 0)
            index += 1

    index = 0
    # The line read and not yet posted: index, line, size, seats.
    current: tuple[int, bytes, int, int] | None = None
    try:
        while True:
            if (error := broken()) is not None:
                summary.stopped = f"the engine stopped: {error}"
                break
            read = await next_line()
            if read is None:
                summary.read_all = True
                break
            line, failure = read
            size = max_line_bytes if failure is not None else len(line)
            try:
                if failure is not None:
                    raise failure
                request: BatchRequest | LineError = parse_line(line, seen, prepare)
            except LineError as e:
                request = e
            seats = min(request.seats, window.lines) if isinstance(request, BatchRequest) else 1
            current = (index, line, size, seats)
            await window.enter(size, seats)
            if isinstance(request, LineError):
                put(index, _output_line(request.custom_id, None, {
                    "code": request.code, "message": str(request)}), size, request.code)
            elif request.stream:
                refusal = _refusal(f"{request.url} is answered whole in a batch; leave "
                                   "'stream' out", "stream")
                put(index, _output_line(request.custom_id, refusal, None), size, "400", seats)
            else:
                if admit is not None:
                    await admit(len(tasks))
                task = asyncio.create_task(answer(index, request, size, seats))
                tasks.add(task)
                posted[index] = (request.custom_id, size, seats)
                task.add_done_callback(finished)
            current = None
            index += 1
        await asyncio.gather(*tasks)
        if summary.stopped is None and (error := broken()) is not None:
            summary.stopped = f"the engine stopped: {error}"
    except asyncio.CancelledError:
        if (left := left_error()) is not None:
            try:
                await write_left(left, current, index + (current is not None))
            except Exception as e:  # (an output that cannot be written: what was, stays)
                logger.warning("run-batch: the lines left could not all be written: %s", e)
        raise
    finally:
        reader.close()
        for task in list(tasks):
            task.cancel()
    return summary


def _custom_id_of(line: bytes) -> str | None:
    """A line's ``custom_id``, where it has one."""
    try:
        item = json.loads(line)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    custom_id = item.get("custom_id") if isinstance(item, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def _seconds(retry_after: str) -> float:
    """A Retry-After header's wait, between 0.1 and 10 s (1 s where it is no number)."""
    try:
        return min(max(float(retry_after), 0.1), 10.0)
    except ValueError:
        return 1.0


def _refusal(message: str, param: str | None, status: int = 400,
             kind: str = "invalid_request_error") -> str:
    """A ``response`` object of OpenAI's error body, for an answer run-batch makes itself."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return json.dumps({"status_code": status, "request_id": uuid.uuid4().hex, "body": body})
