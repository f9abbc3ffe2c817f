"""Per-request sampling parameters, validated when a request is made.

Every limit here exists so that one request cannot hurt the others: a temperature so small
that ``logits / temperature`` overflows to NaN, a seed the generator cannot take, or thousands
of stop strings that every detokenization step must search would fail or slow the engine
step that the request shares with everyone else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mmserve.errors import InvalidInputError

# Below this (and above 0, which is greedy) logits / temperature overflows float32 for
# ordinary logits; vLLM uses the same floor.
MIN_TEMPERATURE = 1e-2
# torch.Generator.manual_seed takes any 64-bit value, signed or unsigned.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
# Stop strings are searched in the new text of every step: bound their number and size.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 4096  # all stop strings together
MAX_STOP_TOKEN_IDS = 64
# Alternatives per generated token that ``logprobs`` may ask for (OpenAI's and vLLM's cap).
MAX_LOGPROBS = 20


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop.

    ``temperature == 0`` is greedy decoding; otherwise it is at least ``MIN_TEMPERATURE``.
    ``top_k`` 0 or -1 and ``top_p == 1`` disable those filters. ``seed`` (a 64-bit integer)
    makes a sampled request reproducible regardless of what it is batched with. At most
    ``MAX_STOP_STRINGS`` stop strings of ``MAX_STOP_CHARS`` characters in all, and
    ``MAX_STOP_TOKEN_IDS`` stop token ids. ``logprobs``: None, or return each generated
    token's log-probability and that many most likely alternatives (0 to ``MAX_LOGPROBS``),
    computed, as vLLM does by default, from the model's logits before temperature, top-k and
    top-p. ``prompt_logprobs``: the same for every prompt token after the first (in the
    request's final output); such a request computes its whole prompt, never taking blocks from
    the prefix cache. A value out of range raises ``InvalidInputError`` naming the parameter.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        def bad(param: str, message: str) -> InvalidInputError:
            return InvalidInputError(message, param=param)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        t = self.temperature
        if not _is_number(t) or t < 0 or 0 < t < MIN_TEMPERATURE:
            raise bad("temperature", f"temperature must be 0 (greedy) or a finite number >= "
                      f"{MIN_TEMPERATURE:g}, got {t!r}.")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}.")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", f"top_k must be an integer >= 0 (0 or -1 disables it), got "
                      f"{self.top_k!r}.")
        self.top_k = max(self.top_k, 0)
        if self.seed is not None and (not _is_int(self.seed)
                                      or not MIN_SEED <= self.seed <= MAX_SEED):
            raise bad("seed", "seed must be an integer between -2**63 and 2**64 - 1, got "
                      f"{_short(self.seed)}.")
        self.stop = self._check_stop(self.stop)
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise bad("stop_token_ids", "stop_token_ids must be a list of token ids (integers "
                      ">= 0).")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are "
                      f"allowed, got {len(ids)}.")
        self.stop_token_ids = list(ids)
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", f"ignore_eos must be a boolean, got {self.ignore_eos!r}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"{name} must be None or an integer from 0 to {MAX_LOGPROBS} "
                          f"(alternatives per token), got {_short(value)}.")

    @staticmethod
    def _check_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise InvalidInputError("stop must be a string or a list of strings.", param="stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidInputError(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}.",
                param="stop")
        if sum(len(s) for s in stop) > MAX_STOP_CHARS:
            raise InvalidInputError(
                f"the stop strings have {sum(len(s) for s in stop)} characters in all; at most "
                f"{MAX_STOP_CHARS} are allowed.", param="stop")
        return [s for s in stop if s]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
