"""The Responses API's stored responses, in the server's memory and bounded in bytes.

A request with ``store`` (OpenAI's default) leaves its response object and its input items
here, so that ``GET /v1/responses/{id}`` returns the response, ``.../input_items`` lists its
input, ``DELETE`` forgets it, and a later request's ``previous_response_id`` continues the
conversation: the items of every response in the chain, oldest first (each one's input, then
its output), go before the new request's input. A ``background`` response is stored while it
runs and updated when it ends; ``cancel`` stops it. One made with ``stream`` keeps its events
(``EventLog``), so that a client whose connection dropped can stream it again from where it
was (``GET /v1/responses/{id}?stream=true&starting_after=N``).

The store holds at most ``max_bytes`` of JSON (responses and their input, images' data URLs
included; the Python objects that hold them take several times that in memory); past it, the
responses used longest ago are forgotten first (a response that is still running is kept, and
a new one that does not fit beside the running ones is not stored). Continuing a conversation
counts as using every response in it, so a live conversation stays while old ones go. Nothing
outlives the process.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

# Items a list of a response's input items or a conversation's items holds at most in one
# page (OpenAI's limit), and by default.
MAX_LIST_LIMIT = 100
DEFAULT_LIST_LIMIT = 20
# A background stream's events are kept up to this share of the store (1 / MAX_LOG_SHARE).
MAX_LOG_SHARE = 4


class EventLog:
    """A streamed background response's events (server-sent events, as written), kept so
    that any number of clients can follow it, from its start or after an event's
    ``sequence_number``: the event at index ``i`` is the one numbered ``i``. It grows while
    the response runs, within the store's bytes (``ResponseStore.record``): past them, the
    rest of the stream is not kept (``cut``), and its followers are told so."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.nbytes = 0
        self.ended = False
        self.cut = False
        self._changed = asyncio.Event()

    def append(self, event: str) -> None:
        self.events.append(event)
        self.nbytes += len(event)
        self._wake()

    def end(self, cut: bool = False) -> None:
        """No more events: the response ended (or was cancelled, or deleted), or, ``cut``,
        the rest of them are not kept."""
        self.ended = True
        self.cut = self.cut or cut
        self._wake()

    def forget(self) -> None:
        """Free the events of a cut stream (it cannot be followed whole any more)."""
        self.events, self.nbytes = [], 0

    async def follow(self, after: int = -1) -> AsyncIterator[str]:
        """The events numbered above ``after``, those kept and then each as it comes, until
        the log ends; a cut one ends with OpenAI's ``error`` event saying so."""
        i = max(after + 1, 0)
        while True:
            if self.cut and not self.events:
                break  # (forgotten)
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.ended:
                break
            changed = self._changed
            await changed.wait()
        if self.cut:
            yield error_event(max(i, len(self.events)), "stream_not_kept",
                              "the rest of this response's events outgrew the response store "
                              "(--responses-store-mib) and were not kept; the response runs "
                              "on: GET /v1/responses/{id} without 'stream' once it has ended.")

    def last_event(self, code: str, message: str) -> str:
        """OpenAI's ``error`` event that ends a stream stopped from outside (cancelled,
        deleted), numbered after the events kept."""
        return error_event(len(self.events), code, message)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def error_event(sequence: int, code: str, message: str) -> str:
    """An ``error`` event of a response's stream, as server-sent."""
    body = {"type": "error", "sequence_number": sequence, "code": code, "param": None,
            "message": message}
    return f"event: error\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"


@dataclass
class Stored:
    """One response: its object as last answered (in progress while a background response
    runs), this request's input items (each with an ``id``), and the response it continued."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    previous: str | None
    nbytes: int = 0
    # A background response, while it runs: its task and its events so far (the response
    # object in progress), both None once it has ended.
    task: Any = None
    events: Any = None
    # A background response made with ``stream``: its events, while it runs and after.
    log: EventLog | None = None

    @property
    def running(self) -> bool:
        return self.task is not None


class InProgressError(Exception):
    """A conversation to continue holds a background response that is still running."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


