"""The OpenAI-compatible server through a real socket: uvicorn in a subprocess on a loopback
port, the official ``openai`` client, the tiny clip-llama checkpoint in float32.

One server serves the whole module; tests leave it drained (no request in flight, every KV
block free) for the next one.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from mmserve import LLM, SamplingParams
from tests.conftest import make_image

IMAGES = [make_image(i, size) for i, size in enumerate([(40, 30), (64, 64), (23, 57), (32, 32)])]


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}[fmt]
    return f"data:image/{mime};base64,{base64.b64encode(buf.getvalue()).decode()}"


def image_message(text: str, *urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


class Server:
    """``mmserve serve`` in a subprocess; ``url`` is its base URL once /health answers."""

    def __init__(self, model: str, *args: str, log: Path, env: dict | None = None,
                 launcher: tuple[str, ...] = ("-m", "mmserve.entrypoints.cli"),
                 verify: str | None = None) -> None:
        """``verify``: the certificate of a server started for HTTPS (its URL is then
        https)."""
        with socket.socket() as s:  # a free loopback port
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"{'https' if verify else 'http'}://127.0.0.1:{self.port}"
        self.verify = ssl.create_default_context(cafile=verify) if verify else True
        self.log = log
        cmd = [sys.executable, *launcher, "serve", model, "--host",
               "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
               "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited early:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1,
                             verify=self.verify).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not come up:\n{self.log.read_text()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def wait_drained(url: str, headers: dict | None = None, timeout: float = 15.0,
                 verify: ssl.SSLContext | bool = True) -> dict:
    """Poll /stats until nothing is in flight and every KV block is free; returns the stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{url}/stats", headers=headers, verify=verify).json()
        if (stats["num_in_flight"] == 0 and stats["num_running"] == 0
                and stats["num_waiting"] == 0
                and stats["kv_blocks_free"] == stats["kv_blocks_total"]
                and stats["encoder_cache_referenced_entries"] == 0):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine did not drain: {stats}")
        time.sleep(0.05)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


@pytest.fixture(scope="module")
def server(clip_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = Server(clip_llama, "--served-model-name", "tiny-llava", log=log)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-llava"]
    assert client.models.retrieve("tiny-llava").model_dump() == models.data[0].model_dump()
    for other in ("llava", "tiny-llava/x", "org/tiny-llava"):
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(other)
        assert e.value.body["code"] == "model_not_found" and other in e.value.body["message"]


def test_chat_equals_llm_generate(client: openai.OpenAI, clip_llama: str,
                                  server: Server) -> None:
    """Greedy text over HTTP (plain and streamed) equals ``LLM.generate`` on the same input."""
    prompts = [("what is in this picture?", [IMAGES[0]]),
               ("compare these two", [IMAGES[1], IMAGES[2]]),
               ("hello there", [])]
    llm = LLM(clip_llama, dtype="float32")
    for text, images in prompts:
        expected = llm.generate(
            {"messages": [{"role": "user", "content": [{"type": "image"}] * len(images)
                           + [{"type": "text", "text": text}]}], "images": images},
            SamplingParams(max_tokens=12, temperature=0.0))[0]
        messages = image_message(text, *[data_url(im) for im in images])

        plain = client.chat.completions.create(model="tiny-llava", messages=messages,
                                               max_tokens=12, temperature=0)
        assert plain.object == "chat.completion"
        assert plain.choices[0].message.role == "assistant"
        assert plain.choices[0].message.content == expected.text
        assert plain.choices[0].finish_reason == expected.finish_reason
        # Image placeholder tokens count as prompt tokens.
        assert plain.usage.prompt_tokens == expected.num_prompt_tokens
        assert plain.usage.prompt_tokens > 16 * len(images)
        assert plain.usage.completion_tokens == len(expected.token_ids)
        assert plain.usage.total_tokens == expected.num_prompt_tokens + len(expected.token_ids)

        chunks = list(client.chat.completions.create(
            model="tiny-llava", messages=messages, max_completion_tokens=12, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert len({c.id for c in chunks}) == 1
        assert chunks[0].choices[0].delta.role == "assistant"
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == expected.text
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] == expected.finish_reason and not any(reasons[:-1])
        assert chunks[-1].choices == []
        assert chunks[-1].usage.prompt_tokens == expected.num_prompt_tokens
        assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
        # The same prompt just ran: every full block but the one holding the last prompt
        # token (always recomputed) comes from the prefix cache.
        cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
        assert cached == (expected.num_prompt_tokens - 1) // 16 * 16
        assert all(c.usage is None for c in chunks[:-1])
    wait_drained(server.url)


def test_penalties_and_logit_bias_over_http_equal_the_python_api(
        client: openai.OpenAI, clip_llama: str, server: Server) -> None:
    """OpenAI's penalties and logit_bias, and vLLM's repetition_penalty, min_p and
    min_tokens (in ``extra_body``, as vLLM's users send them), reach the engine; a token id
    past the vocabulary is a 400 naming logit_bias."""
    fields = {"presence_penalty": 0.8, "frequency_penalty": 0.4, "logit_bias": {"17": 3.0}}
    extra = {"repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 10}
    prompt = {"messages": [{"role": "user", "content": [{"type": "text",
                                                         "text": "hello there"}]}]}
    with LLM(clip_llama, dtype="float32") as llm:
        expected = llm.generate(prompt, SamplingParams(
            max_tokens=12, temperature=0.0, presence_penalty=0.8, frequency_penalty=0.4,
            logit_bias={17: 3.0}, repetition_penalty=1.3, min_p=0.05, min_tokens=10))[0]
        plain = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))[0]
        forced_text = llm.engine.processor.tokenizer.decode([17] * 4)
    assert expected.token_ids != plain.token_ids
    answer = client.chat.completions.create(
        model="tiny-llava", messages=image_message("hello there"), max_tokens=12,
        temperature=0, extra_body=extra, **fields)
    assert answer.choices[0].message.content == expected.text
    assert answer.usage.completion_tokens == len(expected.token_ids)
    forced = client.completions.create(model="tiny-llava", prompt="hi", max_tokens=4,
                                       temperature=0, logit_bias={"17": 100})
    assert forced.choices[0].text == forced_text
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llava", messages=image_message("hi"),
                                       max_tokens=2, logit_bias={"1000000": 1})
    assert e.value.body["param"] == "logit_bias" and "vocabulary" in e.value.body["message"]
    wait_drained(server.url)


