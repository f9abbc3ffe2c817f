"""The engine in a process of its own, apart from the server's front end.

The front end (HTTP, JSON, media fetching and decoding, the processor, grammar compilation,
detokenization and the requests' outputs) and the engine core (scheduling, the step,
sampling) share no interpreter lock and no core's time unannounced: a request's images are
turned into pixels in the front end, which sends the finished ``Request`` to the core, pixels
once; the core steps as the server's engine thread does (``step_loop.run_steps``) and
sends what each step did to each request back (``CoreOutput``s: tokens, finishes,
log-probabilities), which the front end's ``OutputProcessor`` turns into text and outputs. A
stop string is found there, and the front end aborts its request in the core. This is how
vLLM and SGLang run their servers.

Messages are pickled tuples on one pipe each way, read and written by threads of their own on
both sides, so that neither side's stepping or event loop waits on the other's pipe:

- front end to core: ``("add", [(token, request), ...])``, ``("abort", request_id)``,
  ``("stop",)``;
- core to front end: ``("ready", CoreReady)`` or ``("failed", is_bad_setting, message)`` once
  started, then ``("added", token, error)`` for each request queued, ``("step", outputs,
  time, stats)`` (each ``CoreOutput`` as a plain tuple), and ``("dead",
  message)`` if the engine breaks.

A constraint's grammar is compiled in the front end (a bad one is refused there) and again in
the core, from its own compiler's cache, on a small pool of threads before the request
reaches the stepping thread (a compiled grammar costs more to serialize than to compile), so
that a long compilation holds up neither the steps nor the messages behind it. The core exits
once its front end is gone (``exit_with_parent``); a core that dies fails every request in
flight and the server exits, as when its engine thread breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from mmserve.config import EngineConfig, require_model_dir
from mmserve.engine.async_engine import EngineClient, RequestObserver
from mmserve.engine.lora import lora_checker
from mmserve.engine.output_processor import CoreOutput
from mmserve.engine.request import Request
from mmserve.engine.request_maker import RequestMaker, processor_and_grammars
from mmserve.engine.step_loop import STOP, AbortRequest, QueueRequest, run_steps
from mmserve.errors import EngineDeadError, InvalidInputError, PromptTooLongError
from mmserve.processing.processor import InputProcessor
from mmserve.sampling_params import SamplingParams
from mmserve.worker.executor import exit_status, exit_with_parent

logger = logging.getLogger(__name__)

# Seconds the core may take to start (imports, weights, the profile run, CUDA graphs).
START_TIMEOUT_S = 900.0
# Seconds the core gets to finish its step and close the engine once asked to stop.
STOP_GRACE_S = 30.0
# Threads of the core that compile the grammars of constrained requests as they arrive.
GRAMMAR_THREADS = 2


@dataclass(frozen=True)
class CoreReady:
    """What the core tells its front end once its engine is built: the settings as the engine
    resolved them and what the front end needs to make requests for it."""

    config: EngineConfig
    encoder_cache_tokens: int
    release_threshold: int
    stats: dict[str, Any]


class EngineCoreClient(EngineClient):
    """An ``LLMEngine`` under ``config`` started in a process of its own (built here, ready
    when the constructor returns; ``ValueError`` for settings it refuses), served to the
    event loop that calls ``start()``; ``EngineClient`` says the rest."""

    def __init__(self, config: EngineConfig, max_waiting: int | None = None,
                 observer: RequestObserver | None = None,
                 preprocess_workers: int | None = None,
                 on_dead: Callable[[BaseException], None] | None = None,
                 start_timeout: float = START_TIMEOUT_S) -> None:
        from transformers import AutoConfig

        require_model_dir(config.model)
        config = config.replace(device=config.resolved_device)  # one answer on both sides
        ctx = multiprocessing.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        # Not a daemon: the core starts tensor-parallel workers of its own.
        self._proc = ctx.Process(target=_core_main, args=(config, theirs),
                                 name="mmserve-engine-core", daemon=False)
        self._proc.start()
        theirs.close()
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._ended = False  # the reader has given up on the core: nothing more is added
        self._added: dict[int, Callable[[BaseException | None], None]] = {}
        self._tokens = itertools.count()
        try:
            # The front end's processor is built while the core loads the model.
            hf_config = AutoConfig.from_pretrained(config.model, local_files_only=True)
            processor, grammars = processor_and_grammars(config, hf_config)
            ready = self._wait_ready(start_timeout)
            self.request_maker = RequestMaker(
                processor, grammars, ready.config.max_model_len,
                ready.config.limit_mm_per_prompt, ready.encoder_cache_tokens,
                ready.release_threshold, ready.config.scheduling_policy,
                ready.config.pooling_type, lora_checker(ready.config, hf_config))
            super().__init__(ready.config, ready.stats, max_waiting, observer,
                             preprocess_workers, on_dead, processor.tokenizer)
        except BaseException:
            self._end_process(0.0)
            raise

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def processor(self) -> InputProcessor:
        return self.request_maker.processor

    def _wait_ready(self, timeout: float) -> CoreReady:
        ready = wait([self._conn, self._proc.sentinel], timeout)
        if not ready:
            raise RuntimeError(f"the engine core did not start in {timeout:.0f} s")
        if self._conn not in ready:
            raise RuntimeError(f"the engine core {self._exit_status()} while starting")
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the engine core {self._exit_status()} while starting") from None
        if message[0] == "failed":
            _, bad_setting, text = message
            raise (ValueError if bad_setting else RuntimeError)(text)
        return message[1]

    def _exit_status(self) -> str:
        return exit_status(self._proc, 1.0)

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start serving; call from the event loop that will read the outputs."""
        if self._threads:
            raise RuntimeError("the engine core client is already started")
        self._loop = asyncio.get_running_loop()
        self._threads = [
            threading.Thread(target=self._read, name="mmserve-core-reader", daemon=True),
            threading.Thread(target=_write, args=(self._conn, self._outbox),
                             name="mmserve-core-writer", daemon=True)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Ask the core to stop after its current step, without waiting; harmless when it
        has stopped."""
        if not self._stopping:
            self._stopping = True
            self._outbox.put(("stop",))

    async def shutdown(self) -> None:
        """Stop the core after its current step and wait for it to exit; requests still in
        flight fail."""
        self.stop()
        await asyncio.to_thread(self.close)
        self._stop_preprocessing()

    def stats(self) -> dict[str, Any]:
        """The core's counters as of its last step; preprocessing's, the front end's."""
        return {**self._stats,
                "preprocess_peak_bytes": self.request_maker.preprocess_peak_bytes,
                "num_memory_releases": self.request_maker.num_memory_releases}

    def close(self) -> None:
        """Stop the core and wait for it to exit (at most ``STOP_GRACE_S``, then it is
        killed); from any thread."""
        self.stop()
        if not self._threads:  # never started: no writer to send it
            with contextlib.suppress(OSError):
                self._conn.send_bytes(pickle.dumps(("stop",)))
        self._end_process(STOP_GRACE_S)
        self._outbox.put(None)
        for thread in self._threads:
            thread.join(5.0)

    def _end_process(self, grace: float) -> None:
        """Wait ``grace`` seconds for the core to exit, then kill it (it ignores SIGTERM:
        ``_core_main``); its tensor-parallel workers follow it (``exit_with_parent``)."""
        self._proc.join(grace)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)
        self._conn.close()

    def _running(self) -> bool:
        return (bool(self._threads) and not self._ended
                and all(thread.is_alive() for thread in self._threads)
                and self._proc.is_alive())

    # ----------------------------------------------------------------- requests
    def _make(self, prompt: dict[str, Any], params: SamplingParams, request_id: str) -> Request:
        return self.request_maker.make(prompt, params, request_id)

    def _queue(self, requests: list[Request],
               done: list[Callable[[BaseException | None], None]]) -> None:
        batch = []
        for request, resolve in zip(requests, done, strict=True):
            token = next(self._tokens)
            self._added[token] = resolve
            request.grammar = None  # compiled again in the core, from its own cache
            batch.append((token, request))
        self._outbox.put(("add", batch))
        if not self._running():  # the core ended while they were processed
            self._refuse_queued(f"the engine stopped: {self._error}" if self._error
                                else "the engine core is not running")

    def _send_abort(self, request_id: str) -> None:
        self._outbox.put(("abort", request_id))

    # ----------------------------------------------------------------- the reader
    def _read(self) -> None:
        """The core's messages, until it is gone; then every request in flight or queued
        fails, whatever ended the reading."""
        error: BaseException | None = None
        try:
            while True:
                try:
                    message = pickle.loads(self._conn.recv_bytes())
                except (EOFError, OSError):
                    break
                kind = message[0]
                if kind == "step":
                    _, values, now, self._stats = message
                    if values:
                        self._post(self._dispatch_core, [CoreOutput._make(v) for v in values],
                                   now)
                elif kind == "added":
                    _, token, problem = message
                    resolve = self._added.pop(token, None)
                    if resolve is not None:
                        resolve(None if problem is None else _rebuild(problem))
                elif kind == "dead":
                    error = EngineDeadError(message[1])
                    return
        except BaseException as e:  # noqa: BLE001 (a bug here: the front end cannot go on)
            error = EngineDeadError(f"reading the engine core's messages failed: {e!r}")
        finally:
            if error is None and not self._stopping:
                error = EngineDeadError(f"the engine core process {self._exit_status()}")
            if error is None:
                self._post(self._fail_all, None)
            else:
                self._died(error)
            self._ended = True  # after the error is set: requests queued later are refused
            self._refuse_queued("the server is shutting down" if error is None
                                else f"the engine stopped: {error}")

    def _refuse_queued(self, reason: str) -> None:
        """Requests sent and never added (the core ended first) are refused, so that no
        caller waits for them; from the reader and the event loop alike."""
        for token in list(self._added):
            resolve = self._added.pop(token, None)
            if resolve is not None:
                resolve(EngineDeadError(reason))


