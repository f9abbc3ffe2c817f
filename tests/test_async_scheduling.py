"""Asynchronous scheduling (``async_scheduling``): each step is scheduled while the one before
computes, its decodes given the tokens that step samples on the runner's side; the outputs are
the synchronous engine's, token for token in float32, through chunked prefill that splits
images, cache hits, stops, sampling, structured output, aborts and failures, with the runner
in this process or in tensor-parallel workers (a broken device: tests/test_step_failures.py)."""

from __future__ import annotations

import threading
import types
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.engine.prompt_feed import MIN_REQUESTS_AHEAD
from mmserve.errors import InvalidInputError
from mmserve.step import (
    PENDING_TOKEN,
    DecodeRows,
    ModelOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from mmserve.testing import build_tiny_checkpoint
from mmserve.worker import model_runner
from mmserve.worker.cpu_threads import AdaptiveThreads
from mmserve.worker.executor import InlineSteps, StepThread
from mmserve.worker.model_runner import CPUModelRunner, StepResult
from tests.conftest import assert_no_leaks, make_image
from tests.test_parity import mixed_batch, shared_batch
from tests.test_server import IMAGES, Server, data_url, image_message, wait_drained
from tests.test_step_failures import GREEDY, PROMPTS, WHITE, _chat, _poisoned
from tests.test_tensor_parallel import _settings

LONG = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_checkpoint("qwen2_vl", tmp_path_factory.mktemp("async") / "q"))


@pytest.fixture(params=["at once", "on the device", "launched inline"],
                ids=["tokens to Python at once", "tokens left on the device",
                     "launched on the engine's thread"])
