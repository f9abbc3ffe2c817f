"""Soak through a real socket: 300 mixed requests from 4 concurrent clients leave the server
healthy, exact and clean.

A quarter of the requests are hostile (numbers out of range, invalid Unicode, malformed URLs
and JSON, bodies with 300,000 stop strings, broken images), a quarter are streams whose client
hangs up after a few events, and the rest are normal greedy requests, half of them streamed,
over a fixed set of prompts with zero to two images. The soak shows that under that mix:

- every hostile request gets a 4xx with OpenAI's error body (never a 5xx or a dropped
  connection), and none of them reaches an engine step (``num_failed_requests`` stays 0);
- every normal request, whatever it is batched with, returns exactly the greedy text the same
  prompt gets when it runs alone;
- ``/health``, polled throughout, always answers 200;
- afterwards every KV block is free and no encoder-cache entry is referenced (the hung-up
  streams were aborted and released).
"""

from __future__ import annotations

import base64
import io
import json
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_image
from tests.test_server import Server, data_url, image_message, metric, wait_drained

SEED = 1234
NUM_REQUESTS = 300
NUM_CLIENTS = 4
MAX_MODEL_LEN = 128
HEALTH_INTERVAL_S = 0.2
MODEL = "tiny"
IMAGES = [make_image(seed, size) for seed, size in
          enumerate([(40, 30), (64, 64), (23, 57), (32, 32)])]
FILE_IMAGE = make_image(7, (48, 40))


def _png(image_seed: int, size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    make_image(image_seed, size).save(buf, "PNG")
    return buf.getvalue()


def _chat(**extra: object) -> dict:
    return {"model": MODEL, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            **extra}


def _with_url(url: str) -> dict:
    return _chat(messages=image_message("what is this?", url))


def _raw(body: dict, tail: str = "") -> bytes:
    """``body`` as JSON text, with ``tail`` (raw JSON members) spliced in before the last brace.
    ``json.dumps`` writes a lone surrogate as its ``\\ud800`` escape, as a hostile client would.
    """
    text = json.dumps(body)
    return (text[:-1] + tail + "}").encode()


_NO_MAX_TOKENS = {k: v for k, v in _chat().items() if k != "max_tokens"}
# Name -> the request body as bytes. Each must be refused at the door with a 4xx.
BAD_INPUTS: dict[str, bytes] = {
    "temperature 1e-300": _raw(_chat(temperature=1e-300)),
    "temperature 1e-45": _raw(_chat(temperature=1e-45)),
    "seed 2**64": _raw(_chat(seed=2**64)),
    "seed -(2**63)-1": _raw(_chat(seed=-(2**63) - 1)),
    "5000-digit max_tokens": _raw(_NO_MAX_TOKENS, ', "max_tokens": ' + "9" * 5000),
    "lone surrogate in text": _raw(_chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a\ud800b"}]}])),
    "<image> typed in text": _raw(_chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "look: <image> what is it?"}]}])),
    "invalid IPv6 URL": _raw(_with_url("http://[::1/a.png")),
    "NUL in a file URL": _raw(_with_url("file:///tmp/a%00b.png")),
    "300,000 stop strings": _raw(_chat(stop=["x"] * 300_000)),
    "truncated PNG": _raw(_with_url(
        "data:image/png;base64," + base64.b64encode(_png(1, (64, 64))[:150]).decode())),
    "non-image data URL": _raw(_with_url("data:text/plain;base64,aGk=")),
    "max_tokens > max_model_len": _raw(_chat(max_tokens=MAX_MODEL_LEN + 1)),
    "n=129": _raw(_chat(n=129)),
    "JSON schema that does not compile": _raw(_chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})),
    "regex that does not compile": _raw(_chat(guided_regex="([a-z")),
    "unknown role": _raw(_chat(messages=[{"role": "robot", "content": "hi"}])),
    "malformed JSON": b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"',
}


