"""The background engine loop with a scripted stand-in engine: ordering, aborts, the queue bound,
bad input and a crashing step, in milliseconds and without a model."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from mmserve.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from mmserve.engine.request import Request
from mmserve.outputs import RequestOutput
from mmserve.processing.images import InvalidInputError
from mmserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class _Config:
    max_num_seqs: int


class FakeEngine:
    """Each request yields ``max_tokens`` tokens, one per step; "bad" prompts are refused."""

    def __init__(self, max_num_seqs: int = 2, crash_at_step: int | None = None) -> None:
        self.config = _Config(max_num_seqs)
        self.crash_at_step = crash_at_step
        self.live: dict[str, list[int]] = {}  # id -> [generated, max_tokens]
        self.aborted: list[str] = []
        self.steps = 0
        self.thread_ids: set[int] = set()

    def process_request(self, prompt: Any, params: SamplingParams, request_id: str) -> Request:
        if prompt == "bad":
            raise InvalidInputError("the prompt is bad; send a good one", param="messages")
        return Request(request_id, [1, 2, 3], params)

    def add_processed_request(self, req: Request) -> str:
        self.thread_ids.add(threading.get_ident())
        self.live[req.request_id] = [0, req.sampling_params.max_tokens]
        return req.request_id

    def abort_request(self, request_id: str) -> None:
        self.thread_ids.add(threading.get_ident())
        if self.live.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> list[RequestOutput]:
        # A real step takes milliseconds; one that takes none floods the event loop with
        # outputs (whose token lists grow every step) faster than anything can read them.
        time.sleep(0.001)
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        if self.steps == self.crash_at_step:
            raise RuntimeError("boom")
        outputs = []
        for rid, state in list(self.live.items()):
            state[0] += 1
            done = state[0] == state[1]
            outputs.append(RequestOutput(rid, "x" * state[0], list(range(state[0])), 5,
                                         finished=done, finish_reason="length" if done else None,
                                         new_text="x"))
            if done:
                del self.live[rid]
        return outputs

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.live), "num_steps": self.steps}

    def check_health(self) -> None:
        """Healthy (the loop asks while it waits for requests)."""


class Recorder:
    def __init__(self) -> None:
        self.first, self.next, self.finished = 0, 0, []

    def on_first_token(self, seconds: float) -> None:
        self.first += 1

    def on_next_token(self, seconds: float) -> None:
        self.next += 1

    def on_finished(self, reason: str, prompt: int, generated: int, seconds: float) -> None:
        self.finished.append((reason, prompt, generated))


def run(coro) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=10))


def test_streams_in_order_off_the_event_loop() -> None:
    fake, recorder = FakeEngine(), Recorder()

    async def main() -> list[list[int]]:
        engine = AsyncEngine(fake, observer=recorder)
        engine.start()

        async def one(rid: str, n: int) -> list[int]:
            stream = await engine.add_request(rid, "ok", SamplingParams(max_tokens=n))
            return [len(out.token_ids) async for out in stream]

        got = await asyncio.gather(one("a", 3), one("b", 5))
        await engine.shutdown()
        assert not engine.is_alive
        return got

    assert run(main()) == [[1, 2, 3], [1, 2, 3, 4, 5]]
    assert fake.thread_ids and threading.get_ident() not in fake.thread_ids
    assert recorder.first == 2 and recorder.next == 6
    assert sorted(recorder.finished) == [("length", 5, 3), ("length", 5, 5)]


def test_bad_input_raises_and_the_loop_keeps_serving() -> None:
    async def main() -> None:
        engine = AsyncEngine(FakeEngine())
        engine.start()
        with pytest.raises(InvalidInputError, match="send a good one"):
            await engine.add_request("r1", "bad", SamplingParams())
        stream = await engine.add_request("r2", "ok", SamplingParams(max_tokens=2))
        assert [o.finished async for o in stream] == [False, True]
        assert engine.num_in_flight == 0
        await engine.shutdown()

    run(main())


def test_abort_reaches_the_engine() -> None:
    fake, recorder = FakeEngine(), Recorder()

    async def main() -> None:
        engine = AsyncEngine(fake, observer=recorder)
        engine.start()
        stream = await engine.add_request("r", "ok", SamplingParams(max_tokens=10_000))
        async for out in stream:
            if len(out.token_ids) == 3:
                break
        engine.abort("r")
        engine.abort("r")  # twice is harmless
        while fake.live:
            await asyncio.sleep(0.01)
        await engine.shutdown()

    run(main())
    assert fake.aborted == ["r"]
    assert recorder.finished[0][0] == "abort" and recorder.finished[0][2] >= 3


def test_queue_bound_counts_requests_beyond_max_num_seqs() -> None:
    fake = FakeEngine(max_num_seqs=2)

    async def main() -> None:
        engine = AsyncEngine(fake, max_waiting=1)
        engine.start()
        params = SamplingParams(max_tokens=1_000_000)  # none finishes during the test
        for i in range(3):
            await engine.add_request(f"r{i}", "ok", params)
        assert not engine.has_room()
        with pytest.raises(QueueFullError, match="1 requests are already waiting"):
            await engine.add_request("r3", "ok", params)
        engine.abort("r0")
        assert engine.has_room()
        await engine.add_request("r4", "ok", params)
        for rid in ("r1", "r2", "r4"):
            engine.abort(rid)
        await engine.shutdown()

    run(main())
    assert sorted(fake.aborted) == ["r0", "r1", "r2", "r4"]


def test_a_crashing_step_fails_in_flight_requests() -> None:
    async def main() -> None:
        engine = AsyncEngine(FakeEngine(crash_at_step=2))
        engine.start()
        stream = await engine.add_request("r", "ok", SamplingParams(max_tokens=5))
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in stream:
                pass
        assert not engine.is_alive
        with pytest.raises(EngineDeadError):
            await engine.add_request("r2", "ok", SamplingParams())
        await engine.shutdown()

    run(main())


def test_requests_queued_when_the_engine_breaks_are_refused() -> None:
    """A request queued while the step that breaks the engine runs is refused with
    ``EngineDeadError``, not left waiting for an answer that will never come."""
    class Stalling(FakeEngine):
        def __init__(self) -> None:
            super().__init__(crash_at_step=1)
            self.stepping, self.go_on = threading.Event(), threading.Event()

        def step(self) -> list[RequestOutput]:
            self.stepping.set()
            self.go_on.wait(5)
            return super().step()

    fake = Stalling()

    async def main() -> None:
        engine = AsyncEngine(fake)
        engine.start()
        first = await engine.add_request("r", "ok", SamplingParams(max_tokens=5))
        await asyncio.to_thread(fake.stepping.wait, 5)
        late = asyncio.ensure_future(engine.add_request("late", "ok", SamplingParams()))
        while engine._commands.empty():  # the late request is queued behind the step
            await asyncio.sleep(0.001)
        fake.go_on.set()
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in first:
                pass
        with pytest.raises(EngineDeadError, match="boom"):
            await late
        await engine.shutdown()

    run(main())


def test_health_answers_503_once_the_engine_died() -> None:
    """/health is 503 from the moment the engine stops by itself, and the HTTP server is told
    to exit (so that a supervisor restarts it). The real servers exit within a tick of this,
    too soon for a poller to be sure of seeing the 503; here nothing stops the app."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from mmserve.entrypoints.api_server import OpenAIServer
    from mmserve.entrypoints.serve_args import ServerConfig

    fake = FakeEngine(crash_at_step=1)
    fake.config = SimpleNamespace(max_num_seqs=2, max_model_len=64, limit_mm_per_prompt=1,
                                  max_image_pixels=1 << 20, model="", generation_config="vllm",
                                  scheduling_policy="fcfs")
    server = OpenAIServer(fake, ServerConfig("fake"))
    server.http_server = SimpleNamespace(should_exit=False)
    with TestClient(server.app()) as http:
        assert http.get("/health").status_code == 200
        resp = http.post("/v1/completions", json={"model": "fake", "prompt": "hi",
                                                  "max_tokens": 3})
        assert resp.status_code >= 500 and "boom" in resp.json()["error"]["message"], resp.text
        health = http.get("/health")
        assert health.status_code == 503, health.text
        assert server.http_server.should_exit


