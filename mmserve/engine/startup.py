"""Start-up planning: engine settings + checkpoint -> encoder budget, profile batch, memory plan.

The engine and ``mmserve plan`` both call ``plan_for``; they differ only in the figures they
hand it. The engine has loaded the weights, so it passes their real size, and on a GPU it
passes a callback that runs the profile batch and reads the allocator's peak. ``mmserve plan``
loads nothing and passes neither: the weights are counted on a meta-device model and the peak
is a meta-device dry run, which on the CPU is also what the engine measures (the tracker counts
storages, whose sizes depend on shapes alone), so there both plans are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from mmserve.config import EngineConfig
from mmserve.engine.encoder_cache import EncoderBudget, compute_encoder_budget
from mmserve.engine.memory_plan import (
    InfeasiblePlanError,
    MemoryPlan,
    PlanInputs,
    default_memory_utilization,
    max_num_seqs_bound,
    plan_memory,
)
from mmserve.engine.profile_batch import ProfileBatch, profile_batch_for
from mmserve.models.lora import adapter_slot_bytes, attach_lora
from mmserve.processing.family import MultiModalFamily
from mmserve.worker import cpu_threads, memory_profiler
from mmserve.worker.dry_run import (
    decoder_flops_per_token,
    dry_run_peak,
    encoder_flops_per_token,
    kv_heads_per_rank,
    meta_model,
)

# Runs the profile batch on the device; returns its peak bytes and how they were measured.
PeakMeasurement = Callable[[ProfileBatch], tuple[int, str]]


@dataclass(frozen=True)
class StartupPlan:
    """What start-up decides before the KV cache is allocated."""

    plan: MemoryPlan
    encoder_budget: EncoderBudget
    profile: ProfileBatch  # the batch whose peak the plan subtracts


def plan_for(
    config: EngineConfig,
    hf_config,
    family: MultiModalFamily,
    device: str,
    memory_bytes: int,
    weights_bytes: int | None = None,
    measure_peak: PeakMeasurement | None = None,
    estimated: tuple[str, ...] = (),
) -> StartupPlan:
    """The start-up plan for ``config`` on ``device`` (``"cpu"`` or ``"cuda"``), whose memory
    (GPU total, or the RAM available) is ``memory_bytes``.

    ``family``: the checkpoint's model family, for the most tokens an image becomes and the
    profile run's worst-case image.
    ``weights_bytes``: the loaded weights' size; None counts them on a meta-device model.
    ``measure_peak``: runs the profile batch for real; None dry-runs it on the meta device.
    A figure taken from the meta device is marked an estimate on a GPU, where the engine
    measures the allocator instead; ``estimated`` names the caller's own estimates.
    Raises ``InfeasiblePlanError`` when the settings cannot fit; when the family's images can
    be bounded smaller (dynamic resolution) and a bound would fit, the error names it.
    """
    try:
        return _plan(config, hf_config, family, device, memory_bytes, weights_bytes,
                     measure_peak, estimated)
    except InfeasiblePlanError as error:
        hint = _item_bound_that_fits(config, hf_config, family, device, memory_bytes,
                                     weights_bytes, measure_peak, estimated)
        if hint is None:
            raise
        raise InfeasiblePlanError(f"{error}\n{hint}") from None


# Halvings of the largest item tried when looking for a bound that fits.
_MAX_HALVINGS = 12


def _item_bound_that_fits(config: EngineConfig, hf_config, family: MultiModalFamily,
                          device: str, memory_bytes: int, weights_bytes: int | None,
                          measure_peak: PeakMeasurement | None,
                          estimated: tuple[str, ...]) -> str | None:
    """For a plan that does not fit: the largest item bound (halving the tokens of the
    largest image) under which it fits, said as the setting to pass; None when the family
    cannot bound its images or no bound helps."""
    tokens = family.max_tokens_per_item
    for _ in range(_MAX_HALVINGS):
        tokens //= 2
        if tokens < 1:
            return None
        bounded = family.bounded_to(tokens)
        if bounded is None:
            return None
        try:
            _plan(config, hf_config, bounded, device, memory_bytes, weights_bytes,
                  measure_peak, estimated)
        except InfeasiblePlanError:
            continue
        return (f"One image can become {family.max_tokens_per_item} tokens under "
                f"{family.item_bound_setting()}; bounded to {bounded.max_tokens_per_item} "
                f"tokens the plan fits: {bounded.item_bound_setting()}.")
    return None


def _plan(config: EngineConfig, hf_config, family: MultiModalFamily, device: str,
          memory_bytes: int, weights_bytes: int | None, measure_peak: PeakMeasurement | None,
          estimated: tuple[str, ...]) -> StartupPlan:
    dtype = config.torch_dtype
    budget = encoder_budget_for(config, family.max_tokens_per_item)
    batch = profile_batch_for(config, hf_config, family, budget,
                              images_per_step(config, budget), device)
    step = batch.scheduler_output
    marked = set(estimated)
    ranks, split_encoder = config.tensor_parallel_size, config.mm_encoder_tp_mode == "weights"
    # Rank 0's shapes: sizes, dry runs, FLOPs.
    model = meta_model(hf_config, dtype, ranks, split_encoder)
    if config.lora_slots is not None:  # its slots are weights; its deltas, activations
        attach_lora(model, *config.lora_slots)
    adapters_bytes = adapter_slot_bytes(model)  # (rank 0's share)
    if weights_bytes is None:
        weights_bytes = memory_profiler.tensor_bytes(model)
        if device != "cpu":
            marked.add("weights_bytes")
    if measure_peak is None:
        # On the CPU, the most threads the runner will use (their scratch is counted).
        threads = 0 if device != "cpu" else cpu_threads.max_threads(
            config.cpu_threads if isinstance(config.cpu_threads, int) else None)
        if ranks > 1 and not isinstance(config.cpu_threads, int):
            threads = max(1, threads // ranks)  # the workers share the cores out
        peak = dry_run_peak(model, step, batch.encoder_pixels, config.block_size, dtype,
                            threads, ranks, split_encoder)
        method = "tensors of a meta-device dry run of the profile batch"
        if device != "cpu":
            marked.add("activation_bytes")
    else:
        peak, method = measure_peak(batch)
    method += (f" ({step.num_scheduled_tokens} tokens, {step.num_requests} sequences, "
               f"{len(step.images_to_encode)} images)")
    inputs = plan_inputs(config, hf_config, device, memory_bytes, weights_bytes, peak, method,
                         budget, estimated=tuple(sorted(marked)), lora_bytes=adapters_bytes)
    if config.encoder_cache_borrowing and config.limit_mm_per_prompt:
        text = hf_config.text_config
        dtype_bytes = torch.empty((), dtype=dtype).element_size()
        encoder = encoder_flops_per_token(model, family.dummy_encoder_input(),
                                          family.max_tokens_per_item)
        inputs = replace(
            inputs, encoder_borrowing=True,
            encoder_flops_per_byte=encoder / (text.hidden_size * dtype_bytes),
            prefill_flops_per_byte=decoder_flops_per_token(model) / inputs.kv_bytes_per_token)
    return StartupPlan(plan_memory(inputs), budget, batch)


def encoder_budget_for(config: EngineConfig, tokens_per_image: int) -> EncoderBudget:
    """The encoder budget of an engine, decided before the KV cache is sized.

    The cache holds at most ``max_num_seqs x limit_mm_per_prompt`` images, with max_num_seqs
    at its bound, so the encoder cache never grows after the KV cache has been sized.
    """
    return compute_encoder_budget(
        max_tokens_per_item=tokens_per_image,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=max_num_seqs_bound(config),
        max_items_per_prompt=max(1, config.limit_mm_per_prompt),
        encoder_cache_size=config.encoder_cache_size,
    )


def images_per_step(config: EngineConfig, budget: EncoderBudget) -> int:
    """The most images one step can encode: the profile run's worst case."""
    if config.limit_mm_per_prompt == 0:
        return 0
    return max(1, min(budget.compute_tokens // budget.max_tokens_per_item, budget.cache_items))


def plan_inputs(
    config: EngineConfig,
    hf_config,
    device: str,
    memory_bytes: int,
    weights_bytes: int,
    activation_bytes: int,
    activation_method: str,
    encoder_budget: EncoderBudget,
    estimated: tuple[str, ...] = (),
    lora_bytes: int = 0,
) -> PlanInputs:
    """PlanInputs from the engine settings, the checkpoint's config and the measured sizes."""
    text = hf_config.text_config
    dtype_bytes = torch.empty((), dtype=config.torch_dtype).element_size()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    ranks = config.tensor_parallel_size
    kv_heads = kv_heads_per_rank(
        getattr(text, "num_key_value_heads", None) or text.num_attention_heads, ranks)
    util = config.gpu_memory_utilization or default_memory_utilization(device)
    tokens_per_image = encoder_budget.max_tokens_per_item
    return PlanInputs(
        device=device,
        # The CPU's ranks share its RAM; each GPU rank has its own.
        memory_bytes=memory_bytes // ranks if device == "cpu" else memory_bytes,
        tensor_parallel_size=ranks,
        gpu_memory_utilization=util,
        weights_bytes=weights_bytes,
        activation_bytes=activation_bytes,
        activation_method=activation_method,
        encoder_cache_items=encoder_budget.cache_items,
        encoder_cache_tokens=encoder_budget.cache_tokens,
        encoder_bytes_per_token=text.hidden_size * dtype_bytes,
        kv_bytes_per_token=2 * text.num_hidden_layers * kv_heads * head_dim * dtype_bytes,
        block_size=config.block_size,
        model_max_len=text.max_position_embeddings,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        kv_cache_memory=config.kv_cache_memory,
        single_user_mode=config.single_user_mode,
        min_model_len=tokens_per_image + 1 if config.limit_mm_per_prompt else 1,
        estimated=estimated,
        lora_bytes=lora_bytes,
    )
