"""Beam search (``LLM.beam_search``) against transformers' ``generate(num_beams=...)`` on the
same float32 checkpoint: the same sequences token for token, in the same order, with the same
scores, for both families, with images, sequences ended by end-of-sequence tokens (one and two
of them), every ``length_penalty`` sign and ``early_stopping`` setting; several prompts
searched at once give what each gives alone, what beams share is computed once, and nothing
leaks, whatever fails."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

from mmserve import LLM, BeamSearchParams
from mmserve.beam_search import BeamSearch
from mmserve.errors import InvalidInputError
from mmserve.testing import build_tiny_checkpoint
from mmserve.testing.oracle import hf_beam_search, load_hf_processor
from tests.conftest import assert_no_leaks, make_image

IMAGES = [make_image(i, size) for i, size in enumerate([(48, 40), (64, 64), (23, 57)])]


def chat(text: str, images: list) -> dict:
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}], "images": images}


PROMPTS = [chat("what is in this picture?", IMAGES[:1]), chat("compare these two", IMAGES[1:]),
           chat("a story about a fox, please", [])]


def reference(path: str, prompt: dict, width: int, max_tokens: int, **kwargs) -> list:
    text = load_hf_processor(path).apply_chat_template(prompt["messages"],
                                                       add_generation_prompt=True,
                                                       tokenize=False)
    return hf_beam_search(path, text, prompt["images"], width, max_tokens, **kwargs)


def assert_same(out, expected: list, length_penalty: float = 1.0) -> None:
    assert out.error is None
    got = [seq.token_ids for seq in out.sequences]
    assert got == [tokens for tokens, _ in expected]
    for seq, (_, score) in zip(out.sequences, expected, strict=True):
        assert score is None or seq.score == pytest.approx(score, rel=1e-5, abs=1e-4)
        assert seq.score == pytest.approx(
            seq.cumulative_logprob / len(seq.token_ids) ** length_penalty, rel=1e-5)


def with_end_tokens(path: str, root: pathlib.Path, ends: list[int]) -> str:
    """``path``'s checkpoint (its files linked) whose generation config ends sequences at
    ``ends``."""
    root.mkdir()
    for f in pathlib.Path(path).iterdir():
        if f.name != "generation_config.json":
            os.symlink(f, root / f.name)
    config = json.loads((pathlib.Path(path) / "generation_config.json").read_text())
    (root / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": ends}))
    return str(root)


def common_end(path: str) -> int:
    """A token transformers' width-4 beams pick where they part: as an end-of-sequence
    token, it ends some beams midway (the search is deterministic: so is the choice)."""
    found = [tokens for tokens, _ in reference(path, PROMPTS[0], 4, 10)]
    first, second = found[0], found[1]
    part = next(i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b)
    return second[part]


@pytest.fixture(scope="module")
def llm(clip_llama: str) -> LLM:
    return LLM(clip_llama, dtype="float32", max_model_len=256, block_size=16)


@pytest.fixture(scope="module")
def ended(clip_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """clip-llama whose end-of-sequence token is one its beams pick midway."""
    return with_end_tokens(clip_llama, tmp_path_factory.mktemp("ended") / "ckpt",
                           [common_end(clip_llama)])


@pytest.mark.parametrize("width", [1, 3])
def test_equals_transformers_with_images(llm: LLM, clip_llama: str, width: int) -> None:
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=10))
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert_same(out, reference(clip_llama, prompt, width, 10))
        assert all(seq.finish_reason == "length" and len(seq.token_ids) == 10
                   for seq in out.sequences)
        assert [seq.text for seq in out.sequences] == [
            llm.engine.processor.decode(seq.token_ids) for seq in out.sequences]
    assert_no_leaks(llm.engine)


def test_width_one_is_greedy(llm: LLM) -> None:
    from mmserve import SamplingParams

    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0))
    searched = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=10))
    assert [o.sequences[0].token_ids for o in searched] == [o.token_ids for o in greedy]


@pytest.mark.parametrize("length_penalty,early_stopping",
                         [(1.0, False), (2.0, "never"), (0.0, True), (-1.0, False),
                          (1.5, True), (-0.5, "never")])
def test_end_tokens_length_penalty_and_early_stopping(ended: str, length_penalty: float,
                                                      early_stopping: bool | str) -> None:
    params = BeamSearchParams(beam_width=4, max_tokens=10, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    with LLM(ended, dtype="float32", max_model_len=256) as llm:
        outs = llm.beam_search(PROMPTS[:2], params)
        for out, prompt in zip(outs, PROMPTS[:2], strict=True):
            assert_same(out, reference(ended, prompt, 4, 10, length_penalty=length_penalty,
                                       early_stopping=early_stopping), length_penalty)
        # The end token ended some sequences: the path under test ran.
        stopped = [seq for seq in outs[0].sequences if seq.finish_reason == "stop"]
        assert stopped and all(seq.token_ids[-1] in llm.engine.processor.eos_token_ids
                               for seq in stopped)
        assert_no_leaks(llm.engine)


def test_ignore_eos_runs_every_beam_to_max_tokens(ended: str) -> None:
    with LLM(ended, dtype="float32", max_model_len=256) as llm:
        out = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=4, max_tokens=10,
                                                           ignore_eos=True))[0]
    assert all(seq.finish_reason == "length" and len(seq.token_ids) == 10
               for seq in out.sequences)
    scores = [seq.score for seq in out.sequences]
    assert scores == sorted(scores, reverse=True)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_checkpoint("qwen2_vl", tmp_path_factory.mktemp("qwen") / "ckpt",
                                     layout="transformers"))


def test_qwen2_vl_equals_transformers(qwen: str) -> None:
    """Qwen2-VL's M-RoPE: a beam's tokens, given as prompt, keep a generated token's
    positions (``RequestMaker.extend``)."""
    with LLM(qwen, dtype="float32", max_model_len=512) as llm:
        outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=8))
        for out, prompt in zip(outs, PROMPTS, strict=True):
            assert_same(out, reference(qwen, prompt, 3, 8))
        assert_no_leaks(llm.engine)


def test_two_end_tokens(qwen: str, tmp_path: pathlib.Path) -> None:
    """Two end-of-sequence tokens: each step keeps 3 x beam_width continuations, and a
    width whose candidates would pass the log-probability limit is refused by name."""
    path = with_end_tokens(qwen, tmp_path / "ckpt", [2, common_end(qwen)])
    with LLM(path, dtype="float32", max_model_len=512) as llm:
        outs = llm.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=3, max_tokens=10))
        for out, prompt in zip(outs, PROMPTS[:2], strict=True):
            assert_same(out, reference(path, prompt, 3, 10))
        assert any(seq.finish_reason == "stop" for seq in outs[0].sequences)
        with pytest.raises(InvalidInputError, match="at most 6") as e:
            llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=7))
        assert e.value.param == "beam_width"
        assert_no_leaks(llm.engine)
        # The server names its own field, before the prompt is processed.
        from starlette.testclient import TestClient

        from mmserve.entrypoints.api_server import OpenAIServer
        from mmserve.entrypoints.serve_args import ServerConfig

        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as http:
            resp = http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "use_beam_search": True, "n": 7, "max_tokens": 4})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"
        assert "n=7" in resp.json()["error"]["message"]
    # The command line says so too, after the checkpoint told it its end tokens.
    from mmserve.entrypoints.cli import main as cli_main

    IMAGES[0].save(tmp_path / "image.png")
    assert cli_main(["caption", str(tmp_path / "image.png"), "--model", path, "--dtype",
                     "float32", "--max-model-len", "512", "--beam-width", "7"]) == 2


def test_searches_at_once_equal_each_alone(clip_llama: str) -> None:
    """``max_num_seqs`` 4 and width 2: two prompts searched at a time, five in all, each
    as it is alone; each image encoded once, and the beams' shared prefix found in the
    prefix cache round after round."""
    params = BeamSearchParams(beam_width=2, max_tokens=8)
    prompts = [*PROMPTS, chat("and this one?", IMAGES[2:]), chat("hello", [])]
    with LLM(clip_llama, dtype="float32", max_model_len=256, max_num_seqs=4) as llm:
        alone = [llm.beam_search(p, params)[0] for p in prompts]
        before = llm.stats()
        together = llm.beam_search(prompts, params)
        after = llm.stats()
        assert_no_leaks(llm.engine)
    assert [[s.token_ids for s in o.sequences] for o in together] == \
        [[s.token_ids for s in o.sequences] for o in alone]
    assert [[s.score for s in o.sequences] for o in together] == \
        [[s.score for s in o.sequences] for o in alone]
    assert after["encoder_items_computed"] == before["encoder_items_computed"]  # all cached
    prompt_tokens = sum(len(o.prompt_token_ids) for o in together)
    # 8 rounds of two beams each: the prompts' full blocks hit every time but the first.
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] \
        > 8 * prompt_tokens


@pytest.mark.parametrize("fields,param", [
    ({"beam_width": 0}, "beam_width"), ({"beam_width": 11}, "beam_width"),
    ({"beam_width": True}, "beam_width"), ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 2, "length_penalty": float("nan")}, "length_penalty"),
    ({"beam_width": 2, "length_penalty": "1"}, "length_penalty"),
    ({"beam_width": 2, "early_stopping": "sometimes"}, "early_stopping"),
    ({"beam_width": 2, "early_stopping": 1}, "early_stopping"),
    ({"beam_width": 2, "early_stopping": 0.0}, "early_stopping"),
    ({"beam_width": 2, "ignore_eos": 1}, "ignore_eos")])
def test_bad_parameters_are_named(fields: dict, param: str) -> None:
    with pytest.raises(InvalidInputError) as e:
        BeamSearchParams(**fields)
    assert e.value.param == param


def test_a_bad_prompt_leaves_nothing_behind(llm: LLM) -> None:
    """A prompt the processor refuses, after others started: the call raises, the requests
    in flight are aborted, and the engine searches again as before."""
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    expected = llm.beam_search(PROMPTS[0], params)[0]
    with pytest.raises(InvalidInputError):
        llm.beam_search([PROMPTS[0], {"prompt": "two <image> <image>", "images": IMAGES[:1]}],
                        params)
    assert_no_leaks(llm.engine)
    with pytest.raises(InvalidInputError, match="max_model_len"):
        llm.beam_search({"prompt_token_ids": [1] * 256}, params)
    again = llm.beam_search(PROMPTS[0], params)[0]
    assert [s.token_ids for s in again.sequences] == [s.token_ids for s in expected.sequences]
    assert_no_leaks(llm.engine)


def test_a_failing_search_fails_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails for one prompt's beams (its image breaks the encoder) ends that
    search with the error; the others come back as they do alone."""
    from PIL import Image

    white = Image.new("RGB", (32, 32), "white")
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    alone = llm.beam_search(PROMPTS, params)
    model = llm.engine.runner.model
    real_encode = model.encode_pixels

    def encode_pixels(pixels: torch.Tensor) -> torch.Tensor:
        if bool((pixels.flatten(1).min(dim=1).values > 1.0).any()):
            raise RuntimeError("the vision tower cannot take a white image")
        return real_encode(pixels)

    monkeypatch.setattr(model, "encode_pixels", encode_pixels)
    outs = llm.beam_search([PROMPTS[0], chat("white?", [white]), *PROMPTS[1:]], params)
    assert "white image" in outs[1].error and outs[1].sequences == []
    assert [[s.token_ids for s in o.sequences] for o in outs[:1] + outs[2:]] == \
        [[s.token_ids for s in o.sequences] for o in alone]
    assert_no_leaks(llm.engine)


