"""The files of OpenAI's Files API as the server keeps them: the files clients upload (batch
inputs, images) and the output files batches write (``batch_api.py`` serves them), in a folder
of their own, at most ``capacity`` bytes of them together.

Books only, on the event loop: ids, sizes, expiry times. The bytes are copied in and read out
by the caller, on threads where they are large; a file is unlinked when it is deleted or
expires, and the folder is removed when the store closes (files are not kept across
restarts).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import BinaryIO

from mmserve.entrypoints.openai_protocol import ApiError

MAX_FILES = 10_000  # uploads refused past it (a batch's outputs are bounded by the batches)
SWEEP_INTERVAL_S = 1.0  # expired files are looked for at most this often


def shown(value: object) -> str:
    """``value`` as an error message shows it (a file id a client sent): its repr, cut
    short."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


class StoreFull(OSError):
    """A file, or a batch's output, that would not fit in the store."""


@dataclass
class StoredFile:
    id: str
    filename: str
    purpose: str  # uploaded: "batch", "vision", "user_data"; "batch_output": a batch's
    bytes: int
    created_at: int
    expires_at: int | None
    path: str

    def body(self) -> dict:
        """OpenAI's file object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed",
                "expires_at": self.expires_at, "status_details": None}


class FileStore:
    """Files in a temporary folder, at most ``capacity`` bytes of them: what is stored plus
    what outputs being written have taken so far."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.folder = tempfile.mkdtemp(prefix="mmserve-files-")
        self.files: dict[str, StoredFile] = {}  # in the order they were stored
        self.used = 0
        self._swept = 0.0

    @property
    def room(self) -> int:
        return self.capacity - self.used

    def reserve(self, size: int) -> None:
        """Take ``size`` bytes, or raise ``StoreFull``."""
        if size > self.room:
            self.sweep()  # expired files make room
        if size > self.room:
            raise StoreFull(f"the file store is full: {self.used} of its {self.capacity} "
                            "bytes are used (--files-store-mib); delete files or batches' "
                            "outputs that are no longer needed")
        self.used += size

    def new_path(self) -> tuple[str, str]:
        """A new file's id and the path its bytes go to."""
        file_id = f"file-{uuid.uuid4().hex}"
        return file_id, os.path.join(self.folder, file_id)

    def add(self, file_id: str, path: str, filename: str, purpose: str, size: int,
            expires_after_s: int | None) -> StoredFile:
        """Keep the file written at ``path`` (its ``size`` bytes reserved already)."""
        now = int(time.time())
        stored = StoredFile(file_id, filename, purpose, size, now,
                            None if expires_after_s is None else now + expires_after_s, path)
        self.files[file_id] = stored
        return stored

    def get(self, file_id: str) -> StoredFile:
        """The file of this id, or a 404."""
        self.sweep()
        stored = self.files.get(file_id)
        if stored is None:
            raise ApiError(404, f"no file has the id {shown(file_id)} (files are kept until "
                           "deleted or expired, and not across restarts).",
                           param="file_id", code="file_not_found")
        return stored

    def open(self, file_id: str) -> tuple[StoredFile, BinaryIO]:
        """The file and its bytes, open for reading (still readable once it is deleted)."""
        stored = self.get(file_id)
        return stored, open(stored.path, "rb")  # noqa: SIM115 (the caller closes it)

    def delete(self, file_id: str) -> None:
        stored = self.get(file_id)
        self._remove(stored)

    def listed(self, purpose: str | None) -> list[StoredFile]:
        self.sweep()
        return [f for f in self.files.values() if purpose is None or f.purpose == purpose]

    def sweep(self) -> None:
        """Forget the files whose time has come (looked for at most once a second)."""
        now = time.time()
        if now - self._swept < SWEEP_INTERVAL_S:
            return
        self._swept = now
        for stored in [f for f in self.files.values()
                       if f.expires_at is not None and f.expires_at <= now]:
            self._remove(stored)

    def _remove(self, stored: StoredFile) -> None:
        del self.files[stored.id]
        self.used -= stored.bytes
        try:
            os.unlink(stored.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.files.clear()
        self.used = 0


class OutputFile:
    """A batch's output being written, line by line, each counted against the store as it is
    written (``StoreFull`` where it would not fit); kept as a file of the store by ``keep``."""

    def __init__(self, store: FileStore, filename: str) -> None:
        self.store, self.filename = store, filename
        self.id, self.path = store.new_path()
        self.bytes = 0
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed by keep or discard)
        self.kept = False

    def write(self, text: str) -> int:
        data = text.encode()
        self.store.reserve(len(data))
        self.bytes += len(data)
        self._file.write(data)
        return len(text)

    def flush(self) -> None:
        self._file.flush()

    def keep(self, expires_after_s: int | None) -> str | None:
        """Store what was written as a ``batch_output`` file: its id, or None (and nothing
        kept) where nothing was written."""
        self._file.close()
        if not self.bytes:
            os.unlink(self.path)
            return None
        self.store.add(self.id, self.path, self.filename, "batch_output", self.bytes,
                       expires_after_s)
        self.kept = True
        return self.id

    def discard(self) -> None:
        """Remove what was written (unless it was kept), its bytes given back."""
        if self.kept:
            self.store.delete(self.id)
            return
        with contextlib.suppress(OSError):
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.store.used -= self.bytes
        self.bytes = 0
