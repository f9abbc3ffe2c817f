"""Image URLs against hostile input: every malformed URL is an ``InvalidInputError`` naming the
problem, and ``--media-fetch-timeout`` bounds a whole fetch, whatever phase a host drips or
stalls in, with the fetches running on ``MediaLoader``'s own bounded pool.

The hosts are raw sockets on 127.0.0.1 started here, one thread per connection, so each can
misbehave at exactly the phase a test means to (status line, headers, chunk sizes, body, TLS).
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from PIL import Image

from mmserve.entrypoints.media import (
    MediaLoader,
    MediaPolicy,
    load_image_from_url,
    load_image_url,
)
from mmserve.processing.images import InvalidInputError

DRIP_INTERVAL_S = 0.2
MAX_BYTES = 50_000
GOOD_IMAGE = Image.new("RGB", (24, 16), (200, 40, 90))


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


PNG = png_bytes(GOOD_IMAGE)

Handler = Callable[[socket.socket, threading.Event], None]


def _send(conn: socket.socket, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:
        pass  # mmserve hung up: at its byte cap, or its deadline


def _respond(head: str, body: bytes = b"") -> Handler:
    return lambda conn, stop: _send(conn, head.replace("\n", "\r\n").encode() + b"\r\n" + body)


def _drip(prefix: bytes, drip: Callable[[], Iterable[bytes]]) -> Handler:
    """Send ``prefix`` at once, then ``drip()`` one byte every DRIP_INTERVAL_S, until the
    client hangs up or the host stops."""

    def handle(conn: socket.socket, stop: threading.Event) -> None:
        try:
            conn.sendall(prefix)
            for byte in drip():
                if stop.wait(DRIP_INTERVAL_S):
                    return
                conn.sendall(byte)
        except OSError:
            pass

    return handle


def _bytes(data: bytes) -> Iterator[bytes]:
    return (data[i:i + 1] for i in range(len(data)))


def _silent(conn: socket.socket, stop: threading.Event) -> None:
    stop.wait()  # accepted and read, never answered


ROUTES: dict[str, Handler] = {
    "/ok.png": _respond(f"HTTP/1.1 200 OK\nContent-Length: {len(PNG)}\n", PNG),
    "/chunked.png": _respond(
        "HTTP/1.1 200 OK\nTransfer-Encoding: chunked\n",
        b"".join(b"%x\r\n%s\r\n" % (len(PNG[i:i + 100]), PNG[i:i + 100])
                 for i in range(0, len(PNG), 100)) + b"0\r\n\r\n"),
    "/unsized.png": _respond("HTTP/1.0 200 OK\n", PNG),  # ends when the connection does
    "/big.png": _respond(f"HTTP/1.1 200 OK\nContent-Length: {MAX_BYTES + 8}\n",
                         PNG[:8] + bytes(MAX_BYTES)),
    "/big-unsized.png": _respond("HTTP/1.0 200 OK\n", PNG[:8] + bytes(MAX_BYTES)),
    "/truncated.png": _respond(f"HTTP/1.1 200 OK\nContent-Length: {len(PNG) + 500}\n", PNG),
    "/text": _respond("HTTP/1.1 200 OK\nContent-Length: 5\n", b"hello"),
    "/redirect": _respond("HTTP/1.1 302 Found\nLocation: http://example.com/ok.png\n"
                          "Content-Length: 0\n"),
    "/missing.png": _respond("HTTP/1.1 404 Not Found\nContent-Length: 0\n"),
    "/garbage": _respond("SSH-2.0-OpenSSH_9.6\n"),
    "/drip-body.png": _drip(f"HTTP/1.1 200 OK\nContent-Length: {len(PNG)}\n\n".replace(
        "\n", "\r\n").encode(), lambda: _bytes(PNG)),
    "/drip-chunks.png": _drip(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                              lambda: itertools.cycle(_bytes(b"1\r\nx\r\n"))),
    "/drip-chunk-size.png": _drip(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                                  lambda: itertools.repeat(b"0")),  # one endless size line
    "/drip-status.png": _drip(b"", lambda: _bytes(b"HTTP/1.1 200 OK\r\n")),
    "/drip-headers.png": _drip(b"HTTP/1.1 200 OK\r\n",
                               lambda: itertools.cycle(_bytes(b"X-Drip: 1\r\n"))),
    "/silent.png": _silent,
}


class LoopbackHost:
    """A TCP host on 127.0.0.1, one thread per connection. With ``routes``, it reads the
    request head and the path picks the behaviour; with ``raw``, it runs ``raw`` on each
    connection without reading anything (for TLS, which starts with the client's hello)."""

    def __init__(self, routes: dict[str, Handler] | None = None,
                 raw: Handler | None = None) -> None:
        self.routes = routes or {}
        self.raw = raw
        self.stop = threading.Event()
        self.requests: list[bytes] = []  # each request's head, as sent
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            if self.raw is not None:
                self.raw(conn, self.stop)
                return
            head = b""
            while b"\r\n\r\n" not in head:
                data = conn.recv(4096)
                if not data:
                    return
                head += data
            self.requests.append(head)
            path = head.split(b" ", 2)[1].decode().split("?")[0]
            handler = self.routes.get(path, _respond("HTTP/1.1 404 Not Found\nContent-Length: 0\n"))
            handler(conn, self.stop)

    def close(self) -> None:
        self.stop.set()
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept(); close() alone does not
        self.listener.close()
        for thread in self.threads:
            thread.join(timeout=2)


@pytest.fixture(scope="module")
def host() -> Iterator[LoopbackHost]:
    server = LoopbackHost(ROUTES)
    yield server
    server.close()


@pytest.fixture(scope="module")
def tls_dripper() -> Iterator[LoopbackHost]:
    """Answers a TLS hello with a record header announcing 16 KiB, then drips its bytes."""
    server = LoopbackHost(raw=_drip(b"", lambda: itertools.chain(
        _bytes(b"\x16\x03\x03\x40\x00"), itertools.repeat(b"\x00"))))
    yield server
    server.close()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "ok.png").write_bytes(PNG)
    (root / "allowed" / "big.png").write_bytes(PNG[:8] + bytes(MAX_BYTES))
    (root / "allowed" / "locked.png").write_bytes(PNG)
    (root / "allowed" / "locked.png").chmod(0)
    (root / "allowed" / "loop-a").symlink_to(root / "allowed" / "loop-b")
    (root / "allowed" / "loop-b").symlink_to(root / "allowed" / "loop-a")
    (root / "allowed" / "sub").mkdir()
    os.mkfifo(root / "allowed" / "fifo.png")  # opening it would block forever
    (root / "secret.png").write_bytes(PNG)
    return root


