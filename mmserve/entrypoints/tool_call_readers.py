"""Tool calls read out of the generated text as it comes: each reader turns text into OpenAI's
stream deltas (``{"content": ...}``, or ``{"tool_calls": [...]}`` announcing a call with its
id and name, then its arguments piece by piece) with ``feed`` and ``finish``. A whole answer
is the same deltas merged (``merge``), so a streamed answer and a whole one always agree. Each
reader does work in proportion to the text it is fed, however long the answer grows.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class CallReader:
    """Generated text -> OpenAI stream deltas, piece by piece. ``called``: whether a call
    came out."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self.num_calls = 0
        self._out: list[dict[str, Any]] = []
        self._run: list[str] = []  # arguments of call ``_run_index`` not yet in a delta
        self._run_index = -1

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def finish(self) -> list[dict[str, Any]]:
        return self._take()

    def _take(self) -> list[dict[str, Any]]:
        self._flush()
        out, self._out = self._out, []
        return out

    def _emit(self, delta: dict[str, Any]) -> None:
        self._flush()
        self._out.append(delta)

    def _flush(self) -> None:
        if self._run:
            self._out.append({"tool_calls": [{"index": self._run_index, "function": {
                "arguments": "".join(self._run)}}]})
            self._run = []

    def _call(self, name: str) -> int:
        index = self.num_calls
        self.num_calls += 1
        self._emit({"tool_calls": [{"index": index, "id": self._new_id(), "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})
        return index

    def _arguments(self, index: int, text: str) -> None:
        """More of call ``index``'s arguments: one delta however many pieces a feed reads."""
        if not text:
            return
        if index != self._run_index:
            self._flush()
            self._run_index = index
        self._run.append(text)

    def _content(self, text: str) -> None:
        if text:
            self._emit({"content": text})


class NamedCall(CallReader):
    """A named ``tool_choice``: the whole output is that function's arguments."""

    def __init__(self, name: str, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.name = name

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not self.called:
            self._call(self.name)
        self._arguments(0, text)
        return self._take()

    def finish(self) -> list[dict[str, Any]]:
        return self.feed("")


class RequiredCalls(CallReader):
    """``tool_choice`` "required": the output is ``[{"name": ..., "parameters": ...}, ...]``
    (the grammar sees to it); each call is announced once its name is read, and its
    parameters' text streams as its arguments (whitespace around them left out)."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.depth = 0  # of arrays and objects open
        self.in_string = False
        self.escape = False
        self.key: list[str] | None = None  # a call's key being read
        self.value_of: str | None = None  # the key whose value is being read
        self.seen_colon = False  # between that key and its value
        self.value: list[str] = []
        self.call: int | None = None  # the announced call's index
        self.held: list[str] = []  # parameters read before the call's name
        self.blank = ""  # whitespace inside parameters, sent once more follows

    def feed(self, text: str) -> list[dict[str, Any]]:
        for ch in text:
            self._char(ch)
        return self._take()

    def _char(self, ch: str) -> None:
        if self.value_of is not None:
            self._value_char(ch)
        elif self.key is not None:  # a key's string, in a call object
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.value_of, self.key = _json_string(self.key), None
                self.value, self.seen_colon = [], False
                return
            self.key.append(ch)
        elif ch == '"' and self.depth == 2:
            self.key = []
        elif ch in "[{":
            self.depth += 1
            if self.depth == 2:  # a call starts
                self.call, self.held = None, []
        elif ch in "]}":
            self.depth -= 1
            if self.depth == 1:
                self._end_call()

    def _value_char(self, ch: str) -> None:
        """A character after a call's key: the colon, then the value, which ends at this
        call's level with a comma or the call's closing brace."""
        if not self.seen_colon:
            self.seen_colon = ch == ":"
            return  # whitespace before the colon, and the colon
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "[{":
            self.depth += 1
        elif ch in "]}" and self.depth > 2:
            self.depth -= 1
        elif ch in ",}" and self.depth == 2:
            self._end_value()
            if ch == "}":
                self.depth = 1
                self._end_call()
            return
        elif ch.isspace() and self.depth == 2:
            self.blank += ch  # around the value: sent only if more of it follows
            return
        text = self.blank + ch if self.value else ch
        self.blank = ""
        self.value.append(ch)
        if self.value_of != "parameters":
            return
        if self.call is None:
            self.held.append(text)
        else:
            self._arguments(self.call, text)

    def _end_value(self) -> None:
        if self.value_of == "name" and self.call is None:
            name = "".join(self.value)
            try:
                name = json.loads(name)
            except ValueError:
                pass
            self.call = self._call(str(name))
            self._arguments(self.call, "".join(self.held))
            self.held = []
        self.value_of, self.value, self.blank = None, [], ""

    def _end_call(self) -> None:
        if self.call is None and self.held:  # parameters without a name: cannot happen
            self.call = self._call("")      # under the grammar, but keep what was read
            self._arguments(self.call, "".join(self.held))
        self.call, self.held = None, []


def _json_string(chars: list[str]) -> str:
    try:
        return json.loads('"' + "".join(chars) + '"')
    except ValueError:
        return "".join(chars)


class HermesCalls(CallReader):
    """``--tool-call-parser hermes`` (Hermes 2 Pro, Qwen2.5 and later): calls are
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the text; what is
    outside them is content. A block is sent whole once it closes (or the output ends); one
    that is not such a call is sent as content, as written. Whitespace around calls is not
    content, but content on both sides of a call stays apart (a line break); an answer with no
    call is its text exactly."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool = True, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.parallel = parallel
        self.pending = ""  # text outside blocks that may start one
        self.block: list[str] | None = None  # an open block's text
        self.block_tail = ""  # its last characters, where a closing tag may begin
        self.blank = ""  # whitespace outside blocks, sent with the content that follows
        self.after_call = False  # content follows a call: a line break first, not blanks
        self.wrote = False  # content has been sent

    def feed(self, text: str) -> list[dict[str, Any]]:
        while text:
            if self.block is not None:
                text = self._feed_block(text)
                continue
            text = self.pending + text
            start = text.find(self.OPEN)
            if start >= 0:
                self._outside(text[:start])
                self.pending, self.block, self.block_tail = "", [], ""
                text = text[start + len(self.OPEN):]
                continue
            keep = _partial_suffix(text, self.OPEN)
            self._outside(text[:len(text) - keep])
            self.pending = text[len(text) - keep:]
            break
        return self._take()

    def _feed_block(self, text: str) -> str:
        """Add ``text`` to the open block; what follows its closing tag (nothing while it is
        still open). Only the last few characters are searched again."""
        assert self.block is not None
        window = self.block_tail + text
        end = window.find(self.CLOSE)
        if end < 0:
            self.block.append(text)
            self.block_tail = window[-(len(self.CLOSE) - 1):]
            return ""
        body = "".join(self.block)
        body = body[:len(body) - len(self.block_tail)] + window[:end]
        self.block = None
        self._read_block(body, closed=True)
        return window[end + len(self.CLOSE):]

    def finish(self) -> list[dict[str, Any]]:
        if self.block is not None:  # cut off: a closing tag begun counts as closing it
            body = "".join(self.block)
            cut = _partial_suffix(body, self.CLOSE)
            self._read_block(body[:len(body) - cut], closed=False, tail=body[len(body) - cut:])
            self.block = None
        else:
            self._outside(self.pending)
        self.pending = ""
        if self.blank and not self.called:
            self._content(self.blank)
        self.blank = ""
        return self._take()

    def _outside(self, text: str) -> None:
        text = self.blank + text
        stripped = text.rstrip()
        self.blank = text[len(stripped):]  # held: it may be followed by a call
        if not stripped:
            return
        if self.after_call:
            stripped = ("\n" if self.wrote else "") + stripped.lstrip()
            self.after_call = False
        self.wrote = True
        self._content(stripped)

    def _read_block(self, body: str, closed: bool, tail: str = "") -> None:
        call = _hermes_call(body)
        if call is None:
            self._outside(self.OPEN + body + (self.CLOSE if closed else tail))
            return
        self.blank, self.after_call = "", True
        if self.called and not self.parallel:
            return  # parallel_tool_calls false: the first call only
        name, arguments = call
        self._arguments(self._call(name), arguments)


def _hermes_call(body: str) -> tuple[str, str] | None:
    """A block's call: its name and its arguments as JSON text; None for anything else
    (NaN and infinities included, which JSON does not have)."""
    try:
        call = json.loads(body, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def _partial_suffix(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def merge(deltas: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer from its deltas: the content (None where there is none and calls were
    made) and the calls (OpenAI's ``message.tool_calls``)."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    arguments: list[list[str]] = []
    for delta in deltas:
        if "content" in delta:
            content.append(delta["content"])
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                calls.append({"id": call["id"], "type": "function",
                              "function": dict(call["function"])})
                arguments.append([call["function"]["arguments"]])
            else:
                arguments[call["index"]].append(call["function"]["arguments"])
    for call, pieces in zip(calls, arguments, strict=True):
        call["function"]["arguments"] = "".join(pieces)
    text = "".join(content)
    return (text or None) if calls else text, calls