def deferred(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The CPU runner as it is; or leaving each step's sampled tokens on the device for the
    engine's thread to bring to Python, as the CUDA runner does (``defer_sampled_tokens``):
    the step scheduled ahead then reads its pending tokens from the device; or that, and its
    steps launched on the engine's own thread (``InlineSteps``), as the CUDA runner's are
    (``launches_asynchronously``; on the CPU each launch computes its step)."""
    monkeypatch.setattr(CPUModelRunner, "defer_sampled_tokens", request.param != "at once")
    monkeypatch.setattr(CPUModelRunner, "launches_asynchronously",
                        request.param == "launched inline")
    return request.param


def _run(llm: LLM, batches: list[list[dict]], params: SamplingParams | list = LONG) -> list:
    found = []
    for batch in batches:
        found += [(o.token_ids, o.finish_reason) for o in llm.generate(batch, params)]
        assert_no_leaks(llm.engine)
    return found


@pytest.mark.parametrize("family", ["clip-llama", "qwen2-vl"])
def test_same_tokens_through_chunked_prefill_and_cache_hits(
        checkpoints: dict[str, str], qwen2_vl: str, family: str, deferred: str) -> None:
    """Images split across steps, a KV cache that makes the synchronous engine preempt
    (scheduled ahead, nobody is preempted: a request that does not fit waits a step), then
    prefix and encoder cache hits; a second generate collects the step left in flight."""
    path = qwen2_vl if family == "qwen2-vl" else checkpoints[family]
    batches = [mixed_batch(), shared_batch()]
    with LLM(path, **_settings(path, 1)) as sync:
        expected = _run(sync, batches)
        assert sync.stats()["num_preemptions"] > 0
    with LLM(path, async_scheduling=True, **_settings(path, 1)) as ahead:
        assert _run(ahead, batches) == expected
        stats = ahead.stats()
        assert ahead.engine.num_steps_ahead > stats["num_steps"] // 2
    assert stats["encoder_cache_hits"] > 0 and stats["prefix_cache_hit_tokens"] > 0


def test_stops_sampling_logprobs_and_grammars_match(clip_llama: str, deferred: str) -> None:
    """EOS and stop strings end requests a step early (the token computed ahead for them is
    dropped), seeded sampling with n, logprobs and a grammar (whose next bitmask waits for
    its token) in one batch, and penalties and min_tokens (which count tokens the step
    before samples, on the device when scheduled ahead)."""
    prompts = mixed_batch()[:7]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=False),
              SamplingParams(max_tokens=16, temperature=0.0, stop=["e", "a"]),
              SamplingParams(max_tokens=10, temperature=0.8, seed=7, n=3, logprobs=2),
              SamplingParams(max_tokens=10, temperature=1.0, top_p=0.7, top_k=20, min_p=0.1,
                             presence_penalty=0.7, logit_bias={17: 2.0}),
              SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=0.6,
                             frequency_penalty=0.4, min_tokens=9, stop=["e", "a"]),
              SamplingParams(max_tokens=24, temperature=0.0,
                             structured_outputs={"regex": "(yes|no), [a-z]{3,6}"}),
              SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=1)]

    def run(**flags) -> list:
        with LLM(clip_llama, dtype="float32", device="cpu", max_num_seqs=4, seed=3,
                 **flags) as llm:
            outs = llm.generate(prompts, params)
            assert_no_leaks(llm.engine)
        return [[(c.token_ids, c.finish_reason, c.text,
                  [round(lp.logprob, 3) for lp in c.logprobs or []]) for c in o.outputs]
                + [[round(lp.logprob, 3) for lp in o.prompt_logprobs or [] if lp is not None]]
                for o in outs]

    expected = run()
    assert run(async_scheduling=True) == expected
    assert expected[1][0][1] == "stop" and expected[5][0][1] == "stop"
    assert len(expected[4][0][0]) >= 9


class _Runner:
    """Samples token 1 for every request; fails a step whose first request is "bad"."""

    def launch(self, scheduler_output, encoder_pixels):
        if scheduler_output.requests[0].request_id == "bad":
            raise RuntimeError("launch failed")
        return StepResult(ModelOutput(
            sampled={r.request_id: 1 for r in scheduler_output.requests}), [])


def _step(rid: str) -> SchedulerOutput:
    return SchedulerOutput(chunks=[ScheduledRequest(rid, [5], 0, [0], [], True, GREEDY,
                                                      [[0]])])


@pytest.mark.parametrize("kind", [StepThread, InlineSteps])
def test_a_step_left_uncollected_is_never_taken_for_a_later_one(kind) -> None:
    """An interrupted caller (Ctrl-C while waiting) leaves a step's result behind: the next
    ``collect`` gets its own step's result, not that one. What a launch raised is raised
    where its step is collected, and the steps after it go on."""
    steps = kind(_Runner())
    try:
        first = steps.submit(_step("a"), {})
        second = steps.submit(_step("b"), {})
        assert second > first
        assert steps.collect(second).sampled == {"b": 1}  # "a"'s result is dropped
        assert steps.collect(steps.submit(_step("c"), {})).sampled == {"c": 1}
        bad, after = steps.submit(_step("bad"), {}), steps.submit(_step("d"), {})
        with pytest.raises(RuntimeError, match="launch failed"):
            steps.collect(bad)
        assert steps.collect(after).sampled == {"d": 1}
    finally:
        steps.close()


def test_steps_of_a_runner_that_only_queues_them_launch_on_the_engines_thread(
        clip_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner whose launch returns once its device has the step (``launches_asynchronously``,
    the CUDA runner) gets no thread of its own: the engine launches each step as it submits
    it, schedules the next while the device computes, and collects the first after; the
    tokens are the synchronous engine's."""
    with LLM(clip_llama, dtype="float32", device="cpu", max_num_seqs=4) as sync:
        expected = [o.token_ids for o in sync.generate(mixed_batch()[:4], LONG)]
    monkeypatch.setattr(CPUModelRunner, "defer_sampled_tokens", True)
    monkeypatch.setattr(CPUModelRunner, "launches_asynchronously", True)
    with LLM(clip_llama, dtype="float32", device="cpu", max_num_seqs=4,
             async_scheduling=True) as llm:
        engine = llm.engine
        assert isinstance(engine._steps, InlineSteps) and engine._compute is None
        launched_on: set[int] = set()
        launch = engine.runner.launch
        monkeypatch.setattr(engine.runner, "launch", lambda *args: (
            launched_on.add(threading.get_ident()), launch(*args))[1])
        outputs = llm.generate(mixed_batch()[:4], LONG)
        assert launched_on == {threading.get_ident()}
        assert engine.num_steps_ahead > engine.num_steps // 2
    assert [o.token_ids for o in outputs] == expected


def test_a_deferred_step_brings_its_tokens_over_only_when_asked(
        clip_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``defer_sampled_tokens`` a launched step's output has no tokens and no prompt
    log-probabilities until ``result()``; the steps scheduled ahead read their tokens on the
    device, and the outputs are the runner's that converts at once."""
    prompts = mixed_batch()[:4]
    params = [LONG, SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2), LONG,
              SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=0, logprobs=1)]

    def run(defer: bool) -> tuple[list, list]:
        monkeypatch.setattr(CPUModelRunner, "defer_sampled_tokens", defer)
        with LLM(clip_llama, dtype="float32", device="cpu", max_num_seqs=4,
                 max_num_batched_tokens=256, async_scheduling=True) as llm:
            runner, seen = llm.engine.runner, []
            launch = runner.launch

            def recording(*args):  # noqa: ANN202
                step = launch(*args)
                seen.append((len(step.deferred), dict(step.output.sampled),
                             dict(step.output.prompt_logprobs)))
                return step

            monkeypatch.setattr(runner, "launch", recording)
            outs = [(o.token_ids, [e and (e.logprob, e.rank, e.top) for e in
                                   o.prompt_logprobs or []],
                     [(e.logprob, e.rank, e.top) for e in o.logprobs or []])
                    for o in llm.generate(prompts, params)]
            assert_no_leaks(llm.engine)
            return outs, seen

    expected, at_once = run(False)
    got, deferred = run(True)
    assert got == expected
    prompt_entries = expected[1][1]
    assert prompt_entries[0] is None and len(prompt_entries) > 20 and len(expected[3][2]) == 6
    assert all(len(e[2]) == 2 for e in prompt_entries[1:])
    assert all(n == 0 for n, *_ in at_once)
    assert any(sampled for _, sampled, _ in at_once) and any(p for *_, p in at_once)
    waiting = [(n, sampled, prompt) for n, sampled, prompt in deferred if n]
    assert waiting and all(sampled == {} and prompt == {} for _, sampled, prompt in waiting)
    assert all(prompt == {} for *_, prompt in deferred)


