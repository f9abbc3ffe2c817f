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

A daemon thread killed inside torch when the interpreter exits aborts the process (a C++
``terminate``), as happens when Ctrl-C stops the caller while the thread builds an engine or
runs a step. So at exit (``atexit``) each ``ComputeThread`` drops the work it has not started
and the interpreter waits for what it runs, up to ``EXIT_WAIT_S``.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import glob
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# Seconds the interpreter's exit waits for the work a ComputeThread runs (a step, a load).
EXIT_WAIT_S = 120.0

_live: weakref.WeakSet[ComputeThread] = weakref.WeakSet()


class ComputeThread:
    """One daemon thread that runs what it is given, in order. It computes with as many
    torch threads as the thread that created it (torch's count is each thread's own)."""

    def __init__(self, name: str = "mmserve-engine") -> None:
        self._threads = torch.get_num_threads()
        self._todo: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = (
            queue.SimpleQueue())
        self._closed = False
        self._exiting = False  # the interpreter exits: start nothing more
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on the thread after what was submitted before."""
        if self._closed:
            raise RuntimeError(f"the thread {self._thread.name} is closed")
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
        future = self.submit(fn, *args, **kwargs)
        try:
            return future.result()
        except BaseException:
            # Interrupted while waiting (Ctrl-C): what has not started never will; what runs
            # finishes first, so that no torch work is cut off in the middle.
            if not future.cancel():
                future.exception()
            raise

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread once what was submitted has run (waiting up to ``timeout``)."""
        if not self._closed:
            self._closed = True
            self._todo.put(None)
        if threading.current_thread() is not self._thread and not sys.is_finalizing():
            self._thread.join(timeout)

    def _quiesce(self) -> None:
        """At interpreter exit: drop the work not started, wait for the work running."""
        self._exiting = True
        self.close(EXIT_WAIT_S)

    def _serve(self) -> None:
        torch.set_num_threads(self._threads)
        while (item := self._todo.get()) is not None:
            fn, future = item
            del item  # nothing of a finished call stays referenced while the thread waits
            if self._exiting or not future.set_running_or_notify_cancel():
                future.cancel()
                del fn, future
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 (raised where the result is taken)
                future.set_exception(e)
            del fn, future


@atexit.register
def _quiesce_all() -> None:
    for compute in list(_live):
        compute._quiesce()


def single_threaded() -> None:
    """Compute with one torch thread on the calling thread: the initializer of helper
    threads that run a little torch beside an engine (one thread starts no OpenMP pool).

    Only this thread's count changes: ``torch.set_num_threads`` would also make 1 the count
    of every thread started later (an engine's included, and the caller's next one), so the
    OpenMP runtime torch loaded is told directly, once torch has set the thread up."""
    torch.get_num_threads()  # torch's own set-up of this thread first, or it would undo ours
    omp = _openmp()
    if omp is not None:
        omp.omp_set_num_threads(1)
    else:  # no OpenMP runtime found beside torch: its setting, with its side effect
        torch.set_num_threads(1)


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (its own copy of libgomp, or Intel's), if found."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    for pattern in ("libgomp*.so*", "libiomp5*.so*"):
        for path in sorted(glob.glob(os.path.join(lib, pattern))):
            try:
                omp = ctypes.CDLL(path)  # already loaded by torch: the same copy
                omp.omp_set_num_threads.argtypes = [ctypes.c_int]
                return omp
            except (OSError, AttributeError):
                continue
    return None
