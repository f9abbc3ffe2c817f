"""The profile run's batch: the worst step the scheduler can produce, as dummy requests.

The memory plan subtracts the peak activations of this step from the budget. It is
built here, on the engine side, from the engine's settings and the checkpoint; the runner only
runs it and measures (``ModelRunner.measure_profile_peak``, ``worker/dry_run.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.config import EngineConfig
from mmserve.engine.encoder_cache import EncoderBudget
from mmserve.engine.memory_plan import max_num_seqs_bound
from mmserve.inputs import EncoderInput, with_integer_pixels
from mmserve.processing.family import MultiModalFamily
from mmserve.sampling_params import SamplingParams
from mmserve.step import ImageSlice, ScheduledRequest, SchedulerOutput


@dataclass
class ProfileBatch:
    """A step to run for its memory peak: what the scheduler would say, and the encoder inputs
    of the images it encodes (hash -> named tensors), as the engine hands them to the runner."""

    scheduler_output: SchedulerOutput
    encoder_pixels: dict[str, EncoderInput]


def profile_batch(
    num_tokens: int,
    max_num_seqs: int,
    max_positions: int,
    block_size: int,
    num_images: int,
    tokens_per_image: int,
    encoder_input: EncoderInput,
    position_rows: int = 1,
    extra_image: tuple[int, EncoderInput] | None = None,
) -> ProfileBatch:
    """The worst step the scheduler can produce, as dummy requests.

    ``num_tokens`` tokens in all (``max_num_batched_tokens``): ``max_num_seqs - 1`` decodes,
    each sampling a row of logits, and the rest as one prompt chunk (split where it would pass
    ``max_positions``) whose first tokens are image placeholders. ``num_images`` images of
    ``tokens_per_image`` embeddings are encoded in the step, as many as the encoder budget
    allows, each with ``encoder_input`` (the family's worst case, pixels zeroed), and after
    them ``extra_image`` (tokens, encoder input), a smaller item that fills the rest of the
    encoder's budget where the family has items of any size. Token ids are 0: no random
    numbers are drawn. Positions have ``position_rows`` rows (the family's), counting from 0.
    """
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    prompt_tokens = num_tokens - (num_seqs - 1)
    lengths = [1] * (num_seqs - 1)
    while prompt_tokens > 0:
        lengths.insert(0, min(prompt_tokens, max_positions))
        prompt_tokens -= lengths[0]
    images = [(f"profile-{k}", tokens_per_image, encoder_input) for k in range(num_images)]
    if extra_image is not None:
        images.append((f"profile-{num_images}", *extra_image))
    greedy = SamplingParams(temperature=0.0)
    requests = []
    next_block = 0
    for i, n in enumerate(lengths):
        num_blocks = -(-n // block_size)
        slices = []
        offset = 0
        for image_hash, tokens, _ in images if i == 0 else ():
            if offset >= n:
                break
            slices.append(ImageSlice(image_hash, 0, offset, min(tokens, n - offset)))
            offset += tokens
        requests.append(ScheduledRequest(
            request_id=f"profile-{i}", token_ids=[0] * n, start_pos=0,
            block_ids=list(range(next_block, next_block + num_blocks)), image_slices=slices,
            sample=True, sampling_params=greedy,
            positions=[list(range(n)) for _ in range(position_rows)]))
        next_block += num_blocks
    return ProfileBatch(
        SchedulerOutput(chunks=requests,
                        images_to_encode={h: tokens for h, tokens, _ in images}),
        {h: item for h, _, item in images})


def profile_batch_for(config: EngineConfig, hf_config, family: MultiModalFamily,
                      encoder_budget: EncoderBudget, num_images: int,
                      device: str | None = None) -> ProfileBatch:
    """``profile_batch`` for an engine's settings and checkpoint: its images are the family's
    worst-case dummy image, of ``max_tokens_per_item`` tokens, and where the family has items
    of any size and the cache has room, one more that spends the rest of the step's encoder
    budget. ``device``: the one planned for (default: the settings' own).
    """
    # The dummies as the engine's preprocessing sends images: on a GPU, integer pixels that
    # the runner finishes there.
    arithmetic = family.pixel_arithmetic_for(device or config.resolved_device)
    sent = ((lambda item: item) if arithmetic is None
            else (lambda item: with_integer_pixels(item, arithmetic)))
    extra = None
    rest = encoder_budget.compute_tokens - num_images * encoder_budget.max_tokens_per_item
    if 0 < num_images < encoder_budget.cache_items and rest > 0:
        item = family.dummy_encoder_input_of(rest)
        extra = (rest, sent(item)) if item is not None else None
    return profile_batch(
        num_tokens=config.max_num_batched_tokens,
        max_num_seqs=max_num_seqs_bound(config),
        max_positions=hf_config.text_config.max_position_embeddings,
        block_size=config.block_size,
        num_images=num_images,
        tokens_per_image=encoder_budget.max_tokens_per_item,
        encoder_input=sent(family.dummy_encoder_input()),
        position_rows=family.position_rows,
        extra_image=extra,
    )
