"""What a chat's messages say about tools, checked and put as chat templates take it: the
request's ``tools`` (OpenAI's function definitions) and an assistant's earlier ``tool_calls``,
whose ``arguments`` travel as JSON text and are given to templates as objects.

A leaf module (no torch, no processor), shared by the server's request checks and the
processor that renders chats."""

from __future__ import annotations

import json
from typing import Any

from mmserve.errors import InvalidInputError
from mmserve.sampling_params import MAX_SCHEMA_DEPTH, json_nesting

# Levels of objects and arrays a tool's parameters or a call's arguments may nest (deeper
# ones would exhaust the stack of the code that renders them).
MAX_TOOL_NESTING = MAX_SCHEMA_DEPTH


def check_nesting(value: Any, where: str) -> None:
    if json_nesting(value, MAX_TOOL_NESTING + 1) > MAX_TOOL_NESTING:
        raise InvalidInputError(f"{where} nests objects and arrays more than "
                                f"{MAX_TOOL_NESTING} levels deep; flatten it.", param=where)


def template_tools(tools: Any) -> list[dict[str, Any]]:
    """A chat's ``tools`` as given to the template: a list of objects, none nested too
    deep (their fields are the server's to check, ``entrypoints/tool_calls.py``)."""
    if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InvalidInputError("'tools' must be a list of {'type': 'function', 'function': "
                                "{...}}", param="tools")
    check_nesting(tools, "tools")
    return tools


def template_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier ``tool_calls`` (OpenAI's), checked, each call's
    ``arguments`` (JSON text on the wire) made the object chat templates expect."""
    if not isinstance(calls, list):
        raise InvalidInputError(f"{where} must be a list of tool calls", param=where)
    out = []
    for j, call in enumerate(calls):
        cwhere = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise InvalidInputError(f"{cwhere} must be {{'id': ..., 'type': 'function', "
                                    "'function': {'name': ..., 'arguments': '...'}}",
                                    param=cwhere)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except (ValueError, RecursionError):
                raise InvalidInputError(f"{cwhere}.function.arguments is not valid JSON",
                                        param=f"{cwhere}.function.arguments") from None
        check_nesting(arguments, f"{cwhere}.function.arguments")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidInputError(f"{cwhere}.id must be a string", param=f"{cwhere}.id")
        out.append({"id": call_id, "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out
