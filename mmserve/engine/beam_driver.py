"""Beam searches run on an engine: one stepped on this thread (``LLM.beam_search``), or
stepped elsewhere for a server (``BeamRounds``, over an ``EngineClient``).

Each round asks the engine for one token of every running beam of every prompt searched at
once, as requests of their own (``RequestMaker.extend``: the prompt followed by the beam),
with the most likely tokens' log-probabilities; the searches (``mmserve.beam_search``) then
pick the next beams. What the beams of a prompt share stays in the prefix cache between
rounds, and its images in the encoder cache, so a round computes each beam's last tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tqdm.auto import tqdm

from mmserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from mmserve.engine.llm_engine import LLMEngine
from mmserve.engine.request import Request
from mmserve.engine.request_maker import RequestMaker
from mmserve.outputs import RequestOutput
from mmserve.processing.processor import InputProcessor
from mmserve.sampling_params import SamplingParams


class RoundsClient(Protocol):
    """What ``BeamRounds`` needs of a server's engine (``EngineClient`` has it)."""

    @property
    def processor(self) -> InputProcessor: ...

    @property
    def max_model_len(self) -> int: ...

    async def make_request(self, prompt: dict[str, Any], params: SamplingParams,
                           request_id: str) -> Request: ...

    async def run_requests(self, requests: list[Request]) -> list[RequestOutput]: ...


def step_params(params: BeamSearchParams, end_token_ids: Sequence[int]) -> SamplingParams:
    """What each round's request of a beam samples with: one token, and the most likely
    ones' log-probabilities (the candidates). The engine takes the beam as a whole prompt and
    only the candidates are read, so the end token needs no special case (ignore_eos)."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                          logprobs=params.num_candidates(end_token_ids),
                          output_kind="final_only")


def run_beam_search(engine: LLMEngine, prompts: Sequence[dict[str, Any] | str],
                    params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """Search every prompt; outputs in input order. Prompts are processed as searches start,
    at most ``max_num_seqs // beam_width`` searched at once, so any number of images takes
    bounded memory. Bad input raises ``InvalidInputError`` (the call's requests in flight
    aborted first); a prompt the engine fails on comes back with ``error`` set."""
    processor = engine.processor
    ends = processor.eos_token_ids
    sampling = step_params(params, ends)
    at_once = max(1, engine.scheduler.max_num_seqs // params.beam_width)
    max_model_len = engine.scheduler.max_model_len
    outputs: list[BeamSearchOutput | None] = [None] * len(prompts)
    searches: dict[int, tuple[Request, BeamSearch]] = {}  # by prompt index
    in_flight: dict[str, tuple[int, int]] = {}  # request id -> (prompt, beam)
    started = 0
    try:
        with tqdm(total=len(prompts), desc="Searched prompts", disable=not use_tqdm) as bar:
            while started < len(prompts) or searches:
                while started < len(prompts) and len(searches) < at_once:
                    req = engine.process_request(prompts[started], sampling)
                    searches[started] = (req, BeamSearch(
                        params, ends, max_tokens=max_model_len - req.num_prompt_tokens))
                    started += 1
                candidates = {i: [None] * len(search.running)
                              for i, (_, search) in searches.items()}
                for i, (req, search) in searches.items():
                    for b, tokens in enumerate(search.running):
                        request_id = engine.next_request_id()
                        engine.add_processed_request(RequestMaker.extend(
                            req, tokens, req.sampling_params, request_id))
                        in_flight[request_id] = (i, b)
                errors: dict[int, str] = {}
                while in_flight:
                    if not engine.has_unfinished_requests():
                        raise RuntimeError(f"the engine dropped {len(in_flight)} requests of "
                                           "a beam search")
                    for out in engine.step():
                        if not out.finished or out.request_id not in in_flight:
                            continue
                        i, b = in_flight.pop(out.request_id)
                        if out.finish_reason == "error" or not out.logprobs:
                            errors[i] = out.error or f"finished with {out.finish_reason}"
                        else:
                            candidates[i][b] = out.logprobs[0].top
                for i, (req, search) in list(searches.items()):
                    if i in errors:
                        outputs[i] = BeamSearchOutput(req.prompt_token_ids, error=errors[i])
                    else:
                        search.advance(candidates[i])
                        if not search.done:
                            continue
                        outputs[i] = BeamSearchOutput(req.prompt_token_ids, search.sequences())
                        for seq in outputs[i].sequences:
                            seq.text = processor.decode(seq.token_ids)
                    del searches[i]
                    bar.update(1)
    except BaseException:
        for request_id in in_flight:
            engine.abort_request(request_id)
        raise
    return outputs  # type: ignore[return-value]


class BeamRounds:
    """One prompt's beam search over an ``EngineClient`` (a server's engine, stepped on
    another thread or in another process): each round, one request per running beam
    (``EngineClient.run_requests``), beside the server's other requests. ``request_ids``
    name the sequences' outputs; a round's requests are named after the first."""

    def __init__(self, client: RoundsClient, req: Request, search: BeamSearch,
                 request_ids: list[str]) -> None:
        self.client, self.req, self.search = client, req, search
        self.request_ids = request_ids

    @classmethod
    async def start(cls, client: RoundsClient, prompt: dict[str, Any],
                    params: BeamSearchParams, request_ids: list[str]) -> BeamRounds:
        """The prompt processed (``InvalidInputError`` for bad input), nothing queued."""
        ends = client.processor.eos_token_ids
        req = await client.make_request(prompt, step_params(params, ends), request_ids[0])
        search = BeamSearch(params, ends,
                            max_tokens=client.max_model_len - req.num_prompt_tokens)
        return cls(client, req, search, request_ids)

    async def run(self) -> list[RequestOutput]:
        """The search's sequences as final outputs, best first, their text left to the
        caller; if a round fails, every output says why."""
        req, search = self.req, self.search
        rounds = 0
        while not search.done:
            finals = await self.client.run_requests([
                RequestMaker.extend(req, tokens, req.sampling_params,
                                    f"{self.request_ids[0]}-beam{rounds}-{b}")
                for b, tokens in enumerate(search.running)])
            for out in finals:
                if out.finish_reason == "error" or not out.logprobs:
                    return self.failed(out.error or f"finished with {out.finish_reason}")
            search.advance([out.logprobs[0].top for out in finals])
            rounds += 1
        return [RequestOutput(request_id, "", seq.token_ids, req.num_prompt_tokens,
                              finished=True, finish_reason=seq.finish_reason,
                              new_token_ids=seq.token_ids,
                              prompt_token_ids=req.prompt_token_ids)
                for request_id, seq in zip(self.request_ids, search.sequences(), strict=True)]

    def failed(self, reason: str) -> list[RequestOutput]:
        return [RequestOutput(request_id, "", [], self.req.num_prompt_tokens, finished=True,
                              finish_reason="error", error=reason)
                for request_id in self.request_ids]
