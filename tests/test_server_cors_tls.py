"""vLLM's CORS and HTTPS settings of ``mmserve serve``: browsers on the allowed origins get
their preflight answered (before the API key is asked for) and the CORS headers, others and a
server without the setting none; the server speaks HTTPS with ``--ssl-keyfile`` and
``--ssl-certfile``, and bad settings are refused at start-up.

``tests/data/localhost-*.pem`` is a self-signed certificate for 127.0.0.1 made for these
tests alone (its key guards nothing); ``other-key.pem`` is a key of another certificate, and
``encrypted-key.pem`` one with a passphrase ("secret")."""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from mmserve import LLM
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.serve_args import ServerConfig, list_flag
from tests.conftest import assert_no_leaks
from tests.test_server import Server, wait_drained

DATA = Path(__file__).parent / "data"
CERT, KEY = str(DATA / "localhost-cert.pem"), str(DATA / "localhost-key.pem")
APP = "https://app.example.com"
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture(scope="module")
def llm(clip_llama: str):
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        yield llm
        assert_no_leaks(llm.engine)


def _client(llm: LLM, **settings) -> TestClient:
    return TestClient(OpenAIServer(llm.engine, ServerConfig("tiny", api_key="k",
                                                            **settings)).app())


def test_allowed_origins_get_cors_headers_and_a_preflight_without_a_key(llm: LLM) -> None:
    key = {"Authorization": "Bearer k"}
    with _client(llm, allowed_origins=(APP,)) as http:
        preflight = http.options("/v1/chat/completions", headers=PREFLIGHT)
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == APP
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        answer = http.post("/v1/completions", headers={"Origin": APP, **key},
                           json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == APP
        assert "x-request-id" in answer.headers["access-control-expose-headers"].lower()
        # Without the key the request itself is refused, with the header the browser needs
        # to show the refusal to its page.
        refused = http.get("/v1/models", headers={"Origin": APP})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == APP
        other = http.options("/v1/chat/completions",
                             headers={**PREFLIGHT, "Origin": "https://elsewhere.example"})
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers
        plain = http.get("/v1/models", headers={"Origin": "https://elsewhere.example", **key})
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
    with _client(llm, allowed_origins=("*",), allowed_methods=("GET",)) as http:
        assert http.get("/v1/models", headers={"Origin": "https://any.example", **key}
                        ).headers["access-control-allow-origin"] == "*"
        assert http.options("/v1/chat/completions", headers=PREFLIGHT).status_code == 400


def test_no_cors_without_the_setting(llm: LLM) -> None:
    with _client(llm) as http:
        preflight = http.options("/v1/chat/completions", headers=PREFLIGHT)
        assert preflight.status_code in (401, 405)
        assert "access-control-allow-origin" not in preflight.headers
        answer = http.get("/v1/models", headers={"Origin": APP, "Authorization": "Bearer k"})
        assert answer.status_code == 200
        assert "access-control-allow-origin" not in answer.headers


def test_list_flags_take_vllms_json_lists_and_commas() -> None:
    assert list_flag(None, ("*",)) == ("*",)
    assert list_flag([f"{APP}, http://localhost:3000"], ()) == (APP, "http://localhost:3000")
    assert list_flag(['["*"]'], ()) == ("*",)
    assert list_flag(['["GET", "POST"]', "PUT"], ()) == ("GET", "POST", "PUT")
    for bad in ('["*"', '[1]', '[{"a": 1}]'):
        with pytest.raises(ValueError, match="JSON list"):
            list_flag([bad], ())
    # One value a flag: the model path after the flags stays the model path.
    from mmserve.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--allowed-origins", '["*"]', "--allowed-origins",
                                      APP, "--allowed-methods", "GET,POST", "/models/qwen"])
    assert args.model_path == "/models/qwen"
    assert list_flag(args.allowed_origins, ()) == ("*", APP)
    from mmserve.entrypoints.serve_command import front_door_config

    for command in ("serve", "run-batch"):
        io = ["-i", "in.jsonl", "-o", "out.jsonl"] if command == "run-batch" else []
        parsed = build_parser().parse_args([
            command, *io, "--allowed-media-domains", "a.example, b.example",
            "--allowed-media-domains", '["c.example"]', "/models/qwen"])
        assert parsed.model_path == "/models/qwen"
        assert front_door_config(parsed, parsed.model_path).media.allowed_domains == (
            "a.example", "b.example", "c.example")
    assert list_flag(args.allowed_methods, ()) == ("GET", "POST")


def test_bad_tls_settings_are_refused(tmp_path: Path) -> None:
    for settings, message in (
            ({"ssl_keyfile": KEY}, "both --ssl-keyfile and --ssl-certfile"),
            ({"ssl_keyfile": KEY, "ssl_certfile": str(tmp_path / "none.pem")},
             "--ssl-certfile .*none.pem: no such file"),
            ({"ssl_keyfile": KEY, "ssl_certfile": CERT, "ssl_cert_reqs": 2},
             "--ssl-ca-certs"),
            ({"ssl_keyfile": KEY, "ssl_certfile": CERT, "ssl_cert_reqs": 3}, "0 \\(none\\)"),
            ({"ssl_ca_certs": CERT}, "needs HTTPS"),
            ({"ssl_keyfile": str(DATA / "other-key.pem"), "ssl_certfile": CERT},
             "its own key"),
            ({"ssl_keyfile": KEY, "ssl_certfile": KEY}, "its own key"),
            ({"ssl_keyfile": str(DATA / "encrypted-key.pem"), "ssl_certfile": CERT},
             "is encrypted"),
            ({"ssl_keyfile": KEY, "ssl_certfile": CERT, "ssl_ca_certs": KEY,
              "ssl_cert_reqs": 2}, "--ssl-ca-certs"),
            ({"allowed_origins": ("*",), "allow_credentials": True}, "list the origins")):
        with pytest.raises(ValueError, match=message):
            ServerConfig("tiny", **settings)
    done = subprocess.run([sys.executable, "-m", "mmserve.entrypoints.cli", "serve",
                           str(tmp_path), "--allowed-origins", '["oops"', "--port", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "is not a JSON list" in done.stderr


@pytest.mark.slow
def test_the_server_speaks_https(clip_llama: str, tmp_path: Path) -> None:
    """``mmserve serve --ssl-keyfile --ssl-certfile``: a client that trusts the certificate
    gets its answers over HTTPS; one that does not, or that speaks plain HTTP, none."""
    server = Server(clip_llama, "--served-model-name", "tiny", "--ssl-keyfile", KEY,
                    "--ssl-certfile", CERT, "--allowed-origins", APP, log=tmp_path / "log",
                    verify=CERT)
    try:
        trusted = ssl.create_default_context(cafile=CERT)
        answer = httpx.post(f"{server.url}/v1/completions", verify=trusted, timeout=60, json={
            "model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0},
            headers={"Origin": APP})
        assert answer.status_code == 200
        assert answer.json()["usage"]["completion_tokens"] == 3
        assert answer.headers["access-control-allow-origin"] == APP
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=5)  # the system's CAs do not know it
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
        wait_drained(server.url, verify=trusted)
    finally:
        assert server.stop() == 0
