"""Tool calling on ``/v1/chat/completions``: ``tools`` reach the chat template (and an
assistant's earlier calls and the tools' results with them); a named ``tool_choice`` and
"required" constrain the output and answer with ``tool_calls``; "auto" reads the model's own
``<tool_call>`` blocks (``--tool-call-parser hermes``). A streamed answer always merges into
the whole one, and a bad request is a 400 naming the field."""

from __future__ import annotations

import itertools
import json
import random

import openai
import pytest
from starlette.testclient import TestClient

from mmserve import LLM, SamplingParams
from mmserve.entrypoints import openai_protocol as proto
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.serve_args import ServerConfig
from mmserve.entrypoints.tool_call_readers import (
    CallReader,
    HermesCalls,
    NamedCall,
    RequiredCalls,
    merge,
)
from mmserve.entrypoints.tool_calls import ToolChoice
from mmserve.processing.chat_tools import template_tool_calls
from mmserve.sampling_params import StructuredOutputs
from tests.conftest import assert_no_leaks, make_image
from tests.test_server import data_url

# A template that shows the tools and the calls, as tool-aware templates (Qwen2.5's, Hermes')
# do, in a form a test can read back.
TEMPLATE = (
    "{%- if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}"
    "{{ t.function.parameters | tojson }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}{{ m.role }}:"
    "{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}{% else %}<image>{% endif %}"
    "{% endfor %}"
    "{% for c in m.tool_calls or [] %} CALL {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.tool_call_id %} RESULT OF {{ m.tool_call_id }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
HERMES = ('<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Rome)", '
          '"unit": "C"\\}\\}\n</tool_call>')


# ----------------------------------------------------------------- the readers
def _read(reader: CallReader, text: str, cuts: list[int]) -> list[dict]:
    deltas, start = [], 0
    for cut in [*cuts, len(text)]:
        deltas += reader.feed(text[start:cut])
        start = cut
    return deltas + reader.finish()


def _ids():
    counter = itertools.count()
    return lambda: f"call-{next(counter)}"


CASES = [
    (lambda: RequiredCalls(_ids()),
     '[{"name":"get_weather","parameters":{"city":"Paris, \\"FR\\" {x}","n":[1,{"a":2}]}},'
     '{"name":"get_time","parameters":{}}]',
     (None, [("get_weather", '{"city":"Paris, \\"FR\\" {x}","n":[1,{"a":2}]}'),
             ("get_time", "{}")])),
    (lambda: RequiredCalls(_ids()), '[ {"name": "f", "parameters": "a, b}"} ]',
     (None, [("f", '"a, b}"')])),
    (lambda: NamedCall("f", _ids()), '{"city":"Oslo"}', (None, [("f", '{"city":"Oslo"}')])),
    (lambda: HermesCalls(True, _ids()),
     'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
     ("Let me look.", [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")])),
    (lambda: HermesCalls(False, _ids()),
     '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>',
     (None, [("a", "{}")])),
    # Content on both sides of a call stays apart; NaN is no JSON, so no call.
    (lambda: HermesCalls(True, _ids()),
     'A \n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n B\n',
     ("A\nB", [("f", "{}")])),
    (lambda: HermesCalls(True, _ids()), '<tool_call>{"name": "f", "arguments": {"x": NaN}}',
     ('<tool_call>{"name": "f", "arguments": {"x": NaN}}', [])),
    # Cut off inside the closing tag: still the call.
    (lambda: HermesCalls(True, _ids()), '<tool_call>{"name": "f", "arguments": {}}</tool_c',
     (None, [("f", "{}")])),
    # Whitespace anywhere JSON allows it.
    (lambda: RequiredCalls(_ids()), '[ { "name" : "f" ,\n "parameters" : { "a" : 1 } } ]',
     (None, [("f", '{ "a" : 1 }')])),
    # No call: the text exactly, whitespace, a tag's prefix and all.
    (lambda: HermesCalls(True, _ids()), "  plain <tool answer\n\n",
     ("  plain <tool answer\n\n", [])),
    # A block that is no call is content as written; an unclosed one at the end is read.
    (lambda: HermesCalls(True, _ids()),
     'a <tool_call>{bad}</tool_call> b\n<tool_call>{"name": "g", "arguments": {"x": 1}}',
     ("a <tool_call>{bad}</tool_call> b", [("g", '{"x": 1}')])),
]


@pytest.mark.parametrize("make, text, expected", CASES)
def test_readers_agree_however_the_text_is_cut(make, text, expected) -> None:
    rng = random.Random(7)
    cuttings = [[], list(range(1, len(text)))] + [
        sorted(rng.sample(range(1, len(text)), k)) for k in (1, 3, 8, 20) if k < len(text)]
    for cuts in cuttings:
        content, calls = merge(_read(make(), text, cuts))
        assert (content, [(c["function"]["name"], c["function"]["arguments"])
                          for c in calls]) == expected, cuts
        assert [c["id"] for c in calls] == [f"call-{i}" for i in range(len(calls))]


def test_a_call_is_announced_before_its_arguments_stream() -> None:
    reader = RequiredCalls(_ids())
    assert reader.feed('[{"name":"get_weather"') == []
    header, piece = reader.feed(',"parameters":{"ci')
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert piece == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert reader.feed('ty"') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty"'}}]}]


def test_the_hermes_reader_holds_back_only_what_may_start_a_call() -> None:
    reader = HermesCalls()
    assert reader.feed("Sure <tool") == [{"content": "Sure"}]
    assert reader.feed("box") == [{"content": " <toolbox"}]


# ----------------------------------------------------------------- the request's fields
@pytest.mark.parametrize("body, param, fragment", [
    ({"tools": "f"}, "tools", "must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
     "1 to 64 letters"),
    ({"tools": TOOLS + [TOOLS[0]]}, "tools[2].function.name", "used by an earlier tool"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters", "JSON schema"),
    ({"tools": TOOLS * 65}, "tools", "at most 128"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the request's tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"functions": [{"name": "f"}]}, "functions", "send 'tools'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "leave out response_format"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
    ({"messages": [{"role": "tool", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages[0].content[0].type", "supported: 'text'"),
])
def test_bad_tool_fields_are_refused_naming_the_field(body, param, fragment) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(proto.ApiError) as err:
        proto.parse_chat_request(body, 256, 4)
    assert err.value.status == 400 and err.value.param == param
    assert fragment in err.value.message


def test_the_choices_constraints() -> None:
    def parse(**body):
        return proto.parse_chat_request(
            {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **body}, 256, 4,
            tool_parser="hermes")

    # Tools without a choice: "auto" where the server reads calls, else "none".
    assert parse().tool_choice == ToolChoice("auto")
    assert proto.parse_chat_request({"messages": [{"role": "user", "content": "hi"}],
                                     "tools": TOOLS}, 256, 4).tool_choice == ToolChoice("none")
    assert parse().params.structured_outputs is None
    named = parse(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.params.structured_outputs == StructuredOutputs(json=CITY)
    single = parse(tool_choice="required", parallel_tool_calls=False)
    schema = single.params.structured_outputs.json
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [
        {"type": "string", "enum": ["get_weather"]}, {"type": "string", "enum": ["get_time"]}]
    assert "maxItems" not in parse(tool_choice="required").params.structured_outputs.json
    # The completions endpoint takes no tools.
    with pytest.raises(proto.ApiError, match="send images, messages and tools to") as err:
        proto.parse_completion_request({"prompt": "hi", "tools": TOOLS}, 256)
    assert err.value.param == "tools"
    assert proto.parse_completion_request({"prompt": "hi", "tool_choice": "none"}, 256)


def test_tool_messages_pass_the_door_as_sent() -> None:
    """Checked at the door, made the template's by the processor (once: arguments that are
    JSON text of a string stay that string)."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    chat = proto.parse_chat_request({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]}, 256, 4)
    assert chat.messages[1]["tool_calls"] == [call]
    assert chat.messages[2] == {"role": "tool", "content": "-3 C", "tool_call_id": "c1"}
    quoted = {"function": {"name": "echo", "arguments": json.dumps(json.dumps({"a": 1}))}}
    assert template_tool_calls([quoted], "x")[0]["function"]["arguments"] == '{"a": 1}'


# ----------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def llm(clip_llama: str):
    with LLM(clip_llama, dtype="float32", max_model_len=512, chat_template=TEMPLATE) as llm:
        yield llm


# A conversation that has called a tool and has its result.
CALLED = [{"role": "user", "content": "weather?"},
          {"role": "assistant", "content": "", "tool_calls": [{
              "id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
          {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]


@pytest.fixture(scope="module")
def references(llm: LLM) -> dict:
    """The Python API's answers (made before the server's loop steps the engine: one thread
    steps an engine): the text generated under get_weather's schema, and the prompt of
    ``CALLED`` with the tools."""
    params = SamplingParams(max_tokens=60, temperature=0.0,
                            structured_outputs=StructuredOutputs(json=CITY))
    named = llm.chat(_messages(), params, tools=TOOLS)[0].text
    called = llm.chat(CALLED, SamplingParams(max_tokens=1), tools=TOOLS)[0]
    return {"named": named, "called_prompt": called.prompt_token_ids}


@pytest.fixture(scope="module")
def served(llm: LLM, references: dict):
    """The server, with "auto" tool choice read by the hermes parser."""
    config = ServerConfig("tiny", tool_call_parser="hermes", enable_auto_tool_choice=True)
    with TestClient(OpenAIServer(llm.engine, config).app()) as http:
        yield http
    assert_no_leaks(llm.engine)  # once the server's loop has stopped


def _messages(image: bool = True) -> list[dict]:
    content = [{"type": "text", "text": "what is the weather there?"}]
    if image:
        content.insert(0, {"type": "image_url", "image_url": {"url": data_url(make_image(
            5, (40, 32)))}})
    return [{"role": "user", "content": content}]


def _chat(http: TestClient, **body) -> dict:
    resp = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": _messages(), "temperature": 0, "max_tokens": 60, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _stream(http: TestClient, **body) -> tuple[list[dict], str]:
    """A streamed answer's deltas and its finish reason."""
    with http.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "messages": _messages(), "temperature": 0, "max_tokens": 60,
            "stream": True, **body}) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    return [d for d in deltas[1:] if d], events[-1]["choices"][0]["finish_reason"]


def _without_ids(calls: list[dict]) -> list[dict]:
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)
    return [{**c, "id": None} for c in calls]


def _assert_streamed_as_whole(http: TestClient, whole: dict, **body) -> None:
    deltas, reason = _stream(http, **body)
    content, calls = merge(deltas)
    message = whole["choices"][0]["message"]
    assert content == message["content"]
    assert _without_ids(calls) == _without_ids(message.get("tool_calls", []))
    assert reason == whole["choices"][0]["finish_reason"]


def test_the_tools_and_earlier_calls_reach_the_prompt(llm: LLM, served: TestClient,
                                                      references: dict) -> None:
    text, _ = llm.engine.processor.render_chat(
        proto.parse_chat_request({"messages": CALLED}, 512, 4).messages, [], tools=TOOLS)
    assert text == (
        f"TOOLS: get_weather{json.dumps(CITY)} get_time"
        f"{json.dumps(TOOLS[1]['function']['parameters'])}\n"
        "user:weather?\n"
        'assistant: CALL c1 get_weather {"city": "Oslo"}\n'
        "tool:-3 C RESULT OF c1\n"
        "assistant:")
    tokens = llm.engine.processor.tokenizer(text)["input_ids"]
    body = _chat(served, messages=CALLED, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert body["usage"]["prompt_tokens"] == len(tokens)
    assert references["called_prompt"] == tokens  # the Python API's


def test_a_named_choice_calls_that_function(served: TestClient, references: dict) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = _chat(served, tools=TOOLS, tool_choice=choice)
    (answer,) = whole["choices"]
    assert answer["finish_reason"] == "stop" and answer["message"]["content"] is None
    (call,) = answer["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city", "unit"} and arguments["city"] in ("Paris", "Rome", "Oslo")
    assert call["function"]["arguments"] == references["named"]
    _assert_streamed_as_whole(served, whole, tools=TOOLS, tool_choice=choice)


def test_required_calls_a_tool_and_says_so(served: TestClient) -> None:
    whole = _chat(served, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    (answer,) = whole["choices"]
    assert answer["finish_reason"] == "tool_calls"
    (call,) = answer["message"]["tool_calls"]
    assert call["function"]["name"] in ("get_weather", "get_time")
    json.loads(call["function"]["arguments"])
    _assert_streamed_as_whole(served, whole, tools=TOOLS, tool_choice="required",
                              parallel_tool_calls=False)
    # Several calls allowed: each a tool's, its arguments that tool's (or cut off at the
    # token limit, as the model chose to go on).
    many = _chat(served, tools=TOOLS, tool_choice="required", max_tokens=120)
    (answer,) = many["choices"]
    assert answer["message"]["tool_calls"]
    if answer["finish_reason"] == "tool_calls":
        for call in answer["message"]["tool_calls"]:
            assert call["function"]["name"] in ("get_weather", "get_time")
            json.loads(call["function"]["arguments"])
    else:
        assert answer["finish_reason"] == "length"
    _assert_streamed_as_whole(served, many, tools=TOOLS, tool_choice="required", max_tokens=120)


def test_auto_reads_the_models_calls(served: TestClient) -> None:
    # The model is random; a regex makes it write a call as Qwen2.5 writes one.
    whole = _chat(served, tools=TOOLS, structured_outputs={"regex": HERMES}, max_tokens=200)
    (answer,) = whole["choices"]
    assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None
    (call,) = answer["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["unit"] == "C"
    _assert_streamed_as_whole(served, whole, tools=TOOLS, structured_outputs={"regex": HERMES},
                              max_tokens=200)
    # Text with no call is the answer as it was written.
    plain = _chat(served, tools=TOOLS, max_tokens=8)
    assert "tool_calls" not in plain["choices"][0]["message"]
    assert plain["choices"][0]["message"]["content"] == _chat(
        served, tools=TOOLS, tool_choice="none", max_tokens=8)["choices"][0]["message"]["content"]


def test_the_openai_client_reads_the_calls(served: TestClient) -> None:
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                           http_client=served)
    resp = client.chat.completions.create(
        model="tiny", messages=_messages(), tools=TOOLS, temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    stream = client.chat.completions.create(
        model="tiny", messages=_messages(), tools=TOOLS, temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, stream=True)
    pieces = [c.choices[0].delta.tool_calls for c in stream if c.choices]
    arguments = "".join(call.function.arguments or "" for calls in pieces if calls
                        for call in calls)
    assert arguments == resp.choices[0].message.tool_calls[0].function.arguments


def test_a_server_without_the_parser_refuses_auto(llm: LLM) -> None:
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ServerConfig("tiny", enable_auto_tool_choice=True)
    server = OpenAIServer(llm.engine, ServerConfig("tiny"))
    assert server.tool_parser is None
    body = {"model": "tiny", "messages": _messages(image=False), "tools": TOOLS}
    with pytest.raises(proto.ApiError, match="--enable-auto-tool-choice"):
        proto.parse_chat_request({**body, "tool_choice": "auto"}, 512, 4, None)
    # Tools without a choice are shown to the model; the answer is text.
    assert proto.parse_chat_request(body, 512, 4, None).tool_choice.mode == "none"


def test_bad_tool_requests_get_400s_and_leave_nothing_behind(llm: LLM,
                                                             served: TestClient) -> None:
    for body in ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                    "type": "object", "properties": {"x": {"type": "nonsense"}}}}}],
                  "tool_choice": "required"},
                 {"tools": TOOLS, "tool_choice": {"type": "function"}}):
        resp = served.post("/v1/chat/completions", json={
            "model": "tiny", "messages": _messages(image=False), **body})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["type"] == "invalid_request_error"
    assert _chat(served, max_tokens=3)["usage"]["completion_tokens"] == 3



TOOL_VALUES = {
    "tools": [TOOLS, TOOLS[:1], [], None, "x", [None], [{"type": "function"}],
              [{"type": "retrieval", "function": {"name": "f"}}],
              [{"type": "function", "function": {"name": "f" * 65}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {
                  "type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}}],
              [{"type": "function", "function": {"name": "f", "description": 5}}],
              [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)],
              [{"type": "function", "function": {"name": "deep", "parameters": json.loads(
                  '{"type": "object", "properties": {"a": ' * 40 + "{}" + "}}" * 40)}}]],
    "tool_choice": ["none", "auto", "required", "any", None, 5, {"type": "function"},
                    {"type": "function", "function": {"name": "get_time"}},
                    {"type": "function", "function": {"name": ["get_time"]}}],
    "parallel_tool_calls": [True, False, None, "no"],
    "messages": [
        [{"role": "tool", "content": "4 C", "tool_call_id": "c1"}],
        [{"role": "tool", "content": None}],
        [{"role": "tool", "content": "x", "tool_call_id": 5}],
        [{"role": "assistant", "content": None, "tool_calls": "x"}],
        [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": 1}}]}],
        [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": "[" * 100_000}}]}],
        [{"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}],
        [{"role": "user", "content": "hello"}]],
    "response_format": [None, {"type": "json_object"}],
    "stream": [False, True],
}


# Values that make a good request, which the hostile ones are mixed among.
GOOD_VALUES = {"tools": [TOOLS, TOOLS[:1]], "tool_choice": [
    "none", "auto", "required", None, {"type": "function", "function": {"name": "get_weather"}}],
    "parallel_tool_calls": [True, False, None], "messages": [TOOL_VALUES["messages"][0],
                                                             CALLED[1:]],
    "response_format": [None], "stream": [False, True]}


def test_random_tool_requests_answer_200_or_400(served: TestClient) -> None:
    rng = random.Random(20261207)
    statuses: dict[int, int] = {}
    for _ in range(60):
        body = {"model": "tiny", "max_tokens": 6, "temperature": rng.choice([0, 1])}
        for name in sorted(TOOL_VALUES):  # one field in four hostile
            value = rng.choice(TOOL_VALUES[name] if rng.random() < 0.25 else GOOD_VALUES[name])
            if value is not None:
                body[name] = value
        body["messages"] = [{"role": "user", "content": "hi"}, *body.get("messages", [])]
        resp = served.post("/v1/chat/completions", json=body)
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        assert resp.status_code in (200, 400), (body, resp.text)
        if resp.status_code == 400:
            error = resp.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", body
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 10, statuses
    assert _chat(served, max_tokens=3)["usage"]["completion_tokens"] == 3


def test_a_template_that_refuses_a_conversation_is_a_400(clip_llama: str) -> None:
    from transformers import AutoConfig

    from mmserve.errors import InvalidInputError
    from mmserve.processing.processor import InputProcessor

    # LLaVA's template has no turn for a tool's result.
    processor = InputProcessor(
        clip_llama, AutoConfig.from_pretrained(clip_llama, local_files_only=True), 1_000_000)
    with pytest.raises(InvalidInputError, match="chat template cannot render these messages: "
                       "Unsupported role: tool") as err:
        processor.process({"messages": CALLED})
    assert err.value.param == "messages"


def test_deep_nesting_is_a_400_not_a_crash(served: TestClient) -> None:
    deep = json.loads('{"a": ' * 600 + "1" + "}" * 600)
    called = {"role": "assistant", "content": None, "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": json.dumps(deep)}}]}
    for body, param in (
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}],
              "tool_choice": "none"}, "tools[0].function.parameters"),
            ({"messages": [{"role": "user", "content": "hi"}, called]},
             "messages[1].tool_calls[0].function.arguments")):
        resp = served.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                         "messages": _messages(), **body})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param
        assert "levels deep" in resp.json()["error"]["message"]
    assert _chat(served, max_tokens=2)["usage"]["completion_tokens"] == 2


def test_each_of_n_choices_makes_its_own_calls(served: TestClient) -> None:
    body = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "n": 3,
            "temperature": 1.0, "seed": 11}
    whole = _chat(served, **body)["choices"]
    assert len(whole) == 3 and len({c["message"]["tool_calls"][0]["id"] for c in whole}) == 3
    with served.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "messages": _messages(), "max_tokens": 60, "stream": True,
            **body}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    for choice in whole:
        deltas = [e["choices"][0]["delta"] for e in events
                  if e["choices"] and e["choices"][0]["index"] == choice["index"]]
        _, calls = merge([d for d in deltas[1:] if d])
        assert _without_ids(calls) == _without_ids(choice["message"]["tool_calls"])


