"""The CPU runner's thread count: fewer threads while other processes keep cores busy, all of
them again once the cores are free (``mmserve/worker/cpu_threads.py``)."""

import os
import subprocess
import sys

import pytest
import torch

from mmserve.worker import cpu_threads
from mmserve.worker.cpu_threads import AdaptiveThreads, CpuSample, read_sample, threads_for


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_chosen", None)
    monkeypatch.setattr(cpu_threads, "_last_set", None)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("max_threads,other_cores,current,expected", [
    (2, 0.0, None, 2), (2, 0.2, None, 2),  # a quiet machine, a little noise
    (2, 0.37, None, 2),  # a process asking for 50% of a core, beside two threads: two stay
    (2, 0.42, None, 1),  # one asking for 60%: one thread is faster
    (2, 0.66, None, 1), (2, 1.9, None, 1),  # a core taken; never fewer than one thread
    (2, 0.5, 1, 2),  # it asks for 50% and gets it once the core is left to it: take it back
    (2, 0.59, 1, 1), (2, 0.1, 1, 2),  # 60%: leave it; gone: take it back
    (8, 2.1, None, 6), (8, 2.1, 6, 6), (8, 1.5, 6, 7), (8, 3.6, None, 4), (4, 0.41, None, 3),
])
def test_threads_for(max_threads, other_cores, current, expected):
    assert threads_for(max_threads, other_cores, current) == expected


class FakeCores:
    """A timeline of samples: each ``advance`` adds wall time, this process's CPU time and
    other processes' CPU time on the cores."""

    def __init__(self) -> None:
        self.sample = CpuSample(busy_s=1000.0, own_s=10.0, wall_s=50.0)

    def advance(self, wall_s: float, own_cores: float, other_cores: float) -> None:
        s = self.sample
        self.sample = CpuSample(busy_s=s.busy_s + wall_s * (own_cores + other_cores),
                                own_s=s.own_s + wall_s * own_cores, wall_s=s.wall_s + wall_s)

    def __call__(self, cores):
        return self.sample

    def clock(self) -> float:
        return self.sample.wall_s


