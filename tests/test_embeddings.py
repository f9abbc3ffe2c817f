"""Embeddings (``LLM.embed``, ``POST /v1/embeddings``): a prompt's last token's final hidden
state, as transformers' own model computes it in float32, for LLaVA and both Qwen2-VL families,
images included; batched with other requests, from the prefix cache, under chunked prefill and
with asynchronous scheduling the same; the HTTP endpoint in OpenAI's shapes (floats and
base64), vLLM's chat form, and what it refuses; nothing leaks."""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.config import EngineConfig, checkpoint_pooling, resolved_pooling
from mmserve.errors import InvalidInputError
from mmserve.processing.hf_processors import load_qwen2_vl_processor
from mmserve.testing import build_tiny_checkpoint
from mmserve.testing.oracle import hf_last_hidden_state, load_hf_processor
from mmserve.worker.model_runner import CPUModelRunner
from tests.conftest import assert_no_leaks, load_benchmark, make_image, openai_app
from tests.test_parity import mixed_batch
from tests.test_server import data_url
from tests.test_step_failures import GREEDY
from tests.test_tensor_parallel import _settings

IMAGES = [make_image(3, (40, 30)), make_image(4, (64, 48))]
IMAGE_URL = data_url(IMAGES[0])
# float32 on both sides, the same arithmetic up to the order of sums.
ATOL, RTOL = 1e-4, 1e-4


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("qwen-embed")
    return {family: str(build_tiny_checkpoint(family, root / family))
            for family in ("qwen2_vl", "qwen2_5_vl")}


def _template(path: str):
    return (load_qwen2_vl_processor(path) if "qwen" in os.path.basename(path)
            else load_hf_processor(path))


def _messages(n: int, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n + [{"type": "text",
                                                                     "text": text}]}]


def _reference(path: str, n: int, text: str, pooling: str = "last") -> torch.Tensor:
    prompt = _template(path).apply_chat_template(_messages(n, text), add_generation_prompt=True,
                                                 tokenize=False)
    return hf_last_hidden_state(path, prompt, IMAGES[:n], pooling)


@pytest.mark.parametrize("name", ["llava", "qwen2_vl", "qwen2_5_vl"])
def test_embeddings_are_transformers_last_hidden_state(name: str, clip_llama: str,
                                                       qwen: dict[str, str]) -> None:
    path = clip_llama if name == "llava" else qwen[name]
    cases = [(2, "what is in these?"), (1, "a picture"), (0, "no image at all, only words")]
    expected = [_reference(path, n, text) for n, text in cases]
    prompts = [{"messages": _messages(n, text), "images": IMAGES[:n]} for n, text in cases]
    with LLM(path, dtype="float32", max_model_len=512) as llm:
        # Twice: the second time from the prefix cache (all but the last token).
        hits = []
        for _ in range(2):
            before = llm.engine.stats()["prefix_cache_hit_tokens"]
            outs = llm.embed(prompts, normalize=False)
            for out, ref in zip(outs, expected, strict=True):
                torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref,
                                           atol=ATOL, rtol=RTOL)
            hits.append(llm.engine.stats()["prefix_cache_hit_tokens"] - before)
        assert hits[1] > hits[0] + 32  # (the first time, only what the prompts share)
        # In one batch with requests that generate: theirs are the tokens they were alone.
        generate = SamplingParams(max_tokens=6, temperature=0.0)
        alone = llm.generate(prompts, generate)
        embed = SamplingParams(max_tokens=1, temperature=0.0, return_embedding=True)
        mixed = llm.generate(prompts + prompts, [generate] * 3 + [embed] * 3)
        assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
        assert all(o.embedding is None for o in mixed[:3])
        for out, ref in zip(mixed[3:], expected, strict=True):
            torch.testing.assert_close(out.embedding, ref, atol=ATOL, rtol=RTOL)
            # Its own storage: a view of the step's rows would keep (and pickle) them all.
            assert out.embedding.untyped_storage().nbytes() == out.embedding.numel() * 4
        normalized = llm.embed(prompts[0])[0].outputs.embedding
        assert np.isclose(np.linalg.norm(normalized), 1.0)
        torch.testing.assert_close(torch.tensor(normalized),
                                   torch.nn.functional.normalize(expected[0], dim=0),
                                   atol=ATOL, rtol=RTOL)
        assert outs[0].num_prompt_tokens == len(outs[0].prompt_token_ids) > 10
        assert_no_leaks(llm.engine)


