"""What requests ask of the logits before a token is picked (``allowed_token_ids``,
``logit_bias``, the presence, frequency and repetition penalties, ``min_tokens``, ``min_p``):
greedy float32 output equal to transformers' ``generate`` with its own processors for the same
(a processor written here for OpenAI's presence and frequency penalties, which transformers
lacks), kept through chunked prefill, prefix-cache hits, preemption and other requests in the
batch, and nothing kept once requests finish.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.errors import InvalidInputError
from mmserve.testing.oracle import hf_greedy_generate, load_hf_processor
from mmserve.worker import logits_adjust
from mmserve.worker.logits_adjust import TokenHistory, adjust_logits
from mmserve.worker.sampler import sample_each
from tests.conftest import assert_no_leaks
from tests.test_logprobs import PROMPTS  # an image prompt, a text prompt

MAX_TOKENS = 24


@functools.cache
def _processor(path: str):
    return load_hf_processor(path)


def _reference(path: str, prompt: dict, **generate_kwargs) -> list[int]:
    text = _processor(path).apply_chat_template(prompt["messages"], add_generation_prompt=True,
                                                tokenize=False)
    return hf_greedy_generate(path, text, prompt["images"], MAX_TOKENS, generate_kwargs)


class OpenAIPenalties:
    """transformers logits processor for OpenAI's presence and frequency penalties, over the
    tokens generated after ``prompt_len``."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


def _prompt_len(path: str, prompt: dict) -> int:
    processor = _processor(path)
    text = processor.apply_chat_template(prompt["messages"], add_generation_prompt=True,
                                         tokenize=False)
    return processor(text=text, images=prompt["images"] or None,
                     return_tensors="pt")["input_ids"].shape[1]


@pytest.fixture(scope="module")
def llm(clip_llama: str):
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        yield llm


def _greedy(llm: LLM, prompt: dict, **fields) -> list[int]:
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                 **fields))
    assert_no_leaks(llm.engine)
    return out.token_ids


@pytest.mark.parametrize("penalty", [1.3, 0.5])
@pytest.mark.parametrize("which", [0, 1], ids=["image", "text"])
def test_repetition_penalty_equals_transformers(llm: LLM, clip_llama: str, which: int,
                                                penalty: float) -> None:
    prompt = PROMPTS[which]
    ours = _greedy(llm, prompt, repetition_penalty=penalty)
    assert ours == _reference(clip_llama, prompt, repetition_penalty=penalty)
    assert ours != _greedy(llm, prompt)  # the penalty matters here


def test_logit_bias_equals_transformers_sequence_bias(llm: LLM, clip_llama: str) -> None:
    plain = _greedy(llm, PROMPTS[0])
    bias = {plain[0]: -100.0, plain[3]: 4.5, 17: -2.0}
    ours = _greedy(llm, PROMPTS[0], logit_bias=bias)
    assert ours == _reference(clip_llama, PROMPTS[0],
                              sequence_bias={(t,): b for t, b in bias.items()})
    assert ours[0] != plain[0]


@pytest.mark.parametrize("which", [0, 1], ids=["image", "text"])
def test_allowed_token_ids_equal_transformers_prefix_allowed_tokens(
        llm: LLM, clip_llama: str, which: int) -> None:
    """vLLM's ``allowed_token_ids`` against transformers' ``prefix_allowed_tokens_fn`` (the
    same set every step): some of the tokens the model picks unconstrained, some it never
    would, and a bias on top."""
    plain = _greedy(llm, PROMPTS[which])
    allowed = sorted({*plain[1:8:2], 3, 90, 250, 401})
    ours = _greedy(llm, PROMPTS[which], allowed_token_ids=[*allowed, allowed[0]])
    assert ours == _reference(clip_llama, PROMPTS[which],
                              prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    assert set(ours) <= set(allowed) and ours != plain
    # Beside requests without it, and with a bias: the bias applies within the set.
    biased = llm.generate([PROMPTS[which], PROMPTS[1 - which]], [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, allowed_token_ids=allowed,
                       logit_bias={90: 100.0}),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)])
    assert set(biased[0].token_ids) == {90}
    assert biased[1].token_ids == _greedy(llm, PROMPTS[1 - which])
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 0.8), (-0.5, 2.0)])
def test_presence_and_frequency_penalties_equal_openais_definition(
        llm: LLM, clip_llama: str, presence: float, frequency: float) -> None:
    prompt = PROMPTS[1]
    ours = _greedy(llm, prompt, presence_penalty=presence, frequency_penalty=frequency)
    processor = OpenAIPenalties(_prompt_len(clip_llama, prompt), presence, frequency)
    assert ours == _reference(clip_llama, prompt, logits_processor=[processor])
    assert ours != _greedy(llm, prompt)


