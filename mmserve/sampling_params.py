"""Per-request sampling parameters, validated when a request is made.

Every limit here exists so that one request cannot hurt the others: a temperature so small
that ``logits / temperature`` overflows to NaN, a seed the generator cannot take, or thousands
of stop strings that every detokenization step must search would fail or slow the engine
step that the request shares with everyone else.
"""

from __future__ import annotations

import json as _json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mmserve.config import POOLING_TYPES
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
# Completions of one prompt (``n``): OpenAI's cap.
MAX_N = 128
# Tokens ``logit_bias`` may name, and how far it may move one (OpenAI's range, where -100
# and 100 in effect ban and force a token).
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_LOGIT_BIAS = 100.0
# Tokens ``allowed_token_ids`` may name (a label set, digits, the tokens of some choices): as
# ``logit_bias``'s, each step sends them to the device for each row that names them.
MAX_ALLOWED_TOKEN_IDS = 1024
# ``bad_words`` (vLLM's): each step looks for every word's tokens but the last at the end of
# the output, on the device. Bound their number, their text, and their tokens (the output's
# last ``MAX_BAD_WORD_TOKENS - 1`` tokens are what the device keeps to look at).
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_CHARS = 4096  # all words together
MAX_BAD_WORD_TOKENS = 16
# presence_penalty and frequency_penalty: OpenAI's range.
MAX_PENALTY = 2.0
# repetition_penalty divides or multiplies a logit: bounded so that neither overflows nor
# reaches 0 for ordinary logits.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


# A grammar is compiled once per distinct constraint and held in a cache: bound its source.
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 256
# Levels of JSON objects and arrays in a schema. xgrammar's conversion of a schema takes time
# that grows with the cube of its nesting (0.05 s at 129 levels, 16 s at 941), on a thread
# other requests' preprocessing shares; schemas written for real use nest a few levels.
MAX_SCHEMA_DEPTH = 64