def policy(timeout_s: float = 1.0, media_dir: Path | None = None) -> MediaPolicy:
    return MediaPolicy(("127.0.0.1", "::1", "localhost"),
                       str(media_dir / "allowed") if media_dir else None, MAX_BYTES, timeout_s)


def fetch_within(url: str, pol: MediaPolicy, limit_s: float) -> tuple[bytes | Exception, float]:
    """``load_image_url`` in a daemon thread: its result or exception, and how long it took;
    fails the test if it takes over ``limit_s`` (instead of hanging on a fetch that never
    ends)."""
    result: list[bytes | Exception] = []

    def run() -> None:
        try:
            result.append(load_image_url(url, pol, "messages[0].content[0]"))
        except Exception as e:  # noqa: BLE001 (the test inspects whatever it is)
            result.append(e)

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    elapsed = time.monotonic() - start
    assert result, f"fetching {url} was still running after {limit_s} s"
    return result[0], elapsed


def assert_invalid(outcome: bytes | Exception, fragment: str) -> InvalidInputError:
    assert isinstance(outcome, InvalidInputError), repr(outcome)
    assert fragment in str(outcome), str(outcome)
    assert outcome.param == "messages[0].content[0]"
    return outcome


def deadline_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mmserve-fetch-deadline"]


def assert_no_deadline_threads() -> None:
    """Every fetch's watchdog is cancelled on the way out: none outlives its fetch."""
    end = time.monotonic() + 1.0
    while deadline_threads() and time.monotonic() < end:
        time.sleep(0.01)
    assert not deadline_threads()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


