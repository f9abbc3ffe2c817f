"""`mmserve bench throughput`: the engine in this process, fed the workload's requests as
``LLM.generate`` feeds a batch (``PromptFeed``: preprocessed a bounded window ahead, on threads
beside a GPU engine, between steps on the CPU).

Reports what people compare engines by (requests/s, tokens/s) and what only an engine with an
encoder cache can show (images requested vs encoded, tokens per image, the encoder cache's peak
occupancy, prefix-cache hits), plus where the wall time goes (the vision encoder's share of the
step time among it) and how far the achieved model FLOP/s are from the machine's measured matmul
peak.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from mmserve.bench.flops import ModelFlops
from mmserve.bench.report import fmt, section_table
from mmserve.bench.stats import summarize
from mmserve.bench.workload import Workload
from mmserve.engine.llm_engine import LLMEngine
from mmserve.engine.prompt_feed import PromptFeed
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams
from mmserve.step import StepTimes

if TYPE_CHECKING:
    from mmserve.bench.profile import StepProfiler

# Steps with at least this share of the peak number of running requests count as "full batch"
# steps for the scheduling-overhead figure (the target is stated at 64 running).
FULL_BATCH_SHARE = 0.9


@dataclass
class TimelineStep:
    """One engine step of the timeline (from the engine's ``StepRecord`` and its stats)."""

    end_s: float  # seconds since the first request was added
    duration_s: float
    scheduled_tokens: int
    running: int
    waiting: int
    kv_blocks_used: int
    encoder_cache_used_tokens: int  # in the encoder cache's reserve
    encoder_cache_borrowed_tokens: int  # beyond it, in free KV blocks the pool lent
    images_encoded: int
    image_tokens_encoded: int  # embedding tokens of the images encoded
    encoder_s: float  # the runner's vision encoder
    schedule_s: float  # scheduling, state updates and detokenization
    prepare_s: float  # input preparation in the runner
    decoder_flops: int
    encoder_flops: int


@dataclass
class ThroughputRun:
    results: dict[str, Any]
    steps: list[TimelineStep]
    outputs: list[RequestOutput]  # in workload order


def sampling_params_for(workload: Workload) -> list[SamplingParams]:
    """Greedy, exactly ``output_len`` tokens per request (EOS does not stop it); each step's
    outputs hold what it added (``delta``: the engine's cost per step stays flat)."""
    return [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True,
                           output_kind="delta") for r in workload.requests]


