"""OpenAI's Files and Batch APIs, as the openai client's ``files`` and ``batches`` call them:
upload a file of batch requests (``POST /v1/files``, ``purpose: "batch"``), start a batch over
it (``POST /v1/batches``), follow it (``GET /v1/batches/{id}``, ``GET /v1/batches``), cancel it
(``POST /v1/batches/{id}/cancel``) and download its answers (``GET /v1/files/{id}/content``);
files are listed, looked up and deleted (``GET``/``DELETE /v1/files/{id}``). Images uploaded
(``purpose`` ``vision`` or ``user_data``) are named by requests: a Responses API
``input_image``'s ``file_id``, a chat ``file`` part's (``image_path``).

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
in the store keeps what it answered before.

Files live in ``file_store.py``'s folder, at most ``--files-store-mib`` of them; a batch's
record is kept while the server runs (the ``MAX_BATCHES`` newest).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mmserve.entrypoints.file_store import MAX_FILES, FileStore, OutputFile, StoredFile, StoreFull
from mmserve.entrypoints.http_middleware import error_response
from mmserve.entrypoints.openai_protocol import ApiError, bad_request
from mmserve.entrypoints.openai_shapes import list_page
from mmserve.entrypoints.run_batch import (
    LINE_OVERHEAD_BYTES,
    URLS,
    BatchSummary,
    LineError,
    parse_line,
    run_batch,
)
from mmserve.errors import InvalidInputError

logger = logging.getLogger(__name__)

MAX_FILE_BYTES = 200 * 1024 * 1024  # an upload, as OpenAI's batch input files
MAX_REQUESTS = 50_000  # in one batch, as OpenAI's
MAX_LINE_ERRORS = 100  # a failed batch's errors listed (the count of the rest after them)
MAX_ERROR_CHARS = 300  # of each error's message
MAX_BATCHES = 1_000  # records kept; the oldest finished are forgotten past it
COMPLETION_WINDOW_S = 24 * 3600  # "24h", the one window OpenAI takes
# A file's life, unless its upload (or its batch, for outputs) says otherwise: 30 days, as
# OpenAI keeps batch files; a request may ask for 1 hour to 30 days.
DEFAULT_EXPIRY_S = 30 * 24 * 3600
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600
UPLOAD_TIMEOUT_FACTOR = 10  # an upload may take ten times --body-timeout
FORM_OVERHEAD_BYTES = 64 * 1024  # an upload's form fields and part headers beside the file
WINDOW_BYTES = 64 * 1024 * 1024  # a batch's requests and answers held at once
ADMIT_POLL_S = 0.005  # how often a batch's next line looks for room in the engine (_admit)
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
FINISHED = ("completed", "failed", "expired", "cancelled")
PURPOSES = ("batch", "vision", "user_data")  # of uploads
IMAGE_PURPOSES = ("vision", "user_data")  # of the files requests may name as images


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
    """The Files and Batch endpoints over a ``FileStore`` of ``capacity`` bytes (none where it
    is 0: each endpoint then says how to turn them on). ``read_json``: the server's bounded
    reading of a request's JSON body (of at most ``max_body_bytes``, as a batch's lines);
    ``broken``: the engine's error once it has failed for good; ``seats``: the lines a batch
    may have in flight at once (a line asking for several answers counts once);
    ``engine_stats``: the engine's counters as of its last step (``num_waiting``,
    ``num_steps``)."""

    def __init__(self, capacity: int, *, model: str, max_body_bytes: int, seats: int,
                 body_timeout_s: float, api_key: str | None,
                 read_json: Callable[[Request], Awaitable[Any]],
                 broken: Callable[[], BaseException | None],
                 engine_stats: Callable[[], dict[str, Any]]) -> None:
        self.capacity = capacity
        self.store: FileStore | None = None  # made by ``start``
        self.model = model
        self.max_line_bytes = max_body_bytes + LINE_OVERHEAD_BYTES
        self.seats = max(1, seats)
        self.upload_timeout_s = body_timeout_s * UPLOAD_TIMEOUT_FACTOR
        self.headers = (() if api_key is None else
                        ((b"authorization", f"Bearer {api_key}".encode()),))
        self.read_json = read_json
        self.broken = broken
        self.engine_stats = engine_stats
        self._admitted_at_step = -1  # the engine's step count when a batch's last line went
        self.completion_window_s: float = COMPLETION_WINDOW_S
        self.batches: dict[str, Batch] = {}  # in the order they were made
        self.app: Callable[..., Any] | None = None  # set by ``start``
        self._turn = asyncio.Lock()  # one batch runs at a time, in the order they came

    def start(self, app: Callable[..., Any]) -> None:
        """Open the store; batches will post their lines to ``app`` (the server's, middleware
        and all)."""
        self.app = app
        if self.capacity > 0:
            self.store = FileStore(self.capacity)

    async def stop(self) -> None:
        """Cancel the batches that have not finished (their outputs so far kept till the
        store closes), then remove the files."""
        tasks = [b.task for b in self.batches.values() if b.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.store is not None:
            self.store.close()

    def image_path(self, file_id: str) -> str:
        """Where an uploaded image a request names is; an ``InvalidInputError`` where no
        image was uploaded with that id."""
        assert self.store is not None, "BatchApi.start made no store"
        stored = self.store.files.get(file_id)
        if stored is None:
            raise InvalidInputError(f"an image names the file {_shown(file_id)}, and no file "
                                    "has that id: upload the image first (files.create, "
                                    "purpose 'vision').")
        if stored.purpose not in IMAGE_PURPOSES:
            raise InvalidInputError(f"an image names the file {_shown(file_id)}, which has "
                                    f"the purpose {stored.purpose!r}; upload images with "
                                    "purpose 'vision' or 'user_data'.")
        return stored.path

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", self._handle(self.upload), methods=["POST"]),
            Route("/v1/files", self._handle(self.list_files), methods=["GET"]),
            Route("/v1/files/{file_id}", self._handle(self.get_file), methods=["GET"]),
            Route("/v1/files/{file_id}", self._handle(self.delete_file), methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", self._handle(self.file_content),
                  methods=["GET"]),
            Route("/v1/batches", self._handle(self.create_batch), methods=["POST"]),
            Route("/v1/batches", self._handle(self.list_batches), methods=["GET"]),
            Route("/v1/batches/{batch_id}", self._handle(self.get_batch), methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self._handle(self.cancel_batch),
                  methods=["POST"]),
        ]

    def _handle(self, handler: Callable[[Request, FileStore], Awaitable[Response]]
                ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            if self.capacity == 0 or self.store is None:
                return error_response(ApiError(
                    404, "this server keeps no files, so it runs no batches: start it with "
                    "--files-store-mib above 0.", code="files_disabled"))
            try:
                return await handler(request, self.store)
            except ApiError as e:
                return error_response(e)
        return endpoint

    # ----------------------------------------------------------------- files
    async def upload(self, request: Request, store: FileStore) -> Response:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise bad_request("upload the file as multipart/form-data, with the fields 'file' "
                              "and 'purpose' ('batch', 'vision' or 'user_data'), as the "
                              "openai client's files.create does.")
        self._check_file_count(store)
        cap = min(MAX_FILE_BYTES, store.room)
        too_big = ApiError(413, f"the file is over {cap} bytes: the most the file store takes "
                           f"now ({store.used} of {store.capacity} bytes used, "
                           f"--files-store-mib; an upload at most {MAX_FILE_BYTES}); split "
                           "it or delete files no longer needed.", code="file_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > cap + FORM_OVERHEAD_BYTES:
            raise too_big
        # The bytes received are held in the store while the form is read (Starlette spools
        # it to a temporary file first), so that uploads at once cannot together take more
        # than it has room for; a body of known length holds its room at once.
        held = 0

        def hold(size: int) -> None:
            nonlocal held
            if size > held:
                try:
                    store.reserve(size - held)
                except StoreFull:
                    raise too_big from None
                held = size

        received = 0

        async def receive() -> dict[str, Any]:
            nonlocal received
            message = await request.receive()
            received += len(message.get("body", b""))
            if received > cap + FORM_OVERHEAD_BYTES:
                raise too_big
            hold(received)
            return message

        try:
            hold(min(int(length), cap) if length.isdigit() else 0)
            stored = await self._receive_upload(Request(request.scope, receive), store, cap,
                                                too_big)
        finally:
            store.used -= held
        return JSONResponse(stored.body())

    async def _receive_upload(self, request: Request, store: FileStore, cap: int,
                              too_big: ApiError) -> StoredFile:
        try:
            form = await asyncio.wait_for(request.form(max_files=1, max_fields=8),
                                          self.upload_timeout_s)
        except HTTPException as e:  # the form could not be read
            raise bad_request(f"the upload is not a form that can be read: {e.detail}") from None
        except ClientDisconnect:
            raise bad_request("the client disconnected while sending the file") from None
        except asyncio.TimeoutError:
            raise ApiError(408, f"the upload took longer than {self.upload_timeout_s:g} s "
                           "(ten times --body-timeout); send it faster or split it.",
                           code="request_timeout", headers={"Connection": "close"}) from None
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if purpose not in PURPOSES:
                raise bad_request(f"'purpose' must be 'batch' (a batch's requests), or 'vision' "
                                  f"or 'user_data' (images requests name by file_id), got "
                                  f"{_shown(purpose)}.", "purpose")
            if not isinstance(upload, UploadFile):
                raise bad_request("the form has no file: send it as the 'file' field.", "file")
            expiry = _expiry(form.get("expires_after[anchor]"),
                             form.get("expires_after[seconds]"), "expires_after")
            size = upload.size or 0
            if size > cap:
                raise too_big
            file_id, path = store.new_path()
            try:
                await _in_thread(_copy, upload.file, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                raise
            store.used += size  # (the upload's hold is released by the caller)
            name = os.path.basename(upload.filename or "") or "upload.jsonl"
            return store.add(file_id, path, name[:255], purpose, size,
                             DEFAULT_EXPIRY_S if expiry is None else expiry)
        finally:
            await form.close()

    async def list_files(self, request: Request, store: FileStore) -> Response:
        query = dict(request.query_params)
        files = [f.body() for f in store.listed(query.pop("purpose", None))]
        return JSONResponse(_page(files, query, MAX_FILES, MAX_FILES, "file"))

    async def get_file(self, request: Request, store: FileStore) -> Response:
        return JSONResponse(store.get(request.path_params["file_id"]).body())

    async def delete_file(self, request: Request, store: FileStore) -> Response:
        file_id = request.path_params["file_id"]
        store.delete(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    async def file_content(self, request: Request, store: FileStore) -> Response:
        stored, source = store.open(request.path_params["file_id"])
        return StreamingResponse(_chunks(source), media_type="application/octet-stream",
                                 headers={"Content-Length": str(stored.bytes)})

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
        metadata = _metadata(body.get("metadata"))
        output = body.get("output_expires_after")
        if output is not None and not isinstance(output, dict):
            raise bad_request("'output_expires_after' must be an object with 'anchor' and "
                              "'seconds'.", "output_expires_after")
        output = output or {}
        expiry = _expiry(output.get("anchor"), output.get("seconds"), "output_expires_after")
        try:
            stored = store.get(file_id)
        except ApiError as e:
            e.param = "input_file_id"
            raise
        if stored.purpose != "batch":
            raise bad_request(f"{_shown(file_id)} has the purpose {stored.purpose!r}; a "
                              "batch reads a "
                              "file uploaded with purpose 'batch'.", "input_file_id")
        if not self._forget_finished():
            raise ApiError(429, f"{MAX_BATCHES} batches have not finished; wait for some or "
                           "cancel them.", type="rate_limit_error", code="too_many_batches")
        self._check_file_count(store, new=2)  # (its outputs)
        batch = Batch(f"batch_{uuid.uuid4().hex}", endpoint, file_id, self.model, metadata,
                      DEFAULT_EXPIRY_S if expiry is None else expiry)
        self.batches[batch.id] = batch
        batch.task = asyncio.create_task(self._run(batch, store))
        return JSONResponse(batch.body())

    async def list_batches(self, request: Request, store: FileStore) -> Response:
        batches = [b.body() for b in self.batches.values()]
        return JSONResponse(_page(batches, dict(request.query_params), 20, 100, "batch"))

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
            assert batch.task is not None
            batch.task.cancel()
        return JSONResponse(batch.body())

    def _batch(self, request: Request) -> Batch:
        batch_id = request.path_params["batch_id"]
        batch = self.batches.get(batch_id)
        if batch is None:
            raise ApiError(404, f"no batch has the id {batch_id!r} (batches are kept while "
                           f"the server runs, the {MAX_BATCHES} newest).", param="batch_id",
                           code="batch_not_found")
        return batch

    def _check_file_count(self, store: FileStore, new: int = 1) -> None:
        """Refuse ``new`` files more where the store, with the two outputs each batch not
        finished yet will keep, would hold more than ``MAX_FILES``."""
        store.sweep()
        pending = 2 * sum(b.status not in FINISHED for b in self.batches.values())
        if len(store.files) + pending + new > MAX_FILES:
            raise ApiError(409, f"the server keeps at most {MAX_FILES} files, counting the "
                           f"outputs of batches still running ({pending}); delete files no "
                           "longer needed.", code="too_many_files")

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
        try:
            left = batch.created_at + self.completion_window_s - time.time()
            await asyncio.wait_for(self._take_turn(batch, store, outputs), left)
        except asyncio.TimeoutError:
            status = "expired"
        except asyncio.CancelledError:
            status = "cancelled"  # (its task ends here: nothing waits on it)
        except BatchFailed as e:
            status, errors = "failed", e.errors
        except StoreFull as e:
            status, errors = "failed", [_error("file_store_full", str(e))]
        except Exception as e:  # a defect: the batch fails, the server goes on
            logger.exception("batch %s failed", batch.id)
            status, errors = "failed", [_error("server_error",
                                               f"internal error: {type(e).__name__}")]
        finally:
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
                count, errors = await _in_thread(check_input, source, batch.endpoint,
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
        # A batch's responses are not stored unless a line asks: they would push clients'
        # stored responses out of the store.
        defaults = {"store": False} if batch.endpoint == "/v1/responses" else None
        await run_batch(self.app, source, outputs[0], errors_out=outputs[1],
                        max_line_bytes=self.max_line_bytes, window_lines=self.seats,
                        window_bytes=WINDOW_BYTES, broken=self.broken, on_written=written,
                        summary=batch.summary, headers=self.headers, retry_busy=True,
                        defaults=defaults, admit=self._admit)
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


async def _in_thread(func: Callable[..., Any], *args: Any) -> Any:
    """``func(*args)`` on a thread; a cancellation waits for it to return before it goes on
    (``func`` uses files the caller closes or removes)."""
    future = asyncio.ensure_future(asyncio.to_thread(func, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():  # (however often it is cancelled meanwhile)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([future])
        raise


def _error(code: str, message: str) -> dict[str, Any]:
    """A batch's error that is no line's."""
    return {"code": code, "line": None, "message": message, "param": None}


def _page(items: list[dict[str, Any]], query: dict[str, str], default_limit: int,
          max_limit: int, what: str) -> dict[str, Any]:
    try:
        return list_page(items, query, default_limit, max_limit, what)
    except ValueError as e:  # "limit: must be ..."
        param, _, message = str(e).partition(": ")
        raise bad_request(f"'{param}' {message}.", param) from None


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


def _expiry(anchor: Any, seconds: Any, param: str) -> int | None:
    """An ``expires_after`` (``anchor`` ``created_at``, ``seconds`` from 1 hour to 30 days) in
    seconds; None where both are left out."""
    if anchor is None and seconds is None:
        return None
    try:
        value = int(seconds)
    except (TypeError, ValueError):
        value = 0
    if anchor != "created_at" or not MIN_EXPIRY_S <= value <= MAX_EXPIRY_S:
        raise bad_request(f"'{param}' must have 'anchor' 'created_at' and 'seconds' from "
                          f"{MIN_EXPIRY_S} to {MAX_EXPIRY_S}.", param)
    return value


def _metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's ``metadata``: at most 16 string keys of up to 64 characters, with string
    values of up to 512."""
    if metadata is None:
        return None
    if not (isinstance(metadata, dict) and len(metadata) <= METADATA_KEYS and all(
            isinstance(k, str) and len(k) <= METADATA_KEY_CHARS and isinstance(v, str)
            and len(v) <= METADATA_VALUE_CHARS for k, v in metadata.items())):
        raise bad_request(f"'metadata' must be an object of at most {METADATA_KEYS} keys of up "
                          f"to {METADATA_KEY_CHARS} characters, with strings of up to "
                          f"{METADATA_VALUE_CHARS} characters as values.", "metadata")
    return metadata


def _shown(value: Any) -> str:
    """``value`` as an error message shows it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _copy(source: BinaryIO, path: str) -> None:
    source.seek(0)
    with open(path, "wb") as target:
        shutil.copyfileobj(source, target, 1 << 20)


def _chunks(source: BinaryIO) -> Iterator[bytes]:
    """A file's bytes, a MiB at a time (read on Starlette's threads), closed at the end."""
    with source:
        while chunk := source.read(1 << 20):
            yield chunk


__all__ = ["BatchApi", "StoredFile", "check_input"]