@dataclass(frozen=True)
class Prompt:
    """A normal request: its text, image URLs and greedy max_tokens."""

    text: str
    urls: tuple[str, ...]
    max_tokens: int

    def body(self, **extra: object) -> dict:
        return {"model": MODEL, "messages": image_message(self.text, *self.urls),
                "max_tokens": self.max_tokens, "temperature": 0, **extra}


@dataclass(frozen=True)
class Job:
    """One soak request: ``kind`` is "bad", "disconnect" or "normal"."""

    kind: str
    bad_input: str = ""
    prompt: int = 0
    stream: bool = False
    events_before_hangup: int = 0


@dataclass
class Tally:
    """What the clients saw; shared by the client threads under ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    normal_ok: int = 0
    refused: Counter = field(default_factory=Counter)  # status code -> count
    disconnected: int = 0
    failures: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        with self.lock:
            self.failures.append(message)


def make_plan(rng: random.Random, num_prompts: int) -> list[Job]:
    """A quarter bad inputs (each at least once), a quarter hang-ups, the rest normal requests
    over every prompt, exactly half of them streamed; shuffled."""
    num_bad = num_disconnect = NUM_REQUESTS // 4
    num_normal = NUM_REQUESTS - num_bad - num_disconnect
    names = list(BAD_INPUTS)
    bad = names + rng.choices(names, k=num_bad - len(names))
    prompts = list(range(num_prompts)) * (num_normal // num_prompts)
    prompts += rng.choices(range(num_prompts), k=num_normal - len(prompts))
    rng.shuffle(prompts)  # before alternating streamed and plain, so each prompt gets both
    jobs = [Job("bad", bad_input=name) for name in bad]
    jobs += [Job("disconnect", prompt=rng.randrange(num_prompts),
                 events_before_hangup=rng.choice((2, 3))) for _ in range(num_disconnect)]
    jobs += [Job("normal", prompt=p, stream=i % 2 == 0) for i, p in enumerate(prompts)]
    rng.shuffle(jobs)
    return jobs


def _sse_data(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data:"):
            yield line[5:].strip()


def run_job(http: httpx.Client, job: Job, prompts: list[Prompt], expected: list[str],
            tally: Tally) -> None:
    if job.kind == "bad":
        resp = http.post("/v1/chat/completions", content=BAD_INPUTS[job.bad_input],
                         headers={"Content-Type": "application/json"})
        try:
            error = resp.json()["error"]
            well_formed = set(error) == {"message", "type", "param", "code"}
        except (ValueError, KeyError, TypeError):
            well_formed = False
        if not 400 <= resp.status_code < 500 or not well_formed:
            tally.fail(f"bad input {job.bad_input!r}: {resp.status_code} {resp.text[:200]}")
            return
        with tally.lock:
            tally.refused[resp.status_code] += 1
    elif job.kind == "disconnect":
        body = prompts[job.prompt].body(max_tokens=24, ignore_eos=True, stream=True)
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                tally.fail(f"hang-up stream: {resp.status_code} {resp.read()[:200]!r}")
                return
            events = 0
            for _ in _sse_data(resp.iter_lines()):
                events += 1
                if events == job.events_before_hangup:
                    break
        # Leaving the block with the body unread closed the connection mid-stream.
        if events != job.events_before_hangup:
            tally.fail(f"hang-up stream ended after {events} events")
            return
        with tally.lock:
            tally.disconnected += 1
    else:
        body = prompts[job.prompt].body(stream=job.stream)
        if job.stream:
            with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    tally.fail(f"normal stream: {resp.status_code} {resp.read()[:200]!r}")
                    return
                data = list(_sse_data(resp.iter_lines()))
            if not data or data[-1] != "[DONE]":
                tally.fail(f"prompt {job.prompt} streamed: no [DONE] in {data[-2:]}")
                return
            text = "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                           for d in data[:-1])
        else:
            resp = http.post("/v1/chat/completions", json=body)
            if resp.status_code != 200:
                tally.fail(f"normal request: {resp.status_code} {resp.text[:200]}")
                return
            text = resp.json()["choices"][0]["message"]["content"]
        if text != expected[job.prompt]:
            tally.fail(f"prompt {job.prompt} (stream={job.stream}): {text!r} "
                       f"!= {expected[job.prompt]!r}")
            return
        with tally.lock:
            tally.normal_ok += 1


def client_loop(url: str, jobs: queue.Queue[Job], prompts: list[Prompt], expected: list[str],
                tally: Tally) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        while True:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                run_job(http, job, prompts, expected, tally)
            except (httpx.HTTPError, ValueError, KeyError) as e:  # dropped, or not the API
                tally.fail(f"{job}: {type(e).__name__}: {e}")


def poll_health(url: str, stop: threading.Event, statuses: Counter) -> None:
    with httpx.Client(base_url=url, timeout=5) as http:
        while not stop.is_set():
            try:
                statuses[http.get("/health").status_code] += 1
            except httpx.HTTPError as e:
                statuses[type(e).__name__] += 1
            stop.wait(HEALTH_INTERVAL_S)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("soak-media")
    FILE_IMAGE.save(root / "scene.png")
    return root


@pytest.fixture(scope="module")
def server(clip_llama: str, media_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("soak") / "server.log"
    srv = Server(clip_llama, "--served-model-name", MODEL,
                 "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
                 "--allowed-local-media-path", str(media_dir), log=log)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_soak(server: Server, media_dir: Path) -> None:
    urls = [data_url(im) for im in IMAGES]
    file_url = f"file://{media_dir}/scene.png"
    prompts = [Prompt("hello there", (), 8),
               Prompt("what is in this picture?", (urls[0],), 10),
               Prompt("describe the colours", (urls[1],), 12),
               Prompt("what is in this file?", (file_url,), 9),
               Prompt("compare these two", (urls[0], urls[2]), 11),
               Prompt("which one is brighter?", (urls[3], file_url), 12)]
    expected = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for prompt in prompts:  # alone, one at a time: the reference text
            resp = http.post("/v1/chat/completions", json=prompt.body())
            assert resp.status_code == 200, resp.text
            expected.append(resp.json()["choices"][0]["message"]["content"])
    aborts_before = metric(httpx.get(f"{server.url}/metrics").text, "mmserve_requests_total",
                           status="abort")

    jobs: queue.Queue[Job] = queue.Queue()
    for job in make_plan(random.Random(SEED), len(prompts)):
        jobs.put(job)
    tally = Tally()
    health: Counter = Counter()
    stop = threading.Event()
    poller = threading.Thread(target=poll_health, args=(server.url, stop, health))
    clients = [threading.Thread(target=client_loop,
                                args=(server.url, jobs, prompts, expected, tally))
               for _ in range(NUM_CLIENTS)]
    t0 = time.monotonic()
    poller.start()
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    wall = time.monotonic() - t0
    stop.set()
    poller.join()

    stats = wait_drained(server.url)
    aborts = metric(httpx.get(f"{server.url}/metrics").text, "mmserve_requests_total",
                    status="abort") - aborts_before
    print(f"\nsoak: {NUM_REQUESTS} requests in {wall:.1f} s from {NUM_CLIENTS} clients: "
          f"{tally.normal_ok} normal ok, bad refused {dict(sorted(tally.refused.items()))}, "
          f"{tally.disconnected} disconnected ({aborts:.0f} aborted by the server), "
          f"health {dict(health)}, {len(tally.failures)} failures")
    failures = Counter(tally.failures)
    assert not failures, "\n".join(f"{n} x {msg}" for msg, n in failures.most_common())
    assert set(health) == {200}, health
    assert health[200] >= wall / HEALTH_INTERVAL_S / 2  # polled throughout, not once
    assert tally.normal_ok + sum(tally.refused.values()) + tally.disconnected == NUM_REQUESTS
    assert stats["num_failed_requests"] == 0, stats