def test_search_rules_by_hand() -> None:
    """The search alone, on made-up candidates: ended continuations outside the best
    beam_width are dropped, ended ones inside it are scored by length, and the search stops
    once no running beam can beat the worst finished one."""
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=5), end_token_ids=[9])
    assert search.running == [()]
    search.advance([[(9, -0.1), (4, -0.5), (5, -1.0), (6, -3.0)]])
    # 9 ended within the best two: finished at length 1; 4 and 5 go on.
    assert search.running == [(4,), (5,)] and not search.done
    search.advance([[(7, -0.2), (9, -0.3), (8, -2.0), (1, -2.5)],
                    [(9, -0.1), (2, -0.2), (3, -3.0), (1, -4.0)]])
    # Sums: (4,7) -0.7, (4,9) -0.8, (5,9) -1.1, (5,2) -1.2: (4,9) ended in the best two;
    # (5,9) ended outside them and is dropped.
    assert search.running == [(4, 7), (5, 2)]
    finished = search.sequences()
    assert [s.token_ids for s in finished] == [[9], [4, 9]]
    assert finished[1].score == pytest.approx(-0.8 / 2)
    # Best running (4,7) scores -0.7 / 2 = -0.35, better than the worst finished (-0.4):
    # the search goes on; one more step where every continuation is worse stops it.
    assert not search.done
    search.advance([[(1, -5.0), (2, -5.0), (3, -5.0), (4, -5.0)],
                    [(1, -5.0), (2, -5.0), (3, -5.0), (4, -5.0)]])
    assert search.done and search.running == []


