"""``limit_mm_per_prompt`` in vLLM's forms, through the config, the CLI and ``mmserve plan``."""

from __future__ import annotations

import json

import pytest

from mmserve.config import EngineConfig, parse_mm_limit
from mmserve.entrypoints.cli import main


@pytest.mark.parametrize("value, count, size", [
    (2, 2, None),
    ("3", 3, None),
    ({"image": 2}, 2, None),
    ('{"image": 0}', 0, None),
    ({"image": {"count": 2, "width": 1024, "height": 768}}, 2, (1024, 768)),
    ('{"image": {"count": 1}}', 1, None),
])
def test_forms(value: object, count: int, size: tuple | None) -> None:
    assert parse_mm_limit(value) == (count, size)
    config = EngineConfig(model="unused", limit_mm_per_prompt=value)
    assert config.limit_mm_per_prompt == count and config.max_image_size == size


@pytest.mark.parametrize("value, fragment", [
    ('{"video": 1}', "video is not supported"),
    ({"audio": 1}, "unknown modality"),
    ("two", "image count or JSON"),
    (-1, "integer >= 0"),
    (True, "integer >= 0"),
    ({"image": {"cnt": 1}}, '"count", "width" and "height"'),
    ({"image": {"count": 1, "width": 10}}, 'both "width" and "height"'),
    ({"image": {"count": 1, "width": 10, "height": 0}}, "positive integers"),
])
def test_bad_forms_say_what_to_send(value: object, fragment: str) -> None:
    with pytest.raises(ValueError, match="limit_mm_per_prompt") as e:
        EngineConfig(model="unused", limit_mm_per_prompt=value)
    assert fragment in str(e.value)


def test_plan_takes_the_json_form(clip_llama: str, capsys: pytest.CaptureFixture) -> None:
    limit = '{"image": {"count": 2, "width": 640, "height": 480}}'
    assert main(["plan", clip_llama, "--limit-mm-per-prompt", limit, "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)["checkpoint"]
    assert facts["limit_mm_per_prompt"] == 2 and facts["max_image_size"] == [640, 480]
    assert main(["plan", clip_llama, "--limit-mm-per-prompt", limit]) == 0
    assert "at most 2 per prompt, the largest 640x480" in capsys.readouterr().out


def test_cli_refuses_a_bad_limit_as_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", "unused", "--limit-mm-per-prompt", '{"video": 1}'])
    assert e.value.code == 2
    assert "video is not supported" in capsys.readouterr().err


def test_python_api_and_count_limit(clip_llama: str) -> None:
    from mmserve import LLM
    from mmserve.errors import InvalidInputError
    from tests.conftest import make_image

    llm = LLM(clip_llama, dtype="float32", max_model_len=96, max_num_seqs=2,
              limit_mm_per_prompt={"image": 1})
    two = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}],
           "images": [make_image(0, (20, 20)), make_image(1, (20, 20))]}
    with pytest.raises(InvalidInputError, match="limit_mm_per_prompt is 1"):
        llm.generate(two)
