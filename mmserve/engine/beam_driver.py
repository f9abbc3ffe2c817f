"""Beam searches run on an engine that steps on this thread (``LLM.beam_search``).

Each round asks the engine for one token of every running beam of every prompt searched at
once, as requests of their own (``RequestMaker.extend``: the prompt followed by the beam),
with the most likely tokens' log-probabilities; the searches (``mmserve.beam_search``) then
pick the next beams. What the beams of a prompt share stays in the prefix cache between
rounds, and its images in the encoder cache, so a round computes each beam's last tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from mmserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from mmserve.engine.llm_engine import LLMEngine
from mmserve.engine.request import Request
from mmserve.engine.request_maker import RequestMaker
from mmserve.sampling_params import SamplingParams


def run_beam_search(engine: LLMEngine, prompts: Sequence[dict[str, Any] | str],
                    params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """Search every prompt; outputs in input order. Prompts are processed as searches start,
    at most ``max_num_seqs // beam_width`` searched at once, so any number of images takes
    bounded memory. Bad input raises ``InvalidInputError`` (the call's requests in flight
    aborted first); a prompt the engine fails on comes back with ``error`` set."""
    processor = engine.processor
    ends = processor.eos_token_ids
    # The engine takes what each step's request samples as a whole prompt; it only reads
    # the candidates, so the end token needs no special case (ignore_eos).
    step_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                 logprobs=params.num_candidates(ends), output_kind="final_only")
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
                    req = engine.process_request(prompts[started], step_params)
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
