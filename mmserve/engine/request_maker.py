"""Prompts into ``Request``s: processing, validation against the engine's limits, the grammar.

What a request needs before it can be queued, and nothing of the scheduler's state: the engine
runs it beside its stepping thread (``LLMEngine.process_request``), and a server whose engine
runs in a process of its own (``core_process.py``) runs it in the front end, so that the
processor's work never takes the core's interpreter lock.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmserve.config import EngineConfig
from mmserve.engine.lora import LoRAChecker, prompt_lora
from mmserve.engine.request import Request
from mmserve.engine.structured_output import GrammarCompiler
from mmserve.errors import InvalidInputError, PromptTooLongError
from mmserve.processing.processor import InputProcessor, check_unicode
from mmserve.sampling_params import SamplingParams
from mmserve.worker.cpu_allocator import release_free_memory

MAX_CACHE_SALT_CHARS = 1024


class RequestMaker:
    """Makes requests for an engine whose limits are ``max_model_len`` tokens a request,
    ``limit_mm_per_prompt`` and ``encoder_cache_tokens`` (the largest image it can hold), and
    which takes a request's ``priority`` only under ``scheduling_policy`` "priority".
    Thread-safe: a server calls it from several threads at once.

    Preprocessing whose memory peak exceeds ``release_threshold`` bytes gives the heap's free
    memory back to the operating system afterwards: the CPU runner asks glibc to keep freed
    memory for the steps (``keep_freed_memory``), which would otherwise keep what a large
    image's preprocessing freed for the life of the process."""

    def __init__(self, processor: InputProcessor, grammars: GrammarCompiler, max_model_len: int,
                 limit_mm_per_prompt: dict[str, int], encoder_cache_tokens: int,
                 release_threshold: int, scheduling_policy: str = "fcfs",
                 pooling_type: str = "last", lora: LoRAChecker | None = None) -> None:
        self.processor = processor
        self.lora_checker = lora  # None: the engine runs no LoRA adapter
        self.scheduling_policy = scheduling_policy
        self.pooling_type = pooling_type  # an embedding's (``SamplingParams.pooling``)
        self.grammars = grammars
        self.max_model_len = max_model_len
        self.limit_mm_per_prompt = limit_mm_per_prompt
        self.encoder_cache_tokens = encoder_cache_tokens
        self.release_threshold = release_threshold
        self.preprocess_peak_bytes = 0  # the largest preprocessing peak seen (an estimate)
        self.num_memory_releases = 0

    def make(self, prompt: dict[str, Any] | str, params: SamplingParams,
             request_id: str) -> Request:
        """Validate and tokenize a prompt into a ``Request``; ``InvalidInputError`` saying what
        to change."""
        salt = cache_salt(prompt)
        lora = prompt_lora(prompt)
        if lora is not None:
            if self.lora_checker is None:
                raise InvalidInputError(
                    f"this request runs with LoRA adapter {lora.lora_name!r}, but the engine "
                    "was started without LoRA; start it with enable_lora (--enable-lora).",
                    param="lora_request")
            self.lora_checker.check(lora)  # off the stepping thread: its files' headers
        if params.return_embedding and params.pooling != self.pooling_type:
            params = dataclasses.replace(params, pooling=self.pooling_type)
        keep_last = params.truncate_prompt_tokens
        if keep_last == -1:
            keep_last = self.max_model_len
        elif keep_last is not None and keep_last > self.max_model_len:
            raise InvalidInputError(
                f"truncate_prompt_tokens={keep_last} is more than max_model_len "
                f"({self.max_model_len}); send at most that, or -1 for max_model_len.",
                param="truncate_prompt_tokens")
        processed = self.processor.process(prompt, self.limit_mm_per_prompt, self.max_model_len,
                                           keep_last)
        self._note_preprocessing(processed.preprocess_peak_bytes)
        for img in processed.images:
            if img.length > self.encoder_cache_tokens:
                raise InvalidInputError(
                    f"an image needs {img.length} embedding tokens but the encoder cache holds "
                    f"{self.encoder_cache_tokens}; raise encoder_cache_size.", param="images")
        num_tokens = len(processed.token_ids)
        if num_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt is {num_tokens} tokens (images included) but max_model_len is "
                f"{self.max_model_len}; shorten the prompt or raise max_model_len.",
                param="messages" if isinstance(prompt, dict) and "messages" in prompt
                else "prompt")
        for t in params.stop_token_ids:
            if not 0 <= t < self.processor.tokenizer.vocab_size + 1024:
                raise InvalidInputError(f"stop_token_ids has an invalid id {t}",
                                        param="stop_token_ids")
        if params.logit_bias and max(params.logit_bias) >= self.grammars.vocab_size:
            raise InvalidInputError(
                f"logit_bias names token {max(params.logit_bias)}, but the model's vocabulary "
                f"has {self.grammars.vocab_size} tokens (ids 0 to "
                f"{self.grammars.vocab_size - 1}).", param="logit_bias")
        if params.priority and self.scheduling_policy != "priority":
            raise InvalidInputError(
                f"priority={params.priority} needs an engine that schedules by priority "
                "(--scheduling-policy priority); leave it out or send 0.", param="priority")
        allowed = params.allowed_token_ids
        if allowed and max(allowed) >= self.grammars.vocab_size:
            raise InvalidInputError(
                f"allowed_token_ids names token {max(allowed)}, but the model's vocabulary has "
                f"{self.grammars.vocab_size} tokens (ids 0 to "
                f"{self.grammars.vocab_size - 1}).", param="allowed_token_ids")
        if allowed and params.structured_outputs is not None:
            raise InvalidInputError(
                "allowed_token_ids and an output constraint (structured_outputs, "
                "response_format, or a tool_choice that forces a call) may leave no token to "
                "pick; send one of them.", param="allowed_token_ids")
        params = params.with_end_tokens(self.processor.eos_token_ids)
        params = params.with_bad_words(self.processor.encode, self.grammars.vocab_size)
        banned = {w[0] for w in params.bad_words_token_ids if len(w) == 1}
        if allowed and set(allowed) <= banned:
            raise InvalidInputError(
                "bad_words bans every token allowed_token_ids names: allow others, or ban "
                "fewer words.", param="bad_words")
        if allowed and set(allowed) <= set(params.min_tokens_blocked) | banned:
            raise InvalidInputError(
                "allowed_token_ids names only tokens that min_tokens holds back (the end of "
                "the sequence, stop_token_ids) or that bad_words bans: allow others, or leave "
                "min_tokens out.", param="allowed_token_ids")
        grammar = None
        if params.structured_outputs is not None:  # compiled here, off the stepping thread
            grammar = self.grammars.compile(params.structured_outputs)
        images = processed.images
        if salt is not None:  # its images' encoder outputs are its salt's alone too
            images = [dataclasses.replace(img, hash=salted_hash(img.hash, salt))
                      for img in images]
        req = Request(request_id, processed.token_ids, params, images,
                      eos_token_id=self.processor.eos_token_ids, arrival_time=time.time(),
                      prompt_positions=processed.positions,
                      decode_offset=processed.decode_offset, cache_salt=salt,
                      lora_request=lora)
        req.grammar = grammar
        return req

    @staticmethod
    def fork(req: Request, request_ids: list[str]) -> list[Request]:
        """The ``n`` completions of ``req`` (``n`` is ``req.sampling_params.n``, one id
        each): requests of one completion each, sharing its prompt, its images (pixels and
        hashes: each image is encoded once, and once the first completion's prompt blocks
        are computed the others find them in the prefix cache) and its compiled grammar,
        each with its own seed (``SamplingParams.child``)."""
        params = req.sampling_params
        if len(request_ids) != params.n:
            raise ValueError(f"{len(request_ids)} request ids for n={params.n} completions")
        children = []
        for i, request_id in enumerate(request_ids):
            child = Request(request_id, req.prompt_token_ids, params.child(i), req.images,
                            eos_token_id=req.eos_token_ids, arrival_time=req.arrival_time,
                            prompt_positions=req.prompt_positions,
                            decode_offset=req.decode_offset, cache_salt=req.cache_salt,
                            lora_request=req.lora_request)
            child.grammar = req.grammar
            children.append(child)
        return children

    @staticmethod
    def extend(req: Request, tokens: Sequence[int], params: SamplingParams,
               request_id: str) -> Request:
        """A request whose prompt is ``req``'s followed by ``tokens``, as if ``req`` had
        generated them (their positions are generated tokens'), sampled with ``params``: a
        beam search's step of one beam. Its images are ``req``'s (encoded once: the encoder
        and prefix caches find them)."""
        positions = req.prompt_positions
        if tokens:
            start = req.num_prompt_tokens + req.decode_offset
            added = np.arange(start, start + len(tokens), dtype=positions.dtype)
            positions = np.concatenate(
                [positions, np.broadcast_to(added, (positions.shape[0], len(tokens)))], axis=1)
        return Request(request_id, [*req.prompt_token_ids, *tokens], params, req.images,
                       eos_token_id=req.eos_token_ids, arrival_time=req.arrival_time,
                       prompt_positions=positions, decode_offset=req.decode_offset,
                       cache_salt=req.cache_salt, lora_request=req.lora_request)

    def _note_preprocessing(self, peak_bytes: int) -> None:
        self.preprocess_peak_bytes = max(self.preprocess_peak_bytes, peak_bytes)
        if peak_bytes > self.release_threshold and release_free_memory():
            self.num_memory_releases += 1


