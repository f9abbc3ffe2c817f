"""Build a model from a local checkpoint directory, streaming weights from safetensors."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mmserve.models.layers import MergedLinear
from mmserve.models.registry import get_model_class


def load_model(model_dir: str | Path, hf_config, dtype: torch.dtype) -> nn.Module:
    """Instantiate the architecture and fill every parameter from ``*.safetensors``.

    A checkpoint weight the model does not know, or a model parameter the checkpoint lacks,
    is an error naming it.
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    cls = get_model_class(hf_config)
    with torch.device("meta"):
        model = cls(hf_config)
    model = model.to(dtype).to_empty(device="cpu")
    load_weights(model, _safetensors_weights(files), str(model_dir))
    # Buffers (rotary tables) were created on the meta device: compute them for real.
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model.eval()


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 source: str = "the checkpoint") -> None:
    """Copy ``(checkpoint name, tensor)`` pairs into ``model``'s parameters: names go through
    the model's ``checkpoint_renames``, and the layers a ``MergedLinear`` holds fill its rows.
    A weight the model does not know, one of another shape, or a parameter left unfilled is an
    error naming it."""
    params = dict(model.named_parameters())
    shards = _merged_shards(model)
    expected = set(params) - {param for param, _ in shards.values()} | set(shards)
    loaded: set[str] = set()
    unexpected = []
    with torch.no_grad():
        for key, tensor in weights:
            name = key
            for pattern, repl in getattr(model, "checkpoint_renames", ()):
                name = re.sub(pattern, repl, name)
            if name in shards:  # rows of a merged layer
                param, rows = shards[name]
                target = params[param][rows]
            elif name in params:
                target = params[name]
            else:
                if not model.skipped_checkpoint_weight(name):
                    unexpected.append(key)
                continue
            if tensor.shape != target.shape:
                raise ValueError(f"weight {key} has shape {tuple(tensor.shape)}, the model "
                                 f"expects {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(name)
    if unexpected:
        raise ValueError(f"unexpected weights in {source}: {_names(unexpected)}")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"weights missing from {source}: {_names(missing)}")


def _safetensors_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``files``, read one at a time."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _merged_shards(model: nn.Module) -> dict[str, tuple[str, slice]]:
    """The checkpoint names of the layers ``MergedLinear``s hold, each with the merged
    parameter and the rows it fills: ``a.q_proj.weight -> (a.qkv_proj.weight, rows of q)``."""
    shards = {}
    for path, module in model.named_modules():
        if not isinstance(module, MergedLinear):
            continue
        parent = path.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        for shard, rows in module.shard_rows().items():
            for kind, param in (("weight", module.weight), ("bias", module.bias)):
                if param is not None:
                    shards[f"{prefix}{shard}.{kind}"] = (f"{path}.{kind}", rows)
    return shards


def _names(names: list[str], limit: int = 10) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
