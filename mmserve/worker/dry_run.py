"""Profile runs on the meta device: the same code as a real step, on shapes alone.

Every tensor a step creates has a size fixed by shapes and dtypes, so counting the storages of
a meta-device run gives what a real CPU run allocates, within a small bound for the step's
index tensors, in a fraction of a second and with no weights loaded. The engine uses it for
the CPU profile; ``mmserve plan`` uses it for every device.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.inputs import EncoderInput
from mmserve.models.registry import get_model_class
from mmserve.step import SchedulerOutput
from mmserve.worker.model_runner import EncoderPixels, ModelRunner

META = torch.device("meta")
# The step's index tensors built from Python lists (token ids, positions, slots, sample rows:
# int64, on the host and on the device) are created outside the operators the tracker sees
# on the meta device, so the dry run adds their worst case instead: 4 x 8 bytes x 2 per token.
INPUT_BYTES_PER_TOKEN = 64


class MetaModelRunner(ModelRunner):
    """A runner whose tensors live on the meta device; it can profile but never sample."""

    device = META

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int,
                 dtype: torch.dtype) -> None:
        # The base constructor makes a sampling generator, which the meta device cannot have;
        # build it on the CPU (a dry run never samples), then switch to meta tensors.
        self.device = torch.device("cpu")
        super().__init__(model, 0, block_size, dtype, seed=0)
        self.device = META
        self.allocate_kv_cache(num_blocks)


def meta_model(hf_config, dtype: torch.dtype) -> nn.Module:
    """The architecture with every weight on the meta device: sizes without data."""
    rng = torch.get_rng_state()
    with torch.device(META):
        model = get_model_class(hf_config)(hf_config)
    torch.set_rng_state(rng)  # parameter initialisers must not move the seeded global RNG
    model = model.to(dtype)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model.eval()


def profile_blocks(batch: SchedulerOutput) -> int:
    """KV blocks the profile batch writes into."""
    return 1 + max(b for r in batch.requests for b in r.block_ids)


def dry_run_peak(model: nn.Module, batch: SchedulerOutput, encoder_pixels: EncoderPixels,
                 block_size: int, dtype: torch.dtype) -> int:
    """Peak bytes of tensors that running ``batch`` (whose images have ``encoder_pixels``)
    creates, counted on the meta device.

    At least the peak of the CPU allocator's own events (torch.profiler) for a real run of the
    same batch, and at most ``INPUT_BYTES_PER_TOKEN`` per scheduled token more (a test checks
    both sides).
    """
    runner = MetaModelRunner(model, profile_blocks(batch), block_size, dtype)
    peak = runner.measure_profile_peak(batch, encoder_pixels)
    return peak + INPUT_BYTES_PER_TOKEN * batch.num_scheduled_tokens


def encoder_flops_per_token(model: nn.Module, item: EncoderInput, num_tokens: int) -> float:
    """Model FLOPs the encoder spends per embedding token, counted on the meta device while
    ``model`` (a ``meta_model``) encodes ``item``, an image of ``num_tokens`` tokens."""
    from torch.utils.flop_counter import FlopCounterMode

    item = {name: t.to(META) if t.is_floating_point() else t for name, t in item.items()}
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model.encode_images([item])
    return counter.get_total_flops() / num_tokens


def decoder_flops_per_token(model: nn.Module) -> float:
    """Model FLOPs of prefilling one token: two per weight of the decoder's layers (its
    matrix products; the token embedding is a lookup, and attention's own FLOPs, which grow
    with the context, are left out)."""
    layers = model.model.language_model.layers
    return 2.0 * sum(p.numel() for p in layers.parameters() if p.dim() == 2)