@pytest.fixture(params=["at once", "on the device", "launched inline"])
def deferred(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The CPU runner as it is, or leaving its results on the device as the CUDA runner does
    (see tests/test_async_scheduling.py)."""
    monkeypatch.setattr(CPUModelRunner, "defer_sampled_tokens", request.param != "at once")
    monkeypatch.setattr(CPUModelRunner, "launches_asynchronously",
                        request.param == "launched inline")
    return request.param


def test_embeddings_through_chunked_prefill_preemption_and_async_scheduling(
        clip_llama: str, deferred: str) -> None:
    """Embedding requests among generating ones, their images split across steps by chunked
    prefill, in a KV cache small enough to preempt: the synchronous engine's embeddings are
    transformers', and scheduling ahead changes neither them nor the generated tokens."""
    batch = mixed_batch()
    chat = {"messages": _messages(2, "what is in these two pictures, in some detail?"),
            "images": IMAGES}
    expected = _reference(clip_llama, 2, "what is in these two pictures, in some detail?")
    embed = SamplingParams(max_tokens=1, temperature=0.0, return_embedding=True)
    params = [embed if i % 3 == 0 else GREEDY for i in range(len(batch))] + [embed]

    def run(**flags) -> list:
        with LLM(clip_llama, **_settings(clip_llama, 1), **flags) as llm:
            outs = llm.generate(batch + [chat], params)
            stats = llm.stats()
            assert_no_leaks(llm.engine)
        return outs, stats

    sync, stats = run()
    assert stats["num_preemptions"] > 0
    torch.testing.assert_close(sync[-1].embedding, expected, atol=ATOL, rtol=RTOL)
    ahead, _ = run(async_scheduling=True)
    for a, s, p in zip(ahead, sync, params, strict=True):
        if p.return_embedding:
            assert s.embedding is not None and s.embedding.shape == expected.shape
            torch.testing.assert_close(a.embedding, s.embedding, atol=ATOL, rtol=RTOL)
        else:
            assert a.token_ids == s.token_ids and a.embedding is None


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_pooled_embeddings_are_transformers_through_chunks_and_preemption(
        clip_llama: str, qwen: dict[str, str], pooling: str, deferred: str) -> None:
    """``pooling_type`` mean and cls (vLLM's MEAN and CLS): the mean of every prompt token's
    final hidden state, or the first token's, as transformers' model gives them, for prompts
    split into chunks across steps, among generating requests in a KV cache small enough to
    preempt, with asynchronous scheduling too; the prefix cache does not skip their tokens
    (a prompt seen before is computed again, and equal)."""
    batch = mixed_batch()
    cases = [(2, "what is in these two pictures, in some detail?"), (0, "only words here")]
    chats = [{"messages": _messages(n, text), "images": IMAGES[:n]} for n, text in cases]
    expected = [_reference(clip_llama, n, text, pooling) for n, text in cases]
    embed = SamplingParams(max_tokens=1, temperature=0.0, return_embedding=True)
    params = [GREEDY] * len(batch) + [embed] * 2
    for flags in ({}, {"async_scheduling": True}):
        with LLM(clip_llama, **_settings(clip_llama, 1), pooling_type=pooling,
                 **flags) as llm:
            outs = llm.generate(batch + chats, params)
            again = llm.generate(chats, embed)  # (from the prefix cache, were it read)
            stats = llm.stats()
            assert_no_leaks(llm.engine)
        assert stats["num_preemptions"] > 0 or flags
        for out, ref in zip(outs[-2:] + again, expected * 2, strict=True):
            torch.testing.assert_close(out.embedding, ref, atol=ATOL, rtol=RTOL)
    # Qwen2-VL's M-RoPE prompts pool the same way.
    path = qwen["qwen2_vl"]
    with LLM(path, dtype="float32", max_model_len=512, max_num_batched_tokens=24,
             pooling_type=pooling) as llm:
        (out,) = llm.embed(chats[0], normalize=False)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding),
                               _reference(path, 2, cases[0][1], pooling), atol=ATOL, rtol=RTOL)


