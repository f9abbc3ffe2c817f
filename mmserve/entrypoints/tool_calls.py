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

The calls are read out of the text by ``tool_call_readers.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mmserve.entrypoints.tool_call_readers import (
    CallReader,
    HermesCalls,
    NamedCall,
    RequiredCalls,
    new_call_id,
)
from mmserve.errors import InvalidInputError
from mmserve.processing.chat_tools import check_nesting

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
        check_nesting(parameters, f"{where}.function.parameters")
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


def reader_for(choice: ToolChoice, parser: str | None,
               new_id: Callable[[], str] = new_call_id) -> CallReader | None:
    """The reader of a choice's output (None where the output is plain text); ``new_id``
    names each call."""
    if choice.mode == "named":
        return NamedCall(choice.name or "", new_id)
    if choice.mode == "required":
        return RequiredCalls(new_id)
    if choice.mode == "auto" and parser == "hermes":
        return HermesCalls(choice.parallel, new_id)
    return None


def finish_reason(reason: str | None, choice: ToolChoice, reader: CallReader) -> str | None:
    """OpenAI's: "tool_calls" where the model chose to call ("auto", "required") and stopped;
    a named choice's call ends with "stop", and a cut-off answer is "length" whatever it
    held."""
    if reason == "stop" and reader.called and choice.mode in ("auto", "required"):
        return "tool_calls"
    return reason

