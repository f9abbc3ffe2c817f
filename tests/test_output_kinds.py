"""``SamplingParams.output_kind``: what a request's step outputs hold. ``cumulative`` (the
default) everything so far, ``delta`` only what the step added, ``final_only`` one output at
the end. Whatever the kind, the pieces add up to the same text, tokens and log-probabilities.
"""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.errors import InvalidInputError
from tests.conftest import assert_no_leaks, make_image

PROMPT = {"messages": [{"role": "user", "content": [
    {"type": "image"}, {"type": "text", "text": "what is in this picture?"}]}],
    "images": [make_image(3, (48, 40))]}


@pytest.fixture(scope="module")
def llm(clip_llama: str) -> LLM:
    return LLM(clip_llama, dtype="float32", max_model_len=160, max_num_seqs=4)


def _params(kind: str, **changes: object) -> SamplingParams:
    # A stop string that never comes holds back its length less one character each step.
    return SamplingParams(**{"max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
                             "stop": ["\x00never"], "logprobs": 2, "output_kind": kind,
                             **changes})


def _run_together(llm: LLM, params: dict[str, SamplingParams]) -> dict[str, list]:
    """Each request's step outputs, the requests run side by side in one engine."""
    engine = llm.engine
    ids = {kind: engine.add_request(PROMPT, p) for kind, p in params.items()}
    seen: dict[str, list] = {rid: [] for rid in ids.values()}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            seen[out.request_id].append(out)
    assert_no_leaks(engine)
    return {kind: seen[rid] for kind, rid in ids.items()}


def test_every_kind_adds_up_to_the_same_output(llm: LLM) -> None:
    outs = _run_together(llm, {k: _params(k) for k in ("cumulative", "delta", "final_only")})
    cumulative, delta, final = outs["cumulative"], outs["delta"], outs["final_only"]
    whole = cumulative[-1]
    assert whole.finished and len(whole.token_ids) == 12 and len(whole.logprobs) == 12
    assert [len(o.token_ids) for o in cumulative] == list(range(1, 13))
    assert "".join(o.new_text for o in cumulative) == whole.text
    assert [t for o in cumulative for t in o.new_token_ids] == whole.token_ids

    # delta: one token a step, text and logprobs of that step alone, the last one finished
    assert len(delta) == 12 and [o.finished for o in delta] == [False] * 11 + [True]
    assert all(len(o.token_ids) == 1 == len(o.logprobs) for o in delta)
    assert all(o.text == o.new_text and o.token_ids == o.new_token_ids for o in delta)
    assert "".join(o.text for o in delta) == whole.text
    assert [t for o in delta for t in o.token_ids] == whole.token_ids
    assert [lp for o in delta for lp in o.logprobs] == whole.logprobs
    # held back alike: the stop string's length less one character, until the end
    assert [o.text for o in delta] == [o.new_text for o in cumulative]
    assert delta[0].text == "" < cumulative[0].text

    # final_only: nothing until the end, then everything, "new" included
    assert len(final) == 1 and final[0].finished
    assert (final[0].text, final[0].token_ids, final[0].logprobs) == (
        whole.text, whole.token_ids, whole.logprobs)
    assert final[0].new_text == whole.text and final[0].new_token_ids == whole.token_ids
    assert final[0].finish_reason == whole.finish_reason == "length"


def test_a_delta_request_keeps_no_log_probabilities_it_sent(llm: LLM) -> None:
    engine = llm.engine
    rid = engine.add_request(PROMPT, _params("delta", max_tokens=8))
    kept = []
    while engine.has_unfinished_requests():
        engine.step()
        if rid in engine.output_processor:
            kept.append(len(engine.output_processor._outputs[rid].logprobs))
    assert kept and max(kept) == 0
    assert_no_leaks(engine)


