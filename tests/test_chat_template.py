"""``--chat-template`` (``EngineConfig.chat_template``): a template file or the template's text
replaces the checkpoint's chat template wherever messages are rendered (the processor,
``LLM.chat`` and ``LLM.generate``, the server's chat endpoint in both layouts), on a LLaVA and
a Qwen2-VL checkpoint; a missing file and a template that does not parse stop the start with
a message naming the setting."""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient
from transformers import AutoConfig

from mmserve import LLM, EngineConfig, SamplingParams
from mmserve.entrypoints import api_server, serve_command
from mmserve.entrypoints.cli import build_parser
from mmserve.entrypoints.serve_args import ServerConfig
from mmserve.processing.chat_template import load_chat_template
from mmserve.processing.processor import InputProcessor
from mmserve.testing import build_tiny_checkpoint
from tests.conftest import make_image

IMAGE = make_image(1, (40, 30))
# Unlike either checkpoint's own template: a marked header per message, no system prompt.
TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>> {% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}IMAGE{% else %}{{ p['text'] }}{% endif %}"
            "{% endfor %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<<answer>>"
            "{% endif %}")
MESSAGES = [{"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": "what is this?"}]}]


def template_for(proc: InputProcessor) -> str:
    return TEMPLATE.replace("IMAGE", proc.image_token)


def rendered(proc: InputProcessor) -> str:
    """What ``TEMPLATE`` makes of ``MESSAGES``."""
    return f"<<user>> {proc.image_token}what is this?\n<<answer>>"


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_checkpoint("qwen2_vl", tmp_path_factory.mktemp("qwen2_vl") / "ckpt"))


@pytest.fixture(params=["llava", "qwen2_vl"])
def model(request) -> str:
    return request.getfixturevalue("clip_llama" if request.param == "llava" else "qwen2_vl")


def processor(model: str, chat_template: str | None = None) -> InputProcessor:
    return InputProcessor(model, AutoConfig.from_pretrained(model, local_files_only=True),
                          1_000_000, chat_template=chat_template)


