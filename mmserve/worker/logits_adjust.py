"""The changes requests ask of the logits before a token is picked: ``allowed_token_ids``,
``bad_words``, ``logit_bias``, the presence, frequency and repetition penalties, and
``min_tokens``.

The penalties, bad words and ``min_tokens`` depend on the tokens before, which the runner
keeps on the device for the requests that use them (``TokenHistory``): each sampled token is
counted there from the step's token tensor, so a step scheduled ahead of its sampling
(asynchronous scheduling) adjusts its logits without waiting for the tokens to reach Python.
Requests that ask for none of this cost a read of ``SamplingParams.adjusts_logits`` a row,
and nothing on the device.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.kernels.transfer import tensor_on, to_device_all
from mmserve.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams

# The generated tokens before the last that the device keeps of a request with bad words:
# enough to find where the output ends with a bad word's tokens but its last.
TAIL = MAX_BAD_WORD_TOKENS - 1
# A position of a bad word's pattern that any token matches (left of its tokens).
ANY = -2
# Rows a GPU penalizes at once: a dozen [rows, vocab] temporaries of up to 4 bytes an entry,
# 200 MB at a time for a vocabulary of 152,064 tokens.
DENSE_ROWS = 32


@dataclass
class BadWords:
    """A request's bad words as arrays, made once when it is followed: each word's last
    token (``last``, ``[W]``), and for the words of more than one token (their positions
    in ``last``, ``begun``) the tokens before it, right-aligned in ``TAIL`` with ``ANY``
    before them (``patterns``, ``[len(begun), TAIL]``), and the request's slot."""

    last: np.ndarray
    begun: np.ndarray
    patterns: np.ndarray
    slot: int

    @classmethod
    def of(cls, words: tuple[tuple[int, ...], ...], slot: int) -> BadWords:
        begun = [k for k, w in enumerate(words) if len(w) > 1]
        patterns = np.full((len(begun), TAIL), ANY, dtype=np.int64)
        for row, k in enumerate(begun):
            before = words[k][:-1]
            patterns[row, TAIL - len(before):] = before
        return cls(np.array([w[-1] for w in words], dtype=np.int64),
                   np.array(begun, dtype=np.int64), patterns, slot)


