"""vLLM's ``bad_words``: words the output may not contain. Greedy float32 output equal to
transformers' ``generate(bad_words_ids=...)`` for the same token sequences; the ban found on the
device from each request's last tokens, so it holds through asynchronous scheduling,
preemption, chunked prefill and a retried step; the words tokenized as vLLM does; refusals
over HTTP; nothing kept once requests finish.
"""

from __future__ import annotations

import functools

import pytest
import torch
from starlette.testclient import TestClient

from mmserve import LLM, SamplingParams
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.serve_args import ServerConfig
from mmserve.errors import InvalidInputError
from mmserve.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS
from mmserve.testing.oracle import hf_greedy_generate, load_hf_processor
from mmserve.worker.logits_adjust import TAIL, TokenHistory, adjust_logits
from tests.conftest import assert_no_leaks
from tests.test_logprobs import PROMPTS  # an image prompt, a text prompt

MAX_TOKENS = 24


@functools.cache
def _processor(path: str):
    return load_hf_processor(path)


@pytest.fixture(scope="module")
def llm(clip_llama: str):
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        yield llm


def _params(**fields) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, **fields})


def _words_from(llm: LLM, tokens: list[int], spans: list[tuple[int, int]]) -> list[str]:
    """The text of each span of ``tokens``, where that text is those tokens again (the
    tiny tokenizer's bytes may not round-trip)."""
    processor = llm.engine.processor
    words = []
    for start, length in spans:
        for s in range(start, len(tokens) - length):
            word = processor.decode(tokens[s:s + length])
            if word.strip() and processor.encode(word.lstrip()) == tokens[s:s + length]:
                words.append(word)
                break
    assert len(words) == len(spans)
    return words


def _token_ids(llm: LLM, words: list[str]) -> list[list[int]]:
    vocab = llm.engine.grammars.vocab_size
    params = SamplingParams(bad_words=words).with_bad_words(llm.engine.processor.encode, vocab)
    return [list(w) for w in params.bad_words_token_ids]


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


@pytest.mark.parametrize("spans", [[(2, 1), (5, 2), (10, 3)], [(5, 2), (10, 3)]],
                         ids=["1-3 tokens", "2-3 tokens"])
@pytest.mark.parametrize("which", [0, 1], ids=["image", "text"])
def test_bad_words_equal_transformers_bad_words_ids(llm: LLM, clip_llama: str, which: int,
                                                    spans: list[tuple[int, int]]) -> None:
    """Words of one, two and three tokens the model writes unbanned: banned, the output
    equals transformers' with the same token sequences, and contains none of them. Without
    a word of one token, the output is the same until the first word's last token."""
    prompt = PROMPTS[which]
    plain = llm.generate(prompt, _params())[0].token_ids
    words = _words_from(llm, plain, spans)
    ours = llm.generate(prompt, _params(bad_words=words))[0].token_ids
    assert_no_leaks(llm.engine)
    banned = _token_ids(llm, words)
    text = _processor(clip_llama).apply_chat_template(prompt["messages"],
                                                      add_generation_prompt=True, tokenize=False)
    prompt_ids = _processor(clip_llama)(text=text, images=prompt["images"] or None,
                                        return_tensors="pt")["input_ids"][0].tolist()
    # transformers looks for a word's first tokens in the prompt too; vLLM (and mmserve) in
    # the output alone: no word here begins at the prompt's end.
    assert not any(prompt_ids[-1] == w[-2] for w in banned if len(w) > 1)
    assert ours == hf_greedy_generate(clip_llama, text, prompt["images"], MAX_TOKENS,
                                      {"bad_words_ids": banned})
    assert ours != plain
    assert not any(_contains(ours, w) for w in banned)
    if spans[0][1] > 1:
        first = min(i for i in range(len(plain)) if any(
            plain[i - len(w) + 1:i + 1] == w for w in banned if i >= len(w) - 1))
        assert ours[:first] == plain[:first] and ours[first] != plain[first]