def cache_salt(prompt: dict[str, Any] | str) -> str | None:
    """A prompt's ``cache_salt`` (vLLM's), checked: ``InvalidInputError`` for one that is
    not a non-empty string of at most ``MAX_CACHE_SALT_CHARS`` characters of valid Unicode."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise InvalidInputError("cache_salt must be a non-empty string (a secret of the "
                                "users who may share cached prompts).", param="cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidInputError(f"cache_salt is {len(salt)} characters; at most "
                                f"{MAX_CACHE_SALT_CHARS} are taken.", param="cache_salt")
    check_unicode(salt, "cache_salt")
    return salt


def salted_hash(image_hash: str, salt: str) -> str:
    """An image's hash under ``salt``: its encoder output found only under the same salt."""
    return hashlib.sha256(f"{image_hash}\0{salt}".encode()).hexdigest()


def processor_and_grammars(config: EngineConfig,
                           hf_config: Any) -> tuple[InputProcessor, GrammarCompiler]:
    """The checkpoint's processor and grammar compiler, as the engine under ``config`` builds
    them (and a front end apart from it)."""
    processor = InputProcessor(config.model, hf_config, config.max_image_pixels,
                               config.mm_processor_kwargs, config.max_image_size,
                               config.resolved_device, config.chat_template,
                               config.chat_template_content_format)
    grammars = GrammarCompiler(processor.tokenizer, hf_config.get_text_config().vocab_size,
                               list(processor.eos_token_ids))
    return processor, grammars
