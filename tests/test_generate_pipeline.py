"""``LLM.generate`` preprocesses prompts ahead of the engine, on threads (beside a GPU) or
between steps (the CPU): the first step does not wait for the last prompt, memory is bounded
by a window of prompts, a bad prompt aborts the call's queued requests and leaves the engine
usable, and the outputs are those of prompts run one at a time."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from mmserve import LLM, SamplingParams
from mmserve.entrypoints import llm as llm_module
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
        monkeypatch.setattr(llm_module, "_preprocess_pool",
                            lambda device: ThreadPoolExecutor(2))
    return request.param


def test_the_engine_steps_while_later_prompts_are_preprocessed(llm, alone, monkeypatch,
                                                              preprocess_on):
    """With threads, as soon as the first prompt is ready; between steps, beyond the window
    (4 prompts here: max_num_seqs=2 and no floor)."""
    monkeypatch.setattr(llm_module, "MIN_REQUESTS_AHEAD", 0)
    engine = llm.engine
    stepped = threading.Event()
    real_step, real_process = engine.step, engine.process_request
    waited: list[bool] = []

    def step():
        stepped.set()
        return real_step()

    def process_request(prompt, params=None, request_id=None):
        if prompt is last:  # ready only once the engine has stepped (bounded: never hangs)
            waited.append(stepped.wait(timeout=10))
        return real_process(prompt, params, request_id)

    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr(engine, "process_request", process_request)
    prompts = [_prompt(i) for i in range(8)]
    last = prompts[-1]
    outs = llm.generate(prompts, GREEDY)
    assert waited == [True]  # the engine stepped before the last prompt was ready
    assert [o.token_ids for o in outs] == alone  # in input order, as when run alone
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert_no_leaks(engine)


def test_prompts_held_ahead_of_the_engine_are_bounded(llm, alone, monkeypatch, preprocess_on):
    """max_num_seqs=2 and no floor: at most 4 of the call's prompts preprocessed or running
    at once."""
    assert llm_module.requests_ahead(2) == 64 and llm_module.requests_ahead(100) == 200
    monkeypatch.setattr(llm_module, "MIN_REQUESTS_AHEAD", 0)
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
