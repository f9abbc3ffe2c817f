"""OpenAI's Responses API (``POST /v1/responses``), stateless: a request is translated into a
chat request (``openai_protocol.parse_chat_request`` checks it) and its answer, text and
function calls, into a response object or its stream of semantic events.

What it takes: ``input`` as a string or a list of items (messages whose content holds
``input_text``, ``input_image`` and, for earlier answers, ``output_text`` parts; earlier
``function_call`` items and their ``function_call_output``), ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p``, function ``tools`` with ``tool_choice`` and
``parallel_tool_calls``, ``text.format`` (``json_schema`` or ``json_object``), ``stream`` and
``truncation`` (``"auto"``: the server drops the earliest turns where told the prompt is too
long, at the places ``truncation_starts`` gives);
with the server's store (``response_store.py``), ``store``, ``previous_response_id`` (the
server passes the stored conversation in as ``earlier``) and ``background``; ``conversation``
(the server passes the items of the conversation it names, ``conversations.py``, in as
``earlier``). Stored prompts are refused with a 400 saying so, as are tools other than
functions.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mmserve.entrypoints.openai_protocol import (
    ApiError,
    ChatRequest,
    bad_request,
    metadata_of,
    parse_chat_request,
)
from mmserve.errors import InvalidInputError
from mmserve.processing.chat_tools import template_tool_calls
from mmserve.sampling_params import MAX_LOGPROBS

# Fields that need state or machinery mmserve does not keep: refused, never ignored.
_REFUSED = {
    "prompt": "stored prompts are not supported: send the text in 'input'",
}


@dataclass
class ResponsesRequest:
    """A validated ``POST /v1/responses``: the chat request it amounts to, and what the
    response object repeats of it."""

    chat: ChatRequest
    echo: dict[str, Any] = field(default_factory=dict)
    where: list[str] = field(default_factory=list)  # each chat message's field in the body
    logprobs: bool = False  # the output text's, with its tokens' (``include``)
    # Kept in the server's store (``store`` where the server has one), and its input as the
    # store keeps it (each item with an id); answered at once and run on (``background``);
    # the stored response it continues.
    store: bool = False
    input_items: list[dict[str, Any]] = field(default_factory=list)
    background: bool = False
    previous: str | None = None
    truncate: bool = False  # ``truncation: "auto"``: drop the earliest turns to fit
    conversation: str | None = None  # the id of the conversation it goes on and adds to

    def renamed(self, err: ApiError) -> ApiError:
        """An error about the chat request (an image that cannot be fetched, a template that
        refuses the conversation) in the Responses API's names."""
        return _renamed(err, self.where)