class TokenHistory:
    """For each running request whose sampling depends on its tokens before
    (``SamplingParams.uses_history``): how many times it generated each token, which tokens
    it has seen (generated, or in its prompt where a repetition penalty counts those), its
    last ``TAIL`` generated tokens (where a bad word may have begun), and how many it
    generated.

    Rows of two ``[slots, vocab]`` tensors on the device (int32 counts, boolean seen) and a
    ``[slots, TAIL]`` one (the last tokens, -1 before the first), a slot a request with a
    penalty or bad words (``SamplingParams.follows_tokens``), reused once its request
    finishes; the memory plan counts as many as requests run at once (``profiled``), and the
    first such request takes them all. A request with ``min_tokens`` alone needs only its
    count."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self._counts: torch.Tensor | None = None  # [slots, vocab] int32: generated tokens
        self._seen: torch.Tensor | None = None  # [slots, vocab] bool: tokens seen
        self._tail: torch.Tensor | None = None  # [slots, TAIL] long: the last tokens
        self._bad_words: dict[str, BadWords] = {}  # a request's, as arrays (made once)
        self.num_generated: dict[str, int] = {}
        self.planned_slots = 0  # the rows the memory plan counted (``profiled``)
        # Penalize the seen tokens alone, found on the host (the CPU's way), or whole rows
        # (a GPU's, which never waits to learn how many tokens changed).
        self.sparse = device.type == "cpu"

    def __len__(self) -> int:
        return len(self.num_generated)

    @property
    def followed(self) -> list[str]:
        return list(self.num_generated)

    def has_slot(self, request_id: str) -> bool:
        """Whether the request has a slot (a penalty, or bad words)."""
        return request_id in self._slot

    def follow(self, request_id: str, params: SamplingParams, token_ids: list[int],
               num_prompt_tokens: int) -> None:
        """Follow the request from its tokens so far, ``token_ids`` (the first
        ``num_prompt_tokens`` its prompt's), counted afresh: at its admission (after a
        preemption too), and after a failed step whose token may have been counted. Only a
        request with a penalty or bad words takes a slot; one with ``min_tokens`` alone, a
        count."""
        self.num_generated[request_id] = len(token_ids) - num_prompt_tokens
        if not params.follows_tokens:
            return
        slot = self._slot_of(request_id)
        if params.bad_words_token_ids:
            self._bad_words[request_id] = BadWords.of(params.bad_words_token_ids, slot)
        assert self._counts is not None and self._seen is not None and self._tail is not None
        self._counts[slot].zero_()
        self._seen[slot].zero_()
        vocab, device = self.vocab_size, self.device
        last = token_ids[num_prompt_tokens:][-TAIL:]
        self._tail[slot] = tensor_on([-1] * (TAIL - len(last)) + last, torch.long, device)
        output = [t for t in token_ids[num_prompt_tokens:] if 0 <= t < vocab]
        if output:
            index = tensor_on(output, torch.long, device)
            self._counts[slot].index_add_(0, index, torch.ones(len(output), dtype=torch.int32,
                                                              device=device))
            self._seen[slot, index] = True
        if params.repetition_penalty != 1.0:
            prompt = [t for t in token_ids[:num_prompt_tokens] if 0 <= t < vocab]
            if prompt:
                self._seen[slot, tensor_on(prompt, torch.long, device)] = True

    def record(self, sampled: Mapping[str, tuple[torch.Tensor, int]]) -> None:
        """Count each followed request's token of a step that has run: ``sampled`` maps a
        request to the step's token tensor on the device and its row there."""
        if not self.num_generated:
            return
        by_tensor: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        slot_of = self._slot
        for rid in self.num_generated:
            where = sampled.get(rid)
            if where is None:
                continue
            self.num_generated[rid] += 1
            slot = slot_of.get(rid)
            if slot is not None:
                tokens, row = where
                _, rows, slots = by_tensor.setdefault(id(tokens), (tokens, [], []))
                rows.append(row)
                slots.append(slot)
        for tokens, rows, slots in by_tensor.values():
            assert self._counts is not None and self._seen is not None and self._tail is not None
            at = (tensor_on(slots, torch.long, self.device),
                  tokens.index_select(0, tensor_on(rows, torch.long, self.device)))
            self._counts.index_put_(at, torch.ones(len(rows), dtype=torch.int32,
                                                   device=self.device), accumulate=True)
            self._seen[at] = True
            shifted = self._tail.index_select(0, at[0]).roll(-1, 1)
            shifted[:, -1] = at[1]
            self._tail[at[0]] = shifted

    def drop(self, request_ids: list[str]) -> None:
        """Forget finished requests; their slots are reused, and the rows given back once
        no request has one."""
        for rid in request_ids:
            self._bad_words.pop(rid, None)
            if self.num_generated.pop(rid, None) is not None:
                slot = self._slot.pop(rid, None)
                if slot is not None:
                    self._free.append(slot)
        if not self._slot and self._counts is not None:
            self._counts = self._seen = self._tail = None
            self._free.clear()

    @contextmanager
    def profiled(self, slots: int) -> Iterator[None]:
        """The rows of ``slots`` requests (the most that run at once) held while the memory
        plan's profile run measures its peak, and then given back: the first request with a
        penalty takes that many at once, so what the plan counted is what they take."""
        self.planned_slots = slots
        held = (torch.zeros(slots, self.vocab_size, dtype=torch.int32, device=self.device),
                torch.zeros(slots, self.vocab_size, dtype=torch.bool, device=self.device),
                torch.zeros(slots, TAIL, dtype=torch.long, device=self.device))
        try:
            yield
        finally:
            del held

    def bad_words(self, request_id: str) -> BadWords:
        """The request's bad words, as arrays (it has some, and is followed)."""
        return self._bad_words[request_id]

    def tail(self, slots: torch.Tensor) -> torch.Tensor:
        """The last ``TAIL`` generated tokens of the requests in ``slots`` (a device tensor),
        oldest first, -1 where fewer were generated: ``[len(slots), TAIL]``."""
        assert self._tail is not None
        return self._tail.index_select(0, slots)

    @property
    def _capacity(self) -> int:
        return 0 if self._counts is None else self._counts.shape[0]

    def _slot_of(self, request_id: str) -> int:
        slot = self._slot.get(request_id)
        if slot is not None:
            return slot
        if not self._free:  # the planned rows, or more (a request ends as another starts)
            self._grow(max(self.planned_slots, 2 * self._capacity, 8))
        slot = self._free.pop()
        self._slot[request_id] = slot
        return slot

    def _grow(self, new: int) -> None:
        old = self._capacity
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        seen = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        tail = torch.full((new, TAIL), -1, dtype=torch.long, device=self.device)
        if old:
            counts[:old] = self._counts
            seen[:old] = self._seen
            tail[:old] = self._tail
        self._counts, self._seen, self._tail = counts, seen, tail
        self._free.extend(range(new - 1, old - 1, -1))

    def penalize(self, logits: torch.Tensor, rows: list[int], request_ids: list[str],
                 params: list[SamplingParams]) -> None:
        """The repetition, frequency and presence penalties of ``params`` applied, in place,
        to rows ``rows`` of ``logits``, those of the followed requests ``request_ids``.

        Only seen tokens change, and a penalty that is off changes nothing bit for bit
        (dividing or multiplying by 1, subtracting 0), so every row gets all three. With
        ``sparse`` only the seen tokens are read and written (found in one pass over the
        rows' flags), else whole rows are computed, ``DENSE_ROWS`` at a time (which bounds
        their temporaries); the results are the same."""
        step = len(rows) if self.sparse else DENSE_ROWS
        for start in range(0, len(rows), step):
            end = start + step
            self._penalize(logits, rows[start:end], request_ids[start:end], params[start:end])

    def _penalize(self, logits: torch.Tensor, rows: list[int], request_ids: list[str],
                  params: list[SamplingParams]) -> None:
        assert self._counts is not None and self._seen is not None
        device = self.device
        slots = tensor_on([self._slot[rid] for rid in request_ids], torch.long, device)
        row_index = tensor_on(rows, torch.long, device)
        penalty, frequency, presence = tensor_on(
            [[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
             [p.presence_penalty for p in params]], torch.float32, device)
        if self.sparse:  # (numpy finds the flags five times as fast as torch's nonzero)
            seen = np.flatnonzero(self._seen.index_select(0, slots).numpy())
            i, token = (torch.from_numpy(v) for v in np.divmod(seen, self.vocab_size))
            at = (row_index[i], token)
            y = logits[at]
            counts = self._counts[slots[i], token]
            penalty, frequency, presence = penalty[i], frequency[i], presence[i]
        else:
            at = row_index
            y = logits.index_select(0, row_index)
            counts = self._counts.index_select(0, slots)
            seen = self._seen.index_select(0, slots)
            penalty, frequency, presence = (penalty.unsqueeze(1), frequency.unsqueeze(1),
                                            presence.unsqueeze(1))
        repeated = torch.where(y > 0, y / penalty, y * penalty)
        repeated = repeated - frequency * counts - presence * (counts > 0)
        logits[at] = repeated if self.sparse else torch.where(seen, repeated, y)


def adjust_logits(logits: torch.Tensor, ids: list[str], params: list[SamplingParams],
                  history: TokenHistory, in_place: bool) -> torch.Tensor:
    """``logits`` (float32) as the rows' parameters change them: changed in place with
    ``in_place``, else a copy where any row asks for a change. Only ``allowed_token_ids``
    left finite, then ``bad_words``'s last tokens at -inf where the output ends with their
    others, then ``logit_bias`` added,
    ``min_tokens``'s tokens at -inf while too few tokens are generated, then the repetition
    penalty, then the frequency and presence penalties (vLLM's order). A grammar's bitmask is
    applied before: a row that ``min_tokens`` would leave no token (its grammar allows only
    the end) keeps its end tokens."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    out = logits if in_place else logits.clone()
    _keep_allowed(out, rows, params)
    _ban_bad_words(out, rows, ids, params, history)
    _add_bias(out, rows, params)
    _hold_back_end(out, rows, ids, params, history)
    followed = [i for i in rows if params[i].penalizes and history.has_slot(ids[i])]
    if followed:
        history.penalize(out, followed, [ids[i] for i in followed],
                         [params[i] for i in followed])
    return out


def _keep_allowed(x: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> None:
    """Every token but a row's ``allowed_token_ids`` at -inf, in place, in the rows ``rows``
    of ``x`` that name some."""
    held: list[int] = []
    at: list[int] = []
    tokens: list[int] = []
    for i in rows:
        allowed = params[i].allowed_token_ids
        if allowed is not None:
            held.append(i)
            at += [i] * len(allowed)
            tokens += allowed
    if not held:
        return
    device = x.device
    index = (tensor_on(at, torch.long, device), tensor_on(tokens, torch.long, device))
    kept = x[index]
    x[tensor_on(held, torch.long, device)] = float("-inf")
    x[index] = kept


def _ban_bad_words(x: torch.Tensor, rows: list[int], ids: list[str],
                   params: list[SamplingParams], history: TokenHistory) -> None:
    """In place, in the rows ``rows`` of ``x`` that have bad words: each word's last token at
    -inf where the row's output ends with the word's other tokens (a word of one token,
    always), as ``history`` keeps them on the device (no wait for the last step's tokens).
    A row that the bans could leave without a finite logit (one with ``allowed_token_ids``
    or an output constraint; any other loses at most ``2 * MAX_BAD_WORDS`` tokens) keeps
    what they took where they would."""
    found = [(i, history.bad_words(ids[i])) for i in rows if params[i].bad_words_token_ids]
    if not found:
        return
    at = np.concatenate([np.full(len(w.last), i) for i, w in found])  # each word's row
    last = np.concatenate([w.last for _, w in found])
    device = x.device
    ban = torch.full((len(at),), float("-inf"), device=device)
    starts = np.cumsum([0] + [len(w.last) for _, w in found[:-1]])
    begun = np.concatenate([w.begun + start for (_, w), start in zip(found, starts,
                                                                       strict=True)])
    if len(begun):
        slots = np.concatenate([np.full(len(w.begun), w.slot) for _, w in found])
        pattern, slots_on, begun_on = to_device_all(
            [torch.from_numpy(np.concatenate([w.patterns for _, w in found])),
             torch.from_numpy(slots), torch.from_numpy(begun)], device)
        tails = history.tail(slots_on)
        ended = ((tails == pattern) | (pattern == ANY)).all(-1)
        ban[begun_on] = torch.where(ended, float("-inf"), 0.0)
    index = tuple(to_device_all([torch.from_numpy(at), torch.from_numpy(last)], device))
    at_risk = [i for i, _ in found if params[i].allowed_token_ids is not None
               or params[i].structured_outputs is not None or len(history.bad_words(
                   ids[i]).last) >= x.shape[-1]]
    kept = x[index] if at_risk else None
    x.index_put_(index, ban, accumulate=True)  # (-inf, or 0: a token may end two words)
    if kept is not None:  # the rows at risk alone are looked at, once each
        position = {row: k for k, row in enumerate(at_risk)}
        dead = ~torch.isfinite(x.index_select(0, tensor_on(at_risk, torch.long, device))).any(-1)
        looked = [position.get(row, -1) for row in at.tolist()]
        dead = torch.cat([dead, dead.new_zeros(1)])[tensor_on(looked, torch.long, device)]
        x[index] = torch.where(dead, kept, x[index])


def _add_bias(x: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> None:
    """``logit_bias`` added to rows ``rows`` of ``x`` (one a ``params``), in place."""
    at: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for i in rows:
        bias = params[i].logit_bias
        if bias:
            at += [i] * len(bias)
            tokens += bias.keys()
            values += bias.values()
    if at:
        device = x.device
        index = (tensor_on(at, torch.long, device), tensor_on(tokens, torch.long, device))
        x[index] += tensor_on(values, torch.float32, device)  # (a row's tokens are distinct)


def _hold_back_end(x: torch.Tensor, rows: list[int], ids: list[str],
                   params: list[SamplingParams], history: TokenHistory) -> None:
    """The tokens ``min_tokens`` holds back at -inf, in place, in the rows ``rows`` of ``x``
    that have generated fewer than their ``min_tokens``."""
    held: list[int] = []  # the rows that hold tokens back
    at: list[int] = []  # each held-back token's row, as a position in ``held``
    tokens: list[int] = []
    vocab = x.shape[-1]
    for i in rows:
        p = params[i]
        if p.min_tokens and history.num_generated.get(ids[i], 0) < p.min_tokens:
            blocked = [t for t in p.min_tokens_blocked if t < vocab]
            at += [len(held)] * len(blocked)
            held.append(i)
            tokens += blocked
    if not at:
        return
    device = x.device
    held_rows, at_held = tensor_on(held, torch.long, device), tensor_on(at, torch.long, device)
    index = (held_rows[at_held], tensor_on(tokens, torch.long, device))
    kept = x[index]
    x[index] = float("-inf")
    # A row left without a finite logit (its grammar allows only the end) keeps them: the
    # held rows alone are looked at, once each.
    dead = ~torch.isfinite(x.index_select(0, held_rows)).any(-1)
    x[index] = torch.where(dead[at_held], kept, x[index])