def test_logprobs_over_http_equal_the_python_api(client: openai.OpenAI, clip_llama: str,
                                                 server: Server) -> None:
    """``logprobs`` / ``top_logprobs`` in OpenAI's shapes (plain and streamed), the values
    the Python API gives; bad settings are 400s that name the parameter."""
    llm = LLM(clip_llama, dtype="float32")
    tokenizer = llm.engine.processor.tokenizer
    expected = llm.generate(
        {"messages": [{"role": "user", "content": [{"type": "image"},
                                                   {"type": "text", "text": "describe it"}]}],
         "images": [IMAGES[1]]},
        SamplingParams(max_tokens=10, temperature=0.0, logprobs=3))[0]
    messages = image_message("describe it", data_url(IMAGES[1]))

    def check(content) -> None:
        assert len(content) == len(expected.token_ids)
        for item, token, entry in zip(content, expected.token_ids, expected.logprobs,
                                      strict=True):
            assert item.token == tokenizer.decode([token])
            assert item.bytes == list(item.token.encode("utf-8"))
            assert item.logprob == pytest.approx(entry.logprob, abs=1e-5)
            assert [t.token for t in item.top_logprobs] == [tokenizer.decode([t])
                                                            for t, _ in entry.top]
            assert [t.logprob for t in item.top_logprobs] == pytest.approx(
                [v for _, v in entry.top], abs=1e-5)

    plain = client.chat.completions.create(model="tiny-llava", messages=messages,
                                           max_tokens=10, temperature=0, logprobs=True,
                                           top_logprobs=3)
    assert plain.choices[0].message.content == expected.text
    check(plain.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(
        model="tiny-llava", messages=messages, max_tokens=10, temperature=0, logprobs=True,
        top_logprobs=3, stream=True))
    check([item for c in chunks if c.choices and c.choices[0].logprobs
           for item in c.choices[0].logprobs.content])
    # Without top_logprobs: the tokens' own, no alternatives; without logprobs: none at all.
    only = client.chat.completions.create(model="tiny-llava", messages=messages,
                                          max_tokens=10, temperature=0, logprobs=True)
    assert all(item.top_logprobs == [] for item in only.choices[0].logprobs.content)
    none = client.chat.completions.create(model="tiny-llava", messages=messages,
                                          max_tokens=10, temperature=0)
    assert none.choices[0].logprobs is None
    for extra, param in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"top_logprobs": 2}, "top_logprobs"),
                         ({"logprobs": "yes"}, "logprobs")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-llava", messages=messages,
                                           max_tokens=4, **extra)
        assert e.value.body["param"] == param
    wait_drained(server.url)