def _sentence_transformers(model: str, folder: Path, mode: str | None,
                           normalize: bool) -> str:
    """``model``'s files linked into ``folder``, made a sentence-transformers checkpoint
    too: its ``modules.json`` pooling by ``mode`` (one of the ``pooling_mode_*`` names' ends:
    ``mean_tokens``, ``cls_token``, ``lasttoken``, ``max_tokens``; None: no Pooling module),
    then a Normalize module where ``normalize``."""
    folder.mkdir()
    for name in os.listdir(model):
        os.symlink(os.path.join(model, name), folder / name)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"}]
    if mode is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling",
                        "type": "sentence_transformers.models.Pooling"})
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 64, **{f"pooling_mode_{m}": m == mode for m in (
                "mean_tokens", "cls_token", "lasttoken", "max_tokens")}}))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    return str(folder)


def test_a_sentence_transformers_checkpoint_declares_its_pooling(clip_llama: str,
                                                                 tmp_path: Path) -> None:
    cases = {("mean_tokens", False): ("mean", False), ("cls_token", True): ("cls", True),
             ("lasttoken", True): ("last", True), (None, True): (None, None),
             ("max_tokens", False): ("pooling_mode_max_tokens", False)}
    for i, ((mode, normalize), expected) in enumerate(cases.items()):
        path = _sentence_transformers(clip_llama, tmp_path / str(i), mode, normalize)
        assert checkpoint_pooling(path) == expected
    assert checkpoint_pooling(clip_llama) == (None, None)
    # A mode mmserve does not compute stops the start, unless pooling_type is set; so does
    # a file that does not read, named.
    max_pooled = str(tmp_path / "4")
    with pytest.raises(ValueError, match="pooling_mode_max_tokens.*set --pooling-type"):
        resolved_pooling(EngineConfig(model=max_pooled))
    assert resolved_pooling(EngineConfig(model=max_pooled, pooling_type="mean")) == (
        "mean", False)
    (tmp_path / "4" / "1_Pooling" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="1_Pooling/config.json does not read"):
        checkpoint_pooling(max_pooled)
    assert resolved_pooling(EngineConfig(model=max_pooled, pooling_type="cls",
                                         normalize_embeddings=True)) == ("cls", True)


