"""`mmserve bench`: workloads, FLOP counts, and the subcommands end to end on a tiny checkpoint."""

from __future__ import annotations

import argparse
import asyncio
import copy
import gzip
import json
import math
import time

import pytest
import torch
from PIL import Image

from mmserve.bench.cli import add_bench_parser
from mmserve.bench.flops import ModelFlops
from mmserve.bench.profile import parse_steps
from mmserve.bench.serve import run_load, serve_results
from mmserve.bench.stats import summarize
from mmserve.bench.sweep import parse_param, run_sweep
from mmserve.bench.workload import WorkloadConfig, build_workload
from mmserve.kernels.cpu_ops import PackedLinearF32, float32_linear
from mmserve.worker.busy_timer import BusyTimer
from tests.test_bench_plots import assert_plot

# Tiny checkpoint: 32 px images, patch 8 -> 16 image tokens.
WORKLOAD_FLAGS = ["--num-prompts", "8", "--unique-images", "3", "--image-size", "40x30",
                  "--output-len", "3:9", "--shared-prefix-len", "40", "--prompt-len", "6",
                  "--dtype", "float32", "--no-progress"]


def bench(argv: list[str]) -> int:
    """``mmserve bench ARGV``, parsed by the bench subcommands' own parser."""
    parser = argparse.ArgumentParser(prog="mmserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def tokenizer(clip_llama: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(clip_llama)


def test_workload_is_seeded_and_reuses_images_evenly(tokenizer) -> None:
    config = WorkloadConfig(num_prompts=10, image_sizes=((40, 30),), unique_images=4,
                            images_per_prompt=2, output_len=(5, 9), shared_prefix_len=12,
                            seed=3)
    a, b = build_workload(config, tokenizer), build_workload(config, tokenizer)
    assert [r.messages for r in a.requests] == [r.messages for r in b.requests]
    assert [r.image_ids for r in a.requests] == [r.image_ids for r in b.requests]
    assert a.pool[0].tobytes() == b.pool[0].tobytes()
    uses = [sum(r.image_ids.count(i) for r in a.requests) for i in range(4)]
    assert sorted(uses) == [5, 5, 5, 5]  # 20 slots over a pool of 4
    assert all(im.size == (40, 30) for r in a.requests for im in r.images)
    assert all(5 <= r.output_len <= 9 for r in a.requests)
    assert len({r.output_len for r in a.requests}) > 1
    systems = {r.messages[0]["content"] for r in a.requests}
    assert len(systems) == 1
    assert len(tokenizer(systems.pop(), add_special_tokens=False)["input_ids"]) == 12
    other = build_workload(WorkloadConfig(num_prompts=10, seed=4), tokenizer)
    assert [r.messages for r in other.requests] != [r.messages for r in a.requests]


def test_workload_reads_images_from_a_folder(tmp_path) -> None:
    Image.new("RGB", (20, 10), (255, 0, 0)).save(tmp_path / "a.png")
    Image.new("RGB", (30, 15), (0, 0, 255)).save(tmp_path / "b.jpg")
    (tmp_path / "notes.txt").write_text("not an image")
    workload = build_workload(WorkloadConfig(num_prompts=4, unique_images=3,
                                             image_dir=str(tmp_path)))
    assert [im.size for im in workload.pool] == [(20, 10), (30, 15), (20, 10)]
    assert workload.num_distinct_images == 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no images"):
        build_workload(WorkloadConfig(image_dir=str(tmp_path / "empty")))


def test_workload_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="output_len"):
        WorkloadConfig(output_len=(9, 3))
    with pytest.raises(ValueError, match="unique_images"):
        WorkloadConfig(unique_images=0)


