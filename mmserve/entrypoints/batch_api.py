"""OpenAI's Batch API, as the openai client's ``batches`` calls it: over a file of requests
uploaded through the Files API (``files_api.py``, ``purpose: "batch"``), start a batch
(``POST /v1/batches``), follow it (``GET /v1/batches/{id}``, ``GET /v1/batches``), cancel it
(``POST /v1/batches/{id}/cancel``) and download its answers (``GET /v1/files/{id}/content``).

A batch is checked whole first (``validating``): every line a request for the batch's
endpoint, custom ids unique, at most ``MAX_REQUESTS``; a file that is not fails the batch
with the errors of its lines, and nothing runs. Then its lines are answered as ``mmserve
run-batch`` answers them (``run_batch.py``): posted to this server's own app in this process,
so with the same validation, answers and errors as a client's request. Batches run one at a
time, in the order they were made, and yield to clients: a line goes to the engine only while
nothing waits there, one a step (``_admit``), and at most half of the engine's
``max_num_seqs`` are a batch's; a line the queue has no room for (503 with Retry-After) waits
and is sent again. The answers with status 200 go to the
batch's output file, the others to its error file (OpenAI's ``output_file_id`` and
``error_file_id``); a batch cancelled, expired (past its 24 hours) or failing for want of room
in the store keeps what it answered before, and a cancelled or expired one writes each line it
did not answer to its error file (``batch_cancelled``, ``batch_expired``), so that every line
is in one of its files (one that ends before its turn has none).

A batch's record is kept while the server runs (the ``MAX_BATCHES`` newest); its files,
until deleted or expired.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mmserve.entrypoints.file_store import FileStore, OutputFile, StoreFull, shown
from mmserve.entrypoints.files_api import (
    DEFAULT_EXPIRY_S,
    FilesApi,
    expiry_of,
    in_thread,
)
from mmserve.entrypoints.openai_protocol import ApiError, bad_request, metadata_of, paged
from mmserve.entrypoints.run_batch import (
    LINE_OVERHEAD_BYTES,
    URLS,
    BatchSummary,
    LineError,
    parse_line,
    run_batch,
)

logger = logging.getLogger(__name__)

MAX_REQUESTS = 50_000  # in one batch, as OpenAI's
MAX_LINE_ERRORS = 100  # a failed batch's errors listed (the count of the rest after them)
MAX_ERROR_CHARS = 300  # of each error's message
MAX_BATCHES = 1_000  # records kept; the oldest finished are forgotten past it
COMPLETION_WINDOW_S = 24 * 3600  # "24h", the one window OpenAI takes
WINDOW_BYTES = 64 * 1024 * 1024  # a batch's requests and answers held at once
ADMIT_POLL_S = 0.005  # how often a batch's next line looks for room in the engine (_admit)
BATCH_PRIORITY = 2**63 - 1  # a line's under --scheduling-policy priority: the last to run
FINISHED = ("completed", "failed", "expired", "cancelled")
LEFT_ERRORS = {  # written for each line a batch did not answer, by why it ended
    "cancelled": {"code": "batch_cancelled",
                  "message": "the batch was cancelled before this request was answered"},
    "expired": {"code": "batch_expired", "message": "the batch's completion window ended "
                "before this request was answered"}}


@dataclass
class Batch:
    id: str
    endpoint: str
    input_file_id: str
    model: str
    metadata: dict[str, str] | None
    output_expiry_s: int
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "validating"
    times: dict[str, int] = field(default_factory=dict)  # "in_progress_at", ...
    errors: list[dict[str, Any]] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    summary: BatchSummary = field(default_factory=BatchSummary)
    task: asyncio.Task | None = None
    ending: str | None = None  # "cancelled" or "expired": why its task is cancelled

    def mark(self, status: str) -> None:
        """Enter ``status`` now (``in_progress_at``, ``failed_at``... say when)."""
        self.status = status
        self.times[f"{status}_at"] = int(time.time())

    def body(self) -> dict[str, Any]:
        """OpenAI's batch object."""
        s = self.summary
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "model": self.model,
            "errors": (None if self.errors is None else
                       {"object": "list", "data": self.errors}),
            "input_file_id": self.input_file_id, "completion_window": "24h",
            "status": self.status, "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id, "created_at": self.created_at,
            "expires_at": self.created_at + COMPLETION_WINDOW_S,
            **{name: self.times.get(name) for name in (
                "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                "cancelling_at", "cancelled_at")},
            "request_counts": {"total": self.total, "completed": self.completed,
                               "failed": self.failed},
            "usage": {"input_tokens": s.input_tokens,
                      "input_tokens_details": {"cached_tokens": s.cached_tokens},
                      "output_tokens": s.output_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": s.input_tokens + s.output_tokens},
            "metadata": self.metadata}


class BatchApi:
    """The Batch endpoints, and the Files endpoints they read and write through (``files``,
    a ``FilesApi`` over a store of ``capacity`` bytes; none where it is 0: each endpoint then
    says how to have one). ``read_json``: the server's bounded
    reading of a request's JSON body (of at most ``max_body_bytes``, as a batch's lines);
    ``broken``: the engine's error once it has failed for good; ``seats``: the lines a batch
    may have in flight at once (a line counts its sequences: ``n`` answers of each prompt);
    ``engine_stats``: the engine's counters as of its last step (``num_waiting``,
    ``num_steps``); ``by_priority``: the engine schedules by priority, and a batch's lines
    that name none get ``BATCH_PRIORITY`` (they run after clients' requests of any priority
    and are preempted first)."""

    def __init__(self, capacity: int, *, model: str, max_body_bytes: int, seats: int,
                 body_timeout_s: float, api_key: str | None, by_priority: bool = False,
                 read_json: Callable[[Request], Awaitable[Any]],
                 broken: Callable[[], BaseException | None],
                 engine_stats: Callable[[], dict[str, Any]]) -> None:
        self.files = FilesApi(capacity, body_timeout_s, self._pending_outputs)
        self.model = model
        self.max_line_bytes = max_body_bytes + LINE_OVERHEAD_BYTES
        self.seats = max(1, seats)
        self.headers = (() if api_key is None else
                        ((b"authorization", f"Bearer {api_key}".encode()),))
        self.read_json = read_json
        self.broken = broken
        self.engine_stats = engine_stats
        self.by_priority = by_priority
        self._admitted_at_step = -1  # the engine's step count when a batch's last line went
        self.completion_window_s: float = COMPLETION_WINDOW_S
        self.batches: dict[str, Batch] = {}  # in the order they were made
        self.app: Callable[..., Any] | None = None  # set by ``start``
        self._turn = asyncio.Lock()  # one batch runs at a time, in the order they came

    @property
    def store(self) -> FileStore | None:
        return self.files.store

    def start(self, app: Callable[..., Any]) -> None:
        """Open the store; batches will post their lines to ``app`` (the server's, middleware
        and all)."""
        self.app = app
        self.files.start()

    async def stop(self) -> None:
        """Cancel the batches that have not finished (their outputs so far kept till the
        store closes), then remove the files."""
        tasks = [b.task for b in self.batches.values() if b.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.files.close()

    def routes(self) -> list[Route]:
        handle = self.files.handle
        return [
            *self.files.routes(),
            Route("/v1/batches", handle(self.create_batch), methods=["POST"]),
            Route("/v1/batches", handle(self.list_batches), methods=["GET"]),
            Route("/v1/batches/{batch_id}", handle(self.get_batch), methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", handle(self.cancel_batch),
                  methods=["POST"]),
        ]

    def _pending_outputs(self) -> int:
        """The output files the batches not finished yet will keep."""
        return 2 * sum(b.status not in FINISHED for b in self.batches.values())

    # ----------------------------------------------------------------- batches
    async def create_batch(self, request: Request, store: FileStore) -> Response:
        body = await self.read_json(request)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        endpoint = body.get("endpoint")
        if endpoint not in URLS:
            raise bad_request(f"'endpoint' must be one of {', '.join(URLS)}, got "
                              f"{endpoint!r}.", "endpoint")
        if body.get("completion_window") != "24h":
            raise bad_request("'completion_window' must be '24h' (the one OpenAI takes).",
                              "completion_window")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise bad_request("'input_file_id' must be the id of an uploaded file.",
                              "input_file_id")
        metadata = None if body.get("metadata") is None else metadata_of(body["metadata"])
        output = body.get("output_expires_after")
        if output is not None and not isinstance(output, dict):
            raise bad_request("'output_expires_after' must be an object with 'anchor' and "
                              "'seconds'.", "output_expires_after")
        output = output or {}
        expiry = expiry_of(output.get("anchor"), output.get("seconds"), "output_expires_after")
        try:
            stored = store.get(file_id)
        except ApiError as e:
            e.param = "input_file_id"
            raise
        if stored.purpose != "batch":
            raise bad_request(f"{shown(file_id)} has the purpose {stored.purpose!r}; a "
                              "batch reads a "
                              "file uploaded with purpose 'batch'.", "input_file_id")
        if not self._forget_finished():
            raise ApiError(429, f"{MAX_BATCHES} batches have not finished; wait for some or "
                           "cancel them.", type="rate_limit_error", code="too_many_batches")
        self.files.check_file_count(store, new=2)  # (its outputs)
        batch = Batch(f"batch_{uuid.uuid4().hex}", endpoint, file_id, self.model, metadata,
                      DEFAULT_EXPIRY_S if expiry is None else expiry)
        self.batches[batch.id] = batch
        batch.task = asyncio.create_task(self._run(batch, store))
        return JSONResponse(batch.body())

    async def list_batches(self, request: Request, store: FileStore) -> Response:
        batches = [b.body() for b in self.batches.values()]
        return JSONResponse(paged(batches, dict(request.query_params), 20, 100, "batch"))

    async def get_batch(self, request: Request, store: FileStore) -> Response:
        return JSONResponse(self._batch(request).body())

    async def cancel_batch(self, request: Request, store: FileStore) -> Response:
        batch = self._batch(request)
        if batch.status in FINISHED:
            raise ApiError(409, f"the batch has {batch.status} already; only a batch that "
                           "is validating or in progress can be cancelled.",
                           code="batch_finished")
        if batch.status != "cancelling":
            batch.mark("cancelling")
            _end(batch, "cancelled")
        return JSONResponse(batch.body())

    def _batch(self, request: Request) -> Batch:
        batch_id = request.path_params["batch_id"]
        batch = self.batches.get(batch_id)
        if batch is None:
            raise ApiError(404, f"no batch has the id {batch_id!r} (batches are kept while "
                           f"the server runs, the {MAX_BATCHES} newest).", param="batch_id",
                           code="batch_not_found")
        return batch

    def _forget_finished(self) -> bool:
        """Make room for one more batch record; False where every one kept is running."""
        while len(self.batches) >= MAX_BATCHES:
            oldest = next((b for b in self.batches.values() if b.status in FINISHED), None)
            if oldest is None:
                return False
            del self.batches[oldest.id]
        return True

    # ----------------------------------------------------------------- running
    async def _run(self, batch: Batch, store: FileStore) -> None:
        """Wait for the batch's turn, check its file, answer its lines, keep the outputs.
        Cancelling the task cancels the batch; past its window it expires."""
        outputs: list[OutputFile] = []
        status, errors = "completed", None
        left = batch.created_at + self.completion_window_s - time.time()
        deadline = asyncio.get_running_loop().call_later(max(left, 0.0), _end, batch,
                                                          "expired")
        try:
            await self._take_turn(batch, store, outputs)
        except asyncio.CancelledError:  # (its task ends here: nothing waits on it)
            status = batch.ending or "cancelled"  # (or the server stops)
        except BatchFailed as e:
            status, errors = "failed", e.errors
        except StoreFull as e:
            status, errors = "failed", [_error("file_store_full", str(e))]
        except Exception as e:  # a defect: the batch fails, the server goes on
            logger.exception("batch %s failed", batch.id)
            status, errors = "failed", [_error("server_error",
                                               f"internal error: {type(e).__name__}")]
        finally:
            deadline.cancel()
            try:
                kept = [out.keep(batch.output_expiry_s) for out in outputs]
            except OSError as e:  # a full disk: nothing is kept
                for out in outputs:
                    out.discard()
                kept, status = [], "failed"
                errors = [_error("output_not_written", f"the outputs could not be written: {e}")]
            batch.output_file_id, batch.error_file_id = (kept + [None, None])[:2]
            batch.errors = errors or None
            batch.mark(status)

    async def _take_turn(self, batch: Batch, store: FileStore,
                         outputs: list[OutputFile]) -> None:
        """Batches run one at a time, in the order they were made (``validating`` till
        then); ``outputs``: the batch's output and error files, once it runs."""
        async with self._turn:
            try:
                _, source = store.open(batch.input_file_id)
            except ApiError:
                raise BatchFailed([_error("input_file_deleted", f"the input file "
                                          f"{batch.input_file_id} was deleted before the "
                                          "batch's turn came")]) from None
            with source:
                count, errors = await in_thread(check_input, source, batch.endpoint,
                                                 self.max_line_bytes)
                if errors:
                    raise BatchFailed(errors)
                batch.total = count
                batch.mark("in_progress")
                source.seek(0)
                outputs.append(OutputFile(store, f"{batch.id}_output.jsonl"))
                outputs.append(OutputFile(store, f"{batch.id}_error.jsonl"))
                await self._answer(batch, source, outputs)

    async def _answer(self, batch: Batch, source: BinaryIO, outputs: list[OutputFile]
                      ) -> None:
        def written(status: str) -> None:
            if status == "200":
                batch.completed += 1
            else:
                batch.failed += 1

        assert self.app is not None, "BatchApi.start was not called"

        def prepare(body: dict[str, Any]) -> None:
            # A batch's responses are not stored unless a line asks: they would push
            # clients' stored responses out of the store.
            if batch.endpoint == "/v1/responses":
                body.setdefault("store", False)
            # Its lines run after clients' requests (a beam search's rounds run at 0).
            if self.by_priority and body.get("use_beam_search") is not True:
                body.setdefault("priority", BATCH_PRIORITY)

        await run_batch(self.app, source, outputs[0], errors_out=outputs[1],
                        max_line_bytes=self.max_line_bytes, window_lines=self.seats,
                        window_bytes=WINDOW_BYTES, broken=self.broken, on_written=written,
                        summary=batch.summary, headers=self.headers, retry_busy=True,
                        prepare=prepare, admit=self._admit,
                        left_error=lambda: LEFT_ERRORS.get(batch.ending or ""))
        if batch.summary.stopped is not None:
            raise BatchFailed([_error("engine_stopped", f"{batch.summary.stopped}; the lines "
                                      "answered before it are in the output and error "
                                      "files")])
        batch.mark("finalizing")

    async def _admit(self, in_flight: int) -> None:
        """Wait till a batch's next line may go to the engine: one a step at most, and only
        while nothing waits in the engine's queue, so that the batch's lines do not pile up
        there ahead of clients' requests (the engine's counters are those of its last step;
        lines still being prepared, their images read and processed, are not in the queue
        yet and may reach it together, up to ``seats``). Where none of the batch's
        ``in_flight`` lines is (at its start, or after lines refused at once), a line goes
        without waiting for a step; once the engine is broken, at once (it is refused)."""
        while self.broken() is None:
            stats = self.engine_stats()
            steps = stats.get("num_steps", 0)
            if stats.get("num_waiting", 0) == 0 and (steps > self._admitted_at_step
                                                     or in_flight == 0):
                self._admitted_at_step = steps
                return
            await asyncio.sleep(ADMIT_POLL_S)


class BatchFailed(Exception):
    """A batch that cannot go on: its file has bad lines or was deleted before its turn, or
    the engine broke."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(errors[0]["message"])
        self.errors = errors


def _end(batch: Batch, why: str) -> None:
    """Cancel ``batch``'s task, saying ``why`` (the first reason given stays)."""
    if batch.ending is None:
        batch.ending = why
        assert batch.task is not None
        batch.task.cancel()


def _error(code: str, message: str) -> dict[str, Any]:
    """A batch's error that is no line's."""
    return {"code": code, "line": None, "message": message, "param": None}


def check_input(source: BinaryIO, endpoint: str, max_line_bytes: int
                ) -> tuple[int, list[dict[str, Any]]]:
    """The requests in a batch input file, and the errors of the lines that are none (the
    first ``MAX_LINE_ERRORS``, then one that counts the rest): OpenAI's batch errors, each
    with its line's number."""
    seen: set[bytes] = set()
    errors: list[dict[str, Any]] = []
    count = number = more = 0

    def error(code: str, message: str, param: str | None = None) -> None:
        nonlocal more
        if len(errors) < MAX_LINE_ERRORS:
            errors.append({"code": code, "line": number, "message": message[:MAX_ERROR_CHARS],
                           "param": param})
        else:
            more += 1

    while line := source.readline(max_line_bytes + 2):
        number += 1
        if len(line) - line.endswith(b"\n") > max_line_bytes:
            while line and not line.endswith(b"\n"):
                line = source.readline(1 << 20)
            error("line_too_long", f"the line is over {max_line_bytes} bytes "
                  "(--max-request-body-bytes); send smaller images or fewer of them")
            continue
        if not line.strip():
            continue
        try:
            request = parse_line(line, seen)
        except LineError as e:
            error(e.code, str(e))
            continue
        if request.url != endpoint:
            error("mismatched_url", f"the line's url is {request.url}, the batch's endpoint "
                  f"{endpoint}: a batch's requests all go to its endpoint", "url")
        elif request.stream:
            error("invalid_request", f"{request.url} is answered whole in a batch; leave "
                  "'stream' out", "body.stream")
        elif request.background:
            error("invalid_request", "a batch's requests are answered in it; leave "
                  "'background' out", "body.background")
        count += 1
        if count > MAX_REQUESTS:
            error("too_many_requests", f"a batch holds at most {MAX_REQUESTS} requests; split "
                  "the file")
            break
    if more:
        errors.append(_error("more_errors", f"{more} more lines have errors"))
    if not count and not errors:
        errors.append(_error("empty_file", "the file holds no requests"))
    return count, errors


__all__ = ["BatchApi", "check_input"]