def parse_responses_request(body: Any, max_model_len: int, max_images: int,
                            defaults: Mapping[str, Any] | None = None,
                            tool_parser: str | None = None,
                            earlier: list[dict[str, Any]] | None = None,
                            can_store: bool = False,
                            conversation: str | None = None,
                            input_required: bool = True) -> ResponsesRequest:
    """Check a decoded JSON body of ``POST /v1/responses``; a 400 names the Responses API's
    field (``input[2].content[0]``, ``max_output_tokens``), not the chat request's.
    ``earlier``: the items of the stored conversation ``previous_response_id`` names, or of
    the ``conversation`` (its id) the body names, which go before ``input``; ``can_store``:
    whether the server keeps responses; ``input_required`` false: ``input`` may be left out
    (``POST /v1/responses/input_tokens`` counts a conversation alone)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name, why in _REFUSED.items():
        if body.get(name) is not None:
            raise bad_request(f"'{name}' is not supported: {why}.", name)
    store, background, previous = _storage(body, can_store)
    if (previous is not None or conversation is not None) and earlier is None:
        raise ValueError("previous_response_id or conversation without the items it names")
    if body.get("conversation") is not None and conversation is None:
        raise ValueError("a conversation the server did not look up")
    logprobs = _logprobs(body)
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise bad_request("'truncation' must be \"auto\" (drop the conversation's earliest "
                          "turns where it does not fit) or \"disabled\" (the default)",
                          "truncation")
    items = body.get("input")
    if items is None and not input_required:
        items = []
    messages, where = _messages(items, body.get("instructions"), earlier or [],
                                earlier_name="conversation" if conversation else
                                "previous_response_id", required=input_required)
    metadata = metadata_of(body.get("metadata"))
    chat: dict[str, Any] = {"messages": messages}
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("stream", "stream"), ("model", "model"),
                         ("parallel_tool_calls", "parallel_tool_calls"),
                         ("priority", "priority"), ("cache_salt", "cache_salt"),
                         ("mm_processor_kwargs", "mm_processor_kwargs")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if logprobs is not None:
        chat["logprobs"], chat["top_logprobs"] = True, logprobs
    try:
        parsed = parse_chat_request(chat, max_model_len, max_images, defaults, tool_parser)
    except ApiError as e:
        raise _renamed(e, where) from None
    if logprobs is not None and parsed.tools and parsed.tool_choice.mode != "none":
        raise bad_request("log-probabilities come with a message's text: leave "
                          "'message.output_text.logprobs' out of 'include' when the model "
                          "may call tools, or send 'tool_choice': \"none\".", "include")
    echo = {"instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": parsed.params.temperature, "top_p": parsed.params.top_p,
            "tools": body.get("tools") or [], "tool_choice": _echoed_choice(body, parsed),
            "parallel_tool_calls": parsed.tool_choice.parallel,
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "top_logprobs": body.get("top_logprobs") or 0, "metadata": metadata,
            "store": store, "background": background, "previous_response_id": previous,
            "truncation": truncation or "disabled",
            "conversation": None if conversation is None else {"id": conversation}}
    return ResponsesRequest(parsed, echo, where, logprobs is not None, store,
                            _input_items(items) if store or conversation else [],
                            background, previous, truncation == "auto", conversation)


def truncation_starts(messages: list[dict[str, Any]]) -> list[int]:
    """Where a conversation may start when ``truncation: "auto"`` drops its earliest turns:
    at each user message after the first turn, earliest first, the leading system and
    developer messages (the instructions) kept before it, so that what is left begins as a
    conversation does (no answer or tool output without what it answers)."""
    head = _instructions_head(messages)
    return [i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user"]


def without_turns(messages: list[dict[str, Any]], start: int, images: list[Any]
                  ) -> tuple[list[dict[str, Any]], list[Any]]:
    """The conversation from message ``start`` on, its leading instructions kept, and its
    ``images`` (one per ``{"type": "image"}`` part, in order) without the dropped ones."""
    head = _instructions_head(messages)

    def count(kept: list[dict[str, Any]]) -> int:
        return sum(1 for m in kept if isinstance(m.get("content"), list)
                   for part in m["content"] if part.get("type") == "image")

    before, dropped = count(messages[:head]), count(messages[head:start])
    return (messages[:head] + messages[start:],
            images[:before] + images[before + dropped:])


def _instructions_head(messages: list[dict[str, Any]]) -> int:
    """How many system and developer messages the conversation starts with."""
    head = 0
    while head < len(messages) and messages[head]["role"] in ("system", "developer"):
        head += 1
    return head


def _storage(body: dict[str, Any], can_store: bool) -> tuple[bool, bool, str | None]:
    """``store`` (OpenAI's default: true; false where the server keeps nothing),
    ``background`` and ``previous_response_id``, checked."""
    store = body.get("store")
    store = True if store is None else store
    background = body.get("background") or False
    previous = body.get("previous_response_id")
    for name, value in (("store", store), ("background", background)):
        if not isinstance(value, bool):
            raise bad_request(f"'{name}' must be true or false", name)
    if previous is not None and not isinstance(previous, str):
        raise bad_request("'previous_response_id' must be a response's id (a string)",
                          "previous_response_id")
    if background:
        if not (store and can_store):
            raise bad_request("a 'background' response is kept in the server's store until "
                              "it is fetched: send 'store': true"
                              + ("" if can_store else " to a server that stores responses "
                                 "(--responses-store-mib above 0)"), "background")
    return store and can_store, background, previous


def conversation_items(items: list[Any], name: str,
                       check: Callable[[list[dict[str, Any]]], object]
                       ) -> list[dict[str, Any]]:
    """Items a client adds to a conversation (the Conversations API's ``items``), checked as
    a request's ``input`` is, by ``check`` too (the chat endpoint's checks of the messages
    they amount to; a 400 names ``name[i]...``), as the conversation keeps them."""
    if not items:
        return []
    messages, where = _messages(items, None, [], name)
    for i, item in enumerate(items):
        if item.get("type", "message") == "message" and item.get("role") not in (
                "user", "assistant", "system", "developer"):
            raise bad_request(f"{name}[{i}].role must be 'user', 'assistant', 'system' or "
                              "'developer'", f"{name}[{i}].role")
    try:
        check(messages)
    except ApiError as e:
        raise _renamed(e, where) from None
    return _input_items(items)


def finished_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items a conversation keeps: all but function calls cut off
    (``max_output_tokens``), whose arguments are not whole JSON."""
    return [item for item in items
            if item.get("type") != "function_call" or item.get("status") == "completed"]


def _input_items(items: Any) -> list[dict[str, Any]]:
    """``input`` as the store keeps it and lists it (already checked), in OpenAI's shape: a
    list of items, a string a user message, a message's string content a text part, each
    item with an ``id``."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    out = []
    for item in items:
        item = {"type": "message", **item}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        if not isinstance(item.get("id"), str):
            item["id"] = new_id({"message": "msg", "function_call": "fc"}.get(item["type"],
                                                                              "item"))
        out.append(item)
    return out


# What ``include`` may ask for: the output text's log-probabilities, and the encrypted
# reasoning a stateless client asks for on every request (there is none to include).
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_INCLUDABLE = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")


def _logprobs(body: dict[str, Any]) -> int | None:
    """How many alternatives each output token's log-probability comes with (``top_logprobs``,
    0 to 20), where ``include`` asks for them; None where it does not."""
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise bad_request("'include' must be a list of strings", "include")
    for i, name in enumerate(include):
        if name not in _INCLUDABLE:
            raise bad_request(f"'include' may name {', '.join(_INCLUDABLE)}; mmserve has no "
                              f"{name!r} to include.", f"include[{i}]")
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool)
                            or not 0 <= top <= MAX_LOGPROBS):
        raise bad_request(f"'top_logprobs' must be an integer from 0 to {MAX_LOGPROBS}",
                          "top_logprobs")
    return (top or 0) if LOGPROBS_INCLUDE in include else None


def _messages(items: Any, instructions: Any, earlier: list[dict[str, Any]],
              name: str = "input", earlier_name: str = "previous_response_id",
              required: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
    """``instructions``, the ``earlier`` conversation's items and ``items`` (the request's
    ``name``) as chat messages, and each message's field in the request (for errors; the
    earlier ones are ``earlier_name``'s); ``required`` false: ``items`` may be empty."""
    messages: list[dict[str, Any]] = []
    where: list[str] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
        where.append("instructions")
    if isinstance(items, str):
        labelled = [(name, {"role": "user", "content": items})]
    elif isinstance(items, list) and (items or not required):
        labelled = [(f"{name}[{i}]", item) for i, item in enumerate(items)]
    else:
        raise bad_request(f"'{name}' must be a string or a non-empty list of items", name)
    # The stored items were checked when they came (and answered): an error about one of
    # them now (an image URL that no longer loads) names the previous response, or the
    # conversation's item.
    labelled[:0] = [(earlier_name if earlier_name != "conversation" else
                     f"conversation.items[{item.get('id')}]", item) for item in earlier]
    for at, item in labelled:
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item, at)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not (isinstance(call["id"], str) and isinstance(item.get("name"), str)
                    and isinstance(item.get("arguments"), str)):
                raise bad_request(f"{at} must have 'call_id', 'name' and 'arguments' (JSON "
                                  "text) as strings", at)
            try:  # checked here, so that an error names this item
                template_tool_calls([call], at)
            except InvalidInputError as e:
                raise bad_request(str(e).replace(f"{at}[0].function.", f"{at}."),
                                  f"{at}.arguments") from None
            if messages and messages[-1]["role"] == "assistant" and where[-1] != "instructions":
                # The same answer's text and calls: one assistant turn.
                messages[-1].setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise bad_request(f"{at} must have 'call_id' and 'output' as strings", at)
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output})
        else:
            raise bad_request(f"{at} has type {kind!r}; supported: 'message', 'function_call', "
                              "'function_call_output'", f"{at}.type")
        where.append(at)
    return messages, where