# A text model's template, as Qwen2.5's and Hermes' are: content as a string, tools and calls
# written as JSON.
STRING_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
    "{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}{{ '\\n' }}"
    "{% endfor %}{%- if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("template, expected", [
    (STRING_TEMPLATE, "string"), (TEMPLATE, "openai"),
    ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p.text }}"
     "{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}"
     "{{ p.text }}{% endfor %}{% endfor %}", "openai"),
])
def test_the_content_format_is_read_off_the_template(template: str, expected: str) -> None:
    from mmserve.processing.chat_template import content_format
    from mmserve.testing.llava import CHAT_TEMPLATE as LLAVA
    from mmserve.testing.qwen2_vl import CHAT_TEMPLATE as QWEN2_VL

    assert content_format(template) == expected
    assert content_format(template, "openai") == "openai"
    assert content_format(LLAVA) == content_format(QWEN2_VL) == "openai"


def test_a_text_models_template_gets_text_content(clip_llama: str) -> None:
    with LLM(clip_llama, dtype="float32", max_model_len=512,
             chat_template=STRING_TEMPLATE) as llm:
        processor = llm.engine.processor
        assert processor.content_format == "string"
        messages = [*CALLED[:2], {"role": "tool", "tool_call_id": "c1", "content": [
            {"type": "text", "text": "-3 C"}, {"type": "text", "text": "snow"}]}]
        text, _ = processor.render_chat(messages, [], tools=TOOLS)
        assert text == ("<tools>get_weather;get_time;</tools>\n<|user|>weather?\n"
                        '<|assistant|><tool_call>{"name": "get_weather", "arguments": '
                        '{"city": "Oslo"}}</tool_call>\n<|tool|>-3 C\nsnow\n<|assistant|>')
        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as http:
            resp = http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": _messages(), "max_tokens": 2})
            assert resp.status_code == 400
            assert "cannot place it" in resp.json()["error"]["message"]
            ok = http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": CALLED, "tools": TOOLS, "max_tokens": 2})
            assert ok.status_code == 200, ok.text