def test_the_engine_pools_as_its_checkpoint_declares_in_either_layout(
        clip_llama: str, tmp_path: Path) -> None:
    """A sentence-transformers checkpoint of mean pooling and no Normalize module embeds
    each prompt as its tokens' mean, not normalized (where the request does not say), in
    ``LLM.embed``, over HTTP and with the engine in a process of its own (whose front end
    makes the requests); vLLM's ``pooler_config`` overrides it."""
    from starlette.testclient import TestClient

    from mmserve.entrypoints.api_server import OpenAIServer
    from mmserve.entrypoints.serve_args import ServerConfig
    from tests.test_engine_core_process import Core, collect, config_of

    path = _sentence_transformers(clip_llama, tmp_path / "st", "mean_tokens", False)
    chat = {"messages": _messages(1, "a picture"), "images": IMAGES[:1]}
    mean = _reference(clip_llama, 1, "a picture", "mean")
    with LLM(path, dtype="float32", max_model_len=256) as llm:
        assert (llm.engine.config.pooling_type, llm.engine.config.normalize_embeddings) == (
            "mean", False)
        (out,) = llm.embed(chat)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), mean, atol=ATOL,
                                   rtol=RTOL)
        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as http:
            body = {"model": "tiny", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": IMAGE_URL}},
                {"type": "text", "text": "a picture"}]}]}
            served = [http.post("/v1/embeddings", json={**body, **extra}).json()
                      for extra in ({}, {"normalize": True})]
        values = [torch.tensor(answer["data"][0]["embedding"]) for answer in served]
        assert abs(values[0].norm().item() - mean.norm().item()) < 1e-3
        assert abs(values[1].norm().item() - 1.0) < 1e-5
    core = Core(config_of(path), "process")
    try:
        embed = SamplingParams(max_tokens=1, temperature=0.0, return_embedding=True)

        async def main():
            return await collect(await core.client.add_request("st", chat, embed))

        torch.testing.assert_close(core.run(main()).embedding, mean, atol=ATOL, rtol=RTOL)
    finally:
        core.close()
    with LLM(path, dtype="float32", max_model_len=256,
             pooler_config='{"pooling_type": "CLS", "normalize": true}') as llm:
        assert (llm.engine.config.pooling_type, llm.engine.config.normalize_embeddings) == (
            "cls", True)
    for bad, message in (({"pooling_type": "MAX"}, "one of LAST, MEAN, CLS"),
                         ({"dimensions": 8}, "does not take 'dimensions'"),
                         ("{not json", "not valid JSON")):
        with pytest.raises(ValueError, match=message):
            LLM(path, pooler_config=bad)
    with pytest.raises(ValueError, match="disagree"):
        LLM(path, pooler_config={"pooling_type": "MEAN"}, pooling_type="cls")
    with pytest.raises(ValueError, match="normalize_embeddings must be"):
        LLM(path, normalize_embeddings="no")


def test_embeddings_from_tensor_parallel_workers(clip_llama: str) -> None:
    """Two ranks in worker processes: the embedding crosses back from rank 0's process."""
    chat = {"messages": _messages(1, "a picture"), "images": IMAGES[:1]}
    with LLM(clip_llama, **_settings(clip_llama, 2)) as llm:
        (out,) = llm.embed(chat, normalize=False)
        assert_no_leaks(llm.engine)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding),
                               _reference(clip_llama, 1, "a picture"), atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def served(clip_llama: str):
    with openai_app(clip_llama, max_model_len=256) as app:
        yield app


@pytest.fixture(scope="module")
def python_api(clip_llama: str):
    """The Python API's answers come from an engine of their own: the server's is stepped by
    its loop's thread, which ``LLM.embed`` on it would step beside."""
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        yield llm


def _nothing_left(llm: LLM) -> None:
    """No request of a refused one left: none in the server's engine client as the answer
    comes (the items queued before the one refused were aborted, not left to finish), and
    the engine drains."""
    assert llm.server.engine.num_in_flight == 0
    deadline = time.monotonic() + 10
    while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not llm.engine.has_unfinished_requests()