# (URL, fragment of the message); "{dir}" is the allowed local directory.
HOSTILE_URLS: list[tuple[str, str]] = [
    ("http://[::1/x.png", "malformed: Invalid IPv6 URL"),
    ("http://[not-ipv6]/x.png", "malformed"),
    ("http://[::1]:99999/x.png", "Port out of range"),
    ("http://127.0.0.1:99999/x.png", "Port out of range"),
    ("http://127.0.0.1:http/x.png", "Port could not be cast"),
    ("http://127.0.0.1:-80/x.png", "Port could not be cast"),
    ("http://127.0.0.1:80:80/x.png", "Port could not be cast"),
    ("http://127.0.0.1:0/x.png", "port 0"),
    ("http:///x.png", "names no host"),
    ("http://:80/x.png", "names no host"),
    ("https://bücher.example/x.png", "not ASCII"),
    ("http://" + "a" * 250 + ".example/x.png", "at most 253"),
    ("http://" + "a" * 64 + ".example/x.png", "not a valid host name"),
    ("http://exa_mple-.com/x.png", "not a valid host name"),
    ("http://a..b/x.png", "not a valid host name"),
    ("http://127.0.0.1%2f.evil/x.png", "not a valid host name"),
    ("http://user:secret@127.0.0.1/x.png", "user name or password"),
    ("http://127.0.0.1@evil.example/x.png", "'evil.example' is not allowed"),
    ("http://evil.example/x.png", "--allowed-media-domains evil.example"),
    ("http://127.0.0.1.evil.example/x.png", "is not allowed"),
    ("http://127.0.0.1/" + "a" * 9000, "over the limit of 8192"),
    ("http://exa mple.com/x.png", "whitespace or a control character (' ' at position 10)"),
    (" http://127.0.0.1/x.png", "whitespace or a control character"),
    ("http://127.0.0.1/x.png\n", "'\\n' at position 22"),
    ("http://127.0.0.1/\x00.png", "'\\x00'"),
    ("http://127.0.0.1/x\u200b.png", "'\\u200b'"),
    ("http://127.0.0.1/x\x85.png", "control character"),
    ("ftp://127.0.0.1/ok.png", "unsupported image URL"),
    ("javascript:alert(1)", "unsupported image URL"),
    ("127.0.0.1/ok.png", "unsupported image URL"),
    ("", "unsupported image URL"),
    ("data:image/png;base64,%%%not-base64", "not valid base64"),
    ("data:image/png;base64,aGVs\nbG8=", "not valid base64"),
    ("data:image/png;base64,aGVsbG8=\u00e9", "not valid base64"),
    ("data:text/plain;base64,aGk=", "holds 'text/plain', not an image; an image data URL must"),
    ("data:image/png,rawbytes", "must look like 'data:image/"),
    ("data:", "must look like 'data:image/"),
    ("data:image/png;base64,", "not a PNG, JPEG, WebP or GIF"),
    ("data:image/svg+xml;base64," + _b64(b"<svg/>"), "not a PNG, JPEG, WebP or GIF"),
    ("data:image/png;base64," + _b64(PNG[:8] + bytes(MAX_BYTES)), "--max-image-bytes"),
    ("file:///tmp/a%00b.png", "NUL byte"),
    ("file://[::1/x.png", "malformed"),
    ("file://remotehost/x.png", "must not name a host"),
    ("file:///etc/hostname", "outside the allowed local media path"),
    ("file://{dir}/../secret.png", "--allowed-local-media-path"),
    ("file://{dir}", "is a directory"),
    ("file://{dir}/sub/", "is a directory"),
    ("file://{dir}/missing.png", "not found"),
    ("file://{dir}/fifo.png", "not a regular file"),
    ("file://{dir}/loop-a", "cannot read the image file"),
    ("file://{dir}/" + "x" * 300 + ".png", "File name too long"),
    ("file://{dir}/big.png", "--max-image-bytes"),
    ("file://{dir}/%ff%fe.png", "not found"),
    ("file://{dir}/x\t.png", "whitespace or a control character"),
]


@pytest.mark.parametrize(("url", "fragment"), HOSTILE_URLS,
                         ids=[f"{i}-{u[:40]}" for i, (u, _) in enumerate(HOSTILE_URLS)])
