"""The memory plan: sizing arithmetic (no model), the profile run, and engine starts.

Pure-function tests cover every auto-sizing branch and every infeasible error. Engine tests
pin the machine's memory (``device_memory``) so that budgets are exact and repeatable.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig

from mmserve import LLM, SamplingParams
from mmserve.config import EngineConfig
from mmserve.engine.memory_plan import (
    DEFAULT_MAX_NUM_SEQS,
    GPU_MEMORY_UTILIZATION_ENV,
    InfeasiblePlanError,
    PlanInputs,
    default_memory_utilization,
    feasible_pairs,
    plan_memory,
    resolve_limits,
)
from mmserve.engine.profile_batch import profile_batch
from mmserve.entrypoints.plan import make_plan
from mmserve.kernels import cpu_ops
from mmserve.worker import memory_profiler
from mmserve.worker.dry_run import (
    INPUT_BYTES_PER_TOKEN,
    dry_run_peak,
    meta_model,
    profile_blocks,
)
from mmserve.worker.memory_profiler import track_peak_bytes
from mmserve.worker.model_runner import CPUModelRunner
from tests.conftest import assert_no_leaks, make_image

BS = 16
BPT = 1000  # KV bytes per token in the pure tests


def limits(num_blocks: int, max_model_len: int | None = None, max_num_seqs: int | None = None,
           model_max_len: int = 4096, **kw):
    return resolve_limits(num_blocks, BS, model_max_len, max_model_len, max_num_seqs, BPT, **kw)


# ----------------------------------------------------------------- auto-sizing branches
def test_neither_given_uses_longest_that_fits_and_default_seqs() -> None:
    lim = limits(100)  # 1600 tokens < model limit
    assert (lim.max_model_len, lim.max_model_len_source) == (1600, "auto")
    assert (lim.max_num_seqs, lim.max_num_seqs_source) == (100, "auto")  # capped at blocks
    lim = limits(10_000)  # more than the model can use
    assert lim.max_model_len == 4096
    assert lim.max_num_seqs == DEFAULT_MAX_NUM_SEQS


def test_max_num_seqs_given_gives_longest_length_for_all_of_them() -> None:
    lim = limits(100, max_num_seqs=3)
    assert (lim.max_model_len, lim.max_model_len_source) == (33 * BS, "auto")
    assert 3 * math.ceil(lim.max_model_len / BS) <= 100 < 3 * (lim.max_model_len // BS + 1)
    assert (lim.max_num_seqs, lim.max_num_seqs_source) == (3, "given")
    assert limits(10_000, max_num_seqs=2).max_model_len == 4096  # capped at the model limit


def test_max_model_len_given_gives_how_many_fit() -> None:
    lim = limits(100, max_model_len=250)  # 16 blocks each
    assert (lim.max_num_seqs, lim.max_num_seqs_source) == (6, "auto")
    assert (lim.max_model_len, lim.max_model_len_source) == (250, "given")
    assert limits(100_000, max_model_len=16).max_num_seqs == DEFAULT_MAX_NUM_SEQS


def test_both_given_are_kept() -> None:
    lim = limits(100, max_model_len=800, max_num_seqs=7)
    assert (lim.max_model_len, lim.max_num_seqs) == (800, 7)
    assert (lim.max_model_len_source, lim.max_num_seqs_source) == ("given", "given")


def test_single_user_mode_gives_everything_to_one_sequence() -> None:
    lim = limits(100, single_user_mode=True)
    assert (lim.max_num_seqs, lim.max_num_seqs_source) == (1, "single_user_mode")
    assert lim.max_model_len == 1600
    with pytest.raises(InfeasiblePlanError, match="single_user_mode"):
        limits(100, max_num_seqs=4, single_user_mode=True)
    with pytest.raises(ValueError, match="single_user_mode"):
        EngineConfig("m", single_user_mode=True, max_num_seqs=2)


# ----------------------------------------------------------------- infeasible settings
def test_given_length_that_does_not_fit_names_the_numbers() -> None:
    with pytest.raises(InfeasiblePlanError) as err:
        limits(10, max_model_len=1000)
    msg = str(err.value)
    for figure in ("max_model_len=1000", "10 blocks", "160 tokens", "160000 bytes",
                   f"{BPT} bytes per token", "at most 160"):
        assert figure in msg, msg


def test_length_over_the_model_limit_is_an_error() -> None:
    with pytest.raises(InfeasiblePlanError, match="model's limit of 4096"):
        limits(10_000, max_model_len=5000)


def test_more_sequences_than_blocks_is_an_error() -> None:
    with pytest.raises(InfeasiblePlanError, match="Lower max_num_seqs to at most 5"):
        limits(5, max_num_seqs=6)


def test_auto_length_too_short_for_one_image_is_an_error() -> None:
    with pytest.raises(InfeasiblePlanError, match="less than the 577 tokens of one image"):
        limits(30, min_model_len=577)
    assert limits(37, min_model_len=577).max_model_len == 592


def plan_in(**overrides) -> PlanInputs:
    base = dict(device="cuda", memory_bytes=10_000_000, gpu_memory_utilization=0.9,
                weights_bytes=2_000_000, activation_bytes=1_000_000, activation_method="test",
                encoder_cache_items=2, encoder_cache_tokens=200, encoder_bytes_per_token=500,
                kv_bytes_per_token=BPT, block_size=BS, model_max_len=4096, max_model_len=None,
                max_num_seqs=None)
    return PlanInputs(**{**base, **overrides})


def test_budget_terms_add_up_to_the_kv_cache() -> None:
    plan = plan_memory(plan_in())
    assert plan.budget_bytes == 9_000_000
    assert plan.encoder_cache_bytes == 100_000
    kv = 9_000_000 - 2_000_000 - 1_000_000 - 100_000
    assert plan.kv_budget_blocks == plan.num_blocks == kv // (BS * BPT)
    assert plan.kv_cache_bytes == plan.num_blocks * BS * BPT <= kv
    assert plan.kv_cache_limited_by == "memory"
    assert plan.max_model_len == min(4096, plan.num_blocks * BS)
    d = plan.to_dict()
    assert d["kv_cache_tokens"] == plan.num_blocks * BS
    assert d["max_concurrency"] == round(plan.max_concurrency, 2)
    text = plan.summary()
    for figure in (f"{plan.num_blocks} blocks", "max_model_len=", "(auto", "encoder cache"):
        assert figure in text


def test_weights_over_the_budget_is_an_error() -> None:
    with pytest.raises(InfeasiblePlanError) as err:
        plan_memory(plan_in(weights_bytes=9_500_000))
    assert "9500000 bytes" in str(err.value) and "9000000" in str(err.value)
    assert "--gpu-memory-utilization" in str(err.value)


def test_no_room_for_one_block_lists_every_term() -> None:
    with pytest.raises(InfeasiblePlanError) as err:
        plan_memory(plan_in(activation_bytes=6_890_000))
    msg = str(err.value)
    for figure in ("9000000", "2000000", "6890000", "100000", "10000 bytes",
                   "16000 bytes", "--max-num-batched-tokens", "--kv-cache-memory"):
        assert figure in msg, msg


def test_kv_cache_memory_sets_the_blocks_directly() -> None:
    plan = plan_memory(plan_in(kv_cache_memory=50 * BS * BPT + 7, device="cpu"))
    assert plan.num_blocks == plan.kv_budget_blocks == 50
    assert plan.kv_cache_limited_by == "kv_cache_memory"
    assert not plan.warnings
    with pytest.raises(InfeasiblePlanError, match="smaller than one KV block"):
        plan_memory(plan_in(kv_cache_memory=BS * BPT - 1))
    over = plan_memory(plan_in(kv_cache_memory=8_000_000))
    assert any("exceed the budget" in w for w in over.warnings)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_block_count_does_not_depend_on_max_model_len(device: str) -> None:
    counts = {plan_memory(plan_in(device=device, max_model_len=n)).num_blocks
              for n in (64, 100, 256, 1000)}
    assert len(counts) == 1
    assert counts == {plan_memory(plan_in(device=device)).kv_budget_blocks}


def test_cpu_allocates_only_what_max_num_seqs_can_use() -> None:
    # 1 GB of budget; 4 sequences of 256 tokens use 64 blocks of the ~55000 it allows.
    plan = plan_memory(plan_in(device="cpu", memory_bytes=10**9, max_num_seqs=4,
                               max_model_len=256))
    assert plan.num_blocks == 4 * 16
    assert plan.kv_budget_blocks > 100 * plan.num_blocks
    assert plan.kv_cache_limited_by == "max_num_seqs x max_model_len"
    # The same settings on a GPU use the whole budget.
    gpu = plan_memory(plan_in(memory_bytes=10**9, max_num_seqs=4, max_model_len=256))
    assert gpu.num_blocks == gpu.kv_budget_blocks == plan.kv_budget_blocks


def test_single_user_mode_bounds_the_cache_on_any_device() -> None:
    plan = plan_memory(plan_in(memory_bytes=10**9, single_user_mode=True))
    assert (plan.max_num_seqs, plan.max_model_len) == (1, 4096)
    assert plan.num_blocks == 4096 // BS


def test_warns_when_given_sequences_cannot_all_fit() -> None:
    plan = plan_memory(plan_in(max_model_len=4096, max_num_seqs=8))
    assert any("fit in the KV cache at once" in w for w in plan.warnings)


def test_feasible_pairs_fit_and_are_the_most_that_fit() -> None:
    plan = plan_memory(plan_in(memory_bytes=50_000_000))
    pairs = feasible_pairs(plan)
    assert pairs[0][0] == min(4096, plan.kv_budget_blocks * BS)
    assert pairs[-1][0] == 256
    for length, seqs in pairs:
        need = math.ceil(length / BS)
        assert seqs * need <= plan.kv_budget_blocks < (seqs + 1) * need


def test_default_share_of_the_gpu_may_come_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(GPU_MEMORY_UTILIZATION_ENV, raising=False)
    assert default_memory_utilization("cuda") == 0.9
    assert default_memory_utilization("cpu") == 0.8
    monkeypatch.setenv(GPU_MEMORY_UTILIZATION_ENV, "0.25")
    assert default_memory_utilization("cuda") == 0.25
    assert default_memory_utilization("cpu") == 0.8  # the CPU's share is of the RAM available
    for bad in ("most", "0", "1.5", "nan"):
        monkeypatch.setenv(GPU_MEMORY_UTILIZATION_ENV, bad)
        with pytest.raises(ValueError, match=f"{GPU_MEMORY_UTILIZATION_ENV}='{bad}'"):
            default_memory_utilization("cuda")


def test_config_accepts_auto_and_rejects_bad_values() -> None:
    cfg = EngineConfig("m", max_model_len="auto", max_num_seqs="auto")
    assert cfg.max_model_len is None and cfg.max_num_seqs is None
    for bad in (dict(max_model_len="long"), dict(max_num_seqs=1.5),
                dict(gpu_memory_utilization=0.0), dict(gpu_memory_utilization=1.2)):
        with pytest.raises(ValueError):
            EngineConfig("m", **bad)


# ----------------------------------------------------------------- the profile run
def test_tracker_counts_new_tensors_not_views_or_inputs() -> None:
    x = torch.ones(1000)

    def work() -> torch.Tensor:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(2000)  # 8000 B: peak 12000
        del a
        c = torch.empty(500)  # 2000 B
        x.add_(1)  # in place on an input: no allocation
        return b.view(20, 100) + c[:100]  # 8000 B more while b and c live: peak 18000

    out, peak = track_peak_bytes(work)
    assert peak == 18000
    assert out.shape == (20, 100)


def test_tracker_takes_tensors_without_a_storage() -> None:
    """oneDNN's packed weights (``OpaqueTensorImpl``: no storage to read) as operator inputs
    and outputs: nothing to follow, and no error."""
    if not cpu_ops.onednn_linear_supported():
        pytest.skip("this torch build has no oneDNN")
    layer = cpu_ops.OneDNNLinear(torch.nn.Linear(64, 32))
    x = torch.ones(4, 64)
    out, peak = track_peak_bytes(lambda: (layer(x), torch.ones(8, 8).to_mkldnn()))
    assert out[0].shape == (4, 32) and out[1].is_mkldnn
    assert peak == 4 * 32 * 4 + 8 * 8 * 4  # the linear's output and the dense ones() input


@pytest.mark.parametrize(("tokens", "seqs", "max_positions"), [(2048, 256, 4096),
                                                                 (100, 1, 64), (8, 20, 64)])
def test_profile_batch_is_the_worst_step(tokens: int, seqs: int, max_positions: int) -> None:
    profile = profile_batch(tokens, seqs, max_positions, BS, num_images=3, tokens_per_image=24,
                            encoder_input={"pixel_values": torch.zeros(1, 3, 8, 8)})
    batch = profile.scheduler_output
    assert batch.num_scheduled_tokens == tokens
    assert all(r.sample and r.start_pos == 0 for r in batch.requests)
    assert all(len(r.token_ids) <= max_positions for r in batch.requests)
    decodes = min(seqs, tokens) - 1
    chunks = math.ceil((tokens - decodes) / max_positions)  # the prompt, split at the limit
    assert len(batch.requests) == decodes + chunks
    blocks = [b for r in batch.requests for b in r.block_ids]
    assert len(blocks) == len(set(blocks))
    assert all(len(r.block_ids) * BS >= len(r.token_ids) for r in batch.requests)
    assert batch.images_to_encode == {h: 24 for h in profile.encoder_pixels}
    assert len(batch.images_to_encode) == 3
    assert all(p["pixel_values"].shape == (1, 3, 8, 8) for p in profile.encoder_pixels.values())
    first = batch.requests[0]
    for sl in first.image_slices:
        assert sl.dst_start + sl.length <= len(first.token_ids)
    placed = sum(sl.length for sl in first.image_slices)
    assert placed == min(3 * 24, len(first.token_ids))


def allocator_peak(fn) -> int:
    """Peak bytes from the CPU allocator's own events, as recorded by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return peak