def test_the_embeddings_endpoint_answers_as_llm_embed(served, python_api: LLM) -> None:
    """OpenAI's ``input`` forms with the openai client (which asks for base64 and decodes
    it), floats, vLLM's chat form with an image, and its ``normalize``."""
    llm, http, client = served
    texts = ["a red square", "two blue circles"]
    expected = [o.outputs.embedding for o in python_api.embed(texts)]
    made = client.embeddings.create(model="tiny", input=texts)
    assert [d.index for d in made.data] == [0, 1]
    for got, want in zip(made.data, expected, strict=True):
        np.testing.assert_allclose(got.embedding, want, rtol=1e-5, atol=1e-6)
    assert made.usage.prompt_tokens == sum(o.num_prompt_tokens for o in python_api.embed(texts))
    floats = http.post("/v1/embeddings", json={"model": "tiny", "input": texts[0],
                                                "encoding_format": "float"}).json()
    assert floats["object"] == "list" and floats["id"].startswith("embd-")
    np.testing.assert_allclose(floats["data"][0]["embedding"], expected[0], rtol=1e-5,
                               atol=1e-6)
    raw = http.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(decoded, expected[0], rtol=1e-5, atol=1e-6)
    ids = python_api.embed(texts[1])[0].prompt_token_ids
    by_ids = client.embeddings.create(model="tiny", input=[ids], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, expected[1], rtol=1e-5, atol=1e-6)
    # vLLM's chat form, an image in it: transformers' hidden state, not normalized.
    url = data_url(IMAGES[0])
    chat = http.post("/v1/embeddings", json={
        "model": "tiny", "encoding_format": "float", "normalize": False,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "a picture"}]}]})
    assert chat.status_code == 200, chat.text
    torch.testing.assert_close(torch.tensor(chat.json()["data"][0]["embedding"]),
                               _reference(llm.engine.config.model, 1, "a picture"),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": "x", "messages": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["a", 3]}, "input[1]"),
    ({"input": ["a"] * 257}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 3}, "dimensions"),
    ({"input": "x", "normalize": "yes"}, "normalize"),
    ({"input": "x", "add_special_tokens": False}, "add_special_tokens"),
    ({"input": "x", "truncate_prompt_tokens": 100000}, "truncate_prompt_tokens"),
    ({"input": "word " * 400}, "input"),
    ({"input": ["a", "b", "word " * 400]}, "input[2]"),  # (a and b are aborted)
    ({"input": [[1, 2], [10**9]]}, "input[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                  "image_url": {"url": "data:,"}}]}]},
     "messages"),
    ({"input": "x", "model": "other"}, "model"),
])
def test_what_the_embeddings_endpoint_refuses(served, body: dict, param: str) -> None:
    llm, http, _ = served
    resp = http.post("/v1/embeddings", json=body)
    assert 400 <= resp.status_code < 500, resp.text
    assert resp.json()["error"]["param"] == param, resp.text
    _nothing_left(llm)


def test_return_embedding_reads_the_prompt_once() -> None:
    for fields in ({"max_tokens": 2}, {"n": 2}):
        with pytest.raises(InvalidInputError, match="max_tokens=1 and n=1") as e:
            SamplingParams(return_embedding=True, **fields)
        assert e.value.param == "return_embedding"
    with pytest.raises(InvalidInputError, match="boolean"):
        SamplingParams(max_tokens=1, return_embedding=1)


# ----------------------------------------------------------------- scores
def test_llm_score_is_the_cosine_of_the_embeddings(clip_llama: str) -> None:
    image_prompt = {"messages": _messages(1, "a picture"), "images": IMAGES[:1]}
    texts = ["a red square", "two blue circles", "a picture"]
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        embeddings = [torch.tensor(o.outputs.embedding)
                      for o in llm.embed([image_prompt, *texts])]
        one_to_many = llm.score(image_prompt, texts)
        pairwise = llm.score(texts, texts[::-1])
        with pytest.raises(ValueError, match="as many of each"):
            llm.score(texts[:2], texts)
        assert_no_leaks(llm.engine)
    for out, j in zip(one_to_many, (1, 2, 3), strict=True):
        assert out.outputs.score == pytest.approx(float(embeddings[0] @ embeddings[j]), abs=1e-5)
    assert [o.outputs.score for o in pairwise] == pytest.approx(
        [float(embeddings[1 + i] @ embeddings[3 - i]) for i in range(3)], abs=1e-5)
    assert pairwise[1].outputs.score == pytest.approx(1.0, abs=1e-5)  # a text and itself