def test_an_end_outside_the_best_beams_is_dropped() -> None:
    """transformers keeps beam_width x 2 continuations only so that beam_width run on: one
    that ends outside the best beam_width finishes nothing."""
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=5), end_token_ids=[9])
    search.advance([[(4, -0.1), (5, -0.2), (9, -0.3), (6, -3.0)]])
    assert search.running == [(4,), (5,)] and search.sequences() == []


# ----------------------------------------------------------------- the server
def _messages(text: str, images: list) -> list[dict]:
    """``chat(text, images)``'s messages as the server takes them: images as data URLs."""
    from tests.test_server import data_url

    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


TEXT_PROMPTS = ["a story about a fox", "the river"]
TEXT_PARAMS = BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.5,
                               early_stopping="never")


@pytest.fixture(scope="module")
def searched(llm: LLM) -> list:
    """The Python API's searches (made before a server's loop steps the engine: one thread
    steps an engine): PROMPTS[:2] at width 3 for 8 tokens, then TEXT_PROMPTS."""
    return [*llm.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=3, max_tokens=8)),
            *llm.beam_search([{"prompt": p} for p in TEXT_PROMPTS], TEXT_PARAMS)]


@pytest.fixture(scope="module")
def served(llm: LLM, searched: list):
    from starlette.testclient import TestClient

    from mmserve.entrypoints.api_server import OpenAIServer
    from mmserve.entrypoints.serve_args import ServerConfig

    with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as http:
        yield http
    assert_no_leaks(llm.engine)  # once the server's loop has stopped


