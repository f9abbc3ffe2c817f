"""The thread an engine is built on is the thread it steps on (``worker/compute_thread.py``):
the server's engine loop, and the runner of asynchronous scheduling (loaded, stepped and
closed there); helper threads compute with one torch thread; nothing waits on that thread once
the interpreter exits."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.engine.async_engine import AsyncEngine
from mmserve.worker.compute_thread import ComputeThread, single_threaded
from mmserve.worker.model_runner import CPUModelRunner
from tests.test_parity import mixed_batch
from tests.test_server_async_engine import FakeEngine


def test_runs_in_order_on_one_thread_and_raises_where_the_result_is_taken() -> None:
    compute = ComputeThread("test-compute")
    try:
        seen: list[tuple[int, int]] = []
        futures = [compute.submit(lambda i=i: seen.append((i, threading.get_ident())))
                   for i in range(20)]
        for f in futures:
            f.result(timeout=10)
        assert [i for i, _ in seen] == list(range(20))
        assert {ident for _, ident in seen} == {compute.ident} != {threading.get_ident()}
        with pytest.raises(ZeroDivisionError):
            compute.call(lambda: 1 / 0)
        assert compute.call(lambda: 7) == 7  # still serving after a failure
        # A call made on the thread itself runs there and then, not behind itself.
        assert compute.call(lambda: compute.call(threading.get_ident)) == compute.ident
    finally:
        compute.close(timeout=10)
    with pytest.raises(RuntimeError, match="no longer runs"):
        compute.call(lambda: None)


def test_computes_with_its_creators_thread_count() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        compute = ComputeThread()
        assert compute.call(torch.get_num_threads) == 1
        compute.close(timeout=10)
    finally:
        torch.set_num_threads(before)


def test_helper_threads_compute_single_threaded() -> None:
    before = torch.get_num_threads()
    counts: list[int] = []

    def helper() -> None:
        single_threaded()
        counts.append(torch.get_num_threads())

    def later() -> None:
        counts.append(torch.get_num_threads())

    for target in (helper, later):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    # The helper's count is its own: neither the caller's nor a later thread's changes.
    assert counts == [1, before]
    assert torch.get_num_threads() == before


def test_the_engine_loop_runs_on_the_thread_given() -> None:
    compute = ComputeThread("test-engine")
    fake = FakeEngine()

    async def main() -> list[int]:
        engine = AsyncEngine(fake, compute=compute)
        engine.start()
        stream = await engine.add_request("a", "ok", SamplingParams(max_tokens=3))
        got = [len(out.token_ids) async for out in stream]
        await engine.shutdown()
        assert not engine.is_alive
        return got

    try:
        assert asyncio.run(asyncio.wait_for(main(), timeout=10)) == [1, 2, 3]
        assert fake.thread_ids == {compute.ident}
        assert compute.call(lambda: "still mine") == "still mine"  # shutdown left it running
    finally:
        compute.close(timeout=10)


def test_async_scheduling_builds_steps_and_closes_its_runner_on_one_thread(
        clip_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    where: dict[str, set[int]] = {"load": set(), "launch": set(), "close": set()}
    load, launch, close = (CPUModelRunner.load_model, CPUModelRunner.launch,
                           CPUModelRunner.close)
    runners: list = []  # this engine's (another test's engine may be collected meanwhile)

    def record(name, fn):
        def wrapped(*args, **kwargs):
            if name == "load" or args[0] in runners:
                where[name].add(threading.get_ident())
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(CPUModelRunner, "load_model", classmethod(record("load", load.__func__)))
    monkeypatch.setattr(CPUModelRunner, "launch", record("launch", launch))
    monkeypatch.setattr(CPUModelRunner, "close", record("close", close))
    llm = LLM(clip_llama, device="cpu", dtype="float32", max_model_len=256,
              async_scheduling=True)
    compute = llm.engine._compute
    runners.append(llm.engine.runner)
    outs = llm.generate(mixed_batch()[:3], SamplingParams(max_tokens=6, temperature=0.0))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    ident = compute.ident
    llm.close()
    assert where == {"load": {ident}, "launch": {ident}, "close": {ident}}
    assert ident != threading.get_ident()


@pytest.mark.slow
def test_the_interpreter_exits_with_engines_left_open(clip_llama: str) -> None:
    """Engines nobody closed (one stepping on the caller's thread, one scheduling ahead on
    its runner's) are collected at exit; their runners' threads no longer run then, and
    nothing may wait for them."""
    script = textwrap.dedent(f"""
        from mmserve import LLM, SamplingParams
        for ahead in (False, True):
            llm = LLM({clip_llama!r}, device="cpu", dtype="float32", max_model_len=256,
                      async_scheduling=ahead)
            out = llm.generate(["a cat"], SamplingParams(max_tokens=3, temperature=0.0))
            print(len(out[0].outputs[0].token_ids), llm.engine.config.async_scheduling)
            globals()[f"left_open_{{ahead}}"] = llm
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["3", "False", "3", "True"], done.stdout


def test_a_fixed_thread_count_is_reported_as_the_runner_computes(clip_llama: str) -> None:
    llm = LLM(clip_llama, device="cpu", dtype="float32", max_model_len=256,
              async_scheduling=True, cpu_threads=1)
    try:
        assert llm.engine.on_runner_thread(torch.get_num_threads) == 1
        assert llm.engine.stats()["cpu_threads"] == 1
    finally:
        llm.close()


def test_an_engine_that_fails_to_start_leaves_no_thread(
        clip_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The failed call's frames (the half-built engine among them) are not kept by the
    runner's thread, so the engine is collected and closes it."""
    def fail(self, num_blocks):
        raise MemoryError("no room for the KV cache")

    monkeypatch.setattr(CPUModelRunner, "allocate_kv_cache", fail)

    def steps_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "mmserve-steps"]

    before = len(steps_threads())
    with pytest.raises(MemoryError, match="no room"):
        LLM(clip_llama, device="cpu", dtype="float32", max_model_len=256,
            async_scheduling=True)
    gc.collect()
    for t in steps_threads():
        t.join(timeout=10)
    assert len(steps_threads()) == before