def test_flop_count_matches_torch_flop_counter(clip_llama: str) -> None:
    """The analytic count against torch's FlopCounterMode on the transformers model, for the
    prefill of one image prompt."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmserve.sampling_params import SamplingParams
    from mmserve.step import ScheduledRequest, SchedulerOutput

    # Eager attention: plain matmuls that the counter sees.
    model = LlavaForConditionalGeneration.from_pretrained(clip_llama, dtype=torch.float32,
                                                          attn_implementation="eager")
    processor = AutoProcessor.from_pretrained(clip_llama)
    inputs = processor(text="USER: <image>\nwhat is this?", images=[Image.new("RGB", (32, 32))],
                       return_tensors="pt")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(**inputs)
    n = inputs["input_ids"].shape[1]
    # transformers runs every vision layer; mmserve (and its count) stops at the feature layer.
    config = copy.deepcopy(model.config)
    config.vision_feature_layer = -1
    flops = ModelFlops.from_hf_config(config)
    image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
    scheduled = SchedulerOutput(chunks=[ScheduledRequest("r", [0] * n, 0, [], [], True,
                                                           SamplingParams(),
                                                           [list(range(n))])],
                                images_to_encode={"h": image_tokens})
    decoder, encoder = flops.step(scheduled)
    # transformers applies the LM head to every row, mmserve only to the sampled one.
    ours = decoder + encoder + (n - 1) * flops.lm_head_per_row
    # Eager attention multiplies the full [n, n] score matrix (the causal half is masked, not
    # skipped); the count is of causal work.
    ours += flops.attention_per_context_token * (n * n - n * (n + 1) // 2)
    # The rotary tables (positions x frequencies) are no model arithmetic the count covers;
    # some transformers versions make them with a matmul the counter sees, others do not.
    rotary = sum(sum(ops.values()) for name, ops in counter.get_flop_counts().items()
                 if name.endswith("rotary_emb"))
    assert ours == counter.get_total_flops() - rotary
    feature_layer_only = ModelFlops.from_hf_config(model.config)
    assert feature_layer_only.encoder(image_tokens) < flops.encoder(image_tokens)


def test_summarize_percentiles() -> None:
    s = summarize([float(v) for v in range(1, 101)])
    assert s["mean"] == 50.5 and s["median"] == 50.5 and s["count"] == 100
    assert s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)
    assert math.isnan(summarize([])["mean"])


def _check_throughput(r: dict, num_prompts: int) -> None:
    assert r["num_requests"] == num_prompts
    assert r["completed"] + r["failed"] == num_prompts and r["failed"] == 0
    assert r["output_tokens"] == r["requested_output_tokens"]  # ignore_eos holds the lengths
    assert r["encoder_items_requested"] == num_prompts
    # Every distinct image is encoded at least once, never more often than it is requested.
    assert r["encoder_items_distinct"] <= r["encoder_items_computed"]
    assert r["encoder_items_computed"] <= r["encoder_items_requested"]
    assert 0.0 <= r["encoder_cache_hit_rate"] <= 1.0
    assert 0.0 <= r["encoder_cache_lookup_hit_rate"] <= 1.0
    assert r["encoder_cache_lookups"] <= r["encoder_items_requested"]
    assert 0.0 <= r["prefix_cache_hit_rate"] <= 1.0
    assert 0 < r["peak_kv_blocks_used"] <= r["kv_blocks_total"]
    assert 0.0 < r["peak_kv_usage"] <= 1.0
    assert 1 <= r["peak_running"] <= num_prompts
    assert r["requests_per_s"] > 0 and r["output_tokens_per_s"] > 0
    assert r["total_tokens_per_s"] > r["output_tokens_per_s"]
    assert all(v >= 0 for v in r["time_s"].values())
    assert sum(r["time_share"].values()) == pytest.approx(1.0, abs=0.02)
    assert 0.0 <= r["full_batch_sched_prep_share"] <= 1.0
    assert r["model_flops"]["decoder"] > 0 and r["model_flops"]["encoder"] > 0
    assert r["ttft_s"]["median"] <= r["e2e_latency_s"]["median"]
    assert r["ttft_s"]["count"] == r["e2e_latency_s"]["count"] == num_prompts
    assert r["minor_page_faults"] is None or r["minor_page_faults"] >= 0


def test_bench_throughput_end_to_end(clip_llama: str, tmp_path, capsys) -> None:
    out, plot = tmp_path / "tp.json", tmp_path / "tp.png"
    rc = bench(["throughput", "--model", clip_llama, *WORKLOAD_FLAGS,
               "--json", str(out), "--plot", str(plot)])
    assert rc == 0
    assert "output tokens/s" in capsys.readouterr().out
    r = json.loads(out.read_text())
    _check_throughput(r, 8)
    # 3 distinct images over 8 requests with a cache that holds them all: each encoded once.
    assert r["encoder_items_computed"] == 3
    assert r["encoder_cache_hit_rate"] == pytest.approx(5 / 8)
    # The 40-token shared system prompt spans two full 16-token blocks.
    assert r["prefix_cache_hit_tokens"] >= 32
    steps = r["steps"]
    assert len(steps) == r["num_steps"]
    assert sum(s["images_encoded"] for s in steps) == r["encoder_items_computed"]
    # Counts add up: every prompt token not served from the prefix cache, plus every output
    # token but the last of each request, was scheduled exactly once (no preemption here).
    assert r["num_preemptions"] == 0
    assert sum(s["scheduled_tokens"] for s in steps) == (
        r["prompt_tokens"] - r["prefix_cache_hit_tokens"] + r["output_tokens"] - 8)
    assert max(s["kv_blocks_used"] for s in steps) == r["peak_kv_blocks_used"]
    assert steps[-1]["running"] == 0 and steps[-1]["kv_blocks_used"] == 0
    assert sum(s["decoder_flops"] for s in steps) == r["model_flops"]["decoder"]
    # The totals are the sums of the engine's per-step records, which the timeline shows.
    assert sum(s["prepare_s"] for s in steps) == pytest.approx(r["time_s"]["prepare"])
    assert sum(s["schedule_s"] for s in steps) == pytest.approx(r["time_s"]["scheduling"])
    assert r["time_s"]["forward"] > 0 and r["time_s"]["encoder"] > 0
    # The device's busy time: spans of the runner's encoder, forward and sampling; on the CPU
    # the wall time they took, which lies inside the runner's timings of those parts.
    assert 0 < r["device_busy_s"] <= r["elapsed_s"]
    assert r["device_busy_share"] == pytest.approx(r["device_busy_s"] / r["elapsed_s"])
    if torch.cuda.is_available():
        assert r["device_busy_from"] == "CUDA events"
    else:
        assert r["device_busy_from"] == "the runner's wall time"
        parts = sum(r["time_s"][k] for k in ("encoder", "forward", "sample"))
        assert 0.5 * parts < r["device_busy_s"] <= parts
    assert r["matmul_peak_flops_per_s"] > 0
    assert 0.0 < r["share_of_matmul_peak"] < 1.0
    assert r["achieved_flops_per_s"] == pytest.approx(
        sum(r["model_flops"].values()) / r["elapsed_s"])
    assert_plot(plot)


def test_bench_throughput_under_the_profiler(clip_llama: str, tmp_path, capsys) -> None:
    out = tmp_path / "profile"
    rc = bench(["throughput", "--model", clip_llama, *WORKLOAD_FLAGS, "--no-peak",
                "--no-async-scheduling", "--profile", str(out), "--profile-steps", "1:4",
                "--json", str(tmp_path / "tp.json")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "output tokens/s" in printed and "torch profiler: steps 1-3 (3 steps" in printed
    assert json.loads((tmp_path / "tp.json").read_text())["profiled_steps"] == [1, 2, 3]
    # Scheduled in step, each of the three steps runs every phase once (images may be
    # encoded in any of them, but the encoder's phase is entered in each).
    calls = {}
    for line in (out / "phases.txt").read_text().splitlines()[2:]:
        name, count = line.split()[:2]
        calls[name] = int(count)
    kernels = {name: n for name, n in calls.items() if name.startswith("cpu.")}
    assert {name: n for name, n in calls.items() if name not in kernels} == dict.fromkeys(
        ["schedule", "encoder", "prepare", "forward", "sample", "update", "outputs"], 3)
    # The CPU's compiled kernels, which torch's profiler does not see, are labelled too.
    assert set(kernels) <= {"cpu.linear", "cpu.decode_attn", "cpu.prefill_attn",
                            "cpu.encoder_attn"}
    if not torch.cuda.is_available() and float32_linear() is PackedLinearF32:
        assert kernels["cpu.linear"] > 0
    assert "aten::" in (out / "operators.txt").read_text()
    with gzip.open(out / "trace.json.gz", "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"mmserve.forward", "mmserve.schedule"} <= names


def test_bench_profile_sees_the_runners_thread(clip_llama: str, tmp_path) -> None:
    # Scheduled ahead, the CPU runner steps on a thread of its own: its phases are recorded.
    out = tmp_path / "profile"
    assert bench(["throughput", "--model", clip_llama, *WORKLOAD_FLAGS, "--no-peak",
                  "--async-scheduling", "--profile", str(out), "--profile-steps", ":4"]) == 0
    phases = {line.split()[0] for line in (out / "phases.txt").read_text().splitlines()[2:]}
    assert {"schedule", "collect", "prepare", "forward", "sample"} <= phases


def test_bench_profile_flags_are_checked(clip_llama: str, capsys) -> None:
    assert bench(["throughput", "--model", clip_llama, "--profile-steps", "1:4"]) == 2
    assert "--profile-steps needs --profile DIR" in capsys.readouterr().err
    for bad in ("4", "5:2", "a:b", "-1:3"):
        with pytest.raises(ValueError, match="--profile-steps"):
            parse_steps(bad)
    assert parse_steps("20:") == (20, None) and parse_steps(":8") == (0, 8)


def test_busy_timer_sums_its_spans_and_counts_one_that_raises() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = BusyTimer(device)
    x = torch.ones(256, 256, device=device)
    start = time.perf_counter()
    with timer.span():
        for _ in range(20):
            x = (x @ x).clamp_(-1, 1)
    with pytest.raises(RuntimeError), timer.span():
        raise RuntimeError("a step that fails")
    busy = timer.total_s()
    assert timer.num_spans == 2
    assert 0 < busy <= time.perf_counter() - start


def test_bench_sweep_encoder_cache_size(clip_llama: str, tmp_path, capsys) -> None:
    out = tmp_path / "sweep.json"
    # One image's worth of cache (16 tokens) against room for all three.
    rc = bench(["sweep", "--model", clip_llama, *WORKLOAD_FLAGS, "--no-peak",
               "--param", "encoder_cache_size=16,64", "--json", str(out),
               "--plot", str(tmp_path / "sweep.png")])
    assert rc == 0
    assert_plot(tmp_path / "sweep.png")
    table = capsys.readouterr().out
    assert "encoder_cache_size" in table and "enc hit rate" in table
    data = json.loads(out.read_text())
    assert data["param"] == "encoder_cache_size" and data["values"] == [16, 64]
    small, large = data["rows"]
    for row in (small, large):
        _check_throughput(row, 8)
    assert (small["value"], large["value"]) == (16, 64)
    assert large["encoder_items_computed"] == 3
    assert small["encoder_items_computed"] >= large["encoder_items_computed"]
    assert small["encoder_cache_hit_rate"] <= large["encoder_cache_hit_rate"]


def test_bench_sweep_rejects_unknown_param(clip_llama: str, capsys) -> None:
    assert bench(["sweep", "--model", clip_llama, "--param", "max_nun_seqs=1,2"]) == 2
    assert "'max_nun_seqs' is not an engine setting a sweep can vary" in capsys.readouterr().err


def test_sweep_params_take_switches_and_choices() -> None:
    assert parse_param("encoder-cache-eviction=queue-aware,lru") == (
        "encoder_cache_eviction", ["queue-aware", "lru"])
    assert parse_param("encoder_cache_borrowing=on,off,true,0") == (
        "encoder_cache_borrowing", [True, False, True, False])
    assert parse_param("encoder_cache_size=auto,392") == ("encoder_cache_size", [None, 392])
    for text, message in [("encoder_cache_eviction=fifo", "'fifo' is not one of queue-aware, lru"),
                          ("encoder_cache_borrowing=maybe", "'maybe' is not true or false"),
                          ("max_num_seqs=many", "'many' is not a number or 'auto'"),
                          ("mm_processor_kwargs=1", "not an engine setting a sweep can vary"),
                          ("model=x", "not an engine setting a sweep can vary")]:
        with pytest.raises(ValueError, match=message):
            parse_param(text)


def test_sweep_turns_alternate_and_report_the_median_turn() -> None:
    calls, rates = [], iter([3.0, 10.0, 1.0, 20.0, 2.0, 30.0])

    class Run:
        def __init__(self, value) -> None:
            self.results = {"output_tokens_per_s": next(rates), "value_seen": value}

    def run_one(overrides):
        calls.append(overrides["encoder_cache_eviction"])
        return Run(overrides["encoder_cache_eviction"])

    rows = run_sweep("encoder_cache_eviction", ["queue-aware", "lru"], run_one, repeats=3)
    assert calls == ["queue-aware", "lru"] * 3  # turns over all the values, in order
    assert [r["turns_output_tokens_per_s"] for r in rows] == [[3.0, 1.0, 2.0],
                                                             [10.0, 20.0, 30.0]]
    assert [r["output_tokens_per_s"] for r in rows] == [2.0, 20.0]  # each value's median turn
    assert [r["value_seen"] for r in rows] == ["queue-aware", "lru"]
    with pytest.raises(ValueError, match="repeats"):
        run_sweep("x", [1], run_one, repeats=0)


def test_bench_sweep_over_the_eviction_order(clip_llama: str, tmp_path, capsys) -> None:
    out = tmp_path / "sweep.json"
    rc = bench(["sweep", "--model", clip_llama, *WORKLOAD_FLAGS, "--no-peak",
                "--no-encoder-cache-borrowing", "--encoder-cache-size", "32",
                "--param", "encoder_cache_eviction=queue-aware,lru", "--repeats", "2",
                "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "median of 2 turns" in table and "lru: " in table
    rows = json.loads(out.read_text())["rows"]
    assert [r["value"] for r in rows] == ["queue-aware", "lru"]
    for row in rows:
        _check_throughput(row, 8)
        assert len(row["turns_output_tokens_per_s"]) == 2
        assert row["peak_encoder_cache_borrowed_tokens"] == 0  # borrowing off, as asked


def test_serve_client_counts_failures(tokenizer) -> None:
    """Nothing listens on the port: every request fails, is counted, and nothing raises."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workload = build_workload(WorkloadConfig(num_prompts=3, image_sizes=((40, 30),)), tokenizer)
    results, duration = asyncio.run(run_load(f"http://127.0.0.1:{port}", "m", workload,
                                             use_tqdm=False, timeout_s=5))
    summary = serve_results(results, duration)
    assert summary["completed"] == 0 and summary["failed"] == 3
    assert sum(summary["errors"].values()) == 3


