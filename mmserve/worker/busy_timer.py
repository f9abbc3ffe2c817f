"""How long the device computed: the spans of each step's device work (the vision encoder, the
decoder's forward pass with the LM head, sampling), summed over a run.

On a GPU a span is a pair of CUDA events recorded on the stream the steps run on, so its
length is the GPU's time from reaching the first to reaching the second, whatever the CPU did
meanwhile; the spans' sum against a run's wall time is the share of the run the GPU had the
model's work. It is an upper bound: a span also counts the GPU's waits inside it for kernels
the CPU had not launched yet (eager prefill launches hundreds; a decode step replayed as a CUDA
graph, one). On the CPU, whose cores are the device, a span is the wall time it took.

Events are folded into the total as they complete, so a long run keeps only the spans the
GPU has not reached yet. Spans are added on the thread that steps and read on any other (a
benchmark's), under a lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class BusyTimer:
    """Sums spans of device work; ``span()`` around each, ``total_s()`` at the end."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.num_spans = 0
        self._busy_s = 0.0
        self._open: deque[tuple[Any, Any]] = deque()  # (start, end) not folded in yet
        self._lock = threading.Lock()

    @contextmanager
    def span(self) -> Iterator[None]:
        start = self._mark()
        try:
            yield
        finally:
            end = self._mark()
            with self._lock:
                self._open.append((start, end))
                self._fold(wait=False)

    def total_s(self) -> float:
        """Seconds of every span ended so far (on a GPU, once it has reached the last one)."""
        with self._lock:
            self._fold(wait=True)
            return self._busy_s

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record()
        return event

    def _fold(self, wait: bool) -> None:
        while self._open:
            start, end = self._open[0]
            if self.cuda:
                if not wait and not end.query():
                    return  # the GPU is still before this span's end: later
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                seconds = end - start
            self._open.popleft()
            self._busy_s += seconds
            self.num_spans += 1
