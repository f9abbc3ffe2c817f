"""Labels for torch's profiler: each step's phases, and the calls of the CPU's compiled linear
layers and attention (which torch does not see), as named ranges in its tables and traces
(``mmserve bench throughput --profile``). The compiled norms, rotary and activations are not
labelled: their time is the forward phase's own.

A label is ``torch.profiler.record_function("mmserve.NAME")`` while a profiler records and
nothing otherwise, so that steps pay a check for it when nobody profiles. torch says whether
its profiler records on the thread that asks only; one recording every thread (the CPU runner
steps on a thread of its own) says so here too (``set_recording``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.profiler import record_function

PREFIX = "mmserve."

_recording_all_threads = False
_NOTHING = nullcontext()  # reusable: it holds no state


def set_recording(on: bool) -> None:
    """Label every thread's phases (a profiler that records all threads is on), or not."""
    global _recording_all_threads
    _recording_all_threads = on


def phase(name: str) -> AbstractContextManager:
    """The range ``mmserve.<name>`` in a profile being recorded; nothing otherwise."""
    if _recording_all_threads or torch.autograd._profiler_enabled():
        return record_function(PREFIX + name)
    return _NOTHING
