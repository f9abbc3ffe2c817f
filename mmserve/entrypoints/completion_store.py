"""OpenAI's stored chat completions: a chat request sent with ``store: true`` is kept, its
``metadata`` and messages with it, for the openai client's ``chat.completions`` calls:

- ``GET /v1/chat/completions`` (``list``: by ``model`` and ``metadata[key]=value``, oldest
  first unless ``order=desc``, ``limit`` up to 100, ``after``);
- ``GET``/``POST``/``DELETE /v1/chat/completions/{id}`` (``retrieve``, ``update`` its
  ``metadata``, ``delete``);
- ``GET /v1/chat/completions/{id}/messages`` (``messages.list``: the request's messages, each
  with an id of its own).

Completions are kept in the server's memory, at most ``max_bytes`` of their JSON (messages,
images' data URLs included); past it the oldest are forgotten first. Nothing outlives the
process.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mmserve.entrypoints.http_middleware import store_endpoint
from mmserve.entrypoints.openai_protocol import ApiError, bad_request, metadata_of, paged
from mmserve.entrypoints.response_store import (
    DEFAULT_LIST_LIMIT,
    MAX_LIST_LIMIT,
    BoundedStore,
    json_size,
)

logger = logging.getLogger(__name__)


@dataclass
class StoredCompletion:
    body: dict[str, Any]  # the chat.completion object, its ``metadata`` included
    messages: list[dict[str, Any]]  # the request's, each with its ``id``
    nbytes: int = 0


class CompletionStore(BoundedStore):
    """Completion id -> ``StoredCompletion``, in the order they were stored, at most
    ``max_bytes`` of JSON; the oldest forgotten first to make room."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self._answering: set[str] = set()  # ids of answers to be stored (``reserve``)

    def reserve(self, completion_id: str) -> bool:
        """Keep ``completion_id`` for an answer being made (until ``unreserve``); False
        where a stored completion or another answer has it: two clients that send one
        ``X-Request-Id`` at once never share a stored completion."""
        if completion_id in self._entries or completion_id in self._answering:
            return False
        self._answering.add(completion_id)
        return True

    def unreserve(self, completion_id: str) -> None:
        self._answering.discard(completion_id)

    def put(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Keep a finished completion and the messages it answered, the oldest forgotten to
        make room; False, none forgotten, where it is larger than the store (or its id is
        kept already, which ``reserve`` rules out)."""
        completion_id = body["id"]
        messages = [_stored_message(message, f"{completion_id}-{i}")
                    for i, message in enumerate(messages)]
        stored = StoredCompletion(body, messages, json_size(body) + json_size(messages))
        if completion_id in self._entries or not self._fit(stored.nbytes, None):
            return False
        self._add(completion_id, stored)
        return True

    def get(self, completion_id: str) -> StoredCompletion | None:
        return self._entries.get(completion_id)

    def update(self, stored: StoredCompletion, metadata: dict[str, str]) -> bool:
        """Replace the metadata, the oldest others forgotten to make room; False, none
        forgotten, where it would not fit even alone."""
        change = json_size(metadata) - json_size(stored.body["metadata"])
        if not self._fit(change, stored.body["id"]):
            return False
        stored.body["metadata"] = metadata
        self._resize(stored, change)
        return True

    def bodies(self, model: str | None, metadata: dict[str, str]) -> list[dict[str, Any]]:
        """The completions kept, oldest first, of ``model`` (None: any) whose metadata holds
        every pair of ``metadata``."""
        return [stored.body for stored in self._entries.values()
                if (model is None or stored.body["model"] == model)
                and all(stored.body["metadata"].get(k) == v for k, v in metadata.items())]


class StoredCompletionsApi:
    """The stored chat completions' endpoints over a ``CompletionStore`` of ``max_bytes``
    (none where it is 0: each endpoint then says how to have one); ``read_json``: the
    server's bounded reading of a request's JSON body."""

    def __init__(self, max_bytes: int, read_json: Callable[[Request], Awaitable[Any]]) -> None:
        self.store = CompletionStore(max_bytes) if max_bytes > 0 else None
        self.read_json = read_json

    def routes(self) -> list[Route]:
        base = "/v1/chat/completions/{completion_id}"
        return [
            Route("/v1/chat/completions", self._handle(self.list), methods=["GET"]),
            Route(base, self._handle(self.retrieve), methods=["GET"]),
            Route(base, self._handle(self.update), methods=["POST"]),
            Route(base, self._handle(self.delete), methods=["DELETE"]),
            Route(f"{base}/messages", self._handle(self.messages), methods=["GET"]),
        ]

    def keep(self, body: dict[str, Any], messages: list[dict[str, Any]],
             metadata: dict[str, str]) -> None:
        """Store a finished completion a request asked to store (where the server keeps
        any): ``body`` with ``metadata``, and the request's ``messages``."""
        if self.store is not None and not self.store.put({**body, "metadata": metadata},
                                                          messages):
            logger.warning("chat completion %s was not stored: it is larger than the store "
                           "of chat completions (--responses-store-mib)", body["id"])

    # ----------------------------------------------------------------- endpoints
    async def list(self, request: Request, store: CompletionStore) -> Response:
        query = request.query_params
        metadata = {key[len("metadata["):-1]: value for key, value in query.items()
                    if key.startswith("metadata[") and key.endswith("]")}
        bodies = store.bodies(query.get("model"), metadata)
        return JSONResponse(paged(bodies, {"order": "asc", **query}, DEFAULT_LIST_LIMIT,
                                  MAX_LIST_LIMIT, "stored chat completion"))

    async def retrieve(self, request: Request, store: CompletionStore) -> Response:
        return JSONResponse(self._stored(request, store).body)

    async def update(self, request: Request, store: CompletionStore) -> Response:
        body = await self.read_json(request)
        if not isinstance(body, dict) or "metadata" not in body:
            raise bad_request("send the completion's new 'metadata'", "metadata")
        stored = self._stored(request, store)
        if not store.update(stored, metadata_of(body["metadata"])):
            raise ApiError(400, f"the new metadata does not fit the server's store of chat "
                           f"completions ({store.max_bytes} bytes of JSON, "
                           "--responses-store-mib)", "metadata", code="completion_too_large")
        return JSONResponse(stored.body)

    async def delete(self, request: Request, store: CompletionStore) -> Response:
        stored = self._stored(request, store)
        store.delete(stored.body["id"])
        return JSONResponse({"object": "chat.completion.deleted", "id": stored.body["id"],
                             "deleted": True})

    async def messages(self, request: Request, store: CompletionStore) -> Response:
        stored = self._stored(request, store)
        return JSONResponse(paged(stored.messages, {"order": "asc", **request.query_params},
                                  DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT, "message",
                                  "in this chat completion"))

    # ----------------------------------------------------------------- helpers
    def _handle(self, handler: Callable[[Request, CompletionStore], Awaitable[Response]]
                ) -> Callable[[Request], Awaitable[Response]]:
        return store_endpoint(handler, lambda: self.store, _disabled)

    @staticmethod
    def _stored(request: Request, store: CompletionStore) -> StoredCompletion:
        completion_id = request.path_params["completion_id"]
        stored = store.get(completion_id)
        if stored is None:
            raise ApiError(404, f"no stored chat completion has the id "
                           f"{completion_id[:64]!r} (a chat request is stored when it sends "
                           "'store': true; they are kept in the server's memory while it "
                           "runs, the oldest forgotten past --responses-store-mib)",
                           "completion_id", code="completion_not_found")
        return stored


def _stored_message(message: dict[str, Any], message_id: str) -> dict[str, Any]:
    """A request's message as OpenAI lists a stored one: with its ``id``, and content sent
    as parts in ``content_parts`` (``content`` then their text, joined by line breaks),
    each image part in OpenAI's shape (``{"image_url": {"url": ...}}``, however it was
    sent); images sent as embeddings (vLLM's ``image_embeds`` parts) are left out."""
    stored = {**message, "id": message_id}
    content = message.get("content")
    if isinstance(content, list):
        parts = [_stored_part(part) for part in content]
        parts = [part for part in parts if part is not None]
        texts = [part["text"] for part in parts if part["type"] == "text"]
        stored["content"] = "\n".join(texts) if texts else None
        stored["content_parts"] = parts
    return stored


def _stored_part(part: dict[str, Any]) -> dict[str, Any] | None:
    kind = part.get("type")
    if kind == "image_url":
        image = part.get("image_url")
        return {"type": "image_url",
                "image_url": image if isinstance(image, dict) else {"url": image}}
    if kind == "image_embeds":
        return None
    return part  # text, and files (an uploaded image's ``file_id``)


def _disabled() -> ApiError:
    return ApiError(404, "this server stores no chat completions: start it with "
                    "--responses-store-mib above 0.", code="stored_completions_disabled")


__all__ = ["CompletionStore", "StoredCompletion", "StoredCompletionsApi"]
