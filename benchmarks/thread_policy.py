"""The CPU runner's thread count against a load that takes part of one core.

For each load (the share of one core a second process asks for: it spins for that share of every
``--period-ms`` and sleeps the rest, pinned to ``--core``), runs an engine once per thread
setting (``cpu_threads=N`` fixed, or ``auto``, the default policy of
``mmserve/worker/cpu_threads.py``), each in a fresh process, and prints each timed batch's
output tokens/s and the share of the core the load actually got meanwhile (from its
/proc/PID/stat), which is what the policy sees. The workload is text decoding (no images, a
warm-up batch first), where parallel regions are shortest and a descheduled thread costs the
most.

    python benchmarks/thread_policy.py      # where one thread beats two, and what auto picks
    python benchmarks/thread_policy.py --loads 0,0.5,1 --settings 1,2,auto --num-prompts 8

Not part of the test suite: the figures depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from compare_vllm import proc_stat  # this folder is on the path when a script here runs

LOAD_CODE = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
share, period = float(sys.argv[2]), float(sys.argv[3])
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < share * period:
        pass
    time.sleep(max(0.0, period - (time.perf_counter() - start)))
"""


def start_load(core: int, share: float, period_s: float) -> subprocess.Popen | None:
    """A process asking for ``share`` of ``core`` (None for no load)."""
    if share <= 0:
        return None
    return subprocess.Popen([sys.executable, "-c", LOAD_CODE, str(core), str(share),
                             str(period_s)])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the live process ``pid`` so far."""
    return proc_stat(pid)[1]


def child(setting: str, load_pid: int, args: argparse.Namespace) -> dict[str, float]:
    """One engine with thread ``setting``: a warm-up batch, then a timed one; its output
    tokens/s and the share of a core the load got during the timed batch."""
    from mmserve.bench.checkpoint import ensure_bench_checkpoint
    from mmserve.config import EngineConfig
    from mmserve.engine.llm_engine import LLMEngine
    from mmserve.sampling_params import SamplingParams

    model = args.model or str(ensure_bench_checkpoint())
    engine = LLMEngine(EngineConfig(
        model=model, dtype=args.dtype, max_model_len=1024, max_num_seqs=64,
        kv_cache_memory=1 << 30, cpu_threads=None if setting == "auto" else int(setting)))
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def batch() -> float:
        for i in range(args.num_prompts):
            engine.add_request({"prompt": f"USER: tell story number {i} about a cat and a dog "
                                          "playing in the park ASSISTANT:"}, params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    batch()
    load_before = cpu_seconds(load_pid) if load_pid else 0.0
    seconds = batch()
    got = (cpu_seconds(load_pid) - load_before) / seconds if load_pid else 0.0
    return {"tok_s": args.num_prompts * args.output_len / seconds, "load_got": got,
            "threads_at_end": engine.stats()["cpu_threads"]}


def run_child(setting: str, load: subprocess.Popen | None, args: argparse.Namespace,
              out: Path) -> dict[str, float]:
    """``child`` in a fresh process (each thread setting starts from torch's defaults)."""
    cmd = [sys.executable, __file__, "--child", setting, str(load.pid if load else 0),
           str(out), "--dtype", args.dtype, "--num-prompts", str(args.num_prompts),
           "--output-len", str(args.output_len)] + (["--model", args.model] if args.model else [])
    subprocess.run(cmd, check=True, stderr=None if args.verbose else subprocess.DEVNULL)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loads", default="0,0.25,0.5,0.6,0.75,1",
                   help="shares of one core the load asks for")
    p.add_argument("--settings", default="1,2,auto", help="--cpu-threads values to compare")
    p.add_argument("--core", type=int, default=None,
                   help="the core the load runs on (default: the last this process may use)")
    p.add_argument("--period-ms", type=float, default=10.0,
                   help="the load's cycle: it spins its share of each and sleeps the rest")
    p.add_argument("--model", help="checkpoint (default: the llava bench checkpoint)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--verbose", action="store_true", help="show the engines' logs")
    p.add_argument("--child", nargs=3, metavar=("SETTING", "LOAD_PID", "RESULT"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        setting, load_pid, result = args.child
        Path(result).write_text(json.dumps(child(setting, int(load_pid), args)))
        return 0
    core = args.core if args.core is not None else max(os.sched_getaffinity(0))
    loads = [float(v) for v in args.loads.split(",")]
    settings = args.settings.split(",")

    print(f"text decode, {args.num_prompts} requests x {args.output_len} tokens, {args.dtype}; "
          f"load on core {core} of {sorted(os.sched_getaffinity(0))}, "
          f"{args.period_ms:g} ms cycles")
    print("each cell: output tokens/s (threads at the end, share of the core the load got)")
    print(f"{'load asks':>9}  " + "  ".join(f"{'threads ' + s:>22}" for s in settings))
    with tempfile.TemporaryDirectory() as tmp:
        for share in loads:
            load = start_load(core, share, args.period_ms / 1000)
            cells = []
            try:
                time.sleep(0.5)
                for setting in settings:
                    r = run_child(setting, load, args, Path(tmp) / "run.json")
                    cells.append(f"{r['tok_s']:6.1f} ({r['threads_at_end']}t, "
                                 f"got {r['load_got']:4.2f})")
            finally:
                if load is not None:
                    load.kill()
                    load.wait()
            print(f"{share:>9.2f}  " + "  ".join(f"{c:>22}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
