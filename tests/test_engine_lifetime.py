"""Engines that come and go: ``close()``, ``with LLM(...)`` and dropping the last reference give
back everything an engine took, so the next engine in the same process plans and starts exactly
like the first. Runs on the default device: the CPU checks the process's resident memory, a GPU
the CUDA allocator's reserved memory.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.config import EngineConfig
from mmserve.engine.llm_engine import gpu_memory_shortfall
from mmserve.errors import EngineDeadError
from mmserve.worker import collector, cpu_threads
from tests.conftest import assert_no_leaks, make_image

GiB = 2**30


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _held_bytes(device: str) -> int:
    """What this process holds: the CUDA allocator's reserved memory, or resident memory."""
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved()
    return _resident_bytes()


def _decisions(llm: LLM) -> dict:
    """The plan; on the CPU without the figures of the RAM available at start-up, which moves
    with everything else on the machine (a GPU's plan starts from its total memory)."""
    plan = llm.memory_plan().to_dict()
    if plan["device"] == "cpu":
        for measured in ("memory_bytes", "budget_bytes", "kv_budget_blocks"):
            plan.pop(measured)
    return plan


def _use(llm: LLM) -> list[int]:
    prompt = {"messages": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "what is in this picture?"}]}],
        "images": [make_image(1, (48, 40))]}
    out = llm.generate([prompt, "USER: hello\nASSISTANT:"],
                       SamplingParams(max_tokens=8, temperature=0.0))
    assert_no_leaks(llm.engine)
    return [o.token_ids for o in out]


@pytest.mark.parametrize("beside", [False, True], ids=["alone", "another engine open"])
def test_three_engines_in_turn_plan_alike_and_give_their_memory_back(clip_llama, beside,
                                                                    request):
    """Also while another engine stays open, whose thread policy lowered the thread count:
    each close collects what that engine's frozen start-up would otherwise keep for good."""
    device = EngineConfig(clip_llama).resolved_device
    if beside:
        other = LLM(clip_llama, dtype="float32", max_model_len=128, kv_cache_memory=2**20)
        request.addfinalizer(other.close)
        cpu_threads._set_threads(1)  # as the policy does when other processes take a core
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    baseline = _held_bytes(device)
    # An engine of an earlier test still open in this process may have lowered the count
    # (its thread policy gives a core to other processes): closing it would give that back,
    # and so does each engine here, which is what the count is checked against.
    cpu_threads.restore_threads()
    threads = torch.get_num_threads()
    plans, tokens, closed = [], [], []
    for turn in range(3):
        llm = LLM(clip_llama, dtype="float32")
        tokens.append(_use(llm))
        plans.append(_decisions(llm))
        kv_bytes = llm.memory_plan().kv_cache_bytes
        held_open = _held_bytes(device)
        assert held_open - baseline >= 0.9 * kv_bytes  # the KV cache was really there
        if turn < 2:
            with llm:  # the end of the block closes it
                pass
            assert _held_bytes(device) < held_open - 0.9 * kv_bytes
        else:  # dropping the last reference closes it too
            engine = weakref.ref(llm.engine)
            del llm
            assert engine() is None
        closed.append(_held_bytes(device))
        assert torch.get_num_threads() == threads
    assert plans[0] == plans[1] == plans[2]
    assert tokens[0] == tokens[1] == tokens[2]
    if device == "cuda":  # the allocator holds no more than before the first engine
        assert closed == [baseline] * 3
    else:  # the first engine also loaded code and libraries for good
        assert max(closed[1:]) <= closed[0] + 16 * 2**20, closed


def test_a_closed_engine_refuses_work_and_closes_once(clip_llama):
    llm = LLM(clip_llama, dtype="float32", max_model_len=128)
    llm.engine.add_request("USER: a request in flight\nASSISTANT:")
    llm.close()
    assert llm.engine.runner.kv_caches == [] and llm.engine.runner.model is None
    assert llm.engine.device_bytes == 0
    stats = llm.stats()  # counters stay readable
    assert stats["num_running"] == stats["num_waiting"] == 0
    with pytest.raises(EngineDeadError, match="the engine is closed"):
        llm.generate("USER: hello\nASSISTANT:")
    with pytest.raises(EngineDeadError, match="the engine is closed"):
        llm.engine.step()
    llm.close()  # a second close does nothing


def test_closing_restores_the_thread_count_the_adaptive_policy_lowered(clip_llama,
                                                                      monkeypatch):
    if EngineConfig(clip_llama).resolved_device != "cpu":
        pytest.skip("about the CPU runner's thread policy")
    if torch.get_num_threads() < 2:
        pytest.skip("needs two threads to lower one")
    threads = torch.get_num_threads()
    llm = LLM(clip_llama, dtype="float32", max_model_len=128)
    cpu_threads._set_threads(1)  # as the policy does when other processes take a core
    assert torch.get_num_threads() == 1
    llm.close()
    assert torch.get_num_threads() == threads


