"""Build a model from a local checkpoint directory, streaming weights from safetensors."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

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
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected = []
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    name = key
                    for pattern, repl in getattr(model, "checkpoint_renames", ()):
                        name = re.sub(pattern, repl, name)
                    if name not in params:
                        if not model.skipped_checkpoint_weight(name):
                            unexpected.append(key)
                        continue
                    tensor = f.get_tensor(key)
                    if tensor.shape != params[name].shape:
                        raise ValueError(
                            f"weight {key} has shape {tuple(tensor.shape)}, the model expects "
                            f"{tuple(params[name].shape)}")
                    params[name].copy_(tensor)
                    loaded.add(name)
    if unexpected:
        raise ValueError(f"unexpected weights in {model_dir}: {_names(unexpected)}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {_names(missing)}")
    # Buffers (rotary tables) were created on the meta device: compute them for real.
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model.eval()


def _names(names: list[str], limit: int = 10) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