def test_logprobs_stay_the_models(llm: LLM, clip_llama: str) -> None:
    """A token forced by logit_bias comes back with the log-probability the model gave it,
    not the biased one (as vLLM's default), beside a row that asks for none."""
    from mmserve.testing.oracle import hf_token_logprobs

    params = [SamplingParams(max_tokens=4, temperature=0.0, logit_bias={17: 100.0},
                             logprobs=1),
              SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=0.5)]
    forced, other = llm.generate(PROMPTS[1:] * 2, params)
    assert forced.token_ids == [17] * 4
    assert other.token_ids == _greedy(llm, PROMPTS[1], repetition_penalty=0.5)[:4]
    text = _processor(clip_llama).apply_chat_template(PROMPTS[1]["messages"],
                                                      add_generation_prompt=True,
                                                      tokenize=False)
    reference = hf_token_logprobs(clip_llama, text, [], forced.token_ids)
    for j, entry in enumerate(forced.logprobs):
        assert entry.logprob == pytest.approx(reference[j, 17].item(), abs=1e-5)
        assert entry.logprob < -1  # the model alone would not pick it
    assert_no_leaks(llm.engine)


def test_min_tokens_equals_transformers_min_new_tokens(llm: LLM, clip_llama: str) -> None:
    """A stop token greedy decoding reaches at its third token is held back until 6 are
    generated (transformers: the same token among the end tokens, ``min_new_tokens``)."""
    stop = _greedy(llm, PROMPTS[0])[2]
    (short,) = llm.generate(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                       stop_token_ids=[stop]))
    assert len(short.token_ids) == 3 and short.finish_reason == "stop"
    ours = _greedy(llm, PROMPTS[0], stop_token_ids=[stop], min_tokens=6)
    eos = _processor(clip_llama).tokenizer.eos_token_id
    reference = _reference(clip_llama, PROMPTS[0], min_new_tokens=6, eos_token_id=[eos, stop])
    assert ours == reference and len(ours) >= 6 and stop not in ours[:6]


def test_min_p_keeps_the_tokens_near_the_most_likely() -> None:
    """Probabilities 0.5, 0.3, 0.15, 0.05 under min_p 0.5 keep the first two (at least 0.25):
    the others are never drawn, both kept ones are; transformers' ``MinPLogitsWarper`` keeps
    the same tokens of random rows."""
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(400, 1)
    params = [SamplingParams(temperature=1.0, min_p=0.5)] * 400
    generator = torch.Generator().manual_seed(5)
    drawn = sample_each(logits, params, lambda i: generator)
    assert set(drawn) == {0, 1}
    from mmserve.worker.sampler import _min_p

    rows = torch.randn(8, 50, generator=torch.Generator().manual_seed(1)) * 3
    for min_p in (0.02, 0.3, 0.9):
        ours = torch.isfinite(_min_p(rows, [min_p] * 8))
        theirs = torch.isfinite(MinPLogitsWarper(min_p)(None, rows.clone()))
        assert torch.equal(ours, theirs)
        assert ours.sum(-1).min() >= 1


