"""Which image URLs the server will read, and reading them safely.

- ``data:image/...;base64,`` URLs are always accepted.
- ``http(s)://`` URLs only for hosts listed in ``allowed_domains`` (exact host names), fetched
  with a byte cap and one total deadline (``fetch_timeout_s``, ``--media-fetch-timeout``) that
  covers the whole fetch: connect, TLS handshake, status line, headers and body, chunked or not.
  Each socket operation gets the time left as its timeout, and a watchdog shuts the connection
  down when the time is up, so a host that drips one byte at a time cannot hold a fetch longer.
  Redirects are refused, since following one could lead to a host that is not allowed.
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
import functools
import http.client
import ipaddress
import os
import re
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import quote, unquote, urlsplit

from PIL import Image

from mmserve.processing.images import InvalidInputError, decode_data_url, load_image

_CHUNK = 64 * 1024
# Longer than any server's request-line limit (8 KiB is common); data: URLs are exempt.
_MAX_URL_CHARS = 8192
_HOST_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
# Printable ASCII stays as the client wrote it (escapes included); anything else in a path or
# query is percent-encoded as UTF-8, as browsers do, since http.client sends ASCII only.
_PATH_SAFE = "".join(chr(c) for c in range(0x21, 0x7F))


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


class MediaLoader:
    """Reads and decodes request images on a thread pool of its own.

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

    async def load(self, url: str, param: str = "messages") -> Image.Image:
        """The decoded image at ``url``, or ``InvalidInputError`` (with ``param``) saying why
        not."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._load, url, param)

    def close(self) -> None:
        """Stop taking images and drop queued ones. Fetches in progress are not waited for:
        each ends by its own deadline."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _load(self, url: str, param: str) -> Image.Image:
        data = load_image_url(url, self.policy, param)
        try:
            return load_image(data, self.max_pixels)
        except InvalidInputError as e:
            e.param = e.param or param
            raise


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
        return _fetch(url, policy)
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


# ---------------------------------------------------------------------------- http(s)
def _fetch(url: str, policy: MediaPolicy) -> bytes:
    tls, host, port, target = _parse_http_url(url, policy.allowed_domains)
    with _Deadline(policy.fetch_timeout_s) as deadline:
        try:
            return _get(url, _Connection(host, port, tls, deadline), target, policy.max_bytes)
        except InvalidInputError:
            raise
        except (OSError, http.client.HTTPException, ValueError) as e:
            if isinstance(e, TimeoutError) or deadline.expired:
                raise InvalidInputError(
                    f"fetching {_short(url)} took longer than {policy.fetch_timeout_s} s; raise "
                    "--media-fetch-timeout, or send the image as a data: URL.") from None
            # http.client's messages quote what the host sent: name the kind, quote briefly.
            reason = str(e) if isinstance(e, OSError) else (
                f"the answer is not valid HTTP ({type(e).__name__}: {_short(str(e))})")
            raise InvalidInputError(f"fetching {_short(url)} failed: {reason}") from None