def _two_cores(monkeypatch) -> tuple[FakeCores, AdaptiveThreads]:
    """The policy on a process with cores 0 and 1 and two threads, over a fake timeline."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    torch.set_num_threads(2)
    cores = FakeCores()
    return cores, AdaptiveThreads(interval_s=0.5, read=cores, clock=cores.clock)


def test_adaptive_threads_follow_a_load_that_comes_and_goes(monkeypatch):
    cores, threads = _two_cores(monkeypatch)
    assert threads.max_threads == 2 and torch.get_num_threads() == 2

    cores.advance(0.6, own_cores=1.9, other_cores=0.05)  # quiet
    threads.update()
    assert torch.get_num_threads() == 2 and threads.other_cores == pytest.approx(0.05)

    cores.advance(0.6, own_cores=1.34, other_cores=0.66)  # a process spinning on one core
    threads.update()
    assert torch.get_num_threads() == 1 and threads.threads == 1

    cores.advance(0.2, own_cores=1.0, other_cores=0.0)  # too soon to look again
    threads.update()
    assert torch.get_num_threads() == 1

    cores.advance(0.6, own_cores=1.0, other_cores=1.0)  # still there: one thread stays
    threads.update()
    assert torch.get_num_threads() == 1

    cores.advance(0.6, own_cores=1.0, other_cores=0.0)  # gone: both threads again
    threads.update()
    assert torch.get_num_threads() == 2


def test_a_look_while_the_engine_waited_judges_nothing(monkeypatch):
    """Other processes busy while this one had no work (a client building its requests):
    nothing it competed for, so no core is given up."""
    cores, threads = _two_cores(monkeypatch)
    cores.advance(3.0, own_cores=0.1, other_cores=1.0)
    threads.update()
    assert torch.get_num_threads() == 2
    cores.advance(0.6, own_cores=1.34, other_cores=0.66)  # the same load beside its threads
    threads.update()
    assert torch.get_num_threads() == 1


def test_a_look_while_the_engine_waited_on_its_busy_front_end_judges_nothing(monkeypatch):
    """An engine in a process of its own counts its front end's time as its own: the front
    end parsing a burst of requests while the engine waits is not the engine competing, so
    another process busy meanwhile takes no core from it."""
    cores, threads = _two_cores(monkeypatch)
    s = cores.sample
    front_end, engine, client = 0.9, 0.05, 1.0  # cores' worth each, over 3 s
    cores.sample = CpuSample(busy_s=s.busy_s + 3.0 * (front_end + engine + client),
                             own_s=s.own_s + 3.0 * (front_end + engine),
                             wall_s=s.wall_s + 3.0, process_s=3.0 * engine)
    threads._last = CpuSample(s.busy_s, s.own_s, s.wall_s, process_s=0.0)
    threads.update()
    assert torch.get_num_threads() == 2


def _hold_one_thread(cores: FakeCores, threads: AdaptiveThreads, other_cores: float) -> None:
    """Looks at one thread until just before the probe, the others taking ``other_cores``."""
    looked = 0.0
    while looked + 0.6 < cpu_threads.PROBE_AFTER_S:
        cores.advance(0.6, own_cores=1.0, other_cores=other_cores)
        threads.update()
        looked += 0.6
        assert torch.get_num_threads() == 1


def test_a_given_up_core_is_probed_again(monkeypatch):
    """After PROBE_AFTER_S on fewer threads, one look with all of them: a spinning process
    still takes its share there (the core is given up again), a process that only filled the
    free core does not (it is kept)."""
    cores, threads = _two_cores(monkeypatch)
    cores.advance(0.6, own_cores=1.34, other_cores=0.66)
    threads.update()
    assert torch.get_num_threads() == 1

    _hold_one_thread(cores, threads, other_cores=1.0)  # spinning: all of the free core
    cores.advance(0.6, own_cores=1.0, other_cores=1.0)
    threads.update()
    assert torch.get_num_threads() == 2  # the probe
    cores.advance(0.6, own_cores=1.34, other_cores=0.66)  # still there beside two threads
    threads.update()
    assert torch.get_num_threads() == 1

    _hold_one_thread(cores, threads, other_cores=0.9)  # a client filling the free core...
    cores.advance(0.6, own_cores=1.0, other_cores=0.9)
    threads.update()
    assert torch.get_num_threads() == 2
    cores.advance(0.6, own_cores=1.7, other_cores=0.3)  # ...takes little beside two threads
    threads.update()
    assert torch.get_num_threads() == 2
    for _ in range(20):  # and nothing is given up or probed while that lasts
        cores.advance(0.6, own_cores=1.7, other_cores=0.3)
        threads.update()
        assert torch.get_num_threads() == 2


def test_a_later_engine_starts_from_the_users_thread_count(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    torch.set_num_threads(3)  # the user's choice: the ceiling, never raised past
    cores = FakeCores()
    first = AdaptiveThreads(interval_s=0.5, read=cores, clock=cores.clock)
    assert first.max_threads == 3
    cores.advance(1.0, own_cores=1.0, other_cores=2.0)
    first.update()
    assert torch.get_num_threads() == 1
    # Lowered by the first engine, not by the user: the second starts from the user's count.
    second = AdaptiveThreads(interval_s=0.5, read=cores, clock=cores.clock)
    assert second.max_threads == 3
    torch.set_num_threads(2)  # the user again
    assert AdaptiveThreads(interval_s=0.5, read=cores, clock=cores.clock).max_threads == 2


def test_the_memory_plan_counts_the_most_threads_an_engine_uses(monkeypatch):
    """Not the count an engine's policy lowered torch's to: `mmserve plan` and an engine
    started after another plan alike (torch's CPU attention keeps scratch per thread)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    torch.set_num_threads(3)
    assert cpu_threads.max_threads() == 3 and cpu_threads.max_threads(fixed=8) == 8
    cores = FakeCores()
    engine = AdaptiveThreads(interval_s=0.5, read=cores, clock=cores.clock)
    cores.advance(1.0, own_cores=1.0, other_cores=2.0)
    engine.update()
    assert torch.get_num_threads() == 1 and cpu_threads.max_threads() == 3
    torch.set_num_threads(8)  # more than the process's cores
    assert cpu_threads.max_threads() == 4


def test_nothing_to_measure_changes_nothing(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    torch.set_num_threads(2)
    threads = AdaptiveThreads(read=lambda cores: None)  # no /proc/stat
    threads.update()
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux's /proc/stat")
def test_read_sample_counts_this_process():
    cores = frozenset(os.sched_getaffinity(0))
    first = read_sample(cores)
    x = torch.randn(256, 256)
    while read_sample(cores).own_s - first.own_s < 0.05:  # some CPU time of our own
        x = (x @ x).tanh()
    second = read_sample(cores)
    assert second.wall_s > first.wall_s and second.own_s > first.own_s
    assert second.busy_s > first.busy_s  # the cores were busy at least with us


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux's /proc/stat")
def test_a_process_counted_as_own_adds_its_cpu_time(monkeypatch):
    """An engine in a process of its own counts its server's front end (event loop, image
    decoding, preprocessing) as its own work, as when they shared one process."""
    monkeypatch.setattr(cpu_threads, "_own_pids", set())
    busy = ("import sys, time\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass\nprint(flush=True)\nsys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", busy], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # it has used 0.3 s of CPU and now waits
        cores = frozenset(os.sched_getaffinity(0))
        alone = read_sample(cores)
        cpu_threads.count_as_own(child.pid)
        counted = read_sample(cores)
        assert counted.own_s - alone.own_s >= 0.3
    finally:
        child.communicate(b"")
    gone = read_sample(cores)  # a process that ended counts no more, and raises nothing
    assert gone.own_s < counted.own_s


def test_engine_takes_a_fixed_thread_count(clip_llama):
    from mmserve import LLM

    before = torch.get_num_threads()
    llm = LLM(clip_llama, device="cpu", dtype="float32", max_model_len=96, cpu_threads=1)
    assert torch.get_num_threads() == 1 and llm.engine.runner.adaptive_threads is None
    assert llm.engine.stats()["cpu_threads"] == 1
    llm.close()
    assert torch.get_num_threads() == before  # a closed engine gives the count back
    auto = LLM(clip_llama, device="cpu", dtype="float32", max_model_len=96)
    assert isinstance(auto.engine.runner.adaptive_threads, cpu_threads.AdaptiveThreads)
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer"):
        LLM(clip_llama, device="cpu", dtype="float32", max_model_len=96, cpu_threads=0)
