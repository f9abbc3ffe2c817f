"""Structured output: constraints (JSON schemas, any JSON object, regexes, choices, EBNF
grammars) compiled by xgrammar, and each constrained request's matcher, which says which
tokens the request may sample next and follows the ones it did.

Grammars compile where requests are made (``LLMEngine.process_request``, which the server runs
on its own threads, never on the stepping thread), once per distinct constraint: the compiler
caches what it compiled, by source. A constraint that does not compile is refused there, with
xgrammar's reason, before the request reaches the engine. (With the engine in a process of its
own, the front end compiles to refuse, and the core's thread that reads requests compiles its
own copy, from its own cache, before the stepping thread sees the request.) Matchers live on
the stepping thread: before each step the engine fills the bitmask rows of the constrained
requests that sample, the runner masks their logits (``sampler.apply_token_bitmasks``), and
after it each matcher accepts the sampled token; a request whose grammar has ended is
finished.

JSON comes out in one line, with one space after each ``,`` and ``:`` (no free whitespace:
small models given the choice can emit spaces until ``max_tokens``).
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import torch
import xgrammar

from mmserve.errors import InvalidInputError
from mmserve.sampling_params import StructuredOutputs

# xgrammar prefixes its errors with a time and a source location: "[08:46:43] file.cc:820: ".
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")
# Compiled grammars kept for reuse, least recently used dropped first: clients sending ever new
# schemas cost this much memory at most.
CACHE_LIMIT_BYTES = 256 << 20
_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
               "choice": "choice", "grammar": "grammar"}


class GrammarCompiler:
    """Compiles ``StructuredOutputs`` for one tokenizer and vocabulary, from any thread. The
    tokenizer's vocabulary is read once, at the first constrained request."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 max_threads: int = 4) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._max_threads = max_threads
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compile(self, constraint: StructuredOutputs) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``constraint``; ``InvalidInputError`` saying why not."""
        compiler = self._get()
        kind, source = constraint.key
        try:
            if kind == "json":
                compiled = compiler.compile_grammar(json_schema_grammar(source))
            elif kind == "json_object":  # an object, as OpenAI's json_object promises
                compiled = compiler.compile_json_schema('{"type": "object"}',
                                                        any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(source)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(constraint.choice or []))
            else:
                compiled = compiler.compile_grammar(source)
        except Exception as e:  # noqa: BLE001 (xgrammar raises RuntimeError and its own)
            reason = _LOG_PREFIX.sub("", str(e).strip()).strip() or type(e).__name__
            raise InvalidInputError(
                f"the {_KIND_NAMES[kind]} of structured_outputs cannot be used: {reason}",
                param="structured_outputs") from None
        first = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(first)
        if not bool(first.any()):  # not even a stop token: it matches no text at all
            raise InvalidInputError(
                f"the {_KIND_NAMES[kind]} of structured_outputs matches no text: no token can "
                "start it (a rule that only refers to itself never ends).",
                param="structured_outputs")
        return compiled

    def _get(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=self._max_threads, cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler


# xgrammar 0.2.8 writes the characters of a string with maxLength as [^"\\\r\n], which
# lets other control characters through (JSON parsers refuse a raw U+001E in a string); its
# unbounded strings exclude them all, as JSON requires.
_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\"\\\x00-\x1f]'


def json_schema_grammar(schema: str) -> str:
    """The EBNF grammar of a JSON schema's documents, in one line (see the module's notes),
    with strings of bounded length that hold no raw control character."""
    grammar = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))
    return grammar.replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (JSON's string escapes are
    the grammar's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Matchers:
    """The grammar matchers of the engine's constrained requests, by request id."""

    def __init__(self) -> None:
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, request_id: str, grammar: xgrammar.CompiledGrammar) -> None:
        self._matchers[request_id] = xgrammar.GrammarMatcher(grammar)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def bitmasks(self, request_ids: list[str], vocab_size: int) -> list[torch.Tensor | None]:
        """For each request, the packed bitmask of the tokens it may sample next (int32
        words, token ``32 * i + j`` allowed where bit ``j`` of word ``i`` is set), or None
        for a request without a grammar."""
        constrained = [rid for rid in request_ids if rid in self._matchers]
        if not constrained:
            return [None] * len(request_ids)
        words = xgrammar.allocate_token_bitmask(len(constrained), vocab_size)
        rows = {}
        for i, rid in enumerate(constrained):
            self._matchers[rid].fill_next_token_bitmask(words, i)
            rows[rid] = words[i]
        return [rows.get(rid) for rid in request_ids]

    def accept(self, request_id: str, token: int) -> tuple[bool, bool]:
        """Feed a sampled token to the request's matcher: (accepted, the grammar has ended)."""
        matcher = self._matchers[request_id]
        if not matcher.accept_token(token):
            return False, False
        return True, matcher.is_terminated()
