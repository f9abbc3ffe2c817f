"""How many threads the CPU runner computes with: one per core while the cores are its own,
fewer while other processes keep some of them busy.

Every parallel region of a step (a matmul, an attention call) ends with its threads waiting
for the slowest one. A thread that shares its core with another process runs at a fraction of
its speed, so every region waits on it, and its siblings spin at the barrier meanwhile: with
one of two cores busy elsewhere, two threads computed a third as fast as on a quiet machine,
where one thread keeps about half (``benchmarks/README.md``). So the runner measures, twice a
second, how much of its cores other processes used (``/proc/stat`` minus this process's own
CPU time) and computes with one thread fewer for every core they keep busy: more than 40% of
it beside a compute thread (which leaves them less than they ask for), and takes a core back
once they use less than 55% of it on their own.

This process's own service threads (the server's event loop, image loaders, preprocessing
pool), or the server's front end where the engine runs in a process of its own, count as its
own time, not as other work: counted as other work, their bursts while a
server took large images turned the runner down to one thread, and it served 18-29% fewer
tokens than with both threads.

Two rules keep it from giving a core away for nothing. A look over which the engine mostly
waited for work judges nothing (a benchmark client building its requests while the server was
idle used to take a core from the whole run). And a core given up is taken back for one look
every ``PROBE_AFTER_S``: a process that takes whatever is free fills the given-up core and so
never lets the take-back rule fire, though beside both compute threads it takes little. Against
vLLM's benchmark client on the same 2 cores (``benchmarks/compare_vllm_serve.py``), the server
gave 270-290 output tokens/s before these rules and 298-305 after, as with two fixed threads.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# What other processes get of a core they share with a compute thread is less than they ask
# for, so the share that gives a core up is lower than the share that takes it back. Text
# decoding on 2 cores (``benchmarks/thread_policy.py``): a process asking for 50% of a core got
# 37% beside two compute threads, and two threads stayed 5% faster than one; asking for 60% it
# got 42%, and one thread was 13% faster. With the core left to it, it gets what it asks for.
# Give a core up when other processes take more than this of it beside a compute thread...
GIVE_UP_SHARE = 0.4
# ... and take it back once they take less than this of the core left to them.
TAKE_BACK_SHARE = 0.55
# Seconds between two looks at the cores: long enough that the kernel's tick counts (100 a
# second) measure the share to a few percent, short enough to follow a load that comes and goes.
INTERVAL_S = 0.5
# Seconds with a core given up before it is taken back for one look (a probe). A process that
# takes whatever is free (a benchmark client parsing its streams, a build) fills the given-up
# core, so its share of it never falls under TAKE_BACK_SHARE; beside all the compute threads
# it may take little. The probe measures it there again: a spinning process still takes its
# share and the core is given up once more (about one look in ten spent at the wrong count),
# while an elastic one leaves it.
PROBE_AFTER_S = 5.0
# A look over which this process used less than this many cores judges nothing: the engine
# waited for requests, and what other processes did meanwhile (a client building its
# requests) says nothing about what they take beside compute threads.
IDLE_OWN_CORES = 0.5


@dataclass(frozen=True)
class CpuSample:
    """Busy seconds of the cores so far (all processes), and this process's CPU seconds."""

    busy_s: float
    own_s: float  # this process's and those counted as its own (``count_as_own``)
    wall_s: float
    process_s: float | None = None  # this process's alone (None: own_s)


def threads_for(max_threads: int, other_cores: float, current: int | None = None) -> int:
    """Threads to compute with, now ``current`` (default: all), when other processes used
    ``other_cores`` cores' worth of time: one fewer per core they keep busier than
    ``GIVE_UP_SHARE``, and one given back only while they stay under ``TAKE_BACK_SHARE``."""
    current = max_threads if current is None else current

    def leaving(share: float) -> int:
        return max(1, max_threads - max(0, math.ceil(other_cores - share)))

    if leaving(GIVE_UP_SHARE) < current:
        return leaving(GIVE_UP_SHARE)
    return max(current, leaving(TAKE_BACK_SHARE))