def test_streamed_pieces_add_up_to_the_whole_answer(client: openai.OpenAI,
                                                    server: Server) -> None:
    """The engine hands the server each step's additions only (``output_kind`` delta): text
    held back for a stop string, the tokens' log-probabilities and the usage still come out
    as the whole answer does, for two choices at once."""
    messages = image_message("describe it", data_url(IMAGES[1]))
    args = dict(model="tiny-llava", messages=messages, max_tokens=12, temperature=0,
                logprobs=True, top_logprobs=2, n=2, stop=["\x00never"])
    plain = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True,
                                                 stream_options={"include_usage": True}))
    for index in range(2):
        parts = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        whole = plain.choices[index]
        assert "".join(p.delta.content or "" for p in parts) == whole.message.content
        streamed = [item for p in parts if p.logprobs for item in p.logprobs.content]
        assert [(i.token, i.logprob) for i in streamed] == [
            (i.token, i.logprob) for i in whole.logprobs.content]
        assert len(streamed) == 12
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == 24
    wait_drained(server.url)


def test_completions_endpoint(client: openai.OpenAI, clip_llama: str, server: Server) -> None:
    """``/v1/completions``: a string, token ids, or a list of either, each prompt a choice in
    order, equal to the Python API; streamed per prompt; logprobs in the endpoint's shape;
    what it does not take refused with a 400 naming the parameter, and the server serves on."""
    llm = LLM(clip_llama, dtype="float32")
    tokenizer = llm.engine.processor.tokenizer
    texts = ["USER: tell me about the river\nASSISTANT:", "USER: hi\nASSISTANT:"]
    params = SamplingParams(max_tokens=9, temperature=0.0, logprobs=2)
    expected = llm.generate(texts, params)

    one = client.completions.create(model="tiny-llava", prompt=texts[0], max_tokens=9,
                                    temperature=0, logprobs=2)
    assert one.object == "text_completion" and len(one.choices) == 1
    choice, want = one.choices[0], expected[0]
    assert (choice.index, choice.text, choice.finish_reason) == (0, want.text,
                                                                 want.finish_reason)
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in want.token_ids]
    assert choice.logprobs.token_logprobs == pytest.approx([e.logprob for e in want.logprobs],
                                                           abs=1e-5)
    for got, entry in zip(choice.logprobs.top_logprobs, want.logprobs, strict=True):
        top = {tokenizer.decode([t]): v for t, v in entry.top}  # the endpoint's dict shape
        assert got.keys() == top.keys()
        assert list(got.values()) == pytest.approx(list(top.values()), abs=1e-5)
    lengths = [len(t) for t in choice.logprobs.tokens]
    assert choice.logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    assert one.usage.prompt_tokens == want.num_prompt_tokens
    assert one.usage.completion_tokens == len(want.token_ids)

    # Token ids are the same prompt as the text they tokenize to; a list gives a choice each.
    ids = tokenizer(texts[1])["input_ids"]
    many = client.completions.create(model="tiny-llava", prompt=[texts[0], ids], max_tokens=9,
                                     temperature=0)
    assert [(c.index, c.text) for c in many.choices] == [(0, expected[0].text),
                                                         (1, expected[1].text)]
    assert all(c.logprobs is None for c in many.choices)
    assert many.usage.prompt_tokens == sum(o.num_prompt_tokens for o in expected)
    assert many.usage.completion_tokens == sum(len(o.token_ids) for o in expected)

    chunks = list(client.completions.create(
        model="tiny-llava", prompt=texts, max_tokens=9, temperature=0, logprobs=2, stream=True,
        stream_options={"include_usage": True}))
    for i, want in enumerate(expected):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == want.text
        assert [c.finish_reason for c in mine][-1] == want.finish_reason
        streamed = [lp for c in mine if c.logprobs for lp in c.logprobs.token_logprobs]
        assert streamed == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
        offsets = [o for c in mine if c.logprobs for o in c.logprobs.text_offset]
        assert offsets == sorted(offsets) and offsets[:1] == [0]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == sum(len(o.token_ids) for o in expected)

    vocab = len(tokenizer)
    image_token = llm.engine.processor.image_token
    for extra, param in [({"prompt": "hi", "echo": 1}, "echo"),
                         ({"prompt": "hi", "suffix": "end"}, "suffix"),
                         ({"prompt": "hi", "best_of": 3}, "best_of"),
                         ({"prompt": "hi", "logprobs": 21}, "logprobs"),
                         ({"prompt": "hi", "n": 129}, "n"),
                         ({"prompt": ["hi"] * 65, "n": 4}, "n"),
                         ({"prompt": [], }, "prompt"),
                         ({"prompt": ["hi", 3]}, "prompt[1]"),
                         ({"prompt": ["x"] * 257}, "prompt"),
                         ({"prompt": [5, vocab]}, "prompt"),
                         ({"prompt": f"USER: {image_token} what?"}, "prompt")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny-llava", max_tokens=4, **extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
    refused = httpx.post(f"{server.url}/v1/completions", json={
        "model": "tiny-llava", "prompt": "hi", "images": [data_url(IMAGES[0])]})
    assert refused.status_code == 400
    assert "/v1/chat/completions" in refused.json()["error"]["message"]
    assert client.completions.create(model="tiny-llava", prompt="hi", max_tokens=2).choices
    wait_drained(server.url)


def test_string_content_and_jpeg(client: openai.OpenAI) -> None:
    """A system message with string content, and JPEG / GIF / WebP data URLs."""
    for fmt in ("JPEG", "GIF", "WEBP"):
        resp = client.chat.completions.create(
            model="tiny-llava", max_tokens=3, temperature=0,
            messages=[{"role": "system", "content": "be brief"},
                      *image_message("what?", data_url(IMAGES[3], fmt))])
        assert resp.usage.completion_tokens >= 1, fmt


def test_32_concurrent_streams_with_images(server: Server) -> None:
    """32 streamed requests with images at once all finish, and /metrics counts them."""
    before = httpx.get(f"{server.url}/metrics").text
    urls = [data_url(im) for im in IMAGES]

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        stream = await client.chat.completions.create(
            model="tiny-llava", messages=image_message(f"request {i}", urls[i % len(urls)]),
            max_tokens=6 + i % 5, temperature=0, stream=True,
            stream_options={"include_usage": True})
        text, reason, completion = "", None, -1
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage is not None:
                completion = chunk.usage.completion_tokens
        return text, reason, completion

    async def run() -> list[tuple[str, str | None, int]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                      max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    start = time.monotonic()
    results = asyncio.run(run())
    assert all(reason in ("stop", "length") for _, reason, _ in results), results
    assert all(completion >= 1 for _, _, completion in results), results
    stats = wait_drained(server.url)
    elapsed = time.monotonic() - start
    assert stats["encoder_cache_hits"] > 0  # four distinct images among 32 requests

    after = httpx.get(f"{server.url}/metrics").text

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    finished = sum(delta("mmserve_requests_total", status=s) for s in ("stop", "length"))
    assert finished == 32
    generated = delta("mmserve_generation_tokens_total")
    assert generated == sum(c for _, _, c in results)
    assert delta("mmserve_time_to_first_token_seconds_count") == 32
    assert delta("mmserve_inter_token_latency_seconds_count") == generated - 32
    # The engine's steps: their wall time within the run's, and every token they computed:
    # the prompts less prefix-cache hits, then each generated token but the last (more where
    # a preempted request recomputed its tokens).
    assert delta("mmserve_engine_steps_total") >= max(c for _, _, c in results)
    assert 0 < delta("mmserve_engine_step_seconds_total") <= elapsed
    computed = (delta("mmserve_prompt_tokens_total")
                - delta("mmserve_prefix_cache_hit_tokens_total") + generated - 32)
    if delta("mmserve_num_preemptions_total") == 0:
        assert delta("mmserve_scheduled_tokens_total") == computed
    else:
        assert delta("mmserve_scheduled_tokens_total") > computed
    for name in ("mmserve_num_requests_running", "mmserve_num_requests_waiting",
                 "mmserve_kv_cache_usage_perc", "mmserve_encoder_cache_usage_perc",
                 "mmserve_encoder_cache_hits_total", "mmserve_encoder_cache_misses_total",
                 "mmserve_encoder_cache_evictions_total", "mmserve_num_preemptions_total",
                 "mmserve_encoder_cache_borrowed_entries", "mmserve_encoder_cache_borrowed_bytes",
                 "mmserve_encoder_cache_reserve_tokens", "mmserve_encoder_cache_hit_rate",
                 "mmserve_prompt_tokens_total"):
        assert re.search(rf"^{name}{{", after, re.M), name
    for reason in ("capacity", "kv_pressure"):
        assert re.search(rf'^mmserve_encoder_cache_evictions_total{{.*reason="{reason}"', after,
                         re.M), reason
    # The same under vLLM's names, for dashboards and autoscalers written for vLLM.
    assert sum(delta("vllm:request_success_total", finished_reason=r)
               for r in ("stop", "length")) == 32
    assert delta("vllm:generation_tokens_total") == generated
    assert delta("vllm:prompt_tokens_total") == delta("mmserve_prompt_tokens_total") > 0
    assert delta("vllm:request_prompt_tokens_sum") == delta("mmserve_prompt_tokens_total")
    assert delta("vllm:request_generation_tokens_sum") == generated
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_prompt_tokens_count"):
        assert delta(name) == 32, name
    assert delta("vllm:inter_token_latency_seconds_count") == generated - 32
    assert 0 < delta("vllm:e2e_request_latency_seconds_sum") <= 32 * elapsed
    for ours, theirs in (("mmserve_num_preemptions_total", "vllm:num_preemptions_total"),
                         ("mmserve_prefix_cache_hit_tokens_total", "vllm:prefix_cache_hits_total"),
                         ("mmserve_prefix_cache_queried_tokens_total",
                          "vllm:prefix_cache_queries_total"),
                         ("mmserve_kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
                         ("mmserve_num_requests_running", "vllm:num_requests_running"),
                         ("mmserve_num_requests_waiting", "vllm:num_requests_waiting")):
        assert re.search(rf"^{theirs}{{", after, re.M), theirs
        assert metric(after, theirs) == metric(after, ours), theirs


def _long_request(stream: bool) -> dict:
    return {"model": "tiny-llava", "messages": image_message("go on", data_url(IMAGES[0])),
            "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": stream}


def test_stream_disconnect_aborts_and_frees_blocks(server: Server) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/chat/completions",
                         json=_long_request(stream=True)) as resp:
            assert resp.status_code == 200
            events: list[dict] = []
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                if len(events) == 4:
                    break
        # Leaving the block closed the connection mid-stream.
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    stats = wait_drained(server.url)
    after = httpx.get(f"{server.url}/metrics").text
    assert (metric(after, "mmserve_requests_total", status="abort")
            - metric(before, "mmserve_requests_total", status="abort")) == 1
    # Aborted long before its 1500 tokens.
    generated = (metric(after, "mmserve_generation_tokens_total")
                 - metric(before, "mmserve_generation_tokens_total"))
    assert 3 <= generated < 1500, generated
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_non_streaming_disconnect_aborts(server: Server) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=_long_request(stream=False),
                   timeout=0.5)
    wait_drained(server.url)
    after = httpx.get(f"{server.url}/metrics").text
    assert (metric(after, "mmserve_requests_total", status="abort")
            - metric(before, "mmserve_requests_total", status="abort")) == 1


def test_sigterm_drains_in_flight_requests(server: Server) -> None:
    """Runs last: it stops the module's server. SIGTERM lets the open stream finish."""
    body = {"model": "tiny-llava", "messages": image_message("go", data_url(IMAGES[1])),
            "max_tokens": 100, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data:")
        server.proc.send_signal(signal.SIGTERM)
        events = [line[5:].strip() for line in lines if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content") is not None) > 50
    # A clean shutdown: status 0, and no traceback (uvicorn raises the signal again once it
    # has shut down; the server turns that into a quiet return). Nor any in the module's
    # run before it (a disconnected client's cancelled wait logged one).
    assert server.proc.wait(30) == 0
    log = server.log.read_text()
    assert "Traceback" not in log, log[-4000:]
    with pytest.raises(httpx.TransportError):  # no longer listening
        httpx.get(f"{server.url}/health", timeout=2)
