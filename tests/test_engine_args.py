"""Engine flags are declared once, on ``EngineConfig``'s fields, and every subcommand takes
the same ones: one flag per field, parsed defaults equal to the dataclass's."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from mmserve.config import EngineConfig
from mmserve.entrypoints.cli import build_parser, main
from mmserve.entrypoints.engine_args import engine_argv, engine_kwargs

# Fields that are not flags: the model (each front door takes it its own way, always also as
# --model) and what the config derives (max_image_size, from --limit-mm-per-prompt).
NOT_FLAGS = {"model", "max_image_size"}
FLAG_FIELDS = [f for f in dataclasses.fields(EngineConfig) if f.name not in NOT_FLAGS]

# Each subcommand that takes the engine flags, and the arguments it requires.
SUBCOMMANDS = {
    "serve": [],
    "plan": [],
    "caption": ["image.png"],
    "bench throughput": [],
    "bench sweep": ["--param", "block_size=16"],
    "bench serve": [],
}


def argv_of(command: str, *flags: str) -> list[str]:
    return [*command.split(), *SUBCOMMANDS[command], *flags]


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in command.split():
        # argparse has no public accessor for a parser's subcommands.
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


# Switches whose default the engine decides (on for GPUs, off on the CPU): both spellings.
AUTO_SWITCHES = {"async_scheduling", "normalize_embeddings"}


def spelling(f: dataclasses.Field) -> list[str]:
    """The flags users know: vLLM's names, ``--no-NAME`` for a switch that is on by default
    (``--no-enable-prefix-caching``), both for a switch decided by the engine."""
    name = f.name.replace("_", "-")
    if f.name in AUTO_SWITCHES:
        return [f"--{name}", f"--no-{name}"]
    return [f"--no-{name}" if f.default is True else f"--{name}"]


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_field_is_exactly_one_flag(command: str) -> None:
    actions = subparser(command)._actions
    for f in FLAG_FIELDS:
        options = [o for a in actions if a.dest == f.name for o in a.option_strings]
        assert options == spelling(f), f"{command}: EngineConfig.{f.name} -> {options}"
    model = [o for a in actions if a.dest == "model" for o in a.option_strings]
    assert model == ["--model"]
    for name in NOT_FLAGS - {"model"}:
        assert not [a for a in actions if a.dest == name], f"{command}: {name} is derived"


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_parsed_defaults_are_the_dataclass_defaults(command: str) -> None:
    args = build_parser().parse_args(argv_of(command))
    assert engine_kwargs(args) == {f.name: f.default for f in FLAG_FIELDS}
    assert EngineConfig(model="m", **engine_kwargs(args)) == EngineConfig(model="m")


@pytest.mark.parametrize("argv, expected", [
    (["--max-model-len", "auto"], {"max_model_len": None}),
    (["--max-model-len", "512", "--max-num-seqs", "auto"], {"max_model_len": 512}),
    (["--max-num-seqs", "3"], {"max_num_seqs": 3}),
    (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
    (["--limit-mm-per-prompt", '{"image": 2}'], {"limit_mm_per_prompt": 2}),
    (["--limit-mm-per-prompt", '{"image": {"count": 1, "width": 640, "height": 480}}'],
     {"limit_mm_per_prompt": 1, "max_image_size": (640, 480)}),
    (["--limit-mm-per-prompt", "0"], {"limit_mm_per_prompt": 0}),
    (["--dtype", "bfloat16"], {"dtype": "bfloat16"}),
    (["--device", "cpu", "--enforce-eager", "--single-user-mode"],
     {"device": "cpu", "enforce_eager": True, "single_user_mode": True}),
    (["--gpu-memory-utilization", "0.5", "--kv-cache-memory", "1000000"],
     {"gpu_memory_utilization": 0.5, "kv_cache_memory": 1_000_000}),
    (["--scheduler-delay-factor", "0.5"], {"scheduler_delay_factor": 0.5}),
    (["--async-scheduling"], {"async_scheduling": True}),
    (["--no-async-scheduling"], {"async_scheduling": False}),
    (["--chat-template", "chat.jinja"], {"chat_template": "chat.jinja"}),
    (["--pooling-type", "cls", "--no-normalize-embeddings"],
     {"pooling_type": "cls", "normalize_embeddings": False}),
    (["--pooler-config", '{"pooling_type": "MEAN", "normalize": true}'],
     {"pooling_type": "mean", "normalize_embeddings": True}),
    (["--pooler-config", '{"normalize": false}', "--pooling-type", "last"],
     {"pooling_type": "last", "normalize_embeddings": False}),
    (["--chat-template", "{% for m in messages %}\n{{ m['role'] }}{% endfor %}"],
     {"chat_template": "{% for m in messages %}\n{{ m['role'] }}{% endfor %}"}),
])
def test_flags_round_trip_into_the_config(argv: list[str], expected: dict) -> None:
    args = build_parser().parse_args(["serve", *argv])
    config = EngineConfig(model="m", **engine_kwargs(args))
    assert config == dataclasses.replace(EngineConfig(model="m"), **expected)
    if "dtype" in expected:
        assert config.torch_dtype == torch.bfloat16
    # What `bench serve` passes on to the server it starts reads back the same.
    again = build_parser().parse_args(["serve", *engine_argv(args)])
    assert engine_kwargs(again) == engine_kwargs(args)


@pytest.mark.parametrize("argv, message", [
    (["--max-model-len", "long"], "expected an integer or 'auto', got 'long'"),
    (["--limit-mm-per-prompt", '{"video": 1}'], "video is not supported"),
    (["--dtype", "int8"], "invalid choice: 'int8'"),
    (["--block-size", "x"], "invalid int value: 'x'"),
    (["--pooler-config", '{"softmax": true}'], "does not take 'softmax'"),
    (["--pooler-config", "MEAN"], "not valid JSON"),
])
def test_bad_values_are_usage_errors(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("value", [-0.5, float("inf"), float("nan")])
def test_a_scheduler_delay_factor_must_be_a_finite_number_not_below_zero(value: float) -> None:
    with pytest.raises(ValueError, match="scheduler_delay_factor must be a finite number >= 0"):
        EngineConfig(model="m", scheduler_delay_factor=value)


@pytest.mark.parametrize("device, setting, expected", [
    ("cpu", None, False), ("cuda", None, True), ("cuda", False, False), ("cpu", True, True)])
def test_async_scheduling_is_on_by_default_for_gpus(device: str, setting: bool | None,
                                                    expected: bool, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda")
    config = EngineConfig(model="m", device="auto", async_scheduling=setting)
    assert config.resolved_device == device and config.schedules_ahead is expected


@pytest.mark.parametrize("device, setting, expected", [
    ("cpu", None, 2048), ("cuda", None, 8192), ("cuda", "auto", 8192), ("cuda", 512, 512),
    ("cpu", 4096, 4096)])
def test_the_step_token_budget_is_larger_on_gpus(device: str, setting, expected: int,
                                                 monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda")
    config = EngineConfig(model="m", device="auto", max_num_batched_tokens=setting)
    assert config.max_num_batched_tokens == expected
    assert dataclasses.replace(config).max_num_batched_tokens == expected
    if setting is not None:  # the flag takes the same values
        args = build_parser().parse_args(["serve", "--max-num-batched-tokens", str(setting)])
        assert engine_kwargs(args).get("max_num_batched_tokens") == (
            None if setting == "auto" else setting)


def test_async_scheduling_takes_only_a_switch_or_auto() -> None:
    with pytest.raises(ValueError, match="async_scheduling must be True, False or None"):
        EngineConfig(model="m", async_scheduling="auto")


def test_pooler_config_and_a_flag_of_its_own_must_agree() -> None:
    args = build_parser().parse_args(["serve", "--pooling-type", "cls", "--pooler-config",
                                      '{"pooling_type": "MEAN"}'])
    with pytest.raises(ValueError, match="--pooler-config and --pooling-type disagree"):
        engine_kwargs(args)
    # On the command line, a usage error (exit 2) rather than a traceback, in every command.
    with pytest.raises(SystemExit) as e:
        main(["plan", "m", "--pooling-type", "cls", "--pooler-config",
              '{"pooling_type": "MEAN"}'])
    assert e.value.code == 2