def _content(item: dict[str, Any], at: str) -> Any:
    """A message item's content as chat content: ``input_text`` and ``output_text`` parts as
    text, ``input_image`` as an ``image_url`` part (a ``file`` part where it names an uploaded
    image by ``file_id``)."""
    content = item.get("content")
    if isinstance(content, str) or not isinstance(content, list):
        return content  # the chat checks say what is wrong with anything else
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "input_image":
            url, file_id = part.get("image_url"), part.get("file_id")
            if (url is None) == (file_id is None):
                raise bad_request(f"{at}.content[{j}] needs one of 'image_url' (an http(s) or "
                                  "data: URL) and 'file_id' (an image uploaded with "
                                  "files.create)", f"{at}.content[{j}]")
            if file_id is None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif isinstance(file_id, str) and file_id:  # an uploaded image: a chat file part
                parts.append({"type": "file", "file": {"file_id": file_id}})
            else:
                raise bad_request(f"{at}.content[{j}].file_id must be a file's id",
                                  f"{at}.content[{j}].file_id")
        else:
            raise bad_request(f"{at}.content[{j}] has type {kind!r}; supported: 'input_text', "
                              "'input_image', 'output_text'", f"{at}.content[{j}].type")
    return parts


def _tools(tools: Any) -> Any:
    """Function tools in the chat's form; any other kind is refused."""
    if not isinstance(tools, list):
        return tools  # the chat checks refuse it
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}] has type {kind!r}; only 'function' tools are "
                              "supported (no built-in tools)", f"tools[{i}].type")
        out.append({"type": "function", "function": {
            name: tool[name] for name in ("name", "description", "parameters", "strict")
            if tool.get(name) is not None}})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _echoed_choice(body: dict[str, Any], chat: ChatRequest) -> Any:
    """The tool choice the answer followed, in the Responses API's form ("auto", OpenAI's
    default, where there was nothing to choose from)."""
    choice = chat.tool_choice
    if choice.mode == "named":
        return {"type": "function", "name": choice.name}
    if not body.get("tools") and body.get("tool_choice") is None:
        return "auto"
    return choice.mode


