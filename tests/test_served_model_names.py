"""Several ``--served-model-name`` ids, as vLLM takes them: requests may name any, answers
report the first, ``/v1/models`` lists each; a model path written after the flag is said to
be one, not served as the demo model under the names."""

from __future__ import annotations

import openai
import pytest
from starlette.testclient import TestClient

from mmserve import LLM
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.cli import build_parser, main
from mmserve.entrypoints.serve_args import ServerConfig
from mmserve.entrypoints.serve_command import served_model_names
from tests.conftest import assert_no_leaks


def test_requests_may_name_any_and_answers_report_the_first(clip_llama: str) -> None:
    config = ServerConfig("tiny", model_aliases=("gpt-4o", "org/llava"))
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        with TestClient(OpenAIServer(llm.engine, config).app()) as http:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                                   max_retries=0, http_client=http)
            listed = client.models.list().data
            assert [m.id for m in listed] == ["tiny", "gpt-4o", "org/llava"]
            assert {m.root for m in listed} == {"tiny"}
            card = client.models.retrieve("org/llava")
            assert card.id == "org/llava" and card.root == "tiny"
            for name in ("tiny", "gpt-4o", "org/llava"):
                answer = client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
                assert answer.model == "tiny"
            with pytest.raises(openai.NotFoundError, match="'tiny' or 'gpt-4o' or 'org/llava'"):
                client.completions.create(model="other", prompt="hi", max_tokens=2)
        assert_no_leaks(llm.engine)


def test_the_flag_takes_several_and_a_model_after_it_is_said(tmp_path, capsys) -> None:
    args = build_parser().parse_args(["serve", "/ckpt", "--served-model-name", "a", "b", "a"])
    assert served_model_names(args, "/ckpt") == ("a", "b")
    args = build_parser().parse_args(["serve", "/ckpt"])
    assert served_model_names(args, "/ckpt") == ("/ckpt",)
    for command in (["serve"], ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"]):
        assert main([*command, "--served-model-name", "llava", str(tmp_path)]) == 2
        assert "put the model before the flag" in capsys.readouterr().err