def _beam_chat(http, messages: list[dict], **fields) -> dict:
    resp = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "use_beam_search": True, "n": 3,
        "max_tokens": 8, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _generated_tokens(http) -> float:
    """The server's count of generated tokens (``/metrics``)."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("mmserve_generation_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("no mmserve_generation_tokens_total in /metrics")


def test_server_chat_equals_the_python_api(served, searched: list) -> None:
    for messages, out in zip([_messages("what is in this picture?", IMAGES[:1]),
                              _messages("compare these two", IMAGES[1:])],
                             searched[:2], strict=True):
        before = _generated_tokens(served)
        body = _beam_chat(served, messages, temperature=0, top_p=1, logprobs=False)
        # The metrics count the answer's sequences, not the rounds' one-token requests.
        assert _generated_tokens(served) - before == body["usage"]["completion_tokens"]
        assert [c["message"]["content"] for c in body["choices"]] == \
            [seq.text for seq in out.sequences]
        assert [c["finish_reason"] for c in body["choices"]] == \
            [seq.finish_reason for seq in out.sequences]
        assert body["usage"]["prompt_tokens"] == len(out.prompt_token_ids)
        assert body["usage"]["completion_tokens"] == sum(len(s.token_ids)
                                                         for s in out.sequences)


def test_server_stream_carries_each_sequence(served, searched: list) -> None:
    messages = _messages("what is in this picture?", IMAGES[:1])
    texts, reasons = ["", "", ""], [None, None, None]
    usage = None
    with served.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "use_beam_search": True, "n": 3,
            "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
            ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                texts[choice["index"]] += choice["delta"].get("content") or ""
                reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    assert texts == [seq.text for seq in searched[0].sequences]
    assert reasons == [seq.finish_reason for seq in searched[0].sequences]
    assert usage["completion_tokens"] == sum(len(s.token_ids) for s in searched[0].sequences)


def test_server_completions_search_each_prompt(served, searched: list) -> None:
    resp = served.post("/v1/completions", json={
        "model": "tiny", "prompt": TEXT_PROMPTS, "use_beam_search": True, "n": 2,
        "max_tokens": 6, "length_penalty": 0.5, "early_stopping": "never"})
    assert resp.status_code == 200, resp.text
    # Choice p * n + j: prompt p's j-th sequence.
    assert [c["text"] for c in resp.json()["choices"]] == \
        [seq.text for out in searched[2:] for seq in out.sequences]
    assert resp.json()["usage"]["prompt_tokens"] == \
        sum(len(out.prompt_token_ids) for out in searched[2:])


@pytest.mark.parametrize("fields,param", [
    ({"temperature": 0.7}, "temperature"), ({"logprobs": True}, "logprobs"),
    ({"stop": ["."]}, "stop"), ({"top_k": 5}, "top_k"), ({"n": 11}, "n"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"length_penalty": "long"}, "length_penalty"),
    ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
    ({"use_beam_search": False, "early_stopping": True}, "early_stopping"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"use_beam_search": "yes"}, "use_beam_search"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
      "tool_choice": "required"}, "use_beam_search")])
def test_server_refuses_what_a_search_does_not_take(served, fields: dict, param: str) -> None:
    resp = served.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "use_beam_search": True, "n": 2, "max_tokens": 4, **fields})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_server_takes_vllms_defaults_without_a_search(served) -> None:
    """Clients that send every field of vLLM's request send these on every request."""
    resp = served.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False})
    assert resp.status_code == 200, resp.text
    resp = served.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "use_beam_search": True, "n": 2, "early_stopping": None})
    assert resp.status_code == 200, resp.text