def _write(conn: Connection, outbox: queue.SimpleQueue[object]) -> None:
    """Pickle and send what ``outbox`` holds, in order, until None (or the pipe is gone). A
    message that cannot be sent closes the pipe: the other side then sees its peer gone,
    rather than waiting for what never comes."""
    while (message := outbox.get()) is not None:
        try:
            conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            return
        except Exception:  # noqa: BLE001 (a bug: logged, and the pipe closed)
            logger.exception("cannot send %r to the other side of the engine core's pipe",
                             message[0] if isinstance(message, tuple) else message)
            with contextlib.suppress(OSError):
                conn.close()
            return


def _error_of(error: BaseException) -> tuple[str, str, str | None]:
    kind = ("too_long" if isinstance(error, PromptTooLongError)
            else "invalid" if isinstance(error, InvalidInputError)
            else "dead" if isinstance(error, EngineDeadError) else "other")
    return kind, str(error), getattr(error, "param", None)


def _rebuild(error: tuple[str, str, str | None]) -> BaseException:
    kind, text, param = error
    if kind in ("invalid", "too_long"):
        return (PromptTooLongError if kind == "too_long" else InvalidInputError)(text, param)
    return EngineDeadError(text) if kind == "dead" else RuntimeError(text)


# --------------------------------------------------------------------- the core process
def _core_main(config: EngineConfig, conn: Connection) -> None:
    """Build the engine, then step it for the front end until it says stop (or is gone)."""
    from mmserve.engine.llm_engine import LLMEngine
    from mmserve.worker import cpu_threads

    # Ctrl-C and SIGTERM are the front end's to handle: sent to the whole group (a terminal,
    # systemd), they would end the engine before the front end lets the requests in flight
    # finish (its tensor-parallel workers leave them to the engine likewise).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    exit_with_parent()
    cpu_threads.count_as_own(os.getppid())  # the front end's work is the service's own
    try:
        engine = LLMEngine(config, detokenize=False)  # the front end makes the outputs
    except BaseException as e:  # noqa: BLE001 (reported to the front end, which raises it)
        bad_setting = isinstance(e, ValueError | FileNotFoundError)
        if not bad_setting:
            logger.exception("the engine core failed to start")
        conn.send(("failed", bad_setting, str(e)))
        _exit(0)
    conn.send(("ready", CoreReady(engine.config, engine.request_maker.encoder_cache_tokens,
                                  engine.request_maker.release_threshold, engine.stats())))
    outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    commands: queue.SimpleQueue[object] = queue.SimpleQueue()
    writer = threading.Thread(target=_write, args=(conn, outbox), name="mmserve-core-writer",
                              daemon=True)
    writer.start()
    threading.Thread(target=_read_commands, args=(conn, engine, commands, outbox),
                     name="mmserve-core-reader", daemon=True).start()

    def publish(outputs: list[CoreOutput], now: float, stats: dict[str, Any]) -> None:
        # As plain tuples: pickled (by the writer thread, under the core's interpreter lock
        # all the same) in a quarter of the time named tuples take
        # (benchmarks/core_messages.py).
        outbox.put(("step", [tuple(out) for out in outputs], now, stats))

    try:
        run_steps(engine, commands, publish, engine.core_step)
    except BaseException as e:  # noqa: BLE001 (the engine is broken: the front end fails all)
        logger.critical("the engine core stopped", exc_info=e)
        outbox.put(("dead", str(e)))
    with contextlib.suppress(Exception):  # exiting anyway: the process gives it all back
        engine.close()
    outbox.put(None)
    writer.join(10.0)
    _exit(0)


