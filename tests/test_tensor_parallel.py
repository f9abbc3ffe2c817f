"""Tensor parallelism on the CPU (gloo, two worker processes): the same tokens as one process,
each rank loading only its shards, a per-rank memory plan, and workers that never outlive the
engine or hang it.

Two ranks on a 2-core machine are a correctness path, not a speed-up: the workers share the
cores and every layer adds two all-reduces.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import re
import signal
import time
import traceback

import pytest
import torch
from transformers import AutoConfig

from mmserve import LLM, SamplingParams
from mmserve.config import EngineConfig
from mmserve.engine import llm_engine
from mmserve.engine.memory_plan import InfeasiblePlanError
from mmserve.engine.startup import plan_for
from mmserve.errors import EngineDeadError
from mmserve.models import loader, parallel
from mmserve.processing.processor import InputProcessor
from mmserve.step import DecodeRows, ScheduledRequest, SchedulerOutput
from mmserve.testing import build_tiny_checkpoint
from mmserve.worker.dry_run import check_tensor_parallel, meta_model
from mmserve.worker.executor import MultiprocExecutor, ParamsMemo, exit_status
from mmserve.worker.memory_profiler import tensor_bytes
from mmserve.worker.model_runner import split_by_tokens
from tests.conftest import assert_no_leaks
from tests.test_parity import mixed_batch, shared_batch

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)

# Checkpoints beside conftest's: KV heads fewer than ranks (replicated), and a vocabulary that
# does not split evenly (the last rank's share padded).
FAMILIES = {
    "clip-llama": ("llava", {"vision": "clip", "text": "llama"}),
    "siglip-qwen2-one-kv-head": ("llava", {"vision": "siglip", "text": "qwen2",
                                           "text_kv_heads": 1, "vocab_size": 509}),
    "qwen2-vl": ("qwen2_vl", {}),
    "qwen2.5-vl": ("qwen2_5_vl", {}),
}


@pytest.fixture(scope="module")
def tp_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-checkpoints")
    return {name: str(build_tiny_checkpoint(family, root / name, **options))
            for name, (family, options) in FAMILIES.items()}


@pytest.fixture(autouse=True)
def no_worker_left():
    """Every test ends with no worker process of this one alive."""
    yield
    deadline = time.monotonic() + 15
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert multiprocessing.active_children() == []


# ------------------------------------------------------------------ shards, in one process
class _CountingSlice:
    """A safetensors slice that counts the elements read through it."""

    def __init__(self, inner, counts: dict[str, int], key: str) -> None:
        self.inner, self.counts, self.key = inner, counts, key

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        tensor = self.inner[index]
        self.counts[self.key] = self.counts.get(self.key, 0) + tensor.numel()
        return tensor


_READ_WEIGHTS = loader._safetensors_weights


def _load_as(path: str, rank: int, size: int, monkeypatch) -> tuple[torch.nn.Module,
                                                                     dict[str, int]]:
    counts: dict[str, int] = {}

    def counting(files):
        for key, tensor in _READ_WEIGHTS(files):
            yield key, _CountingSlice(tensor, counts, key)

    monkeypatch.setattr(loader, "_safetensors_weights", counting)
    with parallel.tensor_parallel(rank, size):
        model = loader.load_model(path, AutoConfig.from_pretrained(path), torch.float32)
    return model, counts


def test_each_rank_reads_only_its_shards(tp_checkpoints: dict[str, str], monkeypatch) -> None:
    """Two ranks' shards put back together are the checkpoint; together they read each split
    tensor's elements once (the vision tower, held whole by both, twice)."""
    path = tp_checkpoints["siglip-qwen2-one-kv-head"]
    full, full_counts = _load_as(path, 0, 1, monkeypatch)
    (r0, c0), (r1, c1) = (_load_as(path, rank, 2, monkeypatch) for rank in (0, 1))
    p = dict(full.named_parameters())
    p0, p1 = dict(r0.named_parameters()), dict(r1.named_parameters())
    layer = "model.language_model.layers.0."
    # 4 query heads of 16: two per rank; one KV head, replicated on both.
    q, k, v = p[layer + "self_attn.qkv_proj.weight"].split([64, 16, 16])
    for rank, shard in enumerate((p0, p1)):
        assert torch.equal(shard[layer + "self_attn.qkv_proj.weight"],
                           torch.cat([q[32 * rank:32 * (rank + 1)], k, v]))
    # Row-parallel: input columns split; the bias (Qwen2 has none on o_proj) n/a here.
    assert torch.equal(torch.cat([p0[layer + "self_attn.o_proj.weight"],
                                  p1[layer + "self_attn.o_proj.weight"]], dim=1),
                       p[layer + "self_attn.o_proj.weight"])
    gate, up = p[layer + "mlp.gate_up_proj.weight"].split(128)
    assert torch.equal(p1[layer + "mlp.gate_up_proj.weight"], torch.cat([gate[64:], up[64:]]))
    assert torch.equal(torch.cat([p0[layer + "mlp.down_proj.weight"],
                                  p1[layer + "mlp.down_proj.weight"]], dim=1),
                       p[layer + "mlp.down_proj.weight"])
    # 509 tokens: 255 rows each, the second rank's last row padding (zeros).
    embed = "model.language_model.embed_tokens.weight"
    assert p0[embed].shape[0] == p1[embed].shape[0] == 255
    assert torch.equal(torch.cat([p0[embed], p1[embed]])[:509], p[embed])
    assert not p1[embed][-1].any()
    assert torch.equal(torch.cat([p0["lm_head.weight"], p1["lm_head.weight"]])[:509],
                       p["lm_head.weight"])
    tower = "model.vision_tower.embeddings.patch_embedding.weight"
    assert torch.equal(p0[tower], p[tower]) and torch.equal(p1[tower], p[tower])
    for key, elements in full_counts.items():
        together = c0[key] + c1[key]
        if "vision" in key or "projector" in key or "norm" in key or "k_proj" in key \
                or "v_proj" in key:
            assert together == 2 * elements, key  # held whole (or replicated) by both
        else:
            assert together == elements, key  # each element read by one rank
    assert sum(c0.values()) < sum(full_counts.values())