def test_server_search_with_an_engine_process(clip_llama: str, searched: list) -> None:
    """The front end runs the rounds; the core steps them: the same sequences."""
    from starlette.testclient import TestClient

    from mmserve.config import EngineConfig
    from mmserve.engine.core_process import EngineCoreClient
    from mmserve.entrypoints.api_server import OpenAIServer
    from mmserve.entrypoints.serve_args import ServerConfig

    config = EngineConfig(model=clip_llama, dtype="float32", max_model_len=256,
                          block_size=16)
    server = OpenAIServer(EngineCoreClient(config), ServerConfig("tiny"))
    try:
        with TestClient(server.app()) as http:
            messages = _messages("what is in this picture?", IMAGES[:1])
            body = _beam_chat(http, messages)
            assert [c["message"]["content"] for c in body["choices"]] == \
                [seq.text for seq in searched[0].sequences]
            assert http.get("/stats").json()["kv_blocks_free"] == \
                http.get("/stats").json()["kv_blocks_total"]
    finally:
        server.engine.close()


async def _last(stream):
    last = None
    async for out in stream:
        last = out
    return last


def test_an_aborted_search_leaves_nothing_behind(clip_llama: str) -> None:
    """Aborting a search's sequence while a round runs stops the search and aborts the
    round's requests; the engine then answers others as before."""
    import asyncio

    from mmserve.engine.async_engine import AsyncEngine

    params = BeamSearchParams(beam_width=3, max_tokens=40)
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        expected = llm.beam_search(PROMPTS[1], BeamSearchParams(beam_width=2, max_tokens=4))

        async def run() -> list:
            engine = AsyncEngine(llm.engine)
            engine.start()
            streams = await engine.add_beam_search(["a-0", "a-1", "a-2"], PROMPTS[1], params,
                                                   llm.engine.processor.decode)
            for _ in range(2000):  # until a later round runs
                if any(rid.startswith("a-0-beam3") for rid in engine._streams):
                    break
                await asyncio.sleep(0.005)
            else:
                raise AssertionError("the search's rounds never reached round 3")
            engine.abort(streams[0].request_id)  # one of its sequences: it ends them all
            assert not engine._searches and not {"a-0", "a-1", "a-2"} & set(engine._streams)
            for _ in range(200):  # the round in flight, once the cancelled task runs again
                if not any(rid.startswith("a-") for rid in engine._streams):
                    break
                await asyncio.sleep(0.005)
            else:
                raise AssertionError(f"the round's streams stayed: {list(engine._streams)}")
            assert engine._num_round_streams == 0  # the waiting bound counts them no more
            again = await engine.add_beam_search(["b-0", "b-1"], PROMPTS[1], BeamSearchParams(
                beam_width=2, max_tokens=4), llm.engine.processor.decode)
            outs = [await _last(stream) for stream in again]

            def broken(token_ids: list[int]) -> str:
                raise RuntimeError("no text today")

            # A failure in the search's own work: each sequence's stream says so.
            failed = await engine.add_beam_search(["c-0", "c-1"], PROMPTS[1], BeamSearchParams(
                beam_width=2, max_tokens=2), broken)
            for stream in failed:
                out = await _last(stream)
                assert out.finish_reason == "error" and "no text today" in out.error
            for _ in range(400):
                if not engine._streams and not engine._searches:
                    break
                await asyncio.sleep(0.005)
            await engine.shutdown()
            return outs

        outs = asyncio.run(asyncio.wait_for(run(), timeout=60))
        assert [o.token_ids for o in outs] == [s.token_ids for s in expected[0].sequences]
        assert [o.text for o in outs] == [s.text for s in expected[0].sequences]
        assert_no_leaks(llm.engine)


