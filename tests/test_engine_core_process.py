"""The engine in a process of its own (``EngineCoreClient``): the same outputs as the engine
in this process, aborts and errors across the pipe, nothing left held in the core, a core that
dies failing its requests, a start the core refuses raising here. The tests of outputs, stop
strings, aborts and refusals also run the server's other layout, where the engine steps on a
thread of this process (``AsyncEngine`` over ``LLMEngine(detokenize=False)``) and the client
makes the outputs the same way. The tiny clip-llama checkpoint in float32 on the CPU."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from mmserve import LLM, EngineConfig, SamplingParams
from mmserve.engine.async_engine import AsyncEngine, RequestStream
from mmserve.engine.core_process import EngineCoreClient
from mmserve.engine.llm_engine import LLMEngine
from mmserve.errors import EngineDeadError, InvalidInputError, PromptTooLongError
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import StructuredOutputs
from tests.conftest import make_image

IMAGES = [make_image(i, size) for i, size in enumerate([(40, 30), (64, 64), (23, 57)])]


def chat(text: str, images: list | None = None) -> dict[str, Any]:
    images = images or []
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}], "images": images}


PROMPTS = [chat("hello there"), chat("what is in this picture?", IMAGES[:1]),
           chat("compare these two", IMAGES[1:3])]


class Core:
    """A started client and the event loop it serves; ``run`` runs a coroutine there.
    ``layout``: "process" (``EngineCoreClient``) or "thread" (``AsyncEngine``)."""

    def __init__(self, config: EngineConfig, layout: str = "process") -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = None if layout == "process" else LLMEngine(config, detokenize=False)
        self.client = (EngineCoreClient(config) if self.engine is None
                       else AsyncEngine(self.engine))
        self.dead: list[BaseException] = []
        self.client.on_dead = self.dead.append
        self.loop.run_until_complete(self._start())

    async def _start(self) -> None:
        self.client.start()

    def run(self, coro, timeout: float = 60.0) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def close(self) -> None:
        self.run(self.client.shutdown())
        self.loop.close()
        if self.engine is not None:
            self.engine.close()


def config_of(model: str, **kwargs: Any) -> EngineConfig:
    return EngineConfig(model=model, dtype="float32", device="cpu", **kwargs)


@pytest.fixture(scope="module", params=["process", "thread"])
def core(clip_llama: str, request: pytest.FixtureRequest) -> Iterator[Core]:
    core = Core(config_of(clip_llama), request.param)
    yield core
    core.close()


async def collect(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finished
    return last


def assert_drained(core: Core) -> None:
    """Every KV block free and no encoder-cache entry referenced, in the core's own stats
    (published after the step or command that finished the last request)."""
    deadline = time.monotonic() + 10
    while True:
        stats = core.client.stats()
        if (stats["num_running"] == stats["num_waiting"] == 0
                and stats["kv_blocks_free"] == stats["kv_blocks_total"]) \
                or time.monotonic() > deadline:
            break
        core.run(asyncio.sleep(0.05))
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    assert stats["encoder_cache_referenced_entries"] == 0, stats
    assert core.client.num_in_flight == 0
    assert len(core.client._outputs) == 0  # the front end keeps no request's text


def test_outputs_equal_the_engine_in_this_process(core: Core, clip_llama: str) -> None:
    """Greedy with logprobs, and seeded sampling of two completions, for prompts of 0, 1 and
    2 images sent together: tokens, text and logprobs as ``LLM`` gives them in one process."""
    greedy = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2)
    sampled = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7, n=2)
    with LLM(clip_llama, dtype="float32", device="cpu") as llm:
        want_greedy = llm.generate(PROMPTS, greedy)
        want_sampled = llm.generate(PROMPTS[1:2], sampled)[0]

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        streams = [await core.client.add_request(f"g{i}", p, greedy)
                   for i, p in enumerate(PROMPTS)]
        forked = await core.client.add_completions(["s-0", "s-1"], PROMPTS[1], sampled)
        return ([await collect(s) for s in streams], [await collect(s) for s in forked])

    before = core.client.stats()
    got_greedy, got_sampled = core.run(main())
    # The core's step counters (``/metrics``) come over with each step's outputs.
    after = core.client.stats()
    assert after["num_steps"] > before["num_steps"]
    assert after["step_seconds"] > before["step_seconds"]
    generated = sum(len(o.token_ids) for o in got_greedy + got_sampled)
    assert after["num_scheduled_tokens"] - before["num_scheduled_tokens"] > generated
    for got, want in zip(got_greedy, want_greedy, strict=True):
        assert got.token_ids == want.outputs[0].token_ids
        assert got.text == want.outputs[0].text
        for a, b in zip(got.logprobs, want.outputs[0].logprobs, strict=True):
            assert (a.rank, [t for t, _ in a.top]) == (b.rank, [t for t, _ in b.top])
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert [o.token_ids for o in got_sampled] == [c.token_ids for c in want_sampled.outputs]
    assert_drained(core)


def test_stop_strings_and_output_kinds_as_in_this_process(core: Core, clip_llama: str) -> None:
    """The front end makes the text from the core's tokens: a stop string met, each output
    kind gives what ``LLM`` gives in one process (text, tokens, logprobs, prompt logprobs);
    the core, which ran on past the stop, ends the request (nothing left held)."""
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(clip_llama, dtype="float32", device="cpu") as llm:
        text = llm.generate(PROMPTS[1:2], free)[0].text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, stop=[stop],
                                logprobs=1, prompt_logprobs=1)
        want = llm.generate(PROMPTS[1:2], params)[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < 24, (text, stop)
    steps_before = core.client.stats()["num_steps"]

    async def main() -> dict[str, list[RequestOutput]]:
        streams = {kind: await core.client.add_request(
            f"stop-{kind}", PROMPTS[1], dataclasses.replace(params, output_kind=kind))
            for kind in ("cumulative", "delta", "final_only")}
        got: dict[str, list[RequestOutput]] = {}
        for kind, stream in streams.items():
            got[kind] = [out async for out in stream]
        return got

    got = core.run(main())
    cumulative, delta, (final,) = got["cumulative"][-1], got["delta"], got["final_only"]
    for out in (cumulative, final):
        assert (out.text, out.token_ids, out.finish_reason) == (want.text, want.token_ids,
                                                                 "stop")
        assert [e.logprob for e in out.logprobs] == pytest.approx(
            [e.logprob for e in want.logprobs], abs=1e-4)
        assert [e and e.logprob for e in out.prompt_logprobs] == pytest.approx(
            [e and e.logprob for e in want.prompt_logprobs], abs=1e-4)
    assert "".join(o.text for o in delta) == want.text
    assert [t for o in delta for t in o.token_ids] == want.token_ids
    assert len([e for o in delta for e in o.logprobs]) == len(want.token_ids)
    assert [o.finished for o in delta].count(True) == 1 and delta[-1].finish_reason == "stop"
    assert delta[-1].prompt_logprobs is not None
    assert_drained(core)
    # The core ran them on only until the front end's aborts came, not to max_tokens.
    assert core.client.stats()["num_steps"] - steps_before < 100


def test_embeddings_cross_from_the_core(core: Core, clip_llama: str) -> None:
    """An embedding request's last hidden state comes back with its one output, as the
    engine in this process gives it."""
    embed = SamplingParams(max_tokens=1, temperature=0.0, return_embedding=True)
    with LLM(clip_llama, dtype="float32", device="cpu") as llm:
        want = llm.generate(PROMPTS, embed)

    async def main() -> list[RequestOutput]:
        streams = [await core.client.add_request(f"e{i}", p, embed)
                   for i, p in enumerate(PROMPTS)]
        return [await collect(s) for s in streams]

    for got, expected in zip(core.run(main()), want, strict=True):
        torch.testing.assert_close(got.embedding, expected.embedding, atol=1e-5, rtol=1e-5)
        # Each its own row's storage, not the step's (which a pickled view would carry).
        assert got.embedding.untyped_storage().nbytes() == got.embedding.numel() * 4
    assert_drained(core)


def test_a_request_id_in_flight_is_refused_and_its_request_goes_on(core: Core) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def main() -> RequestOutput:
        first = await core.client.add_request("same", PROMPTS[0], params)
        with pytest.raises(InvalidInputError, match="'same' is already in use"):
            await core.client.add_request("same", PROMPTS[0], params)
        return await collect(first)

    assert len(core.run(main()).token_ids) == 8
    assert_drained(core)


@pytest.mark.parametrize("layout", ["process", "thread"])
def test_a_failure_making_outputs_fails_the_requests(clip_llama: str, layout: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the front end's output making ends every request with an error and stops
    the core, rather than leaving their streams waiting."""
    core = Core(config_of(clip_llama), layout)
    try:
        def broken(core_outputs):
            raise KeyError("bug")

        monkeypatch.setattr(core.client._outputs, "process", broken)

        async def main() -> None:
            stream = await core.client.add_request(
                "r", PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0))
            with pytest.raises(EngineDeadError, match="making the engine's outputs failed"):
                await collect(stream)

        core.run(main())
        assert core.dead and not core.client.is_alive
    finally:
        core.close()


