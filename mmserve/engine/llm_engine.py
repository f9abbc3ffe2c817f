"""The engine: admits requests, runs scheduler -> runner -> scheduler steps, and makes their
outputs (``output_processor.py``) unless its front end does."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from mmserve.config import EngineConfig, require_model_dir, resolved_pooling
from mmserve.engine.encoder_cache import KVLending
from mmserve.engine.kv_cache_manager import KVCacheManager
from mmserve.engine.lora import LoRASlots, lora_checker
from mmserve.engine.memory_plan import InfeasiblePlanError, default_memory_utilization
from mmserve.engine.output_processor import CoreOutput, OutputProcessor
from mmserve.engine.profile_batch import ProfileBatch
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.request_maker import RequestMaker, processor_and_grammars
from mmserve.engine.scheduler import Scheduler, SchedulerConfig
from mmserve.engine.startup import plan_for
from mmserve.engine.structured_output import Matchers
from mmserve.errors import EngineDeadError, InvalidInputError
from mmserve.inputs import EncoderInput
from mmserve.outputs import RequestOutput
from mmserve.profiling import phase
from mmserve.sampling_params import SamplingParams
from mmserve.step import PENDING_TOKEN, ModelOutput, SchedulerOutput, StepTimes, TokenLogprobs
from mmserve.worker import memory_profiler
from mmserve.worker.busy_timer import BusyTimer
from mmserve.worker.collector import freeze_long_lived, thaw
from mmserve.worker.compute_thread import ComputeThread
from mmserve.worker.cuda_runner import runner_class
from mmserve.worker.dry_run import check_tensor_parallel, profile_blocks
from mmserve.worker.executor import InlineSteps, MultiprocExecutor, StepThread, WorkerSpec

logger = logging.getLogger(__name__)

# How often steps may fail in a row. A step that fails for a request which has not generated a
# token yet finishes it with an error at once: it is the likely cause (hostile input). One that
# had generated tokens ran fine before, so it is retried, up to this many failed steps in a
# row. And when this many steps in a row fail for every request they run, requests that ran
# fine before among them, the device or engine is broken: the engine stops.
MAX_FAILED_STEPS = 3


@dataclass
class StepRecord:
    """What one engine step did, returned by ``LLMEngine.step_with_record`` (for benchmarks
    and logs; ``step`` returns only the request outputs)."""

    scheduler_output: SchedulerOutput  # the batch scheduled: ids, token counts, image hashes
    runner_times: StepTimes = field(default_factory=StepTimes)  # where the runner's time went
    schedule_s: float = 0.0  # scheduling, state updates, and (``step``) the outputs


# Every engine of this process that holds GPU memory, so that a start which finds too little
# free can say which of them hold it.
_live_engines: weakref.WeakSet[LLMEngine] = weakref.WeakSet()


class _SchedulingFailed(Exception):
    """Scheduling raised; every request was failed (``outputs``)."""

    def __init__(self, outputs: list[CoreOutput]) -> None:
        super().__init__("scheduling failed")
        self.outputs = outputs


class LLMEngine:
    """Admits requests and steps them. ``close()`` (or dropping the last reference) gives back
    everything it took, so a later engine in the same process plans exactly as this one did."""

    _closed = False  # set by close(); a class default so that a half-built engine closes too
    _froze = False  # start-up's objects were frozen out of the collector's walk (collector.py)

    _stepped_by: str | None = None  # who steps the engine now (``claim_steps``)
    _stepping_lock = threading.Lock()

    def __init__(self, config: EngineConfig, detokenize: bool = True) -> None:
        """``detokenize`` False: the engine core of a front end that detokenizes and makes
        the outputs itself (the server's ``EngineClient``, in either layout): ``core_step``
        gives what each step did to each request, ``step`` is not for it. A start that fails
        gives back what it took before raising (the weights, a GPU's memory, the workers), not
        once the exception's traceback, which holds this half-built engine, is dropped."""
        try:
            self._start(config, detokenize)
        except BaseException:
            try:
                self.close()
            except Exception:  # noqa: BLE001 (the start's error is the one to raise)
                logger.warning("giving back what a failed start took failed", exc_info=True)
            raise

    def _start(self, config: EngineConfig, detokenize: bool) -> None:
        from transformers import AutoConfig

        require_model_dir(config.model)
        # An embedding's pooling and normalization, before anything loads: as set, else as
        # a sentence-transformers checkpoint declares them, else the last token's, normalized.
        pooling_type, normalize = resolved_pooling(config)
        config = config.replace(pooling_type=pooling_type, normalize_embeddings=normalize)
        torch.manual_seed(config.seed)
        hf_config = AutoConfig.from_pretrained(config.model, local_files_only=True)
        dtype = config.torch_dtype
        device = config.resolved_device
        runner_cls = runner_class(device)
        # Read before the weights load: on the CPU they come out of the RAM available now.
        memory_bytes = memory_profiler.device_memory(torch.device(device))
        if config.worker_processes:
            # Started first: they import and load their shards while this process builds
            # its processor; waited for below.
            split_encoder = config.mm_encoder_tp_mode == "weights"
            check_tensor_parallel(hf_config, dtype, config.tensor_parallel_size, split_encoder)
            self.runner = MultiprocExecutor(WorkerSpec(
                config.model, device, dtype, config.block_size, config.seed,
                config.cpu_threads if isinstance(config.cpu_threads, int) else None,
                config.tensor_parallel_size, config.worker_timeout, split_encoder,
                config.lora_slots))
        self.processor, self.grammars = processor_and_grammars(config, hf_config)
        self._matchers = Matchers()  # the constrained requests' grammar state
        # Requests of the step being built whose grammar allows no next token: failed when
        # the step ends, whatever their row sampled (``_constrain``, ``_fail_dead_ends``).
        self._dead_ends: dict[str, str] = {}
        if (device == "cuda" and config.kv_cache_memory is None
                and not config.worker_processes):
            self._check_free_gpu_memory(config, memory_bytes)
        self.hf_config = hf_config
        # With asynchronous scheduling a CPU runner in this process computes on a thread of
        # its own; it is built there too, and everything it does runs there (torch's parallel
        # regions run slower once a second thread has started some: compute_thread.py). A
        # runner that only queues its steps on a GPU launches them from this thread.
        self._compute = (ComputeThread("mmserve-steps")
                         if config.schedules_ahead and not config.worker_processes
                         and not runner_cls.launches_asynchronously else None)
        on_runner_thread = self.on_runner_thread
        if config.worker_processes:
            # Workers load their shards and build their runners; this process holds none.
            self.runner.wait_started()
            self.model = None
            weights_bytes = self.runner.weights_bytes
        else:
            self.model, weights_bytes = on_runner_thread(
                runner_cls.load_model, config.model, hf_config, dtype, config.lora_slots)
            # No KV cache until the plan sizes it.
            self.runner = on_runner_thread(runner_cls, self.model, 0, config.block_size, dtype,
                                           config.seed)
            if device == "cuda":
                _live_engines.add(self)
            on_runner_thread(self.runner.set_threads, config.cpu_threads)
        self.weights_bytes = weights_bytes
        # The same planning as `mmserve plan`, with the real weights and, on a GPU, the
        # allocator's peak; on the CPU the meta-device dry run is what a real run allocates.
        # (On the runner's thread too: the dry run builds the model on the meta device, and
        # its rotary tables are computed.)
        startup = on_runner_thread(plan_for, config, hf_config, self.processor.family, device,
                                   memory_bytes, weights_bytes,
                                   None if device == "cpu" else self._measure_profile_peak)
        self.plan, self.encoder_budget = startup.plan, startup.encoder_budget
        for warning in self.plan.warnings:
            logger.warning("memory plan: %s", warning)
        self.config = config.replace(max_model_len=self.plan.max_model_len,
                                     max_num_seqs=self.plan.max_num_seqs)
        on_runner_thread(self.runner.allocate_kv_cache, self.plan.num_blocks)
        if not config.enforce_eager:
            on_runner_thread(self.runner.capture_model, self.plan.max_num_seqs,
                             self.plan.max_model_len, self.processor.family.position_rows)
        kv_cache = KVCacheManager(self.plan.num_blocks, config.block_size,
                                  config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=self.plan.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.plan.max_model_len,
                block_size=config.block_size,
                delay_factor=config.scheduler_delay_factor,
                policy=config.scheduling_policy,
            ),
            kv_cache,
            self.encoder_budget,
            KVLending(kv_cache.pool, self.runner.kv_block_elements,
                      hf_config.text_config.hidden_size,
                      take_prefix_blocks=self.plan.encoder_displaces_prefix)
            if self.plan.encoder_borrowing else None,
            queue_aware_eviction=config.encoder_cache_eviction == "queue-aware",
            lora_slots=LoRASlots(config.max_loras) if config.enable_lora else None,
        )
        # Text, stop strings and the requests' outputs (output_processor.py).
        self.output_processor = (OutputProcessor(self.processor.tokenizer) if detokenize
                                 else None)
        # Each prompt token's log-probabilities, for the requests that asked, until they
        # go out with the request's first output.
        self._prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        # Wall seconds spent in steps (scheduling, the runner, the outputs): against a
        # server's uptime, the share of it the engine computed rather than waited for work.
        self.step_seconds = 0.0
        self.num_failed_requests = 0
        # Preprocessing above this (and the step's peak activations) gives memory back.
        self.request_maker = RequestMaker(
            self.processor, self.grammars, self.plan.max_model_len, config.limit_mm_per_prompt,
            self.encoder_budget.cache_tokens, max(64 << 20, self.plan.activation_bytes),
            config.scheduling_policy, config.pooling_type, lora_checker(config, hf_config))
        self._failed_steps_in_a_row = 0
        self._failing: set[str] = set()  # requests whose num_failed_steps is not 0
        self._dead: str | None = None
        # Steps handed to the runner and not finished yet, oldest first: one, or two while
        # one runs and the next was scheduled ahead (asynchronous scheduling, where the
        # runner's steps compute beside this thread, ``_steps``: each with its number there;
        # synchronously, with its result). ``_stale``: requests whose result in the next
        # step is void.
        self._submitted: deque[tuple[SchedulerOutput, Any]] = deque()
        self._stale: set[str] = set()
        self._aborting: set[str] = set()  # aborted, released once their steps are collected
        self._schedule_s = 0.0  # the current step's scheduling time, so far
        self.num_steps_ahead = 0  # steps scheduled while the one before computed
        self._steps: StepThread | InlineSteps | MultiprocExecutor | None = None
        if config.schedules_ahead:
            self._steps = (self.runner if isinstance(self.runner, MultiprocExecutor)
                           else StepThread(self.runner, self._compute) if self._compute
                           else InlineSteps(self.runner))
        # Full collections would otherwise walk every object start-up made (collector.py).
        freeze_long_lived()
        self._froze = True
        logger.info("mmserve engine ready, dtype=%s, encoder compute budget %d tokens per "
                    "step\n%s", dtype, self.encoder_budget.compute_tokens, self.plan.summary())

    @staticmethod
    def _check_free_gpu_memory(config: EngineConfig, total: int) -> None:
        """The budget is a share of the GPU's total memory: that much must be free (as vLLM).
        Memory this process's allocator caches but no tensor uses counts as free."""
        util = config.gpu_memory_utilization or default_memory_utilization("cuda")
        message = gpu_memory_shortfall(
            int(total * util), total, torch.cuda.mem_get_info()[0],
            torch.cuda.memory_reserved(), torch.cuda.memory_allocated(),
            [e.device_bytes for e in list(_live_engines)])
        if message is not None:
            raise InfeasiblePlanError(f"gpu_memory_utilization={util:g} {message}")

    def _measure_profile_peak(self, batch: ProfileBatch) -> tuple[int, str]:
        """Run the profile batch on the device; its allocator's peak (the planned KV cache
        replaces the blocks the batch writes)."""
        self.on_runner_thread(self.runner.allocate_kv_cache,
                               profile_blocks(batch.scheduler_output))
        peak = self.on_runner_thread(self.runner.measure_profile_peak,
                                      batch.scheduler_output, batch.encoder_pixels)
        return peak, f"measured: {self.runner.device.type} allocator peak of the profile run"

    # ----------------------------------------------------------------- requests
    def on_runner_thread(self, fn, *args):
        """``fn(*args)`` on the thread the runner computes on (this one, unless asynchronous
        scheduling gave the runner a thread of its own): torch work beside the engine's, such
        as a benchmark's measurement, belongs there (``compute_thread.py``)."""
        compute = getattr(self, "_compute", None)
        return fn(*args) if compute is None else compute.call(fn, *args)

    def add_request(
        self,
        prompt: dict[str, Any] | str,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request of one completion. Raises InvalidInputError saying
        what to change."""
        if sampling_params is not None and sampling_params.n != 1:
            raise InvalidInputError(
                f"LLMEngine.add_request queues one completion, not n={sampling_params.n}: use "
                "LLM.generate, or process_request and fork_request.", param="n")
        return self.add_processed_request(
            self.process_request(prompt, sampling_params, request_id))

    def process_request(
        self,
        prompt: dict[str, Any] | str,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Validate and tokenize a prompt into a ``Request`` without queueing it.

        Reads no scheduler state, so a server may run it beside the thread that steps the
        engine, from several threads at once (``RequestMaker``).
        """
        if self._closed:
            raise EngineDeadError("the engine is closed")
        return self.request_maker.make(prompt, sampling_params or SamplingParams(),
                                       request_id if request_id is not None
                                       else self.next_request_id())

    def fork_request(self, req: Request, request_ids: list[str]) -> list[Request]:
        """The ``n`` completions of a request made by ``process_request``
        (``RequestMaker.fork``)."""
        return RequestMaker.fork(req, request_ids)

    @contextlib.contextmanager
    def stepping(self, who: str) -> Iterator[None]:
        """Hold the engine's steps for ``who`` while the block runs (``claim_steps``)."""
        self.claim_steps(who)
        try:
            yield
        finally:
            self.release_steps()

    def claim_steps(self, who: str) -> None:
        """Hold the engine's steps for ``who`` (a call of the Python API, a server's engine
        loop) until ``release_steps``. Two callers stepping one engine at once would mix
        their steps and requests, so the second is refused with a ``RuntimeError`` that
        names the first."""
        with LLMEngine._stepping_lock:
            if self._stepped_by is not None:
                raise RuntimeError(
                    f"this engine is being stepped by {self._stepped_by}, so {who} cannot "
                    "step it meanwhile: send the requests through that, or make another "
                    "engine (another LLM) for them")
            self._stepped_by = who

    def release_steps(self) -> None:
        """Let go of the claim ``claim_steps`` made (called by whoever made it)."""
        self._stepped_by = None

    def next_request_id(self) -> str:
        """A request id no other request of this engine has been given."""
        return str(next(self._ids))

    def add_processed_request(self, req: Request) -> str:
        """Queue a request made by ``process_request`` (of one completion: ``fork_request``
        makes those of ``n``)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if req.sampling_params.n != 1:
            raise ValueError(f"a request of n={req.sampling_params.n} completions is queued "
                             "as its fork_request children")
        if req.request_id in self.scheduler.requests:
            raise InvalidInputError(f"request id {req.request_id!r} is already in use")
        if self.output_processor is not None:
            self.output_processor.add(req)
        if req.sampling_params.prompt_logprobs is not None:
            self._prompt_logprobs[req.request_id] = [None]  # the first token has none
        if req.grammar is not None:
            self._matchers.add(req.request_id, req.grammar)
        self.scheduler.add_request(req)
        return req.request_id

    def abort_request(self, request_id: str) -> None:
        """Finish the request and release what it holds; no output of it follows. While a
        step in flight holds it (asynchronous scheduling) its blocks are released once that
        step is collected: if its chunk there fails, the blocks it published leave the
        prefix cache as a failed request's do."""
        if self.output_processor is not None:
            self.output_processor.abort(request_id)
        self._prompt_logprobs.pop(request_id, None)
        self._matchers.remove(request_id)
        req = self.scheduler.requests.get(request_id)
        if req is not None and self._in_flight(request_id):
            req.aborting = True
            self._aborting.add(request_id)
            return
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _in_flight(self, request_id: str) -> bool:
        return any(request_id in step.request_ids() for step, _ in self._submitted)

    def _release_aborted(self) -> None:
        """Finish the aborted requests that no step in flight holds any more."""
        for request_id in [r for r in self._aborting if not self._in_flight(r)]:
            self._aborting.discard(request_id)
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Whether a request is waiting or running. With asynchronous scheduling a step
        scheduled ahead may still be in flight when none is (its work is void: every request
        in it has finished); the next ``step`` collects it."""
        return self.scheduler.has_unfinished()

    @property
    def is_dead(self) -> bool:
        """Whether the engine serves no more (closed, a worker lost, every step failing):
        ``step`` raises ``EngineDeadError`` saying why."""
        return self._dead is not None

    def collect_steps_in_flight(self) -> list[RequestOutput]:
        """Collect the steps handed to the runner and not collected yet, scheduling none, and
        return their outputs. With asynchronous scheduling a step is left in flight after
        each ``step``; a request aborted while it holds one releases its KV blocks and
        encoder-cache references only once that step is collected: here, rather than at the
        next ``step`` (a caller that aborts everything it asked for and stops stepping)."""
        if self.is_dead:
            raise EngineDeadError(self._dead)
        self._require_processor(True)
        outputs: list[CoreOutput] = []
        while self._submitted:
            scheduler_output, result = self._take()
            outputs += self._finish_step(scheduler_output, result)
        return self._assemble(outputs)

    # ----------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests it changed.

        A step never fails for more requests than it must: the runner reruns a failed batch
        request by request, and the requests that fail alone are finished with
        ``finish_reason="error"`` (their blocks and encoder references released) while the
        others go on. Raises ``EngineDeadError`` only once steps keep failing for every
        request, old ones included (``MAX_FAILED_STEPS``): then nothing can be served.
        """
        return self.step_with_record()[0]

    def step_with_record(self) -> tuple[list[RequestOutput], StepRecord]:
        """``step``, and a ``StepRecord`` of what it did: the batch it scheduled, the runner's
        timings and the time spent scheduling, updating and detokenizing (``mmserve bench``
        builds its per-step timeline from these).

        With ``async_scheduling`` the next step is scheduled and handed to the runner while
        this one computes (``_schedule_ahead``), and this one's outputs are made while the
        next computes; a step returns the outputs of the step before it then."""
        self._require_processor(True)
        core_outputs, record = self._core_step_with_record()
        t0 = time.perf_counter()
        with phase("outputs"):
            outputs = self._assemble(core_outputs)
        assembled = time.perf_counter() - t0
        record.schedule_s += assembled
        self.step_seconds += assembled
        return outputs, record

    def core_step(self) -> list[CoreOutput]:
        """``step`` without the text: what the step did to each request it changed, for an
        ``OutputProcessor`` elsewhere (an engine built with ``detokenize=False``), whose
        caller ends a request a stop string finished with ``abort_request``."""
        return self.core_step_with_record()[0]

    def core_step_with_record(self) -> tuple[list[CoreOutput], StepRecord]:
        """``core_step``, and the step's ``StepRecord``."""
        self._require_processor(False)
        return self._core_step_with_record()

    def _require_processor(self, wanted: bool) -> None:
        """Refuse, before stepping, a step whose outputs nobody would make."""
        if wanted and self.output_processor is None:
            raise RuntimeError("this engine's outputs are made by its front end "
                               "(detokenize=False): call core_step")
        if not wanted and self.output_processor is not None:
            raise RuntimeError("this engine makes its own outputs: call step, or build it "
                               "with detokenize=False")

    def _core_step_with_record(self) -> tuple[list[CoreOutput], StepRecord]:
        t0 = time.perf_counter()
        try:
            return self._core_step()
        finally:
            self.step_seconds += time.perf_counter() - t0

    def _core_step(self) -> tuple[list[CoreOutput], StepRecord]:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self._schedule_s = 0.0
        if not self._submitted:
            try:
                scheduler_output = self._schedule()
            except _SchedulingFailed as failed:
                return failed.outputs, StepRecord(SchedulerOutput(),
                                                  schedule_s=self._schedule_s)
            self._submit(scheduler_output)
        try:
            self._schedule_ahead()
        except _SchedulingFailed as failed:  # every request is failed: drop what is in flight
            while self._submitted:
                self._take()
            return failed.outputs, StepRecord(SchedulerOutput(), schedule_s=self._schedule_s)
        scheduler_output, result = self._take()
        t0 = time.perf_counter()
        with phase("update"):
            outputs = self._finish_step(scheduler_output, result)
        return outputs, StepRecord(scheduler_output, result.times,
                                   self._schedule_s + time.perf_counter() - t0)

    def _schedule(self, pending: frozenset[str] | None = None) -> SchedulerOutput:
        """The next step, its constrained requests' bitmasks added; a failure of the books
        fails every request (``_SchedulingFailed`` carries their outputs). Its time goes
        into the step's ``schedule_s``."""
        t0 = time.perf_counter()
        try:
            with phase("schedule"):
                return self._schedule_timed(pending)
        finally:
            self._schedule_s += time.perf_counter() - t0

    def _schedule_timed(self, pending: frozenset[str] | None) -> SchedulerOutput:
        """``pending`` None: the step after the last one collected; else scheduling ahead
        of the step in flight, whose sampling requests these are."""
        try:
            scheduler_output = (self.scheduler.schedule() if pending is None
                                else self.scheduler.schedule(pending, ahead=True))
        except Exception as e:  # a bug in the books: fail what is in flight, keep the engine
            logger.exception("scheduling failed; failing every request in flight")
            raise _SchedulingFailed(
                self._fail_all(f"scheduling failed: {type(e).__name__}: {e}")) from e
        self._constrain(scheduler_output)
        return scheduler_output

    def _submit(self, scheduler_output: SchedulerOutput) -> None:
        pixels = self._encoder_pixels(scheduler_output)
        if self._steps is None:  # synchronous: run it now
            result = self._dead_on_worker_loss(
                lambda: self.runner.execute(scheduler_output, pixels))
            self._submitted.append((scheduler_output, result))
        else:
            seq = self._dead_on_worker_loss(
                lambda: self._steps.submit(scheduler_output, pixels))
            self._submitted.append((scheduler_output, seq))

    def _take(self) -> tuple[SchedulerOutput, ModelOutput]:
        """The oldest step submitted, and its result (waiting for it)."""
        scheduler_output, handle = self._submitted.popleft()
        if self._steps is None:
            return scheduler_output, handle
        with phase("collect"):  # a step launched before: its tokens, once it is done
            return scheduler_output, self._dead_on_worker_loss(
                lambda: self._steps.collect(handle))

    def _dead_on_worker_loss(self, call):
        try:
            return call()
        except EngineDeadError as e:  # a tensor-parallel worker died or hung
            self._dead = str(e)
            if self.output_processor is not None:
                self.output_processor.clear()  # nothing more is output
            raise

    def _schedule_ahead(self) -> None:
        """With asynchronous scheduling, schedule and submit the step after the one in
        flight, its requests that sample there given ``PENDING_TOKEN``s. Not while a request
        with a grammar samples there (its next bitmask needs that token), nor while the step
        in flight encodes images (an image that fails must not be used, spilled or hit by
        the next step) or loads a LoRA adapter, nor after a failure: the step after is then
        scheduled once the step in flight is collected."""
        if self._steps is None or len(self._submitted) != 1 or self._stale:
            return  # (after a failure, the step in flight is partly void: wait for it)
        in_flight = self._submitted[0][0]
        if in_flight.images_to_encode:
            return  # which of its images fail to encode decides what may use or spill them
        if in_flight.loads_lora:
            return  # an adapter that fails to load fails its requests: none may build on them
        pending = frozenset(in_flight.sampling_ids())
        if self._matchers and any(rid in self._matchers for rid in pending):
            return
        ahead = self._schedule(pending)
        if (ahead.num_requests or ahead.freed_encoder_hashes or ahead.encoder_restores
                or ahead.encoder_spills or ahead.finished_request_ids):
            self._submit(ahead)
            self.num_steps_ahead += 1

    def _assemble(self, core_outputs: list[CoreOutput]) -> list[RequestOutput]:
        """The request outputs of core outputs; a request a stop string finished is finished
        here too."""
        assert self.output_processor is not None
        outputs, stopped = self.output_processor.process(core_outputs)
        for request_id in stopped:
            self._matchers.remove(request_id)
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
        return outputs

    def _finish_step(self, scheduler_output: SchedulerOutput,
                     result: ModelOutput) -> list[CoreOutput]:
        """Apply a step's result: failures, sampled tokens, stops; what it did to each
        request."""
        stale, self._stale = self._stale, set()
        if stale:  # their step before failed: what this one did for them is void
            for found in (result.sampled, result.errors, result.logprobs,
                          result.prompt_logprobs, result.embeddings, result.lora_failures):
                for rid in stale:
                    found.pop(rid, None)
            scheduler_output = scheduler_output.without(stale)
        self._note_prompt_logprobs(result)
        failed = (self._fail_dead_ends(scheduler_output, result)
                  + self._fail_lora_failures(result)
                  + self._handle_failures(scheduler_output, result))
        if self._submitted:  # the step after, scheduled ahead: void for requests whose
            # token it computes from did not come, or whose step here failed or is redone
            self._stale = _void_ahead(self._submitted[0][0], result)
        changed = self.scheduler.update(scheduler_output, result)
        self.num_steps += 1
        outputs = [self._error_output(req) for req in failed if not req.aborting]
        # Once per request every step: the lookups are hoisted, and the tables of what few
        # requests ask for (log-probabilities, grammars) are looked in only when not empty.
        all_logprobs, prompt_logprobs, matchers = (result.logprobs, self._prompt_logprobs,
                                                   self._matchers)
        embeddings = result.embeddings
        for req in changed:
            if req.aborting:
                continue
            rid = req.request_id
            logprobs = all_logprobs.get(rid) if all_logprobs else None
            if matchers and rid in matchers and not self._follow_grammar(req):
                outputs.append(self._error_output(req, with_last_token=True, logprobs=logprobs))
                continue
            finished = req.finished
            if finished and matchers:
                matchers.remove(rid)
            outputs.append(CoreOutput(
                rid, req.all_token_ids[-1:], req.status.finish_reason if finished else None,
                None, req.num_cached_tokens or 0, logprobs,
                prompt_logprobs.pop(rid, None) if prompt_logprobs else None,
                embeddings.get(rid) if embeddings else None))
        if self._aborting:
            self._release_aborted()
        return outputs

    def _constrain(self, scheduler_output: SchedulerOutput) -> None:
        """Give each constrained request that samples in this step the bitmask of the tokens
        its grammar allows next (nothing to do, every step, while none has a grammar)."""
        if not self._matchers:
            return
        sampling = [r for r in scheduler_output.chunks if r.sample]  # (no decode rows)
        masks = self._matchers.bitmasks([r.request_id for r in sampling],
                                        self.grammars.vocab_size)
        for sched, mask in zip(sampling, masks, strict=True):
            if mask is not None and not bool(mask.any()):  # a dead end: its row samples
                # unconstrained, and the request fails when the step ends (its own doing,
                # not the step's: sampling from no token at all would count as the step's)
                self._dead_ends[sched.request_id] = (
                    "its structured_outputs grammar allows no token after the text generated "
                    "so far, so no text completes it; check the grammar (a rule that only "
                    "refers to itself never ends)")
                mask = None
            sched.token_bitmask = mask

    def _fail_lora_failures(self, result: ModelOutput) -> list[Request]:
        """Fail the requests whose LoRA adapter did not load (not retried, nor counted as a
        failed step: the adapter's files are at fault, not the device). Its slot is forgotten,
        so that its next request loads it anew (no step is scheduled ahead of that one)."""
        failed = []
        for rid, reason in result.lora_failures.items():
            req = self.scheduler.requests.get(rid)
            if req is not None and req.lora_slot >= 0:  # (held until the request is freed)
                self.scheduler.lora_slots.forget(req.lora_slot)
            if req is not None and not req.finished:
                self.scheduler.fail_request(rid, reason)
                failed.append(req)
        self.num_failed_requests += len(failed)
        return failed

    def _fail_dead_ends(self, scheduler_output: SchedulerOutput,
                        result: ModelOutput) -> list[Request]:
        """Fail the requests whose grammar allowed no token where they sampled in the step
        that ended (``_constrain``); their rows' tokens and errors are dropped. A dead end
        found for the step scheduled ahead of it waits for that step to end."""
        if not self._dead_ends:
            return []
        requests = self.scheduler.requests
        sampled_here = set(scheduler_output.sampling_ids())
        failed = []
        for rid in list(self._dead_ends):
            if rid not in requests:  # finished meanwhile (aborted)
                del self._dead_ends[rid]
            elif rid in sampled_here:
                reason = self._dead_ends.pop(rid)
                for found in (result.sampled, result.errors, result.logprobs,
                              result.embeddings):
                    found.pop(rid, None)
                req = requests[rid]
                if not req.finished:
                    logger.error("request %s: %s", rid, reason)
                    self.scheduler.fail_request(rid, reason)
                    failed.append(req)
        self.num_failed_requests += len(failed)
        return failed

    def _follow_grammar(self, req: Request) -> bool:
        """Feed the request's new token to its grammar; finish the request when the grammar
        has ended. False (the request failed) if the grammar refuses the token, which the
        step's bitmask should have made impossible."""
        accepted, ended = self._matchers.accept(req.request_id, req.all_token_ids[-1])
        if not accepted:
            req.error = (f"the sampled token {req.all_token_ids[-1]} breaks the request's "
                         "structured_outputs grammar")
            logger.error("request %s: %s", req.request_id, req.error)
            self.scheduler.fail_request(req.request_id, req.error)
            self.num_failed_requests += 1
            return False
        if ended and not req.finished:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        return True

    def _note_prompt_logprobs(self, result: ModelOutput) -> None:
        """Add a step's prompt logprobs to their requests' lists: only positions not seen yet
        (a chunk run again after a preemption or a failed step brings them twice)."""
        for request_id, (first, entries) in result.prompt_logprobs.items():
            found = self._prompt_logprobs.get(request_id)
            if found is not None and first <= len(found) < first + len(entries):
                found.extend(entries[len(found) - first:])

    def _encoder_pixels(self, scheduler_output: SchedulerOutput) -> dict[str, EncoderInput]:
        """The encoder inputs of the images this step encodes, taken from the requests that
        show them (an image to encode overlaps its request's scheduled tokens, so it has a
        slice)."""
        to_encode = scheduler_output.images_to_encode
        pixels: dict[str, EncoderInput] = {}
        if not to_encode:
            return pixels
        for sched in scheduler_output.chunks:
            if not sched.image_slices:
                continue
            for image in self.scheduler.requests[sched.request_id].images:
                if image.hash in to_encode:
                    pixels.setdefault(image.hash, image.pixel_values)
        return pixels

    def _handle_failures(self, scheduler_output: SchedulerOutput,
                         result: ModelOutput) -> list[Request]:
        """Fail or retry the requests the step failed for (see ``MAX_FAILED_STEPS``); returns
        those finished with an error. Raises ``EngineDeadError`` when the device is gone. A
        step with no request left (all void, scheduled ahead of a failure) counts nothing."""
        if not scheduler_output.num_requests:
            return []
        requests = self.scheduler.requests
        if self._failing:  # "in a row": a request a step ran without error counts anew
            ran = set(scheduler_output.request_ids())
            for rid in list(self._failing):
                req = requests.get(rid)
                if req is None:  # finished
                    self._failing.discard(rid)
                elif rid in ran and rid not in result.errors:
                    req.num_failed_steps = 0
                    self._failing.discard(rid)
        if not result.errors:
            self._failed_steps_in_a_row = 0
            return []
        failed, old = [], False
        for sched in scheduler_output.requests:  # (a failed step: objects are affordable)
            reason = result.errors.get(sched.request_id)
            req = self.scheduler.requests.get(sched.request_id)
            if reason is None or req is None:
                continue
            req.num_failed_steps += 1
            self._failing.add(req.request_id)
            old = old or req.num_output_tokens > 0
            if req.num_output_tokens > 0 and req.num_failed_steps < MAX_FAILED_STEPS:
                self.scheduler.retry_request(req.request_id, sched.start_pos)
            else:
                self.scheduler.fail_request(req.request_id, reason)
                failed.append(req)
        self.num_failed_requests += len(failed)
        everyone = len(result.errors) == scheduler_output.num_requests
        self._failed_steps_in_a_row = self._failed_steps_in_a_row + 1 if everyone and old else 0
        if self._failed_steps_in_a_row >= MAX_FAILED_STEPS:
            self._dead = (f"the last {MAX_FAILED_STEPS} engine steps failed for every request, "
                          f"requests that had run fine before among them "
                          f"({next(iter(result.errors.values()))}); the device or the engine "
                          "is broken, restart it.")
            logger.critical(self._dead)
            self._fail_all(self._dead)  # their outputs: the error raised instead
            if self.output_processor is not None:
                self.output_processor.clear()
            raise EngineDeadError(self._dead)
        return failed

    def _fail_all(self, reason: str) -> list[CoreOutput]:
        """Finish every live request with an error (what is left after a failure that no
        request can be blamed for)."""
        outputs = []
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            req.error = reason
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
            outputs.append(self._error_output(req))
        self.num_failed_requests += len(outputs)
        return outputs

    def _error_output(self, req: Request, with_last_token: bool = False,
                      logprobs: TokenLogprobs | None = None) -> CoreOutput:
        """A failed request's last core output: with ``with_last_token`` the token the step
        sampled (a grammar refused it), and its ``logprobs``."""
        self._matchers.remove(req.request_id)
        self._prompt_logprobs.pop(req.request_id, None)
        return CoreOutput(req.request_id, req.all_token_ids[-1:] if with_last_token else [],
                          "error", req.error, req.num_cached_tokens or 0, logprobs)

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine cannot serve (closed, or a tensor-parallel
        worker gone), without a step: what the server looks at while idle."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        try:
            self.runner.check_health()
        except EngineDeadError as e:
            self._dead = str(e)
            raise

    def time_device(self, on: bool = True) -> BusyTimer | None:
        """Time the device's work in each step from now on (``busy_timer.py``): the timer,
        whose ``total_s()`` sums it. ``on=False`` stops timing. None where the runner is in
        worker processes (tensor parallelism)."""
        if self.model is None:
            return None
        self.runner.busy_timer = BusyTimer(self.runner.device) if on else None
        return self.runner.busy_timer

    # ----------------------------------------------------------------- lifetime
    @property
    def device_bytes(self) -> int:
        """What the engine holds on its device: weights and KV cache (the encoder cache and
        CUDA graphs come on top)."""
        if self._closed:
            return 0
        return self.weights_bytes + self.runner.kv_cache_bytes

    def close(self) -> None:
        """Give back everything the engine took: the KV and encoder caches, the weights, CUDA
        graphs and their memory pool, and the CPU thread count it lowered or fixed; the
        allocator's freed memory goes back to the operating system or the driver. Requests
        still in flight are aborted. Calling it again does nothing; stepping afterwards raises
        ``EngineDeadError``."""
        if self._closed:
            return
        self._closed = True
        self._dead = "the engine is closed"
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            for req in [*scheduler.running, *scheduler.waiting]:
                self.abort_request(req.request_id)
        steps = getattr(self, "_steps", None)
        if isinstance(steps, StepThread | InlineSteps):
            steps.close()  # after the steps in flight
        runner = getattr(self, "runner", None)
        if runner is not None:
            self.on_runner_thread(runner.close)
        self.model = None
        _live_engines.discard(self)
        # Tensors held only by reference cycles (tracebacks, closures): thawing collects.
        if self._froze:
            self._froze = False
            thaw()
        else:
            gc.collect()
        if runner is not None:
            self.on_runner_thread(runner.release_memory)
        compute = getattr(self, "_compute", None)
        if compute is not None:
            compute.close()

    def __del__(self) -> None:
        compute = getattr(self, "_compute", None)
        if compute is not None and threading.get_ident() == compute.ident:
            # Collected by the garbage collector on the runner's own thread, maybe inside a
            # step: close once the work in hand is done.
            with contextlib.suppress(Exception):
                compute.submit(self.close)
            return
        with contextlib.suppress(Exception):  # also at interpreter exit, half torn down
            self.close()

    # ----------------------------------------------------------------- stats
    def reset_caches(self) -> None:
        """Forget the cached prefix blocks and image embeddings no request is using, so that
        the next requests find both caches cold (benchmark turns, tests)."""
        self.scheduler.kv_cache.pool.reset_prefix_cache()
        self.scheduler.encoder_cache.evict_unreferenced()

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
            "encoder_cache_kv_pressure_evictions": enc.num_kv_pressure_evictions,
            "encoder_cache_tokens": enc.cache_size,
            "encoder_cache_used_tokens": enc.num_used_tokens,
            "encoder_cache_borrowed_entries": len(enc.borrowed),
            "encoder_cache_borrowed_tokens": enc.num_borrowed_tokens,
            "encoder_cache_borrowed_bytes": (enc.num_borrowed_blocks * self.config.block_size
                                             * self.plan.kv_bytes_per_token),
            "encoder_cache_spills": enc.num_spills,
            "encoder_cache_restores": enc.num_restores,
            "encoder_cache_referenced_entries": enc.num_referenced_entries(),
            "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
            "prefix_cache_queried_tokens": s.prefix_cache_queried_tokens,
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_free": pool.num_free_blocks,
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_steps": self.num_steps,
            "step_seconds": self.step_seconds,
            "num_scheduled_tokens": s.num_scheduled_tokens,
            "cpu_threads": self.runner.num_threads,
            "num_failed_requests": self.num_failed_requests,
            "preprocess_peak_bytes": self.request_maker.preprocess_peak_bytes,
            "num_memory_releases": self.request_maker.num_memory_releases,
        }


def _void_ahead(step: SchedulerOutput, result: ModelOutput) -> set[str]:
    """The requests of ``step``, scheduled ahead of the step that gave ``result``, whose work
    there is void: that step failed for them, or gave no token for them to continue from."""
    errors, sampled = result.errors, result.sampled
    if result.lora_failures:  # (failed outright: nothing to continue from)
        errors = {**errors, **result.lora_failures}
    decodes = step.decodes
    void = {rid for rid, token in zip(decodes.request_ids, decodes.token_ids, strict=True)
            if token == PENDING_TOKEN and rid not in sampled}
    if errors:
        void.update(rid for rid in decodes.request_ids if rid in errors)
    void.update(r.request_id for r in step.chunks if r.request_id in errors
                or (r.token_ids[-1] == PENDING_TOKEN and r.request_id not in sampled))
    return void


def gpu_memory_shortfall(needed: int, total: int, free: int, reserved: int, allocated: int,
                         engines: list[int]) -> str | None:
    """None when ``needed`` bytes of the GPU's ``total`` can be had, else what stands in the
    way, saying whose memory it is. ``free`` is the driver's free memory; ``reserved`` and
    ``allocated`` are this process's allocator (what it caches for reuse, of which live tensors
    use ``allocated``); ``engines`` the device bytes of each live engine in this process."""
    available = free + max(0, reserved - allocated)
    if available >= needed:
        return None
    others = max(0, total - free - reserved)
    parts = []
    if engines:
        sizes = ", ".join(f"{b / 2**30:.2f} GiB" for b in engines)
        parts.append(f"{len(engines)} other engine{'s' if len(engines) > 1 else ''} of this "
                     f"process hold{'' if len(engines) > 1 else 's'} {sizes} (close "
                     "them first: LLM.close(), or `with LLM(...) as llm:`)")
    rest = allocated - sum(engines)
    if rest > 0:
        parts.append(f"other tensors of this process hold {rest / 2**30:.2f} GiB")
    if others > 0:
        parts.append(f"other processes hold {others / 2**30:.2f} GiB")
    return (f"asks for {needed} bytes but only {available} of {total} bytes are free or "
            f"cached by this process on the GPU: {'; '.join(parts) or 'nothing else is known'}"
            f"; lower --gpu-memory-utilization to at most {available / total:.2f}.")