def _text_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as the chat's ``response_format``."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object such as {'format': {'type': 'text'}}",
                          "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format json_schema needs 'schema': {...}, the JSON schema "
                              "as an object (and a 'name')", "text.format")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                       "schema": fmt["schema"]}}
    if not (isinstance(fmt, dict) and fmt.get("type") in ("text", "json_object")):
        raise bad_request("text.format must be {'type': 'text'}, {'type': 'json_object'} or "
                          "{'type': 'json_schema', 'name': ..., 'schema': {...}}", "text.format")
    return fmt


def _renamed(err: ApiError, where: list[str]) -> ApiError:
    """A chat request's error in the Responses API's names."""
    param = err.param or ""

    def item(match: re.Match) -> str:
        index = int(match.group(1))
        return where[index] if index < len(where) else match.group(0)

    param = _MESSAGE.sub(item, param, count=1)
    message = _MESSAGE.sub(item, err.message)
    param = _TOOL.sub(r"tools[\1].", param, count=1)
    message = _TOOL.sub(r"tools[\1].", message)
    for old, new in _NAMES.items():
        if param == old or param.startswith((old + ".", old + "[")):
            param = new + param[len(old):]
        message = message.replace(old, new)
    return ApiError(err.status, message, param or None, err.type, err.code, err.headers)


_MESSAGE = re.compile(r"messages\[(\d+)\]")
_TOOL = re.compile(r"tools\[(\d+)\]\.function\.")
# The chat request's names of fields and forms, and the Responses API's.
_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format",
          "structured_outputs": "text.format", "tool_call_id": "call_id",
          '{"type": "function", "function": {"name": ...}}': '{"type": "function", "name": ...}',
          "the messages carry": "the input carries", "messages": "input"}


# --------------------------------------------------------------------- the answer
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def response_object(response_id: str, model: str, created: int, echo: dict[str, Any],
                    output: list[dict[str, Any]], status: str = "completed",
                    usage_counts: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": response_id, "object": "response", "created_at": created, "status": status,
            "error": error, "incomplete_details": incomplete, "model": model,
            "output": output, "usage": usage_counts, **echo}


