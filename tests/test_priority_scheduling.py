"""vLLM's priority scheduling (``scheduling_policy="priority"``, a request's ``priority``):
waiting requests are admitted lowest priority value first, then by arrival, and the running
request preempted for room is the lowest priority one, where first come first served
preempts the newest; every request's greedy float32 tokens stay what they are under first
come first served; ``priority`` elsewhere is refused by name."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from mmserve import LLM, SamplingParams
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.serve_args import ServerConfig
from mmserve.errors import InvalidInputError
from tests.conftest import assert_no_leaks

TEXTS = ["a story about a fox", "the river in spring", "three red squares",
         "what is a circle?", "hello"]


def _engine(clip_llama: str, policy: str, **options) -> LLM:
    settings = {"dtype": "float32", "max_model_len": 128, "max_num_seqs": 2,
                "async_scheduling": False, **options}
    return LLM(clip_llama, scheduling_policy=policy, **settings)


def _run(llm: LLM, priorities: list[int], max_tokens: int = 6,
         between: int = 0) -> tuple[dict[str, list[int]], list[str], dict[str, int]]:
    """Queue a request per priority (the last ``between`` steps after the others), step
    until all finish: each one's tokens, the order they were first scheduled in, and how
    often each was preempted."""
    engine = llm.engine
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                             priority=p) for p in priorities]
    reqs = [engine.process_request({"prompt": t}, p)
            for t, p in zip(TEXTS[:len(params)], params, strict=True)]
    late = reqs[-1] if between else None
    for req in reqs:
        if req is not late:
            engine.add_processed_request(req)
    tokens: dict[str, list[int]] = {}
    order: list[str] = []
    for step in range(500):
        if step == between and late is not None:
            engine.add_processed_request(late)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
        for req in engine.scheduler.running:
            if req.request_id not in order:
                order.append(req.request_id)
        if len(tokens) == len(reqs):
            break
    assert_no_leaks(engine)
    names = {req.request_id: f"r{i}" for i, req in enumerate(reqs)}
    return ({names[k]: v for k, v in tokens.items()}, [names[k] for k in order],
            {names[req.request_id]: req.num_preemptions for req in reqs})


def test_the_highest_priority_is_admitted_first(clip_llama: str) -> None:
    """Two run at once: four requests of priority 5 queued, then one of priority 0 (and one
    of -1 among them). By priority, -1 and 0 run first; first come first served, in order."""
    with _engine(clip_llama, "priority") as llm:
        by_priority, order, _ = _run(llm, [5, 5, -1, 5, 0])
    assert order[:2] == ["r2", "r4"] and order[2:] == ["r0", "r1", "r3"]
    with _engine(clip_llama, "fcfs") as llm:
        fcfs, order, _ = _run(llm, [0, 0, 0, 0, 0])
    assert order == ["r0", "r1", "r2", "r3", "r4"]
    assert by_priority == fcfs  # the same tokens, whatever ran beside what


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_the_lowest_priority_is_preempted(clip_llama: str, policy: str) -> None:
    """A KV cache of 8 blocks of 16 tokens: two requests growing to 5 blocks each cannot
    both finish. The one of priority 9 runs first; the one of priority 0 arrives a step
    later. By priority the older, lower one gives way; first come first served, the newest
    (the high one)."""
    with _engine(clip_llama, policy, block_size=16, kv_cache_memory=8 * 16 * 512,
                 enable_prefix_caching=False) as llm:
        priorities = [9, 0] if policy == "priority" else [0, 0]
        tokens, _, preempted = _run(llm, priorities, max_tokens=70, between=1)
        assert llm.stats()["num_preemptions"] > 0
    run_texts = {"r0": TEXTS[0], "r1": TEXTS[1]}
    if policy == "priority":
        assert preempted["r0"] > 0 and preempted["r1"] == 0
    else:
        assert preempted["r1"] > 0 and preempted["r0"] == 0
    with _engine(clip_llama, "fcfs", max_model_len=256) as llm:  # each alone
        for name, text in run_texts.items():
            (out,) = llm.generate({"prompt": text}, SamplingParams(
                max_tokens=70, temperature=0.0, ignore_eos=True))
            assert tokens[name] == out.token_ids


def test_priority_elsewhere_is_refused(clip_llama: str) -> None:
    with pytest.raises(InvalidInputError, match="--scheduling-policy priority") as e:
        with _engine(clip_llama, "fcfs") as llm:
            llm.generate("hi", SamplingParams(priority=3))
    assert e.value.param == "priority"
    with pytest.raises(InvalidInputError) as e:
        SamplingParams(priority=True)
    assert e.value.param == "priority"
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        LLM(clip_llama, scheduling_policy="lottery")


def test_priority_over_http_and_the_python_api(clip_llama: str) -> None:
    with _engine(clip_llama, "priority") as llm:
        outs = llm.generate(["hi", "ho"], SamplingParams(max_tokens=3, temperature=0.0),
                            priority=[1, -4])
        assert [len(o.token_ids) for o in outs] == [3, 3]
        with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
            llm.generate(["hi"], priority=[1, 2])
        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as http:
            ok = http.post("/v1/completions", json={
                "model": "tiny", "prompt": "hi", "max_tokens": 3, "priority": -2,
                "temperature": 0})
            assert ok.status_code == 200, ok.text
            assert ok.json()["choices"][0]["text"] == outs[0].text
            bad = http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "priority": "high"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    with _engine(clip_llama, "fcfs") as llm:
        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as http:
            resp = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                      "max_tokens": 3, "priority": 1})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority"
            assert "--scheduling-policy priority" in resp.json()["error"]["message"]
            resp = http.post("/v1/responses", json={"model": "tiny", "input": "hi",
                                                    "max_output_tokens": 3, "priority": 1})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority"


def _scheduler(policy: str, delay_factor: float = 0.0, clock=None):
    """A scheduler over 6 KV blocks of 4 tokens, 4 requests at once."""
    from mmserve.engine.encoder_cache import compute_encoder_budget
    from mmserve.engine.kv_cache_manager import KVCacheManager
    from mmserve.engine.scheduler import Scheduler, SchedulerConfig

    extra = {} if clock is None else {"clock": clock}
    return Scheduler(SchedulerConfig(4, 64, 4096, 4, delay_factor=delay_factor, policy=policy),
                     KVCacheManager(6, 4, False), compute_encoder_budget(32, 64, 4, 2, None),
                     **extra)


def _request(name: str, prompt_len: int, priority: int, arrival: float):
    from mmserve.engine.request import Request

    return Request(name, list(range(100, 100 + prompt_len)), SamplingParams(
        max_tokens=12, ignore_eos=True, priority=priority), eos_token_id=2,
        arrival_time=arrival)


def _drive(scheduler, arrivals: dict[int, list]) -> None:
    """Schedule and complete steps (every sampled token 5), adding ``arrivals[step]``."""
    from mmserve.step import ModelOutput

    for step in range(100):
        for req in arrivals.get(step, ()):
            scheduler.add_request(req)
        out = scheduler.schedule()
        scheduler.update(out, ModelOutput({rid: 5 for rid in out.sampling_ids()}))
        if not scheduler.has_unfinished() and step >= max(arrivals):
            return
    raise AssertionError("the requests did not finish")


def test_a_later_higher_priority_request_never_gives_way_to_a_lower_one() -> None:
    """The high-priority request is admitted after the low one, and whichever needs a new
    block first, the low one gives way (running stays in priority order, so the last is the
    one to preempt)."""
    for high_len in (3, 7):
        low, high = _request("low", 5, 9, 1.0), _request("high", high_len, 0, 2.0)
        _drive(_scheduler("priority"), {0: [low], 1: [high]})
        assert low.num_preemptions > 0 and high.num_preemptions == 0, high_len


def test_delay_factor_waits_on_the_oldest_waiting_request() -> None:
    """With a delay factor, admission waits on the request that has waited longest, not on
    the highest priority one, which may have just come."""
    from mmserve.step import ModelOutput

    now = [0.0]
    scheduler = _scheduler("priority", delay_factor=1.0, clock=lambda: now[0])

    def step_at(t: float) -> None:
        now[0] = t
        out = scheduler.schedule()
        scheduler.update(out, ModelOutput({rid: 5 for rid in out.sampling_ids()}))

    scheduler.add_request(_request("running", 3, 0, 0.0))
    step_at(0.0)  # admitted: a prompt step, which the next step times (1.5 s)
    scheduler.add_request(_request("old", 3, 5, 1.0))
    scheduler.add_request(_request("new", 3, 0, 1.5))
    step_at(1.5)
    step_at(2.0)  # the oldest has waited 1.0 s of the 1.5 s due: nobody is admitted
    assert [r.request_id for r in scheduler.waiting] == ["new", "old"]
    step_at(2.6)  # the oldest has waited 1.6 s (the newest only 1.1 s): both admitted
    assert not scheduler.waiting
    assert [r.request_id for r in scheduler.running] == ["running", "new", "old"]
