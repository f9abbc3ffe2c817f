"""Checkpoint loading: names mapped, missing/unexpected weights and unknown architectures named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from mmserve import LLM
from mmserve.models.loader import load_model


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_weights(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_weight_is_named(clip_llama: str, tmp_path: Path) -> None:
    path = _copy(clip_llama, tmp_path / "ckpt")
    _edit_weights(path, lambda t: t.pop("language_model.model.norm.weight"))
    with pytest.raises(ValueError, match=r"missing .*model\.language_model\.norm\.weight"):
        load_model(path, AutoConfig.from_pretrained(path), torch.float32)


def test_unexpected_weight_is_named(clip_llama: str, tmp_path: Path) -> None:
    path = _copy(clip_llama, tmp_path / "ckpt")
    _edit_weights(path, lambda t: t.__setitem__("language_model.model.extra.weight",
                                                torch.zeros(2)))
    with pytest.raises(ValueError, match=r"unexpected .*language_model\.model\.extra\.weight"):
        load_model(path, AutoConfig.from_pretrained(path), torch.float32)


def test_merged_layers_fill_their_rows_from_each_checkpoint_weight(clip_llama: str,
                                                                   tmp_path: Path) -> None:
    """q, k and v (gate and up) run as one merged layer; each checkpoint weight fills its own
    rows, and one left out or of another shape is named as the checkpoint names it."""
    path = Path(clip_llama)
    tensors = load_file(str(path / "model.safetensors"))
    model = load_model(path, AutoConfig.from_pretrained(path), torch.float32)
    layer = model.model.language_model.layers[1]
    qkv = [tensors[f"language_model.model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"]
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(qkv))
    gate_up = [tensors[f"language_model.model.layers.1.mlp.{n}_proj.weight"]
               for n in ("gate", "up")]
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat(gate_up))

    broken = _copy(clip_llama, tmp_path / "without-v")
    _edit_weights(broken,
                  lambda t: t.pop("language_model.model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(ValueError, match=r"missing .*layers\.1\.self_attn\.v_proj\.weight"):
        load_model(broken, AutoConfig.from_pretrained(broken), torch.float32)
    wrong = _copy(clip_llama, tmp_path / "short-k")
    key = "language_model.model.layers.1.self_attn.k_proj.weight"
    _edit_weights(wrong, lambda t: t.__setitem__(key, t[key][:-1].clone()))
    with pytest.raises(ValueError, match=rf"weight {key} has shape"):
        load_model(wrong, AutoConfig.from_pretrained(wrong), torch.float32)


def test_unsupported_architecture_lists_supported(clip_llama: str, tmp_path: Path) -> None:
    path = _copy(clip_llama, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FancyVLMForEverything"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration"):
        load_model(path, AutoConfig.from_pretrained(path), torch.float32)


def test_legacy_and_new_weight_names_load_identically(clip_llama: str, tmp_path: Path) -> None:
    """transformers 4.x names (``vision_tower.vision_model.*``) and 5.x in-memory names
    (``model.language_model.*``) map onto the same parameters."""
    path = _copy(clip_llama, tmp_path / "ckpt")

    def rename(t: dict) -> None:
        for k in list(t):
            if k.startswith("vision_tower."):
                t["vision_tower.vision_model." + k[len("vision_tower."):]] = t.pop(k)
            elif k.startswith("language_model.model."):
                t["model.language_model." + k[len("language_model.model."):]] = t.pop(k)

    _edit_weights(path, rename)
    cfg = AutoConfig.from_pretrained(path)
    a = load_model(clip_llama, cfg, torch.float32).state_dict()
    b = load_model(path, cfg, torch.float32).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_model_directory_is_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        LLM(str(tmp_path / "does-not-exist"))