def test_a_stop_string_ends_every_kind_alike(llm: LLM) -> None:
    free = _run_together(llm, {"cumulative": _params("cumulative", stop=None)})
    text = free["cumulative"][-1].text
    if len(text) < 4:
        pytest.skip(f"the tiny model's greedy text {text!r} is too short to stop inside")
    stop = text[2:4]
    outs = _run_together(llm, {k: _params(k, stop=[stop])
                               for k in ("cumulative", "delta", "final_only")})
    expected = outs["cumulative"][-1]
    assert expected.text == text[:2] and expected.finish_reason == "stop"
    assert "".join(o.text for o in outs["delta"]) == expected.text
    assert outs["final_only"][0].text == expected.text


def test_a_failed_delta_request_ends_with_an_error_and_no_tokens(llm: LLM) -> None:
    params = _params("delta", temperature=1.0, seed=1)
    params.seed = 2**64  # validated, then changed to a seed the generator refuses
    outs = _run_together(llm, {"delta": params, "final_only": _params("final_only")})
    (failed,) = outs["delta"]
    assert failed.finish_reason == "error" and failed.error
    assert failed.token_ids == [] and failed.logprobs == []
    assert len(outs["final_only"]) == 1 and outs["final_only"][0].finish_reason == "length"


def test_a_token_its_grammar_refuses_comes_with_the_delta_error_output(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refused token was sampled and decoded but no output carried it yet: the delta
    error output does, so the pieces add up to what a cumulative request reports."""
    monkeypatch.setattr(llm.engine._matchers, "accept", lambda rid, token: (False, False))
    choice = {"choice": ["yes", "no"]}
    outs = _run_together(llm, {k: _params(k, structured_outputs=choice)
                               for k in ("cumulative", "delta", "final_only")})
    (whole,), (delta,), (final,) = outs["cumulative"], outs["delta"], outs["final_only"]
    assert whole.finish_reason == delta.finish_reason == final.finish_reason == "error"
    assert len(whole.token_ids) == 1 and len(whole.logprobs) == 1
    for out in (delta, final):
        assert (out.text, out.token_ids, out.logprobs) == (
            whole.text, whole.token_ids, whole.logprobs)
        assert (out.new_text, out.new_token_ids) == (whole.text, whole.token_ids)


def test_generate_returns_whole_outputs_whatever_the_kind(clip_llama: str) -> None:
    # A call each, every one computed alike: on a GPU a prefill over a prefix an earlier call
    # cached, or in a batch of other rows, may round its log-probabilities differently.
    with LLM(clip_llama, dtype="float32", max_model_len=160, max_num_seqs=4,
             enable_prefix_caching=False) as llm:
        outs = [llm.generate(PROMPT, _params(k))[0]
                for k in ("cumulative", "delta", "final_only")]
    assert len(outs[0].token_ids) == 12
    assert all((o.text, o.token_ids, o.logprobs) == (outs[0].text, outs[0].token_ids,
                                                    outs[0].logprobs) for o in outs)


def test_an_unknown_kind_is_refused_by_name() -> None:
    with pytest.raises(InvalidInputError) as e:
        SamplingParams(output_kind="streaming")
    assert e.value.param == "output_kind" and "cumulative, delta, final_only" in str(e.value)


def test_each_engine_steps_the_way_its_outputs_are_made(llm: LLM, clip_llama: str) -> None:
    """An engine makes its outputs (``step``) or leaves them to its front end (built with
    ``detokenize=False``: ``core_step``); the other call is refused before it steps."""
    from mmserve import EngineConfig
    from mmserve.engine.llm_engine import LLMEngine

    with pytest.raises(RuntimeError, match="makes its own outputs"):
        llm.engine.core_step()
    core = LLMEngine(EngineConfig(model=clip_llama, device="cpu", dtype="float32",
                                  max_model_len=160, max_num_seqs=2), detokenize=False)
    try:
        rid = core.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0.0,
                                                      ignore_eos=True, stop=["never"]))
        with pytest.raises(RuntimeError, match="call core_step"):
            core.step()
        assert core.num_steps == 0 and core.has_unfinished_requests()
        outs = []
        while core.has_unfinished_requests():
            outs += core.core_step()
        assert [(o.request_id, len(o.new_token_ids), o.finish_reason) for o in outs] == [
            (rid, 1, None), (rid, 1, None), (rid, 1, "length")]
        assert_no_leaks(core)
    finally:
        core.close()
