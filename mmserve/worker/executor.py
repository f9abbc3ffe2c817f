"""Tensor-parallel workers: N processes, one runner each, joined by ``torch.distributed``.

The engine holds one object it calls like a runner (``execute``, ``allocate_kv_cache``,
``measure_profile_peak``, ...): for one device the runner itself, for N ranks a
``MultiprocExecutor``. Each of its workers builds the same runner class the single-device
engine uses, over its share of the model (``models/parallel.py``: each rank reads only its
shards from the safetensors files), and runs every call in step with the others; the
collectives inside the model (NCCL on CUDA, gloo on the CPU) join them. What crosses to a
worker is a call: a method name and its arguments, pickled once, the step messages of
``step.py`` included, and of a step's images only the pixels of those the rank encodes (the
vision tower is data-parallel: ``ModelRunner._encode_data_parallel``). Every rank answers
each call; rank 0's answer is the result.

A worker that dies, fails a collective or does not answer within ``timeout`` seconds stops
the executor: the engine raises ``EngineDeadError`` naming the rank, and every worker is ended
(no process outlives the executor, or the engine's process: a worker whose parent is gone
exits).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from mmserve.errors import EngineDeadError
from mmserve.step import ModelOutput, SchedulerOutput
from mmserve.worker.model_runner import EncoderPixels, split_by_tokens

logger = logging.getLogger(__name__)

# Seconds a worker gets to exit after ``close`` before it is killed.
CLOSE_GRACE_S = 10.0
# Seconds a call may take beyond ``WorkerSpec.timeout`` (the collectives' own timeout).
TIMEOUT_MARGIN_S = 5.0
# Seconds the other ranks get to answer once one has failed (to name the one that hung).
FAILURE_GRACE_S = 2.0
# Seconds between a worker's looks at whether its parent is still there.
PARENT_CHECK_S = 1.0


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker builds: the checkpoint, device, dtype and runner settings."""

    model: str
    device: str  # "cpu" or "cuda"
    dtype: torch.dtype
    block_size: int
    seed: int
    cpu_threads: int | None  # None: the cores this process may use, shared out evenly
    size: int
    timeout: float  # seconds a call (or a collective inside it) may take
    split_encoder: bool = False  # the vision tower split across ranks (else data-parallel)