@pytest.mark.parametrize("sparse", [True, False], ids=["seen tokens (CPU)", "whole rows (GPU)"])
def test_penalties_equal_their_definition_bit_for_bit(sparse: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of a batch with and without penalties, histories of prompt and generated tokens
    (recorded from step token tensors, then counted afresh), against the penalties computed
    token by token in float32; whole rows two at a time."""
    monkeypatch.setattr(logits_adjust, "DENSE_ROWS", 2)
    vocab = 300
    g = torch.Generator().manual_seed(3)
    history = TokenHistory(vocab, torch.device("cpu"))
    history.sparse = sparse
    ids = ["a", "b", "c", "d"]
    params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4),
              SamplingParams(temperature=0.0),  # nothing asked: untouched
              SamplingParams(repetition_penalty=0.3),
              SamplingParams(frequency_penalty=-1.1, presence_penalty=2.0, logit_bias={9: -3.5})]
    prompts = {rid: torch.randint(vocab, (40,), generator=g).tolist() for rid in ids}
    generated: dict[str, list[int]] = {rid: [] for rid in ids}
    for rid, p in zip(ids, params, strict=True):
        if p.uses_history:
            history.follow(rid, p, prompts[rid], len(prompts[rid]))
    for _ in range(30):  # steps: every request samples a token, the first two from one tensor
        step = torch.randint(vocab // 10, (4,), generator=g)  # few distinct: repeats
        history.record({rid: (step, i) for i, rid in enumerate(ids)})
        for i, rid in enumerate(ids):
            generated[rid].append(int(step[i]))
    # A step that failed after counting its tokens: the requests are counted afresh from
    # the tokens they have (as after a retry, or a preemption), and it leaves no trace.
    history.record({rid: (torch.full((4,), 7), i) for i, rid in enumerate(ids)})
    for rid, p in zip(ids, params, strict=True):
        if p.uses_history:
            history.follow(rid, p, prompts[rid] + generated[rid], len(prompts[rid]))
    logits = torch.randn(4, vocab, generator=g) * 4
    out = adjust_logits(logits, ids, params, history, in_place=False)
    expected = logits.clone()
    for i, (rid, p) in enumerate(zip(ids, params, strict=True)):
        if not p.adjusts_logits:
            continue
        for t, bias in (p.logit_bias or {}).items():
            expected[i, t] += bias
        if not p.uses_history:
            continue
        seen = set(generated[rid]) | (set(prompts[rid]) if p.repetition_penalty != 1 else set())
        penalty, frequency, presence = (torch.tensor(v, dtype=torch.float32) for v in (
            p.repetition_penalty, p.frequency_penalty, p.presence_penalty))  # as a tensor's
        for t in seen:
            v = expected[i, t]
            v = v / penalty if v > 0 else v * penalty
            c = generated[rid].count(t)
            v = v - frequency * c - presence * (c > 0)
            expected[i, t] = v
    assert torch.equal(out, expected)
    assert not torch.equal(out[0], logits[0]) and torch.equal(out[1], logits[1])
    assert history.num_generated == {"a": 30, "c": 30, "d": 30}


def test_min_tokens_leaves_a_grammars_only_token() -> None:
    """A row whose logits allow only an end token (its grammar's bitmask) keeps it under
    min_tokens rather than having no token at all; other rows lose theirs."""
    history = TokenHistory(6, torch.device("cpu"))
    params = SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=[3]).with_end_tokens([2])
    assert params.min_tokens_blocked == (2, 3)
    assert params.child(1).min_tokens_blocked == (2, 3)  # the n completions' too
    unblocked = SamplingParams(min_tokens=4, ignore_eos=True).with_end_tokens([2, 7])
    assert unblocked.min_tokens_blocked == ()
    several = SamplingParams(max_tokens=8, min_tokens=2).with_end_tokens([2, 7])
    assert several.min_tokens_blocked == (2, 7)
    for rid in ("a", "b"):
        history.follow(rid, params, [5, 1], 2)
    inf = float("-inf")
    logits = torch.tensor([[inf, inf, 1.0, inf, inf, inf], [0.0, 1.0, 2.0, 3.0, 0.5, 0.0]])
    out = adjust_logits(logits, ["a", "b"], [params, params], history, in_place=False)
    assert out[0].tolist() == logits[0].tolist()
    assert out[1, 2] == inf and out[1, 3] == inf and out[1, 1] == 1.0
    history.drop(["a", "b"])
    assert len(history) == 0


def test_stop_strings_wait_for_min_tokens(llm: LLM) -> None:
    """A stop string in the text of the first ``min_tokens`` tokens does not stop; one that
    the token after them completes does (vLLM's rule)."""
    tokenizer = llm.engine.processor.tokenizer
    ids = tokenizer.encode("the cat sat on the mat", add_special_tokens=False)

    def run(stop: str, min_tokens: int) -> tuple[bool, str]:
        detok = IncrementalDetokenizer(tokenizer, [stop], min_tokens)
        for t in ids:
            detok.add(t)
            if detok.stopped:
                break
        return detok.stopped, detok.text

    assert run("cat", 0) == (True, "the ")
    assert run("cat", len(ids)) == (False, "the cat sat on the mat")
    assert run("mat", len(ids)) == (False, "the cat sat on the mat")
    assert run("mat", len(ids) - 1) == (True, "the cat sat on the ")


def test_through_chunked_prefill_cache_hits_and_preemption_beside_others(
        clip_llama: str) -> None:
    """Each request alone against all of them at once in a small KV cache (chunked prefill,
    preemptions), then again with their prompts' blocks in the prefix cache (the repetition
    penalty counts the cached tokens too): the same tokens, seeded sampling included."""
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=0.5),
        SamplingParams(max_tokens=20, temperature=0.0, presence_penalty=1.0,
                       frequency_penalty=0.5, logit_bias={17: 3.0}),
        SamplingParams(max_tokens=20, temperature=0.0),
        SamplingParams(max_tokens=20, temperature=0.9, seed=4, min_p=0.1,
                       repetition_penalty=1.4, min_tokens=12, frequency_penalty=0.3),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[1]]
    settings = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=16,
                    block_size=16, max_num_seqs=4, kv_cache_memory=8 * 16 * 512,
                    async_scheduling=False)
    with LLM(clip_llama, **settings) as llm:
        alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params,
                                                                    strict=True)]
        together = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.stats()["num_preemptions"] > 0
        again = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.stats()["prefix_cache_hit_tokens"] > 0
        assert_no_leaks(llm.engine)
    assert together == alone and again == alone
    assert len(alone[3]) >= 12


