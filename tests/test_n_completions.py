"""``n`` completions of one prompt: they share its prefill (prefix-cache hits) and its image's
encoder output, each samples with a seed of its own and reproduces; the Python API returns them
in ``RequestOutput.outputs``, the server as ``n`` choices (streamed and not) with OpenAI's
usage, the completions endpoint ``n`` per prompt in order."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from mmserve import LLM, SamplingParams
from mmserve.errors import InvalidInputError
from tests.conftest import assert_no_leaks, make_image
from tests.test_server import Server, data_url, image_message

PROMPT = {"messages": [{"role": "user", "content": [
    {"type": "image"}, {"type": "text", "text": "what is in this picture, in some detail?"}]}],
    "images": [make_image(1, (48, 40))]}


@pytest.fixture(scope="module")
def llm(clip_llama: str) -> LLM:
    return LLM(clip_llama, dtype="float32", max_model_len=256, block_size=16)


def test_four_seeded_completions_share_the_prompt_and_reproduce(llm: LLM) -> None:
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=5)
    engine = llm.engine
    before = llm.stats()
    used = []  # KV blocks in use after each step
    real_step = engine.step

    def step():
        outs = real_step()
        stats = engine.stats()
        used.append(stats["kv_blocks_total"] - stats["kv_blocks_free"])
        return outs

    engine.step = step
    try:
        out = llm.generate(PROMPT, params)[0]
    finally:
        del engine.step
    after = llm.stats()
    assert len(out.outputs) == 4 and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert (out.text, out.token_ids) == (out.outputs[0].text, out.outputs[0].token_ids)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds of their own
    assert all(c.finish_reason == "length" and len(c.token_ids) == 12 for c in out.outputs)
    # The image is encoded once, and three completions find the prompt's full blocks cached.
    assert after["encoder_items_computed"] - before["encoder_items_computed"] == 1
    full_blocks = out.num_prompt_tokens // 16
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] \
        >= 3 * full_blocks * 16 > 0
    # Fewer KV blocks than four separate requests take (each its prompt and 12 tokens).
    separate = 4 * -(-(out.num_prompt_tokens + 12) // 16)
    assert max(used) < separate, (used, separate)
    assert_no_leaks(engine)
    # Completion i is what a request of seed 5 + i samples, and the whole call reproduces.
    again = llm.generate(PROMPT, params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    alone = [llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=5 + i))[0]
             for i in range(4)]
    assert [a.token_ids for a in alone] == [c.token_ids for c in out.outputs]


def test_greedy_completions_are_the_greedy_answer(llm: LLM) -> None:
    one = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert [c.index for c in one.outputs] == [0] and one.outputs[0].text == one.text
    outs = llm.generate([PROMPT, "USER: hi\nASSISTANT:"],
                        SamplingParams(n=3, max_tokens=8, temperature=0.0))
    assert [c.token_ids for c in outs[0].outputs] == [one.token_ids] * 3
    assert len(outs[1].outputs) == 3
    assert_no_leaks(llm.engine)


def test_each_completion_keeps_its_own_constraint_state(llm: LLM) -> None:
    choices = ["red circle", "blue square", "green triangle"]
    out = llm.generate(PROMPT, SamplingParams(n=5, max_tokens=30, temperature=1.0, seed=2,
                                              structured_outputs={"choice": choices}))[0]
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.outputs)


def test_n_is_checked(llm: LLM) -> None:
    for n in (0, 129, 2.0, True):
        with pytest.raises(InvalidInputError, match="n must be an integer from 1 to 128"):
            SamplingParams(n=n)
    with pytest.raises(InvalidInputError, match="use LLM.generate"):
        llm.engine.add_request(PROMPT, SamplingParams(n=2))
    assert_no_leaks(llm.engine)


# ----------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(clip_llama: str, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(clip_llama, "--served-model-name", "tiny", "--max-model-len", "256",
                 log=tmp_path_factory.mktemp("n") / "server.log")
    yield srv
    srv.stop()


def test_chat_returns_n_choices_streamed_and_not(server: Server, llm: LLM) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = image_message("what is in this picture, in some detail?",
                             data_url(make_image(1, (48, 40))))
    resp = client.chat.completions.create(model="tiny", messages=messages, n=3, max_tokens=10,
                                          temperature=1.0, seed=11)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    texts = [c.message.content for c in resp.choices]
    expected = llm.generate({"messages": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "what is in this picture, in some detail?"}]}],
        "images": [make_image(1, (48, 40))]},
        SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=11))[0]
    assert texts == [c.text for c in expected.outputs]
    # Usage as OpenAI counts it: the prompt once, every choice's tokens.
    assert resp.usage.prompt_tokens == expected.num_prompt_tokens
    assert resp.usage.completion_tokens == sum(len(c.token_ids) for c in expected.outputs)
    stream = client.chat.completions.create(model="tiny", messages=messages, n=3,
                                            max_tokens=10, temperature=1.0, seed=11,
                                            stream=True, stream_options={"include_usage": True})
    streamed, reasons, usage = ["", "", ""], [None] * 3, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert streamed == texts and reasons == ["length"] * 3
    assert usage.completion_tokens == resp.usage.completion_tokens


def test_completions_return_n_per_prompt_in_order(server: Server) -> None:
    body = {"model": "tiny", "prompt": ["USER: one\nASSISTANT:", "USER: two\nASSISTANT:"],
            "n": 2, "max_tokens": 5, "temperature": 0}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in resp["choices"]]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: each prompt's answer twice
    single = httpx.post(f"{server.url}/v1/completions", json={**body, "n": 1},
                        timeout=60).json()
    assert [c["text"] for c in single["choices"]] == [texts[0], texts[2]]
    assert resp["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert resp["usage"]["completion_tokens"] == 2 * single["usage"]["completion_tokens"]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = ["", "", "", ""]
    for event in events:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == texts
    stats = httpx.get(f"{server.url}/stats").json()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
