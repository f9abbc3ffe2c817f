"""LoRA adapters for the tiny checkpoints, built offline in PEFT's format, and the oracle's side
of them: the checkpoint with an adapter merged into its weights (``W + scaling * B A``), which
transformers loads as a plain model.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil
from collections.abc import Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A decoder projection's weight in a checkpoint, whatever its layout's prefix.
_WEIGHT = re.compile(r"^(?P<module>(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
                     r"(?P<target>[a-z_]+))\.weight$")

__all__ = ["ALL_TARGETS", "build_lora_adapter", "merge_lora"]


def _projection_weights(checkpoint: pathlib.Path) -> dict[str, tuple[str, list[int]]]:
    """The language model's projection weights: module name -> (target, shape)."""
    found = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                m = _WEIGHT.match(key)
                if m and not re.search(r"vision|visual|projector", m["prefix"]):
                    found[m["module"]] = (m["target"], list(f.get_slice(key).get_shape()))
    return found


def build_lora_adapter(
    checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], *, rank: int = 4,
    alpha: float = 8.0, targets: Sequence[str] = ALL_TARGETS, seed: int = 0,
    std: float = 0.2, use_rslora: bool = False, rank_pattern: dict[str, int] | None = None,
) -> pathlib.Path:
    """A random LoRA adapter of ``checkpoint``'s language model in PEFT's format: ``lora_A``
    and ``lora_B`` (both random, so that it changes the output) for ``targets`` of every
    layer, keys as PEFT saves them (``base_model.model.<module>.lora_A.weight``),
    ``rank_pattern`` giving some targets a rank of their own."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (target, (out_f, in_f)) in sorted(_projection_weights(
            pathlib.Path(checkpoint)).items()):
        if target not in targets:
            continue
        r = (rank_pattern or {}).get(target, rank)
        tensors[f"base_model.model.{module}.lora_A.weight"] = (
            torch.randn(r, in_f, generator=gen) * std)
        tensors[f"base_model.model.{module}.lora_B.weight"] = (
            torch.randn(out_f, r, generator=gen) * std)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora,
              "target_modules": sorted(set(targets)), "bias": "none", "lora_dropout": 0.0,
              "fan_in_fan_out": False, "modules_to_save": None,
              "rank_pattern": dict(rank_pattern or {}), "alpha_pattern": {},
              "task_type": "CAUSAL_LM"}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out


def merge_lora(checkpoint: str | os.PathLike[str], adapter: str | os.PathLike[str],
               out: str | os.PathLike[str]) -> pathlib.Path:
    """A copy of ``checkpoint`` whose weights have ``adapter`` merged in, as PEFT's
    ``merge_and_unload`` computes it (float32): what the adapted model is, for transformers.
    A ``ValueError`` for adapter tensors that change no weight of the checkpoint (else the
    oracle would be the model's own weights there)."""
    checkpoint, adapter, out = (pathlib.Path(p) for p in (checkpoint, adapter, out))
    shutil.copytree(checkpoint, out, dirs_exist_ok=True)
    config = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        lora = {key: f.get_tensor(key) for key in f.keys()}
    merged_keys: set[str] = set()
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            weights = {key: f.get_tensor(key) for key in f.keys()}
            metadata = f.metadata()
        for key, weight in weights.items():
            module = key.removesuffix(".weight")
            a = lora.get(f"base_model.model.{module}.lora_A.weight")
            if a is None:
                continue
            b = lora[f"base_model.model.{module}.lora_B.weight"]
            merged_keys |= {f"base_model.model.{module}.lora_{ab}.weight" for ab in "AB"}
            r = config.get("rank_pattern", {}).get(key.split(".")[-2], config["r"])
            assert a.shape[0] == r, f"{module}: lora_A has rank {a.shape[0]}, the config {r}"
            alpha = config.get("lora_alpha", 8)
            scaling = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
            merged = weight.to(torch.float32) + scaling * (b.to(torch.float32)
                                                           @ a.to(torch.float32))
            weights[key] = merged.to(weight.dtype)
        save_file(weights, str(file), metadata=metadata)
    if set(lora) - merged_keys:
        raise ValueError(f"{adapter}: {sorted(set(lora) - merged_keys)[:3]} change no weight "
                         f"of {checkpoint}")
    return out