def setting(form: str, template: str, tmp_path) -> str:
    """``template`` as the setting takes it: a file's path, or the text itself."""
    if form == "text":
        return template
    path = tmp_path / "chat.jinja"
    path.write_text(template, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("form", ["file", "text"])
def test_the_template_replaces_the_checkpoints(model: str, form: str, tmp_path) -> None:
    plain = processor(model)
    proc = processor(model, setting(form, template_for(plain), tmp_path))
    chat = {"messages": MESSAGES, "images": [IMAGE]}
    got = proc.process(chat)
    # The same as the text the template renders, given as a prompt to the plain processor.
    expected = plain.process({"prompt": rendered(plain), "images": [IMAGE]})
    assert got.token_ids == expected.token_ids
    assert [im.hash for im in got.images] == [im.hash for im in expected.images]
    assert np.array_equal(got.positions, expected.positions)
    assert got.token_ids != plain.process(chat).token_ids  # the checkpoint's own differs


def test_llm_chat_and_generate_render_with_it(model: str, tmp_path) -> None:
    plain = processor(model)
    expected = plain.process({"prompt": rendered(plain), "images": [IMAGE]}).token_ids
    params = SamplingParams(max_tokens=1, temperature=0.0)
    with LLM(model, dtype="float32", max_model_len=256,
             chat_template=setting("file", template_for(plain), tmp_path)) as llm:
        (chatted,) = llm.chat(MESSAGES, params, images=[IMAGE])
        (generated,) = llm.generate({"messages": MESSAGES, "images": [IMAGE]}, params)
    assert chatted.prompt_token_ids == generated.prompt_token_ids == expected


def chat_prompt_tokens(http: TestClient) -> int:
    resp = http.post("/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "user", "content": "hello"}]})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens"]


def expected_text_tokens(plain: InputProcessor) -> tuple[int, int]:
    """Prompt tokens of the text-only chat ``chat_prompt_tokens`` sends: with ``TEMPLATE``,
    and with the checkpoint's own template."""
    ours = plain.process({"prompt": "<<user>> hello\n<<answer>>"})
    own = plain.process({"messages": [{"role": "user", "content": "hello"}]})
    return len(ours.token_ids), len(own.token_ids)


def test_the_server_renders_with_it(clip_llama: str) -> None:
    plain = processor(clip_llama)
    ours, own = expected_text_tokens(plain)
    assert ours != own
    with LLM(clip_llama, dtype="float32", max_model_len=256,
             chat_template=template_for(plain)) as llm:
        server = api_server.OpenAIServer(llm.engine, ServerConfig("tiny"))
        with TestClient(server.app()) as http:
            assert chat_prompt_tokens(http) == ours


def test_the_server_with_an_engine_process_renders_with_it(clip_llama: str,
                                                            tmp_path) -> None:
    """The front end makes the requests with its own processor; the core gets the config."""
    from mmserve.engine.core_process import EngineCoreClient

    plain = processor(clip_llama)
    ours, _ = expected_text_tokens(plain)
    config = EngineConfig(model=clip_llama, dtype="float32", max_model_len=256,
                          chat_template=setting("file", template_for(plain), tmp_path))
    server = api_server.OpenAIServer(EngineCoreClient(config), ServerConfig("tiny"))
    try:
        with TestClient(server.app()) as http:
            assert chat_prompt_tokens(http) == ours
    finally:
        server.engine.close()


# ------------------------------------------------------------------ the setting's rules
def test_a_file_is_read_whatever_its_name(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "template").write_text("{{ messages }}", encoding="utf-8")
    assert load_chat_template("template") == "{{ messages }}"
    assert load_chat_template(str(tmp_path / "template")) == "{{ messages }}"
    assert load_chat_template(None) is None


@pytest.mark.parametrize("value", ["missing.jinja", "missing.j2", "Missing.TXT", "dir/missing",
                                   "./missing", "mytemplate", "tool_template.jinja2",
                                   "Answer:"])
def test_a_value_that_looks_like_a_path_must_be_a_file(value: str, tmp_path,
                                                       monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="--chat-template") as e:
        load_chat_template(value)
    assert repr(value) in str(e.value) and "no template file" in str(e.value)


@pytest.mark.parametrize("value", ["{{ messages[0]['content'] }}/x.jinja", "Answer: }",
                                   "line one\nline two.txt"])
def test_any_other_value_is_the_template(value: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_chat_template(value) == value


@pytest.mark.parametrize("make, fragment", [
    (lambda d: d, "cannot read the template file"),  # a directory
    (lambda d: _write(d / "bad.jinja", "{% for m in messages %}"), "does not parse"),
    (lambda d: _write(d / "bad.jinja", "{{ m | no_such_filter }}"), "No filter named"),
    (lambda d: _write(d / "empty.jinja", "\n"), "is empty"),
    (lambda d: _write_bytes(d / "latin.jinja", b"\xff{{ x }}"), "cannot read"),
])
def test_a_bad_file_names_the_setting_and_the_file(make, fragment: str, tmp_path) -> None:
    path = str(make(tmp_path))
    with pytest.raises(ValueError, match="--chat-template") as e:
        load_chat_template(path)
    assert fragment in str(e.value) and path in str(e.value)


def test_a_template_that_does_not_parse_says_where() -> None:
    with pytest.raises(ValueError, match=r"--chat-template.*given as text does not parse as a "
                       r"Jinja template \(line 2\)"):
        load_chat_template("{% for m in messages %}\n{{ m }\n{% endfor %}")


def test_transformers_own_tags_parse() -> None:
    text = "{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
    assert load_chat_template(text) == text


def test_the_config_keeps_the_value_as_given(tmp_path) -> None:
    path = tmp_path / "chat.jinja"
    assert EngineConfig(model="m", chat_template=path).chat_template == str(path)
    assert EngineConfig(model="m", chat_template="x.jinja").chat_template == "x.jinja"
    with pytest.raises(ValueError, match="chat_template must be"):
        EngineConfig(model="m", chat_template=3)


# ------------------------------------------------------------- refused at start-up
BAD = {"missing": "missing.jinja", "unparsable": "{{ messages }"}


@pytest.mark.parametrize("bad", BAD)
def test_llm_refuses_a_bad_template_before_the_engine_starts(bad: str, clip_llama: str,
                                                             tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)

    def no_engine(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the engine was started")

    monkeypatch.setattr("mmserve.entrypoints.llm.LLMEngine", no_engine)
    with pytest.raises(ValueError, match="--chat-template"):
        LLM(clip_llama, chat_template=BAD[bad])


@pytest.mark.parametrize("bad", BAD)
def test_the_processor_refuses_a_bad_template(bad: str, clip_llama: str, tmp_path,
                                              monkeypatch) -> None:
    """What the engine and a server's front end build (``processor_and_grammars``)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="--chat-template"):
        processor(clip_llama, BAD[bad])


@pytest.mark.parametrize("bad", BAD)
def test_serve_refuses_a_bad_template_before_the_engine_starts(bad: str, clip_llama: str,
                                                               tmp_path, monkeypatch,
                                                               capsys) -> None:
    monkeypatch.chdir(tmp_path)

    def no_engine(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the engine was started")

    monkeypatch.setattr(serve_command, "LLMEngine", no_engine)
    monkeypatch.setattr("mmserve.engine.core_process.EngineCoreClient", no_engine)
    args: argparse.Namespace = build_parser().parse_args(
        ["serve", clip_llama, "--device", "cpu", "--chat-template", BAD[bad]])
    assert serve_command.serve(args) == 2
    err = capsys.readouterr().err
    assert "mmserve serve: chat_template (--chat-template)" in err
    if bad == "missing":
        assert os.path.join(str(tmp_path), "missing.jinja") in err


def _write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


def _write_bytes(path, data: bytes):
    path.write_bytes(data)
    return path
