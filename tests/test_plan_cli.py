"""`mmserve plan` prints the plan a launch would make, and the engine's own plan agrees."""

from __future__ import annotations

import json
import logging

import pytest

from mmserve import LLM
from mmserve.entrypoints.cli import main
from mmserve.worker import memory_profiler

MEMORY = 40 * 2**20  # a 40 MiB machine: the budget, not the model's limit, sizes the cache
# The one term the two plans may differ in: `mmserve plan` marks the RAM it read as an estimate
# (it moves until an engine starts). With the RAM pinned, every other term is equal.
DIFFERING = {"estimated"}


@pytest.fixture
def small_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_profiler, "device_memory", lambda device: MEMORY)


def plan_json(capsys: pytest.CaptureFixture, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("settings", [
    {},
    {"max_model_len": 300, "max_num_batched_tokens": 512},
    {"kv_cache_memory": 3 * 2**20, "max_num_seqs": 6},
])
def test_plan_and_engine_agree(clip_llama, small_machine, capsys, caplog,
                               settings: dict) -> None:
    """Same checkpoint, same flags: `mmserve plan` prints the plan the engine makes and logs."""
    # A fixed thread count: the plan counts the CPU kernels' scratch of each thread, and the
    # adaptive count follows torch's, which other tests of a parallel worker may have changed.
    settings = {"cpu_threads": 2, **settings}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    printed = plan_json(capsys, clip_llama, "--dtype=float32", "--device=cpu", *flags)
    with caplog.at_level(logging.INFO, logger="mmserve.engine.llm_engine"):
        plan = LLM(clip_llama, dtype="float32", device="cpu", **settings).memory_plan()
    engine = json.loads(json.dumps(plan.to_dict()))  # tuples as JSON lists
    assert engine.keys() == printed["plan"].keys()
    differing = {k: (v, engine[k]) for k, v in printed["plan"].items()
                 if k not in DIFFERING and v != engine[k]}
    assert not differing, differing
    assert printed["plan"]["estimated"] == ["memory_bytes"] and engine["estimated"] == []
    # The summary the engine logs is its plan's, and the text `mmserve plan` prints is the same
    # lines but for the RAM marked as an estimate.
    assert plan.summary() in caplog.text
    assert main(["plan", clip_llama, "--dtype=float32", "--device=cpu", *flags]) == 0
    lines = plan.summary().splitlines()
    text = capsys.readouterr().out.splitlines()[:len(lines)]
    assert text == [lines[0] + " (estimate)", *lines[1:]]
    assert printed["feasible"][0]["max_model_len"] <= printed["plan"]["model_max_len"]
    assert printed["checkpoint"]["checkpoint_bytes"] > 0


def test_plan_text_output_and_auto_flags(clip_llama, small_machine, capsys) -> None:
    assert main(["plan", "--model", clip_llama, "--dtype", "float32", "--device", "cpu",
                 "--max-model-len", "auto", "--max-num-seqs", "4"]) == 0
    out = capsys.readouterr().out
    for text in ("memory plan on cpu", "peak activations", "encoder cache", "KV cache",
                 "max_num_seqs=4 (given)", "max_model_len=", "(estimate)", "feasible pairs",
                 "no weight was loaded"):
        assert text in out, out


def test_plan_reports_infeasible_settings(clip_llama, small_machine, capsys) -> None:
    assert main(["plan", clip_llama, "--dtype", "float32", "--device", "cpu",
                 "--max-model-len", "2048", "--max-num-seqs", "2",
                 "--gpu-memory-utilization", "0.14"]) == 1
    err = capsys.readouterr().err
    assert "max_model_len=2048 does not fit" in err and "bytes per token" in err
    with pytest.raises(SystemExit):
        main(["plan", clip_llama, "--max-num-seqs", "many"])
    assert "expected an integer or 'auto'" in capsys.readouterr().err


def test_plan_of_a_directory_that_is_not_there(tmp_path, capsys) -> None:
    """A missing directory is named as one (transformers would take the path for a name on
    the Hub and say it cannot reach it)."""
    missing = str(tmp_path / "no-such-model")
    assert main(["plan", missing, "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert f"model directory not found: {missing!r}" in err and "huggingface" not in err.lower()


def test_plan_for_a_gpu_from_a_cpu_machine(clip_llama, capsys) -> None:
    out = plan_json(capsys, clip_llama, "--device=cuda", f"--device-memory={2**30}")
    assert out["plan"]["device"] == "cuda"
    assert out["plan"]["memory_bytes"] == 2**30
    assert out["plan"]["kv_cache_limited_by"] == "memory"
    assert sorted(out["plan"]["estimated"]) == ["activation_bytes", "weights_bytes"]
