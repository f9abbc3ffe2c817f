"""Bad input and safety through a real server: every malformed request gets its 4xx with an
OpenAI-style error body that names the problem, and a good request right after it succeeds.

The module's server requires an API key (from ``MMSERVE_API_KEY``), runs one sequence at a time
with a queue of one, caps bodies, image bytes and pixels, and allows images only from a loopback
HTTP server started here and from one local directory.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.conftest import make_image
from tests.test_server import Server, data_url, image_message, wait_drained

KEY = "test-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_IMAGE_BYTES = 100_000
MAX_BODY = 400_000
GOOD_PNG = make_image(5, (48, 40))


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


class _Images(BaseHTTPRequestHandler):
    """Loopback image host: /ok.png, /big.png and /big-unsized.png (over the byte cap, with and
    without Content-Length), /slow.png (over the fetch timeout), /redirect (to a host that is
    not allowed), anything else 404."""

    def do_GET(self) -> None:  # noqa: N802 (api.server's name)
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://example.com/ok.png")
            self.end_headers()
            return
        if self.path == "/slow.png":
            time.sleep(1.5)
        big = b"\x89PNG\r\n\x1a\n" + bytes(MAX_IMAGE_BYTES)
        body = {"/ok.png": png_bytes(GOOD_PNG), "/slow.png": png_bytes(GOOD_PNG),
                "/big.png": big, "/big-unsized.png": big}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if self.path != "/big-unsized.png":  # that one is cut off by counting bytes
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # mmserve stopped reading at its byte cap

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "ok.png").write_bytes(png_bytes(GOOD_PNG))
    (root / "secret.png").write_bytes(png_bytes(GOOD_PNG))
    (root / "allowed" / "link.png").symlink_to(root / "secret.png")
    return root


@pytest.fixture(scope="module")
def server(clip_llama: str, media_dir: Path, image_host: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server-errors") / "server.log"
    srv = Server(clip_llama, "--served-model-name", "tiny", "--max-num-seqs", "1",
                 "--max-queue", "1", "--limit-mm-per-prompt", "2",
                 "--max-image-pixels", "10000", "--max-image-bytes", str(MAX_IMAGE_BYTES),
                 "--max-request-body-bytes", str(MAX_BODY), "--media-fetch-timeout", "1",
                 "--allowed-media-domains", "127.0.0.1",
                 "--allowed-local-media-path", str(media_dir / "allowed"),
                 log=log, env={"MMSERVE_API_KEY": KEY})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


def chat(text: str = "hi", *urls: str, **extra: object) -> dict:
    return {"model": "tiny", "messages": image_message(text, *urls), "max_tokens": 3,
            "temperature": 0, **extra}


def assert_good(api: httpx.Client) -> None:
    resp = api.post("/v1/chat/completions", json=chat("ok", data_url(GOOD_PNG)))
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1


def assert_error(resp: httpx.Response, status: int, fragment: str,
                 param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return error


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


BOMB = Image.new("L", (4000, 4000))  # 16 M pixels in a few kB of PNG
BAD_JSON_BODIES = {
    "invalid JSON": (b'{"model": "tiny", "messages": [', "not valid JSON", None),
    "body not an object": (b"[1, 2]", "must be a JSON object", None),
    "body not UTF-8": (b'{"model": "\xff"}', "not valid JSON", None),
    "nesting too deep": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply", None),
}
BAD_REQUESTS = {
    "messages not a list": ({"model": "tiny", "messages": "hi"}, "'messages' must be",
                            "messages"),
    "unknown role": ({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]},
                     "'robot'", "messages[0].role"),
    "content wrong type": ({"model": "tiny", "messages": [{"role": "user", "content": 5}]},
                           "content must be a string or a list", "messages[0].content"),
    "unknown part type": ({"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "audio"}]}]}, "has type 'audio'", "messages[0].content[0].type"),
    "max_tokens wrong type": (chat(max_tokens="ten"), "must be an integer", "max_tokens"),
    "max_tokens zero": (chat(max_tokens=0), "between 1 and", "max_tokens"),
    "temperature wrong type": (chat(temperature="hot"), "must be a number", "temperature"),
    "top_p out of range": (chat(top_p=0), "top_p must be in (0, 1]", "top_p"),
    "stream not a bool": (chat(stream="yes"), "must be a boolean", "stream"),
    "stop wrong type": (chat(stop=[1]), "stop must be", "stop"),
    "n=129": (chat(n=129), "n must be an integer from 1 to 128", "n"),
    "stream_options without stream": (chat(stream_options={"include_usage": True}),
                                      "only allowed when 'stream' is true", "stream_options"),
    "data URL not base64": (chat("x", "data:image/png;base64,%%%not-base64"),
                            "not valid base64", None),
    "data URL without image type": (chat("x", "data:text/plain;base64,aGk="),
                                    "must look like 'data:image/", None),
    "data URL not an image": (chat("x", "data:image/png;base64," + _b64(b"hello, world")),
                              "not a PNG, JPEG, WebP or GIF", None),
    "truncated image": (chat("x", "data:image/png;base64,"
                             + _b64(png_bytes(make_image(1, (64, 64)))[:150])),
                        "cannot decode", None),
    "image over max-image-pixels": (chat("x", data_url(make_image(2, (120, 100)))),
                                    "12000 pixels exceeds the limit of 10000", None),
    "decompression bomb": (chat("x", data_url(BOMB)), "16000000 pixels exceeds the limit",
                           None),
    "more images than limit-mm-per-prompt": (
        chat("x", *[data_url(GOOD_PNG)] * 3), "carry 3 images but at most 2", "messages"),
    "prompt longer than max_model_len": (chat("a b c d " * 1500), "max_model_len", "messages"),
    "domain not allowed": (chat("x", "https://example.com/cat.png"),
                           "'example.com' is not allowed", None),
    "unsupported scheme": (chat("x", "ftp://127.0.0.1/ok.png"), "unsupported image URL",
                           None),
    "local path outside the allowed dir": (chat("x", "file:///etc/hostname"),
                                           "outside the allowed local media path", None),
    "unknown model": (chat(model="gpt-4o"), "'gpt-4o' does not exist", "model"),
}


@pytest.mark.parametrize("name", list(BAD_JSON_BODIES))
def test_malformed_body(api: httpx.Client, name: str) -> None:
    body, fragment, param = BAD_JSON_BODIES[name]
    resp = api.post("/v1/chat/completions", content=body,
                     headers={"Content-Type": "application/json"})
    assert_error(resp, 400, fragment, param)
    assert_good(api)


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request(api: httpx.Client, name: str) -> None:
    body, fragment, param = BAD_REQUESTS[name]
    status = 404 if name == "unknown model" else 400
    error = assert_error(api.post("/v1/chat/completions", json=body), status, fragment, param)
    assert error["type"] == "invalid_request_error"
    assert_good(api)


def test_local_files_under_the_allowed_path_only(api: httpx.Client, media_dir: Path) -> None:
    ok = api.post("/v1/chat/completions", json=chat("x", f"file://{media_dir}/allowed/ok.png"))
    assert ok.status_code == 200, ok.text
    for url in (f"file://{media_dir}/allowed/../secret.png",
                f"file://{media_dir}/allowed/link.png"):  # a symlink pointing outside
        assert_error(api.post("/v1/chat/completions", json=chat("x", url)), 400,
                     "outside the allowed local media path")
    assert_error(api.post("/v1/chat/completions",
                           json=chat("x", f"file://{media_dir}/allowed/missing.png")),
                 400, "not found")
    assert_good(api)


def test_remote_images_from_allowed_hosts(api: httpx.Client, image_host: str) -> None:
    ok = api.post("/v1/chat/completions", json=chat("x", f"{image_host}/ok.png"))
    assert ok.status_code == 200, ok.text
    for path, fragment in [("/big.png", "is 100008 bytes, over the limit of 100000 bytes"),
                           ("/big-unsized.png", "over the limit of 100000 bytes"),
                           ("/slow.png", "took longer than 1.0 s"),
                           ("/redirect", "does not follow redirects"),
                           ("/missing.png", "HTTP 404")]:
        resp = api.post("/v1/chat/completions", json=chat("x", f"{image_host}{path}"))
        assert_error(resp, 400, fragment)
    assert_good(api)


def test_body_size_cap(api: httpx.Client) -> None:
    body = json.dumps(chat("x" * MAX_BODY)).encode()
    resp = api.post("/v1/chat/completions", content=body,
                     headers={"Content-Type": "application/json"})
    assert_error(resp, 413, f"over {MAX_BODY} bytes")
    assert_good(api)


def test_api_key(server: Server, api: httpx.Client) -> None:
    for check in ("/health", "/ping"):
        assert httpx.get(f"{server.url}{check}").status_code == 200  # no key needed
    resp = httpx.post(f"{server.url}/invocations", json=chat())
    assert_error(resp, 401, "Authorization: Bearer")
    for path in ("/v1/models", "/metrics", "/stats"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            resp = httpx.get(f"{server.url}{path}", headers=headers)
            assert assert_error(resp, 401, "API key")["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}{path}", headers=AUTH).status_code == 200
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=chat())
    assert_error(resp, 401, "Authorization: Bearer")
    assert_good(api)


def test_unknown_path_and_method(api: httpx.Client) -> None:
    assert_error(api.get("/v1/nothing"), 404, "/v1/nothing")
    assert_error(api.put("/v1/chat/completions"), 405, "PUT")  # (GET lists stored ones)
    assert_good(api)


def test_queue_full_is_503_with_retry_after(server: Server, api: httpx.Client) -> None:
    """One running (max-num-seqs 1) plus one waiting (max-queue 1): the third gets 503."""
    long = chat("go", max_tokens=1500, ignore_eos=True, stream=True)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c1, \
            httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c2:
        with c1.stream("POST", "/v1/chat/completions", json=long) as running:
            assert running.status_code == 200
            # Hold the line iterator: dropping it would close the connection (an abort).
            running_lines = running.iter_lines()
            assert next(running_lines).startswith("data:")
            with c2.stream("POST", "/v1/chat/completions", json=long) as waiting:
                assert waiting.status_code == 200
                resp = api.post("/v1/chat/completions", json=chat())
                error = assert_error(resp, 503, "already waiting for a slot (--max-queue 1)")
                assert error["code"] == "queue_full"
                assert resp.headers["Retry-After"] == "1"
    wait_drained(server.url, AUTH)
    assert_good(api)
