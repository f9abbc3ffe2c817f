"""OpenAI's Uploads API, as the openai client's ``uploads`` calls it (and its
``uploads.upload_file_chunked``): a file sent in parts, which becomes a file of the Files API.

- ``POST /v1/uploads`` (``bytes``, ``filename``, ``mime_type``, ``purpose``, optional
  ``expires_after`` for the file it makes): a pending upload, its ``bytes`` held in the file
  store from the start;
- ``POST /v1/uploads/{id}/parts`` (multipart, the part in ``data``): a part of at most
  ``MAX_PART_BYTES``, the parts together at most the upload's ``bytes``;
- ``POST /v1/uploads/{id}/complete`` (``part_ids`` in order, optional ``md5`` of the whole):
  the parts put together as the file (its ``file`` in the answer), when they add up to
  ``bytes``;
- ``POST /v1/uploads/{id}/cancel``: its parts removed.

An upload not completed within ``UPLOAD_LIFE_S`` expires as OpenAI's do: its parts are removed
and its room given back. A file is at most ``files_api.MAX_FILE_BYTES``, as one sent whole.
The upload's room holds its parts, those stored and those arriving (each part spooled while
its form is read, then copied in; parts at once may together bring no more than the upload
lacks). While the parts are put together the file grows as each part, copied into it, is
removed, so the store's folder holds at most one part's bytes more than the upload holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mmserve.entrypoints.file_store import FileStore, StoredFile, StoreFull, shown
from mmserve.entrypoints.files_api import (
    DEFAULT_EXPIRY_S,
    MAX_FILE_BYTES,
    PURPOSES,
    FilesApi,
    copy_into,
    expiry_of,
    in_thread,
    require_multipart,
)
from mmserve.entrypoints.openai_protocol import ApiError, bad_request

MAX_PART_BYTES = 64 * 1024 * 1024  # as OpenAI's
PART_FRAMING_BYTES = 1024  # at most, around a part's bytes in its multipart form
MAX_PARTS = 1000  # of one upload
MAX_PENDING_UPLOADS = 64
UPLOAD_LIFE_S = 3600  # an upload not completed within an hour expires, as OpenAI's


@dataclass
class Upload:
    id: str
    filename: str
    purpose: str
    bytes: int
    mime_type: str
    created_at: int
    file_expiry_s: int
    status: str = "pending"  # then "completed" or "cancelled" ("expired" once too late)
    parts: dict[str, tuple[str, int]] = field(default_factory=dict)  # id -> (path, size)
    received: int = 0
    arriving: int = 0  # bytes the parts being received may still bring
    parts_arriving: int = 0
    busy: bool = False  # being put together
    file: StoredFile | None = None
    timer: asyncio.TimerHandle | None = None

    def body(self) -> dict[str, Any]:
        """OpenAI's upload object."""
        return {"id": self.id, "object": "upload", "bytes": self.bytes,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": self.status,
                "expires_at": self.created_at + UPLOAD_LIFE_S,
                "file": None if self.file is None else self.file.body()}