def test_only_the_output_is_looked_at(llm: LLM) -> None:
    """A word whose first tokens end the prompt is not banned at the first step (vLLM's
    rule): its last token may still follow."""
    plain = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, _params(max_tokens=1))[0].token_ids
    processor = llm.engine.processor
    word = processor.decode([8, plain[0]])
    assert processor.encode(word) == [8, plain[0]]
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]},
                       _params(max_tokens=1, bad_words=[word]))[0].token_ids
    assert out == plain


def test_words_are_tokenized_as_vllm_does(llm: LLM) -> None:
    """Each word as written (leading spaces dropped), and after a space where that gives a
    different first token and as many tokens; sequences the model cannot generate dropped."""
    pieces = {"cat": [5], " cat": [6], "black cat": [7, 5], " black cat": [8, 5],
              "dog": [9], " dog": [3, 9], "big": [40], " big": [41]}

    def encode(text: str) -> list[int]:
        return pieces[text]

    params = SamplingParams(bad_words=[" cat", "black cat", "dog", "big"])
    found = params.with_bad_words(encode, vocab_size=40).bad_words_token_ids
    assert found == ((5,), (6,), (7, 5), (8, 5), (9,))  # " dog" is longer; "big" past 40
    assert SamplingParams().with_bad_words(encode, 40).bad_words_token_ids == ()
    # Copies carry them: a request's n completions each ban the same.
    params = SamplingParams(n=2, bad_words=["cat"]).with_bad_words(encode, 40)
    assert params.with_end_tokens([2]).child(1).bad_words_token_ids == ((5,), (6,))

    word = _words_from(llm, llm.generate(PROMPTS[1], _params())[0].token_ids, [(0, 1)])[0]
    first = llm.engine.processor.encode(word.lstrip())[0]
    end = llm.engine.processor.eos_token_ids[0]
    # A form that is not banned is not measured: 16 tokens as written, 17 after a space.
    sixteen = {"w": list(range(16)), " w": list(range(20, 37))}
    assert SamplingParams(bad_words=["w"]).with_bad_words(
        sixteen.__getitem__, 40).bad_words_token_ids == (tuple(range(16)),)
    long = "x " * MAX_BAD_WORD_TOKENS
    # With allowed_token_ids, bans that would leave nothing are refused when the request is
    # made (with min_tokens, the end tokens count as banned until then).
    with pytest.raises(InvalidInputError, match="bans every token") as e:
        llm.generate(PROMPTS[1], _params(allowed_token_ids=[first], bad_words=[word]))
    assert e.value.param == "bad_words"
    with pytest.raises(InvalidInputError, match="or that bad_words bans") as e:
        llm.generate(PROMPTS[1], _params(allowed_token_ids=[first, end], bad_words=[word],
                                         min_tokens=2))
    assert e.value.param == "allowed_token_ids"
    with pytest.raises(InvalidInputError, match="at most 16") as e:
        SamplingParams(bad_words=[long]).with_bad_words(lambda t: list(range(len(t) // 2 + 1)),
                                                        100)
    assert e.value.param == "bad_words"
    for value, message in ((["a", ""], "bad_words\\[1\\] is empty"),
                           (["  "], "bad_words\\[0\\] is blank"),
                           ("cat", "list of strings"), ([3], "list of strings"),
                           (["a"] * (MAX_BAD_WORDS + 1), "at most 128"),
                           (["a" * 4097], "4097 characters"),
                           (["ok", "a\ud800"], r"bad_words\[1\] has an invalid character")):
        with pytest.raises(InvalidInputError, match=message) as e:
            SamplingParams(bad_words=value)
        assert e.value.param == "bad_words"


def _history(vocab: int, requests: dict[str, tuple[SamplingParams, list[int], int]]
             ) -> TokenHistory:
    history = TokenHistory(vocab, torch.device("cpu"))
    for rid, (params, tokens, num_prompt) in requests.items():
        history.follow(rid, params, tokens, num_prompt)
    return history


def _banned(vocab: int, words: list[tuple[int, ...]], **fields) -> SamplingParams:
    spelled = {str(i): list(w) for i, w in enumerate(words)}
    return SamplingParams(bad_words=list(spelled), **fields).with_bad_words(
        lambda text: spelled.get(text, []), vocab)  # (nothing after a space)


def test_the_ban_reads_the_last_tokens_on_the_device() -> None:
    """By hand, on made-up logits: which tokens each row loses, as its tokens grow (recorded
    from a step's token tensor, as the runner does), a token in two words, a row that would
    be left nothing, and a row beside them untouched."""
    vocab = 12
    words = [(4, 7), (3, 4, 8), (9,), (2, 3, 5), (5, 6), (4, 7)]
    a = _banned(vocab, words)
    b = _banned(vocab, [(9,)], allowed_token_ids=[9])
    plain = SamplingParams()
    history = _history(vocab, {"a": (a, [1, 2, 3, 4], 2), "b": (b, [1], 1)})
    ids, params = ["a", "b", "c"], [a, b, plain]
    logits = torch.randn(3, vocab)

    def finite(out: torch.Tensor, row: int) -> set[int]:
        return {t for t in range(vocab) if torch.isfinite(out[row, t])}

    out = adjust_logits(logits, ids, params, history, in_place=False)
    # Output [3, 4]: (4, 7) and (3, 4, 8) have begun; (2, 3, 5) began in the prompt.
    assert finite(out, 0) == set(range(vocab)) - {7, 8, 9}
    assert finite(out, 1) == {9}  # the ban would leave nothing: the allowed token stays
    assert torch.equal(out[2], logits[2])
    assert torch.equal(out[0, [0, 1, 5, 6]], logits[0, [0, 1, 5, 6]])
    history.record({"a": (torch.tensor([0, 5]), 1)})  # output [3, 4, 5]
    out = adjust_logits(logits, ids, params, history, in_place=False)
    assert finite(out, 0) == set(range(vocab)) - {6, 9}
    history.follow("a", a, [1, 2, 3, 4, 5, 4], 2)  # afresh (a retried step): [3, 4, 5, 4]
    assert finite(adjust_logits(logits, ids, params, history, in_place=False), 0) == (
        set(range(vocab)) - {7, 9})
    assert history.tail(torch.tensor([history.bad_words("a").slot])).tolist() == [
        [-1] * (TAIL - 4) + [3, 4, 5, 4]]
    history.drop(["a", "b"])
    assert not len(history)
    # Two words ending in one token, as a word and its form after a space often do ("black
    # cat" and " black cat"): after either beginning, the token is banned.
    shared = _banned(vocab, [(7, 5), (8, 5), (6, 5)])
    for output in ([7], [8], [6], [1]):
        history.follow("d", shared, [1, 2, *output], 2)
        out = adjust_logits(logits[:1], ["d"], [shared], history, in_place=False)
        assert bool(torch.isinf(out[0, 5])) == (output != [1]), output
    history.drop(["d"])


def test_through_preemption_chunked_prefill_and_scheduling_ahead(clip_llama: str,
                                                                   llm: LLM) -> None:
    """Requests with bad words, a penalty and none, alone in a roomy engine, against all at
    once in an 8-block KV cache (chunked prefill, preemptions), scheduled ahead and not:
    the same tokens, and none holds a banned sequence."""
    plain = [llm.generate(p, _params())[0].token_ids for p in PROMPTS]
    words = [_words_from(llm, plain[0], [(3, 2), (8, 1)]),
             _words_from(llm, plain[1], [(2, 2), (9, 3)])]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[1]]
    params = [_params(bad_words=words[0]), _params(bad_words=words[1], repetition_penalty=1.3),
              _params(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3,
                                        bad_words=words[0] + words[1])]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    assert alone[0] != plain[0] and alone[1] != plain[1]
    small = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=16, block_size=16,
                 max_num_seqs=4, kv_cache_memory=8 * 16 * 512)
    for ahead in (False, True):
        with LLM(clip_llama, async_scheduling=ahead, **small) as engine:
            together = [o.token_ids for o in engine.generate(prompts, params)]
            assert engine.stats()["num_preemptions"] > 0
            assert_no_leaks(engine.engine)
        assert together == alone, f"async_scheduling={ahead}"
    for tokens, sp in zip(alone, params, strict=True):
        assert not any(_contains(tokens, list(w)) for w in
                       _token_ids(llm, sp.bad_words or []))