@pytest.fixture(params=["threads as they are", "16 threads"])
def cpu_thread_count(request):
    """The machine's thread count, then 16 as on a many-core host: torch's fused attention
    keeps scratch for every thread, which the plan must count."""
    threads = torch.get_num_threads()
    if request.param == "16 threads":
        torch.set_num_threads(16)
    yield torch.get_num_threads()
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel_path", cpu_ops.supported_paths())
def test_profile_run_on_the_cpu_matches_the_dry_run_and_leaves_nothing(
        clip_llama, kernel_path: str, cpu_thread_count: int) -> None:
    """On every CPU kernel path: their packed weights (oneDNN's have no storage to follow)
    are counted as weights, never as the step's activations."""
    hf_config = AutoConfig.from_pretrained(clip_llama, local_files_only=True)
    dtype = torch.float32
    with cpu_ops.using_path(kernel_path):
        _profile_run_matches_the_dry_run_and_leaves_nothing(clip_llama, hf_config, dtype)


def _profile_run_matches_the_dry_run_and_leaves_nothing(clip_llama, hf_config, dtype) -> None:
    model, _ = CPUModelRunner.load_model(clip_llama, hf_config, dtype)
    size = hf_config.vision_config.image_size
    tpi = 16
    profile = profile_batch(num_tokens=64, max_num_seqs=4, max_positions=2048, block_size=BS,
                            num_images=3, tokens_per_image=tpi,
                            encoder_input={"pixel_values": torch.zeros(1, 3, size, size)})
    batch, pixels = profile.scheduler_output, profile.encoder_pixels
    runner = CPUModelRunner(model, profile_blocks(batch), BS, dtype, seed=0)
    rng = torch.get_rng_state()
    gen = runner.default_generator.get_state()
    state = dict(vars(runner))
    peak = runner.measure_profile_peak(batch, pixels)

    # The engine's CPU figure is the dry run: never below what the allocator really peaks at
    # for the same step, and above it by at most the index-tensor margin and the images'
    # pixels (the dry run makes its own meta copies; the real run was handed them).
    dry = dry_run_peak(meta_model(hf_config, dtype), batch, pixels, BS, dtype,
                       torch.get_num_threads())
    pixel_bytes = sum(t.numel() * t.element_size() for item in pixels.values()
                      for t in item.values() if isinstance(t, torch.Tensor))
    margin = INPUT_BYTES_PER_TOKEN * batch.num_scheduled_tokens + pixel_bytes
    real = allocator_peak(lambda: runner.profile_run(batch, pixels))
    assert peak <= real <= dry <= real + margin
    text = hf_config.text_config
    logits = 4 * text.vocab_size * 4  # 3 decodes + the prompt chunk sample a row each
    encoder_outputs = 3 * tpi * text.hidden_size * 4
    assert peak >= logits + encoder_outputs
    assert runner.encoder_outputs == {} and runner.generators == {}
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(runner.default_generator.get_state(), gen)
    # No attribute of the runner was added or replaced (it keeps no step timings: a step
    # returns them in its ModelOutput).
    assert vars(runner).keys() == state.keys()
    assert all(vars(runner)[k] is v for k, v in state.items())