def run_throughput(
    engine: LLMEngine,
    workload: Workload,
    matmul_peak: float | None = None,
    use_tqdm: bool = True,
    profiler: StepProfiler | None = None,
) -> ThroughputRun:
    """Feed ``workload``'s requests to ``engine`` (``PromptFeed``), step until all finish,
    measure. The "preprocessing" time is what preprocessing cost the stepping thread: all of
    it on the CPU, only the waits for the pool's threads beside a GPU. ``profiler`` is told
    before each step (``mmserve/bench/profile.py``)."""
    flops = ModelFlops.from_hf_config(engine.hf_config)
    stats0 = engine.stats()
    params = sampling_params_for(workload)

    faults0 = _minor_page_faults()
    device_timer = engine.time_device()
    start = time.perf_counter()
    ids = [engine.next_request_id() for _ in workload.requests]
    image_tokens: list[int] = []  # placeholder tokens of every requested image, by the model
    feed = PromptFeed(engine, [r.prompt() for r in workload.requests], params,
                      [[rid] for rid in ids],
                      on_queued=lambda req: image_tokens.extend(i.length for i in req.images))

    done: dict[str, RequestOutput] = {}
    # Each request's text pieces and tokens so far (its outputs are deltas).
    generated: dict[str, tuple[list[str], list[int]]] = {}
    first_token_s: dict[str, float] = {}
    finish_s: dict[str, float] = {}
    steps: list[TimelineStep] = []
    # The runner's seconds per part and the engine's scheduling seconds, summed over steps.
    times = dict.fromkeys([f.name for f in fields(StepTimes)], 0.0)
    times["scheduling"] = 0.0
    pool_blocks = engine.stats()["kv_blocks_total"]
    bar = tqdm(total=workload.num_output_tokens, desc="output tokens", unit="tok",
               disable=not use_tqdm)
    try:
        while len(done) < len(ids):
            feed.top_up(len(done))
            if not engine.has_unfinished_requests():
                break  # nothing queued, nothing to queue: see below
            if profiler is not None:
                profiler.before_step(len(steps))
            t0 = time.perf_counter()
            outputs, record = engine.step_with_record()
            t1 = time.perf_counter()
            scheduled = record.scheduler_output
            dec, enc = flops.step(scheduled)
            for part, seconds in asdict(record.runner_times).items():
                times[part] += seconds
            times["scheduling"] += record.schedule_s
            s = engine.stats()
            steps.append(TimelineStep(
                end_s=t1 - start, duration_s=t1 - t0,
                scheduled_tokens=scheduled.num_scheduled_tokens,
                running=s["num_running"], waiting=s["num_waiting"],
                kv_blocks_used=pool_blocks - s["kv_blocks_free"],
                encoder_cache_used_tokens=s["encoder_cache_used_tokens"],
                encoder_cache_borrowed_tokens=s["encoder_cache_borrowed_tokens"],
                images_encoded=len(scheduled.images_to_encode),
                image_tokens_encoded=sum(scheduled.images_to_encode.values()),
                encoder_s=record.runner_times.encoder, schedule_s=record.schedule_s,
                prepare_s=record.runner_times.prepare, decoder_flops=dec, encoder_flops=enc))
            for out in outputs:
                bar.update(len(out.token_ids))
                first_token_s.setdefault(out.request_id, t1 - start)
                text, tokens = generated.setdefault(out.request_id, ([], []))
                text.append(out.text)
                tokens += out.token_ids
                if out.finished:
                    done[out.request_id] = replace(out, text="".join(text), token_ids=tokens)
                    finish_s[out.request_id] = t1 - start
    except BaseException:
        feed.abort(done)
        raise
    finally:
        feed.close()
        bar.close()
    feed.check_finished(done)
    preprocess_s = feed.wait_s
    elapsed = time.perf_counter() - start
    device_busy_s = None if device_timer is None else device_timer.total_s()
    engine.time_device(on=False)

    ordered = [done[rid] for rid in ids]
    stats = engine.stats()
    times["preprocessing"] = preprocess_s
    results = _results(workload, ordered, steps, stats, stats0, times, elapsed, matmul_peak,
                       image_tokens)
    faults = _minor_page_faults()
    results["minor_page_faults"] = None if faults is None else faults - faults0
    results["device_busy_s"] = device_busy_s
    results["device_busy_share"] = None if device_busy_s is None else device_busy_s / elapsed
    results["device_busy_from"] = (None if device_timer is None else "CUDA events"
                                   if device_timer.cuda else "the runner's wall time")
    # From the start of the run, with the workload fed as fast as the engine takes it: latencies
    # under a full backlog.
    results["ttft_s"] = summarize([first_token_s[rid] for rid in ids])
    results["e2e_latency_s"] = summarize([finish_s[rid] for rid in ids])
    return ThroughputRun(results, steps, ordered)