@pytest.mark.parametrize("ahead", [False, True], ids=["in step", "scheduled ahead"])
def test_a_retried_step_finds_the_words_again(clip_llama: str, llm: LLM, ahead: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps fail for a request with bad words once it has generated some tokens (in the
    batch, then alone): it is retried, its last tokens taken afresh from those it has, and
    its output is the one it gives without the failures, the words banned."""
    from mmserve.worker.model_runner import ModelRunner

    plain = llm.generate(PROMPTS[1], _params())[0].token_ids
    words = _words_from(llm, plain, [(2, 2), (9, 3)])
    params = [_params(bad_words=words), _params(bad_words=words[:1], repetition_penalty=1.2)]
    real = ModelRunner._execute

    def run(failures: int) -> list[list[int]]:
        left = {"n": failures}

        def flaky(self, scheduler_output, *args, **kwargs):  # noqa: ANN001, ANN202
            if (left["n"] and "0" in scheduler_output.request_ids()
                    and self.token_history.num_generated.get("0", 0) >= 6):
                left["n"] -= 1
                raise RuntimeError("transient")
            return real(self, scheduler_output, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, "_execute", flaky)
        with LLM(clip_llama, dtype="float32", max_model_len=256,
                 async_scheduling=ahead) as engine:
            outs = engine.generate([PROMPTS[1], PROMPTS[0]], params)
            assert_no_leaks(engine.engine)
        assert left["n"] == 0 and all(o.finish_reason != "error" for o in outs)
        return [o.token_ids for o in outs]

    expected = run(0)
    assert expected[0] != plain
    assert run(2) == expected


def test_server_takes_bad_words_on_both_endpoints(llm: LLM) -> None:
    """Over HTTP as through the Python API; refused beside a beam search, and bad values
    named."""
    text = {"messages": [{"role": "user", "content": "tell me a story"}], "images": []}
    plain = llm.generate(text, _params())[0].token_ids
    words = _words_from(llm, plain, [(3, 2)])
    expected = llm.generate(text, _params(bad_words=words))[0].text
    raw = llm.generate({"prompt": "once upon"}, _params(bad_words=words))[0].text
    with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as http:
        chat = http.post("/v1/chat/completions", json={
            "messages": text["messages"], "max_tokens": MAX_TOKENS, "temperature": 0,
            "bad_words": words})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"] == expected
        completion = http.post("/v1/completions", json={
            "prompt": "once upon", "max_tokens": MAX_TOKENS, "temperature": 0,
            "bad_words": words})
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["text"] == raw
        for body, message in (({"bad_words": "cat"}, "list of strings"),
                              ({"bad_words": [""]}, "is empty"),
                              ({"bad_words": ["x"], "use_beam_search": True, "n": 2},
                               "not taken with 'use_beam_search'")):
            r = http.post("/v1/chat/completions", json={
                "messages": text["messages"], "max_tokens": 4, **body})
            assert r.status_code == 400, r.text
            assert message in r.json()["error"]["message"]
            assert r.json()["error"]["param"] == "bad_words"
    assert_no_leaks(llm.engine)
