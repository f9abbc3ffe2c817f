"""The Python API: ``LLM(model).generate(...)``, ``.chat(...)``, ``.caption(...)``,
``.embed(...)`` and ``.score(...)``."""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm.auto import tqdm

from mmserve.beam_search import BeamSearchOutput, BeamSearchParams
from mmserve.config import EngineConfig, pooler_config_kwargs
from mmserve.engine.beam_driver import run_beam_search
from mmserve.engine.llm_engine import LLMEngine
from mmserve.engine.memory_plan import MemoryPlan
from mmserve.engine.prompt_feed import PromptFeed
from mmserve.entrypoints.generation_config import sampling_defaults
from mmserve.lora_request import LoRARequest
from mmserve.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    cosine_scores,
    embedding_of,
    score_pairs,
)
from mmserve.processing.chat_template import load_chat_template
from mmserve.processing.images import ImageLike
from mmserve.sampling_params import SamplingParams


class LLM:
    """An engine in this process, for offline batch generation.

    ``model`` is a local Hugging Face checkpoint directory; without one, the bundled demo model
    (`mmserve.demo.checkpoint.demo_model_path`), which describes scenes of coloured shapes.
    Engine arguments are the fields of `mmserve.config.EngineConfig`, where each one's type,
    default and help are declared (the command line's flags are the same names with dashes);
    they follow vLLM's names, e.g. ``max_model_len`` and ``max_num_seqs`` (integers or
    ``"auto"``, the default: sized by the memory plan) and ``limit_mm_per_prompt``; vLLM's
    ``pooler_config`` (a dict, or its JSON: ``{"pooling_type": "MEAN", "normalize": false}``)
    stands for ``pooling_type`` and ``normalize_embeddings``.

    ``close()``, the end of a ``with LLM(...) as llm:`` block, or dropping the last reference
    gives back everything the engine took (weights, caches, CUDA graphs, the GPU allocator's
    cached memory), so that another ``LLM`` in the same process starts as this one did.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        if model is None:
            # With no model, the bundled demo: it describes scenes of coloured shapes.
            from mmserve.demo.checkpoint import demo_model_path

            model = str(demo_model_path())
        pooler_config = engine_args.pop("pooler_config", None)
        if pooler_config is not None:
            for name, value in pooler_config_kwargs(pooler_config).items():
                if engine_args.get(name) is None:
                    engine_args[name] = value
                elif engine_args[name] != value:
                    raise ValueError(f"pooler_config and {name} disagree; give one of them.")
        config = EngineConfig(model=str(model), **engine_args)
        # The sampling defaults of the checkpoint's generation config and the chat template
        # (a bad file or template stops here, before the weights load).
        self._sampling_defaults = sampling_defaults(config)
        load_chat_template(config.chat_template)
        self.engine = LLMEngine(config)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no ``SamplingParams``: mmserve's
        defaults (vLLM's), the fields the checkpoint's ``generation_config.json`` sets
        replaced (``EngineConfig.generation_config``)."""
        return SamplingParams(**self._sampling_defaults)

    def generate(
        self,
        prompts: dict[str, Any] | str | Sequence[dict[str, Any] | str],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. ``priority``:
        each prompt's, as vLLM's (lower first; an engine of ``scheduling_policy="priority"``
        only), in place of its parameters' ``priority``. ``lora_request``: the LoRA adapter
        the prompts run with (an engine of ``enable_lora``), or each prompt's (None: the
        model's own weights), as vLLM's.

        A prompt is ``{"prompt": str, "images": [...]}`` (text in the model's own format, one
        image token per image) or ``{"messages": [...], "images": [...]}`` in OpenAI chat form;
        vLLM's ``"multi_modal_data": {"image": ...}`` may stand for ``"images"``.

        Prompts are preprocessed (images decoded, resized and normalized, text tokenized) and
        queued in input order, at most ``requests_ahead(max_num_seqs)`` of the call's requests
        (a prompt's ``n`` completions count ``n``) held preprocessed or running at a time, so
        any number of images takes bounded memory.
        Beside a GPU engine a pool of threads preprocesses while the engine steps, and the
        first step starts once the first prompt is ready, not all of them; on the CPU, whose
        steps take every core, the calling thread preprocesses between steps. Bad input raises
        ``InvalidInputError`` naming what to change, after the call's requests already queued
        are aborted: none is left behind. A request the engine fails on while running comes
        back with ``finish_reason == "error"`` and the reason in ``error``; the other requests
        are unaffected. Without ``sampling_params``: ``get_default_sampling_params()``.
        """
        if isinstance(prompts, (dict, str)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [_final_only(sampling_params or self.get_default_sampling_params())
                      ] * len(prompts)
        else:
            params = [_final_only(p) for p in sampling_params]
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
            params = [replace(p, priority=level) for p, level in zip(params, priority,
                                                                     strict=True)]
        return self._run(_with_loras(prompts, lora_request), params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        images: list[ImageLike] | None = None,
        use_tqdm: bool = False,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations; ``tools``: the
        functions (OpenAI's ``tools``) the chat template shows the model. As vLLM's: the
        prompt ends with the start of a new assistant turn (``add_generation_prompt``), or
        inside the last message, an assistant's, for the model to go on writing it
        (``continue_final_message``, with ``add_generation_prompt=False``);
        ``chat_template_kwargs``: more variables for the template; ``mm_processor_kwargs``:
        image-processor settings for these prompts' images over the engine's (Qwen2-VL's
        ``min_pixels`` and ``max_pixels``, up to the engine's), as a prompt's own key of that
        name is in ``generate``; ``lora_request`` as ``generate``'s."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [{"messages": conv, "images": images or [],
                    "add_generation_prompt": add_generation_prompt,
                    "continue_final_message": continue_final_message,
                    "chat_template_kwargs": chat_template_kwargs,
                    "mm_processor_kwargs": mm_processor_kwargs,
                    **({} if tools is None else {"tools": tools})} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def embed(
        self,
        prompts: dict[str, Any] | str | Sequence[dict[str, Any] | str],
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, as vLLM's ``LLM.embed``: the final hidden state of its
        last token (last-token pooling, how embedding models built on a vision-language
        decoder, E5-V and VLM2Vec among them, read a prompt; the engine's ``pooling_type``
        may make it the mean of every token's, or the first token's), L2-normalized unless
        ``normalize`` is false (None: the engine's ``normalize_embeddings``), in
        ``outputs.embedding``. Prompts as ``generate`` takes
        them, images included; ``truncate_prompt_tokens`` as ``SamplingParams``'. Each is a
        request of one step's prefill (its sampled token is dropped), batched and cached as
        any other; one the engine fails on raises ``RuntimeError`` with the reason.
        ``lora_request`` as ``generate``'s."""
        params = SamplingParams(max_tokens=1, temperature=0.0, return_embedding=True,
                                truncate_prompt_tokens=truncate_prompt_tokens,
                                output_kind="final_only")
        outs = self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)
        return [EmbeddingRequestOutput(
            out.request_id, EmbeddingOutput(embedding_of(
                out, self.engine.config.normalize_embeddings if normalize is None
                else normalize).tolist()),
            out.prompt_token_ids or [], out.num_prompt_tokens) for out in outs]

    def score(
        self,
        text_1: dict[str, Any] | str | Sequence[dict[str, Any] | str],
        text_2: dict[str, Any] | str | Sequence[dict[str, Any] | str],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score`` for an embedding model: the cosine similarity of the
        embeddings (``embed``) of one ``text_1`` and each ``text_2``, or of each ``text_1``
        and its ``text_2`` (as many of both); prompts as ``generate`` takes them, images
        included (an image scored against captions). Each output's ``request_id`` names
        the pair's two requests, and its ``prompt_token_ids`` are theirs one after the
        other. ``lora_request``: the LoRA adapter every prompt runs with."""
        left = [text_1] if isinstance(text_1, (str, dict)) else list(text_1)
        right = [text_2] if isinstance(text_2, (str, dict)) else list(text_2)
        pairs = score_pairs(len(left), len(right))
        outs = self.embed(left + right, normalize=False,
                          truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                          lora_request=lora_request)
        values = cosine_scores([torch.tensor(o.outputs.embedding) for o in outs], pairs)
        return [ScoringRequestOutput(f"{outs[a].request_id}_{outs[b].request_id}",
                                     ScoringOutput(value),
                                     outs[a].prompt_token_ids + outs[b].prompt_token_ids)
                for (a, b), value in zip(pairs, values, strict=True)]

    def caption(
        self,
        images: Sequence[ImageLike],
        prompt: str = "Describe this image.",
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        beam_width: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[str]:
        """Caption any number of images as one batch, with a progress bar. ``beam_width``:
        each caption the best sequence of a beam search that wide (``beam_search``), of at
        most ``sampling_params.max_tokens`` tokens. ``lora_request``: the LoRA adapter that
        captions (a captioner fine-tuned as an adapter)."""
        params = sampling_params or SamplingParams(max_tokens=64, temperature=0.0)
        prompts = [{"messages": [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": prompt}]}], "images": [image]}
            for image in images]
        if beam_width is not None:
            searched = self.beam_search(prompts, BeamSearchParams(
                beam_width=beam_width, max_tokens=params.max_tokens), use_tqdm=use_tqdm,
                lora_request=lora_request)
            for out in searched:
                if out.error is not None:
                    raise RuntimeError(f"a caption's beam search failed: {out.error}")
            return [out.sequences[0].text for out in searched]
        return [out.text for out in self.generate(prompts, params, use_tqdm=use_tqdm,
                                                  lora_request=lora_request)]

    def beam_search(
        self,
        prompts: dict[str, Any] | str | Sequence[dict[str, Any] | str],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search every prompt (the same prompts as ``generate``'s); outputs come back
        in input order, each with ``params.beam_width`` sequences, best first. The search is
        transformers' ``generate(num_beams=..., do_sample=False)``, step for step
        (``mmserve.beam_search``): each step runs one request of one token per running
        beam, whose shared prefix, images included, the prefix cache keeps computed.
        ``lora_request`` as ``generate``'s."""
        if isinstance(prompts, (dict, str)):
            prompts = [prompts]
        prompts = _with_loras(list(prompts), lora_request)
        with self.engine.stepping(_caller("LLM.beam_search")):
            return run_beam_search(self.engine, prompts, params, use_tqdm)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def close(self) -> None:
        """Give back the engine's memory and threads (``LLMEngine.close``); generating
        afterwards raises ``EngineDeadError``."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def memory_plan(self) -> MemoryPlan:
        """What the engine decided at start-up: every term of the memory budget, the KV and
        encoder cache sizes, and max_model_len / max_num_seqs with where each came from
        (``.to_dict()`` for plain data, ``.summary()`` for text)."""
        return self.engine.plan

    def _run(self, prompts: list[dict[str, Any] | str], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        """Preprocess ``prompts`` ahead of the engine and step until every completion of
        every one finished, the engine's steps held for this call (a server stepping the
        same engine, or another thread's call, refuses it: ``LLMEngine.stepping``). Whatever
        stops the loop early (a bad prompt, an engine that died, Ctrl-C) aborts the call's
        requests still in flight first, so the engine is left with every KV block free and
        can be used again."""
        with self.engine.stepping(_caller("an LLM call")):
            return self._run_held(prompts, params, use_tqdm)

    def _run_held(self, prompts: list[dict[str, Any] | str], params: list[SamplingParams],
                  use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids = [[engine.next_request_id() for _ in range(p.n)] for p in params]  # per prompt
        wanted = {rid for group in ids for rid in group}
        done: dict[str, RequestOutput] = {}
        feed = PromptFeed(engine, prompts, params, ids)
        try:
            with tqdm(total=len(wanted), desc="Processed prompts",
                      disable=not use_tqdm) as bar:
                while len(done) < len(wanted):
                    feed.top_up(len(done))
                    if not engine.has_unfinished_requests():
                        break  # nothing queued, nothing to queue: see below
                    for out in engine.step():
                        if out.finished and out.request_id in wanted:
                            done[out.request_id] = out
                            bar.update(1)
        except BaseException:
            feed.abort(done)
            raise
        finally:
            feed.close()
        feed.check_finished(done)
        return [_with_completions([done[rid] for rid in group]) for group in ids]


def _caller(what: str) -> str:
    """Who steps the engine, for the error another caller gets: ``what`` and its thread."""
    return f"{what} on thread {threading.current_thread().name!r}"


def _with_loras(prompts: list[dict[str, Any] | str],
                lora_request: LoRARequest | Sequence[LoRARequest | None] | None
                ) -> list[dict[str, Any] | str]:
    """The prompts, each running with its LoRA adapter (the engine reads a prompt's
    ``lora_request``, and refuses what is no ``LoRARequest``): ``lora_request`` for all, or
    one (or None) each."""
    if lora_request is None:
        return prompts
    loras = ([lora_request] * len(prompts) if isinstance(lora_request, LoRARequest)
             else list(lora_request))
    if len(loras) != len(prompts):
        raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
    return [prompt if lora is None else {
        **({"prompt": prompt} if isinstance(prompt, str) else prompt), "lora_request": lora}
        for prompt, lora in zip(prompts, loras, strict=True)]


def _final_only(params: SamplingParams) -> SamplingParams:
    """``params`` for a request whose outputs only ``generate`` sees: the engine builds none
    before the last (whatever ``output_kind`` says, ``generate`` returns final outputs)."""
    if params.output_kind == "final_only":
        return params
    params = copy.copy(params)  # validated already: nothing else changes
    params.output_kind = "final_only"
    return params


def _with_completions(outs: list[RequestOutput]) -> RequestOutput:
    """A prompt's output: its first completion's, with every completion in ``outputs``."""
    return replace(outs[0], outputs=[out.completion(i) for i, out in enumerate(outs)])
