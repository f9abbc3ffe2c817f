"""LoRA adapters: greedy float32 output equals transformers' generate() on the checkpoint with
the adapter merged into its weights, token for token, for requests of several adapters and
none in one batch (LLaVA with Llama and Qwen2 decoders, Qwen2-VL's M-RoPE); through chunked
prefill, preemption, asynchronous scheduling and more adapters than slots; prefix-cache blocks
kept to their adapter; adapters that cannot run refused with what to change; the server's
``--lora-modules`` (the adapter named as the model) and the memory plan's slots."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from mmserve import LLM, LoRARequest, SamplingParams
from mmserve.errors import InvalidInputError
from mmserve.models.lora import LoRARows, attach_lora, read_adapter, target_shapes
from mmserve.processing.hf_processors import load_qwen2_vl_processor
from mmserve.testing import build_tiny_checkpoint
from mmserve.testing.lora import build_lora_adapter, merge_lora
from mmserve.testing.oracle import hf_greedy_generate, load_hf_processor
from tests.conftest import assert_no_leaks, generate_all_at_once, make_image, openai_app
from tests.test_parity import _kv_bytes_per_token

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
IMAGES = [make_image(i, size) for i, size in enumerate([(48, 40), (64, 64), (23, 57)])]
TEXTS = ["describe the picture please", "what colour is the square on the left side?",
         "tell me a long story about a red fox who lives near the river, with many words"]


def _prompt(i: int, image: bool = True) -> dict:
    content = ([{"type": "image"}] if image else []) + [{"type": "text", "text": TEXTS[i]}]
    return {"messages": [{"role": "user", "content": content}],
            "images": [IMAGES[i]] if image else []}


PROMPTS = [_prompt(0), _prompt(1), _prompt(2, image=False)]


@functools.cache
def _template(path: str):
    return load_hf_processor(path) if "qwen2_vl" not in path else load_qwen2_vl_processor(path)


def reference(path: str, prompt: dict, max_tokens: int = MAX_TOKENS) -> list[int]:
    text = _template(path).apply_chat_template(prompt["messages"], add_generation_prompt=True,
                                              tokenize=False)
    return hf_greedy_generate(path, text, prompt["images"], max_tokens)


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """For each decoder: the checkpoint, two adapters (one of every projection; one of some,
    with rsLoRA and a rank of its own for one target) and the checkpoint with each merged."""
    root = tmp_path_factory.mktemp("lora")
    paths = {"clip-llama": checkpoints["clip-llama"],
             "siglip-qwen2": checkpoints["siglip-qwen2"],
             "qwen2_vl": str(build_tiny_checkpoint("qwen2_vl", root / "qwen2_vl",
                                                   layout="transformers"))}
    found = {}
    for name, path in paths.items():
        a = build_lora_adapter(path, root / f"{name}-a", rank=4, alpha=8, seed=1)
        b = build_lora_adapter(path, root / f"{name}-b", rank=8, alpha=4, seed=2,
                               targets=("q_proj", "v_proj", "down_proj"), use_rslora=True,
                               rank_pattern={"down_proj": 2})
        found[name] = {
            "base": path,
            "a": (LoRARequest("a", 1, str(a)), merge_lora(path, a, root / f"{name}-merged-a")),
            "b": (LoRARequest("b", 2, str(b)), merge_lora(path, b, root / f"{name}-merged-b")),
        }
    return found


def _expected(model: dict, adapters: list[str | None],
              max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return [reference(str(model["base"] if a is None else model[a][1]), p, max_tokens)
            for p, a in zip(PROMPTS * 2, adapters, strict=True)]


def _loras(model: dict, adapters: list[str | None]) -> list[LoRARequest | None]:
    return [None if a is None else model[a][0] for a in adapters]


# Every prompt with each adapter and without, interleaved in one batch.
MIXED = ["a", None, "b", "b", "a", None]


@pytest.mark.parametrize("name", ["clip-llama", "siglip-qwen2", "qwen2_vl"])
def test_adapters_in_one_batch_equal_transformers_with_them_merged(models, name) -> None:
    model = models[name]
    expected = _expected(model, MIXED)
    # Each adapter changes the answers (else the comparison proves little): the second
    # prompt with "a" and without, the third with "b" and without.
    assert expected[4] != expected[1] and expected[2] != expected[5]
    with LLM(model["base"], dtype="float32", max_model_len=512, enable_lora=True,
             max_loras=2) as llm:
        outs = llm.generate(PROMPTS * 2, GREEDY, lora_request=_loras(model, MIXED))
        assert [o.token_ids for o in outs] == expected
        assert_no_leaks(llm.engine)


@pytest.mark.parametrize("settings", [
    # Prompts split into chunks of 16 tokens (an image's placeholders across steps).
    {"max_num_batched_tokens": 16, "max_loras": 2},
    # One slot for two adapters: requests wait for the other adapter's to end.
    {"max_loras": 1},
    # The next step scheduled while one computes.
    {"max_loras": 2, "async_scheduling": True},
], ids=["chunked", "one-slot", "async"])
def test_adapters_through_chunks_waits_and_asynchronous_steps(models, settings) -> None:
    model = models["clip-llama"]
    with LLM(model["base"], dtype="float32", max_model_len=512, enable_lora=True,
             **settings) as llm:
        outs = llm.generate(PROMPTS * 2, GREEDY, lora_request=_loras(model, MIXED))
        assert [o.token_ids for o in outs] == _expected(model, MIXED)
        assert_no_leaks(llm.engine)


def test_preempted_requests_take_their_adapter_again(models) -> None:
    """A KV cache of 8 blocks: requests, every one with an adapter, are preempted and
    recomputed, each taking its adapter's slot again, and give the same tokens."""
    model = models["clip-llama"]
    adapters = ["a", "b", "a", "b", "b", "a"]
    with LLM(model["base"], dtype="float32", block_size=16, max_model_len=128, max_num_seqs=6,
             enable_lora=True, max_loras=2, async_scheduling=False,
             kv_cache_memory=8 * 16 * _kv_bytes_per_token(model["base"]),
             enable_prefix_caching=False) as llm:
        assert llm.engine.plan.num_blocks == 8
        prompts = [{**p, "lora_request": model[a][0]}
                   for p, a in zip(PROMPTS * 2, adapters, strict=True)]
        outs = generate_all_at_once(llm, prompts, SamplingParams(max_tokens=32,
                                                                 temperature=0.0))
        assert llm.stats()["num_preemptions"] > 0
        assert [o.token_ids for o in outs] == _expected(model, adapters, 32)
        assert_no_leaks(llm.engine)


