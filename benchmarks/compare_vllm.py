"""mmserve against vLLM's CPU build, in one run, same machine.

Both engines get the same checkpoint (mmserve's LLaVA bench checkpoint unless ``--model``), the
same prompts, images, output lengths and dtype, and the same scheduler limits: at most 64
sequences and 2048 tokens per step, prefix caching on, the same ``max_model_len`` and KV cache
size, greedy decoding with EOS ignored so that every request produces exactly its output length.
Both include preprocessing (their image processor) in their time, and both are timed from the
moment all requests are handed to the engine until the last one finishes.

Each engine runs in a fresh process of its own per turn: vLLM in the Python of its virtual
environment (``--vllm-python``), mmserve in this one. Turns alternate (vLLM, mmserve, vLLM,
mmserve, ... ``--repeats N`` of each) so that a change in the machine's speed moves both figures
of a ratio alike; medians and every turn's ratio are printed. A child loads the engine and warms
it up with a few short requests of their own images before the timed run; neither is timed.

The workload is built once, here, with `mmserve.bench.workload`, and handed to both children as a
file: images as PNG files, each prompt as the text the checkpoint's chat template renders (with
one image placeholder per image), which both engines tokenize themselves; the per-request prompt
token counts they report (image placeholders included) are compared and printed.

Workloads (``--workloads``): ``mixed``: N requests, N/2 distinct 256x200 images each used twice,
a 64-token system prompt shared by all, output lengths 16..96; ``uniform``: N distinct images,
64 output tokens each; ``text``: no images, short prompts (24 tokens), 256 output tokens each
(decode-heavy).

Besides throughput: CPU seconds per output token of each engine in its timed run (user + system
time of the child's process and its descendants during generation, from getrusage and /proc), the
same up to the end of its run (load and warm-up included; taken before it exits, while vLLM's
engine-core and worker processes can still be counted), images encoded
(vLLM: calls of its model's vision encoding, counted by wrapping ``embed_multimodal`` through
``LLM.apply_model``), prefix-cache hit tokens (vLLM: its ``vllm:prefix_cache_hits`` counter;
mmserve: its engine stats), and vLLM's preprocessing-cache hits (``vllm:mm_cache_hits``).

vLLM runs as its CPU installation guide sets it up: its front end, engine core and model worker
in three processes (its default; on the CPU, the worker's OpenMP threads are bound to cores only
in that mode), the worker's threads bound to ``--cores`` (``VLLM_CPU_OMP_THREADS_BIND``; vLLM
otherwise keeps one core for itself), tcmalloc and Intel's OpenMP in ``LD_PRELOAD`` where found,
and a KV cache of ``--kv-cache-gib`` (``VLLM_CPU_KVCACHE_SPACE``), the size mmserve's gets too.
mmserve runs in one process, with torch's default threads (one per core). With ``--cores``, both
engines' processes are pinned to those cores and mmserve runs one torch thread per core.

    python benchmarks/compare_vllm.py --vllm-python ~/venvs/vllm-cpu/bin/python
    python benchmarks/compare_vllm.py --vllm-python ~/venvs/vllm-cpu/bin/python \\
        --num-prompts 8 --repeats 1 --workloads mixed,text

This file is also what each child runs (``--child vllm|mmserve SPEC RESULT``): at module level it
imports only the standard library, so that vLLM's environment needs nothing of mmserve.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16")
WORKLOADS = ("mixed", "uniform", "text")
PROFILE_ROWS = 15
# Scheduler limits both engines get.
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 2048
# Offline, and no usage reports.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1"}


# ----------------------------------------------------------------- CPU time
def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system seconds) of a live process, from ``/proc/PID/stat``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: split after its closing one.
    fields = text[text.rindex(")") + 2:].split()
    ppid, utime, stime = int(fields[1]), int(fields[11]), int(fields[12])
    return ppid, (utime + stime) / _clock_ticks()


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads), of its children it has waited
    for, and of its live descendants (e.g. vLLM's engine-core process)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    procs = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            stat = proc_stat(int(entry))
            if stat is not None:
                procs[int(entry)] = stat
    for pid, (_, seconds) in procs.items():
        ancestor, seen = pid, 0
        while ancestor in procs and seen < 64:
            ancestor, seen = procs[ancestor][0], seen + 1
            if ancestor == os.getpid():
                total += seconds
                break
    return total


# ----------------------------------------------------------------- children
def _load_requests(spec: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The spec's requests with their PNG images decoded (before any timing)."""
    from PIL import Image

    out = []
    for r in spec[key]:
        images = [Image.open(p).convert("RGB") for p in r["images"]]
        out.append({"prompt": r["prompt"], "images": images, "output_len": r["output_len"]})
    return out