# ----------------------------------------------------------------- engine starts
@pytest.fixture
def pinned_memory(monkeypatch: pytest.MonkeyPatch):
    """Make the machine report a chosen amount of memory to both the engine and the planner."""

    def pin(num_bytes: int) -> None:
        monkeypatch.setattr(memory_profiler, "device_memory", lambda device: num_bytes)

    return pin


def memory_for_blocks(path: str, num_blocks: int, **engine_args) -> int:
    """Device memory that leaves room for ``num_blocks`` KV blocks after everything else, by
    the figures an engine measures on the default device (on the CPU the dry run's, which
    ``mmserve plan`` shows; on a GPU the allocator's, which it can only estimate): a probe
    engine with a small KV cache measures them, and gives its memory back for the next."""
    config = EngineConfig(path, **engine_args)
    estimate, _ = make_plan(config, config.resolved_device, memory_bytes=10**12)
    block_bytes = estimate.block_size * estimate.kv_bytes_per_token
    with LLM(path, kv_cache_memory=64 * block_bytes, **engine_args) as probe:
        plan = probe.memory_plan()
    others = plan.weights_bytes + plan.activation_bytes + plan.encoder_cache_bytes
    return math.ceil((others + num_blocks * block_bytes + block_bytes // 2)
                     / plan.gpu_memory_utilization)


def test_small_memory_shrinks_max_model_len_and_that_length_completes(
        clip_llama, pinned_memory) -> None:
    pinned_memory(memory_for_blocks(clip_llama, 12, dtype="float32"))
    llm = LLM(clip_llama, dtype="float32")
    plan = llm.memory_plan()
    model_limit = AutoConfig.from_pretrained(clip_llama).text_config.max_position_embeddings
    assert plan.num_blocks == 12
    assert plan.max_model_len == 12 * BS < model_limit
    assert plan.max_model_len_source == "auto"
    assert llm.engine.config.max_model_len == plan.max_model_len

    image_token = llm.engine.processor.image_token
    prompt = {"prompt": f"USER: {image_token}\nDescribe the picture.\nASSISTANT:",
              "images": [make_image(1, (32, 32))]}
    num_prompt = len(llm.engine.processor.process(prompt).token_ids)
    params = SamplingParams(max_tokens=plan.max_model_len - num_prompt, temperature=0.0,
                            ignore_eos=True)
    (out,) = llm.generate(prompt, params)
    assert out.finished and out.finish_reason == "length"
    assert out.num_prompt_tokens + len(out.token_ids) == plan.max_model_len
    assert_no_leaks(llm.engine)


def test_changing_max_model_len_keeps_the_block_count(clip_llama, pinned_memory) -> None:
    pinned_memory(memory_for_blocks(clip_llama, 100, dtype="float32"))
    plans = [LLM(clip_llama, dtype="float32", max_model_len=n).memory_plan()
             for n in (200, 512)]
    assert [p.max_model_len for p in plans] == [200, 512]
    assert plans[0].num_blocks == plans[1].num_blocks == 100
    assert plans[0].max_num_seqs == 100 // 13 and plans[1].max_num_seqs == 100 // 32


def test_engine_start_fails_before_serving_when_nothing_fits(clip_llama, pinned_memory) -> None:
    pinned_memory(memory_for_blocks(clip_llama, 0, dtype="float32"))
    with pytest.raises(InfeasiblePlanError, match="no room for the KV cache"):
        LLM(clip_llama, dtype="float32")


def test_single_user_mode_engine(clip_llama) -> None:
    torch.manual_seed(5)
    seeded = torch.get_rng_state()
    llm = LLM(clip_llama, dtype="float32", single_user_mode=True, max_num_batched_tokens=256,
              seed=5)
    # Planning (meta model, dry run) draws no random numbers: the seed's stream is untouched.
    assert torch.equal(torch.get_rng_state(), seeded)
    plan = llm.memory_plan()
    assert (plan.max_num_seqs, plan.max_num_seqs_source) == (1, "single_user_mode")
    assert plan.max_model_len == plan.model_max_len
    assert plan.num_blocks == plan.model_max_len // BS
    assert llm.engine.scheduler.max_num_seqs == 1
