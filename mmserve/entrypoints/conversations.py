"""OpenAI's Conversations API, as the openai client's ``conversations`` calls it: a
conversation is a list of items (the Responses API's: messages, with images, function calls
and their outputs) that the server keeps, so that a client names it instead of sending its
history again.

- ``POST /v1/conversations`` (``items``, at most ``MAX_NEW_ITEMS``, and ``metadata``),
  ``GET``/``POST``/``DELETE /v1/conversations/{id}`` (read, update its metadata, forget it);
- ``GET``/``POST /v1/conversations/{id}/items`` (list, add), and ``GET``/``DELETE
  /v1/conversations/{id}/items/{item_id}``;
- a Responses API request with ``conversation`` reads the conversation's items before its
  ``input``, and once the response has completed, its input and output items are added to
  the conversation (``api_server.py``). The conversation is held while the response runs:
  another response naming it meanwhile is refused (``conversation_locked``, as OpenAI's), and
  it is not forgotten to make room.

Conversations live in the server's memory, at most ``max_bytes`` of their items' JSON; past it
the conversations used longest ago are forgotten first, as stored responses are, but not those
a running response holds. Nothing outlives the process.
"""

from __future__ import annotations

import time
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
from mmserve.entrypoints.responses_protocol import conversation_items, new_id

MAX_NEW_ITEMS = 20  # items one request adds (OpenAI's)


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]]
    nbytes: int = 0

    def body(self) -> dict[str, Any]:
        """OpenAI's conversation object."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}


class ConversationStore(BoundedStore):
    """Conversation id -> ``Conversation``, least recently used first, at most ``max_bytes``
    of JSON (metadata and items); those running responses hold (``hold``) are not forgotten
    to make room."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self._held: set[str] = set()  # conversations a running response will add to
        self.held_in_the_way = False  # the last ``_fit`` refused for them

    def create(self, metadata: dict[str, str], items: list[dict[str, Any]]
               ) -> Conversation | None:
        """A new conversation, others forgotten to make room; None (and none forgotten)
        where it does not fit."""
        items = _with_own_ids(set(), items)
        conversation = Conversation(new_id("conv"), int(time.time()), metadata, items)
        conversation.nbytes = json_size(metadata) + sum(map(json_size, items))
        if not self._fit(conversation.nbytes, None):
            return None
        self._add(conversation.id, conversation)
        return conversation

    def get(self, conversation_id: str) -> Conversation | None:
        """The conversation, counted as used now; None where it is not (or no longer) kept."""
        conversation = self._entries.get(conversation_id)
        if conversation is not None:
            self._entries.move_to_end(conversation_id)
        return conversation

    def hold(self, conversation: Conversation) -> bool:
        """Hold the conversation for a response that will add to it (never forgotten to make
        room meanwhile); False where another response holds it."""
        if conversation.id in self._held:
            return False
        self._held.add(conversation.id)
        return True

    def release(self, conversation_id: str) -> None:
        self._held.discard(conversation_id)

    def add(self, conversation: Conversation, items: list[dict[str, Any]]) -> bool:
        """Append ``items`` (each with an id; one the conversation holds already, as a client
        sends an earlier answer's items again, gets a new one), others forgotten to make
        room; False, and nothing added, where they do not fit (or the conversation is no
        longer kept)."""
        items[:] = _with_own_ids({item["id"] for item in conversation.items}, items)
        nbytes = sum(map(json_size, items))
        if self._entries.get(conversation.id) is not conversation or not self._fit(
                nbytes, conversation.id):
            return False
        conversation.items += items
        self._resize(conversation, nbytes)
        return True

    def update(self, conversation: Conversation, metadata: dict[str, str]) -> bool:
        """Replace the metadata; False where it does not fit."""
        change = json_size(metadata) - json_size(conversation.metadata)
        if not self._fit(change, conversation.id):
            return False
        conversation.metadata = metadata
        self._resize(conversation, change)
        return True

    def remove_item(self, conversation: Conversation, item_id: str) -> bool:
        for i, item in enumerate(conversation.items):
            if item.get("id") == item_id:
                del conversation.items[i]
                self._resize(conversation, -json_size(item))
                return True
        return False

    def _pinned(self) -> set[str]:
        return self._held

    def _fit(self, nbytes: int, keep: str | None) -> bool:
        fits = super()._fit(nbytes, keep)
        # Refused for the conversations running responses hold, not for its own size: a
        # refusal that passes once they end.
        own = self._entries[keep].nbytes if keep in self._entries else 0
        self.held_in_the_way = not fits and own + nbytes <= self.max_bytes
        return fits


