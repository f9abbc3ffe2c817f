"""What the engine hands back to its front doors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

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
    # The last prompt token's final hidden state (float32), for a request that asked
    # (``SamplingParams.return_embedding``), in the output of the step that sampled after it.
    embedding: torch.Tensor | None = None

    def completion(self, index: int = 0) -> CompletionOutput:
        """This request's output as completion ``index`` of its prompt."""
        return CompletionOutput(index, self.text, self.token_ids, self.finish_reason,
                                self.logprobs, self.error)


@dataclass
class EmbeddingOutput:
    """A prompt's embedding: the final hidden state of its last token (L2-normalized where
    asked), as vLLM's ``EmbeddingOutput``."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns for one prompt, as vLLM's."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    num_prompt_tokens: int
    finished: bool = True


def embedding_of(out: RequestOutput, normalize: bool = True) -> torch.Tensor:
    """The embedding of a finished ``return_embedding`` request: its last prompt token's
    final hidden state, L2-normalized where ``normalize`` (as embedding models' are, and
    OpenAI's: a dot product is then the cosine similarity). Raises ``RuntimeError`` with
    the engine's reason where the request failed."""
    if out.embedding is None:
        raise RuntimeError(f"request {out.request_id} has no embedding: "
                           f"{out.error or 'it did not ask for one (return_embedding)'}")
    return F.normalize(out.embedding, dim=0) if normalize else out.embedding


@dataclass
class ScoringOutput:
    """A pair's score: the cosine similarity of the two prompts' embeddings, as vLLM's
    ``LLM.score`` gives for an embedding model."""

    score: float


@dataclass
class ScoringRequestOutput:
    """What ``LLM.score`` returns for one pair, as vLLM's."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def score_pairs(num_left: int, num_right: int) -> list[tuple[int, int]]:
    """vLLM's pairing of scored items, as indexes into left + right: one left item against
    every right one, or each against its own (as many of both). ``ValueError`` otherwise."""
    if num_left != 1 and num_left != num_right:
        raise ValueError(f"{num_left} first items and {num_right} second ones: score one "
                         "against all, or as many of each")
    return [(0 if num_left == 1 else j, num_left + j) for j in range(num_right)]


def cosine_scores(embeddings: list[torch.Tensor], pairs: list[tuple[int, int]]) -> list[float]:
    """The cosine similarity of each pair of ``embeddings`` (indexes into them)."""
    unit = [F.normalize(e.to(torch.float32), dim=0) for e in embeddings]
    return [float(unit[a] @ unit[b]) for a, b in pairs]
