"""A step that fails is contained to the requests that cause it.

The engine is driven in-process (``LLM`` on the tiny clip-llama checkpoint in float32). Each
failure is one that validation at the door would refuse today, let through on purpose here by
changing a request's parameters after they were validated: the step must then finish that
request with ``finish_reason="error"``, give every other request the same greedy text it gets
alone, release every KV block and encoder reference, and leave the engine usable. Only steps
that keep failing for every request, old ones included, may stop the engine.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from mmserve import LLM, SamplingParams
from mmserve.engine.llm_engine import MAX_FAILED_STEPS
from mmserve.errors import EngineDeadError, InvalidInputError
from tests.conftest import assert_no_leaks, make_image

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
IMAGES = [make_image(i, size) for i, size in enumerate([(40, 30), (64, 64), (23, 57)])]
WHITE = Image.new("RGB", (32, 32), "white")  # the image the broken encoder below cannot take


def _chat(text: str, images: list) -> dict:
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}], "images": images}


PROMPTS = [_chat("what is this?", [IMAGES[0]]), _chat("and these two?", IMAGES[1:]),
           _chat("hello", [])]


@pytest.fixture(scope="module")
def llm(clip_llama: str) -> LLM:
    return LLM(clip_llama, dtype="float32", max_model_len=160, max_num_seqs=4)


@pytest.fixture(scope="module")
def alone(llm: LLM) -> list[str]:
    """Each prompt's greedy text, run by itself."""
    return [llm.generate(p, GREEDY)[0].text for p in PROMPTS]


def _poisoned(**changes: object) -> SamplingParams:
    """Parameters that passed validation, then were changed to values it refuses."""
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize("changes", [{"temperature": 1e-300}, {"temperature": 1e-45},
                                     {"seed": 2**64}, {"seed": -(2**63) - 1}])
def test_validation_refuses_what_breaks_a_step(changes: dict) -> None:
    name = next(iter(changes))
    with pytest.raises(InvalidInputError) as e:
        SamplingParams(**{"temperature": 1.0, **changes})
    assert e.value.param == name and name in str(e.value)


@pytest.mark.parametrize("changes", [{"temperature": 1e-300}, {"seed": 2**64}])
def test_a_failing_request_does_not_fail_the_batch(llm: LLM, alone: list[str],
                                                   changes: dict) -> None:
    params = [GREEDY] * len(PROMPTS) + [_poisoned(**changes)]
    outs = llm.generate([*PROMPTS, _chat("sample me", [IMAGES[0]])], params)
    assert [o.text for o in outs[:-1]] == alone
    assert all(o.finish_reason in ("stop", "length") for o in outs[:-1])
    bad = outs[-1]
    assert bad.finished and bad.finish_reason == "error"
    assert bad.error and ("RuntimeError" in bad.error or "probability" in bad.error
                          or "seed" in bad.error.lower() or "overflow" in bad.error.lower())
    assert_no_leaks(llm.engine)
    assert llm.stats()["num_failed_requests"] >= 1


def test_engine_is_reusable_with_one_sequence(clip_llama: str) -> None:
    """Finding: with max_num_seqs=1 the request a failed step left running made the next
    generate() spin for ever."""
    llm = LLM(clip_llama, dtype="float32", max_model_len=96, max_num_seqs=1)
    for _ in range(3):
        out = llm.generate(_chat("x", [IMAGES[0]]), _poisoned(temperature=1e-300))[0]
        assert out.finish_reason == "error"
        assert_no_leaks(llm.engine)
    expected = llm.generate(PROMPTS[2], GREEDY)[0]
    assert expected.finish_reason in ("stop", "length") and expected.token_ids