def read_sample(cores: frozenset[int]) -> CpuSample | None:
    """The cores' busy time from ``/proc/stat`` (user, nice, system, irq, softirq and steal
    ticks), this process's CPU time, now; None where ``/proc/stat`` cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = f.readlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            fields = [int(v) for v in rest.split()]
            user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
            ticks += user + nice + system + irq + softirq + steal
    tick = os.sysconf("SC_CLK_TCK")
    process = time.process_time()
    own = process + sum(_cpu_ticks(pid) for pid in _own_pids) / tick
    return CpuSample(ticks / tick, own, time.monotonic(), process)


# Processes whose CPU time counts as this one's (``count_as_own``).
_own_pids: set[int] = set()


def count_as_own(pid: int) -> None:
    """Count process ``pid``'s CPU time as this process's own: an engine in a process of its
    own (``engine/core_process.py``) counts its server's front end, whose event loop, image
    decoding and preprocessing are the same service's work, as when they shared one process."""
    _own_pids.add(pid)


def _cpu_ticks(pid: int) -> int:
    """User and system ticks of process ``pid`` so far; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return 0
    fields = text[text.rindex(")") + 2:].split()  # the name may hold spaces and brackets
    return int(fields[11]) + int(fields[12])


# The thread count before any ``AdaptiveThreads`` lowered it, and the count it last set: a
# later engine in the same process starts from the count the user chose, not from a lowered one.
_chosen: int | None = None
_last_set: int | None = None


def _max_threads() -> int:
    global _chosen
    current = torch.get_num_threads()
    if _last_set is None or current != _last_set or _chosen is None:
        _chosen = current
    return _chosen


def max_threads(fixed: int | None = None) -> int:
    """The most compute threads a CPU runner set to ``fixed`` (None: adaptive) ever uses: the
    figure the memory plan counts per-thread scratch for."""
    if fixed is not None:
        return fixed
    return min(_max_threads(), len(os.sched_getaffinity(0)))


def _set_threads(n: int) -> None:
    global _last_set
    torch.set_num_threads(n)
    _last_set = n


def restore_threads() -> None:
    """torch's thread count back to the one chosen before any ``AdaptiveThreads`` lowered it
    (unless someone set another since): what a closed engine leaves behind."""
    global _last_set
    if _chosen is not None and torch.get_num_threads() == _last_set:
        torch.set_num_threads(_chosen)
    _last_set = None


class AdaptiveThreads:
    """Sets torch's thread count from what other processes leave of this process's cores;
    ``update()`` before each step (it looks at most once per ``interval_s``)."""

    def __init__(self, interval_s: float = INTERVAL_S,
                 read: Callable[[frozenset[int]], CpuSample | None] = read_sample,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cores = frozenset(os.sched_getaffinity(0))
        self.max_threads = max_threads()
        self.interval_s = interval_s
        self._read, self._clock = read, clock
        self._last = read(self.cores)
        self._next_look = clock() + interval_s
        self.threads = self.max_threads
        self.other_cores = 0.0  # other processes' use of the cores at the last look
        self._lowered_since: float | None = None  # when threads last went under the most
        if self.threads != torch.get_num_threads():
            _set_threads(self.threads)

    def update(self) -> None:
        if self._last is None or self.max_threads <= 1 or self._clock() < self._next_look:
            return  # nothing to measure, nothing to give up, or too soon (the step's hot path)
        now = self._read(self.cores)
        if now is None or now.wall_s - self._last.wall_s < self.interval_s:
            return
        self._next_look = self._clock() + self.interval_s
        wall = now.wall_s - self._last.wall_s
        # Whether the engine waited for work: this process's time alone (a server's front
        # end counted as its own may be busy parsing requests while the engine waits).
        if now.process_s is not None and self._last.process_s is not None:
            engine_cores = (now.process_s - self._last.process_s) / wall
        else:
            engine_cores = (now.own_s - self._last.own_s) / wall
        other_cores = max(0.0, (now.busy_s - self._last.busy_s)
                          - (now.own_s - self._last.own_s)) / wall
        self._last = now
        if engine_cores < IDLE_OWN_CORES:
            return  # the engine mostly waited for work: nothing it competed for to judge
        self.other_cores = other_cores
        threads = threads_for(self.max_threads, self.other_cores, self.threads)
        probe = False
        if threads == self.max_threads:
            self._lowered_since = None
        elif self._lowered_since is None or threads < self.threads:
            self._lowered_since = now.wall_s
        elif now.wall_s - self._lowered_since >= PROBE_AFTER_S:
            threads, probe, self._lowered_since = self.max_threads, True, None
        if threads != self.threads:
            logger.log(logging.DEBUG if probe else logging.INFO,
                       "other processes keep %.1f of this process's %d cores busy: computing "
                       "with %d of %d threads%s", self.other_cores, len(self.cores), threads,
                       self.max_threads, " (a probe)" if probe else "")
            self.threads = threads
            _set_threads(threads)