def _read_commands(conn: Connection, engine: Any, commands: queue.SimpleQueue[object],
                   outbox: queue.SimpleQueue[object]) -> None:
    """The front end's messages as the stepping thread's commands, until it says stop (or is
    gone: that stops the core too). A request with a grammar is queued once the grammar is
    compiled, on a pool of ``GRAMMAR_THREADS`` off this thread and the stepping thread, so
    that a schema that takes long to compile holds up neither the requests and aborts sent
    after it nor the steps; a request aborted while its grammar compiles is not queued."""
    def done(token: int) -> Callable[[BaseException | None], None]:
        return lambda error: outbox.put(
            ("added", token, None if error is None else _error_of(error)))

    compiling: dict[int, list[Any]] = {}  # token -> [request id, aborted meanwhile]
    lock = threading.Lock()

    def compile_and_queue(token: int, request: Request) -> None:
        error: Exception | None = None
        try:
            request.grammar = engine.grammars.compile(request.sampling_params.structured_outputs)
        except Exception as e:  # noqa: BLE001 (refused, as the front end would)
            error = e
        with lock:  # an abort read from now on follows the request
            _, aborted = compiling.pop(token)
            if error is None and not aborted:
                commands.put(QueueRequest(request, done(token)))
                return
        done(token)(error)  # refused, or aborted meanwhile (its caller is gone): not queued

    pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="mmserve-core-grammar")
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            commands.put(STOP)
            break
        kind = message[0]
        if kind == "add":
            for token, request in message[1]:
                if request.sampling_params.structured_outputs is None:
                    commands.put(QueueRequest(request, done(token)))
                    continue
                with lock:
                    compiling[token] = [request.request_id, False]
                pool.submit(compile_and_queue, token, request)
        elif kind == "abort":
            with lock:
                for entry in compiling.values():
                    if entry[0] == message[1]:
                        entry[1] = True
                commands.put(AbortRequest(message[1]))
        elif kind == "stop":
            commands.put(STOP)
            break
    pool.shutdown(wait=False, cancel_futures=True)


def _exit(status: int) -> None:
    """Leave without the interpreter's teardown (a last full collection of torch's and
    transformers' objects, seconds the front end would wait for)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)