def test_a_split_vision_tower_reads_its_heads_of_stacked_qkv(
        tp_checkpoints: dict[str, str], monkeypatch) -> None:
    """Qwen2-VL's vision attention keeps q, k and v in one tensor: a rank of a split tower
    holds its heads' rows of each; data-parallel, every rank holds all of it."""
    path = tp_checkpoints["qwen2.5-vl"]
    full, _ = _load_as(path, 0, 1, monkeypatch)
    qkv = dict(full.named_parameters())["model.visual.blocks.0.attn.qkv.weight"]
    q, k, v = qkv.chunk(3)
    half = q.shape[0] // 2
    for rank in (0, 1):
        with parallel.tensor_parallel(rank, 2, split_encoder=True):
            model = loader.load_model(path, AutoConfig.from_pretrained(path), torch.float32)
        held = dict(model.named_parameters())["model.visual.blocks.0.attn.qkv.weight"]
        rows = slice(half * rank, half * (rank + 1))
        assert torch.equal(held, torch.cat([q[rows], k[rows], v[rows]]))
    whole, _ = _load_as(path, 1, 2, monkeypatch)
    assert torch.equal(dict(whole.named_parameters())["model.visual.blocks.0.attn.qkv.weight"],
                       qkv)


def test_row_parallel_bias_counts_on_rank_zero_only(tp_checkpoints: dict[str, str],
                                                   monkeypatch) -> None:
    """Qwen2's q/k/v biases split with their rows; a row-parallel bias (Llama with
    attention_bias) is whole on rank 0 and zero on the others, so the all-reduce adds it
    once."""
    path = tp_checkpoints["clip-llama"]
    config = AutoConfig.from_pretrained(path)
    config.text_config.attention_bias = True
    with parallel.tensor_parallel(1, 2), torch.device("meta"):
        model = loader.get_model_class(config)(config)
    windows = loader._windows(model)
    assert windows["model.language_model.layers.0.self_attn.o_proj.bias"].rank0_only
    assert windows["model.language_model.layers.0.self_attn.o_proj.weight"] == \
        parallel.Window(1, 32, 32)
    target = torch.full((4,), 7.0)
    with parallel.tensor_parallel(1, 2):
        loader._fill("b", target, torch.ones(4), parallel.Window(rank0_only=True))
    assert not target.any()
    with parallel.tensor_parallel(0, 2):
        loader._fill("b", target, torch.ones(4), parallel.Window(rank0_only=True))
    assert torch.equal(target, torch.ones(4))