def count_encoder_calls(model) -> bool:
    """In vLLM's worker: wrap the model's image encoding to count the images it encodes."""
    encode = model.embed_multimodal
    model.bench_images_encoded = 0

    def counted(**kwargs):
        out = encode(**kwargs)
        model.bench_images_encoded += len(out)
        return out

    model.embed_multimodal = counted
    return True


def images_encoded(model) -> int:
    """In vLLM's worker: the images encoded since `count_encoder_calls`."""
    return model.bench_images_encoded


def child_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    if spec["cores"] is not None:
        # Its front end and engine core too (the worker's threads are bound by vLLM); the
        # processes it starts inherit this.
        os.sched_setaffinity(0, spec["cores"])
    requests = _load_requests(spec, "requests")
    warm = _load_requests(spec, "warmup")
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              enable_prefix_caching=True, limit_mm_per_prompt={"image": spec["max_images"]},
              disable_log_stats=False, seed=0)
    load_s = time.perf_counter() - start

    # The functions go to vLLM's worker process by pickle, by reference: as functions of this
    # file imported under its own name (its folder is on sys.path; at module level it imports
    # only the standard library).
    import compare_vllm

    try:
        counting = all(llm.apply_model(compare_vllm.count_encoder_calls))
    except Exception as e:  # noqa: BLE001 - a vLLM without apply_model, or a model without
        print(f"vLLM: images encoded not counted: {e!r}", file=sys.stderr)  # embed_multimodal
        counting = False

    def images_encoded_so_far() -> int | None:
        return sum(llm.apply_model(compare_vllm.images_encoded)) if counting else None

    def metrics() -> dict[str, float]:
        names = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:mm_cache_hits",
                 "vllm:mm_cache_queries")
        out = dict.fromkeys(names, 0.0)
        for m in llm.get_metrics():
            if m.name in out:
                out[m.name] += float(getattr(m, "value", 0) or 0)
        return out

    def prompts(reqs):
        return [{"prompt": r["prompt"], "multi_modal_data": {"image": r["images"]}}
                if r["images"] else {"prompt": r["prompt"]} for r in reqs]

    def params(reqs):
        return [SamplingParams(max_tokens=r["output_len"], temperature=0.0, ignore_eos=True)
                for r in reqs]

    llm.generate(prompts(warm), params(warm), use_tqdm=False)
    llm.reset_prefix_cache()
    encoded0, metrics0 = images_encoded_so_far(), metrics()
    batch, sampling = prompts(requests), params(requests)
    cpu0 = tree_cpu_seconds()
    start = time.perf_counter()
    outputs, top_ops = profiled(spec, lambda: llm.generate(batch, sampling, use_tqdm=False))
    elapsed = time.perf_counter() - start
    cpu = tree_cpu_seconds() - cpu0
    encoded, metrics1 = images_encoded_so_far(), metrics()
    delta = {k: metrics1[k] - metrics0[k] for k in metrics1}
    return {
        "engine": f"vLLM {vllm.__version__}, torch {torch.__version__}",
        "load_s": load_s, "elapsed_s": elapsed, "cpu_s": cpu,
        # Before shutting down: its engine-core and worker processes are still alive to count
        # (once it exits, nobody may wait for them, and wait4 would not see their time).
        "total_cpu_s": tree_cpu_seconds(),
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "prompt_tokens": [len(o.prompt_token_ids) for o in outputs],
        "images_encoded": None if encoded is None else encoded - encoded0,
        "prefix_cache_hit_tokens": int(delta["vllm:prefix_cache_hits"]),
        "prefix_cache_queried_tokens": int(delta["vllm:prefix_cache_queries"]),
        "mm_cache_hits": int(delta["vllm:mm_cache_hits"]),
        "mm_cache_queries": int(delta["vllm:mm_cache_queries"]),
        "threads": f"OpenMP threads bound to cores {os.environ.get('VLLM_CPU_OMP_THREADS_BIND')}",
        "top_ops": top_ops,
    }


def profiled(spec: dict[str, Any], run):
    """``run()``, and when the spec asks for it, under torch's profiler: the operators that took
    the most time in this process (name, seconds of their own on the calling thread, calls),
    else None."""
    if not spec.get("profile"):
        return run(), None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = run()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return out, [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in events[:PROFILE_ROWS]]


