"""The request state machine: counters instead of phase flags."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmserve.inputs import ImageInput
from mmserve.lora_request import LoRARequest
from mmserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Live states sort before finished ones: ``status > PREEMPTED`` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # a step failed for this request; the others went on

    @property
    def finished(self) -> bool:
        return self > _PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# Plain values: an enum member's lookup on its class costs more than the comparison, and these
# are read for every request every step.
_PREEMPTED = int(RequestStatus.PREEMPTED)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """A prompt being served. ``num_computed_tokens`` catches up with ``num_tokens``."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        images: list[ImageInput] | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        arrival_time: float = 0.0,
        prompt_positions: np.ndarray | None = None,
        decode_offset: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """``prompt_positions``: the prompt's rope positions, ``[rows, len(prompt_token_ids)]``
        (from processing; None means LLaMA's counter, one row of ``arange``), and
        ``decode_offset``: a generated token at index ``i`` has position ``i + decode_offset``
        in every row. ``eos_token_id``: the token, or tokens, that end it (unless
        ``ignore_eos``). ``cache_salt`` (vLLM's): the prefix cache's blocks of this request
        are found only by requests of the same salt (its images' hashes are salted too, so
        are their encoder outputs). ``lora_request``: the LoRA adapter its decoder runs with
        (its prefix-cache blocks are that adapter's alone)."""
        self.request_id = request_id
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.lora_slot = -1  # the runner's slot of its adapter while it runs (LoRASlots)
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.images = images or []
        self.images_end = max((image.end for image in self.images), default=0)
        # num_computed_tokens when the scheduler last released passed images (-1: never, or
        # since they went back); once past images_end, there is nothing left to release.
        self.images_checked_at = -1
        # Block ids the runner has of this request's (steps send the others): 0 at admission.
        self.num_blocks_sent = 0
        # Whether the runner's counts of the request's tokens (penalties, min_tokens) are to
        # be made afresh from its tokens: at its admission, and after a failed step (whose
        # token the runner may have counted).
        self.history_stale = False
        self.eos_token_ids: tuple[int, ...] = (
            () if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int)
            else tuple(eos_token_id))
        self.arrival_time = arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.error: str | None = None  # why a step failed for it (status FINISHED_ERROR)
        self.num_failed_steps = 0  # steps in a row that failed for it
        # Aborted while a step still in flight holds it (asynchronous scheduling): never
        # scheduled again, released once that step is collected.
        self.aborting = False
        # Prompt tokens found in the prefix cache when first admitted (None until then).
        self.num_cached_tokens: int | None = None
        # Prefix-cache hashes of this request's full blocks, filled by the KV cache manager.
        self.block_hashes: list[bytes] = []
        # The compiled grammar of its structured_outputs (an xgrammar CompiledGrammar), if any.
        self.grammar: Any = None
        if prompt_positions is None:
            prompt_positions = np.arange(self.num_prompt_tokens, dtype=np.int64)[None, :]
        if prompt_positions.ndim != 2 or prompt_positions.shape[1] != self.num_prompt_tokens:
            raise ValueError(f"prompt positions of shape {prompt_positions.shape} for a prompt "
                             f"of {self.num_prompt_tokens} tokens; expected [rows, "
                             f"{self.num_prompt_tokens}]")
        self.prompt_positions = prompt_positions
        self.position_rows = prompt_positions.shape[0]
        self.decode_offset = decode_offset

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status > _PREEMPTED

    def positions(self, start: int, end: int) -> list[list[int]]:
        """Positions of tokens ``[start, end)``, one list per row: prompt tokens from the
        stored positions, generated ones ``index + decode_offset`` in every row. The only place
        positions are sliced, so chunked prefill, prefix hits and recomputation after a
        preemption see the same numbers."""
        if start >= self.num_prompt_tokens:  # generated tokens only (every decode step)
            if end == start + 1:  # one token: most requests, most steps
                if self.position_rows == 1:
                    return [[start + self.decode_offset]]
                return [[start + self.decode_offset] for _ in range(self.position_rows)]
            generated = range(start + self.decode_offset, end + self.decode_offset)
            return [list(generated) for _ in range(self.position_rows)]
        prompt_end = min(end, self.num_prompt_tokens)
        rows = self.prompt_positions[:, start:prompt_end].tolist()
        if end > prompt_end:
            generated = range(max(start, prompt_end) + self.decode_offset,
                              end + self.decode_offset)
            for row in rows:
                row.extend(generated)
        return rows

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