class UploadsApi:
    """The Uploads endpoints, over the file store of ``files`` (none where the server keeps
    no files: each endpoint then says how to have one); ``read_json``: the server's bounded
    reading of a request's JSON body."""

    def __init__(self, files: FilesApi, read_json: Callable[[Request], Awaitable[Any]]) -> None:
        self.files = files
        self.read_json = read_json
        self.uploads: dict[str, Upload] = {}  # pending ones
        files.pending_uploads = lambda: len(self.uploads)  # (each counts as the file it makes)

    def routes(self) -> list[Route]:
        base = "/v1/uploads/{upload_id}"
        handle = self.files.handle
        return [Route("/v1/uploads", handle(self.create), methods=["POST"]),
                Route(f"{base}/parts", handle(self.add_part), methods=["POST"]),
                Route(f"{base}/complete", handle(self.complete), methods=["POST"]),
                Route(f"{base}/cancel", handle(self.cancel), methods=["POST"])]

    def close(self) -> None:
        """Forget the pending uploads (their parts go with the store's folder)."""
        for upload in self.uploads.values():
            if upload.timer is not None:
                upload.timer.cancel()
        self.uploads.clear()

    # ----------------------------------------------------------------- endpoints
    async def create(self, request: Request, store: FileStore) -> Response:
        body = await self._body(request)
        size, filename, purpose = body.get("bytes"), body.get("filename"), body.get("purpose")
        if not (isinstance(size, int) and not isinstance(size, bool)
                and 0 < size <= MAX_FILE_BYTES):
            raise bad_request(f"'bytes' must be the file's size, from 1 to {MAX_FILE_BYTES}",
                              "bytes")
        if not (isinstance(filename, str) and filename):
            raise bad_request("'filename' must be the file's name", "filename")
        if purpose not in PURPOSES:
            raise bad_request(f"'purpose' must be 'batch', 'vision' or 'user_data', got "
                              f"{shown(purpose)}.", "purpose")
        if not isinstance(body.get("mime_type"), str):
            raise bad_request("'mime_type' must be the file's MIME type", "mime_type")
        after = body.get("expires_after") or {}
        expiry = expiry_of(after.get("anchor"), after.get("seconds"), "expires_after") \
            if isinstance(after, dict) else expiry_of("", None, "expires_after")
        if len(self.uploads) >= MAX_PENDING_UPLOADS:
            raise ApiError(409, f"{MAX_PENDING_UPLOADS} uploads are pending already: complete "
                           "or cancel one first.", code="too_many_uploads")
        self.files.check_file_count(store)  # (a pending upload counts as its file)
        try:
            store.reserve(size)
        except StoreFull as e:
            raise ApiError(413, f"{e}; the upload's {size} bytes do not fit.", "bytes",
                           code="file_too_large") from None
        upload = Upload(f"upload_{uuid.uuid4().hex}", os.path.basename(filename)[:255] or
                        "upload", purpose, size, body["mime_type"], int(time.time()),
                        DEFAULT_EXPIRY_S if expiry is None else expiry)
        self.uploads[upload.id] = upload
        upload.timer = asyncio.get_running_loop().call_later(
            UPLOAD_LIFE_S, self._expire, upload, store)
        return JSONResponse(upload.body())

    async def add_part(self, request: Request, store: FileStore) -> Response:
        require_multipart(request, "'data' (a part of the upload)")
        upload = self._pending(request)
        if len(upload.parts) + upload.parts_arriving >= MAX_PARTS:
            raise ApiError(409, f"an upload takes at most {MAX_PARTS} parts: send larger ones "
                           f"(up to {MAX_PART_BYTES} bytes).", code="too_many_parts")
        # A part may bring what the upload still lacks, less what parts arriving at the same
        # time may bring: the upload's room, held since it was made, holds them all. Each
        # claims its length less its form's framing while its form is read (so parts that
        # fill the upload exactly all fit), then what it brought.
        left = upload.bytes - upload.received - upload.arriving
        length = request.headers.get("content-length", "")
        estimate = int(length) - PART_FRAMING_BYTES if length.isdigit() else left
        claim = max(0, min(MAX_PART_BYTES, left, estimate))

        def too_big(room: int) -> ApiError:
            return ApiError(413, f"the part is over {max(room, 0)} bytes: a part is at most "
                            f"{MAX_PART_BYTES}, and the parts together at most the upload's "
                            f"{upload.bytes} bytes ({upload.received} received, "
                            f"{upload.arriving} arriving).", code="part_too_large")
        if left <= 0:
            raise too_big(left)
        upload.arriving += claim
        upload.parts_arriving += 1
        try:
            async with self.files.form(request, None, claim, too_big(claim)) as form:
                data = form.get("data")
                if not isinstance(data, UploadFile):
                    raise bad_request("the form has no part: send it as the 'data' field.",
                                      "data")
                size = data.size or 0
                room = min(MAX_PART_BYTES,
                           upload.bytes - upload.received - (upload.arriving - claim))
                if size > room:
                    raise too_big(room)
                upload.arriving += size - claim
                claim = size
                part_id, path = f"part_{uuid.uuid4().hex}", os.path.join(
                    store.folder, f"{upload.id}-{uuid.uuid4().hex}")
                await copy_into(data.file, path)
        finally:
            upload.arriving -= claim
            upload.parts_arriving -= 1
        refusal = self._refusal(upload.id, upload)  # (it ended, or is being completed)
        if refusal is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise refusal
        upload.parts[part_id] = (path, size)
        upload.received += size
        return JSONResponse({"id": part_id, "object": "upload.part",
                             "created_at": int(time.time()), "upload_id": upload.id})

    async def complete(self, request: Request, store: FileStore) -> Response:
        body = await self._body(request)
        upload = self._pending(request)
        part_ids = body.get("part_ids")
        if not (isinstance(part_ids, list) and part_ids
                and all(isinstance(p, str) and p in upload.parts for p in part_ids)
                and len(set(part_ids)) == len(part_ids)):
            raise bad_request("'part_ids' must list the upload's parts, each once, in the "
                              "order they make the file", "part_ids")
        total = sum(upload.parts[p][1] for p in part_ids)
        if total != upload.bytes:
            raise bad_request(f"the parts listed hold {total} bytes, and the upload was made "
                              f"for {upload.bytes}.", "part_ids")
        md5 = body.get("md5")
        if md5 is not None and not isinstance(md5, str):
            raise bad_request("'md5' must be the file's MD5 checksum, in hexadecimal", "md5")
        self.files.check_file_count(store, new=0)  # (the file it makes, counted as pending)
        paths = [upload.parts[p][0] for p in part_ids]
        upload.busy = True
        try:
            checksum = await in_thread(_md5, paths) if md5 else None
        except OSError as e:
            raise ApiError(500, f"the parts could not be read ({e}).",
                           code="upload_failed") from None
        finally:
            upload.busy = False
        if checksum is not None and checksum != md5.lower():
            raise bad_request("the parts' MD5 checksum is not 'md5': complete with the parts "
                              "in their right order, or cancel the upload and send the file "
                              "again.", "md5")
        self._pending(request)  # (still: it may have ended while the checksum was made)
        file_id, path = store.new_path()
        upload.busy = True
        try:
            await in_thread(_join, paths, path)
        except BaseException as e:  # (its parts are partly gone: the upload cannot go on)
            upload.busy = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self._end(upload, store, "cancelled")
            if isinstance(e, OSError):
                raise ApiError(500, f"the parts could not be put together ({e}); the upload "
                               "is cancelled: upload the file again.",
                               code="upload_failed") from None
            raise
        upload.busy = False
        # The upload's held bytes are the file's now; the parts not listed are dropped.
        upload.file = store.add(file_id, path, upload.filename, upload.purpose, upload.bytes,
                                upload.file_expiry_s)
        self._end(upload, store, "completed", keep=upload.bytes)
        return JSONResponse(upload.body())

    async def cancel(self, request: Request, store: FileStore) -> Response:
        upload = self._pending(request)
        self._end(upload, store, "cancelled")
        return JSONResponse(upload.body())

    # ----------------------------------------------------------------- helpers
    def _pending(self, request: Request) -> Upload:
        """The pending upload the path names; a 404 where there is none, a 409 while it is
        being completed."""
        upload_id = request.path_params["upload_id"]
        upload = self.uploads.get(upload_id)
        refusal = self._refusal(upload_id, upload)
        if refusal is not None:
            raise refusal
        assert upload is not None
        return upload

    def _refusal(self, upload_id: str, upload: Upload | None) -> ApiError | None:
        if upload is None or self.uploads.get(upload_id) is not upload:
            return ApiError(404, f"no pending upload has the id {shown(upload_id)} (an upload "
                            "ends once completed or cancelled, and expires an hour after it "
                            "was made).", "upload_id", code="upload_not_found")
        if upload.busy:
            return ApiError(409, f"the upload {shown(upload_id)} is being completed.",
                            "upload_id", code="upload_busy")
        return None

    async def _body(self, request: Request) -> dict[str, Any]:
        body = await self.read_json(request)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        return body

    def _expire(self, upload: Upload, store: FileStore) -> None:
        if upload.busy:  # being completed: looked at again a second later
            upload.timer = asyncio.get_running_loop().call_later(1.0, self._expire, upload,
                                                                 store)
            return
        self._end(upload, store, "expired")

    def _end(self, upload: Upload, store: FileStore, status: str, keep: int = 0) -> None:
        """The upload ends (``status``): its parts still on disk removed, its held bytes
        but ``keep`` (a completed one's file's) given back."""
        if self.uploads.get(upload.id) is not upload:
            return
        del self.uploads[upload.id]
        upload.status = status
        if upload.timer is not None:
            upload.timer.cancel()
        for path, _ in upload.parts.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        store.used -= upload.bytes - keep


def _md5(paths: list[str]) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def _join(paths: list[str], target: str) -> None:
    """The parts, in order, as one file at ``target``, each removed once copied (nothing
    left at ``target`` where it fails)."""
    try:
        with open(target, "wb") as out:
            for path in paths:
                with open(path, "rb") as part:
                    shutil.copyfileobj(part, out, 1 << 20)
                os.unlink(path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
        raise


__all__ = ["Upload", "UploadsApi"]