class ResponseStore:
    """Response id -> ``Stored``, least recently used first, at most ``max_bytes`` of JSON."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.running_bytes = 0  # of the running responses, which are never forgotten
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]],
            previous: str | None) -> Stored | None:
        """Store ``response``, forgetting the least recently used others to make room; None
        where it does not fit (larger than the store, or than what the running responses
        leave) or its id is taken (a client's request id sent twice at once): nothing is kept
        then, and nothing is replaced."""
        response_id = response["id"]
        if response_id in self._entries:
            return None
        entry = Stored(response, input_items, previous)
        entry.nbytes = json_size(response) + json_size(input_items)
        if self.running_bytes + entry.nbytes > self.max_bytes:
            return None  # (before forgetting anything for it)
        self._make_room(entry.nbytes)
        self._entries[response_id] = entry
        self.nbytes += entry.nbytes
        return entry

    def start(self, entry: Stored, task: Any, events: Any) -> None:
        """``entry`` is a background response that runs on ``task``, with its ``events`` so
        far: kept until ``update`` says it ended (or it is deleted)."""
        entry.task, entry.events = task, events
        self.running_bytes += entry.nbytes

    def update(self, response: dict[str, Any]) -> None:
        """A stored response's object changed (a background response ended or was
        cancelled): kept where it fits, forgotten where it no longer does."""
        entry = self._entries.get(response["id"])
        if entry is None:
            return
        if entry.running:
            self.running_bytes -= entry.nbytes
        entry.task = entry.events = None
        self.nbytes -= entry.nbytes
        entry.response = response
        if entry.log is not None and entry.log.cut:
            entry.log.forget()
        entry.nbytes = (json_size(response) + json_size(entry.input_items)
                        + (0 if entry.log is None else entry.log.nbytes))
        self.nbytes += entry.nbytes
        self._make_room(0)
        if self.nbytes > self.max_bytes:  # (beside running ones, it no longer fits)
            self.delete(response["id"])

    def record(self, entry: Stored, event: str) -> None:
        """One more event of a running response's log, counted as the response's bytes,
        the least recently used others forgotten to make room; where even that leaves no
        room beside the running responses, or the log would hold more than a quarter of the
        store (one long stream must not empty it for all the others), the log is cut
        there."""
        log = entry.log
        if log is None or log.ended or self._entries.get(entry.response["id"]) is not entry:
            return  # (not a log, or no longer stored: deleted while it ran)
        if (self.running_bytes + len(event) > self.max_bytes
                or log.nbytes + len(event) > self.max_bytes // MAX_LOG_SHARE):
            log.end(cut=True)
            return
        log.append(event)
        entry.nbytes += len(event)
        self.nbytes += len(event)
        if entry.running:
            self.running_bytes += len(event)
        self._make_room(0)

    def get(self, response_id: str) -> Stored | None:
        """The stored response, counted as used now; None where it is not (or no longer)
        stored."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.nbytes -= entry.nbytes
        if entry.running:
            self.running_bytes -= entry.nbytes
        return True

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        """The items of the conversation ``response_id`` ends, oldest first: each response's
        input and then its output (every response in it counted as used now). None where
        the response, or one before it, is not stored; ``InProgressError`` where one of them
        is a background response still running (its answer is not there yet)."""
        chain: list[str] = []
        seen: set[str] = set()
        rid: str | None = response_id
        while rid is not None:
            entry = self._entries.get(rid)
            if entry is None or rid in seen:  # (ids are fresh: a loop cannot form)
                return None
            if entry.running:
                raise InProgressError(rid)
            chain.append(rid)
            seen.add(rid)
            rid = entry.previous
        items: list[dict[str, Any]] = []
        for rid in reversed(chain):
            self._entries.move_to_end(rid)
            entry = self._entries[rid]
            items += entry.input_items
            items += entry.response.get("output") or []
        return items

    def _make_room(self, nbytes: int) -> None:
        """Forget the least recently used responses that have ended until ``nbytes`` more
        fit (or only running ones are left)."""
        if self.nbytes + nbytes <= self.max_bytes:
            return
        for rid in list(self._entries):
            if not self._entries[rid].running:
                self.delete(rid)
                if self.nbytes + nbytes <= self.max_bytes:
                    return


class BoundedStore:
    """Entries by id, oldest (or least recently used, where the subclass moves them) first,
    each with its ``nbytes`` of JSON, at most ``max_bytes`` together; ``_fit`` forgets the
    first ones to make room, but those ``_pinned`` names."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def delete(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.nbytes -= entry.nbytes
        return True

    def _add(self, key: str, entry: Any) -> None:
        self._entries[key] = entry
        self.nbytes += entry.nbytes

    def _resize(self, entry: Any, change: int) -> None:
        entry.nbytes += change
        self.nbytes += change

    def _pinned(self) -> set[str]:
        return set()

    def _fit(self, nbytes: int, keep: str | None) -> bool:
        """Whether ``nbytes`` more fit, once the first entries but ``keep`` and the pinned
        are forgotten as need be (none is, where forgetting all of them would not do)."""
        pinned = self._pinned() | {keep}
        kept = sum(self._entries[key].nbytes for key in pinned if key in self._entries)
        if kept + nbytes > self.max_bytes:
            return False
        for key in list(self._entries):
            if self.nbytes + nbytes <= self.max_bytes:
                break
            if key not in pinned:
                self.delete(key)
        return self.nbytes + nbytes <= self.max_bytes


def json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")))
