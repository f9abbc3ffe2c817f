"""What the engine hands back to its front doors."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.step import TokenLogprobs


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a prompt (``SamplingParams.n``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None


@dataclass
class RequestOutput:
    """The state of one request after an engine step.

    ``text`` and ``token_ids`` are everything generated so far; ``new_text`` and
    ``new_token_ids`` only what this step added (for streaming). With the request's
    ``SamplingParams.output_kind`` ``delta``, ``text``, ``token_ids`` and ``logprobs`` hold
    only what the step added as well. ``logprobs``: for a request that asked
    (``SamplingParams.logprobs``), one entry per token of ``token_ids``; ``prompt_logprobs``
    one per prompt token (None for the first), in the final output. ``prompt_token_ids``: the
    prompt's tokens, each image's placeholders expanded (as vLLM's).
    ``outputs``: in what ``LLM.generate`` returns, the prompt's completions (``n`` of them, the
    first also in the fields above); empty in the engine's step outputs.
    """

    request_id: str
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # finish_reason "error": why the engine failed this request
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None

    def completion(self, index: int = 0) -> CompletionOutput:
        """This request's output as completion ``index`` of its prompt."""
        return CompletionOutput(index, self.text, self.token_ids, self.finish_reason,
                                self.logprobs, self.error)
