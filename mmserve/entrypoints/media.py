"""Which image URLs the server will read, and reading them safely.

- ``data:image/...;base64,`` URLs are always accepted.
- ``http(s)://`` URLs only for hosts listed in ``allowed_domains`` (exact host names), fetched
  (``http_fetch.py``) with a byte cap and one total deadline (``fetch_timeout_s``,
  ``--media-fetch-timeout``) that covers the whole fetch: connect, TLS handshake, status line,
  headers and body. Redirects are refused, since following one could lead to a host that is
  not allowed.
- ``file://`` URLs only when ``allowed_local_path`` is set, and only if the resolved path (after
  symlinks and ``..``) stays inside it.

Whatever the source, the bytes must be a PNG, JPEG, WebP or GIF image of at most ``max_bytes``
and at most ``max_image_pixels`` once decoded (checked from the header, against decompression
bombs). A URL that is malformed in any way is an ``InvalidInputError`` (a 400), never another
exception.

The server reads and decodes images with a ``MediaLoader``: a thread pool of its own, so slow
hosts hold at most its ``max_workers`` threads and never the event loop's default executor.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from PIL import Image

from mmserve.entrypoints.http_fetch import fetch
from mmserve.entrypoints.image_embeds import EmbedsPart, load_embeds
from mmserve.inputs import ImageEmbeds
from mmserve.processing.images import (
    InvalidInputError,
    check_image,
    decode_data_url,
    load_image,
)

# Longer than any server's request-line limit (8 KiB is common); data: URLs are exempt.
_MAX_URL_CHARS = 8192


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how big they may be."""

    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None
    max_bytes: int = 20 * 1024 * 1024
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"--max-image-bytes must be positive, got {self.max_bytes}.")
        # Written so that NaN fails too; the cap is what timers and socket timeouts accept.
        if not 0 < self.fetch_timeout_s <= threading.TIMEOUT_MAX:
            raise ValueError("--media-fetch-timeout must be a positive, finite number of "
                             f"seconds, got {self.fetch_timeout_s}.")
        if self.allowed_local_path is not None and not Path(self.allowed_local_path).is_dir():
            raise ValueError(
                f"--allowed-local-media-path {self.allowed_local_path!r} is not a directory.")
        object.__setattr__(self, "allowed_domains",
                           tuple(d.strip().lower() for d in self.allowed_domains if d.strip()))


@dataclass(frozen=True)
class FilePart:
    """An image uploaded through the Files API, named by its id (a Responses API
    ``input_image``'s ``file_id``, a chat ``file`` part's)."""

    file_id: str


