"""The stepping loop, wherever the engine steps: on a thread of the server's process
(``async_engine.AsyncEngine``) or in an engine core process of its own (``core_process.py``).

Its thread owns the engine alone; the event loop (or the core's reader thread) talks to it
through a queue of commands (``QueueRequest``, ``AbortRequest``, ``STOP``) that the loop
drains between steps, and hears of each step through ``publish``.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from mmserve.engine.llm_engine import LLMEngine
from mmserve.engine.request import Request
from mmserve.errors import EngineDeadError


@dataclass
class QueueRequest:
    request: Request
    done: Callable[[BaseException | None], None]


@dataclass
class AbortRequest:
    request_id: str


STOP = object()  # the command that ends ``run_steps``
# Seconds between two looks at the engine's health while it has nothing to step (a
# tensor-parallel worker that dies while the server is idle turns /health 503 within this).
IDLE_CHECK_S = 1.0


def run_steps(engine: LLMEngine, commands: queue.SimpleQueue[object],
              publish: Callable[[list[Any], float, dict[str, Any]], None],
              step: Callable[[], list[Any]] | None = None) -> None:
    """Step ``engine`` while it has requests, carrying out ``commands`` (``QueueRequest``,
    ``AbortRequest``) between steps, until the ``STOP`` command (after those sent before it);
    ``publish(outputs, time.monotonic(), engine.stats())`` after each step (``step``'s outputs:
    by default ``engine.step``'s), and with no outputs after commands that left nothing to
    step. What the engine raises (it is broken) ends the loop and is raised."""
    step = step or engine.step
    while True:
        # Block only when there is nothing to step.
        batch = []
        while not engine.has_unfinished_requests():
            try:  # idle: look at the engine's workers now and then
                batch.append(commands.get(timeout=IDLE_CHECK_S))
                break
            except queue.Empty:
                engine.check_health()
        while True:
            try:
                batch.append(commands.get_nowait())
            except queue.Empty:
                break
        for i, command in enumerate(batch):
            if command is STOP:  # after the commands sent before it; those after are refused
                refuse(batch[i + 1:], "the engine is stopping")
                return
            _apply(engine, command)
        if engine.has_unfinished_requests():
            outputs = step()
            publish(outputs, time.monotonic(), engine.stats())
        else:
            publish([], time.monotonic(), engine.stats())


def refuse(commands: Iterable[object], reason: str) -> None:
    """Answer the requests among ``commands``, which will never be added, with
    ``EngineDeadError(reason)``, so that no caller waits for them."""
    for command in commands:
        if isinstance(command, QueueRequest):
            command.done(EngineDeadError(reason))


def _apply(engine: LLMEngine, command: object) -> None:
    if isinstance(command, AbortRequest):
        engine.abort_request(command.request_id)
    elif isinstance(command, QueueRequest):
        try:
            engine.add_processed_request(command.request)
        except Exception as e:  # InvalidInputError, or a bug: the caller reports it
            command.done(e)
        else:
            command.done(None)