def test_a_step_rerun_alone_computes_from_the_step_befores_tokens(
        clip_llama: str, monkeypatch: pytest.MonkeyPatch, deferred: str) -> None:
    """A batched step that fails after sampling (here its log-probabilities) is rerun request
    by request; the reruns of requests scheduled ahead read the tokens of the step before,
    not the ones the failed attempt drew."""
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1)
    prompts = mixed_batch()[:3]
    real = model_runner.token_logprobs

    def run(fail: bool, **flags) -> list:
        calls = {"n": 0}

        def flaky(logits, tokens, num_top):  # noqa: ANN202
            if fail and len(tokens) > 1:
                calls["n"] += 1
                if calls["n"] == 4:
                    raise RuntimeError("transient")
            return real(logits, tokens, num_top)

        monkeypatch.setattr(model_runner, "token_logprobs", flaky)
        with LLM(clip_llama, dtype="float32", device="cpu", max_num_seqs=4, **flags) as llm:
            outs = llm.generate(prompts, params)
            assert_no_leaks(llm.engine)
        assert not fail or calls["n"] >= 4
        return [o.outputs[0].token_ids for o in outs]

    expected = run(False)
    assert run(True) == expected
    assert run(True, async_scheduling=True) == expected


def test_the_thread_policy_looks_before_steps_scheduled_ahead(
        clip_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU runner's adaptive thread count is looked at before each step, whichever
    thread runs it."""
    calls = {"n": 0}
    real = AdaptiveThreads.update

    def counting(self, *args, **kwargs):  # noqa: ANN202
        calls["n"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(AdaptiveThreads, "update", counting)
    for flags in ({}, {"async_scheduling": True}):
        calls["n"] = 0
        with LLM(clip_llama, dtype="float32", device="cpu", **flags) as llm:
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0.0))
            steps = llm.stats()["num_steps"]
        assert calls["n"] >= steps > 0, flags


def _drain(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_aborts_between_steps(clip_llama: str, deferred: str) -> None:
    """A request aborted while the next step is already scheduled ahead: the others finish
    as they do synchronously, and nothing leaks."""
    def run(**flags) -> list:
        with LLM(clip_llama, dtype="float32", device="cpu", max_num_seqs=4, **flags) as llm:
            engine = llm.engine
            ids = [engine.add_request(p, LONG) for p in [*PROMPTS, _chat("bye", [])]]
            for _ in range(4):
                engine.step()
            engine.abort_request(ids[1])
            done = _drain(engine)
            assert ids[1] not in done
            assert_no_leaks(engine)
            return [done[i].token_ids for i in ids if i != ids[1]]

    assert run(async_scheduling=True) == run()


def test_a_bad_prompt_mid_call_leaves_no_step_in_flight(clip_llama: str, deferred: str) -> None:
    """``generate`` meets a bad prompt once its first requests are stepping: it aborts them
    while a step scheduled ahead holds them, and collects that step before it raises, so the
    engine is left with nothing unfinished and every block free, and serves the next call."""
    # The bad prompt is preprocessed once the first request finishes, the others running.
    good = [f"USER: say something about the number {i}\nASSISTANT:"
            for i in range(MIN_REQUESTS_AHEAD)]
    bad = {"prompt": "no image here", "images": [make_image(9, (30, 30))]}
    with LLM(clip_llama, dtype="float32", device="cpu", max_num_seqs=4,
             async_scheduling=True) as llm:
        with pytest.raises(InvalidInputError, match="image"):
            llm.generate([*good, bad], [SamplingParams(max_tokens=2 if i == 0 else 16,
                                                       temperature=0.0)
                                        for i in range(len(good) + 1)])
        assert llm.engine.num_steps_ahead > 0
        assert_no_leaks(llm.engine)
        assert len(llm.generate(good[:2], LONG)) == 2


def test_failures_mid_run(clip_llama: str, monkeypatch: pytest.MonkeyPatch,
                          deferred: str) -> None:
    """A request whose sampling fails (its step ahead has no token to compute from) is
    failed alone; a step that fails once for everyone is retried; the others' tokens are the
    synchronous engine's."""
    def run(**flags) -> list:
        with LLM(clip_llama, dtype="float32", device="cpu", max_num_seqs=4, **flags) as llm:
            engine = llm.engine
            ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
            poisoned = engine.add_request(_chat("x", []), _poisoned(temperature=1e-300))
            done = {}
            for _ in range(3):
                done.update((o.request_id, o) for o in engine.step() if o.finished)
            real, calls = engine.runner._forward, {"n": 0}

            def flaky(*args, **kwargs):  # noqa: ANN202
                calls["n"] += 1
                if calls["n"] <= 1 + len(PROMPTS):  # the batch, then each request alone
                    raise RuntimeError("transient")
                return real(*args, **kwargs)

            monkeypatch.setattr(engine.runner, "_forward", flaky)
            done.update(_drain(engine))
            assert calls["n"] > 1 + len(PROMPTS)
            monkeypatch.setattr(engine.runner, "_forward", real)
            assert_no_leaks(engine)
            return [(done[i].token_ids, done[i].finish_reason) for i in [*ids, poisoned]]

    expected = run()
    assert run(async_scheduling=True) == expected
    assert expected[-1][1] == "error" and all(r != "error" for _, r in expected[:-1])


@pytest.mark.slow
def test_with_tensor_parallel_workers(clip_llama: str) -> None:
    """Two worker processes run the steps scheduled ahead in order (each rank writes in its
    own sampled tokens)."""
    batches = [mixed_batch(), shared_batch()]
    with LLM(clip_llama, **_settings(clip_llama, 1)) as sync:
        expected = _run(sync, batches)
    settings = _settings(clip_llama, 2)
    with LLM(clip_llama, async_scheduling=True, **settings) as ahead:
        assert _run(ahead, batches) == expected
        assert ahead.engine.num_steps_ahead > 0


@pytest.mark.slow
def test_the_server_with_async_scheduling(clip_llama: str, tmp_path) -> None:
    """Concurrent chat requests (streamed and not) to ``mmserve serve --async-scheduling``:
    each answer is the one ``LLM`` gives synchronously; the server drains and stays up."""
    prompts = [("what is in this picture?", [IMAGES[0]]), ("compare these two", IMAGES[1:3]),
               ("say something", []), ("and this?", [IMAGES[2]])]
    with LLM(clip_llama, dtype="float32") as llm:
        expected = [llm.generate(
            {"messages": [{"role": "user", "content": [{"type": "image"}] * len(images)
                           + [{"type": "text", "text": text}]}], "images": images},
            SamplingParams(max_tokens=16, temperature=0.0))[0].text for text, images in prompts]
    server = Server(clip_llama, "--served-model-name", "tiny", "--async-scheduling",
                    log=tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

        def ask(i: int) -> str:
            text, images = prompts[i % len(prompts)]
            messages = image_message(text, *[data_url(im) for im in images])
            if i % 2:
                chunks = client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True)
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=16,
                temperature=0).choices[0].message.content

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(16)))
        assert answers == [expected[i % len(prompts)] for i in range(16)]
        wait_drained(server.url)
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()


