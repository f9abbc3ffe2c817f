"""Beam search: its parameters, its outputs, and the search itself, apart from any engine.

The search is transformers' (``generate(num_beams=...)``, greedy), step for step, so that its
outputs can be checked against transformers' token for token: each step extends every running
beam by its most likely tokens, keeps the best ``beams_to_keep`` continuations of them all by
cumulative log-probability, moves those of the best ``beam_width`` that end (an end-of-sequence
token, or ``max_tokens``) into the finished set scored by length (``length_penalty``), and runs
on with the best ``beam_width`` that did not end, until no running beam can beat the finished
ones (``early_stopping``). An engine drives it (``LLM.beam_search``): each step, one request of
one token per running beam, whose prompt is the beam so far; the prefix cache keeps what the
beams share computed once, and the encoder cache their images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mmserve.errors import InvalidInputError
from mmserve.sampling_params import MAX_LOGPROBS


def beams_to_keep(beam_width: int, num_end_tokens: int) -> int:
    """Continuations kept each step (transformers' rule): enough that ``beam_width`` of them
    go on even when every beam's best ``num_end_tokens`` continuations end it."""
    return max(2, 1 + num_end_tokens) * beam_width


@dataclass
class BeamSearchParams:
    """A beam search's settings, as vLLM's ``BeamSearchParams`` and transformers'
    ``generate(num_beams=beam_width, num_return_sequences=beam_width)`` name them.

    ``beam_width``: beams kept and sequences returned (each step asks the model for every
    beam's ``beams_to_keep`` most likely tokens, at most ``MAX_LOGPROBS``: 10 for a checkpoint
    with one end-of-sequence token, 6 with two). ``max_tokens``: the most tokens a sequence
    gets. ``length_penalty``: a finished sequence scores its cumulative log-probability over
    its length to this power (above 0 favours longer sequences). ``early_stopping``: True
    stops once ``beam_width`` sequences finished; False once no running beam, scored at its
    current length, beats the worst of them; "never" the same, scoring running beams at
    ``max_tokens`` where ``length_penalty`` is positive. ``ignore_eos``: the end-of-sequence
    token ends nothing. Greedy only: log-probabilities are the model's, untouched by
    temperature or penalties (transformers applies a generation config's
    ``repetition_penalty`` in its beam search too: compare with ``repetition_penalty=1.0``).
    Where transformers' order is not defined, the two may part: continuations of equal
    scores (mmserve takes them in beam, then rank order), and scores below its -1e9 marker of
    an empty slot (a ``length_penalty`` far below 0 on long sequences). A value out of range
    raises ``InvalidInputError`` naming it.
    """

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def bad(param: str, message: str) -> InvalidInputError:
            return InvalidInputError(message, param=param)

        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise bad("beam_width", f"beam_width must be an integer from 1 to "
                      f"{MAX_LOGPROBS // 2}, got {self.beam_width!r}.")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be an integer >= 1, got "
                      f"{self.max_tokens!r}.")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not -10 <= lp <= 10:
            raise bad("length_penalty", f"length_penalty must be a number from -10 to 10, "
                      f"got {lp!r}.")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise bad("early_stopping", "early_stopping must be true, false or \"never\", got "
                      f"{self.early_stopping!r}.")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", f"ignore_eos must be a boolean, got {self.ignore_eos!r}.")

    def num_candidates(self, end_token_ids: Sequence[int]) -> int:
        """How many most likely tokens each step asks for per beam (``beams_to_keep``);
        ``InvalidInputError`` when that is more than ``MAX_LOGPROBS``."""
        ends = 0 if self.ignore_eos else len(set(end_token_ids))
        k = beams_to_keep(self.beam_width, ends)
        if k > MAX_LOGPROBS:
            widest = MAX_LOGPROBS // max(2, 1 + ends)
            raise InvalidInputError(
                f"beam_width={self.beam_width} needs the {k} most likely tokens of every beam "
                f"each step, more than {MAX_LOGPROBS}: with this checkpoint's {ends} "
                f"end-of-sequence tokens, a beam search takes at most {widest} beams.",
                param="beam_width")
        return k


