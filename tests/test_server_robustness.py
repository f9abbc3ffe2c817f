"""No single request can hurt the server: hostile inputs through a real socket.

Each test sends what a hostile or broken client would (parameters that used to crash the
engine step, numbers with thousands of digits, invalid Unicode, malformed URLs, requests that
stall half way) and checks the answer (a 4xx with OpenAI's error body naming the problem, or
a closed connection), that ``/health`` stays 200, and that a normal request right after gets
the same greedy text as before.
"""

from __future__ import annotations

import json
import signal
import socket
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_image
from tests.test_server import Server, data_url, image_message, metric, wait_drained

IMAGE = make_image(3, (40, 30))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    IMAGE.save(root / "ok.png")
    return root


@pytest.fixture(scope="module")
def server(clip_llama: str, media_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("robust") / "server.log"
    srv = Server(clip_llama, "--served-model-name", "tiny", "--max-model-len", "128",
                 "--header-timeout", "1", "--body-timeout", "1",
                 "--allowed-local-media-path", str(media_dir), log=log)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _body(**extra: object) -> dict:
    return {"model": "tiny", "max_tokens": 6, "temperature": 0,
            "messages": image_message("what is this?", data_url(IMAGE)), **extra}


@pytest.fixture(scope="module")
def expected(api: httpx.Client) -> str:
    resp = api.post("/v1/chat/completions", json=_body())
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def _assert_still_serving(api: httpx.Client, expected: str) -> None:
    assert api.get("/health").status_code == 200
    resp = api.post("/v1/chat/completions", json=_body())
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == expected


def _raw_post(api: httpx.Client, body: str) -> httpx.Response:
    return api.post("/v1/chat/completions", content=body.encode("utf-8", "surrogatepass"),
                    headers={"Content-Type": "application/json"})


# (name, the request body as JSON text, the status, the error's param, a message fragment)
BIG = "9" * 5000
HOSTILE = [
    ("tiny temperature", json.dumps(_body(temperature=1e-300)), "temperature", "0 (greedy)"),
    ("subnormal temperature", json.dumps(_body(temperature=1e-45)), "temperature", "greedy"),
    ("seed 2**64", json.dumps(_body(seed=2**64)), "seed", "2**64 - 1"),
    ("seed below -2**63", json.dumps(_body(seed=-(2**63) - 1)), "seed", "-2**63"),
    ("5000-digit max_tokens", json.dumps(_body())[:-1] + f', "max_tokens": {BIG}}}', None,
     "digits"),
    ("5000-digit seed", json.dumps(_body())[:-1] + f', "seed": {BIG}}}', None, "digits"),
    ("5000-digit temperature", json.dumps(_body())[:-1] + f', "temperature": -{BIG}}}', None,
     "digits"),
    ("huge max_tokens", json.dumps(_body(max_tokens=10**20)), "max_tokens", "max_model_len"),
    ("NaN top_p", json.dumps(_body())[:-1] + ', "top_p": NaN}', "top_p", "top_p"),
    ("infinite temperature", json.dumps(_body())[:-1] + ', "temperature": Infinity}',
     "temperature", "temperature"),
    ("300,000 stop strings", json.dumps(_body(stop=["x"] * 300_000)), "stop", "at most"),
    ("one huge stop string", json.dumps(_body(stop="y" * 100_000)), "stop", "characters"),
    ("lone surrogate in text", json.dumps(_body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a\ud800b"}]}])), "messages[0].content[0].text",
     "surrogate"),
    ("lone surrogate in content", json.dumps(_body(messages=[
        {"role": "system", "content": "\udfff"}, {"role": "user", "content": "hi"}])),
     "messages[0].content", "surrogate"),
    ("lone surrogate in stop", json.dumps(_body(stop=["\ud834"])), "stop", "surrogate"),
    ("image placeholder typed as text", json.dumps(_body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "look: <image> what is it?"}]}])), None, "image part"),
    ("invalid IPv6 URL", json.dumps(_body(messages=image_message("x", "http://[::1/a.png"))),
     None, "malformed"),
    ("NUL in a file URL", json.dumps(_body(messages=image_message("x", "file:///tmp/a%00b.png"))),
     None, None),
    ("bad port", json.dumps(_body(messages=image_message("x", "http://h:99999/a.png"))), None,
     None),
]