def test_caption_with_a_beam_search(clip_llama: str, capsys: pytest.CaptureFixture) -> None:
    """``caption(beam_width=...)`` and ``mmserve caption --beam-width``: each image's best
    sequence. (An engine of its own: the module's may be stepped by a server's loop.)"""
    from mmserve import SamplingParams
    from mmserve.entrypoints.cli import main as cli_main

    prompts = [chat("Describe this image.", [image]) for image in IMAGES[:2]]
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        best = [out.sequences[0].text for out in
                llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=7))]
        assert llm.caption(IMAGES[:2], sampling_params=SamplingParams(max_tokens=7),
                           use_tqdm=False, beam_width=3) == best
        assert_no_leaks(llm.engine)
    paths = []
    for i, image in enumerate(IMAGES[:2]):
        paths.append(pathlib.Path(clip_llama).parent / f"beam-caption-{i}.png")
        image.save(paths[-1])
    assert cli_main(["caption", *map(str, paths), "--model", clip_llama, "--dtype", "float32",
                     "--max-model-len", "256", "--max-tokens", "7", "--beam-width", "3",
                     "--json"]) == 0
    assert [entry["caption"] for entry in json.loads(capsys.readouterr().out)] == best
    assert cli_main(["caption", str(paths[0]), "--beam-width", "11"]) == 2
    assert "beam_width must be" in capsys.readouterr().err