def test_out_of_range_values_are_refused(llm: LLM) -> None:
    vocab = llm.engine.grammars.vocab_size
    with pytest.raises(InvalidInputError, match=f"vocabulary has {vocab} tokens") as e:
        llm.generate(PROMPTS[1], SamplingParams(logit_bias={vocab: 1.0}))
    assert e.value.param == "logit_bias"
    with pytest.raises(InvalidInputError, match=f"vocabulary has {vocab} tokens") as e:
        llm.generate(PROMPTS[1], SamplingParams(allowed_token_ids=[1, vocab]))
    assert e.value.param == "allowed_token_ids"
    with pytest.raises(InvalidInputError, match="send one of them") as e:
        llm.generate(PROMPTS[1], SamplingParams(allowed_token_ids=[1], structured_outputs={
            "regex": "a+"}))
    end = llm.engine.processor.eos_token_ids[0]
    with pytest.raises(InvalidInputError, match="min_tokens holds back") as e:
        llm.generate(PROMPTS[1], SamplingParams(allowed_token_ids=[end], min_tokens=2))
    assert e.value.param == "allowed_token_ids"
    for fields, param in (({"min_p": -0.1}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"),
                          ({"allowed_token_ids": []}, "allowed_token_ids"),
                          ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
                          ({"allowed_token_ids": "1,2"}, "allowed_token_ids"),
                          ({"allowed_token_ids": list(range(1025))}, "allowed_token_ids"),
                          ({"repetition_penalty": float("inf")}, "repetition_penalty"),
                          ({"logit_bias": {"5": 1.0}}, "logit_bias"),
                          ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
                          ({"min_tokens": 17}, "min_tokens")):
        with pytest.raises(InvalidInputError) as e:
            SamplingParams(**fields)
        assert e.value.param == param
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("ahead", [False, True], ids=["in step", "scheduled ahead"])
def test_a_retried_request_counts_its_tokens_afresh(clip_llama: str, ahead: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose tokens were counted fails for a request after sampling (its
    log-probabilities, computed once the tokens reach Python, as on a GPU): the request is
    retried, and its penalties count the tokens it has, not the failed step's too."""
    from mmserve.worker import model_runner
    from mmserve.worker.model_runner import CPUModelRunner

    monkeypatch.setattr(CPUModelRunner, "defer_sampled_tokens", True)
    params = [SamplingParams(max_tokens=16, temperature=0.0, frequency_penalty=2.0,
                             presence_penalty=1.0, min_tokens=12, logprobs=3),
              SamplingParams(max_tokens=16, temperature=0.0, logprobs=1)]
    real = model_runner.token_logprobs

    def run(fail: bool) -> list:
        calls = {"n": 0, "failing": False}

        def flaky(logits, tokens, num_top):  # noqa: ANN202
            if fail and 3 in num_top:
                calls["n"] += 1
                if calls["n"] == 5 or (calls["failing"] and num_top == [3]):
                    calls["failing"] = len(num_top) > 1  # then the request's own, alone
                    raise RuntimeError("transient")
            return real(logits, tokens, num_top)

        monkeypatch.setattr(model_runner, "token_logprobs", flaky)
        with LLM(clip_llama, dtype="float32", device="cpu", max_model_len=256,
                 async_scheduling=ahead) as llm:
            outs = llm.generate(PROMPTS, params)
            assert_no_leaks(llm.engine)
            failed = llm.engine.num_failed_requests
        assert not fail or calls["n"] >= 5
        return [(o.token_ids, o.finish_reason, failed) for o in outs]

    expected = run(False)
    assert run(True) == expected
