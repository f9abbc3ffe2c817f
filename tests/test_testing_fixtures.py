"""The tiny-checkpoint fixtures: one entry point over the family builders, the shared tokenizer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmserve.testing import FAMILIES, build_tiny_checkpoint
from mmserve.testing.__main__ import main as build_main
from mmserve.testing.llava import build_tiny_llava
from mmserve.testing.tokenizer import SpecialTokens, build_tokenizer

OPTIONS = {"vision": "siglip", "text": "qwen2", "image_size": 48, "patch_size": 16, "seed": 3}


def _contents(path: Path) -> tuple[dict, str, dict[str, torch.Tensor]]:
    """config.json, tokenizer.json and the weights of a checkpoint directory."""
    config = json.loads((path / "config.json").read_text())
    return config, (path / "tokenizer.json").read_text(), load_file(path / "model.safetensors")


def _same(a: Path, b: Path) -> bool:
    config_a, tokenizer_a, tensors_a = _contents(a)
    config_b, tokenizer_b, tensors_b = _contents(b)
    return (config_a == config_b and tokenizer_a == tokenizer_b
            and tensors_a.keys() == tensors_b.keys()
            and all(torch.equal(tensors_a[name], tensors_b[name]) for name in tensors_a))


def test_entry_point_and_command_build_what_the_family_builder_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    direct = build_tiny_llava(tmp_path / "direct", **OPTIONS)
    assert _same(build_tiny_checkpoint("llava", tmp_path / "entry", **OPTIONS), direct)
    options = [f"{key}={value}" for key, value in OPTIONS.items()]
    argv = ["mmserve.testing", "llava", str(tmp_path / "cli"), *options]
    monkeypatch.setattr(sys, "argv", argv)
    build_main()
    assert _same(tmp_path / "cli", direct)
    # The comparison sees the weights: another seed is another checkpoint.
    other = build_tiny_checkpoint("llava", tmp_path / "other", **{**OPTIONS, "seed": 4})
    assert not _same(other, direct)


@pytest.mark.parametrize("family, options", [("llava", {}), ("qwen2_vl", {}),
                                             ("qwen2_5_vl", {"tie_word_embeddings": True})])
def test_weights_drawn_on_a_device_are_the_cpu_builds(tmp_path: Path, family: str,
                                                      options: dict) -> None:
    """``device=``: the model is built on the meta device and every weight drawn on the
    device (how the large bench checkpoints are made on a GPU). On the CPU that gives the same
    checkpoint as transformers' own construction: no weight is left as allocated, and tied
    embeddings stay one tensor."""
    classic = build_tiny_checkpoint(family, tmp_path / "classic", seed=5, **options)
    assert _same(build_tiny_checkpoint(family, tmp_path / "meta", seed=5, device="cpu",
                                       **options), classic)


def test_published_layout_renames_sharded_weights(tmp_path: Path) -> None:
    """Weights saved in shards (what transformers writes for billions of parameters): each
    shard and the index take the published names."""
    from safetensors.torch import save_file

    from mmserve.testing.llava import _to_published_layout, published_weight_name

    names = {
        "model-00001-of-00002.safetensors": ["model.vision_tower.vision_model.pre_layrnorm.weight",
                                             "model.multi_modal_projector.linear_1.weight"],
        "model-00002-of-00002.safetensors": ["model.language_model.norm.weight", "lm_head.weight"],
    }
    for shard, keys in names.items():
        save_file({k: torch.full((2,), float(i)) for i, k in enumerate(keys)}, tmp_path / shard)
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in names.items()
                                            for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    _to_published_layout(tmp_path)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    for shard, keys in names.items():
        published = [published_weight_name(k) for k in keys]
        assert sorted(load_file(tmp_path / shard)) == sorted(published)
        assert all(weight_map[k] == shard for k in published)
    assert "vision_tower.vision_model.pre_layrnorm.weight" in weight_map
    assert "multi_modal_projector.linear_1.weight" in weight_map
    # Two shards whose names meet in one published name: refused, not one written over.
    clash = tmp_path / "clash"
    clash.mkdir()
    save_file({"model.multi_modal_projector.linear_1.bias": torch.zeros(2)},
              clash / "model-00001-of-00002.safetensors")
    save_file({"multi_modal_projector.linear_1.bias": torch.ones(2)},
              clash / "model-00002-of-00002.safetensors")
    with pytest.raises(RuntimeError, match="one published name"):
        _to_published_layout(clash)


def test_unknown_family_and_option_are_errors(tmp_path: Path) -> None:
    assert "llava" in FAMILIES
    with pytest.raises(ValueError, match="unknown checkpoint family 'nope'; families: llava, "
                       "qwen2_5_vl, qwen2_vl"):
        build_tiny_checkpoint("nope", tmp_path)
    with pytest.raises(TypeError, match="num_layers"):
        build_tiny_checkpoint("llava", tmp_path, num_layers=2)


def test_tokenizer_with_another_family_special_tokens() -> None:
    """A family without a bos token (as Qwen2's tokenizer): nothing is prepended."""
    specials = SpecialTokens(("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                             eos="<|im_end|>", pad="<|endoftext|>")
    tokenizer = build_tokenizer(400, 128, specials)
    assert len(tokenizer) == 400
    assert [tokenizer.convert_tokens_to_ids(t) for t in specials.tokens] == [0, 1, 2]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 0)
    ids = tokenizer("<|im_start|>user a cat")["input_ids"]
    assert ids[0] == 1 and tokenizer.decode(ids) == "<|im_start|>user a cat"
    with pytest.raises(ValueError, match="the eos token '</s>' is not one of"):
        SpecialTokens(("<s>",), eos="</s>", pad="<s>")