@dataclass
class BeamSearchSequence:
    """One sequence a beam search returned: its generated ``token_ids`` (the end-of-sequence
    token included when one ended it, as transformers' ``sequences`` hold it), their ``text``,
    the sum of their log-probabilities and the ``score`` the search ranked it by (that sum
    over ``len(token_ids) ** length_penalty``), and why it ended ("stop": an end-of-sequence
    token; "length": ``max_tokens``)."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str
    text: str = ""


@dataclass
class BeamSearchOutput:
    """A prompt's beam search: its ``beam_width`` sequences, best first. ``error``: why the
    engine failed it (its sequences are then empty)."""

    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)
    error: str | None = None


@dataclass
class _Beam:
    tokens: tuple[int, ...]
    logprob: torch.Tensor  # float32 scalar: the sum, added as transformers adds it


@dataclass
class _Finished:
    tokens: tuple[int, ...]
    logprob: float
    score: torch.Tensor  # float32 scalar


class BeamSearch:
    """One prompt's search. ``running`` lists the beams (generated tokens) to extend next;
    ``advance`` takes, per running beam in that order, its most likely next tokens with their
    log-probabilities (``(token, logprob)``, most likely first, at least
    ``params.num_candidates(...)`` of them); ``done`` says when to stop, ``sequences()`` what
    it found."""

    def __init__(self, params: BeamSearchParams, end_token_ids: Sequence[int],
                 max_tokens: int | None = None) -> None:
        """``max_tokens``: where the engine's room is less than ``params.max_tokens``
        (``max_model_len`` less the prompt)."""
        self.params = params
        self.end_token_ids = frozenset(() if params.ignore_eos else end_token_ids)
        self.k = params.num_candidates(end_token_ids)
        self.max_tokens = params.max_tokens if max_tokens is None else min(
            params.max_tokens, max_tokens)
        if self.max_tokens < 1:
            raise InvalidInputError("the prompt leaves no room under max_model_len for a "
                                    "generated token; shorten it or raise max_model_len.",
                                    param="max_tokens")
        self._beams = [_Beam((), torch.zeros((), dtype=torch.float32))]
        self._finished: list[_Finished] = []
        self.done = False

    @property
    def running(self) -> list[tuple[int, ...]]:
        return [] if self.done else [beam.tokens for beam in self._beams]

    def advance(self, candidates: Sequence[Sequence[tuple[int, float]]]) -> None:
        params, width = self.params, self.params.beam_width
        if self.done or len(candidates) != len(self._beams):
            raise ValueError(f"{len(candidates)} candidate lists for {len(self._beams)} "
                             f"running beams (done: {self.done})")
        length = len(self._beams[0].tokens) + 1  # of every continuation
        scored = []  # (cumulative log-probability, beam, rank, token)
        for b, (beam, top) in enumerate(zip(self._beams, candidates, strict=True)):
            if len(top) < self.k:
                raise ValueError(f"{len(top)} candidates for a beam, {self.k} wanted")
            sums = beam.logprob + torch.tensor([lp for _, lp in top[:self.k]],
                                               dtype=torch.float32)
            scored += [(sums[r], b, r, token) for r, (token, _) in enumerate(top[:self.k])]
        # The best k of every beam's continuations, ties in beam and rank order.
        scored.sort(key=lambda c: (-float(c[0]), c[1], c[2]))
        kept = scored[:self.k]
        ends = [length == self.max_tokens or token in self.end_token_ids
                for _, _, _, token in kept]
        # Of the best beam_width, those that ended join the finished (transformers adds a
        # continuation outside them only to keep beam_width running).
        penalty = length ** params.length_penalty
        new = [_Finished(self._beams[b].tokens + (token,), float(s), s / penalty)
               for rank, ((s, b, _, token), end) in enumerate(zip(kept, ends, strict=True))
               if end and rank < width]
        merged = self._finished + new
        merged.sort(key=lambda f: -float(f.score))  # stable: earlier finishers first on ties
        self._finished = merged[:width]
        going = [(s, b, token) for (s, b, _, token), end in zip(kept, ends, strict=True)
                 if not end][:width]
        self._beams = [_Beam(self._beams[b].tokens + (token,), s) for s, b, token in going]
        self.done = self._stops(length, all(ends))

    def _stops(self, length: int, all_ended: bool) -> bool:
        params = self.params
        if all_ended or not self._beams:
            return True
        if len(self._finished) < params.beam_width:
            return False
        if params.early_stopping is True:
            return True
        hypothetical = length
        if params.early_stopping == "never" and params.length_penalty > 0:
            hypothetical = self.max_tokens
        best_running = self._beams[0].logprob / hypothetical ** params.length_penalty
        worst_finished = min(float(f.score) for f in self._finished)
        return not float(best_running) > worst_finished

    def sequences(self) -> list[BeamSearchSequence]:
        """The finished sequences, best first (text left empty: the driver detokenizes)."""
        return [BeamSearchSequence(
            list(f.tokens), f.logprob, float(f.score),
            "stop" if f.tokens[-1] in self.end_token_ids else "length")
            for f in self._finished]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