def test_prefix_cache_blocks_stay_with_their_adapter(models) -> None:
    model = models["clip-llama"]
    lora = model["a"][0]
    with LLM(model["base"], dtype="float32", max_model_len=512, enable_lora=True) as llm:
        def run(adapter: LoRARequest | None) -> tuple[list[int], int]:
            out = llm.generate([PROMPTS[0]], GREEDY, lora_request=adapter)[0]
            return out.token_ids, out.num_cached_tokens

        base, cached = run(None)
        assert cached == 0
        first, cached_first = run(lora)
        again, cached_again = run(lora)
        base_again, cached_base = run(None)
        assert cached_first == 0 and cached_again > 0 and cached_base > 0
        assert first == again != base == base_again
        # The image's encoder output is the model's whatever the adapter: encoded once.
        assert llm.engine.stats()["encoder_items_computed"] == 1
        assert_no_leaks(llm.engine)


def _broken_adapters(model: dict, tmp_path) -> dict[str, tuple[str, str]]:
    """Adapters that cannot run on ``model``: name -> (folder, what its refusal says)."""
    from safetensors.torch import load_file, save_file

    good = model["a"][0].lora_path

    def copy(name: str, **config) -> str:
        path = tmp_path / name
        shutil.copytree(good, path)
        file = path / "adapter_config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
        return str(path)

    def edited(name: str, edit) -> str:
        path = tmp_path / name
        shutil.copytree(good, path)
        tensors = load_file(str(path / "adapter_model.safetensors"))
        edit(tensors, next(k for k in tensors if "layers.0.self_attn.q_proj.lora_A" in k))
        save_file(tensors, str(path / "adapter_model.safetensors"))
        return str(path)

    def renamed(old: str, new: str):
        return lambda tensors, key: tensors.__setitem__(key.replace(old, new), tensors.pop(key))

    return {
        "missing": (str(tmp_path / "nowhere"), "no adapter_config.json"),
        "dora": (copy("dora", use_dora=True), "DoRA adapters are not supported"),
        "bias": (copy("bias", bias="all"), "bias='all' adapters are not supported"),
        "vision": (edited("vision", renamed("language_model.model.",
                                            "vision_tower.vision_model.encoder.")),
                   "which mmserve does not adapt"),
        "shape": (edited("shape", lambda tensors, key: tensors.__setitem__(
            key, tensors[key][:, :32].contiguous())), "it is another model's"),
        "layer": (edited("layer", renamed("layers.0.", "layers.7.")),
                  "changes layer 7, but the model has 2"),
        "half": (edited("half", lambda tensors, key: tensors.pop(key)),
                 "without its other half"),
        "rank": (model["b"][0].lora_path, "above max_lora_rank=4"),
    }


