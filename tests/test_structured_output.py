"""Structured output (xgrammar): every kind of constraint, greedy and sampled, with images,
beside free requests, under preemption and prefix-cache hits; bad constraints refused at the
door; the OpenAI forms through the real server and the openai client; the demo model."""

from __future__ import annotations

import json
import re
from enum import Enum
from pathlib import Path
from typing import Literal

import openai
import pytest
import torch
import xgrammar
from pydantic import BaseModel, Field

from mmserve import LLM, SamplingParams
from mmserve.engine.llm_engine import MAX_FAILED_STEPS
from mmserve.engine.structured_output import choice_grammar
from mmserve.errors import InvalidInputError
from mmserve.sampling_params import StructuredOutputs
from mmserve.step import ModelOutput, SchedulerOutput
from mmserve.worker.sampler import apply_token_bitmasks
from tests.conftest import assert_no_leaks, make_image
from tests.test_server import Server, data_url, image_message


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Shape(BaseModel):
    kind: Literal["circle", "square", "triangle"]
    colour: Colour
    size: int = Field(ge=0, le=99)


class Size(BaseModel):
    width: int = Field(ge=1, le=999)
    height: int = Field(ge=1, le=999)


class Scene(BaseModel):
    """Nested objects, an array of objects, enums, bounded strings and integers."""

    title: str = Field(max_length=12)
    shapes: list[Shape] = Field(max_length=3)
    size: Size
    outdoors: bool


SCHEMA = Scene.model_json_schema()
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["red circle", 'a "quoted" square', "ünïcode"]
GRAMMAR = 'root ::= "yes" | "no" | "maybe " [0-9]'
LONG = 400  # tokens: enough for any sentence of the bounded schema


def _checks() -> dict[str, tuple[dict, object]]:
    """Constraint name -> (structured_outputs fields, check of the text)."""
    def scene(text: str) -> None:
        Scene.model_validate_json(text)

    def json_object(text: str) -> None:
        assert isinstance(json.loads(text), dict)

    def regex(text: str) -> None:
        assert re.fullmatch(REGEX, text), text

    def choice(text: str) -> None:
        assert text in CHOICES, text

    def grammar(text: str) -> None:
        assert re.fullmatch(r"yes|no|maybe [0-9]", text), text

    return {"json": ({"json": SCHEMA}, scene), "json_object": ({"json_object": True}, json_object),
            "regex": ({"regex": REGEX}, regex), "choice": ({"choice": CHOICES}, choice),
            "grammar": ({"grammar": GRAMMAR}, grammar)}


CHECKS = _checks()


def _chat(text: str, images: int = 0, seed: int = 0) -> dict:
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}],
            "images": [make_image(seed + i, (40 + 8 * i, 32)) for i in range(images)]}


def _params(constraint: str | None, temperature: float = 0.0, seed: int | None = None,
            max_tokens: int = LONG) -> SamplingParams:
    fields = None if constraint is None else CHECKS[constraint][0]
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=fields)


@pytest.fixture(scope="module")
def llm(clip_llama: str) -> LLM:
    return LLM(clip_llama, dtype="float32", max_model_len=640, max_num_seqs=8)


# ----------------------------------------------------------------- pieces
def test_the_bitmask_masks_what_xgrammar_masks() -> None:
    words = torch.randint(-2**31, 2**31 - 1, (4, 16), dtype=torch.int32)  # a row per row
    logits = torch.randn(4, 500)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, words, indices=[0, 2, 3])
    got = apply_token_bitmasks(logits, [0, 2, 3], [words[0], words[2], words[3]])
    assert torch.equal(got, expected)
    assert not torch.equal(got, logits)  # a new tensor: the raw logits stay for logprobs


def test_choices_are_the_grammars_sentences(llm: LLM) -> None:
    compiled = llm.engine.grammars.compile(StructuredOutputs(choice=CHOICES))
    for text in CHOICES:
        matcher = xgrammar.GrammarMatcher(compiled)
        assert matcher.accept_string(text) and matcher.is_completed()
    assert "\\\"quoted\\\"" in choice_grammar(CHOICES)


