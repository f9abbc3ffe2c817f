"""The thread an engine is built on and steps on.

torch's x86 builds run their parallel regions on OpenMP (libgomp), which keeps a pool of
worker threads for each thread that has started a region, for that thread's life. Once a
second thread of the process has such a pool, the parallel regions of both run slower: a
decode step starts hundreds of short ones and pays for each. Measured on 2 cores (the LLaVA
bench checkpoint, bfloat16, 16 decode rows), a step took 13.8 ms on the thread that loaded the
model, 20.6 ms on another thread, and 17.8 ms on a thread that loaded the model after another
thread had run a single parallel region. The server used to build its engine on the main
thread and step it on a thread of its own; its decode steps took 18-21 ms.

So wherever an engine steps on a thread other than the caller's, it is built there too:
``ComputeThread`` runs the callables given to it one after the other on one thread (building
the engine, the engine loop, closing it), and the process's helper threads (preprocessing)
compute with one torch thread (``single_threaded``), which starts no pool.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class ComputeThread:
    """One daemon thread that runs what it is given, in order. It computes with as many
    torch threads as the thread that created it (torch's count is each thread's own)."""

    def __init__(self, name: str = "mmserve-engine") -> None:
        self._threads = torch.get_num_threads()
        self._todo: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on the thread after what was submitted before."""
        future: Future[T] = Future()
        self._todo.put((lambda: fn(*args, **kwargs), future))
        return future

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``submit``, and wait for the result (what ``fn`` raised is raised here). Called
        on the thread itself, runs ``fn`` right away."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        if sys.is_finalizing() or not self._thread.is_alive():
            # At interpreter exit a daemon thread runs no more: nothing would ever answer.
            raise RuntimeError(f"the thread {self._thread.name} no longer runs")
        return self.submit(fn, *args, **kwargs).result()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread once what was submitted has run (waiting up to ``timeout``)."""
        self._todo.put(None)
        if threading.current_thread() is not self._thread and not sys.is_finalizing():
            self._thread.join(timeout)

    def _serve(self) -> None:
        torch.set_num_threads(self._threads)
        while (item := self._todo.get()) is not None:
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 (raised where the result is taken)
                future.set_exception(e)


def single_threaded() -> None:
    """Compute with one torch thread on the calling thread: the initializer of helper
    threads that run a little torch beside an engine (one thread starts no OpenMP pool).
    torch takes the count as the default of threads started later, too; a ``ComputeThread``
    sets its own."""
    torch.set_num_threads(1)
