"""vLLM's ``truncate_prompt_tokens``: only the prompt's last tokens are read. Greedy float32
output equal to transformers' on the same last tokens (LLaVA, and Qwen2-VL, whose M-RoPE
positions start again at the kept part), images kept among them; a cut image, a size past
max_model_len and bad values refused by name; a prompt longer than max_model_len taken
when it is truncated to fit; on both endpoints."""

from __future__ import annotations

import functools

import pytest
from starlette.testclient import TestClient

from mmserve import LLM, SamplingParams
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.serve_args import ServerConfig
from mmserve.errors import InvalidInputError
from mmserve.processing.processor import TRUNCATED_PROMPT_FACTOR
from mmserve.testing.families import build_tiny_checkpoint
from mmserve.testing.oracle import hf_greedy_generate, load_hf_processor
from tests.conftest import assert_no_leaks, make_image

MAX_TOKENS = 12
SYSTEM = {"role": "system", "content": "you answer in few words, and only about what the "
                                        "picture shows; never guess what is outside it"}


def _prompt(images: int) -> dict:
    return {"messages": [SYSTEM, {"role": "user", "content": [
        *[{"type": "image"}] * images, {"type": "text", "text": "what is in this picture?"}]}],
        "images": [make_image(i + 1, (40, 30)) for i in range(images)]}


@functools.cache
def _processor(path: str):
    return load_hf_processor(path)


def _reference(path: str, prompt: dict, keep_last: int) -> list[int]:
    text = _processor(path).apply_chat_template(prompt["messages"], add_generation_prompt=True,
                                                tokenize=False)
    return hf_greedy_generate(path, text, prompt["images"], MAX_TOKENS, keep_last=keep_last)


def _params(keep_last: int | None, **fields) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0,
                             "truncate_prompt_tokens": keep_last, **fields})


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_checkpoint("qwen2_vl", tmp_path_factory.mktemp("qwen") / "ckpt",
                                     layout="transformers"))


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_truncated_prompts_equal_transformers(family: str, clip_llama: str, qwen: str) -> None:
    path = clip_llama if family == "llava" else qwen
    prompt = _prompt(1)
    with LLM(path, dtype="float32", max_model_len=512) as llm:
        (whole,) = llm.generate(prompt, _params(None))
        ids = whole.prompt_token_ids
        num_prompt = len(ids)
        # What the tokenizer puts first (LLaVA's Llama: a BOS) stays first.
        bos = 1 if family == "llava" else 0
        assert (ids[0] == llm.engine.processor.tokenizer.bos_token_id) == bool(bos)
        image = llm.engine.processor.process(prompt).images[0]
        shortest = bos + num_prompt - image.offset  # from the image's first token on
        for keep_last in (shortest, shortest + 5, num_prompt, num_prompt + 10, -1):
            (out,) = llm.generate(prompt, _params(keep_last))
            kept = min(num_prompt, keep_last if keep_last > 0 else num_prompt)
            assert out.prompt_token_ids == ids[:bos] + ids[num_prompt - kept + bos:]
            assert out.token_ids == _reference(path, prompt, kept), keep_last
            if kept < num_prompt:
                assert out.token_ids != whole.token_ids or family == "qwen2_vl"
        with pytest.raises(InvalidInputError, match=f"would cut image 1; keep at least "
                                                    f"{shortest},") as e:
            llm.generate(prompt, _params(shortest - 1))
        assert e.value.param == "truncate_prompt_tokens"
        assert_no_leaks(llm.engine)


def test_token_ids_long_prompts_and_refusals(clip_llama: str) -> None:
    with LLM(clip_llama, dtype="float32", max_model_len=64) as llm:
        ids = list(range(5, 45))
        (cut,) = llm.generate({"prompt_token_ids": ids}, _params(16))
        (given,) = llm.generate({"prompt_token_ids": ids[-16:]}, _params(None))
        assert cut.token_ids == given.token_ids and cut.prompt_token_ids == ids[-16:]
        # Longer than max_model_len: refused whole, taken truncated (up to the factor).
        text = " ".join(["word"] * 100)
        with pytest.raises(InvalidInputError, match="max_model_len"):
            llm.generate({"prompt": text}, _params(None))
        (out,) = llm.generate({"prompt": text}, _params(40))
        assert len(out.prompt_token_ids) == 40 and out.token_ids
        whole = llm.engine.processor.process({"prompt": text}).token_ids  # (untruncated)
        assert out.prompt_token_ids == whole[:1] + whole[-39:]
        assert whole[0] == llm.engine.processor.tokenizer.bos_token_id
        with pytest.raises(InvalidInputError, match="up to 4 times max_model_len") as e:
            llm.generate({"prompt_token_ids": [5] * (64 * 4 + 1)}, _params(40))
        assert e.value.param == "prompt"
        (fits,) = llm.generate({"prompt": text}, _params(-1, max_tokens=1))
        assert len(fits.prompt_token_ids) == 64
        too_long = "word " * (64 * TRUNCATED_PROMPT_FACTOR * 2 * llm.engine.processor
                              .max_token_chars)
        with pytest.raises(InvalidInputError, match="characters"):
            llm.generate({"prompt": too_long}, _params(40))
        with pytest.raises(InvalidInputError, match="more than max_model_len") as e:
            llm.generate({"prompt": text}, _params(65))
        assert e.value.param == "truncate_prompt_tokens"
        for value in (0, -2, 1.5, "8", True):
            with pytest.raises(InvalidInputError, match="truncate_prompt_tokens must") as e:
                SamplingParams(truncate_prompt_tokens=value)
        assert_no_leaks(llm.engine)


def test_both_endpoints_take_it(clip_llama: str) -> None:
    with LLM(clip_llama, dtype="float32", max_model_len=64) as llm:
        text = " ".join(["word"] * 100)
        (expected,) = llm.generate({"prompt": text}, _params(30))
        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as http:
            completion = http.post("/v1/completions", json={
                "model": "tiny", "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
                "truncate_prompt_tokens": 30})
            assert completion.status_code == 200, completion.text
            assert completion.json()["choices"][0]["text"] == expected.text
            assert completion.json()["usage"]["prompt_tokens"] == 30
            ids = list(range(5, 45))
            echoed = http.post("/v1/completions", json={
                "model": "tiny", "prompt": ids, "max_tokens": 1, "echo": True,
                "truncate_prompt_tokens": 16})
            assert echoed.status_code == 200, echoed.text
            kept = llm.engine.processor.tokenizer.decode(ids[-16:])
            assert echoed.json()["choices"][0]["text"].startswith(kept)
            assert echoed.json()["usage"]["prompt_tokens"] == 16
            chat = http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": text}],
                "max_tokens": 2, "truncate_prompt_tokens": 20})
            assert chat.status_code == 200, chat.text
            assert chat.json()["usage"]["prompt_tokens"] == 20
            for value, message in ((0, "must be an integer >= 1"), ("5", "must be an integer"),
                                   (65, "more than max_model_len")):
                refused = http.post("/v1/completions", json={
                    "model": "tiny", "prompt": text, "truncate_prompt_tokens": value})
                assert refused.status_code == 400, refused.text
                assert message in refused.json()["error"]["message"]
                assert refused.json()["error"]["param"] == "truncate_prompt_tokens"
        assert_no_leaks(llm.engine)
