"""Tool calling (OpenAI's ``tools`` and ``tool_choice``): a request's tools checked, the output
constraint a forced choice needs, and the calls read out of the generated text.

``tool_choice`` is one of:

- ``"none"``: plain text (the tools are still shown to the chat template);
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is
  constrained to that function's ``parameters`` schema and is its call's arguments;
- ``"required"``: the output is constrained to a JSON array of one or more
  ``{"name": ..., "parameters": ...}`` objects, one per call (vLLM's shape);
- ``"auto"``: the model decides, and a parser of the model's own call format
  (``--tool-call-parser``) finds the calls in its text.

Each reader turns the generated text into OpenAI's stream deltas as it comes
(``feed`` / ``finish``); a whole answer is the same deltas merged (``merge``), so a streamed
answer and a whole one always agree.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mmserve.errors import InvalidInputError

# OpenAI's bounds: at most 128 tools a request, names of at most 64 letters, digits, _ or -.
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CALL_PARSERS = ("hermes",)


def _bad(message: str, param: str) -> InvalidInputError:
    return InvalidInputError(message, param=param)


@dataclass(frozen=True)
class ToolChoice:
    """What a request asks of the tools: ``mode`` "none", "auto", "required" or "named" (then
    ``name`` is the function's); ``parallel``: more than one call allowed."""

    mode: str = "none"
    name: str | None = None
    parallel: bool = True

    @property
    def reads_calls(self) -> bool:
        return self.mode != "none"


def parse_tools(body: dict[str, Any], parser: str | None
                ) -> tuple[list[dict[str, Any]] | None, ToolChoice]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request, checked: the
    tools as the chat template gets them (None without any) and the choice. ``parser``: the
    server's ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is on (None: "auto" is
    refused, and a request with tools but no choice gets "none", as vLLM does)."""
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise _bad(f"'{name}' is OpenAI's deprecated form; send 'tools' (and "
                       "'tool_choice') instead.", name)
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "none" if tools is None or parser is None else "auto"
    if choice == "none":
        return tools, ToolChoice("none", parallel=parallel)
    if tools is None:
        raise _bad("'tool_choice' needs 'tools': send the functions the model may call, or "
                   "leave 'tool_choice' out.", "tool_choice")
    if choice == "auto":
        if parser is None:
            raise _bad('tool_choice "auto" needs a server started with '
                       "--enable-auto-tool-choice and --tool-call-parser (one of "
                       f"{', '.join(TOOL_CALL_PARSERS)}); send \"required\", a named function "
                       'or "none" instead.', "tool_choice")
        return tools, ToolChoice("auto", parallel=parallel)
    if choice == "required":
        return tools, ToolChoice("required", parallel=parallel)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(name, str)):
        raise _bad('tool_choice must be "none", "auto", "required" or {"type": "function", '
                   '"function": {"name": ...}}', "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise _bad(f"tool_choice names the function {name[:80]!r}, which is not among the "
                   "request's tools", "tool_choice")
    return tools, ToolChoice("named", name, parallel)


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of {'type': 'function', 'function': {...}}", "tools")
    if len(tools) > MAX_TOOLS:
        raise _bad(f"'tools' has {len(tools)} tools; at most {MAX_TOOLS} are allowed",
                   "tools")
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function"
                and isinstance(function, dict)):
            raise _bad(f"{where} must be {{'type': 'function', 'function': {{'name': ..., "
                       "'parameters': {...}}}", where)
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise _bad(f"{where}.function.name must be 1 to 64 letters, digits, underscores "
                       "or dashes", f"{where}.function.name")
        if name in names:
            raise _bad(f"{where}.function.name {name!r} is used by an earlier tool; give each "
                       "tool its own name", f"{where}.function.name")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"{where}.function.description must be a string",
                       f"{where}.function.description")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _bad(f"{where}.function.parameters must be a JSON schema (an object)",
                       f"{where}.function.parameters")
        checked: dict[str, Any] = {"name": name}
        if description is not None:
            checked["description"] = description
        if parameters is not None:
            checked["parameters"] = parameters
        out.append({"type": "function", "function": checked})
    return out


def output_schema(tools: list[dict[str, Any]], choice: ToolChoice) -> dict[str, Any] | None:
    """The JSON schema a forced choice constrains the output to (None for "none" and
    "auto"): the named function's parameters, or for "required" an array of calls, each an
    object of a tool's name and its parameters."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
              for t in tools}
    if choice.mode == "named":
        return params[choice.name]
    if choice.mode != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in params.items()]
    array: dict[str, Any] = {"type": "array", "minItems": 1,
                             "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not choice.parallel:
        array["maxItems"] = 1
    return array


# --------------------------------------------------------------------- reading the calls
def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class CallReader:
    """Generated text -> OpenAI stream deltas (``{"content": ...}`` or ``{"tool_calls":
    [...]}``), piece by piece. ``called``: whether a call came out."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self.num_calls = 0
        self.out: list[dict[str, Any]] = []

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def finish(self) -> list[dict[str, Any]]:
        return []

    def _take(self) -> list[dict[str, Any]]:
        out, self.out = self.out, []
        return out

    def _call(self, name: str) -> int:
        index = self.num_calls
        self.num_calls += 1
        self.out.append({"tool_calls": [{"index": index, "id": self._new_id(),
                                         "type": "function",
                                         "function": {"name": name, "arguments": ""}}]})
        return index

    def _arguments(self, index: int, text: str) -> None:
        """More of call ``index``'s arguments: one delta however many pieces a feed reads."""
        if not text:
            return
        last = self.out[-1]["tool_calls"][0] if self.out and "tool_calls" in self.out[-1] else {}
        if last.get("index") == index and "id" not in last:
            last["function"]["arguments"] += text
        else:
            self.out.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})


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
    parameters' text streams as its arguments."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.depth = 0  # of arrays and objects open
        self.in_string = False
        self.escape = False
        self.key: list[str] | None = None  # a call's key being read
        self.value_of: str | None = None  # the key whose value is being read
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
                self.value = []
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
        """A character of a call's value: its end at this call's level is a comma or the
        call's closing brace."""
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
        elif ch == ":" and self.depth == 2 and not self.value:
            return  # the colon after the key
        if self.value_of == "parameters":
            self._parameters_char(ch)
        else:
            self.value.append(ch)

    def _parameters_char(self, ch: str) -> None:
        if not self.in_string and ch.isspace() and self.depth == 2:
            self.blank += ch  # between the colon and the value, or after it
            return
        text = self.blank + ch if self.value else ch
        self.blank = ""
        self.value.append(ch)
        if self.call is None:
            self.held.append(text)
        else:
            self._arguments(self.call, text)

    def _end_value(self) -> None:
        if self.value_of == "name" and self.call is None:
            name = "".join(self.value).strip()
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
    content; an answer with no call is its text exactly."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool = True, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.parallel = parallel
        self.buffer = ""  # text not yet sent: a block, or what may start one
        self.in_block = False
        self.blank = ""  # whitespace outside blocks, sent with the content that follows
        self.after_call = False  # the whitespace that starts the next content is not sent

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.buffer += text
        while self.buffer:
            if self.in_block:
                end = self.buffer.find(self.CLOSE)
                if end < 0:
                    break
                self._block(self.buffer[:end], closed=True)
                self.buffer = self.buffer[end + len(self.CLOSE):]
                self.in_block = False
                continue
            start = self.buffer.find(self.OPEN)
            if start >= 0:
                self._content(self.buffer[:start])
                self.buffer = self.buffer[start + len(self.OPEN):]
                self.in_block = True
                continue
            keep = _partial_suffix(self.buffer, self.OPEN)
            self._content(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        return self._take()

    def finish(self) -> list[dict[str, Any]]:
        if self.in_block:
            self._block(self.buffer, closed=False)
        else:
            self._content(self.buffer)
        self.buffer, self.in_block = "", False
        if self.blank and not self.called:
            self.out.append({"content": self.blank})
        self.blank = ""
        return self._take()

    def _content(self, text: str) -> None:
        text = self.blank + text
        stripped = text.rstrip()
        self.blank = text[len(stripped):]  # held: it may be followed by a call
        if not stripped:
            return
        if self.after_call:
            stripped, self.after_call = stripped.lstrip(), False
        self.out.append({"content": stripped})

    def _block(self, body: str, closed: bool) -> None:
        call = _hermes_call(body)
        if call is None:
            self._content(self.OPEN + body + (self.CLOSE if closed else ""))
            return
        self.blank, self.after_call = "", True
        if self.called and not self.parallel:
            return  # parallel_tool_calls false: the first call only
        name, arguments = call
        self._arguments(self._call(name), arguments)


def _hermes_call(body: str) -> tuple[str, str] | None:
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _partial_suffix(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def reader_for(choice: ToolChoice, parser: str | None) -> CallReader | None:
    """The reader of a choice's output (None where the output is plain text)."""
    if choice.mode == "named":
        return NamedCall(choice.name or "")
    if choice.mode == "required":
        return RequiredCalls()
    if choice.mode == "auto" and parser == "hermes":
        return HermesCalls(choice.parallel)
    return None


def finish_reason(reason: str | None, choice: ToolChoice, reader: CallReader) -> str | None:
    """OpenAI's: "tool_calls" where the model chose to call ("auto", "required") and stopped;
    a named choice's call ends with "stop", and a cut-off answer is "length" whatever it
    held."""
    if reason == "stop" and reader.called and choice.mode in ("auto", "required"):
        return "tool_calls"
    return reason


def merge(deltas: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer from its deltas: the content (None where there is none) and the calls
    (OpenAI's ``message.tool_calls``)."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        if "content" in delta:
            content.append(delta["content"])
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                calls.append({"id": call["id"], "type": "function",
                              "function": dict(call["function"])})
            else:
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    text = "".join(content)
    return (text or None) if calls else text, calls