def _parse_http_url(url: str, allowed_domains: tuple[str, ...]) -> tuple[bool, str, int, str]:
    """``(tls, host, port, request target)`` of a URL to an allowed host, with the problem
    named if the URL has one."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:  # a bad IPv6 literal, a port out of range or not a number
        raise InvalidInputError(f"the image URL {_short(url)} is malformed: {e}") from None
    host = parts.hostname or ""
    if not host:
        raise InvalidInputError(f"the image URL {_short(url)} names no host")
    if not host.isascii():
        raise InvalidInputError(
            f"the image URL's host {host!r} is not ASCII; write an international domain name "
            "in its ASCII (xn--) form.")
    if len(host) > 253:
        raise InvalidInputError(
            f"the image URL's host is {len(host)} characters long; host names have at most 253")
    if ":" in host:  # urlsplit has checked a bracketed IPv6 literal; this is belt and braces
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError as e:
            raise InvalidInputError(f"the image URL's host {host!r} is malformed: {e}") from None
    elif not all(_HOST_LABEL.fullmatch(label) for label in host.removesuffix(".").split(".")):
        raise InvalidInputError(
            f"the image URL's host {host!r} is not a valid host name (letters, digits and "
            "hyphens, at most 63 per dot-separated label)")
    # The host first: in 'http://allowed.com@evil.net/' it is evil.net that matters.
    if host not in allowed_domains:
        raise InvalidInputError(
            f"fetching images from {host!r} is not allowed; start the server with "
            f"--allowed-media-domains {host} to allow it, or send a data: URL.")
    if parts.username is not None or parts.password is not None:
        raise InvalidInputError(
            f"the image URL {_short(url)} carries a user name or password; mmserve sends no "
            "credentials, remove them.")
    if port == 0:
        raise InvalidInputError(f"the image URL {_short(url)} has port 0; ports are 1-65535")
    tls = parts.scheme == "https"
    target = quote(parts.path or "/", safe=_PATH_SAFE)
    if parts.query:
        target += "?" + quote(parts.query, safe=_PATH_SAFE)
    return tls, host, port or (443 if tls else 80), target


def _get(url: str, conn: _Connection, target: str, max_bytes: int) -> bytes:
    """One GET on ``conn`` under its deadline; the response checked and read to the end."""
    deadline = conn.deadline
    resp: http.client.HTTPResponse | None = None
    try:
        conn.connect()
        sock = conn.sock
        sock.settimeout(deadline.remaining())
        conn.request("GET", target, headers={
            "Accept": "image/png, image/jpeg, image/webp, image/gif",
            "Connection": "close", "User-Agent": "mmserve"})
        sock.settimeout(deadline.remaining())
        resp = conn.getresponse()  # status line and headers: bounded by the watchdog
        deadline.remaining()  # a header section cut short by the watchdog is a timeout
        if 300 <= resp.status < 400:
            location = resp.getheader("Location")
            where = f" to {_short(location)}" if location else ""
            raise InvalidInputError(
                f"the image URL {_short(url)} redirects{where} (HTTP {resp.status}); mmserve "
                "does not follow redirects, send the final URL.")
        if not 200 <= resp.status < 300:
            raise InvalidInputError(
                f"fetching {_short(url)} failed with HTTP {resp.status}; check the URL.")
        if resp.length is not None and resp.length > max_bytes:
            raise InvalidInputError(
                f"the image at {_short(url)} is {resp.length} bytes, over the limit of "
                f"{max_bytes} bytes; send a smaller image, or raise --max-image-bytes.")
        chunks: list[bytes] = []
        size = 0
        while True:
            # read1 returns what one socket read brings instead of looping until the chunk is
            # full, so each read waits at most the time left.
            sock.settimeout(deadline.remaining())
            chunk = resp.read1(_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                raise InvalidInputError(
                    f"the image at {_short(url)} is over the limit of {max_bytes} bytes; send "
                    "a smaller image, or raise --max-image-bytes.")
            chunks.append(chunk)
        deadline.remaining()  # an end of body forced by the watchdog is a timeout
        if resp.length:  # read1 reports a connection closed early as a plain end of body
            raise InvalidInputError(
                f"fetching {_short(url)} failed: the host closed the connection after {size} of "
                f"{size + resp.length} bytes.")
        return b"".join(chunks)
    finally:
        if resp is not None:
            resp.close()
        conn.close()


class _Deadline:
    """One fetch's total time limit, from connect to the last byte.

    Each socket operation gets the time left as its timeout. That alone does not bound
    http.client's own loops (the status line, headers and chunk sizes are read line by line,
    and every byte that arrives starts a new socket read with a fresh timeout), so a watchdog
    timer shuts the connection down at the deadline and whatever read is blocked returns at
    once. It shuts down a duplicate of each socket, which stays valid after TLS takes the
    original over, and is cancelled on the way out so no timer outlives its fetch.
    """

    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._watched: list[socket.socket] = []
        self._fired = False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.name = "mmserve-fetch-deadline"
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._timer.cancel()
        with self._lock:
            for sock in self._watched:
                sock.close()
            self._watched.clear()

    @property
    def expired(self) -> bool:
        return self._fired or time.monotonic() >= self._end

    def remaining(self) -> float:
        """Seconds left, for a socket timeout; ``TimeoutError`` when there are none."""
        left = self._end - time.monotonic()
        if left <= 0 or self._fired:
            raise TimeoutError("the fetch deadline has passed")
        return left

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            if self._fired:
                raise TimeoutError("the fetch deadline has passed")
            self._watched.append(sock.dup())

    def _fire(self) -> None:
        with self._lock:
            self._fired = True
            for sock in self._watched:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # not connected (yet, or any more): nothing to wake


class _Connection(http.client.HTTPConnection):
    """An HTTP or HTTPS connection whose socket opens under ``deadline``."""

    def __init__(self, host: str, port: int, tls: bool, deadline: _Deadline) -> None:
        super().__init__(host, port)
        self.default_port = 443 if tls else 80  # the Host header omits the scheme's own port
        self.tls = tls
        self.deadline = deadline

    def connect(self) -> None:
        sock = _open_socket(self.host, self.port, self.deadline)
        if self.tls:
            try:
                sock.settimeout(self.deadline.remaining())
                sock = _tls_context().wrap_socket(sock, server_hostname=self.host)
            except BaseException:
                sock.close()
                raise
        self.sock = sock


def _open_socket(host: str, port: int, deadline: _Deadline) -> socket.socket:
    """Like ``socket.create_connection``, but the addresses share one deadline instead of
    each getting the whole timeout. Name resolution itself (``getaddrinfo``) cannot be
    interrupted and is left to the system resolver's timeouts; the hosts are the operator's
    own --allowed-media-domains."""
    error: OSError = OSError(f"no address found for {host!r}")
    for family, kind, proto, _, address in socket.getaddrinfo(host, port,
                                                               type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            deadline.watch(sock)
            sock.settimeout(deadline.remaining())
            sock.connect(address)
            return sock
        except OSError as e:
            sock.close()
            if isinstance(e, TimeoutError):
                raise
            error = e
        except BaseException:
            sock.close()
            raise
    raise error


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()  # loading the CA store takes milliseconds: do it once


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
