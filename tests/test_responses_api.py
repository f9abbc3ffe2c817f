"""OpenAI's Responses API (``POST /v1/responses``) through the openai client: text and images
in, the same tokens as the chat endpoint gives for the same conversation; function
tools and earlier calls; a JSON schema; the stream's events add up to the whole response; what
it does not do is a 400 naming the field. (Stored responses: test_responses_store.py.)"""

from __future__ import annotations

import json

import openai
import pytest
from starlette.testclient import TestClient

from mmserve import LLM
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.serve_args import ServerConfig
from tests.conftest import assert_no_leaks, make_image
from tests.test_server import data_url
from tests.test_tool_calls import CITY, TEMPLATE, TOOLS

IMAGE = data_url(make_image(4, (48, 40)))


@pytest.fixture(scope="module")
def http(clip_llama: str):
    with LLM(clip_llama, dtype="float32", max_model_len=512, chat_template=TEMPLATE) as llm:
        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as client:
            yield client
        assert_no_leaks(llm.engine)  # once the server's loop has stopped


@pytest.fixture(scope="module")
def client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                         http_client=http)


def _chat(http: TestClient, messages: list, **body) -> dict:
    resp = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages,
                                                   "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_text_and_images_answer_as_the_chat_does(http: TestClient,
                                                 client: openai.OpenAI) -> None:
    resp = client.responses.create(
        model="tiny", instructions="Be brief.", temperature=0, max_output_tokens=12,
        input=[{"role": "user", "content": [
            {"type": "input_text", "text": "what is this?"},
            {"type": "input_image", "image_url": IMAGE}]}])
    chat = _chat(http, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": IMAGE}}]}], max_tokens=12)
    assert resp.output_text == chat["choices"][0]["message"]["content"]
    assert resp.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert resp.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.output[0].type == "message" and resp.output[0].id.startswith("msg_")
    # A string input is one user message; the token limit makes it incomplete.
    short = client.responses.create(model="tiny", input="hello", temperature=0,
                                    max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.output_text == _chat(http, [{"role": "user", "content": "hello"}],
                                      max_tokens=2)["choices"][0]["message"]["content"]


def test_a_stream_adds_up_to_the_whole_response(client: openai.OpenAI) -> None:
    body = {"model": "tiny", "input": "tell me about the cat", "temperature": 0,
            "max_output_tokens": 8}
    whole = client.responses.create(**body)
    events = list(client.responses.create(**body, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 8


def test_function_tools_and_earlier_calls(http: TestClient, client: openai.OpenAI) -> None:
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    resp = client.responses.create(model="tiny", input="weather in a city?", tools=tools,
                                   tool_choice={"type": "function", "name": "get_weather"},
                                   temperature=0, max_output_tokens=60)
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == set(CITY["required"])
    events = list(client.responses.create(
        model="tiny", input="weather in a city?", tools=tools, stream=True,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
        max_output_tokens=60))
    streamed = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments
    # The call and its output go back in: the prompt is the chat endpoint's.
    turn = client.responses.create(model="tiny", tools=tools, max_output_tokens=2, input=[
        {"role": "user", "content": "weather in a city?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "-3 C"}])
    chat = _chat(http, [
        {"role": "user", "content": "weather in a city?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "-3 C"}],
        tools=TOOLS, max_tokens=2)
    assert turn.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_the_response_id_is_the_request_id(http: TestClient) -> None:
    resp = http.post("/v1/responses", json={"model": "tiny", "input": "hi",
                                            "max_output_tokens": 1})
    assert resp.json()["id"] == f"resp_{resp.headers['x-request-id']}"


def test_a_stream_and_a_whole_answer_have_the_same_items() -> None:
    """Text on both sides of two calls: four items, alike in both forms; cut off, the last
    item is incomplete too."""
    from mmserve.entrypoints.responses_protocol import ResponseEvents
    from mmserve.entrypoints.tool_call_readers import HermesCalls

    text = ('Sure. <tool_call>{"name": "a", "arguments": {}}</tool_call>\nthen '
            '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>')
    ids = iter(range(100))

    def read(pieces: list[str]) -> list[dict]:
        reader = HermesCalls(True, lambda: f"call_{next(ids)}")
        return [d for piece in pieces for d in reader.feed(piece)] + reader.finish()

    usage = {"input_tokens": 1}
    whole = ResponseEvents("resp_1", "tiny", {}, 0).whole(read([text]), "stop", usage)
    events = ResponseEvents("resp_1", "tiny", {}, 0)
    sent = [event for delta in read(list(text)) for event in events.delta(delta)]
    sent += events.finish("stop", usage)
    streamed = json.loads(sent[-1].split("data: ", 1)[1])["response"]

    def shape(response: dict) -> list:
        return [(i["type"], i.get("content", [{}])[0].get("text") if i["type"] == "message"
                 else (i["name"], i["arguments"]), i["status"]) for i in response["output"]]

    assert shape(whole) == shape(streamed) == [
        ("message", "Sure.", "completed"), ("function_call", ("a", "{}"), "completed"),
        ("message", "then", "completed"), ("function_call", ("b", '{"x": 1}'), "completed")]
    cut = ResponseEvents("resp_2", "tiny", {}, 0).whole([{"content": "abc"}], "length", usage)
    assert cut["status"] == "incomplete" and cut["output"][0]["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_json_schema_shapes_the_text(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="tiny", input="a city", temperature=0,
                                   max_output_tokens=60, text={"format": {
                                       "type": "json_schema", "name": "city", "schema": CITY}})
    assert resp.status == "completed"
    assert set(json.loads(resp.output_text)) == {"city", "unit"}


def test_output_text_logprobs_are_the_chat_endpoints(http: TestClient,
                                                     client: openai.OpenAI) -> None:
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: each output token
    with its log-probability and alternatives, as the chat endpoint gives them; a stream's
    deltas carry their tokens', adding up to the whole; without ``include``, none."""
    body = {"model": "tiny", "input": "tell me about the cat", "temperature": 0,
            "max_output_tokens": 6, "top_logprobs": 3,
            "include": ["message.output_text.logprobs"]}
    whole = client.responses.create(**body)
    chat = _chat(http, [{"role": "user", "content": "tell me about the cat"}], max_tokens=6,
                 logprobs=True, top_logprobs=3)
    want = chat["choices"][0]["logprobs"]["content"]
    got = [lp.model_dump() for lp in whole.output[0].content[0].logprobs]
    assert len(got) == 6 and got == want
    assert whole.top_logprobs == 3
    events = list(client.responses.create(**body, stream=True))
    streamed = [lp.model_dump() for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert streamed == want
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.model_dump() for lp in done.logprobs] == want
    plain = client.responses.create(**{k: v for k, v in body.items() if k != "include"})
    assert plain.output[0].content[0].logprobs == []
    # A client that asks for encrypted reasoning on every request: there is none to include.
    assert client.responses.create(**{**body, "include": ["reasoning.encrypted_content"]}
                                   ).output_text == whole.output_text


@pytest.mark.parametrize("body, param, fragment", [
    ({"conversation": 5}, "conversation", "a conversation's id"),
    ({"previous_response_id": 5}, "previous_response_id", "a response's id"),
    ({"store": "yes"}, "store", "true or false"),
    ({"include": ["file_search_call.results"]}, "include[0]", "no 'file_search_call"),
    ({"include": "message.output_text.logprobs"}, "include", "list of strings"),
    ({"top_logprobs": 21}, "top_logprobs", "from 0 to 20"),
    ({"include": ["message.output_text.logprobs"], "tool_choice": "required",
      "tools": [{"type": "function", "name": "f"}]}, "include", "call tools"),
    ({"background": True, "store": False}, "background", "send 'store': true"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only 'function' tools"),
    ({"input": [{"type": "reasoning"}]}, "input[0].type", "supported: 'message'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "detail": "auto"}]}]},
     "input[0].content[0]", "'file_id'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
     "input[0].content[0].type", "supported: 'input_text'"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]},
     "input[1].role", "use one of"),
    ({"instructions": "x", "input": [{"role": "user", "content": [{"type": "input_text",
                                                                    "text": 5}]}]},
     "input[0].content[0].text", "must be a string"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be between"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "'schema'"),
    ({"text": "x"}, "text", "must be an object"),
    ({"text": {"format": {"type": "xml"}}}, "text.format", "must be {'type': 'text'}"),
    ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name", "1 to 64 letters"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function"}},
     "tool_choice", '{"type": "function", "name": ...}'),
    ({"input": [{"role": "user", "content": "a"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "nope"}]},
     "input[1].arguments", "not valid JSON"),
    ({"metadata": {"k": 5}}, "metadata", "at most 16 keys"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE}] * 5}]},
     "input", "the input carries 5 images"),
    ({"input": []}, "input", "non-empty list"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]", "'call_id'"),
])
def test_what_it_does_not_do_is_a_400(http: TestClient, body: dict, param: str,
                                      fragment: str) -> None:
    resp = http.post("/v1/responses", json={"model": "tiny", "input": "hi", **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


RESPONSES_VALUES = {
    "input": ["hi", [], 5, [{"type": "message", "role": "user", "content": "hi"}],
              [{"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                            {"type": "input_image", "image_url": IMAGE}]}],
              [{"role": "user", "content": [{"type": "input_image", "image_url": 5}]}],
              [{"role": "assistant", "content": [{"type": "output_text", "text": "x"}]},
               {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c", "output": "ok"}],
              [{"type": "function_call_output", "call_id": 5, "output": "ok"}],
              [{"type": "function_call", "call_id": "c", "name": "f",
                "arguments": "[" * 300 + "]" * 300}]],
    "instructions": [None, "be brief", 5, ""],
    "max_output_tokens": [None, 1, 4, 0, -1, 10**20, "4"],
    "temperature": [None, 0, 1.5, 3, "x"],
    "tools": [None, [], [{"type": "function", "name": "f"}], "x", [{"type": "file_search"}],
              [{"type": "function", "name": "g", "parameters": {"type": "object", "properties": {
                  "z": {"enum": ["a", "b"]}}, "required": ["z"]}}]],
    "tool_choice": [None, "auto", "none", "required", {"type": "function", "name": "g"}, 7],
    "text": [None, {"format": {"type": "json_object"}}, {"format": None}, [], {"format": 5}],
    "metadata": [None, {"a": "b"}, {"a": 1}, {str(i): "v" for i in range(17)}],
    "stream": [None, True, False, "yes"],
    "store": [None, True, False],
    "background": [None, True, False, "x"],
    "include": [None, [], ["message.output_text.logprobs"], ["x"], "x", [5]],
    "top_logprobs": [None, 0, 5, 20, 21, -1, "2", True],
}


def test_random_responses_requests_answer_200_or_400(http: TestClient) -> None:
    import random

    rng = random.Random(20261207)
    statuses: dict[int, int] = {}
    for _ in range(80):
        body = {"model": "tiny", "max_output_tokens": 4}
        for name in rng.sample(sorted(RESPONSES_VALUES), 2):  # hostile, or not
            value = rng.choice(RESPONSES_VALUES[name])
            if value is not None:
                body[name] = value
        body.setdefault("input", "hi")
        resp = http.post("/v1/responses", json=body)
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        assert resp.status_code in (200, 400), (body, resp.text)
        if resp.status_code == 400:
            assert resp.json()["error"]["type"] == "invalid_request_error", body
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 10, statuses
    ok = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 3


def test_input_tokens_count_tools_and_leave_generating_fields_unread(
        client: openai.OpenAI, http: TestClient) -> None:
    """The tools a template shows the model are counted (as the response made of the same
    body reads them); the fields only generating reads are not checked by the count."""
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    bare = client.responses.input_tokens.count(model="tiny", input="weather in Paris?")
    counted = client.responses.input_tokens.count(model="tiny", input="weather in Paris?",
                                                  tools=tools)
    made = client.responses.create(model="tiny", input="weather in Paris?", tools=tools,
                                   max_output_tokens=2, temperature=0)
    assert counted.input_tokens == made.usage.input_tokens > bare.input_tokens
    resp = http.post("/v1/responses/input_tokens", json={
        "model": "tiny", "input": "hi", "max_output_tokens": 0, "background": True,
        "store": False, "stream": True, "temperature": 99})
    assert resp.status_code == 200 and resp.json()["input_tokens"] > 0, resp.text