def child_mmserve(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from mmserve.bench.throughput import run_throughput
    from mmserve.bench.workload import BenchRequest, Workload, WorkloadConfig
    from mmserve.config import EngineConfig
    from mmserve.engine.llm_engine import LLMEngine

    if spec["cores"] is not None:
        os.sched_setaffinity(0, spec["cores"])
        torch.set_num_threads(len(spec["cores"]))

    @dataclasses.dataclass
    class PromptRequest(BenchRequest):
        """A request as prompt text with its image placeholders, like vLLM's."""

        text: str = ""

        def prompt(self) -> dict[str, Any]:
            return {"prompt": self.text, "images": self.images}

    def workload(key: str) -> Workload:
        reqs = [PromptRequest([], r["images"], list(range(len(r["images"]))), r["output_len"],
                              text=r["prompt"]) for r in _load_requests(spec, key)]
        return Workload(WorkloadConfig(), reqs, pool=[])

    requests, warm = workload("requests"), workload("warmup")
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
        max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        enable_prefix_caching=True, limit_mm_per_prompt=spec["max_images"],
        kv_cache_memory=int(spec["kv_cache_gib"] * 2**30), seed=0))
    load_s = time.perf_counter() - start
    run_throughput(engine, warm, use_tqdm=False)
    engine.reset_caches()
    cpu0 = tree_cpu_seconds()
    run = run_throughput(engine, requests, use_tqdm=False)
    cpu = tree_cpu_seconds() - cpu0
    r = run.results
    import mmserve

    return {
        "engine": f"mmserve {mmserve.__version__}, torch {torch.__version__}",
        "load_s": load_s, "elapsed_s": r["elapsed_s"], "cpu_s": cpu,
        "total_cpu_s": tree_cpu_seconds(),
        "token_ids": [list(o.token_ids) for o in run.outputs],
        "prompt_tokens": [o.num_prompt_tokens for o in run.outputs],
        "images_encoded": r["encoder_items_computed"],
        "prefix_cache_hit_tokens": r["prefix_cache_hit_tokens"],
        "prefix_cache_queried_tokens": r["prefix_cache_queried_tokens"],
        "encoder_cache_tokens": r["encoder_cache_tokens"],
        "preemptions": r["num_preemptions"],
        "time_share": r["time_share"],
        "threads": (f"{len(spec['cores'])} torch thread(s) pinned to cores "
                    f"{','.join(map(str, spec['cores']))}" if spec["cores"] else
                    f"torch threads chosen as it ran (--cpu-threads auto), "
                    f"{torch.get_num_threads()} at the end"),
    }