def _minor_page_faults() -> int | None:
    """Page faults of this process so far that needed no disk read (None where unknown).

    Each costs more than the arithmetic on its page; a run with millions of them is paying
    the C allocator for returning freed activations to the kernel (worker/cpu_allocator.py).
    """
    try:
        import resource
    except ImportError:  # not on Unix
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _results(workload, outputs, steps, stats, stats0, times, elapsed, matmul_peak,
             image_tokens) -> dict:
    def delta(key: str) -> int:
        return stats[key] - stats0[key]

    num_output = sum(len(o.token_ids) for o in outputs)
    num_prompt = sum(o.num_prompt_tokens for o in outputs)
    finish = Counter(o.finish_reason for o in outputs)
    hits, misses = delta("encoder_cache_hits"), delta("encoder_cache_misses")
    requested = sum(len(r.images) for r in workload.requests)
    prefix_hit, prefix_queried = (delta("prefix_cache_hit_tokens"),
                                  delta("prefix_cache_queried_tokens"))
    shares_of = ("preprocessing", "encoder", "prepare", "forward", "sample", "scheduling")
    time_s = {k: times[k] for k in shares_of}
    time_s["other"] = max(0.0, elapsed - sum(time_s.values()))
    peak_running = max((s.running for s in steps), default=0)
    full = [s for s in steps if s.running >= FULL_BATCH_SHARE * peak_running and s.running]
    full_time = sum(s.duration_s for s in full)
    decoder_flops = sum(s.decoder_flops for s in steps)
    encoder_flops = sum(s.encoder_flops for s in steps)
    achieved = (decoder_flops + encoder_flops) / elapsed
    step_s = sum(s.duration_s for s in steps)
    peak_encoder_used = max((s.encoder_cache_used_tokens for s in steps), default=0)
    return {
        "num_requests": len(workload.requests),
        "completed": sum(n for reason, n in finish.items() if reason in ("length", "stop")),
        "failed": sum(n for reason, n in finish.items() if reason not in ("length", "stop")),
        "finish_reasons": dict(finish),
        "elapsed_s": elapsed,
        "requested_output_tokens": workload.num_output_tokens,
        "output_tokens": num_output,
        "prompt_tokens": num_prompt,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": num_output / elapsed,
        "total_tokens_per_s": (num_output + num_prompt) / elapsed,
        "encoder_items_requested": requested,
        "encoder_items_distinct": workload.num_distinct_images,
        "encoder_items_computed": misses,
        "encoder_tokens_computed": sum(s.image_tokens_encoded for s in steps),
        "tokens_per_image": {"min": min(image_tokens), "median": statistics.median(image_tokens),
                             "max": max(image_tokens)} if image_tokens else None,
        # Requested images served without running the encoder, from the encoder cache or
        # because a prefix-cache hit covered their placeholders (then no lookup happens).
        "encoder_cache_hit_rate": max(0.0, 1 - misses / requested) if requested else 0.0,
        "encoder_cache_lookups": hits + misses,
        "encoder_cache_lookup_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        # Entries dropped because the reserve was full (capacity), and borrowed entries dropped
        # because the KV cache needed their blocks; spills moved entries out of the reserve
        # into lent KV blocks, restores brought them back on a hit (no re-encoding).
        "encoder_cache_evictions": delta("encoder_cache_evictions"),
        "encoder_cache_kv_pressure_evictions": delta("encoder_cache_kv_pressure_evictions"),
        "encoder_cache_spills": delta("encoder_cache_spills"),
        "encoder_cache_restores": delta("encoder_cache_restores"),
        "prefix_cache_hit_tokens": prefix_hit,
        "prefix_cache_queried_tokens": prefix_queried,
        "prefix_cache_hit_rate": prefix_hit / prefix_queried if prefix_queried else 0.0,
        "kv_blocks_total": stats["kv_blocks_total"],
        "peak_kv_blocks_used": max((s.kv_blocks_used for s in steps), default=0),
        "peak_kv_usage": (max((s.kv_blocks_used for s in steps), default=0)
                          / stats["kv_blocks_total"]),
        "peak_encoder_cache_used_tokens": peak_encoder_used,
        "encoder_cache_tokens": stats["encoder_cache_tokens"],
        "peak_encoder_cache_usage": peak_encoder_used / stats["encoder_cache_tokens"],
        "peak_encoder_cache_borrowed_tokens": max(
            (s.encoder_cache_borrowed_tokens for s in steps), default=0),
        "peak_running": peak_running,
        "num_preemptions": delta("num_preemptions"),
        "num_steps": len(steps),
        "time_s": time_s,
        "time_share": {k: v / elapsed for k, v in time_s.items()},
        # The runner's vision encoder against the engine steps' wall time (no preprocessing).
        "encoder_share_of_step_time": times["encoder"] / step_s if step_s else 0.0,
        "full_batch_steps": len(full),
        "full_batch_mean_running": (sum(s.running for s in full) / len(full)) if full else 0.0,
        "full_batch_mean_step_ms": 1e3 * full_time / len(full) if full else 0.0,
        "full_batch_sched_prep_share": (sum(s.schedule_s + s.prepare_s for s in full)
                                        / full_time if full_time else 0.0),
        "model_flops": {"decoder": decoder_flops, "encoder": encoder_flops},
        "achieved_flops_per_s": achieved,
        "matmul_peak_flops_per_s": matmul_peak,
        "share_of_matmul_peak": achieved / matmul_peak if matmul_peak else None,
    }