def test_a_model_that_does_not_split_says_why(clip_llama: str) -> None:
    config = AutoConfig.from_pretrained(clip_llama)  # 4 heads, 2 KV heads, MLP 128
    check_tensor_parallel(config, torch.float32, 4)  # KV heads split 2 ways, replicated
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the model's "
                                         r"4 attention heads"):
        check_tensor_parallel(config, torch.float32, 3)


def test_images_split_between_ranks_by_tokens() -> None:
    tokens = {"a": 100, "b": 60, "c": 50, "d": 10}
    owner = split_by_tokens(list(tokens), tokens, 2)
    assert owner == {"a": 0, "b": 1, "c": 1, "d": 0}  # 110 against 110
    assert split_by_tokens(["d", "c", "b", "a"], tokens, 2) == owner  # order-independent
    assert set(split_by_tokens(list(tokens), tokens, 8).values()) == {0, 1, 2, 3}


def _chunk(rid: str, params: SamplingParams) -> ScheduledRequest:
    return ScheduledRequest(request_id=rid, token_ids=[1, 2, 3], start_pos=0, block_ids=[0],
                            image_slices=[], sample=True, sampling_params=params,
                            positions=[[0, 1, 2]])


def _decodes(rows: dict[str, SamplingParams]) -> DecodeRows:
    decodes = DecodeRows()
    for i, (rid, params) in enumerate(rows.items()):
        decodes.append(rid, 7, 10 + i, 10 + i, params, 0)
    return decodes


def test_sampling_params_cross_to_the_workers_once() -> None:
    """A step pickled for the workers carries each request's params in its first step only,
    and the worker's side reads back every row's params as the engine sent them."""
    a, b, c = (SamplingParams(max_tokens=8, seed=i, logit_bias={i: 1.0}) for i in range(3))
    b_again = SamplingParams(max_tokens=4, temperature=0.0)  # id "b" reused after it ended
    steps = [
        SchedulerOutput(chunks=[_chunk("a", a), _chunk("b", b)]),
        SchedulerOutput(decodes=_decodes({"a": a, "b": b}), chunks=[_chunk("c", c)]),
        SchedulerOutput(decodes=_decodes({"a": a, "b": b, "c": c})),
        # "b" ended; an id of its reused by a new request, in the step that drops it.
        SchedulerOutput(decodes=_decodes({"a": a, "c": c}), chunks=[_chunk("b", b_again)],
                        finished_request_ids=["b"]),
        # "a" preempted and run again from its prompt: its params are known still.
        SchedulerOutput(decodes=_decodes({"b": b_again, "c": c}), chunks=[_chunk("a", a)]),
    ]
    sent_params = [["a", "b"], ["c"], [], ["b"], []]
    engine, worker = ParamsMemo(), ParamsMemo()
    for step, expected in zip(steps, sent_params, strict=True):
        before = step.decodes.sampling_params + [r.sampling_params for r in step.chunks]
        stripped = engine.strip(step)
        carried = [rid for rid, p in zip(stripped.request_ids(),
                                         stripped.decodes.sampling_params
                                         + [r.sampling_params for r in stripped.chunks],
                                         strict=True)
                   if p is not None]
        assert carried == expected
        # The engine's step is left whole (it reads the params after the step).
        assert step.decodes.sampling_params + [r.sampling_params for r in step.chunks] == before
        filled = worker.fill(pickle.loads(pickle.dumps(stripped)))
        assert filled.request_ids() == step.request_ids()
        assert (filled.decodes.sampling_params + [r.sampling_params for r in filled.chunks]
                == before)
        assert engine.known.keys() == worker.known.keys()
    assert worker.known["b"] == b_again
    # Ended requests are forgotten on both sides.
    last = engine.strip(SchedulerOutput(finished_request_ids=["a", "b", "c"]))
    worker.fill(pickle.loads(pickle.dumps(last)))
    assert engine.known == {} and worker.known == {}