def test_score_and_rerank_over_http(served, python_api: LLM) -> None:
    """vLLM's ``/score`` (one against many, pairwise; an image as ``{"content": [...]}``)
    and ``/rerank`` (best first, ``top_n``, the documents returned), as ``LLM.score``."""
    llm, http, _ = served
    query, docs = "a red square", ["two blue circles", "a red square", "a green line"]
    expected = [o.outputs.score for o in python_api.score(query, docs)]
    scored = http.post("/score", json={"model": "tiny", "text_1": query, "text_2": docs})
    assert scored.status_code == 200, scored.text
    body = scored.json()
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] == 0
    pairwise = http.post("/v1/score", json={"text_1": docs, "text_2": docs}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([1.0] * 3, abs=1e-5)
    # An image among the items, in vLLM's content form (in a list: one item of all its
    # parts): the chat prompt of that message.
    content = {"content": [{"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}},
                           {"type": "text", "text": "a picture"}]}
    with_image = http.post("/score", json={"text_1": [content], "text_2": docs}).json()
    image_prompt = {"messages": _messages(1, "a picture"), "images": IMAGES[:1]}
    assert [d["score"] for d in with_image["data"]] == pytest.approx(
        [o.outputs.score for o in python_api.score(image_prompt, docs)], abs=1e-5)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = http.post(path, json={"model": "tiny", "query": query, "documents": docs,
                                       "top_n": 2})
        assert ranked.status_code == 200, ranked.text
        results = ranked.json()["results"]
        best = sorted(range(3), key=lambda i: -expected[i])[:2]
        assert [r["index"] for r in results] == best == [1, best[1]]
        assert [r["document"]["text"] for r in results] == [docs[i] for i in best]
        assert [r["relevance_score"] for r in results] == pytest.approx(
            [expected[i] for i in best], abs=1e-5)
    everything = http.post("/rerank", json={"query": query, "documents": docs}).json()
    assert len(everything["results"]) == 3 and everything["usage"]["total_tokens"] > 0
    # vLLM's lone {"content": [parts]}: each part a document of its own (an image's
    # returned as its part).
    image_part = {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}}
    parts = http.post("/rerank", json={"query": query, "documents": {"content": [
        {"type": "text", "text": docs[0]}, image_part]}}).json()["results"]
    assert sorted(r["index"] for r in parts) == [0, 1]
    by_index = {r["index"]: r for r in parts}
    assert by_index[0]["document"] == {"text": docs[0]}
    assert by_index[1]["document"] == {"multi_modal": image_part}
    alone = {"messages": [{"role": "user", "content": [{"type": "image"}]}],
             "images": IMAGES[:1]}
    assert by_index[1]["relevance_score"] == pytest.approx(
        python_api.score(query, alone)[0].outputs.score, abs=1e-5)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/score", {"text_2": "x"}, "text_1"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/score", {"text_1": "a", "text_2": ["b", 3]}, "text_2[1]"),
    ("/score", {"text_1": "a", "text_2": ["b", "word " * 400]}, "text_2[1]"),
    ("/rerank", {"query": ["a", "b"], "documents": ["c"]}, "query"),
    ("/rerank", {"query": ["a"], "documents": ["c"]}, "query"),
    ("/rerank", {"query": "a", "documents": ["c", {"content": [], "x": 1}]}, "documents[1]"),
    ("/score", {"text_1": "a", "text_2": [{"content": [
        {"type": "image_url", "image_url": {"url": IMAGE_URL}}] * 5}]}, "text_2[0]"),
    ("/rerank", {"query": "a", "documents": "c"}, "documents"),
    ("/rerank", {"query": "a", "documents": ["c"], "top_n": -1}, "top_n"),
    ("/rerank", {"query": "a", "documents": ["c", {"content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "documents[1]"),
    ("/rerank", {"query": "a", "documents": {"content": [
        {"type": "text", "text": "c"},
        {"type": "image_url", "image_url": {"url": "data:,"}}]}}, "documents[1]"),
    ("/rerank", {"query": "a", "documents": ["c", {"text": "d"}]}, "documents[1]"),
])
def test_what_score_and_rerank_refuse(served, path: str, body: dict, param: str) -> None:
    llm, http, _ = served
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text
    _nothing_left(llm)


def test_the_embeddings_benchmark_runs(clip_llama: str, capsys) -> None:
    """``benchmarks/embeddings.py`` at a tiny scale: both sides ran and agree (its figures are
    not checked: they depend on the machine)."""
    assert load_benchmark("embeddings").main([
        "--model", clip_llama, "--num-prompts", "3", "--rounds", "1", "--image-size", "40",
        "--hf-batch-size", "2"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert "ratio" in line and float(line.rsplit(" ", 1)[1]) < ATOL
