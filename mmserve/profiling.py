"""Labels for torch's profiler: each step's phases, and the calls of the CPU's compiled kernels
(which torch does not see), as named ranges in its tables and traces (``mmserve bench
throughput --profile``).

A label is ``torch.profiler.record_function("mmserve.NAME")`` while the profiler records and
nothing otherwise, so that steps pay one C call for it when nobody profiles.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.profiler import record_function

PREFIX = "mmserve."


def phase(name: str) -> AbstractContextManager:
    """The range ``mmserve.<name>`` in a profile being recorded; nothing otherwise."""
    if torch.autograd._profiler_enabled():
        return record_function(PREFIX + name)
    return nullcontext()