def test_failed_image_is_encoded_again_later(llm: LLM, alone: list[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An image whose encoding fails fails its request only; the entry the scheduler
    reserved for it is dropped, so the image is encoded anew when it comes back."""
    model = llm.engine.runner.model
    real_encode = model.encode_pixels
    broken = {"on": True}

    def encode_pixels(pixels: torch.Tensor) -> torch.Tensor:
        if broken["on"] and bool((pixels.flatten(1).min(dim=1).values > 1.0).any()):
            raise RuntimeError("the vision tower cannot take a white image")
        return real_encode(pixels)

    monkeypatch.setattr(model, "encode_pixels", encode_pixels)
    outs = llm.generate([*PROMPTS, _chat("white?", [WHITE])], GREEDY)
    assert [o.text for o in outs[:-1]] == alone
    assert outs[-1].finish_reason == "error" and "white image" in outs[-1].error
    assert_no_leaks(llm.engine)
    broken["on"] = False
    again = llm.generate(_chat("white?", [WHITE]), GREEDY)[0]
    assert again.finish_reason in ("stop", "length") and again.token_ids


def test_failed_request_leaves_nothing_in_the_prefix_cache(clip_llama: str) -> None:
    """Blocks a failed step may have half written are withdrawn from the prefix cache."""
    llm = LLM(clip_llama, dtype="float32", max_model_len=160, max_num_seqs=2, block_size=4)
    pool = llm.engine.scheduler.kv_cache.pool
    before = len(pool.cached)
    prompt = _chat("a prompt long enough to fill a few blocks " * 2, [IMAGES[2]])
    out = llm.generate(prompt, _poisoned(temperature=1e-300))[0]
    assert out.finish_reason == "error"
    assert len(pool.cached) == before
    ok = llm.generate(prompt, GREEDY)[0]
    assert ok.num_cached_tokens == 0 and ok.finish_reason in ("stop", "length")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_broken_device_stops_the_engine(clip_llama: str, monkeypatch: pytest.MonkeyPatch,
                                          async_scheduling: bool) -> None:
    """Steps that fail for every request, requests that ran fine before among them, mean the
    device or engine is broken: after MAX_FAILED_STEPS of them the engine says so, every
    request is finished and released, and later steps refuse at once. Scheduled ahead, the
    void step after each failure counts neither way."""
    llm = LLM(clip_llama, dtype="float32", max_model_len=96, max_num_seqs=4,
              async_scheduling=async_scheduling)
    engine = llm.engine
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(6):  # every request has generated tokens
        engine.step()

    def lost(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "_forward", lost)
    errors = []
    with pytest.raises(EngineDeadError, match="device lost"):
        for _ in range(3 * MAX_FAILED_STEPS):
            errors += [o for o in engine.step() if o.finish_reason == "error"]
    assert errors == []  # requests that ran fine before are retried, not failed, until then
    assert_no_leaks(engine)
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    with pytest.raises(EngineDeadError):
        engine.step()


def test_one_new_failing_request_at_a_time_never_stops_the_engine(llm: LLM,
                                                                   alone: list[str]) -> None:
    """Poisoned requests arriving one after another, each alone in its step, are each
    finished with an error; the engine stays up (they are new, not a broken device)."""
    for _ in range(MAX_FAILED_STEPS + 2):
        assert llm.generate(_chat("x", []), _poisoned(temperature=1e-45))[0].finish_reason \
            == "error"
    assert llm.generate(PROMPTS[0], GREEDY)[0].text == alone[0]


def test_a_request_that_ran_before_is_retried_after_a_failed_step(
        llm: LLM, alone: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails once for requests that had generated tokens (a transient error) is
    retried: they finish with the same text as alone, nothing fails, nothing leaks."""
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    real = engine.runner._forward
    calls = {"n": 0}

    def flaky(*args: object, **kwargs: object):  # noqa: ANN202
        calls["n"] += 1
        if calls["n"] <= 1 + len(PROMPTS):  # the batch and each request rerun alone
            raise RuntimeError("transient")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "_forward", flaky)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert calls["n"] > 1 + len(PROMPTS)
    assert [done[i].text for i in ids] == alone
    assert all(done[i].finish_reason in ("stop", "length") for i in ids)
    assert_no_leaks(engine)


def test_a_sampling_failure_fails_its_row_alone(llm: LLM,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose sampling fails is failed from the logits already computed: the
    forward pass is not run again, and a seeded neighbour draws exactly what it draws alone
    (its generator is not advanced twice)."""
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    expected = llm.generate(PROMPTS[0], seeded)[0].text
    real = llm.engine.runner._forward
    calls = {"n": 0}

    def counted(*args: object, **kwargs: object):  # noqa: ANN202
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "_forward", counted)
    steps_before = llm.stats()["num_steps"]
    outs = llm.generate([PROMPTS[0], _chat("x", [])], [seeded, _poisoned(temperature=1e-300)])
    assert outs[0].text == expected and outs[1].finish_reason == "error"
    assert calls["n"] == llm.stats()["num_steps"] - steps_before  # one forward per step
    assert_no_leaks(llm.engine)