class MultiprocExecutor:
    """``spec.size`` worker processes, called like one runner (rank 0 answers)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.device = torch.device(spec.device)
        self.dtype = spec.dtype
        self._dead: str | None = None
        self._closed = False
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        for rank in range(spec.size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(spec, rank, port, theirs),
                               name=f"mmserve-tp-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        # Loading takes as long as it takes; a hung start still ends.
        ready = self._replies("start", max(spec.timeout, 600.0), every=True)
        self.weights_bytes = max(ready)  # per rank: its shards and the whole vision tower
        logger.info("tensor parallelism: %d workers (pids %s), %s", spec.size,
                    ", ".join(str(p.pid) for p in self._procs),
                    "NCCL" if spec.device == "cuda" else "gloo")

    # ------------------------------------------------------------ the runner's calls
    def execute(self, scheduler_output: SchedulerOutput,
                encoder_pixels: EncoderPixels) -> ModelOutput:
        """The step on every rank, each sent the pixels of the images it encodes (all of
        them where the vision tower is split)."""
        step = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        if self.spec.split_encoder:
            payloads = [_dumps(("execute", (step, encoder_pixels)))] * self.spec.size
        else:
            tokens = scheduler_output.images_to_encode
            owner = split_by_tokens([h for h in tokens if h in encoder_pixels], tokens,
                                    self.spec.size)
            payloads = [_dumps(("execute", (step, {h: p for h, p in encoder_pixels.items()
                                                   if owner.get(h) == rank})))
                        for rank in range(self.spec.size)]
        return self._call_each(payloads, "execute")

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call("allocate_kv_cache", num_blocks)

    def capture_model(self, max_num_seqs: int, max_model_len: int,
                      position_rows: int = 1) -> None:
        self._call("capture_model", max_num_seqs, max_model_len, position_rows)

    def measure_profile_peak(self, batch: SchedulerOutput, encoder_pixels: EncoderPixels) -> int:
        """The largest peak of the ranks (each runs the whole batch's decoder share and its
        share of the images)."""
        return max(self._call("measure_profile_peak", batch, encoder_pixels, every=True))

    def set_threads(self, threads: int | None) -> None:
        """Threads are each worker's own, set when it starts (``WorkerSpec.cpu_threads``)."""

    @property
    def kv_block_elements(self) -> int:
        return self._call("get", "kv_block_elements")

    @property
    def kv_cache_bytes(self) -> int:
        """Every rank's KV cache together."""
        return sum(self._call("get", "kv_cache_bytes", every=True))

    @property
    def num_threads(self) -> int | None:
        return self._call("get", "num_threads")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` (ending the others) if a worker has exited: between
        steps, where no call would notice."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        for rank, proc in enumerate(self._procs):
            if not self._closed and not proc.is_alive():
                self._fail(f"tensor-parallel worker rank {rank} {self._exit_status(rank)} "
                           "while the engine was idle")

    def release_memory(self) -> None:
        """Nothing of the workers' memory stays once they exit (``close``)."""

    def close(self) -> None:
        """Ask every worker to exit; kill those still there after ``CLOSE_GRACE_S``."""
        if self._closed:
            return
        self._closed = True
        if self._dead is None:
            payload = _dumps(("close", ()))
            for conn in self._conns:
                try:
                    conn.send_bytes(payload)
                except OSError:
                    pass
        deadline = time.monotonic() + CLOSE_GRACE_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        for conn in self._conns:
            conn.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (at interpreter exit, half torn down)
            pass

    # ------------------------------------------------------------ calls and answers
    def _call(self, method: str, *args: Any, every: bool = False) -> Any:
        return self._call_each([_dumps((method, args))] * self.spec.size, method, every)

    def _call_each(self, payloads: list[bytes], method: str, every: bool = False) -> Any:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._closed:
            raise EngineDeadError("the tensor-parallel workers are closed")
        for rank, (conn, payload) in enumerate(zip(self._conns, payloads, strict=True)):
            try:
                conn.send_bytes(payload)
            except OSError as e:
                self._fail(f"tensor-parallel worker rank {rank} {self._exit_status(rank)} "
                           f"(cannot be reached: {e})")
        # The ranks' own collectives time out first, so that a rank waiting on a silent one
        # reports, and the silent one is named.
        return self._replies(method, self.spec.timeout + TIMEOUT_MARGIN_S, every)

    def _replies(self, method: str, timeout: float, every: bool = False) -> Any:
        """Every rank's answer to the call just sent: rank 0's, or all of them (``every``).
        A rank that fails, dies or stays silent past ``timeout`` ends the executor. After a
        failure the others get ``FAILURE_GRACE_S`` to answer too: a rank that fails a
        collective is usually waiting on one that died or hangs, which the error then names."""
        answers: dict[int, Any] = {}
        problems: list[str] = []
        pending = set(range(self.spec.size))
        started = time.monotonic()
        deadline = started + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            wait([self._conns[r] for r in pending]
                 + [self._procs[r].sentinel for r in pending], timeout=left)
            for rank in sorted(pending):
                conn = self._conns[rank]
                if conn.poll():
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):
                        status, value = "gone", None
                    if status == "ok":
                        answers[rank] = value
                    elif status == "gone":
                        problems.append(f"rank {rank} {self._exit_status(rank)}")
                    else:
                        problems.append(f"rank {rank} failed: {value}")
                elif not self._procs[rank].is_alive():
                    problems.append(f"rank {rank} {self._exit_status(rank)}")
                else:
                    continue
                pending.discard(rank)
            if problems:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if pending:
            waited = time.monotonic() - started
            problems.insert(0, f"rank(s) {', '.join(map(str, sorted(pending)))} did not answer "
                            f"in {waited:.0f} s (hung? raise --worker-timeout if steps are "
                            "this slow)")
        if problems:
            self._fail(f"tensor-parallel workers stopped during {method!r}: "
                       + "; ".join(problems))
        return [answers[r] for r in range(self.spec.size)] if every else answers[0]

    def _exit_status(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(0.5)
        code = proc.exitcode
        if code is None:
            return f"(pid {proc.pid}) stopped answering"
        if code < 0:
            return f"(pid {proc.pid}) was killed by {signal.Signals(-code).name}"
        return f"(pid {proc.pid}) exited with status {code}"

    def _fail(self, reason: str) -> None:
        """End every worker and raise: the ranks can no longer run in step."""
        self._dead = reason
        logger.error("%s; stopping every tensor-parallel worker", reason)
        self._kill_all()
        raise EngineDeadError(reason)

    def _kill_all(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)


def _dumps(call: tuple[str, tuple]) -> bytes:
    return pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ the worker process
def _worker_main(spec: WorkerSpec, rank: int, port: int, conn: Connection) -> None:
    """One rank: build the runner over this rank's shards, then answer calls until ``close``
    (or until the engine's process is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    _exit_with_parent()
    try:
        runner = _start(spec, rank, port)
        conn.send(("ok", runner.weights_bytes))
    except BaseException as e:  # noqa: BLE001 (reported to the engine, which raises it)
        _send_error(conn, e)
        return
    _serve(runner, rank, conn)


def _start(spec: WorkerSpec, rank: int, port: int):
    import torch.distributed as dist
    from transformers import AutoConfig

    from mmserve.models import parallel
    from mmserve.worker import cpu_threads
    from mmserve.worker.cuda_runner import runner_class

    if spec.device == "cuda":
        torch.cuda.set_device(rank)
    torch.manual_seed(spec.seed)
    dist.init_process_group("nccl" if spec.device == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=spec.size, timeout=timedelta(seconds=spec.timeout))
    parallel.init_tensor_parallel(rank, spec.size, dist.group.WORLD, spec.split_encoder)
    hf_config = AutoConfig.from_pretrained(spec.model, local_files_only=True)
    runner_cls = runner_class(spec.device)
    model, weights_bytes = runner_cls.load_model(spec.model, hf_config, spec.dtype)
    runner = runner_cls(model, 0, spec.block_size, spec.dtype, spec.seed)
    runner.weights_bytes = weights_bytes
    if spec.device == "cpu":
        runner.set_threads(spec.cpu_threads or max(1, cpu_threads.max_threads() // spec.size))
    return runner


def _serve(runner, rank: int, conn: Connection) -> None:
    import torch.distributed as dist

    from mmserve.models.parallel import CollectiveError

    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the engine is gone
        if method == "close":
            runner.close()
            break
        try:
            if method == "get":
                result = getattr(runner, args[0])
            elif method == "execute":
                result = runner.execute(pickle.loads(args[0]), args[1])
            else:
                result = getattr(runner, method)(*args)
            conn.send(("ok", result if rank == 0 or method in _EVERY_RANK else None))
        except BaseException as e:  # noqa: BLE001 (reported; a broken group ends the worker)
            _send_error(conn, e)
            if isinstance(e, CollectiveError | KeyboardInterrupt | SystemExit):
                break
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (exiting anyway)
        pass


# Calls whose answer the engine reads from every rank.
_EVERY_RANK = ("measure_profile_peak", "get")


def _send_error(conn: Connection, error: BaseException) -> None:
    from mmserve.models.parallel import CollectiveError

    text = "".join(traceback.format_exception_only(type(error), error)).strip()
    # A broken group's traceback says nothing the message does not; anything else's does.
    logger.error("tensor-parallel worker failed: %s", text,
                 exc_info=None if isinstance(error, CollectiveError) else error)
    try:
        conn.send(("error", text[:2000]))
    except OSError:
        pass


def _exit_with_parent() -> None:
    """Exit once the engine's process is gone (killed, crashed), whatever this one is doing."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(PARENT_CHECK_S)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="mmserve-parent-watch", daemon=True).start()