def test_a_request_aborted_while_it_is_added_does_not_run() -> None:
    """``abort`` called while the request is still being processed reaches the engine before
    the request does (and does nothing there): the request is aborted again once queued,
    instead of running to its ``max_tokens`` for nobody."""
    class SlowToProcess(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.processing, self.go_on = threading.Event(), threading.Event()

        def process_request(self, prompt: Any, params: SamplingParams, request_id: str):
            self.processing.set()
            self.go_on.wait(5)
            return super().process_request(prompt, params, request_id)

    fake = SlowToProcess()

    async def main() -> None:
        engine = AsyncEngine(fake)
        engine.start()
        adding = asyncio.ensure_future(
            engine.add_request("r", "ok", SamplingParams(max_tokens=100_000)))
        await asyncio.to_thread(fake.processing.wait, 5)
        engine.abort("r")
        fake.go_on.set()
        await adding
        deadline = time.monotonic() + 5
        while (fake.live or "r" not in fake.aborted) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert fake.aborted == ["r"] and not fake.live and fake.steps < 1000, fake.steps
        assert engine.num_in_flight == 0
        await engine.shutdown()

    run(main())


def test_requests_sent_after_the_stop_are_refused() -> None:
    """Commands drained in one batch: the request before ``STOP`` is added, the one after it
    is refused (it used to be dropped, its caller waiting for ever)."""
    import queue

    from mmserve.engine.step_loop import STOP, QueueRequest, run_steps

    fake = FakeEngine()
    answers: dict[str, BaseException | None] = {}

    def queued(rid: str) -> QueueRequest:
        request = fake.process_request("ok", SamplingParams(max_tokens=1), rid)
        return QueueRequest(request, lambda error: answers.__setitem__(rid, error))

    commands: queue.SimpleQueue[object] = queue.SimpleQueue()
    for command in (queued("before"), STOP, queued("after")):
        commands.put(command)
    run_steps(fake, commands, lambda *_: None)
    assert answers["before"] is None and "before" in fake.live
    assert isinstance(answers["after"], EngineDeadError) and "after" not in fake.live


@pytest.mark.parametrize("crash", [False, True])
def test_a_chat_streams_role_with_its_first_output(crash: bool) -> None:
    """The role chunk goes out with the choice's first output, as OpenAI and vLLM send it (a
    client timing the first chunk, as vLLM's benchmark does, then times the first token),
    not before the engine has computed anything: a request the engine fails at once gets
    the error event alone."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from mmserve.entrypoints.api_server import OpenAIServer
    from mmserve.entrypoints.serve_args import ServerConfig

    fake = FakeEngine(crash_at_step=1 if crash else None)
    fake.config = SimpleNamespace(max_num_seqs=2, max_model_len=64, limit_mm_per_prompt=1,
                                  max_image_pixels=1 << 20, model="", generation_config="vllm",
                                  scheduling_policy="fcfs")
    server = OpenAIServer(fake, ServerConfig("fake"))
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "stream": True}
    with TestClient(server.app()) as http:
        lines = http.post("/v1/chat/completions", json=body).text.splitlines()
    events = [json.loads(line[5:]) for line in lines
              if line.startswith("data:") and line != "data: [DONE]"]
    if crash:
        assert len(events) == 1 and "boom" in events[0]["error"]["message"], events
        return
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content") or "" for d in deltas[1:]) == "xxx", deltas


class SlowImagesEngine(FakeEngine):
    """Preprocessing a prompt with images takes 2 s (a large image), a text prompt none."""

    def __init__(self) -> None:
        super().__init__(max_num_seqs=16)

    def process_request(self, prompt: Any, params: SamplingParams, request_id: str) -> Request:
        if isinstance(prompt, dict) and prompt.get("images"):
            time.sleep(2.0)
        return super().process_request(prompt, params, request_id)


def test_a_text_prompt_does_not_wait_behind_images_being_preprocessed() -> None:
    async def main() -> float:
        engine = AsyncEngine(SlowImagesEngine(), preprocess_workers=2)
        engine.start()

        async def one(rid: str, prompt: Any) -> float:
            start = time.monotonic()
            stream = await engine.add_request(rid, prompt, SamplingParams(max_tokens=1))
            async for _ in stream:
                pass
            return time.monotonic() - start

        images = [asyncio.ensure_future(one(f"i{i}", {"prompt": "x", "images": [b"png"]}))
                  for i in range(4)]  # two rounds of the two image threads
        await asyncio.sleep(0.1)
        text = await one("t", {"messages": [{"role": "user", "content": "hi"}]})
        await asyncio.gather(*images)
        await engine.shutdown()
        return text

    assert run(main()) < 1.0  # not behind the images (2 s, or 4 for the second round)