# What a request's step outputs hold (``SamplingParams.output_kind``), vLLM's three kinds.
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass
class StructuredOutputs:
    """A constraint on the generated text, exactly one of (vLLM's names): ``json``, a JSON
    schema (a dict, or its JSON text); ``json_object``, any JSON object; ``regex``;
    ``choice``, one of these strings; ``grammar``, an EBNF grammar in xgrammar's (GBNF)
    dialect. Sources are bounded (``MAX_GRAMMAR_CHARS``, ``MAX_CHOICES``); whether one
    compiles is checked when the request is made, and an error names what is wrong."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        def bad(message: str) -> InvalidInputError:
            return InvalidInputError(message, param="structured_outputs")

        kinds = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if not isinstance(self.json_object, bool):
            raise bad(f"json_object must be a boolean, got {_short(self.json_object)}.")
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise bad("give exactly one of json, json_object, regex, choice and grammar, got "
                      f"{', '.join(kinds) or 'none'}.")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = _json.loads(self.json)
                except RecursionError:
                    raise bad(f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels "
                              "deep.") from None
                except ValueError as e:
                    raise bad(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(self.json, dict):
                raise bad("the JSON schema must be a JSON object (a dict).")
            if json_nesting(self.json, MAX_SCHEMA_DEPTH + 1) > MAX_SCHEMA_DEPTH:
                raise bad(f"the JSON schema nests objects and arrays more than "
                          f"{MAX_SCHEMA_DEPTH} levels deep; flatten it (a definition under "
                          "$defs, referenced with $ref, can be used at any depth).")
            if len(_json.dumps(self.json)) > MAX_GRAMMAR_CHARS:
                raise bad(f"the JSON schema is over {MAX_GRAMMAR_CHARS} characters.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value
                                      or len(value) > MAX_GRAMMAR_CHARS):
                raise bad(f"{name} must be a non-empty string of at most {MAX_GRAMMAR_CHARS} "
                          "characters.")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise bad("choice must be a non-empty list of non-empty strings.")
            if len(self.choice) > MAX_CHOICES or sum(map(len, self.choice)) > MAX_GRAMMAR_CHARS:
                raise bad(f"choice takes at most {MAX_CHOICES} strings of "
                          f"{MAX_GRAMMAR_CHARS} characters in all.")
            self.choice = list(self.choice)

    @property
    def key(self) -> tuple[str, str]:
        """The constraint as (kind, canonical source): what compiled grammars are cached by."""
        if self.json is not None:  # key order kept: properties come out in schema order
            return "json", _json.dumps(self.json)
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json.dumps(self.choice)
        return "grammar", self.grammar or ""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop.

    ``temperature == 0`` is greedy decoding; otherwise it is at least ``MIN_TEMPERATURE``.
    ``top_k`` 0 or -1 and ``top_p == 1`` disable those filters. ``n``: completions of the
    prompt (1 to ``MAX_N``), which share its prefill and its images' encoder outputs; with a
    ``seed``, completion ``i`` samples with ``seed + i``. ``seed`` (a 64-bit integer)
    makes a sampled request reproducible regardless of what it is batched with. At most
    ``MAX_STOP_STRINGS`` stop strings of ``MAX_STOP_CHARS`` characters in all, and
    ``MAX_STOP_TOKEN_IDS`` stop token ids. ``logprobs``: None, or return each generated
    token's log-probability and that many most likely alternatives (0 to ``MAX_LOGPROBS``),
    computed, as vLLM does by default, from the model's logits before temperature, top-k and
    top-p. ``prompt_logprobs``: the same for every prompt token after the first (in the
    request's final output); such a request computes its whole prompt, never taking blocks from
    the prefix cache. ``structured_outputs``: constrain the text to a JSON schema, a regex, a
    choice or a grammar (``StructuredOutputs``, or a dict of its fields).
    ``min_p`` (0 to 1, 0 is off): drop the tokens whose probability (after temperature) is below
    ``min_p`` times the most likely token's. ``presence_penalty`` and ``frequency_penalty`` (-2
    to 2, OpenAI's): subtract from a token's logit this much if it was generated before, and
    this much for each time it was. ``repetition_penalty`` (0.01 to 100, 1 is off; as
    transformers' and vLLM's): a token of the prompt or of the output so far has its logit
    divided by it where positive, multiplied where negative. ``logit_bias``: token id -> a
    number from -100 to 100 added to its logit (at most ``MAX_LOGIT_BIAS_TOKENS`` of them).
    ``allowed_token_ids`` (vLLM's): only these tokens may be picked (at most
    ``MAX_ALLOWED_TOKEN_IDS``). ``bad_words`` (vLLM's): words the output may not contain: a
    word's last token cannot be picked where the output ends with its other tokens (a word
    of one token, never), each word as written and after a space (up to ``MAX_BAD_WORDS``
    words of at most ``MAX_BAD_WORD_TOKENS`` tokens); a ban that would leave no token
    (beside ``allowed_token_ids``, or an output constraint) is lifted for that step.
    ``truncate_prompt_tokens`` (vLLM's): only the prompt's last this many tokens are read
    (-1: ``max_model_len``), where it has more; its images must be among them.
    ``priority`` (vLLM's, for an engine scheduling by priority only): lower is admitted
    first, and preempted last. ``min_tokens``: the end-of-sequence token and
    ``stop_token_ids`` cannot be sampled, and stop strings do not stop, until this many
    tokens are generated (at most ``max_tokens``). All of these apply to greedy decoding as
    well; log-probabilities stay those of the model's logits. ``skip_special_tokens`` (default
    on) leaves special tokens' text out of ``text``; ``include_stop_str_in_output`` keeps the
    stop string that ended the text at its end (both vLLM's). ``return_embedding`` (with
    ``max_tokens=1``, ``n=1``; what ``LLM.embed`` sends): the output's ``embedding`` is the
    final hidden state of the prompt's last token (last-token pooling, as embedding models
    built on a decoder, E5-V and VLM2Vec among them, read a prompt), not normalized;
    ``pooling`` ``"mean"`` makes it the mean of every prompt token's, ``"cls"`` the first
    token's (``POOLING_TYPES``; the engine sets it from ``EngineConfig.pooling_type``).
    ``output_kind`` (``OUTPUT_KINDS``, as vLLM's ``RequestOutputKind``): what the engine's
    step outputs for the request hold. ``cumulative``: everything generated so far, and in
    ``new_text`` / ``new_token_ids`` what the step added. ``delta``: only what the step added,
    in every field (``text``, ``token_ids`` and ``logprobs`` too), so that a step costs the
    same however long the output grows. ``final_only``: no output until the request
    finishes, then everything (``LLM.generate`` runs every request so, since it returns only
    final outputs). A value out of range raises ``InvalidInputError`` naming the parameter.
    """

    max_tokens: int = 16
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None
    output_kind: str = "cumulative"
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_embedding: bool = False
    pooling: str = "last"
    # Whether the logits the next token is picked from (greedily too) are the model's
    # changed: by logit_bias, a penalty or min_tokens (set from them: the sampler's test,
    # which most rows pass in one read).
    adjusts_logits: bool = field(default=False, init=False, repr=False, compare=False)
    # The token ids ``min_tokens`` holds back: the end-of-sequence token (unless
    # ``ignore_eos``) and ``stop_token_ids``. Set when a request is made
    # (``with_end_tokens``): the end token is the checkpoint's.
    min_tokens_blocked: tuple[int, ...] = field(default=(), init=False, repr=False,
                                                compare=False)
    # ``bad_words`` as token sequences (``bad_words_token_ids``), set when a request is made
    # (``with_bad_words``): the tokenizer is the checkpoint's.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), init=False,
                                                             repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(param: str, message: str) -> InvalidInputError:
            return InvalidInputError(message, param=param)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"n must be an integer from 1 to {MAX_N} (completions of the "
                      f"prompt), got {_short(self.n)}.")
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
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "return_embedding"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"{name} must be a boolean, got {_short(getattr(self, name))}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"{name} must be None or an integer from 0 to {MAX_LOGPROBS} "
                          f"(alternatives per token), got {_short(value)}.")
        if self.pooling not in POOLING_TYPES or (self.pooling != "last"
                                                 and not self.return_embedding):
            raise bad("pooling", f"pooling must be one of {', '.join(POOLING_TYPES)}, and "
                      f"'mean' or 'cls' only with return_embedding; got "
                      f"{_short(self.pooling)}.")
        if self.return_embedding and (self.max_tokens != 1 or self.n != 1):
            raise bad("return_embedding", "return_embedding reads the prompt once: send it "
                      f"with max_tokens=1 and n=1 (got {_short(self.max_tokens)} and "
                      f"{_short(self.n)}), as LLM.embed does.")
        if self.output_kind not in OUTPUT_KINDS:
            raise bad("output_kind", f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, "
                      f"got {_short(self.output_kind)}.")
        self._check_logits_fields()
        so = self.structured_outputs
        if isinstance(so, dict):
            so = self.structured_outputs = StructuredOutputs(**so)
        if so is not None and not isinstance(so, StructuredOutputs):
            raise bad("structured_outputs", "structured_outputs must be a StructuredOutputs "
                      f"or a dict of its fields, got {_short(so)}.")

    def _check_logits_fields(self) -> None:
        def bad(param: str, message: str) -> InvalidInputError:
            return InvalidInputError(message, param=param)

        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"min_p must be a number from 0 to 1 (0 is off), got "
                      f"{_short(self.min_p)}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise bad(name, f"{name} must be a number from {-MAX_PENALTY:g} to "
                          f"{MAX_PENALTY:g}, got {_short(value)}.")
        rep = self.repetition_penalty
        if not _is_number(rep) or not MIN_REPETITION_PENALTY <= rep <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"repetition_penalty must be a number from "
                      f"{MIN_REPETITION_PENALTY:g} to {MAX_REPETITION_PENALTY:g} (1 is off), "
                      f"got {_short(rep)}.")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise bad("logit_bias", "logit_bias must map token ids to numbers, got "
                          f"{_short(bias)}.")
            if len(bias) > MAX_LOGIT_BIAS_TOKENS:
                raise bad("logit_bias", f"logit_bias may name at most {MAX_LOGIT_BIAS_TOKENS} "
                          f"tokens, got {len(bias)}.")
            for token, value in bias.items():
                if not _is_int(token) or token < 0:
                    raise bad("logit_bias", f"logit_bias's keys must be token ids (integers "
                              f">= 0), got {_short(token)}.")
                if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    raise bad("logit_bias", f"logit_bias's values must be numbers from "
                              f"{-MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}, got "
                              f"{_short(value)} for token {token}.")
            self.logit_bias = {t: float(v) for t, v in bias.items() if v} or None
        allowed = self.allowed_token_ids
        if allowed is not None:
            if (not isinstance(allowed, (list, tuple)) or not allowed
                    or not all(_is_int(t) and t >= 0 for t in allowed)):
                raise bad("allowed_token_ids", "allowed_token_ids must be a non-empty list of "
                          "token ids (integers >= 0), or None.")
            if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
                raise bad("allowed_token_ids", f"allowed_token_ids may name at most "
                          f"{MAX_ALLOWED_TOKEN_IDS} tokens, got {len(allowed)}.")
            self.allowed_token_ids = sorted(set(allowed))
        self.bad_words = self._check_bad_words(self.bad_words)
        keep = self.truncate_prompt_tokens
        if keep is not None and (not _is_int(keep) or not (keep >= 1 or keep == -1)):
            raise bad("truncate_prompt_tokens", "truncate_prompt_tokens must be an integer >= 1 "
                      f"(the prompt's last tokens to keep) or -1 (max_model_len), got "
                      f"{_short(keep)}.")
        if not _is_int(self.priority) or not MIN_SEED <= self.priority < 2**63:
            raise bad("priority", f"priority must be a 64-bit integer (lower runs first under "
                      f"--scheduling-policy priority), got {_short(self.priority)}.")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"min_tokens must be an integer from 0 to max_tokens "
                      f"({self.max_tokens}), got {_short(self.min_tokens)}.")
        self.adjusts_logits = (bool(self.logit_bias) or self.allowed_token_ids is not None
                               or self.uses_history)

    @property
    def penalizes(self) -> bool:
        """Whether a presence, frequency or repetition penalty is on."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def follows_tokens(self) -> bool:
        """Whether the device keeps this request's tokens before: for a penalty, or to find
        where the output ends with the first tokens of a bad word."""
        return self.penalizes or bool(self.bad_words)

    @property
    def uses_history(self) -> bool:
        """Whether the logits depend on the tokens before (penalties, ``min_tokens``,
        ``bad_words``)."""
        return self.follows_tokens or bool(self.min_tokens)

    def with_end_tokens(self, eos_token_ids: Sequence[int]) -> SamplingParams:
        """These parameters for a request of a checkpoint whose end-of-sequence tokens are
        ``eos_token_ids``: what ``min_tokens`` holds back is known (a copy where it
        changes)."""
        blocked = tuple(dict.fromkeys(
            ([] if self.ignore_eos else list(eos_token_ids))
            + self.stop_token_ids)) if self.min_tokens else ()
        if blocked == self.min_tokens_blocked:
            return self
        params = self._copy()
        params.min_tokens_blocked = blocked
        return params

    def with_bad_words(self, encode: Callable[[str], list[int]],
                       vocab_size: int) -> SamplingParams:
        """These parameters with ``bad_words`` as the token sequences ``encode`` (the
        checkpoint's tokenizer, without special tokens) gives (a copy where there are
        some). As vLLM, each word is banned as written (leading spaces dropped) and after a
        space, where the space makes a different first token and as many tokens (a word
        that starts a line, and one inside a sentence). A sequence with a token outside the
        model's ``vocab_size`` (which it cannot generate) needs no ban."""
        if not self.bad_words:
            return self
        found: dict[tuple[int, ...], None] = {}
        for i, word in enumerate(self.bad_words):
            plain = tuple(encode(word.lstrip()))
            spaced = tuple(encode(" " + word.lstrip()))
            forms = [plain] if plain else []
            if spaced and (not plain or spaced[0] != plain[0] and len(spaced) == len(plain)):
                forms.append(spaced)
            for tokens in forms:
                if len(tokens) > MAX_BAD_WORD_TOKENS:
                    raise InvalidInputError(
                        f"bad_words[{i}] is {len(tokens)} tokens; a bad word may be at most "
                        f"{MAX_BAD_WORD_TOKENS}: ban a shorter part of it.", param="bad_words")
                found[tokens] = None
        params = self._copy()
        params.bad_words_token_ids = tuple(w for w in found if max(w) < vocab_size)
        return params

    def _copy(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes``, and with what was set when its request was made."""
        params = replace(self, **changes)
        params.min_tokens_blocked = self.min_tokens_blocked
        params.bad_words_token_ids = self.bad_words_token_ids
        return params

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

    @staticmethod
    def _check_bad_words(words: object) -> list[str] | None:
        if words is None:
            return None
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
            raise InvalidInputError("bad_words must be a list of strings.", param="bad_words")
        if len(words) > MAX_BAD_WORDS:
            raise InvalidInputError(f"at most {MAX_BAD_WORDS} bad_words are allowed, got "
                                    f"{len(words)}.", param="bad_words")
        if sum(len(w) for w in words) > MAX_BAD_WORDS_CHARS:
            raise InvalidInputError(
                f"the bad_words have {sum(len(w) for w in words)} characters in all; at most "
                f"{MAX_BAD_WORDS_CHARS} are allowed.", param="bad_words")
        for i, word in enumerate(words):
            if not word.strip():
                raise InvalidInputError(f"bad_words[{i}] is {'empty' if not word else 'blank'}"
                                        "; send words with some text.", param="bad_words")
            try:
                word.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidInputError(
                    f"bad_words[{i}] has an invalid character (a lone UTF-16 surrogate at "
                    f"position {e.start}); send valid Unicode text.", param="bad_words") from None
        return list(words) or None

    def child(self, index: int) -> SamplingParams:
        """The parameters of completion ``index`` of ``n``: one completion, and with a seed,
        a stream of its own (``seed + index``, wrapped into the 64-bit range), so that the
        completions differ and each reproduces. The first alone computes ``prompt_logprobs``
        (the prompt's, the same for all), so the others read the prompt from the prefix
        cache."""
        seed = self.seed
        if seed is not None:
            seed += index
            if seed > MAX_SEED:
                seed -= 2**64
        return self._copy(n=1, seed=seed, prompt_logprobs=None if index else self.prompt_logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def json_nesting(value: object, limit: int) -> int:
    """Levels of dicts and lists in ``value`` (a JSON document), counted up to ``limit``: one
    level at a time, without recursion (a client's document may nest past Python's stack)."""
    depth, level = 0, [value]
    while depth < limit:
        level = [v for v in level if isinstance(v, (dict, list))]
        if not level:
            break
        depth += 1
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