def test_adapters_that_cannot_run_are_refused_saying_why(models, tmp_path) -> None:
    model = models["clip-llama"]
    with LLM(model["base"], dtype="float32", max_model_len=512, enable_lora=True,
             max_lora_rank=4) as llm:
        cases = _broken_adapters(model, tmp_path)
        for i, (path, message) in enumerate(cases.values()):
            with pytest.raises(InvalidInputError, match=message) as caught:
                llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("x", 10 + i, path))
            assert caught.value.param == "lora_request"
        # The engine serves on, the good adapter too.
        out = llm.generate([PROMPTS[0]], GREEDY, lora_request=model["a"][0])[0]
        assert out.token_ids == _expected(model, ["a"] + [None] * 5)[0]
        assert_no_leaks(llm.engine)
    with LLM(model["base"], dtype="float32", max_model_len=512) as llm:
        with pytest.raises(InvalidInputError, match="started without LoRA"):
            llm.generate([PROMPTS[0]], GREEDY, lora_request=model["a"][0])
    with pytest.raises(InvalidInputError, match="lora_int_id"):
        LoRARequest("a", 0, model["a"][0].lora_path)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["in-step", "ahead"])
def test_an_adapter_gone_before_it_loads_fails_its_requests_alone(models, tmp_path,
                                                                  async_scheduling) -> None:
    """Checked when its request was made, then removed before its first step: its request
    fails with why, the others run; its files back, it is read again."""
    model = models["clip-llama"]
    moved = tmp_path / "moved"
    shutil.copytree(model["a"][0].lora_path, moved)
    lora = LoRARequest("moved", 5, str(moved))
    with LLM(model["base"], dtype="float32", max_model_len=512, enable_lora=True,
             max_loras=2, async_scheduling=async_scheduling) as llm:
        engine = llm.engine
        doomed = engine.add_request({**PROMPTS[0], "lora_request": lora}, GREEDY)
        fine = engine.add_request({**PROMPTS[1], "lora_request": model["b"][0]}, GREEDY)
        plain = engine.add_request(PROMPTS[2], GREEDY)
        shutil.rmtree(moved)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert done[doomed].finish_reason == "error" and "moved" in done[doomed].error
        expected = _expected(model, ["a", "b", None, None, None, None])
        assert [done[fine].token_ids, done[plain].token_ids] == expected[1:3]
        assert_no_leaks(engine)
        # Its files back: its next request reads it again, into a slot of its own.
        shutil.copytree(model["a"][0].lora_path, moved)
        out = llm.generate([PROMPTS[0]], GREEDY, lora_request=lora)[0]
        assert out.outputs[0].finish_reason == "length" and out.token_ids == expected[0]
        assert_no_leaks(engine)


