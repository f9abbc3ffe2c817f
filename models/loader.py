"""Build a model from a local checkpoint directory, streaming weights from safetensors."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from mmserve.models import parallel
from mmserve.models.layers import MergedLinear
from mmserve.models.parallel import Window
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


def load_weights(model: nn.Module, weights: Iterable[tuple[str, Any]],
                 source: str = "the checkpoint") -> None:
    """Copy ``(checkpoint name, tensor)`` pairs into ``model``'s parameters: names go through
    the model's ``checkpoint_renames``, and the layers a ``MergedLinear`` holds fill its rows.
    A tensor may be a lazy safetensors slice: a rank of a tensor-parallel model reads only
    the window of it that it holds (``parallel.Window``), never the whole tensor. A weight the
    model does not know, one of another shape, or a parameter left unfilled is an error naming
    it."""
    params = dict(model.named_parameters())
    shards = _merged_shards(model)
    windows = _windows(model)
    expected = set(params) - {param for param, _, _ in shards.values()} | set(shards)
    loaded: set[str] = set()
    unexpected = []
    with torch.no_grad():
        for key, tensor in weights:
            name = key
            for pattern, repl in getattr(model, "checkpoint_renames", ()):
                name = re.sub(pattern, repl, name)
            if name in shards:  # rows of a merged layer
                param, rows, window = shards[name]
                target = params[param][rows]
            elif name in params:
                target, window = params[name], windows.get(name)
            else:
                if not model.skipped_checkpoint_weight(name):
                    unexpected.append(key)
                continue
            _fill(key, target, tensor, window)
            loaded.add(name)
    if unexpected:
        raise ValueError(f"unexpected weights in {source}: {_names(unexpected)}")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"weights missing from {source}: {_names(missing)}")


def _fill(key: str, target: torch.Tensor, tensor, window: Window | None) -> None:
    """Copy ``tensor`` (or this rank's ``window`` of it) into ``target``; rows of ``target``
    past the window's (a vocabulary share's padding) become zeros."""
    if window is not None and window.rank0_only and parallel.tp_rank() != 0:
        target.zero_()
        return
    full = tuple(tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape())
    expected = tuple(target.shape)
    if window is not None and not window.rank0_only:
        expected = (*expected[:window.dim], window.size, *expected[window.dim + 1:])
        if full[window.dim] < window.end:
            raise ValueError(f"weight {key} has shape {full}, too small for this rank's "
                             f"share (to {window.end} along dimension {window.dim})")
        full = (*full[:window.dim], window.size, *full[window.dim + 1:])
    if full != expected:
        raise ValueError(f"weight {key} has shape {full}, the model expects {expected}")
    value = window.read(tensor) if window is not None else (
        tensor if isinstance(tensor, torch.Tensor) else tensor[:])
    if value.shape == target.shape:
        target.copy_(value)
        return
    target.narrow(window.dim, 0, window.size).copy_(value)
    target.narrow(window.dim, window.size, target.shape[window.dim] - window.size).zero_()


def _safetensors_weights(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """Every tensor of ``files`` as a lazy slice, read (whole or in part) when copied."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_slice(key)


def _windows(model: nn.Module) -> dict[str, Window]:
    """Parameter name -> the checkpoint window it holds, for layers that record one
    (``parallel.set_windows``; none with one rank)."""
    found = {}
    for path, module in model.named_modules():
        for name, window in getattr(module, "checkpoint_windows", {}).items():
            found[f"{path}.{name}" if path else name] = window
    return found


def _merged_shards(model: nn.Module) -> dict[str, tuple[str, slice, Window | None]]:
    """The checkpoint names of the layers ``MergedLinear``s hold, each with the merged
    parameter, the rows it fills and this rank's window of the checkpoint tensor (None: all
    of it): ``a.q_proj.weight -> (a.qkv_proj.weight, rows of q, window)``."""
    shards = {}
    for path, module in model.named_modules():
        if not isinstance(module, MergedLinear):
            continue
        parent = path.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        for shard, rows in module.shard_rows().items():
            window = module.shard_windows.get(shard)
            for kind, param in (("weight", module.weight), ("bias", module.bias)):
                if param is not None:
                    shards[f"{prefix}{shard}.{kind}"] = (f"{path}.{kind}", rows, window)
    return shards


def _names(names: list[str], limit: int = 10) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
