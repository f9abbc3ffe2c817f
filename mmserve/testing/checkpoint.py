"""What every family's tiny checkpoint shares: seeded random weights and the directory it writes.

`random_model` builds a transformers model from its config and re-initialises it with a fixed,
seeded scheme (unit-variance embeddings, ``1/sqrt(fan_in)`` projections with sharpened attention
and a stronger multimodal projector, non-trivial norm weights and biases), so that greedy
generation is varied, images visibly change the output, and a serving engine that forgets to
load a norm weight or a bias produces different tokens than the reference. The ``lm_head`` rows of
the tokens a family names are zero, so greedy decoding never emits them.

`save_checkpoint` writes the Hugging Face directory (config, safetensors weights, greedy generation
config, image processor, tokenizer, processor config and chat template) that transformers' own
classes load without network access.
"""

from __future__ import annotations

import math
import os
import pathlib
from typing import Any

import torch
from torch import nn

__all__ = ["init_weights", "random_model", "save_checkpoint"]

# Standard deviations of the weight initialisation (see `init_weights`).
_EMBED_STD = 1.0
_BIAS_STD = 0.1
_NORM_WEIGHT_NOISE = 0.1
_QK_GAIN = 2.0
_PROJECTOR_GAIN = 2.0


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, never_generate: list[int], projector: str,
                 device: torch.device | str | None = None) -> None:
    """Deterministically re-initialise every parameter of ``model`` in float32.

    Embeddings get unit variance, linear/conv weights ``N(0, 1/fan_in)`` (scaled by
    `_QK_GAIN` for attention queries/keys to sharpen attention and by `_PROJECTOR_GAIN` in modules
    whose name contains ``projector``, so that images clearly influence the text), biases
    ``N(0, 0.1^2)``, norm weights ``1 + N(0, 0.1^2)`` and any other parameter (e.g. CLIP's class
    embedding) unit variance. Values are drawn from a dedicated generator in module registration
    order. Finally the ``lm_head`` rows of ``never_generate`` are zeroed so that greedy decoding
    never picks them.
    """
    generator = torch.Generator(device=device or "cpu").manual_seed(seed)

    def normal(shape: torch.Size, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32,
                           device=device) * std + mean

    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, nn.Embedding):
                value = normal(param.shape, _EMBED_STD)
            elif isinstance(module, (nn.Linear, nn.Conv2d, nn.Conv3d)) and name == "weight":
                gain = 1.0
                if module_name.endswith(("q_proj", "k_proj")):
                    gain = _QK_GAIN
                elif projector in module_name:
                    gain = _PROJECTOR_GAIN
                value = normal(param.shape, gain / math.sqrt(math.prod(param.shape[1:])))
            elif name == "bias":
                value = normal(param.shape, _BIAS_STD)
            elif name == "weight" and param.ndim == 1:
                value = normal(param.shape, _NORM_WEIGHT_NOISE, mean=1.0)
            else:
                value = normal(param.shape, _EMBED_STD)
            param.copy_(value)

    output_embeddings = model.get_output_embeddings()
    if output_embeddings is not None:
        output_embeddings.weight[never_generate] = 0.0


def random_model(
    model_class: type[nn.Module],
    config: Any,
    *,
    seed: int,
    never_generate: list[int],
    projector: str,
    device: torch.device | str | None = None,
) -> nn.Module:
    """``model_class(config)`` with the seeded weights of `init_weights`, in float32.

    The global torch generator is left as it was: construction draws from it, under a fork.
    With a ``device`` (a GPU, for checkpoints of billions of parameters: seconds instead of
    many minutes), the model is built on the meta device and its parameters are drawn on
    ``device`` by that device's generator: the same numbers as without on the CPU, others on a
    GPU. Such a model is only fit for saving: the buffers computed at construction (rotary
    frequencies) are not set.
    """
    if device is not None:
        with torch.device("meta"):
            model = model_class(config)
        model.to_empty(device=device)
        model.tie_weights()  # to_empty gave tied parameters a tensor each
        init_weights(model, seed, never_generate, projector, device)
        return model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    init_weights(model, seed, never_generate, projector)
    return model


def save_checkpoint(
    path: str | os.PathLike[str],
    model: Any,
    processor: Any,
    *,
    dtype: torch.dtype,
) -> pathlib.Path:
    """Write ``model`` (cast to ``dtype``) and ``processor`` to the directory ``path``.

    The generation config is greedy, with the tokenizer's bos/eos/pad ids. The image processor is
    also written on its own (``preprocessor_config.json``) for readers that do not parse the
    image processor section of ``processor_config.json``. Returns the directory.
    """
    from transformers import GenerationConfig

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = processor.tokenizer
    model.to(dtype)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(out)
    processor.image_processor.save_pretrained(out)
    processor.save_pretrained(out)
    return out