@pytest.mark.parametrize("name, body, param, fragment", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_request_is_a_400(api: httpx.Client, expected: str, name: str, body: str,
                                  param: str | None, fragment: str | None) -> None:
    resp = _raw_post(api, body)
    assert resp.status_code == 400, (name, resp.status_code, resp.text[:500])
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    if fragment is not None:
        assert fragment in error["message"], error
    assert "Traceback" not in resp.text and "Error(" not in resp.text
    _assert_still_serving(api, expected)


def test_responses_carry_a_request_id_and_are_counted(api: httpx.Client) -> None:
    before = metric(api.get("/metrics").text, "mmserve_http_responses_total", code="400")
    resp = _raw_post(api, json.dumps(_body(seed=2**64)))
    assert resp.status_code == 400 and len(resp.headers["x-request-id"]) == 32
    ok = api.get("/health")
    assert ok.headers["x-request-id"] != resp.headers["x-request-id"]
    after = metric(api.get("/metrics").text, "mmserve_http_responses_total", code="400")
    assert after == before + 1


def test_stalled_headers_are_cut_off(server: Server, api: httpx.Client,
                                     expected: str) -> None:
    """Finding 5: a client that sends part of a request line and stalls (or sends nothing)
    is disconnected after --header-timeout, not held for ever."""
    socks = []
    for partial in (b"", b"POST /v1/chat/comp", b"POST /v1/chat/completions HTTP/1.1\r\nHo"):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(partial)
        s.settimeout(5)
        socks.append(s)
    t0 = time.monotonic()
    for s in socks:
        assert s.recv(1024) == b""  # closed by the server
        s.close()
    assert time.monotonic() - t0 < 4
    _assert_still_serving(api, expected)


def test_stalled_body_is_a_408(server: Server, api: httpx.Client, expected: str) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\"")
        s.settimeout(5)
        t0 = time.monotonic()
        head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 408"), head
        assert b"--body-timeout" in head + s.recv(4096)
        assert time.monotonic() - t0 < 4
    _assert_still_serving(api, expected)


