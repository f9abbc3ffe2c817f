"""`mmserve bench throughput --profile DIR`: a stretch of the run's steps under torch's profiler.

What it writes into DIR, and prints the head of:

- ``phases.txt``: the step's phases as the engine labels them (``mmserve.profiling``):
  scheduling, the runner's encoder, input preparation, forward pass and sampling, the wait
  for a step launched earlier (``collect``), the books (``update``) and the outputs, each
  with its calls, its host time and the device time of the kernels it launched.
- ``operators.txt``: torch's operator table, by self device time on a GPU (which kernels the
  GPU spends its time in), by self CPU time otherwise.
- ``trace.json.gz``: the timeline of every operator, kernel and phase, for Perfetto
  (ui.perfetto.dev) or chrome://tracing.

``--profile-steps START:END`` records steps START to END - 1 (counted from 0; either may be
left out): a window of decode steps, say, instead of the whole run, and a smaller trace. Every
thread of the process is recorded where torch can (the CPU runner steps on a thread of its own
when scheduling ahead).
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
import time
from pathlib import Path
from types import TracebackType

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, profile

from mmserve.profiling import PREFIX, set_recording

OPERATOR_ROWS = 30  # in operators.txt; the report prints the first 12
PRINTED_OPERATOR_ROWS = 12


def parse_steps(text: str) -> tuple[int, int | None]:
    """``START:END``, ``START:`` or ``:END`` as ``(start, end)`` (end None: the run's end)."""
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        first = int(start) if start.strip() else 0
        last = int(end) if end.strip() else None
    except ValueError:
        raise ValueError(f"--profile-steps {text!r}: give START:END (steps counted from 0, "
                         "END not included; either may be left out), e.g. 20:40") from None
    if first < 0 or (last is not None and last <= first):
        raise ValueError(f"--profile-steps {text!r}: START must be >= 0 and END > START")
    return first, last


class StepProfiler:
    """torch's profiler over steps ``[first, end)`` of a run: call ``before_step(i)`` before
    step ``i``; leaving the ``with`` block stops it (if the run ended inside the window) and
    writes the report. ``cuda``: record the GPU's kernels too."""

    def __init__(self, directory: str | Path, first: int = 0, end: int | None = None,
                 cuda: bool = False) -> None:
        self.directory = Path(directory)
        self.first, self.end = first, end
        self.cuda = cuda
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._profile = profile(activities=activities, experimental_config=_all_threads())
        self._recording = False
        self._started_s = 0.0
        self.steps: list[int] = []  # the steps recorded
        self.elapsed_s = 0.0
        self.report = ""

    def before_step(self, index: int) -> None:
        if self._recording and self.end is not None and index >= self.end:
            self._stop()
            self.report = self._write()  # now: the rest of the run may not end well
        elif not self._recording and not self.steps and index >= self.first and (
                self.end is None or index < self.end):
            self._sync()
            self._profile.start()
            set_recording(True)
            self._recording = True
            self._started_s = time.perf_counter()
        if self._recording:
            self.steps.append(index)

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._recording:
            self._stop(sync=exc_type is None)  # (a failed run's device may not answer)
            if exc_type is None:
                self.report = self._write()
        elif not self.report and exc_type is None:  # the run ended before the window
            self.report = self._write()

    def _sync(self) -> None:
        # Steps launch their kernels ahead (a GPU's default): the window holds those launched
        # while it was open, the first's launched the step before it.
        if self.cuda:
            torch.cuda.synchronize()

    def _stop(self, sync: bool = True) -> None:
        try:
            if sync:
                self._sync()
        finally:
            self.elapsed_s = time.perf_counter() - self._started_s
            set_recording(False)
            self._profile.stop()
            self._recording = False

    def _write(self) -> str:
        self.directory.mkdir(parents=True, exist_ok=True)
        if not self.steps:
            text = (f"torch profiler: the run ended before step {self.first}; nothing recorded "
                    "(see --profile-steps)\n")
            (self.directory / "phases.txt").write_text(text)
            return text
        # With the GPU's activity each labelled range also comes back as a span on the
        # device, under the same name: the phases are the host's ranges, with the time of the
        # kernels inside them; the operators leave those spans out.
        events = EventList([e for e in self._profile.key_averages()
                            if e.device_type == DeviceType.CPU
                            or not getattr(e, "is_user_annotation", False)],
                           use_device="cuda" if self.cuda else None)
        window = (f"steps {self.steps[0]}-{self.steps[-1]} ({len(self.steps)} steps, "
                  f"{self.elapsed_s:.2f} s)")
        phases = phase_table(events, self.cuda)
        (self.directory / "phases.txt").write_text(f"{window}\n{phases}\n")
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        operators = events.table(sort_by=sort_by, row_limit=OPERATOR_ROWS, max_name_column_width=60)
        (self.directory / "operators.txt").write_text(operators + "\n")
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            self._profile.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(self.directory / "trace.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        head = "\n".join(operators.splitlines()[:PRINTED_OPERATOR_ROWS + 3])
        by = "self device time" if self.cuda else "self CPU time"
        return (f"-- torch profiler: {window}; in {self.directory} --\n{phases}\n"
                f"operators by {by} (all of them in operators.txt):\n{head}\n")


def _all_threads():
    """torch's option to record every thread (the CPU runner steps on a thread of its own
    when scheduling ahead), where this torch has it; None (the starting thread's) otherwise."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


def phase_table(events, cuda: bool) -> str:
    """The ``mmserve.*`` ranges of ``key_averages()``: calls, host ms (the range's wall time on
    its thread) and, on a GPU, the device ms of the kernels launched inside it."""
    rows = sorted((e for e in events
                   if e.key.startswith(PREFIX) and e.device_type == DeviceType.CPU),
                  key=lambda e: -e.cpu_time_total)
    lines = [f"{'phase':<18} {'calls':>7} {'host ms':>10} {'ms a call':>10}"
             + (f" {'device ms':>10}" if cuda else "")]
    for e in rows:
        line = (f"{e.key.removeprefix(PREFIX):<18} {e.count:>7} {e.cpu_time_total / 1e3:>10.1f} "
                f"{e.cpu_time_total / 1e3 / e.count:>10.3f}")
        if cuda:
            line += f" {e.device_time_total / 1e3:>10.1f}"
        lines.append(line)
    return "\n".join(lines)