def message_item(item_id: str, text: str, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A message item; in progress, it has no content part yet. ``logprobs``: its text's
    tokens', as OpenAI's chat ``logprobs.content`` entries."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [_text_part(text, logprobs)]}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponseEvents:
    """A streamed response's events, from the chat stream deltas of its answer: the response
    created and in progress, each output item added, its text or arguments as they come, the
    item done, and the response completed (or incomplete). Items follow one another: an item
    is done before the next is added. Every event has its ``sequence_number``. A whole
    answer is the last event's response (``whole``), so the two always agree."""

    def __init__(self, response_id: str, model: str, echo: dict[str, Any],
                 created: int | None = None) -> None:
        self.response_id, self.model, self.echo = response_id, model, echo
        self.created = int(time.time()) if created is None else created
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # done
        self.open: dict[str, Any] | None = None  # the item being written
        self.pieces: list[str] = []  # its text or arguments so far
        self.logprobs: list[dict[str, Any]] = []  # its text's tokens', where asked for
        self.final: dict[str, Any] = {}  # the response, once finished

    def start(self, queued: bool = False) -> list[str]:
        """The first events: the response created and in progress; a background one's is
        created queued first (``response.queued``), as OpenAI's is."""
        events = []
        if queued:
            response = self._response("queued")
            events += [self._event("response.created", response=response),
                       self._event("response.queued", response=response)]
        response = self._response("in_progress")
        if not queued:
            events.append(self._event("response.created", response=response))
        return [*events, self._event("response.in_progress", response=response)]

    def whole(self, deltas: list[dict[str, Any]], reason: str | None,
              usage_counts: dict[str, Any]) -> dict[str, Any]:
        """The response object of a whole answer: its deltas' events' last response."""
        for delta in deltas:
            self.delta(delta)
        self.finish(reason, usage_counts)
        return self.final

    def delta(self, delta: dict[str, Any]) -> list[str]:
        """Events for one chat delta: text (and its tokens' ``logprobs``, where it has
        them), a call announced, or more of its arguments."""
        events = []
        text = delta.get("content")
        if text is not None:
            if self.open is None or self.open["type"] != "message":
                events += self._close()
                if self.items:  # a new message after a call: no line break to start it
                    text = text.lstrip("\n")
                events += self._add(message_item(new_id("msg"), "", "in_progress"))
                events.append(self._event("response.content_part.added", **self._where(),
                                          content_index=0, part=_text_part("")))
            self.pieces.append(text)
            logprobs = delta.get("logprobs") or []
            self.logprobs += logprobs
            events.append(self._event("response.output_text.delta", **self._where(),
                                      content_index=0, delta=text, logprobs=logprobs))
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                events += self._close()
                events += self._add(call_item(new_id("fc"), call["id"],
                                              call["function"]["name"], "", "in_progress"))
            elif call["function"]["arguments"]:
                self.pieces.append(call["function"]["arguments"])
                events.append(self._event("response.function_call_arguments.delta",
                                          **self._where(),
                                          delta=call["function"]["arguments"]))
        return events

    def finish(self, reason: str | None, usage_counts: dict[str, Any]) -> list[str]:
        """The last item done, and the response completed, or incomplete (the last item
        too) when it reached ``max_output_tokens``."""
        status = "incomplete" if reason == "length" else "completed"
        if self.open is None and not self.items:  # nothing written: an empty message
            events = self._add(message_item(new_id("msg"), "", "in_progress"))
            events.append(self._event("response.content_part.added", **self._where(),
                                      content_index=0, part=_text_part("")))
        else:
            events = []
        events += self._close(status)
        self.final = self._response(status, usage_counts)
        return [*events, self._event(f"response.{status}", response=self.final)]

    def fail(self, error: ApiError) -> list[str]:
        """The response failed: the SDK knows ``server_error``; the message says why."""
        self.final = self._response(
            "failed", error={"code": "server_error", "message": error.message})
        return [self._event("response.failed", response=self.final)]

    def snapshot(self, status: str = "in_progress") -> dict[str, Any]:
        """The response as it stands (a background response's, while it runs): the items
        done so far."""
        return self._response(status)

    def cancel(self) -> dict[str, Any]:
        """The response cancelled: the items done so far."""
        self.final = self._response("cancelled")
        return self.final

    # ----------------------------------------------------------------- pieces
    def _add(self, item: dict[str, Any]) -> list[str]:
        self.open, self.pieces, self.logprobs = item, [], []
        return [self._event("response.output_item.added", output_index=len(self.items),
                            item=item)]

    def _close(self, status: str = "completed") -> list[str]:
        if self.open is None:
            return []
        item, text = self.open, "".join(self.pieces)
        events = []
        if item["type"] == "message":
            done = message_item(item["id"], text, status, self.logprobs)
            events.append(self._event("response.output_text.done", **self._where(),
                                      content_index=0, text=text, logprobs=self.logprobs))
            events.append(self._event("response.content_part.done", **self._where(),
                                      content_index=0,
                                      part=_text_part(text, self.logprobs)))
        else:
            done = {**item, "arguments": text, "status": status}
            events.append(self._event("response.function_call_arguments.done",
                                      **self._where(), arguments=text))
        events.append(self._event("response.output_item.done", output_index=len(self.items),
                                  item=done))
        self.items.append(done)
        self.open, self.pieces, self.logprobs = None, [], []
        return events

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _response(self, status: str, usage_counts: dict[str, Any] | None = None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.response_id, self.model, self.created, self.echo,
                               list(self.items), status, usage_counts, error)

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"
