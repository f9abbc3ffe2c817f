"""OpenAI's Files API, as the openai client's ``files`` calls it: upload a file
(``POST /v1/files``, multipart, ``purpose`` ``batch`` for a batch's requests or ``vision`` /
``user_data`` for images), list them (``GET /v1/files``), look one up, read its bytes and delete
it (``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``).
Batches (``batch_api.py``) read their input files here and keep their outputs here; requests
name uploaded images by their ids (a Responses API ``input_image``'s ``file_id``, a chat
``file`` part's: ``image_path``).

The bytes live in ``file_store.py``'s folder, at most ``--files-store-mib`` of them. An upload
holds the bytes it has sent while its form is read (Starlette spools it to a temporary file
first), so that uploads at once cannot together take more than the store has room for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, BinaryIO

from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mmserve.entrypoints.file_store import MAX_FILES, FileStore, StoreFull, shown
from mmserve.entrypoints.http_middleware import store_endpoint
from mmserve.entrypoints.openai_protocol import ApiError, bad_request, paged
from mmserve.errors import InvalidInputError

MAX_FILE_BYTES = 200 * 1024 * 1024  # an upload, as OpenAI's batch input files
# A file's life, unless its upload (or its batch, for outputs) says otherwise: 30 days, as
# OpenAI keeps batch files; a request may ask for 1 hour to 30 days.
DEFAULT_EXPIRY_S = 30 * 24 * 3600
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600
UPLOAD_TIMEOUT_FACTOR = 10  # an upload may take ten times --body-timeout
FORM_OVERHEAD_BYTES = 64 * 1024  # an upload's form fields and part headers beside the file
PURPOSES = ("batch", "vision", "user_data")  # of uploads
IMAGE_PURPOSES = ("vision", "user_data")  # of the files requests may name as images


class FilesApi:
    """The Files endpoints over a ``FileStore`` of ``capacity`` bytes (none where it is 0:
    each endpoint then says how to have one). ``pending_outputs``: the files batches not
    finished yet will add (they count against ``MAX_FILES`` from the start)."""

    def __init__(self, capacity: int, body_timeout_s: float,
                 pending_outputs: Callable[[], int]) -> None:
        self.capacity = capacity
        self.store: FileStore | None = None  # made by ``start``
        self.upload_timeout_s = body_timeout_s * UPLOAD_TIMEOUT_FACTOR
        self.pending_outputs = pending_outputs
        # Uploads sent in parts and not completed yet (``uploads_api.py`` sets it).
        self.pending_uploads: Callable[[], int] = lambda: 0

    def start(self) -> None:
        if self.capacity > 0:
            self.store = FileStore(self.capacity)

    def close(self) -> None:
        """Remove the files."""
        if self.store is not None:
            self.store.close()

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", self.handle(self.upload), methods=["POST"]),
            Route("/v1/files", self.handle(self.list_files), methods=["GET"]),
            Route("/v1/files/{file_id}", self.handle(self.get_file), methods=["GET"]),
            Route("/v1/files/{file_id}", self.handle(self.delete_file), methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", self.handle(self.file_content),
                  methods=["GET"]),
        ]

    def handle(self, handler: Callable[[Request, FileStore], Awaitable[Response]]
               ) -> Callable[[Request], Awaitable[Response]]:
        """``handler(request, store)`` as an endpoint: its ``ApiError`` as OpenAI's error
        body; without a store, a 404 that says how to have one."""
        return store_endpoint(handler, lambda: self.store, lambda: ApiError(
            404, "this server keeps no files, so it takes no uploads and runs no batches: "
            "start it with --files-store-mib above 0.", code="files_disabled"))

    def image_path(self, file_id: str) -> str:
        """Where an uploaded image a request names is; an ``InvalidInputError`` where no
        image was uploaded with that id."""
        assert self.store is not None, "FilesApi.start made no store"
        stored = self.store.files.get(file_id)
        if stored is None:
            raise InvalidInputError(f"an image names the file {shown(file_id)}, and no file "
                                    "has that id: upload the image first (files.create, "
                                    "purpose 'vision').")
        if stored.purpose not in IMAGE_PURPOSES:
            raise InvalidInputError(f"an image names the file {shown(file_id)}, which has "
                                    f"the purpose {stored.purpose!r}; upload images with "
                                    "purpose 'vision' or 'user_data'.")
        return stored.path

    def check_file_count(self, store: FileStore, new: int = 1) -> None:
        """Refuse ``new`` files more where the store, with the outputs batches not finished
        yet will keep (``pending_outputs``), would hold more than ``MAX_FILES``."""
        store.sweep()
        pending = self.pending_outputs() + self.pending_uploads()
        if len(store.files) + pending + new > MAX_FILES:
            raise ApiError(409, f"the server keeps at most {MAX_FILES} files, counting the "
                           f"outputs of batches still running and the uploads pending "
                           f"({pending}); delete files no longer needed.",
                           code="too_many_files")

    async def upload(self, request: Request, store: FileStore) -> Response:
        require_multipart(request, "'file' and 'purpose' ('batch', 'vision' or 'user_data'), "
                          "as the openai client's files.create does")
        self.check_file_count(store)
        cap = min(MAX_FILE_BYTES, store.room)
        too_big = ApiError(413, f"the file is over {cap} bytes: the most the file store takes "
                           f"now ({store.used} of {store.capacity} bytes used, "
                           f"--files-store-mib; an upload at most {MAX_FILE_BYTES}); split "
                           "it or delete files no longer needed.", code="file_too_large")
        async with self.form(request, store, cap, too_big) as form:
            upload, purpose = form.get("file"), form.get("purpose")
            if purpose not in PURPOSES:
                raise bad_request(f"'purpose' must be 'batch' (a batch's requests), or 'vision' "
                                  f"or 'user_data' (images requests name by file_id), got "
                                  f"{shown(purpose)}.", "purpose")
            if not isinstance(upload, UploadFile):
                raise bad_request("the form has no file: send it as the 'file' field.", "file")
            expiry = expiry_of(form.get("expires_after[anchor]"),
                               form.get("expires_after[seconds]"), "expires_after")
            size = upload.size or 0
            if size > cap:
                raise too_big
            file_id, path = store.new_path()
            await copy_into(upload.file, path)
            store.used += size  # (the form's hold is released as it closes)
            name = os.path.basename(upload.filename or "") or "upload.jsonl"
            stored = store.add(file_id, path, name[:255], purpose, size,
                               DEFAULT_EXPIRY_S if expiry is None else expiry)
        return JSONResponse(stored.body())

    @contextlib.asynccontextmanager
    async def form(self, request: Request, store: FileStore | None, cap: int,
                   too_big: ApiError) -> AsyncIterator[FormData]:
        """A multipart upload's form (one file of at most ``cap`` bytes, else ``too_big``),
        read within the upload's time. The bytes received are held in ``store`` (None: room
        held already) while the form is read (Starlette spools it to a temporary file first)
        and until the block ends, so that uploads at once cannot together take more than it
        has room for; a body of known length holds its room at once."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > cap + FORM_OVERHEAD_BYTES:
            raise too_big
        held = 0

        def hold(size: int) -> None:
            nonlocal held
            if store is not None and size > held:
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
            try:
                form = await asyncio.wait_for(
                    Request(request.scope, receive).form(max_files=1, max_fields=8),
                    self.upload_timeout_s)
            except HTTPException as e:  # the form could not be read
                raise bad_request(f"the upload is not a form that can be read: "
                                  f"{e.detail}") from None
            except ClientDisconnect:
                raise bad_request("the client disconnected while sending the file") from None
            except asyncio.TimeoutError:
                raise ApiError(408, f"the upload took longer than {self.upload_timeout_s:g} s "
                               "(ten times --body-timeout); send it faster or split it.",
                               code="request_timeout", headers={"Connection": "close"}) from None
            try:
                yield form
            finally:
                await form.close()
        finally:
            if store is not None:
                store.used -= held

    async def list_files(self, request: Request, store: FileStore) -> Response:
        query = dict(request.query_params)
        files = [f.body() for f in store.listed(query.pop("purpose", None))]
        return JSONResponse(paged(files, query, MAX_FILES, MAX_FILES, "file"))

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


def require_multipart(request: Request, fields: str) -> None:
    """Refuse a body that is not a multipart form (``fields``: what it should hold)."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request(f"upload the file as multipart/form-data, with the fields {fields}.")


async def in_thread(func: Callable[..., Any], *args: Any) -> Any:
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


def expiry_of(anchor: Any, seconds: Any, param: str) -> int | None:
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


async def copy_into(source: BinaryIO, path: str) -> None:
    """Copy an uploaded file's bytes to ``path`` on a thread (nothing left there where it
    fails)."""
    try:
        await in_thread(_copy, source, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise


def _copy(source: BinaryIO, path: str) -> None:
    source.seek(0)
    with open(path, "wb") as target:
        shutil.copyfileobj(source, target, 1 << 20)


def _chunks(source: BinaryIO) -> Iterator[bytes]:
    """A file's bytes, a MiB at a time (read on Starlette's threads), closed at the end."""
    with source:
        while chunk := source.read(1 << 20):
            yield chunk
