"""The engine in one background thread, shared by every connection of the server.

Engine steps are synchronous torch work, so they run in a dedicated thread, never on the event
loop: the server stays responsive (``/health`` answers) during long steps. The thread owns the
``LLMEngine`` alone; best, it is the thread the engine was built on (``ComputeThread``:
torch's parallel regions run slower once a second thread has started some). The event loop
talks to it through a command queue (add, abort) that the thread drains between steps, and
gets outputs back through ``loop.call_soon_threadsafe``, one call per step, which fans them
out to per-request asyncio queues. No lock guards engine state because only one thread ever
touches it; the stats the server reads are a snapshot the thread publishes after each step.
A request's prompt processing (chat template, tokenizer, image
processor) runs on a small pool of preprocessing threads of its own while the engine keeps
stepping (the processor serialises only its tokenizer call, so one large image does not stall
the small ones), each computing with one torch thread; the engine thread only queues the
finished ``Request``.

A step that fails for some requests finishes those with ``finish_reason="error"`` and goes on
(``LLMEngine.step``). Only a broken engine (``EngineDeadError``, or an exception that escapes
a step) stops the loop: every in-flight request fails, ``is_alive`` turns False and
``on_dead`` is called, so the server can report it and exit for a supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from mmserve.engine.llm_engine import LLMEngine
from mmserve.engine.request import Request
from mmserve.errors import EngineDeadError
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams
from mmserve.worker.compute_thread import ComputeThread, single_threaded

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError", "RequestStream"]


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_waiting`` allows."""


class RequestObserver(Protocol):
    """Hooks for metrics, called on the event loop with times measured by the engine thread."""

    def on_first_token(self, seconds_since_arrival: float) -> None: ...

    def on_next_token(self, seconds_since_previous: float) -> None: ...

    def on_finished(self, finish_reason: str, num_prompt_tokens: int,
                    num_generation_tokens: int) -> None: ...


@dataclass
class RequestStream:
    """The outputs of one request, in order. Iterate with ``async for``."""

    request_id: str
    arrival_time: float  # time.monotonic() when the request was submitted
    delta: bool = False  # its outputs hold only what each step added (output_kind delta)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished: bool = False
    _queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


@dataclass
class _Add:
    request: Request
    done: Callable[[BaseException | None], None]


@dataclass
class _Abort:
    request_id: str


_STOP = object()
# Seconds between two looks at the engine's health while it has nothing to step (a
# tensor-parallel worker that dies while the server is idle turns /health 503 within this).
IDLE_CHECK_S = 1.0