def test_start_up_objects_are_out_of_the_collectors_sight_until_close(clip_llama):
    before = collector.holders()
    # What a full collection leaves frozen with nothing frozen by an engine: none, but on
    # Python 3.12 a full collection moves the immortal objects it meets there (a few hundred).
    gc.collect()
    resting = gc.get_freeze_count()
    first = LLM(clip_llama, dtype="float32", max_model_len=128)
    model = first.engine.model
    # Frozen: a full collection walks none of the objects start-up made (the model's included).
    assert gc.get_freeze_count() > 0 and collector.holders() == before + 1
    assert not any(o is model for o in gc.get_objects())
    assert _use(first) == _use(first)
    second = LLM(clip_llama, dtype="float32", max_model_len=128)
    first.close()  # another engine still runs: what is frozen stays so
    assert collector.holders() == before + 1 and gc.get_freeze_count() > 0
    second.close()
    second.close()  # closing twice counts once
    assert collector.holders() == before
    if before == 0:  # (no engine of an earlier test left open in this process)
        gc.collect()
        assert gc.get_freeze_count() <= resting
        assert any(o is model for o in gc.get_objects())


def test_an_unclosed_engine_finalized_by_the_next_ones_start_up_does_not_hang_it():
    """An engine left unclosed in a reference cycle is closed by its finalizer when the
    collector finds it, which may be the collection the next engine's start-up runs before
    freezing: its close thaws, and must not wait for the lock that start-up holds."""
    before = collector.holders()

    class Unclosed:  # an engine as the collector meets it: garbage in a cycle, not frozen,
        def __init__(self) -> None:  # its hold given back when it is finalized
            self.cycle = self

        def __del__(self) -> None:
            collector.thaw()

    collector.freeze_long_lived()  # its start-up
    Unclosed()
    start_up = threading.Thread(target=collector.freeze_long_lived, daemon=True)
    start_up.start()
    start_up.join(timeout=30)
    assert not start_up.is_alive(), "freezing waited on itself"
    assert collector.holders() == before + 1  # the new engine's; the finalized one's is gone
    collector.thaw()
    assert collector.holders() == before


# ----------------------------------------------------------------- a GPU that is not free
def test_memory_this_process_caches_counts_as_free():
    assert gpu_memory_shortfall(needed=90 * GiB, total=100 * GiB, free=20 * GiB,
                                reserved=75 * GiB, allocated=1 * GiB, engines=[]) is None


def test_a_shortfall_says_whose_memory_it_is():
    message = gpu_memory_shortfall(needed=90 * GiB, total=100 * GiB, free=20 * GiB,
                                   reserved=70 * GiB, allocated=66 * GiB,
                                   engines=[65 * GiB])
    assert "asks for 96636764160 bytes but only 25769803776 of 107374182400" in message
    assert "1 other engine of this process holds 65.00 GiB (close them first: LLM.close()" \
        in message
    assert "other tensors of this process hold 1.00 GiB" in message
    assert "other processes hold 10.00 GiB" in message
    assert message.endswith("lower --gpu-memory-utilization to at most 0.24.")
    only_others = gpu_memory_shortfall(needed=90 * GiB, total=100 * GiB, free=5 * GiB,
                                       reserved=0, allocated=0, engines=[])
    assert "other processes hold 95.00 GiB" in only_others and "engine" not in only_others



def test_one_caller_steps_an_engine_at_a_time(clip_llama):
    """An engine a server's loop steps refuses the Python API's calls (their steps and
    requests would mix with the server's), as one another call is stepping does; once the
    server has stopped, the ``LLM`` works again."""
    from starlette.testclient import TestClient

    from mmserve.beam_search import BeamSearchParams
    from mmserve.entrypoints.api_server import OpenAIServer
    from mmserve.entrypoints.serve_args import ServerConfig

    params = SamplingParams(max_tokens=3, temperature=0.0)
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        expected = llm.generate("a fox", params)[0].token_ids
        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as http:
            for call in (lambda: llm.generate("a fox", params), lambda: llm.embed("a fox"),
                         lambda: llm.beam_search("a fox", BeamSearchParams(2, 3))):
                with pytest.raises(RuntimeError, match="server's engine loop"):
                    call()
            answer = http.post("/v1/completions", json={"prompt": "a fox", "max_tokens": 3,
                                                        "temperature": 0})
            assert answer.status_code == 200, answer.text
        with llm.engine.stepping("another thread's call"):
            with pytest.raises(RuntimeError, match="another thread's call, so an LLM call "
                               "on thread 'MainThread'"):
                llm.generate("a fox", params)
            with pytest.raises(RuntimeError, match="another thread's call, so a server's"):
                with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()):
                    pass
        # A server whose start fails after its engine loop started gives the steps back.
        server = OpenAIServer(llm.engine, ServerConfig("tiny"))
        server.batch_api.start = lambda app: (_ for _ in ()).throw(OSError("no disk"))
        with pytest.raises(OSError, match="no disk"):
            with TestClient(server.app()):
                pass
        assert llm.generate("a fox", params)[0].token_ids == expected
        assert_no_leaks(llm.engine)
