"""The server's HTTP plumbing, apart from its endpoints: the API key check, request ids (and
the JSON 500 a handler's bug gets), OpenAI's error body for every error response, and large
JSON bodies written piece by piece."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from mmserve.entrypoints import chat_page
from mmserve.entrypoints.openai_protocol import ApiError

logger = logging.getLogger(__name__)


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on every path but the health checks (/health, and
    /ping for SageMaker) and the chat page (which asks for the key and sends it on its API
    calls), compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.expected is None or scope["type"] != "http"
                or scope["path"] in ("/health", "/ping") or chat_page.is_public(scope["path"])):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        err = ApiError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")
        await error_response(err)(scope, receive, send)


# A request id a client may give in its ``X-Request-Id`` header (vLLM's): letters, digits and
# ``-_.:``, at most 128 of them.
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class RequestIdMiddleware:
    """Gives every HTTP request an id (``scope["state"]["request_id"]``, echoed in the
    ``X-Request-Id`` response header): the client's ``X-Request-Id`` where it sends one (as
    vLLM takes it, for tracing across services; one not of ``CLIENT_REQUEST_ID``'s form is
    ignored), else a fresh one. Counts every response by status code, and answers an
    exception that escapes a handler (a bug) with a JSON 500 that quotes the id and tells no
    internals; the log gets the traceback under the same id."""

    def __init__(self, app: ASGIApp, count: Any) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        fresh = uuid.uuid4().hex
        given = dict(scope.get("headers") or ()).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if CLIENT_REQUEST_ID.fullmatch(given) else fresh
        # The engine's ids are unique whatever clients send: a given id gets a fresh suffix.
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["engine_id"] = fresh if request_id == fresh else f"{given}-{fresh[:12]}"

        started = False

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", request_id.encode())]
                self.count(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # noqa: BLE001 (answered and logged)
            logger.error("internal error on %s %s (request id %s)", scope.get("method"),
                         scope.get("path"), request_id, exc_info=exc)
            if started:  # a stream already under way: all we can do is end it
                return
            err = ApiError(500, f"internal server error (request id {request_id}); the server "
                           "log has the details.", type="server_error", code="internal_error")
            await error_response(err)(scope, receive, send_with_id)


def request_ids_of(request: Request, prefix: str) -> tuple[str, str]:
    """The id ``RequestIdMiddleware`` gave the request, for its answer, and a unique one for
    the engine, each after ``prefix`` (fresh ones outside the middleware)."""
    state = request.scope.get("state", {})
    fresh = uuid.uuid4().hex
    return (f"{prefix}{state.get('request_id') or fresh}",
            f"{prefix}{state.get('engine_id') or fresh}")


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class ClosingStream(StreamingResponse):
    """A streamed answer that calls ``on_close`` once it has ended, however it ended: sent
    whole, the client gone, or its task cancelled before the body's first chunk, when the
    body's generator, never started, runs no ``finally`` of its own."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], object] | None,
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()


def store_endpoint(handler: Callable[[Request, Any], Awaitable[Response]],
                   store: Callable[[], Any], missing: Callable[[], ApiError]
                   ) -> Callable[[Request], Awaitable[Response]]:
    """``handler(request, store())`` as an endpoint of an API over a store the server may
    keep none of (``missing()``, the error that says how to have one); an ``ApiError`` it
    raises is OpenAI's error body."""
    async def endpoint(request: Request) -> Response:
        try:
            kept = store()
            if kept is None:
                raise missing()
            return await handler(request, kept)
        except ApiError as e:
            return error_response(e)
    return endpoint


async def http_exception(request: Request, exc: HTTPException) -> Response:
    return error_response(ApiError(exc.status_code, f"{exc.detail}: {request.method} "
                                    f"{request.url.path}", code="not_found"
                                    if exc.status_code == 404 else None))


class LargeParts:
    """Lists in a JSON body that may be large (a long prompt's log-probabilities): each
    stands in the body as a placeholder (``add``), and ``response`` writes it piece by
    piece, each piece made when it is written, so that neither making nor encoding it keeps
    the event loop from the other requests for long."""

    def __init__(self, piece: int = 512) -> None:
        self.piece = piece  # elements made and written at once
        self._stem = f"\x00part-{uuid.uuid4().hex}-"
        self._parts: list[tuple[str, Callable[[int, int], list[Any]], int]] = []

    def add(self, make: Callable[[int, int], list[Any]], length: int) -> Any:
        """The list of ``length`` elements ``make(start, end)`` makes a span of: made now
        where it is one piece, else a placeholder for it."""
        if length <= self.piece:
            return make(0, length)
        placeholder = f"{self._stem}{len(self._parts)}"
        self._parts.append((placeholder, make, length))
        return placeholder

    def response(self, body: dict[str, Any]) -> Response:
        """``body`` as an ``application/json`` response, its placeholders written out."""
        if not self._parts:
            return JSONResponse(body)
        return StreamingResponse(self._write(json.dumps(body, separators=(",", ":"))),
                                 media_type="application/json")

    async def _write(self, text: str) -> AsyncIterator[bytes]:
        at = 0
        for placeholder, make, length in self._parts:
            marker = json.dumps(placeholder)
            found = text.index(marker, at)
            yield (text[at:found] + "[").encode()
            for start in range(0, length, self.piece):
                encoded = json.dumps(make(start, min(start + self.piece, length)),
                                     separators=(",", ":"))[1:-1]
                yield (encoded if start == 0 else "," + encoded).encode()
                await asyncio.sleep(0)  # the other requests' turn
            yield b"]"
            at = found + len(marker)
        yield text[at:].encode()