def child_main(kind: str, spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = child_vllm(spec) if kind == "vllm" else child_mmserve(spec)
    Path(result_path).write_text(json.dumps(result))
    return 0


# ----------------------------------------------------------------- parent
def workload_configs(n: int, shared_prefix_len: int, seed: int) -> dict[str, Any]:
    from mmserve.bench.workload import WorkloadConfig

    size = ((256, 200),)
    return {
        "mixed": WorkloadConfig(num_prompts=n, image_sizes=size, unique_images=max(1, n // 2),
                                output_len=(16, 96), shared_prefix_len=shared_prefix_len,
                                seed=seed),
        "uniform": WorkloadConfig(num_prompts=n, image_sizes=size, output_len=(64, 64),
                                  seed=seed + 1),
        "text": WorkloadConfig(num_prompts=n, images_per_prompt=0, output_len=(256, 256),
                               seed=seed + 2),
    }


def write_requests(workload, processor, folder: Path, tag: str) -> list[dict[str, Any]]:
    """The workload's requests as prompt text (the checkpoint's chat template), PNG image
    paths (each pool image written once) and output lengths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths: dict[int, str] = {}
    out = []
    for r in workload.requests:
        for i in r.image_ids:
            if i not in paths:
                paths[i] = str(folder / f"{tag}-{i:04d}.png")
                Path(paths[i]).write_bytes(workload.png(i))
        text = processor.apply_chat_template(r.messages, add_generation_prompt=True)
        out.append({"prompt": text, "images": [paths[i] for i in r.image_ids],
                    "output_len": r.output_len})
    return out


def run_child(kind: str, python: str, spec_path: Path, folder: Path, turn: int,
              env: dict[str, str]) -> dict[str, Any]:
    """One engine in a fresh process; its result, plus the process's wall seconds and its CPU
    seconds by wait4 (which counts only the descendants it waited for)."""
    result = folder / f"{kind}-{turn}.json"
    log = folder / f"{kind}-{turn}.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([python, __file__, "--child", kind, str(spec_path), str(result)],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or not result.is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise RuntimeError(f"the {kind} child failed (exit {proc.returncode}); end of {log}:\n"
                           f"{tail}")
    r = json.loads(result.read_text())
    r["process_cpu_s"] = usage.ru_utime + usage.ru_stime
    r["process_s"] = time.perf_counter() - start
    return r


def profile_vllm(spec: dict[str, Any], spec_path: Path, folder: Path, name: str, python: str,
                 env: dict[str, str], tokens: int) -> None:
    """One vLLM run of the workload, engine and model in the child's own process so that
    torch's profiler sees the model's operators; prints where its time went."""
    spec_path.write_text(json.dumps({**spec, "profile": True}))
    r = run_child("vllm", python, spec_path, folder, f"{name}-profile",
                  {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    print(f"\n{name}: vLLM under torch's profiler, engine in one process: "
          f"{tokens / r['elapsed_s']:.1f} out tok/s, {r['elapsed_s']:.1f} s (the profiler's "
          f"own cost included); operators by their own time on the thread that called them "
          f"(its OpenMP helpers work inside that time):")
    for op, seconds, calls in r["top_ops"]:
        print(f"  {seconds:8.2f} s  {calls:7d} calls  {op}")


def start_load(core: int) -> subprocess.Popen:
    """A process spinning on ``core``, competing with the engines for it."""
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def parse_cores(text: str | None) -> list[int] | None:
    """``0-1`` or ``0,2,3`` -> the core ids; None stays None (all cores)."""
    if text is None:
        return None
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores += range(int(lo), int(hi or lo) + 1)
    return sorted(set(cores))


def vllm_preload(python: str) -> list[str]:
    """What vLLM's CPU installation guide puts in ``LD_PRELOAD``: tcmalloc (the system's
    ``libtcmalloc_minimal.so.4``, Debian's libtcmalloc-minimal4) and Intel's OpenMP runtime
    (``libiomp5.so``, which vLLM's CPU build installs into its environment's lib/); those found."""
    found = []
    for pattern in ("/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4",
                    "/usr/lib/*-linux-gnu/libtcmalloc.so.4", "/usr/lib64/libtcmalloc*.so.4"):
        hits = sorted(Path("/").glob(pattern.lstrip("/")))
        if hits:
            found.append(str(hits[0]))
            break
    # The environment's own lib/ (not the interpreter's: a venv's python is a symlink).
    iomp = Path(python).absolute().parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        found.append(str(iomp))
    return found


def machine() -> str:
    cpu, flags = platform.processor() or platform.machine(), []
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = [f for f in line.split(":", 1)[1].split()
                         if f in ("avx2", "fma") or f.startswith(("avx512", "amx"))]
                break
    except OSError:
        pass
    listed = " ".join(flags) or "none of avx2, fma, avx512*, amx*"
    return f"{cpu}, {os.cpu_count()} cores, flags: {listed}; Python {platform.python_version()}"


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float, float]:
    """Requests with identical tokens, mean common-prefix length, mean length."""
    prefixes = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    exact = sum(x == y for x, y in zip(a, b, strict=True))
    return exact, statistics.mean(prefixes), statistics.mean(len(x) for x in a)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True, metavar="PATH",
                   help="the Python of the virtual environment with vLLM's CPU build")
    p.add_argument("--model", help="checkpoint (default: mmserve's LLaVA bench checkpoint, "
                   "built if needed)")
    p.add_argument("--workloads", default="mixed,uniform,text",
                   help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--shared-prefix-len", type=int, default=64,
                   help="tokens of the mixed workload's shared system prompt")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-gib", type=int, default=2,
                   help="KV cache of each engine in GiB (vLLM: VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--repeats", type=int, default=1,
                   help="turns of each engine per workload, alternating; medians reported")
    p.add_argument("--cores", help="cores both engines use, e.g. 0-1 or 1 (default: all); vLLM "
                   "binds its worker's threads to them; both engines' processes are pinned to "
                   "them only when this is given")
    p.add_argument("--load-core", type=int, metavar="N",
                   help="keep core N busy with a spinning process during every turn")
    p.add_argument("--no-vllm-preload", dest="vllm_preload", action="store_false",
                   help="do not put tcmalloc and Intel's OpenMP in vLLM's LD_PRELOAD (by default "
                   "they are, where found, as vLLM's CPU installation guide asks)")
    p.add_argument("--keep-dir", help="write the workload files and the children's logs and "
                   "results here (default: a temporary directory, removed at the end)")
    p.add_argument("--profile-vllm", action="store_true",
                   help="instead of the comparison: run vLLM once per workload with its engine "
                   "in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) under torch's profiler, "
                   "and print the operators that took its time")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    names = args.workloads.split(",")
    for name in names:
        if name not in WORKLOADS:
            p.error(f"--workloads: {name!r} is not one of {', '.join(WORKLOADS)}")
    all_cores = sorted(os.sched_getaffinity(0))
    cores = parse_cores(args.cores)
    bind = cores or all_cores

    from mmserve.bench.checkpoint import ensure_bench_checkpoint
    from mmserve.bench.report import grid_table
    from mmserve.bench.workload import build_workload
    from mmserve.testing.oracle import load_hf_processor

    model_dir = args.model or str(ensure_bench_checkpoint())
    processor = load_hf_processor(model_dir)
    tokenizer = processor.tokenizer
    configs = workload_configs(args.num_prompts, args.shared_prefix_len, args.seed)
    print(f"machine: {machine()}")
    print(f"model: {model_dir}, dtype {args.dtype}, max_model_len {args.max_model_len}, KV cache "
          f"{args.kv_cache_gib} GiB each, max_num_seqs {MAX_NUM_SEQS}, max_num_batched_tokens "
          f"{MAX_NUM_BATCHED_TOKENS}, prefix caching on, greedy, EOS ignored")
    print(f"cores: {','.join(map(str, bind))} (vLLM's worker threads bound to them"
          + (", both engines' processes pinned to them" if cores else ", processes unpinned")
          + ")"
          + (f"; core {args.load_core} kept busy by a spinning process" if args.load_core
             is not None else ""))

    env = {**os.environ, **OFFLINE_ENV}
    vllm_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, bind)),
                "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
                # apply_model sends the counting function to the worker process by pickle.
                "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING")}
    preload = vllm_preload(args.vllm_python) if args.vllm_preload else []
    if preload:
        vllm_env["LD_PRELOAD"] = ":".join(preload + [env["LD_PRELOAD"]] if env.get("LD_PRELOAD")
                                          else preload)
    vllm_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # its default: separate processes
    print(f"vLLM: {args.vllm_python}, LD_PRELOAD {vllm_env.get('LD_PRELOAD') or '(none)'}")
    mm_env = env

    tmp = None
    if args.keep_dir:
        folder = Path(args.keep_dir)
        folder.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="compare-vllm-")
        folder = Path(tmp.name)
    load = start_load(args.load_core) if args.load_core is not None else None
    rows, details = [], []
    try:
        for name in names:
            workload = build_workload(configs[name], tokenizer)
            warm = build_workload(dataclasses.replace(configs["uniform"], num_prompts=2,
                                                    output_len=(2, 2), seed=10_000), tokenizer)
            max_images = max(1, max(len(r.images) for r in workload.requests))
            spec = {"model": model_dir, "dtype": args.dtype,
                    "max_model_len": args.max_model_len, "kv_cache_gib": args.kv_cache_gib,
                    "max_images": max_images, "cores": cores,
                    "requests": write_requests(workload, processor, folder / "images", name),
                    "warmup": write_requests(warm, processor, folder / "images", "warmup")}
            spec_path = folder / f"{name}.json"
            spec_path.write_text(json.dumps(spec))
            tokens = workload.num_output_tokens
            print(f"\n== {name}: {len(workload.requests)} requests, "
                  f"{workload.num_distinct_images} distinct images, {tokens} output tokens",
                  file=sys.stderr)
            if args.profile_vllm:
                profile_vllm(spec, spec_path, folder, name, args.vllm_python, vllm_env, tokens)
                continue
            runs: dict[str, list[dict[str, Any]]] = {"vllm": [], "mmserve": []}
            ratios = []
            for turn in range(args.repeats):
                line = f"  turn {turn + 1}:"
                for kind, python, kind_env in (("vllm", args.vllm_python, vllm_env),
                                               ("mmserve", sys.executable, mm_env)):
                    r = run_child(kind, python, spec_path, folder, f"{name}-{turn}", kind_env)
                    got = sum(len(t) for t in r["token_ids"])
                    if got != tokens:
                        raise RuntimeError(f"{kind} produced {got} output tokens, not {tokens}")
                    r["rate"] = tokens / r["elapsed_s"]
                    runs[kind].append(r)
                    line += (f" {'vLLM' if kind == 'vllm' else kind} {r['rate']:.1f} out tok/s "
                             f"({r['cpu_s'] / tokens * 1e3:.1f} CPU ms/tok),")
                ratios.append(runs["mmserve"][-1]["rate"] / runs["vllm"][-1]["rate"])
                print(f"{line} mmserve/vLLM {ratios[-1]:.2f}x", file=sys.stderr)
            v, m = runs["vllm"][-1], runs["mmserve"][-1]
            exact, prefix, length = agreement(v["token_ids"], m["token_ids"])
            rows.append([
                name, statistics.median(r["rate"] for r in runs["vllm"]),
                statistics.median(r["rate"] for r in runs["mmserve"]), statistics.median(ratios),
                f"{statistics.median(r['cpu_s'] for r in runs['vllm']) / tokens * 1e3:.1f}",
                f"{statistics.median(r['cpu_s'] for r in runs['mmserve']) / tokens * 1e3:.1f}",
                f"{exact}/{len(workload.requests)}", f"{prefix:.1f}/{length:.1f}"])
            details.append((name, workload, runs, ratios))
    finally:
        if load is not None:
            load.terminate()
            load.wait()
        if tmp is not None:
            tmp.cleanup()

    if args.profile_vllm:
        return 0
    print("\n" + grid_table(
        ["workload", "vLLM out tok/s", "mmserve out tok/s", "ratio", "vLLM CPU ms/tok",
         "mmserve CPU ms/tok", "exact match", "common prefix/len"], rows))
    print("\nratio: mmserve / vLLM output tokens/s. CPU ms/tok: user + system CPU time of the "
          "engine's process (and its descendants) during the timed run, per output token.")
    if args.repeats > 1:
        print(f"(medians of {args.repeats} turns each; ratios of each turn: " + "; ".join(
            f"{name} " + ", ".join(f"{x:.2f}" for x in ratios)
            for name, _, _, ratios in details) + ")")
    for name, workload, runs, _ in details:
        v, m = runs["vllm"][-1], runs["mmserve"][-1]
        same = v["prompt_tokens"] == m["prompt_tokens"]
        print(f"\n{name}: prompt tokens (image placeholders included) vLLM "
              f"{sum(v['prompt_tokens'])}, mmserve {sum(m['prompt_tokens'])}; per request "
              + ("identical" if same else "DIFFERENT: " + ", ".join(
                  f"#{i} {a}/{b}" for i, (a, b) in enumerate(
                      zip(v["prompt_tokens"], m["prompt_tokens"], strict=True)) if a != b)[:300]))
        requested = sum(len(r.images) for r in workload.requests)
        enc_v = "n/a" if v["images_encoded"] is None else v["images_encoded"]
        print(f"{name}: images encoded vLLM {enc_v}, mmserve {m['images_encoded']}, of "
              f"{requested} ({workload.num_distinct_images} distinct); prefix-cache hit tokens "
              f"vLLM {v['prefix_cache_hit_tokens']} of {v['prefix_cache_queried_tokens']}, "
              f"mmserve {m['prefix_cache_hit_tokens']} of {m['prefix_cache_queried_tokens']}; "
              f"vLLM preprocessing-cache hits {v['mm_cache_hits']} of {v['mm_cache_queries']}; "
              f"mmserve preemptions {m['preemptions']}")
        print(f"{name}: mmserve time shares: " + ", ".join(
            f"{k} {v:.1%}" for k, v in m["time_share"].items()))
        for kind, label in (("vllm", "vLLM"), ("mmserve", "mmserve")):
            r = runs[kind]
            print(f"{name}: {label} ({r[-1]['engine']}, {r[-1]['threads']}): timed run "
                  + ", ".join(f"{x['elapsed_s']:.1f}" for x in r) + " s, CPU "
                  + ", ".join(f"{x['cpu_s']:.1f}" for x in r) + " s ("
                  + ", ".join(f"{x['cpu_s'] / x['elapsed_s']:.2f}" for x in r)
                  + " cores busy); whole process (load, warm-up, run) "
                  + ", ".join(f"{x['process_s']:.0f}" for x in r) + " s wall, "
                  + ", ".join(f"{x['total_cpu_s']:.0f}" for x in r) + " s CPU; load "
                  + ", ".join(f"{x['load_s']:.0f}" for x in r) + " s")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:  # a child: --child KIND SPEC RESULT
        sys.exit(child_main(*sys.argv[2:5]))
    sys.exit(main())