def test_an_aborted_request_whose_chunk_fails_leaves_nothing_cached(
        clip_llama: str) -> None:
    """Aborted while its first chunk (whose image then fails to encode) is in flight: the
    blocks that chunk published leave the prefix cache, so a later prompt sharing them
    computes them instead of reading what was never written."""
    system = {"role": "system", "content": "you are a helpful assistant who answers briefly "
                                           "and well " * 2}

    def with_system(text: str, images: list) -> dict:
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
        return {"messages": [system, {"role": "user", "content": content}], "images": images}

    with LLM(clip_llama, dtype="float32", max_model_len=256, max_num_seqs=4, block_size=4,
             async_scheduling=True) as llm:
        engine = llm.engine
        model = engine.runner.model
        real = model.encode_pixels

        def encode(pixels):
            if bool((pixels.flatten(1).min(dim=1).values > 1.0).any()):
                raise RuntimeError("cannot encode a white image")
            return real(pixels)

        model.encode_pixels = encode
        expected = llm.generate(with_system("hi", []), GREEDY)[0].token_ids
        engine.reset_caches()
        engine.add_request(_chat("keep running", []), SamplingParams(
            max_tokens=30, temperature=0.0, ignore_eos=True))
        engine.step()
        engine.step()
        doomed = engine.add_request(with_system("what?", [WHITE]), GREEDY)
        engine.step()  # its first chunk is in flight now
        engine.abort_request(doomed)
        _drain(engine)
        assert_no_leaks(engine)
        again = llm.generate(with_system("hi", []), GREEDY)[0]
        assert again.token_ids == expected and again.num_cached_tokens == 0