@pytest.mark.slow
def test_bench_serve_against_real_server(clip_llama: str, tmp_path, capsys) -> None:
    """The whole load against a server started here, its engine in a process of its own."""
    pytest.importorskip("mmserve.entrypoints.api_server")
    out, plot = tmp_path / "serve.json", tmp_path / "cdf.png"
    rc = bench(["serve", "--model", clip_llama, *WORKLOAD_FLAGS, "--engine-process",
               "--max-concurrency", "4", "--json", str(out), "--plot", str(plot)])
    r = json.loads(out.read_text())
    assert rc == 0, r["errors"]
    assert r["completed"] == 8 and r["failed"] == 0
    workload = build_workload(WorkloadConfig(
        num_prompts=8, unique_images=3, image_sizes=((40, 30),), output_len=(3, 9),
        shared_prefix_len=40, prompt_len=6), None)
    assert r["output_tokens"] == workload.num_output_tokens
    assert r["prompt_tokens"] > 8 * 16  # each prompt holds an image's 16 tokens
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = r[key]
        assert 0 < s["median"] <= s["p90"] <= s["p99"], (key, s)
    assert r["ttft_ms"]["median"] <= r["e2e_ms"]["median"]
    assert r["requests_per_s"] > 0 and r["output_tokens_per_s"] > 0
    assert "TTFT" in capsys.readouterr().out
    assert_plot(plot)  # TTFT and ITL CDFs