def test_memory_plan_is_per_rank(clip_llama: str) -> None:
    """Each rank's plan: its weights (the vision tower whole), half the KV heads, half the
    CPU's RAM."""
    hf_config = AutoConfig.from_pretrained(clip_llama)

    def plan(ranks: int):
        config = EngineConfig(clip_llama, device="cpu", dtype="float32",
                              tensor_parallel_size=ranks, max_num_seqs=4)
        family = InputProcessor(clip_llama, hf_config, config.max_image_pixels).family
        return plan_for(config, hf_config, family, "cpu", 8 << 30).plan

    one, two = plan(1), plan(2)
    assert two.tensor_parallel_size == 2 and "per rank of 2" in two.summary()
    assert two.memory_bytes == one.memory_bytes // 2
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token
    assert one.weights_bytes / 2 < two.weights_bytes < one.weights_bytes
    assert two.activation_bytes < one.activation_bytes


# ------------------------------------------------------------------ workers
def _settings(path: str, ranks: int) -> dict:
    """Chunked prefill that splits images, and a KV cache of 12 blocks per rank: the mixed
    batch preempts; then the shared batch hits both caches."""
    text = AutoConfig.from_pretrained(path).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = parallel.kv_heads_per_rank(text.num_key_value_heads, ranks)
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * 4
    return dict(dtype="float32", device="cpu", max_num_batched_tokens=24, max_num_seqs=4,
                block_size=16, max_model_len=160, kv_cache_memory=12 * 16 * per_token,
                tensor_parallel_size=ranks)


def _run_both(llm: LLM) -> list[list[int]]:
    tokens = []
    for batch in (mixed_batch(), shared_batch()):
        tokens += [o.token_ids for o in llm.generate(batch, GREEDY)]
        assert_no_leaks(llm.engine)
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize(("name", "encoder_mode"), [
    # Each family, and each tower both ways: the data-parallel tower is the one-rank tower
    # on each rank, whatever the family; the split one is each tower's own.
    ("clip-llama", "data"), ("siglip-qwen2-one-kv-head", "weights"), ("qwen2-vl", "data"),
    ("qwen2.5-vl", "weights")])
