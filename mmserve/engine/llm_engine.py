"""The engine: admits requests, runs scheduler -> runner -> scheduler steps, detokenizes."""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any

import torch

from mmserve.config import EngineConfig
from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.engine.encoder_cache import compute_encoder_budget
from mmserve.engine.kv_cache_manager import KVCacheManager
from mmserve.engine.memory_plan import MemoryPlan, resolve_limits
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from mmserve.outputs import RequestOutput
from mmserve.processing.images import InvalidInputError
from mmserve.processing.processor import InputProcessor
from mmserve.sampling_params import SamplingParams
from mmserve.worker.cuda_runner import runner_class

logger = logging.getLogger(__name__)

# Without an explicit kv_cache_memory, the KV cache takes at most this share of the RAM that is
# available at start-up.
DEFAULT_KV_RAM_SHARE = 0.3


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoConfig

        if not os.path.isdir(config.model):
            raise FileNotFoundError(
                f"model directory not found: {config.model!r}; mmserve loads local Hugging "
                "Face checkpoints (config.json, *.safetensors, tokenizer and processor files).")
        torch.manual_seed(config.seed)
        hf_config = AutoConfig.from_pretrained(config.model, local_files_only=True)
        dtype = config.torch_dtype
        self.processor = InputProcessor(config.model, hf_config, config.max_image_pixels)
        runner_cls = runner_class(config.resolved_device)
        self.model, self.weight_bytes = runner_cls.load_model(config.model, hf_config, dtype)
        text = hf_config.text_config

        self.plan = self._plan_memory(config, text, dtype)
        self.config = config.replace(max_model_len=self.plan.max_model_len,
                                     max_num_seqs=self.plan.max_num_seqs)
        self.encoder_budget = compute_encoder_budget(
            max_tokens_per_item=self.processor.tokens_per_image,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=self.plan.max_num_seqs,
            max_items_per_prompt=max(1, config.limit_mm_per_prompt),
            encoder_cache_size=config.encoder_cache_size,
        )
        self.runner = runner_cls(self.model, self.plan.num_blocks, config.block_size, dtype,
                                 config.seed)
        if not config.enforce_eager:
            self.runner.capture_model(self.plan.max_num_seqs, self.plan.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=self.plan.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.plan.max_model_len,
                block_size=config.block_size,
            ),
            KVCacheManager(self.plan.num_blocks, config.block_size,
                           config.enable_prefix_caching),
            self.encoder_budget,
        )
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.schedule_time = 0.0
        self.last_scheduler_output: SchedulerOutput | None = None
        logger.info(
            "mmserve engine ready: dtype=%s, KV cache %d blocks x %d tokens (%d bytes), "
            "max_model_len=%d (%s), max_num_seqs=%d (%s), encoder cache %d tokens "
            "(%d images of %d tokens), encoder compute budget %d tokens per step",
            dtype, self.plan.num_blocks, config.block_size, self.plan.kv_cache_bytes,
            self.plan.max_model_len, self.plan.max_model_len_source, self.plan.max_num_seqs,
            self.plan.max_num_seqs_source, self.encoder_budget.cache_tokens,
            self.encoder_budget.cache_items, self.encoder_budget.max_tokens_per_item,
            self.encoder_budget.compute_tokens)

    @staticmethod
    def _plan_memory(config: EngineConfig, text_config, dtype: torch.dtype) -> MemoryPlan:
        head_dim = (getattr(text_config, "head_dim", None)
                    or text_config.hidden_size // text_config.num_attention_heads)
        kv_heads = (getattr(text_config, "num_key_value_heads", None)
                    or text_config.num_attention_heads)
        elem = torch.tensor([], dtype=dtype).element_size()
        bytes_per_token = 2 * text_config.num_hidden_layers * kv_heads * head_dim * elem
        block_bytes = bytes_per_token * config.block_size
        model_max_len = text_config.max_position_embeddings
        if config.kv_cache_memory is not None:
            budget = config.kv_cache_memory
        else:
            # Enough for the requested (or default) concurrency at full length, within a share
            # of the available RAM.
            want_len = config.max_model_len or model_max_len
            want_seqs = config.max_num_seqs or 256
            budget = min(int(_available_ram() * DEFAULT_KV_RAM_SHARE),
                         want_len * want_seqs * bytes_per_token)
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget of {budget} bytes is smaller than one block "
                f"({block_bytes} bytes = {config.block_size} tokens x {bytes_per_token} bytes "
                "per token); give the KV cache more memory or lower block_size.")
        return resolve_limits(num_blocks, config.block_size, model_max_len,
                              config.max_model_len, config.max_num_seqs, bytes_per_token)

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: dict[str, Any] | str,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request. Raises InvalidInputError saying what to change."""
        params = sampling_params or SamplingParams()
        processed = self.processor.process(prompt)
        n_images = len(processed.images)
        limit = self.config.limit_mm_per_prompt
        if n_images > limit:
            raise InvalidInputError(
                f"the prompt has {n_images} images but limit_mm_per_prompt is {limit}; send "
                f"fewer images or raise limit_mm_per_prompt.", param="images")
        for img in processed.images:
            if img.length > self.encoder_budget.cache_tokens:
                raise InvalidInputError(
                    f"an image needs {img.length} embedding tokens but the encoder cache holds "
                    f"{self.encoder_budget.cache_tokens}; raise encoder_cache_size.",
                    param="images")
        num_tokens = len(processed.token_ids)
        if num_tokens > self.config.max_model_len:
            raise InvalidInputError(
                f"the prompt is {num_tokens} tokens (images included) but max_model_len is "
                f"{self.config.max_model_len}; shorten the prompt or raise max_model_len.",
                param="messages")
        for t in params.stop_token_ids:
            if not 0 <= t < self.processor.tokenizer.vocab_size + 1024:
                raise InvalidInputError(f"stop_token_ids has an invalid id {t}",
                                        param="stop_token_ids")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.scheduler.requests:
            raise InvalidInputError(f"request id {request_id!r} is already in use")
        req = Request(request_id, processed.token_ids, params, processed.images,
                      eos_token_id=self.processor.eos_token_id, arrival_time=time.time())
        self._detokenizers[request_id] = IncrementalDetokenizer(self.processor.tokenizer,
                                                                params.stop)
        self.scheduler.add_request(req)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._detokenizers.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        self.schedule_time += time.perf_counter() - t0
        self.last_scheduler_output = so  # read by `mmserve bench` for its per-step timeline
        sampled = self.runner.execute(so)
        t1 = time.perf_counter()
        changed = self.scheduler.update(so, sampled)
        self.num_steps += 1
        outputs = []
        for req in changed:
            detok = self._detokenizers[req.request_id]
            detok.add(req.all_token_ids[-1])
            if detok.stopped and not req.finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            outputs.append(self._output(req, detok))
        self.schedule_time += time.perf_counter() - t1
        return outputs

    def _output(self, req: Request, detok: IncrementalDetokenizer) -> RequestOutput:
        finished = req.finished
        if finished:
            del self._detokenizers[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            text=detok.text,
            token_ids=req.output_token_ids,
            num_prompt_tokens=req.num_prompt_tokens,
            finished=finished,
            finish_reason=req.status.finish_reason,
            new_text=detok.take_new_text(final=finished),
            new_token_ids=req.all_token_ids[-1:],
        )

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        enc = s.encoder_cache
        pool = s.kv_cache.pool
        return {
            "num_preemptions": s.num_preemptions,
            "encoder_cache_hits": enc.num_hits,
            "encoder_cache_misses": enc.num_misses,
            "encoder_items_computed": enc.num_misses,
            "encoder_cache_evictions": enc.num_evictions,
            "encoder_cache_tokens": enc.cache_size,
            "encoder_cache_used_tokens": enc.num_used_tokens,
            "encoder_cache_referenced_entries": enc.num_referenced_entries(),
            "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
            "prefix_cache_queried_tokens": s.prefix_cache_queried_tokens,
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_free": pool.num_free_blocks,
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_steps": self.num_steps,
        }
