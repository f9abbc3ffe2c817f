"""Shared fixtures: tiny random checkpoints built offline, test images, leak checks, an LLM
served by the OpenAI app in this process."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from PIL import Image

# Without a GPU, Triton kernels run in Triton's CPU interpreter. triton.jit chooses interpreted
# or compiled when a function is defined, and test modules import Triton indirectly (through
# transformers), so the switch must be set before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mmserve.engine.memory_plan import GPU_MEMORY_UTILIZATION_ENV  # noqa: E402
from mmserve.kernels import cpu_ops  # noqa: E402
from mmserve.testing import build_tiny_checkpoint  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """On a GPU, every engine of a test process (and of the servers it starts) takes a small
    share of the GPU by default, not nine tenths: the test checkpoints are tiny, and the suite
    runs several engines at once (a module's engine beside a server under test). Parallel
    workers (pytest-xdist's -n) split the GPU between them: at most three engines each, 60% in
    all. ``MMSERVE_GPU_MEMORY_UTILIZATION`` set by hand wins.

    Set here, in the processes that run tests, and not at import: xdist's controller imports
    this module too, runs no test, and its environment is what the workers start from (a
    share it computed for one process would reach each of them)."""
    if not torch.cuda.is_available() or GPU_MEMORY_UTILIZATION_ENV in os.environ:
        return
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # xdist's controller
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ[GPU_MEMORY_UTILIZATION_ENV] = f"{min(0.1, 0.6 / (3 * workers)):.3f}"


# The checkpoints the parity tests cover: name -> (family, the family builder's options).
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "clip-llama": ("llava", {"vision": "clip", "text": "llama"}),
    "siglip-qwen2": ("llava", {"vision": "siglip", "text": "qwen2"}),
    "clip-mistral": ("llava", {"vision": "clip", "text": "mistral"}),
}


# The CPU kernel paths with a compiled module that this machine runs (``cpu_ops.PATHS``): an
# AVX-512 machine runs the AVX2 build too.
COMPILED_PATHS = [name for name in cpu_ops.supported_paths()
                  if cpu_ops.PATHS[name].target is not None]


@pytest.fixture(scope="session", autouse=True)
def built_cpu_kernels() -> None:
    """The compiled CPU kernels built (or found built) before a test process runs its first
    test. On a machine that has never built them, the build takes minutes on two cores; a
    server a test starts would otherwise wait behind it (a build another worker started,
    which holds the lock) inside its own start-up deadline. A build failure is not raised
    here: the engines fall back to torch's operators, and the tests of the kernels fail."""
    cpu_ops.load()


@pytest.fixture(scope="module", params=COMPILED_PATHS)
def kernel(request):
    """The compiled CPU kernels of each path in ``COMPILED_PATHS``, in force while the tests
    that take them run (a build failure fails them)."""
    with cpu_ops.using_path(request.param) as module:
        yield module


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: str(build_tiny_checkpoint(family, root / name, **options))
            for name, (family, options) in ARCHS.items()}


@pytest.fixture(scope="session")
def clip_llama(checkpoints: dict[str, str]) -> str:
    return checkpoints["clip-llama"]


def make_image(seed: int, size: tuple[int, int]) -> Image.Image:
    """A deterministic image with structure (gradients and a block), not a flat colour."""
    w, h = size
    img = Image.new("RGB", size)
    px = img.load()
    for y in range(h):
        for x in range(w):
            px[x, y] = ((x * 7 + seed * 40) % 256, (y * 5 + seed * 90) % 256,
                        ((x + y) * 3 + seed * 17) % 256)
    img.paste((255 - seed * 30 % 256, seed * 60 % 256, 120), (w // 4, h // 4, w // 2, h // 2))
    return img


def record_steps(llm) -> list:
    """Keep every SchedulerOutput ``llm``'s scheduler makes from now on, scheduled ahead of
    the step in flight or not (its arguments passed on as they come)."""
    steps = []
    schedule = llm.engine.scheduler.schedule

    def recording(*args, **kwargs):
        steps.append(schedule(*args, **kwargs))
        return steps[-1]

    llm.engine.scheduler.schedule = recording
    return steps


def assert_no_leaks(engine) -> None:
    """After a drained engine: every KV block free, no referenced encoder-cache entry, no
    request's text, prompt log-probabilities or token history kept."""
    stats = engine.stats()
    assert not engine.has_unfinished_requests()
    assert len(engine.output_processor or ()) == 0 and not engine._prompt_logprobs
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    assert stats["encoder_cache_referenced_entries"] == 0, stats
    scheduler = getattr(engine, "scheduler", None)
    if getattr(scheduler, "lora_slots", None) is not None:  # no LoRA slot held by anyone
        assert scheduler.lora_slots.users == [0] * len(scheduler.lora_slots.users)
    # A runner in this process forgets a request's token history in the step after it
    # finished, which sends its id: only those waiting for that step, or sent in a step
    # still in flight (scheduled ahead, on the runner's thread), are left.
    runner = getattr(engine, "runner", None)
    # Nor a prompt pooled in part (only a step in flight may still hold one).
    assert not getattr(runner, "_pooled", None) or engine._submitted
    history = getattr(runner, "token_history", None)
    if history is not None:
        finishing = set(engine.scheduler._finished_ids).union(
            *(step.finished_request_ids for step, _ in engine._submitted))
        assert set(history.followed) <= finishing


@contextlib.contextmanager
def openai_app(model: str, server: dict[str, Any] | None = None,
               **engine_args: Any) -> Iterator[tuple[Any, Any, Any]]:
    """An ``LLM`` served by the OpenAI server's app in this process (the served model named
    "tiny", ``server`` more of its ``ServerConfig``): ``(llm, http, client)``, a Starlette
    test client and an openai client over it (with the server's API key where it has one);
    ``llm.server`` is the ``OpenAIServer``. Leaks are checked once the server's loop stops."""
    import openai
    from starlette.testclient import TestClient

    from mmserve import LLM
    from mmserve.entrypoints.api_server import OpenAIServer
    from mmserve.entrypoints.serve_args import ServerConfig

    with LLM(model, dtype="float32", **engine_args) as llm:
        config = ServerConfig("tiny", **(server or {}))
        llm.server = OpenAIServer(llm.engine, config)
        with TestClient(llm.server.app()) as http:
            yield llm, http, openai.OpenAI(base_url="http://testserver/v1",
                                           api_key=config.api_key or "unused",
                                           max_retries=0, http_client=http)
        assert_no_leaks(llm.engine)


def load_benchmark(name: str) -> Any:
    """``benchmarks/<name>.py`` as a module (the folder is no package), for tests that run a
    benchmark at a tiny scale."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def slow_down_steps(engine, seconds: float, monkeypatch: Any) -> None:
    """Make each of ``engine``'s steps take ``seconds`` more (till the test ends), so that a
    long answer is still running when a test acts on it, on any machine."""
    step = engine._core_step_with_record

    def slowly():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "_core_step_with_record", slowly)


def generate_all_at_once(llm, prompts: list, params) -> list:
    """``llm.generate(prompts, params)`` with every prompt queued before the first step, as
    when requests reach a server together; outputs in input order.

    ``generate`` lets a GPU engine start on the first prompts while threads preprocess the
    rest, so how many run at once there depends on timing; a test about contention
    (preemption) needs them all waiting from the start."""
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    return [done[rid] for rid in ids]
