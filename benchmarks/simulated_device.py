"""How busy the engine's host side can keep a GPU, measured without one.

The decoder's forward pass is replaced by a simulated device that takes T milliseconds for
each step, in the order launched: a launch returns at once, and a step's sampled tokens reach
Python only once its device work is done, as the CUDA runner's deferred tokens do. The device
is a timeline, not a thread (a thread would need the interpreter lock to finish a job). The
rest runs as it does on the CPU: scheduling, the CPU runner's input preparation, the LM head
and sampling (over logits from the token embeddings, so that tokens vary), detokenization and
outputs, for hundreds of requests decoding at once on a tiny checkpoint. ``--cuda-inputs``
adds the CUDA runner's own preparation: its Triton metadata (decode batches padded to a
captured graph's size, block tables as wide as ``max_model_len``) and the copies into the
graphs' static inputs, on host tensors (a GPU's pinned copies are left out). Left out too:
kernel launches, and the LM head and sampling moving to the device. The device's busy share is the
time it spent on jobs over the wall time: with synchronous scheduling the host's work and the
device's add up each step; scheduled ahead, they overlap. Scheduled ahead, the engine
launches each step on its own thread, as it does with the CUDA runner (whose launch only
queues the step); ``--runner-thread`` adds the rows of each step launched on a thread of the
runner's own, as on the CPU (and as the CUDA runner's steps were launched before).

    python benchmarks/simulated_device.py
    python benchmarks/simulated_device.py --requests 64 --device-ms 0.5,1,2
    python benchmarks/simulated_device.py --device-ms 10 --kernels 300 --launch-us 10
    python benchmarks/simulated_device.py --threads 1 --device-ms 2,10 --core
    python benchmarks/simulated_device.py --threads 1 --device-ms 0,2 --core --cuda-inputs
    python benchmarks/simulated_device.py --threads 1 --device-ms 6,10 --core \
        --runner-thread --repeats 3

``--core`` adds the steps of an engine core process (``core_step``), whose front end makes
the text and the outputs in a process of its own. ``--kernels``/``--launch-us`` model an
eager forward pass: a step's device work as that many kernels, each launched by that much
Python holding the interpreter lock (as torch's launches do), the device unable to start a
kernel before its launch; by default a step is one launch of no cost (a CUDA graph's
replay). ``--switch-interval-ms`` sets the interpreter's switch interval
(``sys.setswitchinterval``; Python's default is 5 ms): how long a thread waiting for
the lock lets the one holding it run. ``--repeats N`` runs each row N times, the rows' turns
alternating, and prints medians: on a shared machine one run's figure may be off by a tenth.

The suite runs it at a tiny scale (``tests/test_simulated_device.py``) without checking its
figures: they depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from mmserve.config import EngineConfig
from mmserve.engine.llm_engine import LLMEngine
from mmserve.sampling_params import SamplingParams
from mmserve.testing import build_tiny_checkpoint
from mmserve.worker.cuda_runner import CUDAModelRunner, graph_batch_sizes
from mmserve.worker.model_runner import CPUModelRunner


class SimulatedDevice:
    """A device that runs each launched job for ``seconds``, in the order launched, with no
    Python of its own: a job starts when the device is free and it is launched, and ends
    ``seconds`` later (a thread of the device's would need the interpreter lock to wake and
    say so, which the threads it serves hold). ``wait`` sleeps until a job's end, the
    interpreter lock released, as a thread waiting on a CUDA event does."""

    def __init__(self, seconds: float, kernels: int = 1, launch_s: float = 0.0) -> None:
        self.seconds = seconds
        self.kernels = kernels  # a step's job, as that many kernels launched one by one
        self.launch_s = launch_s  # Python each launch takes, holding the interpreter lock
        self.jobs: list[tuple[float, float]] = []  # (start, end) of every kernel launched
        self._free_at = 0.0

    def launch(self) -> float:
        """Queue a step's kernels; returns when the last will be done."""
        per_kernel = self.seconds / self.kernels
        for _ in range(self.kernels):
            launched = time.perf_counter() + self.launch_s
            while time.perf_counter() < launched:  # busy in Python, as a launch is
                pass
            start = max(self._free_at, launched)
            self._free_at = start + per_kernel
            self.jobs.append((start, self._free_at))
        return self._free_at

    @staticmethod
    def wait(until: float) -> None:
        while (left := until - time.perf_counter()) > 0:
            time.sleep(left)

    def busy(self, start: float, end: float) -> float:
        """Seconds of [start, end] the device spent on jobs."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.jobs)


def simulate(engine: LLMEngine, device: SimulatedDevice, cuda_inputs: bool = False) -> None:
    """Make ``engine``'s runner launch its decoder on ``device`` and defer its tokens;
    ``cuda_inputs``: prepare its inputs as the CUDA runner does, on the host."""
    runner = engine.runner
    runner.defer_sampled_tokens = True
    launched: list[float] = []  # when each launched step not yet sampled will be done
    if cuda_inputs:
        scheduler = engine.scheduler
        sizes = graph_batch_sizes(scheduler.max_num_seqs)
        CUDAModelRunner.allocate_graph_inputs(runner, sizes[-1], scheduler.max_model_len)
        runner.graph_sizes = sizes
        runner._attention_metadata = CUDAModelRunner._attention_metadata.__get__(runner)

    def forward(positions: torch.Tensor, embeds: torch.Tensor, meta,
                output_rows=None, lora=None) -> torch.Tensor:
        if cuda_inputs and meta.padded:  # a decode batch that replays a graph
            CUDAModelRunner.fill_graph_inputs(runner, positions, embeds, meta)
        launched.append(device.launch())
        return embeds if output_rows is None else embeds[output_rows.index]

    sample = runner._sample

    def sample_after_device(*args, **kwargs):
        drawn = sample(*args, **kwargs)
        done, to_list = launched.pop(), drawn.to_list
        drawn.to_list = lambda: (device.wait(done), to_list())[1]
        return drawn

    runner._forward = forward
    runner._sample = sample_after_device


# How each row of the table schedules: synchronously; ahead, each step launched on the engine's
# thread (``InlineSteps``), as the CUDA runner's steps are; ahead, launched on a thread of the
# runner's own (``StepThread``), as the CPU runner's are.
MODES = {"in step": (False, True), "ahead": (True, True), "ahead, thread": (True, False)}


def measure(model: str, requests: int, device: SimulatedDevice, mode: str, steps: int,
            threads: int | None = None, core: bool = False,
            cuda_inputs: bool = False) -> tuple[float, float]:
    """Seconds per decode step of ``requests`` requests, ``steps`` steps after a warm-up, and
    the device's busy share over those steps. ``mode``: a key of ``MODES``. ``core``: steps
    as the engine core process runs them (``core_step``: its front end detokenizes and makes
    the outputs). ``cuda_inputs``: see ``simulate``."""
    ahead, inline = MODES[mode]
    # The engine picks how it launches steps from the runner's class, before building it.
    inline_before = CPUModelRunner.launches_asynchronously
    CPUModelRunner.launches_asynchronously = inline
    try:
        engine = LLMEngine(EngineConfig(
            model=model, device="cpu", dtype="float32", max_model_len=2048,
            max_num_seqs=requests, max_num_batched_tokens=8192, kv_cache_memory=1 << 30,
            async_scheduling=ahead, cpu_threads=threads), detokenize=not core)
    finally:
        CPUModelRunner.launches_asynchronously = inline_before
    step = engine.core_step if core else engine.step
    try:
        simulate(engine, device, cuda_inputs)
        params = SamplingParams(max_tokens=steps + 100, temperature=0.0, ignore_eos=True,
                                output_kind="delta")
        for i in range(requests):
            engine.add_request({"prompt": f"USER: request {i}\nASSISTANT:"}, params)
        for _ in range(30):  # prompts, then decodes under way
            step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        end = time.perf_counter()
        scheduler = engine.scheduler
        live = len(scheduler.running) + len(scheduler.waiting)
        if live != requests:  # a failed step finishes its requests: no figure to give
            raise RuntimeError(f"{requests - live} of {requests} requests stopped before "
                               "the measured steps ended; see the engine's log")
        return (end - start) / steps, device.busy(start, end) / (end - start)
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--device-ms", default="1,2,3,4",
                        help="the simulated device's time per step, comma-separated")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", help="checkpoint (default: a tiny LLaVA built here)")
    parser.add_argument("--threads", type=int,
                        help="the engine's torch threads (default: one per core); on a GPU "
                        "host the work they do here (LM head, sampling) runs on the device")
    parser.add_argument("--kernels", type=int, default=1,
                        help="kernels a step's device work is launched as")
    parser.add_argument("--launch-us", type=float, default=0.0,
                        help="microseconds of Python each kernel's launch takes")
    parser.add_argument("--core", action="store_true",
                        help="also the engine core process's steps, without the outputs "
                        "(its front end detokenizes and makes them)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each row, in alternating turns; the table gives medians")
    parser.add_argument("--runner-thread", action="store_true",
                        help="also scheduling ahead with each step launched on a thread of "
                        "the runner's own (as on the CPU)")
    parser.add_argument("--cuda-inputs", action="store_true",
                        help="prepare each step's inputs as the CUDA runner does (Triton "
                        "metadata, copies into a CUDA graph's static inputs), on the host")
    parser.add_argument("--switch-interval-ms", type=float,
                        help="the interpreter's switch interval (default: Python's, 5 ms)")
    args = parser.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_tiny_checkpoint("llava", f"{tmp}/tiny"))
        print(f"{args.requests} requests decoding, {args.threads or torch.get_num_threads()} "
              f"threads, {args.kernels} launch(es) of {args.launch_us:g} us a step, switch "
              f"interval {sys.getswitchinterval() * 1e3:g} ms"
              + (", the CUDA runner's inputs" if args.cuda_inputs else ""))
        print(f"{'device ms':>9}  {'scheduling':>13}  {'outputs':>9}  {'ms a step':>9}  "
              f"{'device busy':>11}")
        modes = [m for m in MODES if args.runner_thread or m != "ahead, thread"]
        for ms in (float(v) for v in args.device_ms.split(",")):
            rows = [(mode, core) for mode in modes
                    for core in ((False, True) if args.core else (False,))]
            found: dict[tuple[str, bool], list[tuple[float, float]]] = {r: [] for r in rows}
            for _ in range(args.repeats):  # the rows' turns alternate
                for mode, core in rows:
                    device = SimulatedDevice(ms / 1e3, args.kernels, args.launch_us / 1e6)
                    found[mode, core].append(measure(model, args.requests, device, mode,
                                                     args.steps, args.threads, core,
                                                     args.cuda_inputs))
            for (mode, core), runs in found.items():
                step = statistics.median(s for s, _ in runs)
                busy = statistics.median(b for _, b in runs)
                print(f"{ms:9.1f}  {mode:>13}  {'front end' if core else 'engine':>9}  "
                      f"{step * 1e3:9.2f}  {busy:11.0%}")


if __name__ == "__main__":
    main()