def test_hostile_urls_are_invalid_input(url: str, fragment: str, media_dir: Path) -> None:
    outcome, _ = fetch_within(url.replace("{dir}", str(media_dir / "allowed")),
                              policy(1.0, media_dir), limit_s=5)
    assert_invalid(outcome, fragment)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_local_file(media_dir: Path) -> None:
    outcome, _ = fetch_within(f"file://{media_dir}/allowed/locked.png", policy(1.0, media_dir),
                              limit_s=5)
    assert_invalid(outcome, "Permission denied")


def test_non_string_url_and_disabled_local_files(media_dir: Path) -> None:
    not_a_url: str = None  # type: ignore[assignment] (JSON can carry anything)
    assert_invalid(fetch_within(not_a_url, policy(), 5)[0], "must be a string, not NoneType")
    assert_invalid(fetch_within(f"file://{media_dir}/allowed/ok.png", policy(), 5)[0],
                   "--allowed-local-media-path DIR")


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan"), float("inf")])
def test_policy_refuses_a_timeout_no_timer_can_keep(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="--media-fetch-timeout must be a positive, finite"):
        MediaPolicy(fetch_timeout_s=timeout_s)


def test_good_fetches_round_trip(host: LoopbackHost, media_dir: Path) -> None:
    pol = policy(2.0, media_dir)
    for url in (f"{host.url}/ok.png", f"{host.url}/chunked.png", f"{host.url}/unsized.png",
                f"http://localhost:{host.port}/ok.png?size=24%2016&x=\u00e9",
                f"file://{media_dir}/allowed/ok.png", "data:image/png;base64," + _b64(PNG)):
        data, _ = fetch_within(url, pol, limit_s=5)
        assert data == PNG, url
    # Non-ASCII in the query goes out percent-encoded; the client's own escapes stay as sent.
    assert any(head.startswith(b"GET /ok.png?size=24%2016&x=%C3%A9 HTTP/1.1\r\n")
               and b"\r\nHost: localhost:%d\r\n" % host.port in head for head in host.requests)
    image = load_image_from_url(f"{host.url}/ok.png", pol, max_pixels=10_000)
    assert image.size == GOOD_IMAGE.size
    assert image.getpixel((3, 3)) == (200, 40, 90)
    assert_no_deadline_threads()


@pytest.mark.parametrize(("path", "fragment"), [
    ("/big.png", f"is {MAX_BYTES + 8} bytes, over the limit of {MAX_BYTES} bytes; send a "
                 "smaller image, or raise --max-image-bytes"),
    ("/big-unsized.png", f"over the limit of {MAX_BYTES} bytes"),
    ("/truncated.png", f"closed the connection after {len(PNG)} of {len(PNG) + 500} bytes"),
    ("/text", "not a PNG, JPEG, WebP or GIF"),
    ("/redirect", "redirects to 'http://example.com/ok.png' (HTTP 302); mmserve does not "
                  "follow redirects"),
    ("/missing.png", "failed with HTTP 404"),
    ("/garbage", "the answer is not valid HTTP (BadStatusLine: 'SSH-2.0-OpenSSH_9.6\\r\\n')"),
])
def test_http_errors_name_the_problem(host: LoopbackHost, path: str, fragment: str) -> None:
    outcome, elapsed = fetch_within(host.url + path, policy(2.0), limit_s=5)
    assert_invalid(outcome, fragment)
    assert elapsed < 1.0  # answered at once: none of these waits for the deadline


def test_connection_refused() -> None:
    outcome, _ = fetch_within(f"http://127.0.0.1:{_free_port()}/x.png", policy(), limit_s=5)
    assert_invalid(outcome, "Connection refused")


def test_body_drip_hits_the_total_deadline(host: LoopbackHost) -> None:
    """Every byte arrives well within a per-read timeout; the whole body never does."""
    outcome, elapsed = fetch_within(f"{host.url}/drip-body.png", policy(1.0), limit_s=5)
    assert_invalid(outcome, "took longer than 1.0 s; raise --media-fetch-timeout")
    assert 0.9 < elapsed < 1.5
    assert_no_deadline_threads()


@pytest.mark.parametrize("path", ["/drip-status.png", "/drip-headers.png",
                                  "/drip-chunk-size.png", "/drip-chunks.png", "/silent.png"])
