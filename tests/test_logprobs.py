"""Log-probabilities of generated tokens (``SamplingParams.logprobs``) and of prompt tokens
(``prompt_logprobs``): equal to transformers' log-softmax of the same logits within float32
rounding, the top alternatives the true top k, one entry per token through chunked prefill and
preemption, and bounded at the door.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.errors import InvalidInputError
from mmserve.testing.oracle import hf_token_logprobs, load_hf_processor
from tests.conftest import assert_no_leaks, make_image

PROMPTS = [
    {"messages": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "what is in this picture?"}]}],
     "images": [make_image(3, (40, 30))]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "tell me a story"}]}],
     "images": []},
]


@functools.cache
def _processor(path: str):
    return load_hf_processor(path)


def _reference(path: str, prompt: dict, token_ids: list[int]) -> torch.Tensor:
    text = _processor(path).apply_chat_template(prompt["messages"], add_generation_prompt=True,
                                                tokenize=False)
    return hf_token_logprobs(path, text, prompt["images"], token_ids)


def _check(out, reference: torch.Tensor, k: int) -> None:
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = reference[j]
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-5)
        assert entry.rank == int((row > row[token]).sum()) + 1
        values, ids = row.topk(k)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-5)


def test_greedy_logprobs_equal_transformers_log_softmax(clip_llama: str) -> None:
    llm = LLM(clip_llama, dtype="float32", max_model_len=256)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, logprobs=5))
    assert_no_leaks(llm.engine)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        _check(out, _reference(clip_llama, prompt, out.token_ids), 5)
        assert all(entry.rank == 1 for entry in out.logprobs)  # greedy takes the top token


def test_sampled_tokens_get_the_models_logprobs_not_the_tempered_ones(clip_llama: str) -> None:
    """As vLLM returns by default: the log-softmax of the raw logits, before temperature, top-k
    and top-p shaped the distribution the token was drawn from."""
    llm = LLM(clip_llama, dtype="float32", max_model_len=256)
    params = SamplingParams(max_tokens=10, temperature=1.7, top_k=50, seed=11, logprobs=3)
    (out,) = llm.generate(PROMPTS[1], params)
    _check(out, _reference(clip_llama, PROMPTS[1], out.token_ids), 3)
    assert any(entry.rank > 1 for entry in out.logprobs)
    # Asking for logprobs changes nothing about which tokens come out.
    (plain,) = llm.generate(PROMPTS[1], SamplingParams(max_tokens=10, temperature=1.7,
                                                       top_k=50, seed=11))
    assert plain.token_ids == out.token_ids and plain.logprobs is None


def test_logprobs_through_chunked_prefill_and_preemption_beside_other_requests(
        clip_llama: str) -> None:
    # 8 blocks of 16 tokens (512 bytes a token in float32): one long request fits, four do not;
    # scheduled in step, as scheduled ahead (a GPU's default) nobody is preempted.
    llm = LLM(clip_llama, dtype="float32", max_model_len=128, max_num_batched_tokens=16,
              block_size=16, max_num_seqs=4, kv_cache_memory=8 * 16 * 512,
              enable_prefix_caching=False, async_scheduling=False)
    prompts = PROMPTS * 3
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                             logprobs=(i % 3) if i % 2 == 0 else None,
                             prompt_logprobs=1 if i % 3 == 0 else None)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] > 0
    assert_no_leaks(llm.engine)
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        if p.prompt_logprobs is not None:  # recomputed after a preemption: each once
            ids, reference = _prompt_reference(clip_llama, prompt)
            assert len(out.prompt_logprobs) == len(ids)
            assert [e.logprob for e in out.prompt_logprobs[1:]] == pytest.approx(
                [reference[i - 1][ids[i]].item() for i in range(1, len(ids))], abs=1e-5)
        if p.logprobs is None:
            assert out.logprobs is None
            continue
        _check(out, _reference(clip_llama, prompt, out.token_ids), p.logprobs)


def _prompt_reference(path: str, prompt: dict) -> tuple[list[int], torch.Tensor]:
    """transformers' prompt ids (images expanded) and its log-softmax at every position."""
    from mmserve.testing.oracle import _load_hf

    model, processor = _load_hf(path)
    text = _processor(path).apply_chat_template(prompt["messages"], add_generation_prompt=True,
                                                tokenize=False)
    inputs = processor(text=text, images=prompt["images"] or None, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0]
    return inputs["input_ids"][0].tolist(), torch.log_softmax(logits.float(), dim=-1)


def test_prompt_logprobs_through_chunks_that_split_an_image(clip_llama: str) -> None:
    """Every prompt token after the first, image placeholders included, with chunks of 8
    tokens splitting the image; a second identical request computes its prompt again rather
    than taking the first one's blocks from the prefix cache."""
    llm = LLM(clip_llama, dtype="float32", max_model_len=256, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2, logprobs=1)
    for prompt in PROMPTS:
        ids, reference = _prompt_reference(clip_llama, prompt)
        first, again = (llm.generate(prompt, params)[0] for _ in range(2))
        for out in (first, again):
            assert out.num_prompt_tokens == len(ids)
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
            for pos in range(1, len(ids)):
                entry, row = out.prompt_logprobs[pos], reference[pos - 1]
                assert entry.logprob == pytest.approx(row[ids[pos]].item(), abs=1e-5)
                assert [t for t, _ in entry.top] == row.topk(2).indices.tolist()
        assert again.num_cached_tokens == 0
    plain = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # it may use the cache
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("bad", [-1, 21, 2.5, True, "5"])
def test_logprobs_out_of_range_is_refused(bad, name) -> None:
    with pytest.raises(InvalidInputError, match=f"{name} must be None or an integer from 0 "
                                                "to 20") as e:
        SamplingParams(**{name: bad})
    assert e.value.param == name
