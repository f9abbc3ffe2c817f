"""Tensor-parallel workers: N processes, one runner each, joined by ``torch.distributed``.

The engine holds one object it calls like a runner (``execute``, ``allocate_kv_cache``,
``measure_profile_peak``, ...): for one device the runner itself, for N ranks a
``MultiprocExecutor``. Each of its workers builds the same runner class the single-device
engine uses, over its share of the model (``models/parallel.py``: each rank reads only its
shards from the safetensors files), and runs every call in step with the others; the
collectives inside the model (NCCL on CUDA, gloo on the CPU) join them. What crosses to a
worker is a call: a method name and its arguments, pickled once, the step messages of
``step.py`` included, and of a step's images only the pixels of those the rank encodes (the
vision tower is data-parallel: ``ModelRunner._encode_data_parallel``). A request's sampling
parameters cross once, in its first step (``ParamsMemo``), not with every token it decodes.
Every rank answers each call, tagged with its number; rank 0's answer is the result.

Asynchronous scheduling hands steps over with ``submit`` and takes their results with
``collect`` (by number), so that the engine schedules the next step while one runs: the
workers run steps in the order sent; for a runner in the engine's own process,
``InlineSteps`` launches each step from the engine's thread as it is submitted (a GPU's
runner, whose launch only queues the step), and ``StepThread`` runs them on the thread the
runner was built on (the CPU's, whose launch computes the step).

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
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from mmserve.errors import EngineDeadError
from mmserve.sampling_params import SamplingParams
from mmserve.step import ModelOutput, SchedulerOutput
from mmserve.worker.collector import freeze_again, freeze_long_lived
from mmserve.worker.compute_thread import ComputeThread
from mmserve.worker.model_runner import EncoderPixels, StepResult, split_by_tokens

logger = logging.getLogger(__name__)

# Seconds a worker gets to exit after ``close`` before it is killed.
CLOSE_GRACE_S = 10.0
# Seconds the workers may take to start (import, join the group, load their shards) at least.
START_TIMEOUT_S = 600.0
# Seconds a call may take beyond ``WorkerSpec.timeout`` (the collectives' own timeout).
TIMEOUT_MARGIN_S = 5.0
# Seconds the other ranks get to answer once one has failed (to name the one that hung).
FAILURE_GRACE_S = 2.0


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
    lora_slots: tuple[int, int] | None = None  # (max_loras, max_lora_rank), or no LoRA


class ParamsMemo:
    """Each request's ``SamplingParams`` as the other end of the pipe last received them, so
    that a step carries only those it has not: a request's first step, or a request whose
    params object changed. (A step of 256 decode rows took 0.42 ms to pickle and 0.87 ms to
    read back on every rank with each row's params, 64 KB; without them 0.06 ms each, 5 KB.
    A ``logit_bias`` or ``bad_words`` list made it more.)

    The engine's side ``strip``s each step before pickling it, each worker ``fill``s it back
    after reading it; both handle the steps in the same order, and forget a request when a step
    lists it among ``finished_request_ids`` (before its rows, as the runner does), so both sides
    hold the same entries."""

    def __init__(self) -> None:
        self.known: dict[str, SamplingParams] = {}

    def strip(self, step: SchedulerOutput) -> SchedulerOutput:
        """``step`` with ``None`` for the params the workers hold already (a copy: the engine
        keeps the original)."""
        known = self.known
        for rid in step.finished_request_ids:
            known.pop(rid, None)

        def sent(rid: str, params: SamplingParams) -> SamplingParams | None:
            if known.get(rid) is params:
                return None
            known[rid] = params
            return params

        decodes = step.decodes
        return replace(
            step,
            decodes=replace(decodes, sampling_params=[
                sent(rid, p) for rid, p in zip(decodes.request_ids, decodes.sampling_params,
                                               strict=True)]),
            chunks=[replace(r, sampling_params=sent(r.request_id, r.sampling_params))
                    for r in step.chunks])

    def fill(self, step: SchedulerOutput) -> SchedulerOutput:
        """A ``strip``ped step made whole again, in place (the worker's own copy)."""
        known = self.known
        for rid in step.finished_request_ids:
            known.pop(rid, None)

        def held(rid: str, params: SamplingParams | None) -> SamplingParams:
            if params is None:
                params = known.get(rid)
                if params is None:
                    raise RuntimeError(f"request {rid}'s sampling params were never sent to "
                                       "this worker (the executor's memo and the worker's "
                                       "differ)")
                return params
            known[rid] = params
            return params

        decodes = step.decodes
        decodes.sampling_params = [
            held(rid, p) for rid, p in zip(decodes.request_ids, decodes.sampling_params,
                                           strict=True)]
        for r in step.chunks:
            r.sampling_params = held(r.request_id, r.sampling_params)
        return step


class MultiprocExecutor:
    """``spec.size`` worker processes, called like one runner (rank 0 answers).

    The constructor starts the processes and returns at once, so that the engine's own start
    (its processor, tokenizer and grammars) goes on while they import and load their shards;
    ``wait_started`` waits for them, before the first call."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.device = torch.device(spec.device)
        self.dtype = spec.dtype
        self._dead: str | None = None
        self._closed = False
        self._started = False
        self._seq = 0  # calls sent so far (the start is call 0)
        self._steps: list[int] = []  # steps' call numbers, not collected yet
        self._kv_cache_bytes = 0
        self._params = ParamsMemo()  # what the workers' memos hold
        ctx = torch.multiprocessing.get_context("spawn")
        port = _free_port()
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        try:
            for rank in range(spec.size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(spec, rank, port, theirs),
                                   name=f"mmserve-tp-rank{rank}", daemon=True)
                self._conns.append(ours)
                proc.start()
                theirs.close()
                self._procs.append(proc)
        except BaseException:  # a failed or interrupted start leaves no worker behind
            self._abandon()
            raise

    def wait_started(self) -> None:
        """Wait until every worker has loaded its shards (``EngineDeadError`` naming a rank
        that failed, died or hung, every worker ended)."""
        try:
            # Loading takes as long as it takes; a hung start still ends.
            ready = self._replies(0, "start", max(self.spec.timeout, START_TIMEOUT_S),
                                  every=True)
            self.weights_bytes = max(ready)  # per rank: its shards and the whole vision tower
            self._num_threads = self._call("get", "num_threads")
        except BaseException:
            self._abandon()
            raise
        self._started = True
        logger.info("tensor parallelism: %d workers (pids %s), %s", self.spec.size,
                    ", ".join(str(p.pid) for p in self._procs),
                    "NCCL" if self.spec.device == "cuda" else "gloo")

    def _abandon(self) -> None:
        """End a start that failed or was given up: every worker killed at once."""
        self._closed = True
        self._kill_all()
        for conn in self._conns:
            conn.close()

    # ------------------------------------------------------------ the runner's calls
    def execute(self, scheduler_output: SchedulerOutput,
                encoder_pixels: EncoderPixels) -> ModelOutput:
        return self.collect(self.submit(scheduler_output, encoder_pixels))

    def collect(self, seq: int) -> ModelOutput:
        """The result of step ``seq``; answers to earlier steps nobody collected (an
        interrupted caller's) are dropped."""
        self._steps = [s for s in self._steps if s > seq]
        # The ranks' own collectives time out first, so that a rank waiting on a silent one
        # reports, and the silent one is named.
        return self._replies(seq, "execute", self.spec.timeout + TIMEOUT_MARGIN_S)

    def submit(self, scheduler_output: SchedulerOutput, encoder_pixels: EncoderPixels) -> int:
        """Send the step to every rank, each with the pixels of the images it encodes (all of
        them where the vision tower is split); the workers run steps in the order sent.
        Returns its number, for ``collect``."""
        try:
            step = pickle.dumps(self._params.strip(scheduler_output),
                                protocol=pickle.HIGHEST_PROTOCOL)
            if self.spec.split_encoder:
                payloads = [_dumps((self._seq + 1, "execute", (step, encoder_pixels)))
                            ] * self.spec.size
            else:
                tokens = scheduler_output.images_to_encode  # split as the runners split them
                owner = split_by_tokens(list(tokens), tokens, self.spec.size)
                payloads = [_dumps((self._seq + 1, "execute",
                                    (step, {h: p for h, p in encoder_pixels.items()
                                            if owner.get(h) == rank})))
                            for rank in range(self.spec.size)]
            seq = self._send(payloads)
        except BaseException:
            # The memo counted this step's params as sent: start it afresh, so that the next
            # step sends every request's (the workers take what they are sent).
            self._params = ParamsMemo()
            raise
        self._steps.append(seq)
        return seq

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call("allocate_kv_cache", num_blocks)
        self._kv_cache_bytes = self._call("get", "kv_cache_bytes")

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
        """Rank 0's KV cache (every rank holds as many blocks of its KV heads), like
        ``weights_bytes``: what one device holds."""
        return self._kv_cache_bytes

    @property
    def num_threads(self) -> int | None:
        """Rank 0's compute threads (fixed when it started)."""
        return self._num_threads

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
        if not self._started:  # still loading: nothing to finish
            self._abandon()
            return
        self._closed = True
        if self._dead is None:
            payload = _dumps((0, "close", ()))
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
        if self._steps:  # the workers answer in order: it would wait for the steps
            raise RuntimeError(f"{method!r} called with {len(self._steps)} step(s) in flight")
        seq = self._send([_dumps((self._seq + 1, method, args))] * self.spec.size)
        return self._replies(seq, method, self.spec.timeout + TIMEOUT_MARGIN_S, every)

    def _send(self, payloads: list[bytes]) -> int:
        """Send call ``self._seq + 1`` (its payloads carry that number); returns it."""
        self._seq += 1
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
        return self._seq

    def _replies(self, seq: int, method: str, timeout: float, every: bool = False) -> Any:
        """Every rank's answer to call ``seq``: rank 0's, or all of them (``every``); answers
        to earlier calls (left by one interrupted, e.g. by Ctrl-C) are dropped. A rank that
        fails, dies or stays silent past ``timeout`` ends the executor. After a failure the
        others get ``FAILURE_GRACE_S`` to answer too: a rank that fails a collective is usually
        waiting on one that died or hangs, which the error then names first."""
        answers: dict[int, Any] = {}
        problems: list[tuple[int, str]] = []  # (order in the message, what)
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
                        answer_seq, status, value = conn.recv()
                    except (EOFError, OSError):
                        answer_seq, status, value = seq, "gone", None
                    if answer_seq < seq:
                        continue  # an earlier call's, nobody waits for it any more
                    if status == "ok":
                        answers[rank] = value
                    elif status == "gone":
                        problems.append((0, f"rank {rank} {self._exit_status(rank)}"))
                    else:  # a rank waiting on a collective is rarely the cause: named last
                        problems.append((2 if "CollectiveError" in value else 0,
                                         f"rank {rank} failed: {value}"))
                elif not self._procs[rank].is_alive():
                    problems.append((0, f"rank {rank} {self._exit_status(rank)}"))
                else:
                    continue
                pending.discard(rank)
            if problems:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if pending:
            waited = time.monotonic() - started
            problems.append((1, f"rank(s) {', '.join(map(str, sorted(pending)))} did not "
                                f"answer in {waited:.0f} s (hung? raise --worker-timeout if "
                                "steps are this slow)"))
        if problems:
            self._fail(f"tensor-parallel workers stopped during {method!r}: "
                       + "; ".join(text for _, text in sorted(problems, key=lambda p: p[0])))
        return [answers[r] for r in range(self.spec.size)] if every else answers[0]

    def _exit_status(self, rank: int) -> str:
        return exit_status(self._procs[rank], 0.5)

    def _fail(self, reason: str) -> None:
        """End every worker and raise: the ranks can no longer run in step."""
        self._dead = reason
        logger.error("%s; stopping every tensor-parallel worker", reason)
        self._kill_all()
        raise EngineDeadError(reason)

    def _kill_all(self) -> None:
        for proc in self._procs:  # SIGKILL: the workers leave SIGTERM to the engine
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(2.0)


class StepThread:
    """A runner in this process whose steps run on ``compute`` (the thread it was built on,
    ``compute_thread.py``; default: a thread of its own) in the order submitted: the engine
    schedules the next step while this one computes (asynchronous scheduling without worker
    processes). ``MultiprocExecutor`` has the same ``submit`` and ``collect``."""

    def __init__(self, runner, compute: ComputeThread | None = None) -> None:
        self.runner = runner
        self._own_compute = compute is None
        self._compute = compute or ComputeThread("mmserve-steps")
        self._results: dict[int, Future[StepResult]] = {}
        self._seq = 0

    def submit(self, scheduler_output: SchedulerOutput, encoder_pixels: EncoderPixels) -> int:
        """Queue the step; returns its number, for ``collect``."""
        self._seq += 1
        self._results[self._seq] = self._compute.submit(self.runner.launch, scheduler_output,
                                                        encoder_pixels)
        return self._seq

    def collect(self, seq: int) -> ModelOutput:
        """The result of step ``seq`` (what its ``launch`` raised is raised here), its
        sampled tokens brought to Python on this thread while the runner's goes on; results
        of earlier steps nobody collected (an interrupted caller's) are dropped."""
        for earlier in [n for n in self._results if n < seq]:
            del self._results[earlier]
        return self._results.pop(seq).result().result()

    def close(self) -> None:
        """Once the steps submitted have run, stop the thread if it is this object's own."""
        if self._own_compute:
            self._compute.close()
        else:
            self._compute.call(lambda: None)


class InlineSteps:
    """Asynchronous scheduling for a runner whose ``launch`` only queues its step on the
    device (``launches_asynchronously``: the CUDA runner, its sampled tokens left there):
    each step is launched on the caller's thread as it is submitted, and ``collect`` waits
    for its tokens. The engine schedules the next step while the device computes, with no
    second Python thread: a runner's thread would wait for the interpreter lock while the
    engine's schedules and makes outputs (up to the 5 ms switch interval at each hand-over),
    which is how the device waited. What ``launch`` raises is raised by ``collect``, as
    ``StepThread`` does. The same ``submit`` and ``collect`` as ``StepThread``."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self._results: dict[int, StepResult | Exception] = {}
        self._seq = 0

    def submit(self, scheduler_output: SchedulerOutput, encoder_pixels: EncoderPixels) -> int:
        self._seq += 1
        try:
            self._results[self._seq] = self.runner.launch(scheduler_output, encoder_pixels)
        except Exception as e:  # noqa: BLE001 (the engine handles it where it collects)
            self._results[self._seq] = e
        return self._seq

    def collect(self, seq: int) -> ModelOutput:
        for earlier in [n for n in self._results if n < seq]:
            del self._results[earlier]
        result = self._results.pop(seq)
        if isinstance(result, Exception):
            raise result
        return result.result()

    def close(self) -> None:
        self._results.clear()


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
    # Ctrl-C and SIGTERM are the engine's process's to handle: sent to the whole group (a
    # terminal, systemd), they would end the ranks before the server lets the requests in
    # flight finish. The engine closes or kills the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    exit_with_parent()
    try:
        runner = _start(spec, rank, port)
        freeze_long_lived()  # the rank's full collections would stall every rank's step
        conn.send((0, "ok", runner.weights_bytes))
    except BaseException as e:  # noqa: BLE001 (reported to the engine, which raises it)
        _send_error(conn, e)
        return
    _serve(runner, rank, conn)
    # Closed (or the engine is gone): nothing is left to tidy, and the interpreter's own
    # teardown (a last full collection of torch's and transformers' objects) would keep the
    # engine's close waiting about two seconds for this process.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _start(spec: WorkerSpec, rank: int, port: int):
    import torch.distributed as dist
    from transformers import AutoConfig

    from mmserve.models import parallel
    from mmserve.worker import cpu_threads
    from mmserve.worker.cuda_runner import runner_class

    if spec.device == "cuda":
        torch.cuda.set_device(rank)
    torch.manual_seed(spec.seed)
    backend = "nccl" if spec.device == "cuda" else "gloo"
    # Joining waits for the slowest rank's imports (START_TIMEOUT_S); the model's collectives
    # get the step's timeout, in a group of their own.
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=spec.size,
                            timeout=timedelta(seconds=max(spec.timeout, START_TIMEOUT_S)))
    group = dist.new_group(list(range(spec.size)), timeout=timedelta(seconds=spec.timeout),
                           backend=backend)
    parallel.init_tensor_parallel(rank, spec.size, group, spec.split_encoder)
    hf_config = AutoConfig.from_pretrained(spec.model, local_files_only=True)
    runner_cls = runner_class(spec.device)
    model, weights_bytes = runner_cls.load_model(spec.model, hf_config, spec.dtype, spec.lora_slots)
    runner = runner_cls(model, 0, spec.block_size, spec.dtype, spec.seed)
    runner.weights_bytes = weights_bytes
    if spec.device == "cpu":
        runner.set_threads(spec.cpu_threads or max(1, cpu_threads.max_threads() // spec.size))
    return runner


def _serve(runner, rank: int, conn: Connection) -> None:
    import torch.distributed as dist

    from mmserve.models.parallel import CollectiveError

    calls = _read_ahead(conn)
    params = ParamsMemo()
    while True:
        call = calls.get()
        if call is None:
            break  # the engine is gone
        seq, method, args = pickle.loads(call)
        if method == "close":
            runner.close()
            break
        try:
            if method == "get":
                result = getattr(runner, args[0])
            elif method == "execute":
                result = runner.execute(params.fill(pickle.loads(args[0])), args[1])
            else:
                result = getattr(runner, method)(*args)
                if method in ("allocate_kv_cache", "capture_model"):
                    freeze_again()  # start-up's last objects, as the engine's own process does
            conn.send((seq, "ok", result if rank == 0 or method in _EVERY_RANK else None))
        except BaseException as e:  # noqa: BLE001 (reported; a broken group ends the worker)
            _send_error(conn, e, seq)
            if isinstance(e, CollectiveError | KeyboardInterrupt | SystemExit):
                break
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (exiting anyway)
        pass


def _read_ahead(conn: Connection) -> queue.SimpleQueue:
    """The engine's calls, read off the pipe by a thread as they come (None once it is
    closed): the engine may send the next step while this one's large answer is still
    going back, and neither side must block the other's pipe."""
    calls: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        while True:
            try:
                calls.put(conn.recv_bytes())
            except (EOFError, OSError):
                calls.put(None)
                return

    threading.Thread(target=read, name="mmserve-calls", daemon=True).start()
    return calls


# Calls whose answer the engine reads from every rank.
_EVERY_RANK = ("measure_profile_peak", "get")


def _send_error(conn: Connection, error: BaseException, seq: int = 0) -> None:
    from mmserve.models.parallel import CollectiveError

    text = "".join(traceback.format_exception_only(type(error), error)).strip()
    # A broken group's traceback says nothing the message does not; anything else's does.
    logger.error("tensor-parallel worker failed: %s", text,
                 exc_info=None if isinstance(error, CollectiveError) else error)
    try:
        conn.send((seq, "error", text[:2000]))
    except OSError:
        pass


def exit_status(proc: multiprocessing.process.BaseProcess, wait_s: float) -> str:
    """How a child process ended, for an error message ("(pid 7) was killed by SIGKILL"),
    after waiting up to ``wait_s`` for it to end."""
    proc.join(wait_s)
    code = proc.exitcode
    if code is None:
        return f"(pid {proc.pid}) stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:  # a real-time signal has no name
            name = f"signal {-code}"
        return f"(pid {proc.pid}) was killed by {name}"
    return f"(pid {proc.pid}) exited with status {code}"


def exit_with_parent() -> None:
    """Exit once the engine's process is gone (killed, crashed), whatever this one is doing
    (multiprocessing's sentinel of the parent becomes ready when it ends, even if that was
    before this process got here)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="mmserve-parent-watch", daemon=True).start()