def test_every_phase_is_under_the_deadline(host: LoopbackHost, path: str) -> None:
    outcome, elapsed = fetch_within(host.url + path, policy(0.5), limit_s=5)
    assert_invalid(outcome, "took longer than 0.5 s; raise --media-fetch-timeout")
    assert 0.4 < elapsed < 1.0
    assert_no_deadline_threads()


def test_tls_handshake_is_under_the_deadline(tls_dripper: LoopbackHost) -> None:
    outcome, elapsed = fetch_within(f"https://127.0.0.1:{tls_dripper.port}/x.png", policy(0.5),
                                    limit_s=5)
    assert_invalid(outcome, "--media-fetch-timeout")
    assert elapsed < 1.0
    assert_no_deadline_threads()


def test_loader_bounds_slow_fetches_to_its_own_pool(host: LoopbackHost) -> None:
    """Six dripping fetches on two workers take three rounds of the deadline, not forever,
    and hold only the loader's threads; a good image afterwards loads normally."""
    before = set(threading.enumerate())
    loader = MediaLoader(policy(0.5), max_pixels=10_000, max_workers=2)

    async def run() -> tuple[list[object], float, bytes]:
        start = time.monotonic()
        slow = [loader.load(f"{host.url}/{path}", f"messages[{i}]")
                for i, path in enumerate(["drip-body.png", "drip-headers.png", "silent.png"] * 2)]
        results = await asyncio.gather(*slow, return_exceptions=True)
        elapsed = time.monotonic() - start
        return results, elapsed, await loader.load(f"{host.url}/ok.png", "messages[6]")

    try:
        results, elapsed, image = asyncio.run(asyncio.wait_for(run(), timeout=10))
        workers = [t for t in set(threading.enumerate()) - before
                   if t.name.startswith("mmserve-media_")]
    finally:
        loader.close()
    for i, result in enumerate(results):
        assert isinstance(result, InvalidInputError), repr(result)
        assert "--media-fetch-timeout" in str(result)
        assert result.param == f"messages[{i}]"
    assert 1.4 < elapsed < 2.5  # 6 fetches / 2 workers x 0.5 s
    assert len(workers) == 2
    assert Image.open(io.BytesIO(image)).size == GOOD_IMAGE.size  # decoded later, by the
    assert_no_deadline_threads()  # request's preprocessing


def test_loader_reports_decode_errors_and_closes_without_waiting(host: LoopbackHost) -> None:
    loader = MediaLoader(policy(0.5), max_pixels=100, max_workers=1)

    async def run() -> None:
        with pytest.raises(InvalidInputError, match="exceeds the limit of 100 pixels") as info:
            await loader.load(f"{host.url}/ok.png", "messages[1]")
        assert info.value.param == "messages[1]"
        slow = asyncio.ensure_future(loader.load(f"{host.url}/silent.png"))
        await asyncio.sleep(0.1)  # the fetch is running
        start = time.monotonic()
        loader.close()
        assert time.monotonic() - start < 0.1  # does not wait for the stuck fetch
        with pytest.raises(InvalidInputError, match="--media-fetch-timeout"):
            await slow  # which still ends by its deadline

    asyncio.run(asyncio.wait_for(run(), timeout=5))
    assert_no_deadline_threads()


def test_loader_hands_on_checked_bytes_not_pixels() -> None:
    # A 7000x7000 1-bit PNG is a few KB; decoded to RGB, 147 MB. Requests waiting for their
    # preprocessing hold the bytes: the pixels are decoded there, one image at a time.
    buf = io.BytesIO()
    Image.new("1", (7000, 7000)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    loader = MediaLoader(policy(0.5), max_pixels=50_000_000, max_workers=1)
    smaller = MediaLoader(policy(0.5), max_pixels=40_000_000, max_workers=1)
    try:
        data = asyncio.run(loader.load(url, "messages[0]"))
        assert data == buf.getvalue() and len(data) < 100_000
        with pytest.raises(InvalidInputError, match="exceeds the limit") as e:  # its header
            asyncio.run(smaller.load(url, "messages[1]"))
        assert e.value.param == "messages[1]"
    finally:
        loader.close()
        smaller.close()