def test_unexpected_exception_is_a_json_500_without_internals(caplog) -> None:
    """A handler bug: OpenAI's error body with the request id, no exception text; the log
    has the traceback under the same id; the response is counted by status."""
    import asyncio

    from mmserve.entrypoints.http_middleware import RequestIdMiddleware

    counted = []

    async def broken(scope, receive, send) -> None:  # noqa: ANN001
        raise KeyError("secret internal detail")

    app = RequestIdMiddleware(broken, count=counted.append)

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/v1/models")

    with caplog.at_level("ERROR"):
        resp = asyncio.run(call())
    assert resp.status_code == 500 and counted == [500]
    rid = resp.headers["x-request-id"]
    error = resp.json()["error"]
    assert rid in error["message"] and error["type"] == "server_error"
    assert "secret" not in resp.text and "KeyError" not in resp.text
    assert rid in caplog.text and "secret internal detail" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_drains_for_at_most_the_shutdown_timeout(clip_llama: str, tmp_path: Path,
                                                         stop: signal.Signals) -> None:
    """Finding 5: a client that sent headers and half a body, then stalled, kept SIGTERM from
    ever finishing. Now the server exits within --shutdown-timeout (plus the step it is in),
    and the requests it could finish meanwhile did finish. SIGINT (Ctrl-C) the same, with
    status 0 and no KeyboardInterrupt traceback."""
    srv = Server(clip_llama, "--body-timeout", "600", "--shutdown-timeout", "2",
                 log=tmp_path / "server.log")
    try:
        stalled = socket.create_connection(("127.0.0.1", srv.port))
        stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{")
        time.sleep(0.5)
        t0 = time.monotonic()
        srv.proc.send_signal(stop)
        code = srv.proc.wait(timeout=20)
        elapsed = time.monotonic() - t0
        stalled.close()
    finally:
        srv.stop()
    assert code == 0
    log = (tmp_path / "server.log").read_text()
    assert "Cancel 1 running task(s), timeout graceful shutdown exceeded" in log
    # (uvicorn logs the cancelled request's traceback; none of the signal's)
    assert "KeyboardInterrupt" not in log and f"stopped by {stop.name}" in log
    assert elapsed < 8, f"shutdown took {elapsed:.1f} s"


HARNESS = textwrap.dedent("""
    # mmserve serve with two faults injected below the engine. Sampling fails for requests
    # whose seed is POISON_SEED (as a request that slipped past validation would). Once the
    # file FLAG exists the decoder fails for good, as on a lost device: every step fails from
    # then on, for old and new requests alike.
    import os, sys
    from mmserve.worker import cuda_runner, model_runner

    flag = sys.argv[1]
    real_sample = model_runner.sample_on_device

    def broken(real_forward):
        def forward(self, *args, **kwargs):
            if os.path.exists(flag):
                raise RuntimeError("CUDA error: device lost (simulated)")
            return real_forward(self, *args, **kwargs)
        return forward

    def sample_on_device(logits, params, generator):
        drawn = real_sample(logits, params, generator)
        for i, p in enumerate(params):
            if p.seed == POISON_SEED:
                drawn.errors[i] = RuntimeError("probability tensor contains inf or nan "
                                               "(simulated)")
        return drawn

    for runner in (model_runner.ModelRunner, cuda_runner.CUDAModelRunner):  # each its own
        runner._forward = broken(runner._forward)
    model_runner.sample_on_device = sample_on_device
    if __name__ == "__main__":  # the engine's process runs what is above, not this
        from mmserve.entrypoints.cli import main
        sys.exit(main(sys.argv[2:]))
""").replace("POISON_SEED", "424242")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["--engine-process", "--no-engine-process"])
def test_failures_inside_steps(clip_llama: str, tmp_path: Path, layout: str) -> None:
    """A request that fails inside a step gets a 500 (in a stream: an error event) for
    itself alone, while a request running beside it finishes with its usual text and /health
    stays 200. When every step fails for every request, requests that ran fine before among
    them, the engine is broken: in-flight requests get an error and the process exits with
    status 1 so that a supervisor restarts it (it used to stay up with /health 503 for ever).
    In both layouts: the engine on a thread of the server's process, or in a process of its
    own (where the faults are then injected: the harness runs there again), each failure
    crossing to the front end.
    """
    flag = tmp_path / "broken"
    script = tmp_path / "harness.py"
    script.write_text(HARNESS)
    srv = Server(clip_llama, "--max-model-len", "128", layout,
                 log=tmp_path / "server.log", launcher=(str(script), str(flag)))
    try:
        good = {"max_tokens": 30, "temperature": 0, "ignore_eos": True,
                "messages": image_message("what is this?", data_url(IMAGE))}
        with httpx.Client(base_url=srv.url, timeout=60) as api:
            expected = api.post("/v1/chat/completions", json=good).json()
            poisoned = {**good, "temperature": 1.0, "seed": 424242}
            with ThreadPoolExecutor(3) as pool:
                beside = pool.submit(api.post, "/v1/chat/completions", json=good)
                plain = pool.submit(api.post, "/v1/chat/completions", json=poisoned)
                streamed = pool.submit(api.post, "/v1/chat/completions",
                                       json={**poisoned, "stream": True})
            assert beside.result().json()["choices"] == expected["choices"]
            error = plain.result().json()["error"]
            assert plain.result().status_code == 500 and error["code"] == "generation_failed"
            assert "nan (simulated)" in error["message"]
            events = [line[6:] for line in streamed.result().text.splitlines()
                      if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "generation_failed"
            assert api.get("/health").status_code == 200
            assert api.get("/stats").json()["num_failed_requests"] == 2

            body = {**good, "max_tokens": 100, "stream": True}
            events = []
            with api.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 4:  # tokens are flowing: now the device goes
                            flag.touch()
        assert events[-1] == "[DONE]", events[-3:]
        assert "device lost" in json.loads(events[-2])["error"]["message"], events[-3:]
        assert srv.proc.wait(timeout=60) == 1
    finally:
        srv.stop()
    text = (tmp_path / "server.log").read_text()
    assert "device lost" in text and "restart" in text


def test_drained_after_everything(server: Server) -> None:
    """Nothing above left a KV block or encoder-cache reference behind, and every hostile
    request was refused at the door (none reached an engine step)."""
    stats = wait_drained(server.url)
    assert stats["num_failed_requests"] == 0