def test_two_ranks_give_one_ranks_tokens(tp_checkpoints: dict[str, str], name: str,
                                         encoder_mode: str) -> None:
    """float32 greedy tokens of two ranks equal one rank's (which equal transformers',
    ``test_parity.py``), with images split across steps, preemption, and encoder and prefix
    cache hits; the vision tower data-parallel or split."""
    path = tp_checkpoints[name]
    with LLM(path, **_settings(path, 1)) as one:
        expected = _run_both(one)
        blocks = one.engine.plan.num_blocks
    with LLM(path, mm_encoder_tp_mode=encoder_mode, **_settings(path, 2)) as two:
        assert two.engine.plan.num_blocks == blocks == 12
        assert _run_both(two) == expected
        stats = two.stats()
        pids = two.engine.runner.pids
        weights = two.engine.weights_bytes
    # What each worker loaded: the vision tower whole, or its share.
    data_parallel = tensor_bytes(meta_model(AutoConfig.from_pretrained(path), torch.float32, 2))
    assert (weights == data_parallel) == (encoder_mode == "data")
    assert weights <= data_parallel
    assert stats["num_preemptions"] > 0
    assert stats["encoder_cache_hits"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert all(not _alive(pid) for pid in pids)


@pytest.mark.slow
def test_embeddings_borrowing_kv_blocks_with_two_ranks(clip_llama: str) -> None:
    """The elastic encoder cache: embeddings spilled into free KV blocks (each rank into
    its own, of its own KV heads) and taken back give one rank's tokens."""
    def run(ranks: int):
        with LLM(clip_llama, dtype="float32", device="cpu", max_num_seqs=1,
                 max_num_batched_tokens=64, encoder_cache_size=20,
                 tensor_parallel_size=ranks) as llm:
            tokens = [o.token_ids for o in llm.generate(shared_batch(), GREEDY)]
            assert_no_leaks(llm.engine)
            return tokens, llm.stats()

    (one, _), (two, stats) = run(1), run(2)
    assert two == one
    assert stats["encoder_cache_spills"] > 0 and stats["encoder_cache_restores"] > 0


@pytest.mark.slow
def test_one_rank_in_a_worker_process_gives_the_same_tokens(clip_llama: str) -> None:
    """``distributed_executor_backend="mp"`` with one rank: the worker-process path (the one
    several GPUs take, with NCCL) on one device."""
    prompts = mixed_batch()
    with LLM(clip_llama, dtype="float32", device="cpu") as uni:
        expected = [o.token_ids for o in uni.generate(prompts, GREEDY)]
    with LLM(clip_llama, dtype="float32", device="cpu",
             distributed_executor_backend="mp") as mp:
        executor = mp.engine.runner
        assert isinstance(executor, MultiprocExecutor)
        assert len(executor.pids) == 1
        sent = []  # each step as it crossed to the worker
        send = executor._send

        def recording(payloads: list[bytes]) -> int:
            _, method, args = pickle.loads(payloads[0])
            if method == "execute":
                sent.append(pickle.loads(args[0]))
            return send(payloads)

        executor._send = recording
        assert [o.token_ids for o in mp.generate(prompts, GREEDY)] == expected
        workers = executor._procs
    # Every request's params crossed once, in its first step; decode rows carried none after.
    carried = [p for step in sent for p in step.decodes.sampling_params
               + [r.sampling_params for r in step.chunks] if p is not None]
    assert len(carried) == len(prompts)
    assert sum(len(step.decodes) for step in sent) > 2 * len(prompts)
    assert [w.exitcode for w in workers] == [0]  # closed, not killed


def test_a_start_that_fails_beside_the_loading_workers_ends_them(clip_llama: str,
                                                                monkeypatch) -> None:
    """The workers start before the engine builds its processor, and load beside it: a
    failure there ends them at once (the autouse check: no worker left)."""
    started: list[MultiprocExecutor] = []
    real_start = MultiprocExecutor.__init__

    def start(self, spec) -> None:
        real_start(self, spec)
        started.append(self)

    def broken(config, hf_config):
        assert started and all(p.is_alive() for p in started[0]._procs)  # loading meanwhile
        raise ValueError("no processor")

    monkeypatch.setattr(MultiprocExecutor, "__init__", start)
    monkeypatch.setattr(llm_engine, "processor_and_grammars", broken)
    begin = time.monotonic()
    with pytest.raises(ValueError, match="no processor"):
        LLM(clip_llama, dtype="float32", device="cpu", tensor_parallel_size=2)
    assert time.monotonic() - begin < 5  # killed, not waited for
    assert not any(_alive(p.pid) for p in started[0]._procs)


@pytest.mark.slow
def test_a_start_that_fails_after_the_workers_loaded_ends_them(clip_llama: str) -> None:
    """The plan refuses the settings once the workers hold their shards: they are gone when
    the error reaches the caller, not when its traceback (which holds the half-built engine,
    as a notebook keeps the last one) is dropped."""
    with pytest.raises(InfeasiblePlanError, match="smaller than one KV block") as refused:
        LLM(clip_llama, dtype="float32", device="cpu", tensor_parallel_size=2,
            kv_cache_memory=1024)
    engine = next(frame.f_locals["self"] for frame, _ in traceback.walk_tb(refused.tb)
                  if isinstance(frame.f_locals.get("self"), llm_engine.LLMEngine))
    assert engine._closed and engine.runner.pids
    assert not any(_alive(pid) for pid in engine.runner.pids)


def test_settings_that_cannot_work_together_say_so(clip_llama: str) -> None:
    with pytest.raises(ValueError, match="use 'mp'"):
        EngineConfig(clip_llama, tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(clip_llama, tensor_parallel_size=0)


@pytest.mark.slow
def test_sampling_logprobs_and_n_match_one_rank(tp_checkpoints: dict[str, str]) -> None:
    """Seeded sampling, log-probabilities, n completions, prompt logprobs and structured
    output come out of rank 0 as one rank gives them."""
    path = tp_checkpoints["qwen2-vl"]
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=3, n=2, logprobs=2)
    constrained = SamplingParams(max_tokens=24, temperature=0.0, prompt_logprobs=1,
                                 structured_outputs={"regex": "(red|green|blue) [0-9]{2}"})
    prompts = mixed_batch()[:4]

    def run(ranks: int):
        with LLM(path, dtype="float32", device="cpu", tensor_parallel_size=ranks) as llm:
            outs = llm.generate(prompts, params)
            guided = llm.generate(prompts[:2], constrained)
        sampled = [c.token_ids for o in outs for c in o.outputs]
        logprobs = [lp.logprob for o in outs for c in o.outputs for lp in c.logprobs]
        logprobs += [lp.logprob for o in guided for lp in o.prompt_logprobs[1:]]
        return sampled, [o.text for o in guided], logprobs

    two, one = run(2), run(1)
    assert two[:2] == one[:2] and len(one[0]) == 8
    assert all(re.fullmatch("(red|green|blue) [0-9]{2}", text) for text in one[1])
    # The ranks' partial sums add up in another order: equal within float32 rounding.
    assert two[2] == pytest.approx(one[2], abs=1e-4) and len(one[2]) > 100


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _two_ranks(path: str, worker_timeout: float) -> tuple[LLM, list[int]]:
    llm = LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2,
              worker_timeout=worker_timeout)
    return llm, llm.engine.runner.pids