def test_refusals_cross_the_pipe_and_the_core_goes_on(core: Core) -> None:
    """A bad prompt is refused in the front end, a constraint that does not compile too; a
    constrained request answers in its grammar (compiled again in the core)."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def main() -> RequestOutput:
        with pytest.raises(InvalidInputError, match="max_model_len"):
            await core.client.add_request("long", chat("word " * 5000), params)
        bad = SamplingParams(structured_outputs=StructuredOutputs(regex="(unclosed"))
        with pytest.raises(InvalidInputError, match="structured_outputs"):
            await core.client.add_request("bad-regex", chat("hi"), bad)
        await collect(await core.client.add_request("after", chat("hi"), params))
        choice = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=(
            StructuredOutputs(choice=["red square", "blue circle"])))
        return await collect(await core.client.add_request("choice", chat("which?"), choice))

    assert core.run(main()).text in ("red square", "blue circle")
    assert core.client.is_alive
    assert_drained(core)


def test_abort_releases_what_the_request_held_in_the_core(core: Core) -> None:
    """A request aborted mid-stream stops, and its KV blocks and image come free in the
    core; one running beside it finishes."""
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=6, temperature=0.0)

    async def main() -> RequestOutput:
        victim = await core.client.add_request("victim", PROMPTS[1], long)
        other = await core.client.add_request("other", PROMPTS[2], short)
        seen = 0
        async for _ in victim:
            seen += 1
            if seen == 3:
                break
        core.client.abort("victim")
        return await collect(other)

    steps_before = core.client.stats()["num_steps"]
    assert len(core.run(main()).token_ids) == 6
    assert_drained(core)
    assert core.client.stats()["num_steps"] - steps_before < 100  # the victim's 400 did not run


def test_a_request_aborted_while_it_is_processed_does_not_run(core: Core) -> None:
    """An abort that comes while the request is still being processed reaches the engine
    before the request does: the request is aborted again once queued, and neither the engine
    nor the client keeps anything of it."""
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        adding = asyncio.ensure_future(core.client.add_request("gone", PROMPTS[1], params))
        await asyncio.sleep(0)  # the request's stream is open, its prompt being processed
        assert core.client.num_in_flight == 1
        core.client.abort("gone")
        await adding

    steps_before = core.client.stats()["num_steps"]
    core.run(main())
    assert_drained(core)
    assert core.client.stats()["num_steps"] - steps_before < 100  # not its 400 tokens


@pytest.mark.parametrize("core", ["process"], indirect=True)
def test_the_core_leaves_sigterm_to_its_front_end(core: Core) -> None:
    """SIGTERM sent to the whole process group (systemd, a terminal's Ctrl-C is SIGINT) must
    not end the core before the front end has let the requests in flight finish: the core
    ignores it and serves on, until the front end stops it."""
    os.kill(core.client.pid, signal.SIGTERM)
    os.kill(core.client.pid, signal.SIGINT)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    out = core.run(collect(core.run(core.client.add_request("after-term", PROMPTS[0], params))))
    assert len(out.token_ids) == 5 and core.client.is_alive


@pytest.mark.slow
def test_a_core_that_dies_fails_its_requests(clip_llama: str) -> None:
    """The core killed while one request streams and another is being processed in the front
    end: the stream ends with ``EngineDeadError`` naming the signal, the other is refused
    with it once processed (not left waiting for the core's answer), ``on_dead`` is called,
    the client is no longer alive and refuses later requests."""
    core = Core(config_of(clip_llama))
    try:
        params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
        make = core.client.request_maker.make

        def make_while_the_core_dies(*args: Any) -> Any:
            os.kill(core.client.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while not core.client._ended and time.monotonic() < deadline:
                time.sleep(0.01)
            return make(*args)

        async def main() -> None:
            stream = await core.client.add_request("r", PROMPTS[1], params)
            core.client.request_maker.make = make_while_the_core_dies
            with pytest.raises(EngineDeadError, match="SIGKILL"):
                await core.client.add_request("late", PROMPTS[0], params)
            with pytest.raises(EngineDeadError, match="SIGKILL"):
                async for _ in stream:
                    pass

        core.run(main())
        core.run(asyncio.sleep(0.1))  # on_dead is posted after the streams fail
        assert not core.client.is_alive
        assert len(core.dead) == 1 and "SIGKILL" in str(core.dead[0])
        with pytest.raises(EngineDeadError):
            core.run(core.client.add_request("later", PROMPTS[0], params))
    finally:
        core.close()


@pytest.mark.slow
def test_a_start_the_core_refuses_raises_here(clip_llama: str) -> None:
    """Settings the engine refuses at start (a KV cache too small for one request) are a
    ``ValueError`` carrying the engine's own message, and no process is left behind."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="kv_cache_memory|KV cache"):
        EngineCoreClient(config_of(clip_llama, kv_cache_memory=4096))
    assert set(multiprocessing.active_children()) <= before


def test_errors_of_the_core_are_rebuilt_here() -> None:
    """What the core refuses a request with crosses the pipe as plain data and is raised here
    as the same kind of error, a bad request's field kept for the 400."""
    from mmserve.engine.core_process import _error_of, _rebuild

    invalid = _rebuild(_error_of(InvalidInputError("request id 'x' is already in use",
                                                    param="messages")))
    assert isinstance(invalid, InvalidInputError) and invalid.param == "messages"
    assert str(invalid) == "request id 'x' is already in use"
    long = _rebuild(_error_of(PromptTooLongError("the prompt is 9 tokens", "prompt")))
    assert isinstance(long, PromptTooLongError) and long.param == "prompt"
    assert isinstance(_rebuild(_error_of(EngineDeadError("closed"))), EngineDeadError)
    other = _rebuild(_error_of(KeyError("bug")))
    assert type(other) is RuntimeError and "bug" in str(other)


def test_core_outputs_cross_as_plain_tuples() -> None:
    """What a step did to a request, sent as a plain tuple, is rebuilt equal, logprobs and
    prompt logprobs included."""
    import pickle

    from mmserve.engine.output_processor import CoreOutput
    from mmserve.step import TokenLogprobs

    out = CoreOutput("r", [6], "stop", None, 4, TokenLogprobs(-0.5, 1, ((6, -0.5), (7, -1.0))),
                     [None, TokenLogprobs(-2.0, 3, ())])
    (back,) = [CoreOutput._make(v) for v in pickle.loads(pickle.dumps([tuple(out)]))]
    assert back == out
    embedded = out._replace(embedding=torch.arange(4.0))  # (an embedding request's)
    (back,) = [CoreOutput._make(v) for v in pickle.loads(pickle.dumps([tuple(embedded)]))]
    assert torch.equal(back.embedding, embedded.embedding)


def test_a_slow_grammar_holds_up_no_message_behind_it() -> None:
    """The core compiles grammars beside its reader: a plain request and aborts sent after a
    constrained request whose grammar takes long are carried out at once; the constrained
    request, aborted while it compiles, is answered and never queued (a later request of the
    same id is); a grammar that fails is refused."""
    import pickle
    import queue
    import threading
    from multiprocessing import Pipe
    from types import SimpleNamespace

    from mmserve.engine.core_process import _read_commands
    from mmserve.engine.step_loop import STOP, AbortRequest, QueueRequest

    release = threading.Event()

    def compile(constraint: StructuredOutputs) -> str:
        if constraint.regex == "bad":
            raise InvalidInputError("does not compile")
        assert release.wait(30)
        return f"grammar of {constraint.regex}"

    def request(rid: str, regex: str | None = None) -> SimpleNamespace:
        constraint = None if regex is None else StructuredOutputs(regex=regex)
        return SimpleNamespace(request_id=rid, grammar=None, sampling_params=SamplingParams(
            structured_outputs=constraint))

    engine = SimpleNamespace(grammars=SimpleNamespace(compile=compile))
    commands: queue.SimpleQueue = queue.SimpleQueue()
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    ours, theirs = Pipe()
    reader = threading.Thread(target=_read_commands, args=(theirs, engine, commands, outbox))
    reader.start()
    for message in [("add", [(1, request("slow", "a+")), (2, request("bad", "bad"))]),
                    ("add", [(3, request("plain"))]), ("abort", "other"), ("abort", "slow"),
                    ("add", [(4, request("slow", "b+"))])]:
        ours.send_bytes(pickle.dumps(message))

    def next_command() -> object:
        return commands.get(timeout=10)

    got = [next_command() for _ in range(3)]
    assert isinstance(got[0], QueueRequest) and got[0].request.request_id == "plain"
    assert [type(c) for c in got[1:]] == [AbortRequest, AbortRequest]
    assert [c.request_id for c in got[1:]] == ["other", "slow"]
    assert outbox.get(timeout=10) == ("added", 2, ("invalid", "does not compile", None))
    assert commands.empty()  # the slow ones still compile
    release.set()
    queued = next_command()
    assert isinstance(queued, QueueRequest) and queued.request.grammar == "grammar of b+"
    assert outbox.get(timeout=10) == ("added", 1, None)  # answered, not queued
    ours.send_bytes(pickle.dumps(("stop",)))
    assert next_command() is STOP
    reader.join(10)
    assert not reader.is_alive() and commands.empty()


def test_prompt_token_ids_are_those_a_request_reads(core: Core) -> None:
    """What ``/tokenize`` answers with: the prompt's tokens, images' placeholders expanded,
    as the front end makes a request of it (in either layout)."""
    async def main() -> list[tuple[list[int], list[int]]]:
        pairs = []
        for i, prompt in enumerate(PROMPTS):
            ids = await core.client.prompt_token_ids(prompt)
            out = await collect(await core.client.add_request(
                f"t{i}", prompt, SamplingParams(max_tokens=1)))
            pairs.append((ids, out.prompt_token_ids))
        return pairs

    pairs = core.run(main())
    for ids, read in pairs:
        assert ids == read
    assert len(pairs[2][0]) > len(pairs[1][0]) > len(pairs[0][0])  # 2, 1 and 0 images
    assert_drained(core)
