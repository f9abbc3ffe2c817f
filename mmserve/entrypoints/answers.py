"""Answers put back together from the engine's outputs, which hold only what each step added
(the server's requests run with ``output_kind`` ``delta``, so that a step costs the engine the
same however long the answers grow): each choice's text, tokens and log-probabilities, what a
stream has sent of them, and the usage OpenAI counts."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mmserve.entrypoints import openai_shapes as shapes
from mmserve.entrypoints import responses_protocol as responses
from mmserve.entrypoints.tool_call_readers import CallReader
from mmserve.outputs import RequestOutput
from mmserve.step import TokenLogprobs


def completion_ids(request_id: str, n: int) -> list[str]:
    """The engine request ids of a chat answer's ``n`` choices."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


class Answer:
    """One choice put back together from the engine's outputs: its text, tokens and
    log-probabilities so far, and which of them a stream's chunks have carried."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = None
        self.sent = 0  # tokens whose log-probabilities went out with an earlier chunk
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.last = out
        self.pieces.append(out.text)
        self.token_ids += out.token_ids
        if out.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += out.logprobs

    def usage_so_far(self) -> dict[str, Any]:
        """The choice's usage as of its last output (vLLM's ``continuous_usage_stats``)."""
        last = self.last
        assert last is not None
        return shapes.usage(last.num_prompt_tokens, len(self.token_ids), last.num_cached_tokens)

    def unsent(self) -> tuple[list[int], list[TokenLogprobs]]:
        """The tokens since the last call, and their log-probabilities."""
        start, self.sent = self.sent, len(self.token_ids)
        return self.token_ids[start:], (self.logprobs or [])[start:]

    def whole(self, last: RequestOutput) -> RequestOutput:
        """The choice's final output, everything in it."""
        return replace(last, text="".join(self.pieces), token_ids=self.token_ids,
                       logprobs=self.logprobs)


def without_generated(out: RequestOutput) -> RequestOutput:
    """``out`` with what the engine generated taken out: an echo of the prompt alone
    (``max_tokens`` 0), whose one token was sampled only because a request samples one."""
    return replace(out, text="", new_text="", token_ids=[], new_token_ids=[],
                   logprobs=None if out.logprobs is None else [],
                   finish_reason="length" if out.finished else None)


def deltas(reader: CallReader | None, out: RequestOutput) -> list[dict[str, Any]]:
    """A streamed chat delta's pieces: its new text, or what ``reader`` reads of it."""
    if reader is None:
        return [{"content": out.new_text}] if out.new_text else []
    return reader.feed(out.new_text) + (reader.finish() if out.finished else [])


def responses_usage(out: RequestOutput) -> dict[str, Any]:
    return responses.usage(out.num_prompt_tokens, len(out.token_ids), out.num_cached_tokens)


def per_prompt(outs: list[RequestOutput], n: int) -> list[list[RequestOutput]]:
    """Outputs in choice order (``n`` per prompt) grouped by prompt."""
    return [outs[i:i + n] for i in range(0, len(outs), n)]


def usage_of(prompts: list[list[RequestOutput]]) -> dict[str, Any]:
    """The usage of several prompts' completions together, as OpenAI counts it: each
    prompt's tokens (and those of it the prefix cache served) once, every completion's."""
    return shapes.usage(sum(outs[0].num_prompt_tokens for outs in prompts if outs),
                        sum(len(o.token_ids) for outs in prompts for o in outs),
                        sum(outs[0].num_cached_tokens for outs in prompts if outs))