@pytest.mark.slow
def test_a_killed_worker_stops_the_engine_naming_it(clip_llama: str) -> None:
    llm, pids = _two_ranks(clip_llama, worker_timeout=30)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        llm.generate(mixed_batch()[:2], GREEDY)
    assert time.monotonic() - start < 10
    assert not any(_alive(pid) for pid in pids)  # rank 0 ended too
    with pytest.raises(EngineDeadError):
        llm.generate(mixed_batch()[:1], GREEDY)
    llm.close()


@pytest.mark.slow
def test_a_hung_worker_stops_the_engine_within_the_timeout(clip_llama: str) -> None:
    llm, pids = _two_ranks(clip_llama, worker_timeout=3)
    os.kill(pids[1], signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(EngineDeadError, match=r"rank\(s\) 1 did not answer"):
            llm.generate(mixed_batch()[:2], GREEDY)
        assert time.monotonic() - start < 3 + 5 + 10
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGCONT)
    llm.close()
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.slow
def test_workers_exit_with_the_engines_process(clip_llama: str, tmp_path) -> None:
    """A process that holds a tensor-parallel engine and is killed leaves no worker behind."""
    script = tmp_path / "hold.py"
    script.write_text(
        "import sys, time\n"
        "from mmserve import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({clip_llama!r}, device='cpu', tensor_parallel_size=2)\n"
        "    print(*llm.engine.runner.pids, flush=True)\n"
        "    time.sleep(600)\n")
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)


def _sleep_long() -> None:
    time.sleep(60)


@pytest.mark.parametrize(("signum", "named"), [(signal.SIGKILL, "SIGKILL"),
                                               (signal.SIGRTMIN + 6, None)])
def test_a_dead_processs_status_names_its_signal(signum: int, named: str | None) -> None:
    """Every signal a worker can die of gives a message, the real-time ones Python does not
    name included (``signal.Signals`` raises on them)."""
    proc = multiprocessing.get_context("fork").Process(target=_sleep_long, daemon=True)
    proc.start()
    assert exit_status(proc, 0.0) == f"(pid {proc.pid}) stopped answering"
    os.kill(proc.pid, signum)
    assert exit_status(proc, 10.0) == (f"(pid {proc.pid}) was killed by "
                                       f"{named or f'signal {int(signum)}'}")
