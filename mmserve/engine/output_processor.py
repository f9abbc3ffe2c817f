"""From the engine core's tokens to request outputs: detokenization, stop strings, the
log-probabilities a request gathers, and the shape its ``output_kind`` asks for.

A step of the engine core gives a ``CoreOutput`` for each request it changed: the token it
sampled, whether the core finished it (and why), its log-probabilities. ``OutputProcessor``
turns those into ``RequestOutput``s. For ``LLM`` and ``bench`` the engine runs it after each
step (``LLMEngine.step``); the server's ``EngineClient`` runs it on its event loop, whether
the engine steps on a thread of the server's process or in a process of its own
(``core_process.py``), so that the thread the device waits on spends no time on text. A stop
string is found here, after the core has moved on: the processor finishes the request's
output and names it, and its caller ends the request in the core (the engine at once, the
server by an abort that may come a step or two later, whose tokens are dropped).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.engine.request import Request
from mmserve.outputs import RequestOutput
from mmserve.step import TokenLogprobs

if TYPE_CHECKING:
    import torch


class CoreOutput(NamedTuple):
    """What one step of the engine core did to one request."""

    request_id: str
    new_token_ids: list[int]  # the token the step sampled; empty for a failure without one
    finish_reason: str | None = None  # the core finished the request: "stop", "length", "error"
    error: str | None = None  # finish_reason "error": why
    num_cached_tokens: int = 0
    logprobs: TokenLogprobs | None = None  # the new token's, for a request that asked
    # With a request's first output, for a request that asked: complete once it samples.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # With the output it is sampled for, for a request that asked (``return_embedding``).
    embedding: torch.Tensor | None = None


@dataclass(slots=True)
class _Output:
    """What the processor keeps of one request between its steps."""

    detok: IncrementalDetokenizer
    kind: str  # its SamplingParams.output_kind
    num_prompt_tokens: int
    token_ids: list[int]  # generated so far (not kept for delta outputs)
    logprobs: list[TokenLogprobs] | None  # gathered so far, if asked (delta: none kept)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_token_ids: list[int] | None = None  # the request's (not a copy)


class OutputProcessor:
    """The requests' text and outputs, built from the core's ``CoreOutput``s; every method
    from one thread."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._outputs: dict[str, _Output] = {}

    def __len__(self) -> int:
        return len(self._outputs)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._outputs

    def add(self, req: Request) -> None:
        """Follow a request queued in the core (before its first step)."""
        params = req.sampling_params
        self._outputs[req.request_id] = _Output(
            IncrementalDetokenizer(self.tokenizer, params.stop, params.min_tokens,
                                   params.skip_special_tokens,
                                   params.include_stop_str_in_output),
            params.output_kind,
            req.num_prompt_tokens, [], None if params.logprobs is None else [],
            prompt_token_ids=req.prompt_token_ids)

    def abort(self, request_id: str) -> None:
        """Forget a request: nothing more of it is output. Harmless for one not followed."""
        self._outputs.pop(request_id, None)

    def clear(self) -> None:
        self._outputs.clear()

    def process(self, core_outputs: Iterable[CoreOutput]) -> tuple[list[RequestOutput],
                                                                      list[str]]:
        """The request outputs of a step's core outputs (each as its request's ``output_kind``
        asks: a ``final_only`` request's once it finishes), and the requests that a stop
        string finished here, which the core is still running. Core outputs of requests not
        followed (aborted, stopped) are dropped."""
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        followed = self._outputs
        for core in core_outputs:
            rid = core.request_id
            state = followed.get(rid)
            if state is None:
                continue
            if core.prompt_logprobs is not None:
                state.prompt_logprobs = core.prompt_logprobs
            detok = state.detok
            for token in core.new_token_ids:
                detok.add(token)
            logprobs = state.logprobs
            if state.kind == "delta":  # this step's alone: nothing is kept that grows
                token_ids = core.new_token_ids
                if logprobs is not None:
                    logprobs = [] if core.logprobs is None else [core.logprobs]
            else:
                state.token_ids += core.new_token_ids
                token_ids = state.token_ids
                if logprobs is not None and core.logprobs is not None:
                    logprobs.append(core.logprobs)
            reason = core.finish_reason
            if reason is None and detok.stopped:
                reason = "stop"
                stopped.append(rid)
            if reason is None:
                if state.kind != "final_only":
                    outputs.append(self._output(rid, state, token_ids, logprobs, core, None))
                continue
            del followed[rid]
            outputs.append(self._output(rid, state, token_ids, logprobs, core, reason))
        return outputs, stopped

    @staticmethod
    def _output(rid: str, state: _Output, token_ids: list[int],
                logprobs: list[TokenLogprobs] | None, core: CoreOutput,
                reason: str | None) -> RequestOutput:
        """The request's output after a step, ``reason`` set when it finished."""
        finished = reason is not None
        error = reason == "error"
        detok = state.detok
        new_text = detok.take_new_text(final=finished)
        if state.kind == "delta":
            text, new_token_ids = new_text, token_ids
        else:
            text, token_ids = detok.text, list(token_ids)
            if state.kind == "final_only":  # everything is new
                new_text, new_token_ids = text, token_ids
            elif error:  # what the failed step sampled, if anything, is in token_ids alone
                new_text, new_token_ids = "", []
            else:
                new_token_ids = list(core.new_token_ids)
            if logprobs is not None:
                logprobs = list(logprobs)
        return RequestOutput(
            request_id=rid, text=text, token_ids=token_ids,
            num_prompt_tokens=state.num_prompt_tokens, finished=finished, finish_reason=reason,
            new_text=new_text, new_token_ids=new_token_ids,
            num_cached_tokens=core.num_cached_tokens, error=core.error if error else None,
            logprobs=logprobs,
            prompt_logprobs=state.prompt_logprobs if finished and not error else None,
            prompt_token_ids=state.prompt_token_ids, embedding=core.embedding)
