"""Profile runs on the meta device: the same code as a real step, on shapes alone.

Every tensor a step creates has a size fixed by shapes and dtypes, so counting the storages of
a meta-device run gives what a real CPU run allocates, within a small bound for the step's
index tensors, in a fraction of a second and with no weights loaded. The engine uses it for
the CPU profile; ``mmserve plan`` uses it for every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from mmserve.inputs import EncoderInput
from mmserve.kernels import cpu_ops
from mmserve.models import parallel
from mmserve.models.parallel import kv_heads_per_rank  # noqa: F401 (the plan's, from here)
from mmserve.models.registry import get_model_class
from mmserve.step import SchedulerOutput
from mmserve.worker.memory_profiler import track_peak_bytes
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


def meta_model(hf_config, dtype: torch.dtype, tensor_parallel_size: int = 1,
               split_encoder: bool = False) -> nn.Module:
    """The architecture with every weight on the meta device: sizes without data (rank 0's
    share of them under tensor parallelism, the vision tower split too with
    ``split_encoder``; ranks hold equal shares). A model that cannot be split
    ``tensor_parallel_size`` ways is a ``ValueError`` saying why."""
    rng = torch.get_rng_state()
    with torch.device(META), parallel.tensor_parallel(0, tensor_parallel_size, split_encoder):
        model = get_model_class(hf_config)(hf_config)
    torch.set_rng_state(rng)  # parameter initialisers must not move the seeded global RNG
    model = model.to(dtype)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model.eval()


def check_tensor_parallel(hf_config, dtype: torch.dtype, tensor_parallel_size: int,
                          split_encoder: bool = False) -> None:
    """A ``ValueError`` saying why, when the model cannot be split that many ways (heads,
    KV heads or the MLP not divisible), before any worker starts."""
    meta_model(hf_config, dtype, tensor_parallel_size, split_encoder)


def profile_blocks(batch: SchedulerOutput) -> int:
    """KV blocks the profile batch writes into."""
    return 1 + max(b for r in batch.requests for b in r.block_ids)


def dry_run_peak(model: nn.Module, batch: SchedulerOutput, encoder_pixels: EncoderPixels,
                 block_size: int, dtype: torch.dtype, threads: int,
                 tensor_parallel_size: int = 1, split_encoder: bool = False) -> int:
    """Peak bytes of tensors that running ``batch`` (whose images have ``encoder_pixels``)
    creates, counted on the meta device.

    At least the peak of the CPU allocator's own events (torch.profiler) for a real run of the
    same batch on ``threads`` threads (which sizes the CPU kernels' per-thread scratch; 0 for
    a device without them), and at most ``INPUT_BYTES_PER_TOKEN`` per scheduled token more,
    plus the images' pixels, which a real step is handed and the dry run copies to the meta
    device (a test checks both sides).
    """
    runner = MetaModelRunner(model, profile_blocks(batch), block_size, dtype)
    # As rank 0 (of ``meta_model(..., tensor_parallel_size, split_encoder)``): its share of
    # the images, or of the vision tower's layers.
    with _FusedAttentionOnMeta(), parallel.tensor_parallel(0, tensor_parallel_size,
                                                           split_encoder):
        _, peak = track_peak_bytes(lambda: runner.profile_run(batch, encoder_pixels), threads)
    return peak + INPUT_BYTES_PER_TOKEN * batch.num_scheduled_tokens


class _FusedAttentionOnMeta(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` on meta tensors as the CPU runs it, not as the math
    fallback that the meta device would take, whose query-by-key score matrices a real step
    never allocates (hundreds of megabytes for a batch of images in a large vision tower):
    where the CPU runner calls a compiled flash attention instead (``cpu_ops``), that kernel's
    output; elsewhere torch's fused kernel (its outputs and, through the tracker, its
    per-thread scratch)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].device == META:
            return _cpu_attention(*args, **kwargs)
        return func(*args, **kwargs)


def _cpu_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False) -> torch.Tensor:
    # Attention with a mask or causal is a prompt chunk's (paged_attention.prefill_attention).
    causal = is_causal or attn_mask is not None
    if cpu_ops.compiled_attention(query.dtype, query.shape[-1], causal,
                                  key.shape[-2]) is not None:
        # [batch, heads, queries, dim] in, as the caller has transposed them; the kernel
        # writes a contiguous [batch, queries, heads, dim].
        return query.new_empty(query.transpose(1, 2).shape).transpose(1, 2)
    # The fused CPU kernel takes fewer KV heads than query heads as they are (enable_gqa).
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


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
