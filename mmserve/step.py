"""The messages of one engine step, between the scheduler and the runner.

``SchedulerOutput`` says what to compute (ids, token counts, block ids, image hashes) and
``ModelOutput`` what came out (sampled tokens, failures, the runner's timings). Both sides
import this leaf module and nothing of each other: the scheduler never sees a tensor (the
engine adds the structured-output bitmasks after scheduling), and the runner never sees the
scheduler. The pixels of the images to encode travel beside the
``SchedulerOutput``, as ``ModelRunner.execute``'s second argument (hash -> pixel values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


# A token the step before this one samples, not yet known when this step was scheduled
# (asynchronous scheduling): the runner writes in the token it sampled for the request.
PENDING_TOKEN = -1


@dataclass
class ImageSlice:
    """Copy ``embeddings[image_hash][src_start : src_start + length]`` to ``dst_start``."""

    image_hash: str
    src_start: int
    dst_start: int  # position within this request's scheduled tokens
    length: int


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the last may be PENDING_TOKEN (scheduled ahead of its sampling)
    start_pos: int  # num_computed_tokens before this step
    # The request's KV block ids from index ``blocks_from`` on: those no earlier step sent (the
    # runner keeps each request's table between steps; ``SchedulerOutput.finished_request_ids``
    # drops it). A request's first step after its admission sends all of them.
    block_ids: list[int]
    image_slices: list[ImageSlice]
    sample: bool  # the chunk reaches the last known token: sample the next one
    sampling_params: SamplingParams
    # Rope positions of ``token_ids``, one list per row ([1][n], or [3][n] for M-RoPE), sliced
    # from the request's (``Request.positions``).
    positions: list[list[int]]
    # For a request that asked for prompt logprobs: the prompt tokens that follow the first
    # rows of this chunk, one per row (the logprobs of prompt positions start_pos + 1 on).
    prompt_logprob_targets: list[int] = field(default_factory=list)
    # Where the request has a structured_outputs grammar and samples: the tokens it may
    # sample, packed 32 to an int32 word (bit j of word i: token 32 * i + j), on the CPU.
    token_bitmask: torch.Tensor | None = None
    blocks_from: int = 0  # index of block_ids[0] in the request's table


@dataclass
class SchedulerOutput:
    """Everything the runner needs for one step, as plain ids, counts and hashes."""

    requests: list[ScheduledRequest] = field(default_factory=list)
    # Encode these now: image hash -> embedding tokens it makes. Their pixels come separately.
    images_to_encode: dict[str, int] = field(default_factory=dict)
    freed_encoder_hashes: list[str] = field(default_factory=list)  # drop these tensors first
    # Encoder outputs moving between the encoder cache's reserve and KV blocks it borrows,
    # done before anything else in the step, restores first: hash -> (tokens, block ids) to
    # rebuild from KV blocks, and hash -> block ids to copy a tensor into (then drop it).
    encoder_restores: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    encoder_spills: dict[str, list[int]] = field(default_factory=dict)
    finished_request_ids: list[str] = field(default_factory=list)
    # Scheduled while the step before it still ran (asynchronous scheduling): a request that
    # step failed for has nothing to continue from here.
    ahead: bool = False

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    def only(self, req: ScheduledRequest) -> SchedulerOutput:
        """This step cut down to one of its requests and the images that request encodes
        (frees and finished ids were carried out with the whole step)."""
        hashes = {s.image_hash for s in req.image_slices}
        return SchedulerOutput(requests=[req], images_to_encode={
            h: n for h, n in self.images_to_encode.items() if h in hashes})


@dataclass
class StepTimes:
    """Seconds the runner spent in each part of one step (summed over its reruns when a
    failed step is rerun request by request)."""

    encoder: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability under the model (log-softmax of its logits), its rank
    among all tokens (1: the most likely), and the most likely tokens with theirs, as many as
    the request asked for, most likely first."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class ModelOutput:
    """What the runner hands back for one step.

    ``sampled``: the next token of every request whose chunk completed. ``logprobs``: that
    token's log-probabilities, for the requests that asked (``SamplingParams.logprobs``), and
    ``prompt_logprobs`` those of the prompt tokens this step's chunks predicted.
    ``errors``: requests the step failed for, with the reason; their tokens were not
    computed. ``failed_images``: hashes scheduled for encoding whose embeddings do not exist
    (their encoding failed). ``times``: where the runner's time went in this step.
    """

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Prompt logprobs computed this step: request -> (the prompt position of the first, them).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    failed_images: list[str] = field(default_factory=list)
    times: StepTimes = field(default_factory=StepTimes)
