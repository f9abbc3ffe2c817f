"""The engine in one background thread, shared by every connection of the server.

``EngineClient`` is what the server talks to on its event loop, wherever the engine steps:
here (``AsyncEngine``) or in a process of its own (``core_process.py``); both step it with
``step_loop.run_steps``. Engine steps are synchronous torch work, so they run in a dedicated
thread, never on the event loop: the server stays responsive (``/health`` answers) during long
steps.
The thread owns the ``LLMEngine`` alone; best, it is the thread the engine was built on
(``ComputeThread``: torch's parallel regions run slower once a second thread has started
some). The event loop
talks to it through a command queue (add, abort) that the thread drains between steps, and
gets each step's outputs back through ``loop.call_soon_threadsafe``, one call per step. In
both layouts these are the engine core's (``CoreOutput``: tokens, finishes,
log-probabilities): the event loop makes the requests' text and outputs from them
(``OutputProcessor``: detokenization, stop strings, output kinds) while the engine computes
its next step, aborts in the engine a request a stop string ended, and fans the outputs out
to per-request asyncio queues. No lock guards engine state because only one thread ever
touches it; the stats the server reads are a snapshot the thread publishes after each step.
A request's prompt processing (chat template, tokenizer, image
processor) runs on a small pool of preprocessing threads of its own while the engine keeps
stepping (the processor serialises only its tokenizer call, so one large image does not stall
the small ones), each computing with one torch thread; the engine thread only queues the
finished ``Request``.

A step that fails for some requests finishes those with ``finish_reason="error"`` and goes on
(``LLMEngine.core_step``). Only a broken engine (``EngineDeadError``, or an exception that escapes
a step) stops the loop: every in-flight request fails, ``is_alive`` turns False and
``on_dead`` is called, so the server can report it and exit for a supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import queue
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from mmserve.beam_search import BeamSearchParams
from mmserve.config import EngineConfig
from mmserve.engine.beam_driver import BeamRounds
from mmserve.engine.llm_engine import LLMEngine
from mmserve.engine.output_processor import CoreOutput, OutputProcessor
from mmserve.engine.request import Request
from mmserve.engine.request_maker import RequestMaker
from mmserve.engine.step_loop import STOP, AbortRequest, QueueRequest, refuse, run_steps
from mmserve.errors import EngineDeadError, InvalidInputError
from mmserve.outputs import RequestOutput
from mmserve.processing.processor import InputProcessor
from mmserve.sampling_params import SamplingParams
from mmserve.worker.compute_thread import ComputeThread, single_threaded

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineClient", "EngineDeadError", "QueueFullError", "RequestStream"]


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_waiting`` allows."""


class RequestObserver(Protocol):
    """Hooks for metrics, called on the event loop with times measured by the engine thread."""

    def on_first_token(self, seconds_since_arrival: float) -> None: ...

    def on_next_token(self, seconds_since_previous: float) -> None: ...

    def on_finished(self, finish_reason: str, num_prompt_tokens: int,
                    num_generation_tokens: int, seconds_since_arrival: float) -> None: ...


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
    observed: bool = True  # counted in the server's metrics (a beam search's rounds are not)
    _queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


