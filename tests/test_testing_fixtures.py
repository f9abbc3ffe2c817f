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
