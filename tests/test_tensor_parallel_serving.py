"""The front doors with ``--tensor-parallel-size 2`` on the CPU: ``mmserve serve`` (the OpenAI
client's answers equal one process's, workers that end with the server, a killed worker that
stops it), ``mmserve plan`` (the per-rank plan, a model that does not split) and ``mmserve
bench`` (throughput, and a sweep over the rank count).

Servers start as tests/test_server.py starts them (``Server``); the engine's own behaviour
under tensor parallelism (parity, shards, hung workers) is tests/test_tensor_parallel.py's.
Each server or engine with two ranks spawns two worker processes (a few seconds on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from mmserve import LLM, SamplingParams
from mmserve.engine import llm_engine
from mmserve.entrypoints.cli import main
from mmserve.worker.executor import MultiprocExecutor
from tests.test_bench import WORKLOAD_FLAGS, _check_throughput, bench
from tests.test_plan_cli import MEMORY, plan_json, small_machine  # noqa: F401 (a fixture)
from tests.test_server import IMAGES, Server, data_url, image_message, wait_drained

TP = ("--tensor-parallel-size", "2", "--device", "cpu")  # ranks on the CPU: one GPU is not two


# ----------------------------------------------------------------- processes, from /proc
def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process, or None when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name may hold spaces and brackets
    return fields[0], int(fields[1]), int(fields[19])


def _children(pid: int) -> list[int]:
    """Live (not zombie) child processes of ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[1] == pid and st[0] != "Z":
                found.append(int(entry))
    return sorted(found)


def _descendants(pid: int) -> dict[int, int]:
    """Every live process below ``pid``: pid -> start time (to tell a reused pid apart)."""
    found: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child in _children(todo.pop()):
            st = _stat(child)
            if st is not None:
                found[child] = st[2]
                todo.append(child)
    return found


def _spawned(pids) -> list[int]:
    """Those of ``pids`` that multiprocessing spawned (the OS names them python; the
    resource tracker, also spawned, is not one)."""
    found = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"--multiprocessing-fork" in cmdline:
            found.append(pid)
    return sorted(found)


def _workers(server_pid: int) -> list[int]:
    """The server's tensor-parallel workers: the spawned processes below it that spawned none
    (with ``--engine-process`` the engine's own process stands between, and spawned them)."""
    return [pid for pid in _spawned(_descendants(server_pid)) if not _spawned(_children(pid))]


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z" and st[2] == start


def _assert_all_gone(procs: dict[int, int], within: float = 5.0) -> None:
    """Every process of ``procs`` (pid -> start time) ends within ``within`` seconds."""
    deadline = time.monotonic() + within
    while any(_alive(p, s) for p, s in procs.items()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p, s in procs.items() if _alive(p, s)]
    assert not left, f"processes of the server still running: {left}"


# ----------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def tp_server(clip_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("tp-server") / "server.log"
    srv = Server(clip_llama, "--served-model-name", "tiny-llava", *TP, log=log)
    yield srv
    srv.stop()


def _server(clip_llama: str, tmp_path: Path, *args: str) -> Server:
    return Server(clip_llama, "--served-model-name", "tiny-llava", *TP, *args,
                  log=tmp_path / "server.log")