def test_the_memory_plan_counts_the_slots(models) -> None:
    model = models["clip-llama"]
    with LLM(model["base"], dtype="float32", max_model_len=512) as plain, \
            LLM(model["base"], dtype="float32", max_model_len=512, enable_lora=True,
                max_loras=3, max_lora_rank=8) as lora:
        # Each decoder layer's seven projections, A and B of rank 8 in each of 3 slots.
        text = lora.engine.hf_config.text_config
        slots = 3 * 8 * 4 * text.num_hidden_layers * sum(
            i + o for i, o in target_shapes(text).values())
        assert lora.engine.weights_bytes - plain.engine.weights_bytes == slots
        assert lora.engine.plan.weights_bytes == lora.engine.weights_bytes
        assert lora.engine.plan.lora_bytes == slots and plain.engine.plan.lora_bytes == 0
        assert "LoRA adapters' slots" in lora.engine.plan.summary()


def test_the_server_serves_its_lora_modules_as_models(models) -> None:
    model = models["clip-llama"]
    lora = model["a"][0]
    with openai_app(model["base"], {"lora_modules": (("sql", lora.lora_path),)},
                    max_model_len=512, enable_lora=True) as (llm, http, client):
        listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert listed["sql"]["parent"] == "tiny" and listed["sql"]["root"] == lora.lora_path
        assert listed["tiny"]["parent"] is None
        assert http.get("/v1/models/sql").json()["parent"] == "tiny"
        answer = client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": TEXTS[1]}], max_tokens=MAX_TOKENS,
            temperature=0, extra_body={"return_token_ids": True})
        text_only = {"messages": [{"role": "user", "content": [{"type": "text",
                                                                 "text": TEXTS[1]}]}],
                     "images": []}
        want = reference(str(model["a"][1]), text_only)
        assert answer.model == "sql" and answer.choices[0].token_ids == want
        streamed = list(client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": TEXTS[1]}],
            max_tokens=MAX_TOKENS, temperature=0, stream=True))
        assert {c.model for c in streamed} == {"sql"}
        assert "".join(c.choices[0].delta.content or "" for c in streamed
                       if c.choices) == answer.choices[0].message.content
        assert want != reference(model["base"], text_only)  # the adapter's own
        response = client.responses.create(model="sql", input=TEXTS[1], temperature=0,
                                           max_output_tokens=MAX_TOKENS)
        assert response.model == "sql"
        assert response.output_text == answer.choices[0].message.content
        embedded = {name: client.embeddings.create(model=name, input=TEXTS[1])
                    for name in ("sql", "tiny")}
        assert embedded["sql"].model == "sql"
        assert embedded["sql"].data[0].embedding != embedded["tiny"].data[0].embedding
        # A content item (a chat turn) against a text: both embedded with the adapter, as
        # the embeddings endpoint gives them.
        content = [{"type": "text", "text": TEXTS[1]}]
        for name in ("sql", "tiny"):
            scored = http.post("/score", json={"model": name, "text_1": [{"content": content}],
                                               "text_2": [TEXTS[2]]}).json()
            chat, text = (torch.tensor(http.post("/v1/embeddings", json={
                "model": name, **body}).json()["data"][0]["embedding"]) for body in (
                    {"messages": [{"role": "user", "content": content}]}, {"input": TEXTS[2]}))
            assert scored["model"] == name
            assert scored["data"][0]["score"] == pytest.approx(
                torch.cosine_similarity(chat, text, dim=0).item(), abs=1e-5)
        base = client.completions.create(model="tiny", prompt=TEXTS[2], max_tokens=4,
                                         temperature=0)
        adapted = client.completions.create(model="sql", prompt=TEXTS[2], max_tokens=4,
                                            temperature=0, stream=True)
        chunks = list(adapted)
        assert base.model == "tiny" and {c.model for c in chunks} == {"sql"}
        assert "".join(c.choices[0].text for c in chunks if c.choices) != base.choices[0].text
        missing = http.post("/v1/chat/completions", json={
            "model": "nope", "messages": [{"role": "user", "content": "hi"}]})
        assert missing.status_code == 404 and "'sql'" in missing.json()["error"]["message"]


