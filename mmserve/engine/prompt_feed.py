"""Prompts preprocessed ahead of an engine that steps on this thread: what ``LLM.generate`` and
``mmserve bench throughput`` share.

A batch of prompts is preprocessed (images decoded, resized and normalized, text tokenized) a
bounded window ahead of the engine and queued in input order, so the first step starts once
the first prompt is ready, not all of them, and any number of images takes bounded memory.
Beside a GPU engine a pool of threads preprocesses while the GPU computes; on the CPU the
stepping thread itself does, between steps, since the steps already take every core.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Container
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from mmserve.engine.llm_engine import LLMEngine
from mmserve.engine.request import Request
from mmserve.sampling_params import SamplingParams

# The fewest requests of a batch the engine may hold at once, whatever its max_num_seqs:
# waiting requests are what the scheduler plans the encoder cache by (an image a later request
# needs again is kept, or waits in free KV blocks).
MIN_REQUESTS_AHEAD = 64


def requests_ahead(max_num_seqs: int) -> int:
    """How many requests of a batch are held preprocessed or running at once."""
    return max(2 * max_num_seqs, MIN_REQUESTS_AHEAD)


def preprocess_pool(device: str) -> Executor:
    """Where a batch's prompts are preprocessed. Beside a GPU engine, threads: one per four
    cores this process may use (image decoding and resizing release the GIL), at least one, at
    most eight. On the CPU the calling thread, between steps: the engine's steps already take
    every core, and a thread beside them only contends (a 48-image caption batch of the demo
    model ran 0.5x as fast with one, on 2 cores)."""
    if device == "cpu":
        return InlineExecutor()
    workers = max(1, min(8, len(os.sched_getaffinity(0)) // 4))
    return ThreadPoolExecutor(workers, thread_name_prefix="mmserve-prep")


class InlineExecutor(Executor):
    """Runs each task when it is submitted, in the submitting thread."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 (raised where the result is taken)
            future.set_exception(e)
        return future


class PromptFeed:
    """Feeds ``prompts`` to ``engine`` in order: call ``top_up()`` before every step, and
    ``close()`` when done (in a ``finally``). ``ids[i]`` are prompt ``i``'s request ids, one per
    completion (``params[i].n``). ``on_queued(req)`` sees each request as it is queued.

    ``wait_s`` is the time the stepping thread spent in ``top_up`` waiting for preprocessing
    or doing it (on the CPU): what preprocessing cost the engine, as against what it took."""

    def __init__(self, engine: LLMEngine, prompts: list[dict[str, Any] | str],
                 params: list[SamplingParams], ids: list[list[str]],
                 on_queued: Callable[[Request], None] | None = None) -> None:
        self.engine = engine
        self.prompts, self.params, self.ids = prompts, params, ids
        self.on_queued = on_queued
        self.window = requests_ahead(engine.scheduler.max_num_seqs)
        self.pool = preprocess_pool(engine.config.resolved_device)
        self.pending: dict[int, Future] = {}  # prompt index -> its preprocessing
        self.submitted = self.queued = 0  # prompts handed to the pool; to the engine
        self.requests = 0  # completions of the submitted prompts
        self.wait_s = 0.0

    def top_up(self, num_finished: int) -> None:
        """Hand prompts to the pool while fewer than the window's requests of this batch are
        held (``num_finished`` of them have finished), then queue the ready ones, in order,
        waiting for the next only when the engine has nothing else to do. Raises what a
        prompt's preprocessing raised (an invalid prompt)."""
        start = time.perf_counter()
        engine = self.engine
        while (self.submitted < len(self.prompts)
               and self.requests - num_finished < self.window):
            i = self.submitted
            self.pending[i] = self.pool.submit(engine.process_request, self.prompts[i],
                                               self.params[i], self.ids[i][0])
            self.requests += self.params[i].n
            self.submitted += 1
        while self.queued < self.submitted and (self.pending[self.queued].done()
                                                or not engine.has_unfinished_requests()):
            req = self.pending.pop(self.queued).result()
            children = ([req] if req.sampling_params.n == 1
                        else engine.fork_request(req, self.ids[self.queued]))
            for child in children:
                engine.add_processed_request(child)
                if self.on_queued is not None:
                    self.on_queued(child)
            self.queued += 1
        self.wait_s += time.perf_counter() - start

    def abort(self, done: Container[str]) -> None:
        """Cancel the preprocessing not started, and abort the queued requests not in
        ``done``, so that the engine is left with every KV block free (after a bad prompt, an
        engine error, Ctrl-C): a step still in flight (asynchronous scheduling) is collected,
        its outputs dropped (the caller's requests are aborted, and no other runs meanwhile)."""
        for future in self.pending.values():
            future.cancel()
        for group in self.ids[:self.queued]:
            for rid in group:
                if rid not in done:
                    self.engine.abort_request(rid)
        if not self.engine.is_dead:
            self.engine.collect_steps_in_flight()

    def check_finished(self, done: Container[str]) -> None:
        """Raise if the engine stopped without finishing every request of the batch (a bug,
        not a state to hang in), aborting those it lost track of."""
        missing = [rid for group in self.ids for rid in group if rid not in done]
        if missing:
            for rid in missing:
                self.engine.abort_request(rid)
            raise RuntimeError(f"the engine stopped without finishing requests {missing}")

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