def _with_own_ids(ids: set[str], items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``items``, each whose id is among ``ids`` (or an earlier one's) with a new one."""
    out = []
    for item in items:
        if item["id"] in ids:
            item = {**item, "id": new_id(item["id"].partition("_")[0] or "item")}
        ids.add(item["id"])
        out.append(item)
    return out


class ConversationsApi:
    """The Conversations endpoints over a ``ConversationStore`` of ``max_bytes`` (none where
    it is 0: each endpoint then says how to have one). ``read_json``: the server's bounded
    reading of a request's JSON body; ``check_messages``: the chat endpoint's checks of
    messages (``ApiError`` naming ``messages[i]...``), which new items pass as a request's
    ``input`` does."""

    def __init__(self, max_bytes: int, read_json: Callable[[Request], Awaitable[Any]],
                 check_messages: Callable[[list[dict[str, Any]]], object]) -> None:
        self.store = ConversationStore(max_bytes) if max_bytes > 0 else None
        self.read_json = read_json
        self.check_messages = check_messages

    def routes(self) -> list[Route]:
        base = "/v1/conversations/{conversation_id}"
        items = f"{base}/items"
        return [
            Route("/v1/conversations", self._handle(self.create), methods=["POST"]),
            Route(base, self._handle(self.retrieve), methods=["GET"]),
            Route(base, self._handle(self.update), methods=["POST"]),
            Route(base, self._handle(self.delete), methods=["DELETE"]),
            Route(items, self._handle(self.list_items), methods=["GET"]),
            Route(items, self._handle(self.create_items), methods=["POST"]),
            Route(items + "/{item_id}", self._handle(self.retrieve_item), methods=["GET"]),
            Route(items + "/{item_id}", self._handle(self.delete_item), methods=["DELETE"]),
        ]

    def named(self, value: Any) -> Conversation:
        """The conversation a Responses API request's ``conversation`` names (its id, or
        ``{"id": ...}``): a 404 where it is not kept, a 400 where it names none."""
        if isinstance(value, dict):
            value = value.get("id")
        if not isinstance(value, str):
            raise bad_request("'conversation' must be a conversation's id, or an object with "
                              "its 'id'", "conversation")
        return self._conversation(value, "conversation")

    def hold(self, value: Any) -> tuple[Conversation, Callable[[], None]]:
        """The conversation ``value`` names (``named``), held for the request, and the
        function that lets it go (once, however often it is called: a later hold by another
        request is never released by this one's): a 400 where another response holds it
        (OpenAI's ``conversation_locked``)."""
        conversation = self.named(value)
        store = self.store
        assert store is not None  # (``named`` says there is none otherwise)
        if not store.hold(conversation):
            raise ApiError(400, f"another response is running on conversation "
                           f"{conversation.id[:64]!r}: retry once it has ended (responses "
                           "that name one conversation run one at a time).", "conversation",
                           code="conversation_locked")
        held = [conversation.id]

        def release() -> None:
            while held:
                store.release(held.pop())
        return conversation, release

    # ----------------------------------------------------------------- endpoints
    async def create(self, request: Request, store: ConversationStore) -> Response:
        body = await self._body(request)
        metadata = metadata_of(body.get("metadata"))
        items = self._new_items(body.get("items") or [])
        conversation = store.create(metadata, items)
        if conversation is None:
            raise _full(store)
        return JSONResponse(conversation.body())

    async def retrieve(self, request: Request, store: ConversationStore) -> Response:
        return JSONResponse(self._conversation(request.path_params["conversation_id"]).body())

    async def update(self, request: Request, store: ConversationStore) -> Response:
        body = await self._body(request)
        conversation = self._conversation(request.path_params["conversation_id"])
        if "metadata" not in body:
            raise bad_request("send the conversation's new 'metadata'", "metadata")
        if not store.update(conversation, metadata_of(body["metadata"])):
            raise _full(store)
        return JSONResponse(conversation.body())

    async def delete(self, request: Request, store: ConversationStore) -> Response:
        conversation = self._conversation(request.path_params["conversation_id"])
        store.delete(conversation.id)
        return JSONResponse({"id": conversation.id, "object": "conversation.deleted",
                             "deleted": True})

    async def list_items(self, request: Request, store: ConversationStore) -> Response:
        conversation = self._conversation(request.path_params["conversation_id"])
        return JSONResponse(paged(conversation.items, request.query_params, DEFAULT_LIST_LIMIT,
                                  MAX_LIST_LIMIT, "item", "in this conversation"))

    async def create_items(self, request: Request, store: ConversationStore) -> Response:
        body = await self._body(request)
        conversation = self._conversation(request.path_params["conversation_id"])
        if not body.get("items"):
            raise bad_request("'items' must be a non-empty list of items to add", "items")
        items = self._new_items(body["items"])
        if not store.add(conversation, items):
            raise _full(store)
        return JSONResponse({"object": "list", "data": items, "first_id": items[0]["id"],
                             "last_id": items[-1]["id"], "has_more": False})

    async def retrieve_item(self, request: Request, store: ConversationStore) -> Response:
        conversation = self._conversation(request.path_params["conversation_id"])
        return JSONResponse(self._item(conversation, request.path_params["item_id"]))

    async def delete_item(self, request: Request, store: ConversationStore) -> Response:
        conversation = self._conversation(request.path_params["conversation_id"])
        store.remove_item(conversation, self._item(conversation,
                                                   request.path_params["item_id"])["id"])
        return JSONResponse(conversation.body())

    # ----------------------------------------------------------------- helpers
    def _handle(self, handler: Callable[[Request, ConversationStore], Awaitable[Response]]
                ) -> Callable[[Request], Awaitable[Response]]:
        """``handler(request, store)`` as an endpoint: its ``ApiError`` as OpenAI's error
        body; without a store, a 404 that says how to have one."""
        return store_endpoint(handler, lambda: self.store, _disabled)

    async def _body(self, request: Request) -> dict[str, Any]:
        body = await self.read_json(request)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        return body

    def _conversation(self, conversation_id: str, param: str = "conversation_id"
                      ) -> Conversation:
        if self.store is None:
            raise _disabled()
        conversation = self.store.get(conversation_id)
        if conversation is None:
            raise ApiError(404, f"no conversation has the id {conversation_id[:64]!r} "
                           "(conversations are kept in the server's memory while it runs, "
                           "the least recently used forgotten past --responses-store-mib)",
                           param, code="conversation_not_found")
        return conversation

    def _new_items(self, items: Any) -> list[dict[str, Any]]:
        if not isinstance(items, list) or len(items) > MAX_NEW_ITEMS:
            raise bad_request(f"'items' must be a list of at most {MAX_NEW_ITEMS} items "
                              "(messages, function calls and their outputs)", "items")
        return conversation_items(items, "items", self.check_messages)

    @staticmethod
    def _item(conversation: Conversation, item_id: str) -> dict[str, Any]:
        for item in conversation.items:
            if item.get("id") == item_id:
                return item
        raise ApiError(404, f"the conversation has no item {item_id[:64]!r}", "item_id",
                       code="item_not_found")


def _disabled() -> ApiError:
    return ApiError(404, "this server keeps no conversations: start it with "
                    "--responses-store-mib above 0.", code="conversations_disabled")


def _full(store: ConversationStore) -> ApiError:
    if store.held_in_the_way:
        return ApiError(503, "the store of conversations is taken by conversations that "
                        "running responses hold, which are not forgotten to make room: retry "
                        "once they end, or start the server with a larger --responses-store-mib.",
                        type="server_overloaded", code="conversations_busy",
                        headers={"Retry-After": "1"})
    return ApiError(400, f"the conversation does not fit the server's store of conversations "
                    f"({store.max_bytes} bytes of JSON, --responses-store-mib): send fewer or "
                    "smaller items, or start the server with a larger store.",
                    code="conversation_too_large")


__all__ = ["Conversation", "ConversationStore", "ConversationsApi"]