def test_adapters_cross_to_an_engine_process(models) -> None:
    """``--engine-process``: the front end checks a request's adapter, the core loads it into
    a slot and runs it, as in one process."""
    from tests.test_engine_core_process import Core, collect, config_of

    model = models["clip-llama"]
    core = Core(config_of(model["base"], max_model_len=512, enable_lora=True, max_loras=2))
    try:
        async def main() -> list[list[int]]:
            streams = [await core.client.add_request(
                f"r{i}", p if a is None else {**p, "lora_request": model[a][0]}, GREEDY)
                for i, (p, a) in enumerate(zip(PROMPTS * 2, MIXED, strict=True))]
            return [(await collect(s)).token_ids for s in streams]

        assert core.run(main()) == _expected(model, MIXED)
        with pytest.raises(InvalidInputError, match="no adapter_config.json"):
            core.run(core.client.add_request("bad", {**PROMPTS[0], "lora_request": LoRARequest(
                "x", 9, str(models["clip-llama"]["base"]))}, GREEDY))
    finally:
        core.close()


def test_beam_search_captions_and_embeddings_take_an_adapter(models) -> None:
    """``LLM.beam_search`` (its rounds' requests, each a prompt and the beam's tokens, keep
    the adapter) equals transformers' beam search on the merged checkpoint; ``caption`` and
    ``embed`` run with the adapter too."""
    from mmserve import BeamSearchParams
    from mmserve.testing.oracle import hf_beam_search

    model = models["clip-llama"]
    lora, merged = model["a"]
    prompt = PROMPTS[0]
    text = _template(model["base"]).apply_chat_template(
        prompt["messages"], add_generation_prompt=True, tokenize=False)
    want = [tokens for tokens, _ in hf_beam_search(str(merged), text, prompt["images"], 2, 6)]
    with LLM(model["base"], dtype="float32", max_model_len=512, enable_lora=True) as llm:
        searched = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=6),
                                   lora_request=lora)[0]
        assert searched.error is None
        assert [seq.token_ids for seq in searched.sequences] == want
        caption = llm.caption([IMAGES[0]], TEXTS[0], GREEDY, use_tqdm=False,
                              lora_request=lora)[0]
        assert caption == llm.generate([prompt], GREEDY, lora_request=lora)[0].text
        assert caption != llm.caption([IMAGES[0]], TEXTS[0], GREEDY, use_tqdm=False)[0]
        adapted, plain = (llm.embed([TEXTS[1]], lora_request=r)[0].outputs.embedding
                          for r in (lora, None))
        assert adapted != plain
        assert_no_leaks(llm.engine)


def test_lora_modules_flags_as_vllm_takes_them(models, tmp_path, capsys) -> None:
    from mmserve.entrypoints.cli import build_parser, main
    from mmserve.entrypoints.serve_command import front_door_config

    model = models["clip-llama"]
    a, b = model["a"][0].lora_path, model["b"][0].lora_path
    args = build_parser().parse_args([
        "serve", model["base"], "--enable-lora", "--lora-modules", f"sql={a}",
        json.dumps({"name": "ocr", "path": b, "base_model_name": "x"})])
    assert front_door_config(args, model["base"]).lora_modules == (("sql", a), ("ocr", b))
    refused = [  # (engine flags, --lora-modules values, what the refusal says)
        ((), (f"sql={a}",), "start with --enable-lora too"),
        (("--enable-lora",), ("sql",), "write each adapter as name=path"),
        (("--enable-lora",), (f"sql={tmp_path}/none",), "no such folder"),
        (("--enable-lora",), ('{"name": "sql"}',), 'a JSON adapter is an object of a "name"'),
        (("--enable-lora",), (f"sql={a}", f"sql={b}"), "names 'sql' twice"),
        (("--enable-lora", "--max-lora-rank", "4"), (f"sql={b}",), "above max_lora_rank=4"),
    ]
    for engine, modules, message in refused:
        assert main(["serve", model["base"], *engine, "--lora-modules", *modules]) == 2
        assert message in capsys.readouterr().err, modules
    assert main(["serve", model["base"], "--allow-runtime-lora-updating"]) == 2
    assert "start with --enable-lora too" in capsys.readouterr().err


