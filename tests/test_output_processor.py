"""The output processor: request outputs from the engine core's tokens, as each output kind
asks; a stop string finishes the output and names the request (the core ran it on: what it
sends later is dropped); failures; refused and aborted requests forgotten. The engine's own
steps run it too, so every test of outputs in one process covers it as well; these give it
core outputs directly, as the engine core process's front end does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from mmserve.engine.output_processor import CoreOutput, OutputProcessor
from mmserve.sampling_params import SamplingParams
from mmserve.step import TokenLogprobs

TEXT = "the cat sat on the mat, then ran away"


@pytest.fixture(scope="module")
def tokenizer(clip_llama: str):
    return AutoTokenizer.from_pretrained(clip_llama)


def request(rid: str, **params) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, sampling_params=SamplingParams(**params),
                           num_prompt_tokens=7, prompt_token_ids=list(range(7)))


def lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(-0.25 * token, 1, ((token, -0.25 * token),))


def run(proc: OutputProcessor, rid: str, ids: list[int], last_reason: str | None = None):
    """Feed ``ids`` one step each (the last with ``last_reason``); every step's outputs and
    the requests named as stopped."""
    outputs, stopped = [], []
    for i, token in enumerate(ids):
        reason = last_reason if i == len(ids) - 1 else None
        got, names = proc.process([CoreOutput(rid, [token], reason, None, 3, lp(token))])
        outputs += got
        stopped += names
    return outputs, stopped


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_a_stop_string_ends_the_output_and_later_tokens_are_dropped(tokenizer, kind: str
                                                                    ) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add(request("r", stop=["mat"], logprobs=1, output_kind=kind))
    outputs, stopped = run(proc, "r", ids)  # the core runs on until it hears of the stop
    assert stopped == ["r"] and "r" not in proc and len(proc) == 0
    final = outputs[-1]
    assert (final.finished, final.finish_reason) == (True, "stop")
    assert sum(o.finished for o in outputs) == 1
    n = len(outputs) if kind == "delta" else len(final.token_ids)
    kept = ids[:n]  # through the token that completed "mat"
    assert tokenizer.decode(kept).endswith("mat")
    if kind == "delta":
        assert "".join(o.text for o in outputs) == "the cat sat on the "
        assert [t for o in outputs for t in o.token_ids] == kept
        assert [e for o in outputs for e in o.logprobs] == [lp(t) for t in kept]
    else:
        assert len(outputs) == (1 if kind == "final_only" else len(kept))
        assert (final.text, final.token_ids) == ("the cat sat on the ", kept)
        assert final.logprobs == [lp(t) for t in kept]
        assert final.new_token_ids == (kept if kind == "final_only" else kept[-1:])
    assert final.num_prompt_tokens == 7 and final.num_cached_tokens == 3


def test_the_cores_finish_prompt_logprobs_and_text_held_back(tokenizer) -> None:
    """Text that may begin a stop string is held back until it cannot; the core's finish
    releases it, with the prompt logprobs that came with the first token."""
    ids = tokenizer.encode("the cat", add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add(request("r", stop=["cats"], output_kind="delta"))
    prompt = [None, lp(5)]
    first, _ = proc.process([CoreOutput("r", ids[:1], prompt_logprobs=prompt)])
    rest, stopped = run(proc, "r", ids[1:], "length")
    outputs = first + rest
    assert stopped == [] and "".join(o.text for o in outputs) == "the cat"
    assert outputs[-1].finish_reason == "length" and outputs[-1].prompt_logprobs == prompt
    assert all(o.prompt_logprobs is None for o in outputs[:-1])
    assert outputs[-1].logprobs is None  # not asked for


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_failures(tokenizer, kind: str) -> None:
    """A grammar that refuses the sampled token: the token and its logprobs go out with the
    error; a failure that sampled nothing adds nothing."""
    ids = tokenizer.encode("the cat", add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add(request("refused", logprobs=0, output_kind=kind))
    proc.add(request("failed", output_kind=kind))
    run(proc, "refused", ids[:-1])
    (refused,), _ = proc.process([CoreOutput("refused", ids[-1:], "error", "breaks the grammar",
                                             0, lp(ids[-1]))])
    run(proc, "failed", ids)
    (failed,), _ = proc.process([CoreOutput("failed", [], "error", "no memory")])
    assert (refused.finish_reason, refused.error) == ("error", "breaks the grammar")
    assert (failed.finish_reason, failed.error, failed.prompt_logprobs) == (
        "error", "no memory", None)
    assert len(proc) == 0
    if kind == "delta":
        assert (refused.token_ids, refused.logprobs) == (ids[-1:], [lp(ids[-1])])
        assert failed.token_ids == []
    else:
        assert (refused.text, refused.token_ids) == ("the cat", ids)
        assert refused.logprobs == [lp(t) for t in ids]
        assert (failed.text, failed.token_ids) == ("the cat", ids)
        if kind == "cumulative":
            assert (refused.new_text, refused.new_token_ids) == ("", [])


def test_aborted_and_unknown_requests_give_nothing(tokenizer) -> None:
    proc = OutputProcessor(tokenizer)
    proc.add(request("a"))
    proc.abort("a")
    proc.abort("never-added")
    assert proc.process([CoreOutput("a", [5]), CoreOutput("b", [6], "length")]) == ([], [])
    assert len(proc) == 0
