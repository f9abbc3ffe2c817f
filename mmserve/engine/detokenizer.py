"""Incremental detokenization and stop strings."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text without re-decoding all of it each step.

    Text is released only once it no longer ends in an incomplete UTF-8 sequence, and held
    back by up to ``len(longest stop string) - 1`` characters so that a stop string is never
    streamed partially before it is recognised.
    """

    def __init__(self, tokenizer, stop: list[str], min_tokens: int = 0,
                 skip_special_tokens: bool = True, include_stop_str: bool = False) -> None:
        """``skip_special_tokens``: leave special tokens' text out (vLLM's default);
        ``include_stop_str``: a stop string found stays at the end of the text."""
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str = include_stop_str
        # Stop strings are looked for once more than this many tokens are added
        # (``min_tokens``, as vLLM): in the text the token after those adds, and after.
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []  # what Python-level decoding reads (no Rust stream)
        self.text = ""  # everything decoded so far
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped = False
        self._emitted = 0
        # A Rust tokenizer decodes the stream itself, one call a token (twice as fast as two
        # Python-level decodes of the last few tokens, which every step pays per request).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = (DecodeStream(skip_special_tokens=skip_special_tokens)
                        if self._backend else None)

    def add(self, token_id: int) -> None:
        """Append one token; sets ``stopped`` when a stop string appears (text cut before it,
        or after it with ``include_stop_str``)."""
        self.num_tokens += 1
        if self._stream is not None:  # the stream keeps the ids it needs itself
            piece = self._stream.step(self._backend, token_id)
            if piece:
                start = len(self.text)
                self.text += piece
                if self.stop:
                    self._check_stop(start)
            return
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(self.token_ids[self._prefix_offset:self._read_offset],
                        skip_special_tokens=skip)
        full = decode(self.token_ids[self._prefix_offset:], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            start = len(self.text)
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            self._check_stop(start)

    def _check_stop(self, new_from: int) -> None:
        if self.num_tokens <= self.min_tokens:
            return
        for s in self.stop:
            idx = self.text.find(s, max(0, new_from - len(s) + 1))
            if idx != -1:
                self.text = self.text[:idx + len(s) if self.include_stop_str else idx]
                self.stopped = True
                return

    def take_new_text(self, final: bool) -> str:
        """Text not yet handed out; keeps a possible partial stop string unless ``final``."""
        end = len(self.text) if final or self.stopped else max(
            self._emitted, len(self.text) - self.holdback)
        new = self.text[self._emitted:end]
        self._emitted = end
        return new