def test_a_served_adapter_gone_is_the_servers_error(models, tmp_path) -> None:
    """An adapter of ``--lora-modules`` whose folder is gone (after requests ran with it):
    its requests are a 500 naming it on every endpoint (nothing the client sent is wrong),
    and the model's own requests run on."""
    model = models["clip-llama"]
    gone = tmp_path / "gone"
    shutil.copytree(model["a"][0].lora_path, gone)
    with openai_app(model["base"], {"lora_modules": (("sql", str(gone)),)},
                    max_model_len=512, enable_lora=True) as (_, http, _client):
        chat = {"messages": [{"role": "user", "content": TEXTS[1]}], "max_tokens": 2}
        assert http.post("/v1/chat/completions", json={"model": "sql", **chat}).status_code == 200
        shutil.rmtree(gone)  # (after its first requests passed their check)
        refused = http.post("/v1/chat/completions", json={"model": "sql", **chat})
        assert refused.status_code == 500
        error = refused.json()["error"]
        assert error["code"] == "adapter_unavailable" and "'sql'" in error["message"]
        for path, body in (("/v1/embeddings", {"input": ["a", "b"]}),
                           ("/score", {"text_1": "a", "text_2": ["b"]}),
                           ("/rerank", {"query": "a", "documents": ["b", "c"]}),
                           ("/v1/completions", {"prompt": "a", "max_tokens": 2}),
                           ("/v1/responses", {"input": "a", "max_output_tokens": 2})):
            refused = http.post(path, json={"model": "sql", **body})
            error = refused.json()["error"]
            assert (refused.status_code, error["code"]) == (500, "adapter_unavailable"), path
            assert "'sql'" in error["message"], path
        assert http.post("/v1/chat/completions", json={"model": "tiny", **chat}).status_code == 200


