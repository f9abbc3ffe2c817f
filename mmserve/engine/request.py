"""The request state machine: counters instead of phase flags."""

from __future__ import annotations

import enum

from mmserve.inputs import ImageInput
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
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


class Request:
    """A prompt being served. ``num_computed_tokens`` catches up with ``num_tokens``."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        images: list[ImageInput] | None = None,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.images = images or []
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.error: str | None = None  # why a step failed for it (status FINISHED_ERROR)
        self.num_failed_steps = 0  # steps in a row that failed for it
        # Prompt tokens found in the prefix cache when first admitted (None until then).
        self.num_cached_tokens: int | None = None
        # Prefix-cache hashes of this request's full blocks, filled by the KV cache manager.
        self.block_hashes: list[bytes] = []

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
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
