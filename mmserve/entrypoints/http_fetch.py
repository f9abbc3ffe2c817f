"""Fetching one image over http(s) within one total deadline, from connect to the last byte.

Each socket operation gets the time left as its timeout. That alone does not bound
http.client's own loops (status line, headers and chunk sizes are read line by line, and every
byte that arrives starts a new read with a fresh timeout), so a watchdog shuts the connection
down at the deadline: a host that drips one byte at a time cannot hold a fetch any longer.
Only hosts in the allow-list are fetched; redirects are refused. Every problem, a malformed
URL included, is an ``InvalidInputError`` whose message names the flag to change.
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import re
import socket
import ssl
import threading
import time
from types import TracebackType
from urllib.parse import quote, urlsplit

from mmserve.errors import InvalidInputError

_CHUNK = 64 * 1024
_HOST_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
# Printable ASCII stays as the client wrote it (escapes included); anything else in a path or
# query is percent-encoded as UTF-8, as browsers do, since http.client sends ASCII only.
_PATH_SAFE = "".join(chr(c) for c in range(0x21, 0x7F))


def _short(url: str) -> str:
    return repr(url if len(url) <= 80 else url[:77] + "...")


def fetch(url: str, allowed_domains: tuple[str, ...], timeout_s: float,
          max_bytes: int) -> bytes:
    """The body of ``url`` (a host in ``allowed_domains``), at most ``max_bytes``, all of it
    within ``timeout_s`` seconds. Blocking: call it from a worker thread."""
    tls, host, port, target = _parse_http_url(url, allowed_domains)
    with _Deadline(timeout_s) as deadline:
        conn = _Connection(host, port, tls, deadline)
        try:
            return _get(url, conn, target, max_bytes)
        except InvalidInputError:
            raise
        except (OSError, http.client.HTTPException, ValueError) as e:
            if isinstance(e, TimeoutError) or deadline.expired:
                raise InvalidInputError(
                    f"fetching {_short(url)} took longer than {timeout_s} s; raise "
                    "--media-fetch-timeout, or send the image as a data: URL.") from None
            # http.client's messages quote what the host sent: name the kind, quote briefly.
            reason = str(e) if isinstance(e, OSError) else (
                f"the answer is not valid HTTP ({type(e).__name__}: {_short(str(e))})")
            raise InvalidInputError(f"fetching {_short(url)} failed: {reason}") from None
        finally:
            deadline.disarm()  # before the socket closes: the watchdog never touches its number
            conn.close()


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
        # The response closes itself (and its socket) once it has read Content-Length bytes,
        # on Python 3.12.3 and later with the read that completes the body.
        while not resp.isclosed():
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


class _Deadline:
    """One fetch's total time limit, from connect to the last byte.

    Each socket operation gets the time left as its timeout. That alone does not bound
    http.client's own loops (the status line, headers and chunk sizes are read line by line,
    and every byte that arrives starts a new socket read with a fresh timeout), so a watchdog
    timer shuts the connection down at the deadline and whatever read is blocked returns at
    once. It shuts down the sockets it is shown (the TLS socket too, once TLS takes the plain
    one over), and is disarmed before they close, so it never acts on a closed socket's file
    descriptor (which the process may have reused) and no timer outlives its fetch.
    """

    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._watched: list[socket.socket] = []
        self._fired = False
        self._disarmed = False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.name = "mmserve-fetch-deadline"
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.disarm()

    def disarm(self) -> None:
        """Stop the watchdog; once this returns it shuts nothing down."""
        self._timer.cancel()
        with self._lock:  # waits for a watchdog already running
            self._disarmed = True
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
            self._watched.append(sock)

    def close(self, sock: socket.socket) -> None:
        """Close a socket the fetch gives up on (an address that failed), unwatched first."""
        with self._lock:
            if sock in self._watched:
                self._watched.remove(sock)
        sock.close()

    def _fire(self) -> None:
        with self._lock:
            if self._disarmed:
                return
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
                self.deadline.watch(sock)
            except BaseException:
                self.deadline.close(sock)
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
            deadline.close(sock)
            if isinstance(e, TimeoutError):
                raise
            error = e
        except BaseException:
            deadline.close(sock)
            raise
    raise error


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()  # loading the CA store takes milliseconds: do it once
