"""The messages of one engine step, between the scheduler and the runner.

``SchedulerOutput`` says what to compute (ids, token counts, block ids, image hashes) and
``ModelOutput`` what came out (sampled tokens, failures, the runner's timings). Both sides
import this leaf module and nothing of each other: the scheduler never sees a tensor (the
engine adds the structured-output bitmasks after scheduling), and the runner never sees the
scheduler. The pixels of the images to encode travel beside the
``SchedulerOutput``, as ``ModelRunner.execute``'s second argument (hash -> pixel values).

Most requests of most steps decode: one token each, past their prompts and images. Those
travel as ``DecodeRows``, columns that both sides read and fill without an object per request,
so a step of hundreds of decodes costs a few list appends each; prompt chunks and the rarer
cases travel as ``ScheduledRequest`` objects.
"""

from __future__ import annotations

import dataclasses
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
    # For a request whose sampling depends on its tokens before (penalties, min_tokens), in
    # its first step after its admission or after a failed step: every token it has, prompt
    # first (``num_prompt_tokens`` of them), from which the runner counts them afresh.
    known_token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    lora_slot: int = -1  # the LoRA adapter slot its rows compute with (-1: none)


@dataclass
class DecodeRows:
    """The requests of a step that compute one generated token each and sample the next
    (past their prompts, hence past their images; no grammar): most requests of most steps,
    as columns rather than an object each. In the step's flat batch they are the first rows,
    in this order, before ``SchedulerOutput.chunks``."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # each one's last, or PENDING_TOKEN
    start_pos: list[int] = field(default_factory=list)  # the token's index in its request
    positions: list[int] = field(default_factory=list)  # its rope position, in every row alike
    sampling_params: list[SamplingParams] = field(default_factory=list)
    blocks_from: list[int] = field(default_factory=list)  # as ``ScheduledRequest.blocks_from``
    # The block ids no earlier step sent, for the rows that add some (one step in a block's
    # size): row -> ids, from index ``blocks_from[row]`` of the request's table.
    new_blocks: dict[int, list[int]] = field(default_factory=dict)
    position_rows: int = 1  # rows of the model's positions (3 for M-RoPE)
    lora_slots: list[int] = field(default_factory=list)  # each one's, as ScheduledRequest's

    def __len__(self) -> int:
        return len(self.request_ids)

    def append(self, request_id: str, token_id: int, start_pos: int, position: int,
               sampling_params: SamplingParams, blocks_from: int, lora_slot: int = -1) -> None:
        self.request_ids.append(request_id)
        self.token_ids.append(token_id)
        self.start_pos.append(start_pos)
        self.positions.append(position)
        self.sampling_params.append(sampling_params)
        self.blocks_from.append(blocks_from)
        self.lora_slots.append(lora_slot)

    def select(self, rows: list[int]) -> DecodeRows:
        """These rows alone, in this order."""
        return DecodeRows(
            [self.request_ids[i] for i in rows], [self.token_ids[i] for i in rows],
            [self.start_pos[i] for i in rows], [self.positions[i] for i in rows],
            [self.sampling_params[i] for i in rows], [self.blocks_from[i] for i in rows],
            {j: self.new_blocks[i] for j, i in enumerate(rows) if i in self.new_blocks},
            self.position_rows, [self.lora_slots[i] for i in rows])

    def request(self, row: int) -> ScheduledRequest:
        """The row as a ``ScheduledRequest`` (for tests and rare paths: a failed step's
        requests run again one by one)."""
        position = self.positions[row]
        return ScheduledRequest(
            request_id=self.request_ids[row], token_ids=[self.token_ids[row]],
            start_pos=self.start_pos[row], block_ids=list(self.new_blocks.get(row, ())),
            blocks_from=self.blocks_from[row], image_slices=[], sample=True,
            sampling_params=self.sampling_params[row],
            positions=[[position] for _ in range(self.position_rows)],
            lora_slot=self.lora_slots[row])


@dataclass
class SchedulerOutput:
    """Everything the runner needs for one step, as plain ids, counts and hashes."""

    # The step's decode rows (columns), then every other request it runs (prompt chunks,
    # requests with a grammar, a token computed again), one object each.
    decodes: DecodeRows = field(default_factory=DecodeRows)
    chunks: list[ScheduledRequest] = field(default_factory=list)
    # Encode these now: image hash -> embedding tokens it makes. Their pixels come separately.
    images_to_encode: dict[str, int] = field(default_factory=dict)
    freed_encoder_hashes: list[str] = field(default_factory=list)  # drop these tensors first
    # Encoder outputs moving between the encoder cache's reserve and KV blocks it borrows,
    # done before anything else in the step, restores first: hash -> (tokens, block ids) to
    # rebuild from KV blocks, and hash -> block ids to copy a tensor into (then drop it).
    encoder_restores: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    encoder_spills: dict[str, list[int]] = field(default_factory=dict)
    finished_request_ids: list[str] = field(default_factory=list)
    # The LoRA adapter each slot the step's rows use must hold: slot -> (name, id, folder);
    # the runner reads one into a slot that holds another first. ``loads_lora``: an adapter
    # takes a slot anew here (no step is scheduled ahead of it: a read that fails fails its
    # requests, which a step after must not build on).
    lora_adapters: dict[int, tuple[str, int, str]] = field(default_factory=dict)
    loads_lora: bool = False
    # Scheduled while the step before it still ran (asynchronous scheduling): a request that
    # step failed for has nothing to continue from here.
    ahead: bool = False

    @property
    def requests(self) -> list[ScheduledRequest]:
        """Every request of the step as an object, in the batch's order (decode rows made
        into objects: for tests and rare paths, not for every step)."""
        decodes = self.decodes
        return [decodes.request(i) for i in range(len(decodes))] + self.chunks

    def request_ids(self) -> list[str]:
        """The step's requests' ids, in the batch's order."""
        return self.decodes.request_ids + [r.request_id for r in self.chunks]

    def sampling_ids(self) -> list[str]:
        """The ids of the requests that sample in this step, in the batch's order."""
        return self.decodes.request_ids + [r.request_id for r in self.chunks if r.sample]

    @property
    def num_requests(self) -> int:
        return len(self.decodes) + len(self.chunks)

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.decodes) + sum(len(r.token_ids) for r in self.chunks)

    def without(self, request_ids: set[str] | frozenset[str]) -> SchedulerOutput:
        """This step less the requests in ``request_ids`` (a copy; the rest is shared)."""
        decodes = self.decodes
        if any(rid in request_ids for rid in decodes.request_ids):
            decodes = decodes.select([i for i, rid in enumerate(decodes.request_ids)
                                      if rid not in request_ids])
        return dataclasses.replace(self, decodes=decodes, chunks=[
            r for r in self.chunks if r.request_id not in request_ids])

    def only(self, req: ScheduledRequest) -> SchedulerOutput:
        """This step cut down to one of its requests and the images that request encodes
        (frees and finished ids were carried out with the whole step)."""
        hashes = {s.image_hash for s in req.image_slices}
        return SchedulerOutput(chunks=[req], images_to_encode={
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
    ``prompt_logprobs`` those of the prompt tokens this step's chunks predicted;
    ``embeddings`` the last prompt token's hidden state, for requests that asked.
    ``errors``: requests the step failed for, with the reason; their tokens were not
    computed. ``failed_images``: hashes scheduled for encoding whose embeddings do not exist
    (their encoding failed). ``lora_failures``: requests whose LoRA adapter did not load, with
    why (to fail, never to retry). ``times``: where the runner's time went in this step.
    """

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Prompt logprobs computed this step: request -> (the prompt position of the first, them).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    failed_images: list[str] = field(default_factory=list)
    lora_failures: dict[str, str] = field(default_factory=dict)
    times: StepTimes = field(default_factory=StepTimes)
    # The final hidden state of the last prompt token (float32, on the CPU) of each request
    # that sampled its first token here and asked for it (``SamplingParams.return_embedding``).
    embeddings: dict[str, torch.Tensor] = field(default_factory=dict)