@pytest.mark.slow
def test_large_messages_both_ways_do_not_block_the_workers(tmp_path) -> None:
    """A step's large answer (prompt logprobs of a long prompt) going back while the next,
    large step (an image's pixels) is sent: each worker reads its calls on a thread of its
    own, so neither pipe waits on the other."""
    path = str(build_tiny_checkpoint("qwen2_vl", tmp_path / "q"))
    long_prompt = " ".join(f"w{i}" for i in range(400))
    image = {"messages": [{"role": "user", "content": [{"type": "image"},
                                                       {"type": "text", "text": "hi"}]}],
             "images": [make_image(1, (448, 448))]}
    with LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2,
             async_scheduling=True, max_num_seqs=4, worker_timeout=60,
             max_num_batched_tokens=1500) as llm:
        outs = llm.generate([long_prompt, image],
                            [SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=20),
                             SamplingParams(max_tokens=3, temperature=0.0)])
        assert all(o.finish_reason == "length" for o in outs)
        assert len(outs[0].prompt_logprobs) > 400


@pytest.mark.parametrize("sources", ["one step's tokens", "two steps' tokens"])
def test_pending_tokens_are_read_where_each_request_sampled_last(sources: str) -> None:
    # Decode rows a and b and the chunk of c wait for tokens sampled on the device: most
    # steps, all from the step before (one tensor); after a failed or skipped step, from two.
    step_1, step_2 = torch.tensor([101, 102, 103]), torch.tensor([201, 202])
    b_from = (step_1, 0) if sources == "one step's tokens" else (step_2, 1)
    runner = types.SimpleNamespace(last_sampled={"a": (step_1, 2), "b": b_from,
                                                 "c": (step_1, 1)})
    decodes, params = DecodeRows(), SamplingParams()
    for rid, token in (("a", PENDING_TOKEN), ("x", 7), ("b", PENDING_TOKEN)):
        decodes.append(rid, token, 10, 10, params, 1)
    chunk = ScheduledRequest("c", [5, PENDING_TOKEN], 3, [], [], True, params, [[3, 4]])
    ids = torch.tensor([PENDING_TOKEN, 7, PENDING_TOKEN, 5, PENDING_TOKEN])
    got = model_runner.ModelRunner._with_pending_tokens(runner, ids, decodes, [chunk])
    assert got.tolist() == [103, 7, int(b_from[0][b_from[1]]), 5, 102]