class EngineClient:
    """What the server talks to, on its event loop: per-request output streams, the waiting
    bound, aborts and the engine's stats, for an engine stepped elsewhere (a thread of this
    process: ``AsyncEngine``; a process of its own: ``core_process.EngineCoreClient``).

    ``config`` is the engine's settings as it resolved them; ``max_waiting`` bounds the
    requests admitted beyond the ``max_num_seqs`` that run at once (``add_request`` refuses
    more with ``QueueFullError``); ``preprocess_workers`` threads turn prompts into requests
    (default: the CPU count, between 2 and 4); ``on_dead`` is called on the event loop if the
    engine stops by itself. A subclass makes requests (``_make``), queues them (``_queue``),
    aborts (``_send_abort``), stops its engine (``stop``) and says whether it runs
    (``_running``); it hands a step's outputs to ``_dispatch_core`` (an engine core's,
    ``CoreOutput``s, whose text and outputs are made here with ``tokenizer``) or to
    ``_dispatch`` (an engine that makes its own) and ends the streams with ``_fail_all``, all
    on the event loop (``_post``)."""

    def __init__(self, config: EngineConfig, stats: dict[str, Any],
                 max_waiting: int | None = None, observer: RequestObserver | None = None,
                 preprocess_workers: int | None = None,
                 on_dead: Callable[[BaseException], None] | None = None,
                 tokenizer: Any = None) -> None:
        self.config = config
        # The requests' text and outputs, made on the event loop from an engine core's
        # outputs while the engine computes the next step (no ``tokenizer``: the engine makes
        # its own), with a tokenizer of their own: a fast tokenizer is not safe to share
        # between threads, and the preprocessing threads tokenize meanwhile.
        self._outputs = (None if tokenizer is None
                         else OutputProcessor(copy.deepcopy(tokenizer)))
        self.max_waiting = max_waiting
        self.observer = observer
        self.on_dead = on_dead
        self._streams: dict[str, RequestStream] = {}
        # Beam searches (their task and streams' ids), by each of their streams' ids, and
        # the streams of their rounds' requests (which the waiting bound leaves out).
        self._searches: dict[str, tuple[asyncio.Task[None], list[str]]] = {}
        self._num_round_streams = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        workers = preprocess_workers or max(2, min(4, os.cpu_count() or 2))
        self._preprocess = ThreadPoolExecutor(workers, thread_name_prefix="mmserve-preprocess",
                                              initializer=single_threaded)
        # Prompts without images take threads of their own: they are done in milliseconds,
        # and would otherwise wait in line behind images that take seconds each (twelve
        # requests of four 7000x7000 images kept a one-word prompt waiting 29.6 s).
        self._preprocess_text = ThreadPoolExecutor(
            2, thread_name_prefix="mmserve-preprocess-text", initializer=single_threaded)
        self._stats = stats

    def _stop_preprocessing(self) -> None:
        """Take no more prompts; those queued are dropped (their requests are failing)."""
        self._preprocess.shutdown(wait=False, cancel_futures=True)
        self._preprocess_text.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- what a subclass does
    def _make(self, prompt: dict[str, Any], params: SamplingParams, request_id: str) -> Request:
        raise NotImplementedError

    def _fork(self, request: Request, request_ids: list[str]) -> list[Request]:
        return RequestMaker.fork(request, request_ids)

    def _queue(self, requests: list[Request],
               done: list[Callable[[BaseException | None], None]]) -> None:
        raise NotImplementedError

    def _send_abort(self, request_id: str) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def _running(self) -> bool:
        raise NotImplementedError

    @property
    def processor(self) -> InputProcessor:
        """The processor requests are made with."""
        raise NotImplementedError

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (what a token stands for, in logprobs)."""
        return self.processor.tokenizer

    # ----------------------------------------------------------------- state
    @property
    def is_alive(self) -> bool:
        return self._error is None and self._running()

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped by itself, if it did."""
        return self._error

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def has_room(self) -> bool:
        """Whether one more request may queue: those beyond the ``max_num_seqs`` that run at
        once count as waiting."""
        waiting = len(self._streams) - self._num_round_streams - self.config.max_num_seqs
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
        streams = self._open(request_ids, delta=params.output_kind == "delta")

        async def made() -> list[Request]:
            request = await self._loop.run_in_executor(
                self._pool_for(prompt), self._make, prompt, params, request_ids[0])
            return [request] if params.n == 1 else self._fork(request, request_ids)

        await self._submit(streams, made())
        return streams

    async def add_beam_search(self, request_ids: list[str], prompt: dict[str, Any],
                              params: BeamSearchParams, decode: Callable[[list[int]], str]
                              ) -> list[RequestStream]:
        """A beam search of ``prompt`` (``mmserve.beam_search``): one stream per sequence it
        returns (``params.beam_width``, best first), each given one final output once the
        search ends (its text made with ``decode``). Its rounds are requests of their own
        (``run_requests``), on the same engine; ``abort`` of any of its ids stops it and ends
        them all. The prompt is processed here, so bad input raises ``InvalidInputError`` as
        ``add_completions`` does."""
        if len(request_ids) != params.beam_width:
            raise ValueError(f"{len(request_ids)} request ids for beam_width="
                             f"{params.beam_width}")
        params.num_candidates(self.processor.eos_token_ids)  # before any processing
        streams = self._open(request_ids, delta=True)
        try:
            search = await BeamRounds.start(self, prompt, params, request_ids)
        except BaseException:
            for request_id in request_ids:
                self._streams.pop(request_id, None)
            raise
        if any(self._streams.get(s.request_id) is not s for s in streams):
            for request_id in request_ids:  # aborted while it was processed
                self.abort(request_id)
            return streams
        task = self._loop.create_task(self._search(search, streams, decode))
        task.add_done_callback(_log_failure)
        for request_id in request_ids:
            self._searches[request_id] = (task, request_ids)
        return streams

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    async def make_request(self, prompt: dict[str, Any], params: SamplingParams,
                           request_id: str) -> Request:
        """``prompt`` made into a request on the preprocessing threads, not queued."""
        return await self._loop.run_in_executor(self._pool_for(prompt), self._make, prompt,
                                                params, request_id)

    async def run_requests(self, requests: list[Request]) -> list[RequestOutput]:
        """Queue requests made already (``make_request``, and ``RequestMaker.extend`` of one)
        and return their final outputs, in order: requests a caller admitted already (a beam
        search's rounds), so the waiting bound and the server's metrics leave them out.
        Cancelled, it aborts them."""
        streams = self._open([req.request_id for req in requests],
                             delta=requests[0].sampling_params.output_kind == "delta",
                             admitted=True)

        async def made() -> list[Request]:
            return requests

        self._num_round_streams += len(streams)
        try:
            await self._submit(streams, made())
            return await asyncio.gather(*(_final(stream) for stream in streams))
        finally:
            self._num_round_streams -= len(streams)
            for stream in streams:
                self.abort(stream.request_id)

    def _open(self, request_ids: list[str], delta: bool,
              admitted: bool = False) -> list[RequestStream]:
        """The streams of requests about to be made: refused unless the engine runs, there
        is room (unless ``admitted``) and every id is new."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        if not admitted and not self.has_room():
            raise QueueFullError(
                f"{self.max_waiting} requests are already waiting for a slot "
                f"(--max-queue {self.max_waiting}); retry later.")
        assert self._loop is not None
        seen: set[str] = set()
        for rid in request_ids:  # a stream of each: one id, one request in flight
            if rid in self._streams or rid in seen:
                raise InvalidInputError(f"request id {rid!r} is already in use",
                                        param="request_id")
            seen.add(rid)
        now = time.monotonic()
        streams = [RequestStream(rid, arrival_time=now, delta=delta, observed=not admitted)
                   for rid in request_ids]
        for stream in streams:
            self._streams[stream.request_id] = stream
        return streams

    async def _submit(self, streams: list[RequestStream],
                      made: Awaitable[list[Request]]) -> None:
        """Queue the requests ``made`` gives, one per stream, once it gives them; if it
        raises or this is cancelled, none of them is left behind."""
        request_ids = [stream.request_id for stream in streams]
        added = [self._loop.create_future() for _ in request_ids]
        try:
            children = await made
            resolvers = [self._resolver(future) for future in added]
            if self._outputs is not None:
                for child in children:
                    self._outputs.add(child)
                resolvers = [self._forget_if_refused(child.request_id, resolve)
                             for child, resolve in zip(children, resolvers, strict=True)]
            self._queue(children, resolvers)
            for stream in streams:
                if self._streams.get(stream.request_id) is not stream:
                    # Aborted while it was being processed: that abort went ahead of the
                    # request and did nothing in the engine. This one follows it there.
                    self._abort_in_engine(stream.request_id)
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

    async def _search(self, search: BeamRounds, streams: list[RequestStream],
                      decode: Callable[[list[int]], str]) -> None:
        """Run a beam search to its end and hand each stream its sequence; a stream no
        longer here was aborted, or failed with the engine."""
        try:
            outputs = await search.run()
            for out in outputs:
                if out.token_ids:
                    out.text = out.new_text = decode(out.token_ids)
        except EngineDeadError:
            return  # every stream failed with the engine (``_fail_all``)
        except Exception as e:  # noqa: BLE001 (a bug: it fails this search, nothing else)
            logger.exception("a beam search failed")
            outputs = search.failed(f"the beam search failed: {e!r}")
        finally:
            for stream in streams:
                self._searches.pop(stream.request_id, None)
        now = time.monotonic()
        for stream, out in zip(streams, outputs, strict=True):
            if self._streams.get(stream.request_id) is not stream:
                continue
            del self._streams[stream.request_id]
            stream.finished = True
            stream.first_token_time = stream.last_token_time = now
            stream.num_prompt_tokens = out.num_prompt_tokens
            stream.num_generation_tokens = len(out.token_ids)
            stream._queue.put_nowait(out)
            if self.observer is not None:
                self.observer.on_first_token(now - stream.arrival_time)
                self.observer.on_finished(out.finish_reason or "stop", out.num_prompt_tokens,
                                          len(out.token_ids), now - stream.arrival_time)

    async def prompt_token_ids(self, prompt: dict[str, Any]) -> list[int]:
        """The token ids the model reads for ``prompt`` (its images' placeholders expanded),
        as a request of it would be made, on the preprocessing threads; raises
        ``InvalidInputError`` as making the request would."""
        assert self._loop is not None
        processed = await self._loop.run_in_executor(
            self._pool_for(prompt), self.processor.process, prompt,
            self.config.limit_mm_per_prompt, self.config.max_model_len)
        return processed.token_ids

    def _pool_for(self, prompt: dict[str, Any]) -> ThreadPoolExecutor:
        """The preprocessing threads of prompts with images, or of those without."""
        return self._preprocess if _carries_images(prompt) else self._preprocess_text

    def abort(self, request_id: str) -> None:
        """Stop a request and release its KV blocks and encoder-cache references. Harmless for
        requests that already finished."""
        search = self._searches.pop(request_id, None)
        if search is not None:  # a beam search's: the search stops, and all its streams
            task, request_ids = search
            task.cancel()  # its rounds' requests are aborted as it stops
            for other in request_ids:
                self._searches.pop(other, None)
            for other in request_ids:
                if other != request_id:
                    self.abort(other)
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self._abort_in_engine(request_id)
            if self.observer is not None and stream.observed:
                self.observer.on_finished("abort", stream.num_prompt_tokens,
                                          stream.num_generation_tokens,
                                          time.monotonic() - stream.arrival_time)

    def _abort_in_engine(self, request_id: str) -> None:
        if self._outputs is not None:
            self._outputs.abort(request_id)
        self._send_abort(request_id)

    def _forget_if_refused(self, request_id: str, resolve: Callable[[BaseException | None], None]
                           ) -> Callable[[BaseException | None], None]:
        """``resolve``, after the output processor forgets a request the engine refused."""
        def done(error: BaseException | None) -> None:
            if error is not None:  # on the event loop, before the caller hears of it
                self._post(self._outputs.abort, request_id)
            resolve(error)

        return done

    def _resolver(self, fut: asyncio.Future[None]) -> Callable[[BaseException | None], None]:
        def resolve(error: BaseException | None) -> None:
            if fut.done():  # the caller was cancelled meanwhile
                return
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

        return lambda error: self._post(resolve, error)

    # ----------------------------------------------------------------- event loop side
    def _post(self, callback: Callable[..., None], *args: object) -> None:
        """Run ``callback(*args)`` on the event loop, from any thread, unless the loop is
        already closed."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(callback, *args)

    def _died(self, error: BaseException) -> None:
        """From any thread: the engine stopped by itself; fail every request, loudly."""
        logger.critical("the engine loop stopped; failing all in-flight requests",
                        exc_info=error)
        self._error = error
        self._post(self._end_in_death, error)

    def _end_in_death(self, error: BaseException) -> None:
        """Fail every request, then tell ``on_dead``: in one callback, so that whoever
        hears of a failed request finds the death reported."""
        self._fail_all(error)
        if self.on_dead is not None:
            self.on_dead(error)

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted: the engine drops it at its next command drain
                continue
            if self.observer is not None and stream.observed:
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
                if self.observer is not None and stream.observed:
                    self.observer.on_finished(out.finish_reason or "stop", out.num_prompt_tokens,
                                              stream.num_generation_tokens,
                                              now - stream.arrival_time)
            stream._queue.put_nowait(out)

    def _dispatch_core(self, core_outputs: list[CoreOutput], now: float) -> None:
        """A step's outputs, made here from the engine core's; a request a stop string
        finished is aborted in the engine, which ran it on meanwhile. A failure here (a bug)
        leaves the outputs of the requests in flight unknown: they fail, and the engine is
        stopped, as when it breaks."""
        try:
            outputs, stopped = self._outputs.process(core_outputs)
            for request_id in stopped:
                self._send_abort(request_id)
            self._dispatch(outputs, now)
        except Exception as e:  # noqa: BLE001 (reported as the engine's death)
            if self._error is None:
                self._died(EngineDeadError(f"making the engine's outputs failed: {e!r}"))
                self.stop()

    def _fail_all(self, error: BaseException | None) -> None:
        if self._outputs is not None:
            self._outputs.clear()
        reason = (f"the engine stopped: {error}" if error is not None
                  else "the server is shutting down")
        for stream in self._streams.values():
            stream._queue.put_nowait(EngineDeadError(reason))
        self._streams.clear()


class AsyncEngine(EngineClient):
    """Runs ``engine`` on ``compute`` (the thread it was built on; default: a thread of its
    own) once ``start()`` is called from the event loop; ``EngineClient`` says the rest.

    An engine built with ``detokenize=False`` (as the server builds it) is stepped with
    ``core_step``, and its requests' text and outputs are made on the event loop while it
    computes the next step, as the front end of an engine core process makes them; any
    other engine with ``step``, and its outputs are passed on as they are."""

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None,
                 observer: RequestObserver | None = None,
                 preprocess_workers: int | None = None,
                 on_dead: Callable[[BaseException], None] | None = None,
                 compute: ComputeThread | None = None) -> None:
        core = isinstance(engine, LLMEngine) and engine.output_processor is None
        super().__init__(engine.config, engine.stats(), max_waiting, observer,
                         preprocess_workers, on_dead,
                         engine.processor.tokenizer if core else None)
        self.engine = engine
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._own_compute = compute is None  # then made by ``start``
        self._compute = compute
        self._loop_done: Future[None] | None = None  # the engine loop, once started
        self._ended = False  # the loop has returned: nothing more is added

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine loop; call from the event loop that will read the outputs."""
        if self._loop_done is not None:
            raise RuntimeError("the engine loop is already started")
        self._loop = asyncio.get_running_loop()
        # The engine's steps are this loop's from now on (an ``LLM`` call on it meanwhile is
        # refused, and a call stepping it now refuses this start); ``_run`` gives them back.
        steps = self.engine if isinstance(self.engine, LLMEngine) else None
        if steps is not None:
            steps.claim_steps("a server's engine loop (AsyncEngine)")
        try:
            if self._compute is None:
                self._compute = ComputeThread()
            self._loop_done = self._compute.submit(self._run)
        except BaseException:
            if steps is not None:
                steps.release_steps()
            raise

    async def shutdown(self) -> None:
        """Stop the engine loop after its current step; requests still in flight fail."""
        if self._loop_done is None:
            return
        self.stop()
        await asyncio.wrap_future(self._loop_done)
        if self._own_compute and self._compute is not None:
            self._compute.close()
        self._stop_preprocessing()

    def stop(self) -> None:
        """Ask the engine loop to stop after its current step, from any thread, without
        waiting (``shutdown`` waits); harmless when it has stopped."""
        self._commands.put(STOP)

    def _running(self) -> bool:
        return (self._loop_done is not None and not self._ended
                and not self._loop_done.done())

    @property
    def processor(self) -> InputProcessor:
        return self.engine.processor

    # ----------------------------------------------------------------- requests
    def _make(self, prompt: dict[str, Any], params: SamplingParams, request_id: str) -> Request:
        return self.engine.process_request(prompt, params, request_id)

    def _queue(self, requests: list[Request],
               done: list[Callable[[BaseException | None], None]]) -> None:
        for request, resolve in zip(requests, done, strict=True):
            self._commands.put(QueueRequest(request, resolve))
        if not self._running():  # the loop ended while they were processed
            self._refuse_queued("the engine loop is not running")

    def _send_abort(self, request_id: str) -> None:
        self._commands.put(AbortRequest(request_id))

    # ----------------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            step = self.engine.step if self._outputs is None else self.engine.core_step
            run_steps(self.engine, self._commands, self._publish, step)
        except BaseException as e:  # the engine is broken
            self._ended = True
            self._died(e)
            self._refuse_queued(f"the engine stopped: {e}")
            return
        finally:
            if isinstance(self.engine, LLMEngine):
                self.engine.release_steps()
        self._ended = True
        self._post(self._fail_all, None)
        self._refuse_queued("the server is shutting down")

    def _refuse_queued(self, reason: str) -> None:
        """Requests queued and never added (the loop ended first) are refused, so that no
        caller waits for them."""
        while True:
            try:
                refuse([self._commands.get_nowait()], reason)
            except queue.Empty:
                return

    def _publish(self, outputs: list[Any], now: float, stats: dict[str, Any]) -> None:
        self._stats = stats
        if outputs:
            self._post(self._dispatch if self._outputs is None else self._dispatch_core,
                       outputs, now)


def _log_failure(task: asyncio.Task[None]) -> None:
    """A beam search's task ended by something other than cancellation: say what (it hands
    its streams an error itself; this is for what escaped that)."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("a beam search's task failed", exc_info=task.exception())


async def _final(stream: RequestStream) -> RequestOutput:
    """A stream's last output (a request of ``output_kind`` final_only has only that)."""
    last = None
    async for out in stream:
        last = out
    assert last is not None
    return last


def _carries_images(prompt: Any) -> bool:
    """Whether a prompt holds images to preprocess: in ``images`` (where the server puts
    them), vLLM's ``multi_modal_data``, or message parts that are not text."""
    if not isinstance(prompt, dict):
        return False
    if prompt.get("images") or prompt.get("multi_modal_data"):
        return True
    messages = prompt.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(not isinstance(part, dict) or part.get("type") != "text"
                for part in m["content"])
        for m in messages)