def test_json_strings_hold_no_raw_control_characters(llm: LLM) -> None:
    """Bounded and unbounded strings alike (xgrammar's own bounded strings let U+001E in)."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5},
                                               "b": {"type": "string"}}}
    compiled = llm.engine.grammars.compile(StructuredOutputs(json=schema))
    for bad in ['{"a": "x\x1e', '{"a": "x", "b": "\x07']:
        assert not xgrammar.GrammarMatcher(compiled).accept_string(bad)
    matcher = xgrammar.GrammarMatcher(compiled)
    assert matcher.accept_string('{"a": "é ok", "b": "fine"}') and matcher.is_completed()


def _nested_schema(levels: int) -> str:
    """An object whose property is an object ... ``levels`` deep: 2 x levels + 1 levels of
    JSON objects."""
    return ('{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}'
            + '}, "required": ["a"]}' * levels)


def test_a_schema_at_the_nesting_limit_compiles(llm: LLM) -> None:
    schema = StructuredOutputs(json=_nested_schema(31))  # 63 levels
    matcher = xgrammar.GrammarMatcher(llm.engine.grammars.compile(schema))
    assert matcher.accept_string('{"a": ' * 31 + '"x"' + "}" * 31) and matcher.is_completed()


@pytest.mark.parametrize("fields, fragment", [
    ({}, "exactly one of json, json_object, regex, choice and grammar, got none"),
    ({"regex": "a", "grammar": "b"}, "got regex, grammar"),
    ({"json": "[1, 2]"}, "must be a JSON object"),
    ({"json": "{"}, "not valid JSON"),
    ({"choice": ["a", ""]}, "non-empty strings"),
    ({"regex": "x" * 70_000}, "at most 65536 characters"),
    ({"json_object": "yes"}, "must be a boolean"),
    # Nesting: xgrammar's conversion takes time cubic in it (16 s at 941 levels), and a
    # document nested past Python's stack must not raise RecursionError.
    ({"json": _nested_schema(32)}, "more than 64 levels deep; flatten it"),
    ({"json": json.loads(_nested_schema(32))}, "more than 64 levels deep; flatten it"),
    ({"json": "[" * 100_000 + "]" * 100_000}, "more than 64 levels deep"),
])
def test_constraints_are_checked_when_made(fields: dict, fragment: str) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(fragment)) as e:
        SamplingParams(structured_outputs=fields)
    assert e.value.param == "structured_outputs"


# ----------------------------------------------------------------- the engine
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 7)], ids=["greedy", "sampled"])
def test_every_constraint_holds_in_a_mixed_batch_with_images(llm: LLM, temperature: float,
                                                             seed: int | None) -> None:
    names = list(CHECKS)
    prompts = [_chat(f"describe {name}", images=i % 3, seed=i) for i, name in enumerate(names)]
    outs = llm.generate(prompts, [_params(n, temperature, seed) for n in names])
    for name, out in zip(names, outs, strict=True):
        if name == "json_object" and out.finish_reason == "length":
            # Any object: a random model sampling may fill a string until max_tokens; what
            # it wrote is then the start of a JSON object.
            compiled = llm.engine.grammars.compile(StructuredOutputs(json_object=True))
            assert xgrammar.GrammarMatcher(compiled).accept_string(out.text), out.text
            continue
        assert out.finish_reason == "stop", (name, out.text)
        CHECKS[name][1](out.text)
    assert_no_leaks(llm.engine)
    if seed is not None:  # a seeded constrained request reproduces
        again = llm.generate(prompts[0], _params(names[0], temperature, seed))[0]
        assert again.token_ids == outs[0].token_ids


def test_free_requests_get_the_tokens_they_get_alone(llm: LLM) -> None:
    free = [_chat("tell me", images=1, seed=20), _chat("and more", seed=21)]
    free_params = SamplingParams(max_tokens=12, temperature=0.0)
    alone = [llm.generate(p, free_params)[0].token_ids for p in free]
    constrained = [_chat(f"constrained {n}", images=1, seed=30 + i)
                   for i, n in enumerate(CHECKS)]
    outs = llm.generate([free[0], *constrained, free[1]],
                        [free_params, *(_params(n) for n in CHECKS), free_params])
    assert [outs[0].token_ids, outs[-1].token_ids] == alone


def test_constraints_hold_under_preemption_and_prefix_hits(clip_llama: str) -> None:
    """A KV cache of 64 blocks of 4 tokens for 6 requests with a shared prefix: requests are
    preempted and resumed, and later ones hit the prefix cache; each constrained request
    gives the tokens it gives alone."""
    small = LLM(clip_llama, dtype="float32", max_model_len=192, max_num_seqs=6, block_size=4,
                kv_cache_memory=64 * 4 * _kv_bytes_per_token(small_config(clip_llama)),
                enable_prefix_caching=True)
    system = "you are a careful describer of every picture you are shown. "
    names = ["json", "regex", "choice", "json", "grammar", "json_object"]
    prompts = [_chat(system + f"request {i}", images=1, seed=40 + i) for i in range(6)]
    params = [_params(n, max_tokens=120) for n in names]
    alone = [small.generate(p, q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    outs = small.generate(prompts, params)
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats
    assert [o.token_ids for o in outs] == alone
    for name, out in zip(names, outs, strict=True):
        if out.finish_reason == "stop":  # 120 tokens may cut a JSON document short
            CHECKS[name][1](out.text)
    assert_no_leaks(small.engine)
    small.close()


def small_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).text_config


def _kv_bytes_per_token(text) -> int:
    head_dim = text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 4


@pytest.mark.parametrize("fields, fragment", [
    ({"json": {"type": "objectx"}}, 'JSON schema of structured_outputs cannot be used: '
     'Unsupported type "objectx"'),
    ({"regex": "([a-z"}, "regex of structured_outputs cannot be used"),
    ({"grammar": "root ::= "}, "grammar of structured_outputs cannot be used"),
    ({"grammar": 'start ::= "a"'}, "grammar of structured_outputs cannot be used"),
    ({"grammar": "root ::= root"}, "grammar of structured_outputs matches no text"),
])
def test_a_constraint_that_does_not_compile_is_refused_and_the_engine_goes_on(
        llm: LLM, fields: dict, fragment: str) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(fragment)) as e:
        llm.generate(_chat("x"), SamplingParams(structured_outputs=fields))
    assert e.value.param == "structured_outputs"
    assert_no_leaks(llm.engine)
    out = llm.generate(_chat("x"), _params("choice"))[0]
    assert out.text in CHOICES


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_grammar_that_dead_ends_fails_its_request_alone(llm: LLM, temperature: float) -> None:
    # After "a" the grammar allows no token at all. Sampled from no token, the row's
    # probabilities are not finite, a failure that counted as the step's: a request that had
    # a token before, alone in its steps, made MAX_FAILED_STEPS of them and killed the engine.
    engine = llm.engine
    dead_end = SamplingParams(max_tokens=8, temperature=temperature, seed=1,
                              structured_outputs={"grammar": 'root ::= "a" x\nx ::= x'})
    for _ in range(MAX_FAILED_STEPS + 1):  # alone in its steps
        out = llm.generate(_chat("x"), dead_end)[0]
        assert out.finish_reason == "error" and out.text == "a"
        assert "grammar allows no token after the text generated so far" in out.error
    # Beside another request, which goes on.
    expected = llm.generate(_chat("y"), _params("choice"))[0].text
    outs = llm.generate([_chat("x"), _chat("y")], [dead_end, _params("choice")])
    assert outs[0].finish_reason == "error" and outs[1].text == expected
    assert_no_leaks(engine)
    assert engine.num_failed_requests >= MAX_FAILED_STEPS + 2


def test_a_dead_end_found_for_a_step_scheduled_ahead_waits_for_that_step(llm: LLM) -> None:
    # Scheduling ahead, the next step's bitmasks are made while this one runs: a request
    # found at a dead end there (one recomputing its text after a preemption, say) fails when
    # the step it samples in ends, not the one before it (whose blocks it still uses).
    engine = llm.engine
    rid = engine.add_request(_chat("x"), SamplingParams(max_tokens=4, temperature=0.0))
    engine._dead_ends = {rid: "a dead end", "gone": "a request that finished meanwhile"}
    assert engine._fail_dead_ends(SchedulerOutput(), ModelOutput()) == []
    assert engine._dead_ends == {rid: "a dead end"}
    sampling_there = SchedulerOutput()
    sampling_there.decodes.append(rid, 1, 5, 5, SamplingParams(), 1)
    result = ModelOutput(sampled={rid: 7})
    [failed] = engine._fail_dead_ends(sampling_there, result)
    assert failed.request_id == rid and failed.error == "a dead end"
    assert not engine._dead_ends and not result.sampled
    [out] = engine._assemble([engine._error_output(failed)])  # as _finish_step's outputs
    assert out.finish_reason == "error" and out.error == "a dead end"
    assert_no_leaks(engine)


def test_the_demo_model_answers_in_the_schemas_shape() -> None:
    with LLM(dtype="float32") as demo:
        image = Path(__file__).parent.parent / "samples" / "scene_01.png"
        prompt = {"messages": [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "Describe the shapes as JSON."}]}],
            "images": [str(image)]}
        out = demo.generate(prompt, _params("json"))[0]
    assert out.finish_reason == "stop"
    Scene.model_validate_json(out.text)


# ----------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def client(clip_llama: str, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("structured") / "server.log"
    srv = Server(clip_llama, "--served-model-name", "tiny", "--max-model-len", "640", log=log)
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    srv.stop()


def _ask(client: openai.OpenAI, **kwargs):
    messages = image_message("describe it", data_url(make_image(3, (40, 32))))
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=LONG,
                                          temperature=0, **kwargs)


def test_response_format_over_http(client: openai.OpenAI, llm: LLM) -> None:
    resp = _ask(client, response_format={"type": "json_schema", "json_schema": {
        "name": "scene", "schema": SCHEMA, "strict": True}})
    assert resp.choices[0].finish_reason == "stop"
    Scene.model_validate_json(resp.choices[0].message.content)
    # Any object: a random model may fill a string until max_tokens, so the check is that
    # the server gives the Python API's tokens (which the engine tests validate).
    resp = _ask(client, response_format={"type": "json_object"})
    prompt = {"messages": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "describe it"}]}],
        "images": [make_image(3, (40, 32))]}
    expected = llm.generate(prompt, _params("json_object"))[0]
    assert resp.choices[0].message.content == expected.text
    assert resp.choices[0].message.content.startswith("{")
    if expected.finish_reason == "stop":
        assert isinstance(json.loads(expected.text), dict)


def test_vllm_forms_over_http_streamed_and_not(client: openai.OpenAI) -> None:
    for extra, name in [({"guided_regex": REGEX}, "regex"), ({"guided_choice": CHOICES}, "choice"),
                        ({"structured_outputs": {"grammar": GRAMMAR}}, "grammar"),
                        ({"guided_json": SCHEMA}, "json")]:
        text = _ask(client, extra_body=extra).choices[0].message.content
        CHECKS[name][1](text)
        stream = _ask(client, extra_body=extra, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    completion = client.completions.create(model="tiny", prompt="USER: a scene\nASSISTANT:",
                                           max_tokens=LONG, temperature=0,
                                           extra_body={"guided_json": SCHEMA})
    Scene.model_validate_json(completion.choices[0].text)


def test_a_bad_schema_is_a_400_and_the_next_request_succeeds(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match='Unsupported type \\\\"objectx\\\\"|'
                       'Unsupported type "objectx"'):
        _ask(client, response_format={"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "objectx"}}})
    with pytest.raises(openai.BadRequestError, match="send one output constraint"):
        _ask(client, response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})
    assert _ask(client, extra_body={"guided_choice": CHOICES}).choices[0].message.content \
        in CHOICES


def test_bench_serve_sends_the_schema(client: openai.OpenAI, tmp_path: Path) -> None:
    """`mmserve bench serve --structured-output`: every request under the schema."""
    import asyncio

    from mmserve.bench.serve import run_load
    from mmserve.bench.workload import WorkloadConfig, build_workload

    small = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                              "n": {"type": "integer", "minimum": 0,
                                                    "maximum": 9}},
             "required": ["ok", "n"], "additionalProperties": False}
    workload = build_workload(WorkloadConfig(num_prompts=4, unique_images=2,
                                             image_sizes=((40, 30),), output_len=(60, 60),
                                             prompt_len=6), None)
    base_url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    results, _ = asyncio.run(run_load(base_url, "tiny", workload, use_tqdm=False,
                                      schema=small))
    assert all(r.ok for r in results), [r.error for r in results]
    for r in results:  # the grammar ends each request well before its 60 tokens
        assert r.output_tokens < 60
        doc = json.loads(r.text)
        assert set(doc) == {"ok", "n"} and isinstance(doc["ok"], bool) and 0 <= doc["n"] <= 9


def test_the_demo_model_over_http_answers_in_the_schemas_shape(tmp_path: Path) -> None:
    """Its answers about the picture may be wrong; their shape is the schema's."""
    from mmserve.demo.checkpoint import demo_model_path

    srv = Server(str(demo_model_path()), "--served-model-name", "demo",
                 log=tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        image = Path(__file__).parent.parent / "samples" / "scene_02.png"
        from PIL import Image

        messages = image_message("Describe the shapes as JSON.", data_url(Image.open(image)))
        resp = client.chat.completions.create(
            model="demo", messages=messages, max_tokens=LONG, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "scene", "schema": SCHEMA}})
        assert resp.choices[0].finish_reason == "stop"
        Scene.model_validate_json(resp.choices[0].message.content)
    finally:
        srv.stop()
