"""The chat page at ``GET /`` without a browser: the page and its assets are served from the
package with their content types, load nothing from the internet, and need no API key while the
API still does.

The app is built over a stand-in engine and its lifespan never runs (``TestClient`` outside a
``with`` block), so no model loads: these routes never reach the engine. The page's behaviour
in a real browser is ``test_chat_page_browser.py``.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from importlib import resources
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from mmserve.entrypoints.api_server import ServerConfig, build_app

KEY = "page-test-key"
CONTENT_TYPES = {
    "/": "text/html; charset=utf-8",
    "/static/chat.css": "text/css; charset=utf-8",
    "/static/chat.js": "text/javascript; charset=utf-8",
}


class StandInEngine:
    """What ``OpenAIServer`` reads of an engine when it builds its app."""

    config = SimpleNamespace(max_model_len=64, limit_mm_per_prompt=1, max_image_pixels=10**6,
                             max_num_seqs=1, model="", generation_config="vllm",
                             scheduling_policy="fcfs")

    def stats(self) -> dict[str, Any]:
        return {}


def client(api_key: str | None = None) -> TestClient:
    app = build_app(StandInEngine(), ServerConfig("stand-in", api_key=api_key))  # type: ignore[arg-type]
    return TestClient(app)


class References(HTMLParser):
    """Every ``src`` and ``href`` of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [value for name, value in attrs if name in ("src", "href") and value]


def page_references(html: str) -> list[str]:
    parser = References()
    parser.feed(html)
    return parser.urls


def test_page_and_assets_are_served_with_their_content_types() -> None:
    http = client()
    page = http.get("/")
    assert page.status_code == 200
    assert "<meta name=\"viewport\"" in page.text
    # The page names its assets relative to itself, and every one of them is served; its icon
    # is empty, so that the browser does not ask for /favicon.ico.
    references = page_references(page.text)
    assert sorted(references) == ["data:,", "static/chat.css", "static/chat.js"]
    for path, content_type in CONTENT_TYPES.items():
        resp = http.get(path)
        assert resp.status_code == 200, path
        assert resp.headers["content-type"] == content_type, path
        assert resp.headers["x-content-type-options"] == "nosniff"
        assert "connect-src 'self'" in resp.headers["content-security-policy"]
    assert http.get("/static/chat.js").content == (
        resources.files("mmserve.entrypoints").joinpath("static", "chat.js").read_bytes())


@pytest.mark.parametrize("path", ["/static/index.html", "/static/missing.js", "/static/",
                                  "/static/../api_server.py", "/index.html"])
def test_only_the_listed_assets_are_served(path: str) -> None:
    resp = client().get(path)
    assert resp.status_code == 404, path
    assert "error" in resp.json()


def test_nothing_is_loaded_from_the_internet() -> None:
    """The page must work on a server without internet access: no CDN script, font or image,
    in the files shipped with the package (all of them, not only those the page names)."""
    static = resources.files("mmserve.entrypoints").joinpath("static")
    names = sorted(f.name for f in static.iterdir() if f.is_file())
    assert names == ["chat.css", "chat.js", "index.html"]
    for name in names:
        text = static.joinpath(name).read_text(encoding="utf-8")
        assert not re.search(r"https?://", text, re.I), name
        assert not re.search(r"""(?:src|href|url)\s*[=(]\s*["']?//""", text, re.I), name
        assert "@import" not in text, name


def test_page_needs_no_key_but_the_api_does() -> None:
    http = client(api_key=KEY)
    for path in CONTENT_TYPES:
        assert http.get(path).status_code == 200, path
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/v1/models", "/stats"):
        resp = http.get(path)
        assert resp.status_code == 401, path
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert http.get(path, headers=auth).status_code == 200, path
    models = http.get("/v1/models", headers=auth).json()
    assert models["data"][0]["id"] == "stand-in"
    # Only the page's own files are public: any other path asks for the key first.
    for path in ("/elsewhere", "/static/missing.js", "/static/"):
        assert http.get(path).status_code == 401, path
        assert http.get(path, headers=auth).status_code == 404, path