class AsyncEngine:
    """Runs ``engine`` on ``compute`` (the thread it was built on; default: a thread of its
    own) once ``start()`` is called from the event loop.

    ``max_waiting`` bounds the requests admitted beyond the ``max_num_seqs`` that run at once;
    ``add_request`` refuses more with ``QueueFullError``. ``preprocess_workers`` threads turn
    prompts into requests (default: the CPU count, between 2 and 4). ``on_dead`` is called on
    the event loop if the engine loop stops by itself.
    """

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None,
                 observer: RequestObserver | None = None,
                 preprocess_workers: int | None = None,
                 on_dead: Callable[[BaseException], None] | None = None,
                 compute: ComputeThread | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.observer = observer
        self._streams: dict[str, RequestStream] = {}
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._own_compute = compute is None  # then made by ``start``
        self._compute = compute
        self._loop_done: Future[None] | None = None  # the engine loop, once started
        self._error: BaseException | None = None
        self.on_dead = on_dead
        workers = preprocess_workers or max(2, min(4, os.cpu_count() or 2))
        self._preprocess = ThreadPoolExecutor(workers, thread_name_prefix="mmserve-preprocess",
                                              initializer=single_threaded)
        self._stats: dict[str, Any] = engine.stats()

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine loop; call from the event loop that will read the outputs."""
        if self._loop_done is not None:
            raise RuntimeError("the engine loop is already started")
        self._loop = asyncio.get_running_loop()
        if self._compute is None:
            self._compute = ComputeThread()
        self._loop_done = self._compute.submit(self._run)

    async def shutdown(self) -> None:
        """Stop the engine loop after its current step; requests still in flight fail."""
        if self._loop_done is None:
            return
        self.stop()
        await asyncio.wrap_future(self._loop_done)
        if self._own_compute and self._compute is not None:
            self._compute.close()
        self._preprocess.shutdown(wait=False, cancel_futures=True)

    def stop(self) -> None:
        """Ask the engine loop to stop after its current step, from any thread, without
        waiting (``shutdown`` waits); harmless when it has stopped."""
        self._commands.put(_STOP)

    @property
    def is_alive(self) -> bool:
        return (self._loop_done is not None and not self._loop_done.done()
                and self._error is None)

    @property
    def error(self) -> BaseException | None:
        """Why the engine loop stopped by itself, if it did."""
        return self._error

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def has_room(self) -> bool:
        """Whether one more request may queue: those beyond the ``max_num_seqs`` that run at
        once count as waiting."""
        waiting = len(self._streams) - self.engine.config.max_num_seqs
        return self.max_waiting is None or waiting < self.max_waiting

    def stats(self) -> dict[str, Any]:
        """Engine counters as of the last step (see ``LLMEngine.stats``)."""
        return dict(self._stats)

    # ----------------------------------------------------------------- requests
    async def add_request(self, request_id: str, prompt: dict[str, Any],
                          params: SamplingParams) -> RequestStream:
        """Validate and queue a request of one completion; raises ``InvalidInputError``
        (bad input), ``QueueFullError`` or ``EngineDeadError``. Abort it with ``abort`` if the
        caller stops reading before it finishes."""
        (stream,) = await self.add_completions([request_id], prompt, params)
        return stream

    async def add_completions(self, request_ids: list[str], prompt: dict[str, Any],
                              params: SamplingParams) -> list[RequestStream]:
        """``add_request`` for the ``params.n`` completions of one prompt, one id each: the
        prompt is processed once and its completions queued together (``fork_request``)."""
        if len(request_ids) != params.n:
            raise ValueError(f"{len(request_ids)} request ids for n={params.n} completions")
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        if not self.has_room():
            raise QueueFullError(
                f"{self.max_waiting} requests are already waiting for a slot "
                f"(--max-queue {self.max_waiting}); retry later.")
        assert self._loop is not None
        now = time.monotonic()
        streams = [RequestStream(rid, arrival_time=now, delta=params.output_kind == "delta")
                   for rid in request_ids]
        for stream in streams:
            self._streams[stream.request_id] = stream
        added = [self._loop.create_future() for _ in request_ids]
        try:
            request = await self._loop.run_in_executor(
                self._preprocess, self.engine.process_request, prompt, params, request_ids[0])
            children = ([request] if params.n == 1
                        else self.engine.fork_request(request, request_ids))
            for child, future in zip(children, added, strict=True):
                self._commands.put(_Add(child, self._resolver(future)))
            await asyncio.gather(*added)
        except asyncio.CancelledError:
            for rid in request_ids:
                self.abort(rid)
            raise
        except BaseException:
            for rid, future in zip(request_ids, added, strict=True):
                if future.done() and not future.cancelled() and future.exception() is None:
                    self.abort(rid)  # queued before another completion was refused
                self._streams.pop(rid, None)
            raise
        return streams

    def abort(self, request_id: str) -> None:
        """Stop a request and release its KV blocks and encoder-cache references. Harmless for
        requests that already finished."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self._commands.put(_Abort(request_id))
            if self.observer is not None:
                self.observer.on_finished("abort", stream.num_prompt_tokens,
                                          stream.num_generation_tokens)

    def _resolver(self, fut: asyncio.Future[None]) -> Callable[[BaseException | None], None]:
        def resolve(error: BaseException | None) -> None:
            if fut.done():  # the caller was cancelled meanwhile
                return
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

        return lambda error: self._post(resolve, error)

    # ----------------------------------------------------------------- the thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                # Block only when there is nothing to step.
                commands = []
                while not engine.has_unfinished_requests():
                    try:  # idle: look at the engine's workers now and then
                        commands.append(self._commands.get(timeout=IDLE_CHECK_S))
                        break
                    except queue.Empty:
                        engine.check_health()
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if not all(self._apply(command) for command in commands):
                    break  # _STOP, after the commands sent before it
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    now = time.monotonic()
                    self._stats = engine.stats()
                    if outputs:
                        self._post(self._dispatch, outputs, now)
                else:
                    self._stats = engine.stats()
        except BaseException as e:  # the engine is broken: fail every request, loudly
            logger.critical("the engine loop stopped; failing all in-flight requests",
                            exc_info=e)
            self._error = e
            self._post(self._fail_all, e)
            if self.on_dead is not None:
                self._post(self.on_dead, e)
            return
        self._post(self._fail_all, None)

    def _post(self, callback: Callable[..., None], *args: object) -> None:
        """Run ``callback(*args)`` on the event loop, unless the loop is already closed."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(callback, *args)

    def _apply(self, command: object) -> bool:
        """Carry out one command; False for the stop command."""
        if command is _STOP:
            return False
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
        elif isinstance(command, _Add):
            try:
                self.engine.add_processed_request(command.request)
            except Exception as e:  # InvalidInputError, or a bug: the caller reports it
                command.done(e)
            else:
                command.done(None)
        return True

    # ----------------------------------------------------------------- event loop side
    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted: the engine drops it at its next command drain
                continue
            if self.observer is not None:
                if stream.first_token_time is None:
                    self.observer.on_first_token(now - stream.arrival_time)
                else:
                    self.observer.on_next_token(now - stream.last_token_time)
            if stream.first_token_time is None:
                stream.first_token_time = now
            stream.last_token_time = now
            stream.num_prompt_tokens = out.num_prompt_tokens
            if stream.delta:
                stream.num_generation_tokens += len(out.token_ids)
            else:
                stream.num_generation_tokens = len(out.token_ids)
            if out.finished:
                stream.finished = True
                del self._streams[out.request_id]
                if self.observer is not None:
                    self.observer.on_finished(out.finish_reason or "stop", out.num_prompt_tokens,
                                              stream.num_generation_tokens)
            stream._queue.put_nowait(out)

    def _fail_all(self, error: BaseException | None) -> None:
        reason = (f"the engine stopped: {error}" if error is not None
                  else "the server is shutting down")
        for stream in self._streams.values():
            stream._queue.put_nowait(EngineDeadError(reason))
        self._streams.clear()

