"""LLaVA checkpoints in the published (Hub) layout, which vLLM requires: the weight names, a tiny
checkpoint in that layout giving transformers' greedy tokens in mmserve, and the llava bench
checkpoint written in it (and rebuilt when a cached one has the old layout)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from mmserve import LLM, SamplingParams
from mmserve.bench import checkpoint as bench_checkpoint
from mmserve.testing import build_tiny_checkpoint
from mmserve.testing.llava import published_weight_name
from tests.test_parity import MAX_TOKENS, mixed_batch, reference, shared_batch


def _weight_names(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_published_weight_names() -> None:
    """Every name transformers uses for a LLaVA weight maps onto llava-hf's name for it."""
    cases = {
        # transformers 5.x save_pretrained: the vision tower lacks its vision_model level
        "vision_tower.embeddings.patch_embedding.weight":
            "vision_tower.vision_model.embeddings.patch_embedding.weight",
        "vision_tower.pre_layrnorm.bias": "vision_tower.vision_model.pre_layrnorm.bias",
        # transformers 5.x in-memory names
        "model.vision_tower.encoder.layers.0.mlp.fc1.weight":
            "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
        "model.language_model.layers.3.self_attn.q_proj.weight":
            "language_model.model.layers.3.self_attn.q_proj.weight",
        "model.multi_modal_projector.linear_1.bias": "multi_modal_projector.linear_1.bias",
        "lm_head.weight": "language_model.lm_head.weight",
    }
    published = set(cases.values()) | {"language_model.model.norm.weight"}
    for name, expected in cases.items():
        assert published_weight_name(name) == expected
    # Published names stay as they are.
    assert {published_weight_name(n) for n in published} == published


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_checkpoint("llava", tmp_path_factory.mktemp("published") / "ckpt",
                                     layout="published"))


def test_tiny_published_checkpoint_has_the_hub_names(published: str) -> None:
    names = _weight_names(Path(published))
    prefixes = {n.split(".")[0] + "." + n.split(".")[1] for n in names}
    assert prefixes == {"vision_tower.vision_model", "multi_modal_projector.linear_1",
                        "multi_modal_projector.linear_2", "language_model.model",
                        "language_model.lm_head"}
    with pytest.raises(ValueError, match="layout must be one of"):
        build_tiny_checkpoint("llava", Path(published).parent / "x", layout="hub")


@pytest.mark.parametrize("batch", [mixed_batch, shared_batch])
def test_published_layout_parity(published: str, batch) -> None:
    """mmserve on the published layout gives transformers' greedy tokens (transformers loads
    the same directory)."""
    prompts = batch()
    llm = LLM(published, dtype="float32", max_model_len=512)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.token_ids for o in outs] == reference(published, prompts)


# ----------------------------------------------------------------- the llava bench checkpoint
SMALL_LLAVA_SHAPES = {"image_size": 32, "patch_size": 16, "vision_hidden": 32,
                      "vision_layers": 2, "vision_heads": 2, "text_hidden": 32, "text_layers": 1,
                      "text_heads": 2, "text_kv_heads": 1, "intermediate_size": 64,
                      "vocab_size": 600, "max_position_embeddings": 512}


@pytest.fixture
def small_llava_bench(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The registry's llava entry at `SMALL_LLAVA_SHAPES`, cached under ``tmp_path``."""
    entry = bench_checkpoint.BENCH_CHECKPOINTS["llava"]
    monkeypatch.setitem(bench_checkpoint.BENCH_CHECKPOINTS, "llava", dataclasses.replace(
        entry, shapes={**entry.shapes, **SMALL_LLAVA_SHAPES}))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "mmserve" / "bench-llava"


def test_llava_bench_checkpoint_is_published_and_an_old_one_is_rebuilt(
        small_llava_bench: Path) -> None:
    path = bench_checkpoint.ensure_bench_checkpoint(name="llava")
    assert path == small_llava_bench
    names = _weight_names(path)
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in names
    assert not any(n.startswith("vision_tower.embeddings.") for n in names)
    marker = json.loads((path / bench_checkpoint._MARKER).read_text())
    assert marker["layout"] == "published" and marker["format"] == 2
    assert marker["weights_drawn_on"] == "cpu"  # recorded; a GPU's draws are other numbers
    # No staging or set-aside directories are left beside it.
    assert [p.name for p in path.parent.iterdir()] == ["bench-llava"]
    # A cached checkpoint of an older format (its marker lacks the format) is built again.
    weights = path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    old = {k: v for k, v in marker.items() if k not in ("format", "layout", "weights_drawn_on")}
    (path / bench_checkpoint._MARKER).write_text(json.dumps(old))
    assert bench_checkpoint.ensure_bench_checkpoint(name="llava") == path
    assert weights.stat().st_mtime_ns != mtime
    assert json.loads((path / bench_checkpoint._MARKER).read_text()) == marker
    # One drawn on a GPU is the same checkpoint to a machine without one: kept, not rebuilt.
    mtime = weights.stat().st_mtime_ns
    (path / bench_checkpoint._MARKER).write_text(json.dumps({**marker,
                                                             "weights_drawn_on": "cuda"}))
    assert bench_checkpoint.ensure_bench_checkpoint(name="llava") == path
    assert weights.stat().st_mtime_ns == mtime
    # mmserve runs it.
    llm = LLM(str(path), dtype="float32", max_model_len=256)
    out = llm.generate([{"prompt": "USER: <image>\nhi\nASSISTANT:",
                         "images": [mixed_batch()[1]["images"][0]]}],
                       SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_bench_checkpoint_build_leaves_other_directories_alone(tmp_path: Path) -> None:
    """A path holding files that are not a bench checkpoint's is not replaced."""
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="notes.txt"):
        bench_checkpoint.build_bench_checkpoint(other, "llava", **SMALL_LLAVA_SHAPES)
    assert (other / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