@pytest.mark.slow
def test_chat_with_images_equals_one_process(tp_server: Server, clip_llama: str) -> None:
    """Greedy float32 over HTTP from two ranks: the tokens, their log-probabilities and the
    text ``LLM(path, dtype="float32")`` gives in one process, plain and streamed."""
    assert len(_workers(tp_server.proc.pid)) == 2  # the flag did start two workers
    assert httpx.get(f"{tp_server.url}/health").status_code == 200
    client = openai.OpenAI(base_url=f"{tp_server.url}/v1", api_key="unused", max_retries=0)
    prompts = [("what is in this picture?", [IMAGES[0]]),
               ("compare these two", [IMAGES[1], IMAGES[2]])]
    with LLM(clip_llama, dtype="float32", device="cpu") as llm:
        tokenizer = llm.engine.processor.tokenizer
        expected = [llm.generate(
            {"messages": [{"role": "user", "content": [{"type": "image"}] * len(images)
                           + [{"type": "text", "text": text}]}], "images": images},
            SamplingParams(max_tokens=12, temperature=0.0, logprobs=0))[0]
            for text, images in prompts]
    for (text, images), want in zip(prompts, expected, strict=True):
        messages = image_message(text, *[data_url(im) for im in images])
        got = client.chat.completions.create(model="tiny-llava", messages=messages,
                                             max_tokens=12, temperature=0, logprobs=True)
        choice = got.choices[0]
        assert choice.message.content == want.text
        assert choice.finish_reason == want.finish_reason
        assert got.usage.prompt_tokens == want.num_prompt_tokens > 16 * len(images)
        assert [item.token for item in choice.logprobs.content] == [
            tokenizer.decode([t]) for t in want.token_ids]
        assert [item.logprob for item in choice.logprobs.content] == pytest.approx(
            [e.logprob for e in want.logprobs], abs=1e-4)
        chunks = list(client.chat.completions.create(
            model="tiny-llava", messages=messages, max_tokens=12, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            want.text
    wait_drained(tp_server.url)
    assert httpx.get(f"{tp_server.url}/health").status_code == 200


@pytest.mark.slow
def test_sigterm_stop_leaves_no_worker(tp_server: Server) -> None:
    """Runs after the chat test: stops the module's server; its workers (and every other
    process it started) end with it."""
    procs = _descendants(tp_server.proc.pid)
    assert len(_workers(tp_server.proc.pid)) == 2
    assert tp_server.stop() == 0
    _assert_all_gone(procs)


class _HealthPoller:
    """/health, asked again and again on one keep-alive connection, from a thread: every
    status seen in order ("gone" once the server no longer answers)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[int | str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=2) as http:
            while not self._stop.is_set():
                try:
                    self.seen.append(http.get("/health").status_code)
                except httpx.TransportError:
                    self.seen.append("gone")
                    return

    def stop(self) -> list[int | str]:
        self._stop.set()
        self._thread.join(10)
        return self.seen


@pytest.mark.slow
def test_killed_worker_fails_health_and_the_server_exits(clip_llama: str,
                                                         tmp_path: Path) -> None:
    """A worker killed mid-request: the stream ends with an error naming it, /health never
    answers 200 again (503 until the server is gone: it exits within a tick of uvicorn's loop,
    so a poller on a busy machine may not see the 503; test_server_async_engine checks it),
    the server exits with status 1, and nothing it started is left. The engine runs in a
    process of its own, so the news crosses two processes to the client."""
    server = _server(clip_llama, tmp_path, "--engine-process")
    try:
        workers = _workers(server.proc.pid)
        assert len(workers) == 2
        procs = _descendants(server.proc.pid)
        poller = _HealthPoller(server.url)
        body = {"model": "tiny-llava", "messages": image_message("go on", data_url(IMAGES[0])),
                "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}
        victim = max(workers)  # rank 1: the ranks start in order
        events: list[str] = []
        with httpx.Client(base_url=server.url, timeout=60) as http, \
                http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    if len(events) == 3:
                        os.kill(victim, signal.SIGKILL)
        assert len(events) > 3, events
        errors = [json.loads(e)["error"] for e in events[3:]
                  if e != "[DONE]" and "error" in json.loads(e)]
        assert errors and errors[0]["code"] == "engine_unavailable", events[-3:]
        assert f"pid {victim}" in errors[0]["message"], errors[0]
        assert server.proc.wait(30) == 1
        seen = poller.stop()
        assert seen[0] == 200 and seen[-1] == "gone", seen
        after = seen[seen.index(next(s for s in seen if s != 200)):]
        assert set(after) <= {503, "gone"}, seen
        assert "the engine stopped" in server.log.read_text()
        _assert_all_gone(procs)
    finally:
        server.stop()


@pytest.mark.slow
def test_worker_killed_while_idle_fails_health(clip_llama: str, tmp_path: Path) -> None:
    """A worker killed with no request in flight: /health turns 503 (or the server is gone)
    within 10 s and the server exits with status 1, without a request to find it out."""
    server = _server(clip_llama, tmp_path)
    try:
        procs = _descendants(server.proc.pid)
        os.kill(max(_workers(server.proc.pid)), signal.SIGKILL)
        deadline = time.monotonic() + 10
        status: int | str = 200
        while status == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
            try:
                status = httpx.get(f"{server.url}/health", timeout=2).status_code
            except httpx.TransportError:
                status = "gone"
        assert status in (503, "gone"), "/health still answered 200 10 s after a worker died"
        assert server.proc.wait(30) == 1  # with no request to find it out
        _assert_all_gone(procs)
    finally:
        server.stop()


def test_serve_refuses_a_model_that_does_not_split(clip_llama: str, capsys, caplog,
                                                   monkeypatch) -> None:
    """Three ranks of a decoder with 4 attention heads: a one-line error naming the setting
    and status 2 before any worker starts, not a traceback."""
    monkeypatch.setattr(MultiprocExecutor, "__init__", _no_workers)
    code = main(["serve", clip_llama, "--dtype", "float32", "--device", "cpu", "--port", "1",
                 "--tensor-parallel-size", "3"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "tensor_parallel_size=3" in err and "4 attention heads" in err
    assert "Traceback" not in err and not [r for r in caplog.records if r.exc_info]


def _no_workers(self, spec) -> None:
    raise AssertionError("a refused start starts no worker")


# ----------------------------------------------------------------- mmserve plan
def test_plan_per_rank(clip_llama: str, small_machine, capsys) -> None:  # noqa: F811
    """Each rank's plan: half the RAM, fewer weights (the decoder split, the vision tower
    whole), half the KV bytes per token (2 KV heads, one each); the text says so."""
    flags = (clip_llama, "--dtype=float32", "--device=cpu")
    one = plan_json(capsys, *flags)["plan"]
    two = plan_json(capsys, *flags, "--tensor-parallel-size=2")["plan"]
    assert (one["tensor_parallel_size"], two["tensor_parallel_size"]) == (1, 2)
    assert one["weights_bytes"] / 2 < two["weights_bytes"] < one["weights_bytes"]
    assert two["kv_bytes_per_token"] * 2 == one["kv_bytes_per_token"]
    assert (one["memory_bytes"], two["memory_bytes"]) == (MEMORY, MEMORY // 2)
    assert main(["plan", *flags, "--tensor-parallel-size", "2"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("memory plan on cpu, per rank of 2: ")
    assert "(available RAM / 2 ranks)" in text.splitlines()[0]
    assert main(["plan", *flags]) == 0
    assert "per rank" not in capsys.readouterr().out


def test_plan_names_a_rank_count_that_does_not_divide_the_heads(clip_llama: str,
                                                                 capsys) -> None:
    flags = (clip_llama, "--dtype=float32", "--device=cpu", "--tensor-parallel-size=3")
    assert main(["plan", *flags]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("mmserve plan: tensor_parallel_size=3 must divide the "
                                   "model's 4 attention heads")
    assert main(["plan", *flags, "--json"]) == 1
    assert "tensor_parallel_size=3" in json.loads(capsys.readouterr().out)["error"]
    assert main(["plan", clip_llama, "--tensor-parallel-size=0"]) == 1
    assert "tensor_parallel_size must be a positive integer" in capsys.readouterr().err


# ----------------------------------------------------------------- mmserve bench
@pytest.fixture
def executors(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, dict[int, int]]]:
    """Every ``MultiprocExecutor`` the engine starts: (ranks, its workers' pid -> start
    time)."""
    started: list[tuple[int, dict[int, int]]] = []

    class Recorded(MultiprocExecutor):
        def __init__(self, spec) -> None:
            super().__init__(spec)
            started.append((spec.size, {p: _stat(p)[2] for p in self.pids}))

    monkeypatch.setattr(llm_engine, "MultiprocExecutor", Recorded)
    return started


def test_bench_sweep_over_tensor_parallel_size(clip_llama: str, tmp_path: Path, capsys,
                                               executors) -> None:
    """``--param tensor_parallel_size=1,2``: one engine in this process, then two ranks (the
    bench's engine, as ``bench throughput`` builds it); the same workload gives the same
    counts, and the two-rank engine is closed once the bench returns."""
    out = tmp_path / "sweep.json"
    assert bench(["sweep", "--model", clip_llama, *WORKLOAD_FLAGS, "--no-peak",
                  "--param", "tensor_parallel_size=1,2", "--device", "cpu", "--json",
                  str(out)]) == 0
    assert "tensor_parallel_size" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["param"] == "tensor_parallel_size" and data["values"] == [1, 2]
    one, two = data["rows"]
    for row in (one, two):
        _check_throughput(row, 8)
    for key in ("output_tokens", "prompt_tokens", "encoder_items_computed",
                "prefix_cache_hit_tokens", "num_preemptions"):
        assert one[key] == two[key], key
    assert two["encoder_items_computed"] == 3  # 3 distinct images, each encoded once
    assert [size for size, _ in executors] == [2]
    _assert_all_gone(executors[0][1])
