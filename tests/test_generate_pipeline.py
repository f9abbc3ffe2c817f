"""``LLM.generate`` preprocesses prompts ahead of the engine, on threads (beside a GPU) or
between steps (the CPU): the first step does not wait for the last prompt, memory is bounded
by a window of prompts, a bad prompt aborts the call's queued requests and leaves the engine
usable, and the outputs are those of prompts run one at a time."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from mmserve import LLM, SamplingParams
from mmserve.engine import prompt_feed
from mmserve.errors import InvalidInputError
from tests.conftest import assert_no_leaks, make_image

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def _prompt(i: int) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": f"picture {i}?"}]}],
        "images": [make_image(i, (40 + 8 * (i % 3), 32))]}


@pytest.fixture(scope="module")
def llm(clip_llama: str) -> LLM:
    return LLM(clip_llama, dtype="float32", max_model_len=160, max_num_seqs=2)


@pytest.fixture(scope="module")
def alone(llm: LLM) -> list[list[int]]:
    return [llm.generate(_prompt(i), GREEDY)[0].token_ids for i in range(8)]


@pytest.fixture(params=["threads", "calling thread"])
def preprocess_on(request, monkeypatch):
    """Both ways of preprocessing: threads (beside a GPU engine) and between steps (CPU)."""
    if request.param == "threads":
        monkeypatch.setattr(prompt_feed, "preprocess_pool",
                            lambda device: ThreadPoolExecutor(2))
    return request.param


def _ready_after_a_step(engine, step_name: str, held, monkeypatch) -> list[bool]:
    """Make the prompts ``held(prompt)`` picks ready only once the engine has stepped (through
    its method ``step_name``); bounded, never hangs. Returns the list each such prompt adds
    to: whether the step came first."""
    stepped = threading.Event()
    real_step, real_process = getattr(engine, step_name), engine.process_request
    waited: list[bool] = []

    def step():
        stepped.set()
        return real_step()

    def process_request(prompt, params=None, request_id=None):
        if held(prompt):
            waited.append(stepped.wait(timeout=10))
        return real_process(prompt, params, request_id)

    monkeypatch.setattr(engine, step_name, step)
    monkeypatch.setattr(engine, "process_request", process_request)
    return waited


def test_the_engine_steps_while_later_prompts_are_preprocessed(llm, alone, monkeypatch,
                                                              preprocess_on):
    """With threads, as soon as the first prompt is ready; between steps, beyond the window
    (4 prompts here: max_num_seqs=2 and no floor)."""
    monkeypatch.setattr(prompt_feed, "MIN_REQUESTS_AHEAD", 0)
    engine = llm.engine
    prompts = [_prompt(i) for i in range(8)]
    waited = _ready_after_a_step(engine, "step", lambda prompt: prompt is prompts[-1],
                                 monkeypatch)
    outs = llm.generate(prompts, GREEDY)
    assert waited == [True]  # the engine stepped before the last prompt was ready
    assert [o.token_ids for o in outs] == alone  # in input order, as when run alone
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert_no_leaks(engine)


def test_prompts_held_ahead_of_the_engine_are_bounded(llm, alone, monkeypatch, preprocess_on):
    """max_num_seqs=2 and no floor: at most 4 of the call's prompts preprocessed or running
    at once."""
    assert prompt_feed.requests_ahead(2) == 64 and prompt_feed.requests_ahead(100) == 200
    monkeypatch.setattr(prompt_feed, "MIN_REQUESTS_AHEAD", 0)
    engine = llm.engine
    real_step, real_process = engine.step, engine.process_request
    count = {"processed": 0, "finished": 0, "most": 0}
    lock = threading.Lock()

    def step():
        outs = real_step()
        with lock:
            count["finished"] += sum(o.finished for o in outs)
        return outs

    def process_request(*args, **kwargs):
        with lock:
            count["processed"] += 1
            count["most"] = max(count["most"], count["processed"] - count["finished"])
        return real_process(*args, **kwargs)

    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr(engine, "process_request", process_request)
    outs = llm.generate([_prompt(i) for i in range(8)], GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert count["processed"] == 8 and 2 <= count["most"] <= 4, count


def test_a_bad_prompt_aborts_the_calls_requests_and_the_engine_goes_on(llm, alone,
                                                                      preprocess_on):
    prompts = [_prompt(i) for i in range(5)]
    prompts[3] = {"prompt": "no image here", "images": [make_image(9, (30, 30))]}
    with pytest.raises(InvalidInputError, match="image"):
        llm.generate(prompts, GREEDY)
    assert_no_leaks(llm.engine)
    assert [o.token_ids for o in llm.generate([_prompt(0), _prompt(1)], GREEDY)] == alone[:2]


def test_the_throughput_bench_feeds_the_engine_as_generate_does(llm, monkeypatch, preprocess_on):
    """``run_throughput`` shares generate's feed: with threads its first step does not wait
    for the last prompt, and the outputs are the same either way (and leave nothing held)."""
    from mmserve.bench.throughput import run_throughput
    from mmserve.bench.workload import WorkloadConfig, build_workload

    engine = llm.engine
    workload = build_workload(WorkloadConfig(num_prompts=6, image_sizes=((40, 32), (48, 32)),
                                             output_len=(3, 5), prompt_len=4),
                              engine.processor.tokenizer)
    real_process = engine.process_request
    last_image = workload.requests[-1].images[0]
    waited = _ready_after_a_step(
        engine, "step_with_record",
        lambda prompt: prompt["images"][0] is last_image and preprocess_on == "threads",
        monkeypatch)
    run = run_throughput(engine, workload, use_tqdm=False)
    assert waited == ([True] if preprocess_on == "threads" else [])
    assert [len(o.token_ids) for o in run.outputs] == [r.output_len for r in workload.requests]
    monkeypatch.setattr(engine, "process_request", real_process)
    alone = [llm.generate(r.prompt(), SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                                      ignore_eos=True))[0].token_ids
             for r in workload.requests]
    assert [o.token_ids for o in run.outputs] == alone
    assert run.results["time_s"]["preprocessing"] > 0
    assert_no_leaks(engine)