def throughput_table(r: dict[str, Any], title: str = "mmserve bench throughput") -> str:
    share = r["time_share"]
    peak = r["matmul_peak_flops_per_s"]
    return section_table(title, [
        ("requests", [
            ("requests (completed / failed)", f"{r['completed']} / {r['failed']}"),
            ("wall time (s)", r["elapsed_s"]),
            ("requests/s", r["requests_per_s"]),
            ("output tokens/s", r["output_tokens_per_s"]),
            ("total tokens/s", r["total_tokens_per_s"]),
            ("output / prompt tokens", f"{r['output_tokens']:,} / {r['prompt_tokens']:,}"),
            ("TTFT mean / p90 (s)", f"{r['ttft_s']['mean']:.2f} / {r['ttft_s']['p90']:.2f}"),
            ("E2E mean / p90 (s)",
             f"{r['e2e_latency_s']['mean']:.2f} / {r['e2e_latency_s']['p90']:.2f}"),
        ]),
        ("caches", [
            ("images requested / distinct / encoded",
             f"{r['encoder_items_requested']} / {r['encoder_items_distinct']} / "
             f"{r['encoder_items_computed']}"),
            ("tokens per image (min / median / max)", _tokens_per_image(r)),
            ("image tokens encoded", r["encoder_tokens_computed"]),
            ("encoder cache hit rate", r["encoder_cache_hit_rate"]),
            ("peak encoder cache reserve used (tokens)",
             f"{r['peak_encoder_cache_used_tokens']:,} of {r['encoder_cache_tokens']:,} "
             f"({r['peak_encoder_cache_usage']:.1%})"),
            ("peak borrowed from free KV blocks (tokens)",
             f"{r['peak_encoder_cache_borrowed_tokens']:,}"),
            ("encoder cache spills / restores",
             f"{r['encoder_cache_spills']} / {r['encoder_cache_restores']}"),
            ("encoder cache evictions (capacity / KV pressure)",
             f"{r['encoder_cache_evictions']} / {r['encoder_cache_kv_pressure_evictions']}"),
            ("prefix cache hit tokens", f"{r['prefix_cache_hit_tokens']:,} of "
                                        f"{r['prefix_cache_queried_tokens']:,}"),
            ("peak KV blocks used", f"{r['peak_kv_blocks_used']:,} of {r['kv_blocks_total']:,} "
                                    f"({r['peak_kv_usage']:.1%})"),
            ("peak running requests", r["peak_running"]),
            ("preemptions", r["num_preemptions"]),
            ("engine steps", r["num_steps"]),
        ]),
        ("where the wall time goes", [
            *((name, f"{r['time_s'][key]:.2f} s  {share[key]:6.1%}")
              for name, key in (("preprocessing (not overlapped)", "preprocessing"),
                                ("vision encoder", "encoder"),
                                ("input preparation", "prepare"),
                                ("decoder forward + LM head", "forward"),
                                ("sampling", "sample"),
                                ("scheduling + update + detok", "scheduling"),
                                ("other", "other"))),
            ("vision encoder share of step time", f"{r['encoder_share_of_step_time']:.1%}"),
            (f"device busy ({r['device_busy_from'] or 'not measured'})", _device_busy(r)),
            ("minor page faults", "not measured" if r["minor_page_faults"] is None
             else f"{r['minor_page_faults']:,}"),
            (f"sched + prep share, {r['full_batch_steps']} steps at "
             f"~{r['full_batch_mean_running']:.0f} running",
             f"{r['full_batch_sched_prep_share']:.1%} of "
             f"{r['full_batch_mean_step_ms']:.0f} ms"),
        ]),
        ("compute", [
            ("model FLOPs (decoder / encoder)",
             f"{fmt(float(r['model_flops']['decoder']))} / "
             f"{fmt(float(r['model_flops']['encoder']))}"),
            ("achieved model FLOP/s", r["achieved_flops_per_s"]),
            ("measured matmul peak FLOP/s", peak),
            ("share of matmul peak",
             f"{r['share_of_matmul_peak']:.1%}" if peak else "not measured"),
        ]),
    ])


def _tokens_per_image(r: dict[str, Any]) -> str:
    t = r["tokens_per_image"]
    return "no images" if t is None else f"{t['min']:,} / {t['median']:,g} / {t['max']:,}"


def _device_busy(r: dict[str, Any]) -> str:
    """The device's busy time and share of the run: the spans of the runner's encoder,
    forward and sampling (``worker/busy_timer.py``)."""
    busy = r.get("device_busy_s")
    return "" if busy is None else f"{busy:.2f} s  {r['device_busy_share']:6.1%}"