def test_adapters_loaded_and_unloaded_at_run_time(models, tmp_path) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, with
    --allow-runtime-lora-updating: a loaded adapter is a model from then on (checked against
    the checkpoint first), an unloaded one no longer; loading is refused where not allowed."""
    model = models["clip-llama"]
    lora, merged = model["a"]
    chat = {"messages": [{"role": "user", "content": TEXTS[1]}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True}
    text_only = {"messages": [{"role": "user", "content": [{"type": "text", "text": TEXTS[1]}]}],
                 "images": []}
    with openai_app(model["base"], {"allow_runtime_lora_updating": True},
                    max_model_len=512, enable_lora=True) as (_, http, _client):
        load = {"lora_name": "ocr", "lora_path": lora.lora_path}
        added = http.post("/v1/load_lora_adapter", json=load)
        assert added.status_code == 200 and "'ocr' added" in added.text
        assert "ocr" in {m["id"] for m in http.get("/v1/models").json()["data"]}
        answer = http.post("/v1/chat/completions", json={"model": "ocr", **chat}).json()
        assert answer["model"] == "ocr"
        assert answer["choices"][0]["token_ids"] == reference(str(merged), text_only)
        refusals = [
            (load, 400, "loaded already"),
            ({"lora_name": "tiny", "lora_path": lora.lora_path}, 400, "loaded already"),
            ({"lora_name": "x", "lora_path": str(tmp_path)}, 400, "no adapter_config.json"),
            ({"lora_name": "x"}, 400, "lora_path must be"),
            ({"lora_path": lora.lora_path}, 400, "lora_name must be"),
        ]
        for body, status, message in refusals:
            refused = http.post("/v1/load_lora_adapter", json=body)
            assert (refused.status_code, message in refused.json()["error"]["message"]) == (
                status, True), body
        removed = http.post("/v1/unload_lora_adapter", json={"lora_name": "ocr"})
        assert removed.status_code == 200 and "'ocr' removed" in removed.text
        assert http.post("/v1/chat/completions", json={"model": "ocr", **chat}).status_code == 404
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "ocr"}).status_code == 404
    with openai_app(model["base"], max_model_len=512, enable_lora=True) as (_, http, _client):
        off = http.post("/v1/load_lora_adapter", json=load)
        assert off.status_code == 404
        assert "--allow-runtime-lora-updating" in off.json()["error"]["message"]


@pytest.mark.parametrize(("name", "size"), [("clip-llama", 2), ("qwen2_vl", 2),
                                           ("clip-llama", 4)])
def test_each_rank_holds_its_share_of_an_adapter(models, name, size) -> None:
    """Under tensor parallelism each rank's slots hold its rows of a column-parallel layer's
    ``B`` (each shard's: q, k, v; gate, up; four ranks of two KV heads: k and v replicated)
    and its columns of a row-parallel layer's ``A``: each rank's output is its rows of the
    whole layer's, and the row-parallel layers' partial sums add up (as the all-reduce adds
    them) to the whole layer's output."""
    from transformers import AutoConfig

    from mmserve.models import loader, parallel
    from mmserve.models.forward_context import forward_context

    path = models[name]["base"]
    config = AutoConfig.from_pretrained(path)
    hidden = config.text_config.hidden_size
    adapter = read_adapter("a", models[name]["a"][0].lora_path, config.text_config, 8,
                           torch.float32)
    torch.manual_seed(0)
    x, o_in = torch.randn(5, hidden), torch.randn(5, hidden)
    down_in = torch.randn(5, config.text_config.intermediate_size)

    def run(rank: int, size: int) -> tuple[dict, dict[str, torch.Tensor]]:
        with parallel.tensor_parallel(rank, size):
            model = loader.load_model(path, config, torch.float32)
        layer = attach_lora(model, 2, 8).layers[0]
        model.lora.load(1, adapter)

        def share(full: torch.Tensor, module) -> torch.Tensor:
            window = module.input_window
            return full if window is None else full.narrow(1, window.start, window.length)

        inputs = {"qkv_proj": x, "gate_up_proj": x, "o_proj": share(o_in, layer["o_proj"]),
                  "down_proj": share(down_in, layer["down_proj"])}
        with torch.inference_mode(), forward_context(None, None, None,
                                                     LoRARows(5, [(1, None)])):
            return layer, {key: layer[key](value) for key, value in inputs.items()}

    whole_layer, whole = run(0, 1)
    with torch.inference_mode():  # (the adapter changes every layer's output)
        assert all(not torch.allclose(whole_layer[key].base(value), whole[key], atol=1e-3)
                   for key, value in (("qkv_proj", x), ("gate_up_proj", x),
                                      ("o_proj", o_in), ("down_proj", down_in)))
    ranks = [run(rank, size) for rank in range(size)]
    for key in ("o_proj", "down_proj"):
        assert torch.allclose(sum(outputs[key] for _, outputs in ranks), whole[key], atol=1e-5)
    for key in ("qkv_proj", "gate_up_proj"):
        columns = whole_layer[key].columns
        for layer, outputs in ranks:
            want = torch.cat([whole[key][:, cols].narrow(1, w.start, w.length)
                              for cols, w in zip(columns, layer[key].output_windows,
                                                 strict=True)], dim=1)
            assert torch.allclose(outputs[key], want, atol=1e-5), key


@pytest.mark.slow
def test_two_ranks_run_adapters_as_transformers_merged(models) -> None:
    """Tensor parallelism of two worker processes: each reads its share of every adapter, and
    the batch of two adapters and none gives transformers' tokens on the merged
    checkpoints."""
    model = models["clip-llama"]
    with LLM(model["base"], dtype="float32", max_model_len=512, enable_lora=True,
             max_loras=2, tensor_parallel_size=2) as llm:
        outs = llm.generate(PROMPTS * 2, GREEDY, lora_request=_loras(model, MIXED))
        assert [o.token_ids for o in outs] == _expected(model, MIXED)
        assert llm.engine.plan.lora_bytes > 0
        assert_no_leaks(llm.engine)