class MediaLoader:
    """Reads request images and checks them from their headers (format, size, aspect ratio)
    on a thread pool of its own. It hands on the bytes: the pixels are decoded where the
    request is preprocessed, one image at a time, so that requests waiting for their turn
    hold compressed images, not pixels (four 7000x7000 images are 30 KB as 1-bit PNGs and
    588 MB decoded).

    A fetch holds its thread for up to ``policy.fetch_timeout_s``; with a pool of its own, slow
    hosts can hold at most ``max_workers`` threads, and images beyond that wait their turn
    instead of taking the event loop's default executor from everything else. Each image's
    deadline starts when its fetch does, not when it is queued.
    """

    def __init__(self, policy: MediaPolicy, max_pixels: int, max_workers: int = 8) -> None:
        if max_workers < 1:
            raise ValueError(f"the media loader needs at least one worker, got {max_workers}.")
        self.policy = policy
        self.max_pixels = max_pixels
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="mmserve-media")
        # Where an uploaded image is, by its file id (or ``InvalidInputError``): set by a
        # server that keeps files; called on the event loop.
        self.file_path: Callable[[str], str] | None = None

    async def load(self, url: str | EmbedsPart | FilePart,
                   param: str = "messages") -> bytes | ImageEmbeds:
        """The bytes of the image at ``url`` (or uploaded, a ``FilePart``), its header
        checked, or ``InvalidInputError`` (with ``param``) saying why not; for an image sent
        as its embeddings, their tensors."""
        loop = asyncio.get_running_loop()
        if isinstance(url, EmbedsPart):
            return await loop.run_in_executor(self._executor, load_embeds, url, param)
        if isinstance(url, FilePart):
            if self.file_path is None:
                raise InvalidInputError(f"an image names the uploaded file {_short(url.file_id)}"
                                        ", but no files are kept here (mmserve serve keeps "
                                        "them unless --files-store-mib is 0); send it as an "
                                        "image URL.", param=param)
            try:
                path = self.file_path(url.file_id)
            except InvalidInputError as e:
                e.param = e.param or param
                raise
            return await loop.run_in_executor(self._executor, self._read_file, path, param)
        return await loop.run_in_executor(self._executor, self._load, url, param)

    def _read_file(self, path: str, param: str) -> bytes:
        try:
            with open(path, "rb") as source:
                data = source.read(self.policy.max_bytes + 1)
        except FileNotFoundError:  # deleted since the request named it
            raise InvalidInputError("an image names an uploaded file that was deleted "
                                    "meanwhile; upload it again.", param=param) from None
        if len(data) > self.policy.max_bytes:
            raise InvalidInputError(
                f"an uploaded image is over the limit of {self.policy.max_bytes} bytes; send a "
                "smaller image, or raise --max-image-bytes.", param=param)
        check_image_format(data, param)
        return self._checked(data, param)

    def close(self) -> None:
        """Stop taking images and drop queued ones. Fetches in progress are not waited for:
        each ends by its own deadline."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _load(self, url: str, param: str) -> bytes:
        return self._checked(load_image_url(url, self.policy, param), param)

    def _checked(self, data: bytes, param: str) -> bytes:
        try:
            check_image(data, self.max_pixels)
        except InvalidInputError as e:
            e.param = e.param or param
            raise
        return data


def load_image_url(url: str, policy: MediaPolicy, param: str = "messages") -> bytes:
    """The bytes of the image at ``url``, or ``InvalidInputError`` (with ``param``) saying why
    not. Blocking: call it from a worker thread."""
    try:
        data = _read_url(url, policy)
        if len(data) > policy.max_bytes:
            raise InvalidInputError(
                f"an image is {len(data)} bytes, over the limit of {policy.max_bytes} bytes; "
                "send a smaller image, or raise --max-image-bytes.")
        check_image_format(data)
    except InvalidInputError as e:
        e.param = param
        raise
    return data


def load_image_from_url(url: str, policy: MediaPolicy, max_pixels: int) -> Image.Image:
    """Read and decode the image at ``url`` (first frame; at most ``max_pixels``). Blocking:
    call it from a worker thread (``MediaLoader`` does)."""
    return load_image(load_image_url(url, policy), max_pixels)


def check_image_format(data: bytes, param: str = "messages") -> None:
    """Accept only the formats the API promises, by their magic bytes."""
    if (data.startswith(b"\x89PNG\r\n\x1a\n") or data.startswith(b"\xff\xd8\xff")
            or data[:6] in (b"GIF87a", b"GIF89a")
            or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")):
        return
    raise InvalidInputError("an image is not a PNG, JPEG, WebP or GIF file", param=param)


def _short(url: str) -> str:
    return repr(url if len(url) <= 80 else url[:77] + "...")


def _read_url(url: str, policy: MediaPolicy) -> bytes:
    if not isinstance(url, str):
        raise InvalidInputError(f"an image URL must be a string, not {type(url).__name__}")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":  # base64 decoding itself refuses every character out of place
        return decode_data_url(url)
    _check_url_text(url)
    if scheme in ("http", "https"):
        return fetch(url, policy.allowed_domains, policy.fetch_timeout_s, policy.max_bytes)
    if scheme == "file":
        return _read_local(url, policy)
    raise InvalidInputError(
        f"unsupported image URL {_short(url)}; send a data:image/...;base64 URL, an http(s) URL "
        "of a host in --allowed-media-domains, or a file:// URL under "
        "--allowed-local-media-path.")


def _check_url_text(url: str) -> None:
    if len(url) > _MAX_URL_CHARS:
        raise InvalidInputError(
            f"an image URL is {len(url)} characters long, over the limit of {_MAX_URL_CHARS}; "
            "send the image as a data: URL.")
    if not url.isprintable() or " " in url:
        at, char = next((i, c) for i, c in enumerate(url) if c == " " or not c.isprintable())
        raise InvalidInputError(
            f"the image URL {_short(url)} contains whitespace or a control character ({char!r} "
            f"at position {at}); percent-encode it.")


# ---------------------------------------------------------------------------- file://
def _read_local(url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_path is None:
        raise InvalidInputError(
            "local image files are disabled; start the server with --allowed-local-media-path "
            "DIR to serve files under DIR, or send a data: URL.")
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise InvalidInputError(f"the image URL {_short(url)} is malformed: {e}") from None
    if parts.netloc not in ("", "localhost"):
        raise InvalidInputError(f"file:// URLs must not name a host, got {parts.netloc!r}")
    name = unquote(parts.path)
    if "\x00" in name:
        raise InvalidInputError(f"the image path {_short(name)} contains a NUL byte")
    try:
        root = Path(policy.allowed_local_path).resolve()
        path = Path(name).resolve()
        if not path.is_relative_to(root):
            raise InvalidInputError(
                f"the image path {_short(name)} is outside the allowed local media path; "
                "move the file under --allowed-local-media-path, or send a data: URL.")
        if path.is_dir():
            raise InvalidInputError(f"the image path {_short(name)} is a directory, not a file")
        if not path.exists():
            raise InvalidInputError(f"image file not found: {_short(name)}")
        # Only regular files: opening a FIFO would block, a device could be endless.
        if not path.is_file():
            raise InvalidInputError(f"the image path {_short(name)} is not a regular file")
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > policy.max_bytes:
                raise InvalidInputError(
                    f"the image file is {size} bytes, over the limit of {policy.max_bytes} "
                    "bytes; send a smaller image, or raise --max-image-bytes.")
            return f.read(policy.max_bytes + 1)  # a file that grew since is caught by its size
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop, in Python 3.11
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InvalidInputError(f"cannot read the image file {_short(name)}: {reason}") from None
