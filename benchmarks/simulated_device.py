"""How busy the engine's host side can keep a GPU, measured without one.

The decoder's forward pass is replaced by a simulated device: a thread that runs each step's
work (T milliseconds) in the order launched, while the launch returns at once, and a step's
sampled tokens reach Python only once its device work is done, as the CUDA runner's deferred
tokens do. Everything else is the engine as it runs: scheduling, input preparation, sampling
(over logits from the token embeddings, so tokens vary), detokenization and outputs, for
hundreds of requests decoding at once on a tiny checkpoint. The device's busy share is T times
the steps, over the wall time: with synchronous scheduling the host's work and the device's add
up each step; scheduled ahead, they overlap, and the device waits only where the host's work
per step is longer than T.

    python benchmarks/simulated_device.py
    python benchmarks/simulated_device.py --requests 64 --device-ms 0.5,1,2

Not part of the test suite: the figures depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import queue
import tempfile
import threading
import time

import torch

from mmserve.config import EngineConfig
from mmserve.engine.llm_engine import LLMEngine
from mmserve.sampling_params import SamplingParams
from mmserve.testing import build_tiny_checkpoint


class SimulatedDevice:
    """A thread that takes ``seconds`` for each job, in order; ``launch`` returns the job's
    done event."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._jobs: queue.Queue[threading.Event | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def launch(self) -> threading.Event:
        done = threading.Event()
        self._jobs.put(done)
        return done

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (done := self._jobs.get()) is not None:
            end = time.perf_counter() + self.seconds
            while (left := end - time.perf_counter()) > 0:
                time.sleep(left)
            done.set()


def simulate(engine: LLMEngine, device: SimulatedDevice) -> None:
    """Make ``engine``'s runner launch its decoder on ``device`` and defer its tokens."""
    runner = engine.runner
    runner.defer_sampled_tokens = True
    launched: list[threading.Event] = []

    def forward(positions: torch.Tensor, embeds: torch.Tensor, meta) -> torch.Tensor:
        launched.append(device.launch())
        return embeds

    sample = runner._sample

    def sample_after_device(sampled, logits):
        drawn = sample(sampled, logits)
        done, to_list = launched.pop(), drawn.to_list
        drawn.to_list = lambda: (done.wait(), to_list())[1]
        return drawn

    runner._forward = forward
    runner._sample = sample_after_device


def measure(model: str, requests: int, device_s: float, ahead: bool, steps: int) -> float:
    """Seconds per decode step of ``requests`` requests, ``steps`` steps after a warm-up."""
    engine = LLMEngine(EngineConfig(
        model=model, device="cpu", dtype="float32", max_model_len=2048,
        max_num_seqs=requests, max_num_batched_tokens=8192, kv_cache_memory=1 << 30,
        async_scheduling=ahead))
    device = SimulatedDevice(device_s)
    try:
        simulate(engine, device)
        params = SamplingParams(max_tokens=steps + 100, temperature=0.0, ignore_eos=True,
                                output_kind="delta")
        for i in range(requests):
            engine.add_request({"prompt": f"USER: request {i}\nASSISTANT:"}, params)
        for _ in range(30):  # prompts, then decodes under way
            engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        return (time.perf_counter() - start) / steps
    finally:
        engine.close()
        device.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--device-ms", default="1,2,3,4",
                        help="the simulated device's time per step, comma-separated")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", help="checkpoint (default: a tiny LLaVA built here)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_tiny_checkpoint("llava", f"{tmp}/tiny"))
        print(f"{args.requests} requests decoding, {torch.get_num_threads()} threads")
        print(f"{'device ms':>9}  {'scheduling':>10}  {'ms a step':>9}  {'device busy':>11}")
        for ms in (float(v) for v in args.device_ms.split(",")):
            for ahead in (False, True):
                step = measure(model, args.requests, ms / 1e3, ahead, args.steps)
                print(f"{ms:9.1f}  {'ahead' if ahead else 'in step':>10}  {step * 1e3:9.2f}  "
                      f"{min(1.0, ms / 1e3 / step):11.0%}")


if __name__ == "__main__":
    main()
