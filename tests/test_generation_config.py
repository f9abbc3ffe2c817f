"""Default sampling parameters from the checkpoint's ``generation_config.json``
(``--generation-config``, as vLLM's): read where a request leaves a field out, in the Python
API and both endpoints; 'vllm' leaves the file out; a file a request could not follow stops
the start with an error naming it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from mmserve import LLM, SamplingParams
from mmserve.config import EngineConfig
from mmserve.entrypoints.generation_config import sampling_defaults
from mmserve.entrypoints.openai_protocol import parse_chat_request, parse_completion_request
from tests.conftest import assert_no_leaks
from tests.test_logprobs import PROMPTS


def _config(folder: Path, fields: dict | None, setting: str = "auto") -> EngineConfig:
    folder.mkdir(parents=True, exist_ok=True)
    if fields is not None:
        (folder / "generation_config.json").write_text(json.dumps(fields))
    return EngineConfig(model=str(folder), generation_config=setting, device="cpu")


def test_the_fields_vllm_reads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    qwen25 = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True,
              "eos_token_id": [151645, 151643], "repetition_penalty": 1.05,
              "temperature": 1e-06, "top_k": 1, "top_p": 0.001, "max_new_tokens": 512}
    with caplog.at_level(logging.INFO, logger="mmserve.entrypoints.generation_config"):
        defaults = sampling_defaults(_config(tmp_path / "q", qwen25))
    assert defaults == {"temperature": 0.01, "top_p": 0.001, "top_k": 1,
                        "repetition_penalty": 1.05, "max_tokens": 512}  # raised to 0.01
    assert "repetition_penalty=1.05" in caplog.text
    # do_sample is not read (vLLM's way): the temperature written is used.
    assert sampling_defaults(_config(tmp_path / "d", {"do_sample": False, "temperature": 0.7,
                                                      "min_p": 0.1})) == {
        "temperature": 0.7, "min_p": 0.1}
    assert sampling_defaults(_config(tmp_path / "q", None, "vllm")) == {}
    assert sampling_defaults(_config(tmp_path / "none", None)) == {}  # no file: none
    other = _config(tmp_path / "o", {"top_k": 20})
    assert sampling_defaults(_config(tmp_path / "m", None, str(tmp_path / "o"))) == {"top_k": 20}
    assert sampling_defaults(other) == {"top_k": 20}  # its own folder's, by default


@pytest.mark.parametrize("content, fragment", [
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"repetition_penalty": -1}, "repetition_penalty must be"),
    ({"max_new_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"temperature": "hot"}, "temperature must be"),
    ({"temperature": 3.0}, "temperature must be at most 2"),
    ("[1, 2]", "must hold a JSON object"),
    ("{not json", "cannot be read as JSON"),
])
def test_a_file_a_request_could_not_follow_is_refused(tmp_path: Path, content,
                                                      fragment: str) -> None:
    tmp_path.joinpath("generation_config.json").write_text(
        content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match="generation_config.json") as e:
        sampling_defaults(EngineConfig(model=str(tmp_path), device="cpu"))
    assert fragment in str(e.value)
    with pytest.raises(ValueError, match="no generation_config.json in that folder"):
        sampling_defaults(EngineConfig(model=str(tmp_path), device="cpu",
                                       generation_config=str(tmp_path / "missing")))


def test_requests_that_leave_fields_out_get_the_defaults() -> None:
    defaults = {"temperature": 0.3, "top_p": 0.8, "top_k": 7, "min_p": 0.05,
                "repetition_penalty": 1.1, "max_tokens": 40}
    body = {"messages": [{"role": "user", "content": "hi"}]}
    p = parse_chat_request(body, max_model_len=100, max_images=1, defaults=defaults).params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        0.3, 0.8, 7, 0.05, 1.1, 40)
    own = {"temperature": 0, "top_p": 1, "top_k": 0, "min_p": 0, "repetition_penalty": 1,
           "max_tokens": 5}
    p = parse_completion_request({"prompt": "hi", **own}, max_model_len=100,
                                 defaults=defaults).params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        0, 1, 0, 0, 1, 5)
    # The default max_tokens within the context.
    assert parse_completion_request({"prompt": "hi"}, max_model_len=30,
                                    defaults=defaults).params.max_tokens == 30
    assert parse_completion_request({"prompt": "hi"}, max_model_len=100).params.max_tokens == 16


@pytest.fixture(scope="module")
def with_defaults(clip_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny checkpoint with a generation config that changes greedy output."""
    path = tmp_path_factory.mktemp("generation") / "ckpt"
    shutil.copytree(clip_llama, path)
    config = json.loads((path / "generation_config.json").read_text()) if (
        path / "generation_config.json").exists() else {}
    config.update(temperature=0.0, repetition_penalty=0.5, max_new_tokens=9)
    (path / "generation_config.json").write_text(json.dumps(config))
    return str(path)


def test_generate_and_the_server_follow_the_checkpoints_defaults(with_defaults: str) -> None:
    from mmserve.entrypoints.api_server import OpenAIServer
    from mmserve.entrypoints.serve_args import ServerConfig

    explicit = SamplingParams(temperature=0.0, repetition_penalty=0.5, max_tokens=9)
    with LLM(with_defaults, dtype="float32", max_model_len=256) as llm:
        assert llm.get_default_sampling_params() == explicit
        (by_default,) = llm.generate(PROMPTS[1])
        (expected,) = llm.generate(PROMPTS[1], explicit)
        (plain,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=9))
        assert by_default.token_ids == expected.token_ids != plain.token_ids
        assert len(by_default.token_ids) == 9
        server = OpenAIServer(llm.engine, ServerConfig("tiny"))
        with TestClient(server.app()) as http:
            answer = http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": PROMPTS[1]["messages"]}).json()
            own = http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": PROMPTS[1]["messages"], "repetition_penalty": 1,
                "max_tokens": 9}).json()
        assert answer["choices"][0]["message"]["content"] == expected.text
        assert answer["usage"]["completion_tokens"] == 9
        assert own["choices"][0]["message"]["content"] == plain.text
        assert_no_leaks(llm.engine)
    with LLM(with_defaults, dtype="float32", max_model_len=256,
             generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_every_end_token_the_generation_config_lists_stops(clip_llama: str,
                                                          tmp_path: Path) -> None:
    """A generation config that lists several end tokens (Qwen2-VL's <|im_end|> and
    <|endoftext|>): each ends a request, as in transformers' ``generate``."""
    from mmserve.testing.oracle import hf_greedy_generate, load_hf_processor

    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        (plain,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12))
    third = plain.token_ids[2]
    path = tmp_path / "ckpt"
    shutil.copytree(clip_llama, path)
    config = json.loads((path / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], third]
    (path / "generation_config.json").write_text(json.dumps(config))
    with LLM(str(path), dtype="float32", max_model_len=256) as llm:
        (out,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12))
        (ignored,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12,
                                                             ignore_eos=True))
        (held,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12,
                                                          min_tokens=5))
    assert out.token_ids == plain.token_ids[:3] and out.finish_reason == "stop"
    text = load_hf_processor(str(path)).apply_chat_template(
        PROMPTS[1]["messages"], add_generation_prompt=True, tokenize=False)
    assert out.token_ids == hf_greedy_generate(str(path), text, [], 12)
    assert ignored.token_ids == plain.token_ids and ignored.finish_reason == "length"
    assert third not in held.token_ids[:5] and len(held.token_ids) >= 5