def test_tools_and_calls_with_an_engine_process(clip_llama: str, served: TestClient) -> None:
    """The front end renders the tools and reads the calls; the core only steps: the same
    answers as the engine on a thread of the server (``served``)."""
    from mmserve.config import EngineConfig
    from mmserve.engine.core_process import EngineCoreClient

    config = EngineConfig(model=clip_llama, dtype="float32", max_model_len=512,
                          chat_template=TEMPLATE)
    server = OpenAIServer(EngineCoreClient(config), ServerConfig(
        "tiny", tool_call_parser="hermes", enable_auto_tool_choice=True))
    try:
        with TestClient(server.app()) as http:
            for body in ({"tools": TOOLS, "tool_choice": {"type": "function",
                                                          "function": {"name": "get_weather"}}},
                         {"tools": TOOLS, "structured_outputs": {"regex": HERMES},
                          "max_tokens": 200},
                         {"messages": CALLED, "tools": TOOLS, "tool_choice": "none",
                          "max_tokens": 2}):
                got, want = _chat(http, **body), _chat(served, **body)
                assert _without_ids(got["choices"][0]["message"].get("tool_calls", [])) == \
                    _without_ids(want["choices"][0]["message"].get("tool_calls", []))
                for name in ("prompt_tokens", "completion_tokens"):  # (cache hits differ)
                    assert got["usage"][name] == want["usage"][name]
    finally:
        server.engine.close()
