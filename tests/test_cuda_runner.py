"""The CUDA runner's device-independent logic, checked on the CPU.

Runner selection, the device flags, decode batch padding, and the runner's eager path end to
end: its input preparation and the Triton attention backend run the tiny checkpoints through
Triton's CPU interpreter and must give the CPU runner's tokens. CUDA graph capture itself needs
a GPU and is not exercised here.
"""

from __future__ import annotations

import argparse
import collections
import logging

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.config import EngineConfig
from mmserve.entrypoints.cli import add_engine_args, engine_kwargs
from mmserve.kernels import fused, triton_fused
from mmserve.models.llama import DecoderLayer
from mmserve.worker.cuda_runner import (
    CUDA_GRAPH_BATCH_SIZES,
    CUDAModelRunner,
    graph_batch_sizes,
    padded_batch_size,
    runner_class,
)
from mmserve.worker.executor import InlineSteps
from mmserve.worker.model_runner import CPUModelRunner
from tests.conftest import assert_no_leaks, make_image

MAX_TOKENS = 6


def test_runner_class_by_device():
    assert runner_class("cpu") is CPUModelRunner
    assert runner_class("cuda") is CUDAModelRunner
    with pytest.raises(ValueError, match="no runner for device 'auto'"):
        runner_class("auto")


def test_device_config():
    assert EngineConfig(model="m").device == "auto"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert EngineConfig(model="m").resolved_device == expected
    assert EngineConfig(model="m", device="cpu").resolved_device == "cpu"
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        EngineConfig(model="m", device="gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a CUDA device")
def test_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        EngineConfig(model="m", device="cuda")


def test_cli_device_flags():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--device", "cpu", "--enforce-eager"]))
    assert kwargs["device"] == "cpu" and kwargs["enforce_eager"] is True
    defaults = engine_kwargs(parser.parse_args([]))
    assert defaults["device"] == "auto" and defaults["enforce_eager"] is False


@pytest.mark.parametrize(("max_num_seqs", "expected_last", "expected_len"), [
    (1, 1, 1), (3, 4, 3), (5, 8, 4), (8, 8, 4), (9, 16, 5), (256, 256, 35), (1000, 256, 35)])
def test_graph_batch_sizes(max_num_seqs, expected_last, expected_len):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and set(sizes) <= set(CUDA_GRAPH_BATCH_SIZES)
    assert sizes[-1] == expected_last and len(sizes) == expected_len


def test_padded_batch_size():
    sizes = graph_batch_sizes(20)  # 1, 2, 4, 8, 16, 24
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 24)] == \
        [1, 2, 4, 8, 8, 16, 24, 24]
    assert padded_batch_size(25, sizes) is None  # larger than every graph: runs eagerly


class InterpretedCUDARunner(CUDAModelRunner):
    """The CUDA runner with its tensors on the CPU, so Triton's interpreter runs its kernels
    (tests/conftest.py switches the interpreter on where there is no GPU)."""

    device = torch.device("cpu")

    release_memory = CPUModelRunner.release_memory  # no CUDA allocator to empty: the CPU heap


def _prompts() -> list[dict]:
    texts = ["what is in this picture?", "hi", "compare these two images please", "ok"]
    layout = [[(40, 30)], [], [(64, 64), (23, 57)], [(32, 32)]]
    return [{"messages": [{"role": "user", "content": [{"type": "image"}] * len(sizes)
                           + [{"type": "text", "text": t}]}],
             "images": [make_image(i + 3 * j, s) for j, s in enumerate(sizes)]}
            for i, (t, sizes) in enumerate(zip(texts, layout, strict=True))]


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate(_prompts(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert_no_leaks(llm.engine)
    return [o.token_ids for o in outs]


ENGINE_ARGS = dict(dtype="float32", device="cpu", max_num_batched_tokens=24, max_num_seqs=4)


@pytest.fixture(scope="module")
def cpu_runner_tokens(clip_llama: str) -> list[list[int]]:
    return _generate(LLM(clip_llama, **ENGINE_ARGS))


class EagerReplay:
    """Stands in for a captured CUDA graph: ``replay()`` reruns the captured function, which
    reads the runner's static input buffers, and writes into the same output tensor."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.output = fn()
        self.replays = 0

    def replay(self) -> None:
        self.output.copy_(self.fn())
        self.replays += 1


# On a GPU machine the engine itself picks the CUDA runner, and the parity tests cover it.
@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels in the CPU interpreter")
@pytest.mark.parametrize("ahead", [False, True], ids=["in-step", "scheduled-ahead"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-replay"])
def test_triton_runner_matches_cpu_runner(clip_llama: str, cpu_runner_tokens: list[list[int]],
                                          graphs: bool, ahead: bool, caplog,
                                          monkeypatch: pytest.MonkeyPatch):
    """Same greedy tokens as the torch-reference runner, with chunked prefill splitting images
    (and the last layer of prompt steps computing only the rows they sample).

    ``graph-replay`` runs decode-only batches as the CUDA graphs would, with ``EagerReplay`` in
    place of the capture (which needs CUDA): padded to a captured size, copied into the static
    buffers, and the decoder rerun on them. ``scheduled-ahead`` is the engine as a GPU runs it
    by default: asynchronous scheduling, each step launched from the engine's own thread, its
    sampled tokens left on the device for the next step's inputs and brought to Python when
    the step is collected. No step may fail on
    the way: the engine would retry the requests of a failed step and hide it.
    """
    # The engine is built with the CPU runner, then given the CUDA one: built as a GPU builds
    # it, with no thread for the runner's steps (``InlineSteps``).
    monkeypatch.setattr(CPUModelRunner, "launches_asynchronously", True)
    with LLM(clip_llama, **ENGINE_ARGS, async_scheduling=ahead) as llm:
        engine = llm.engine
        runner = InterpretedCUDARunner(engine.model, engine.plan.num_blocks,
                                       engine.config.block_size, torch.float32,
                                       engine.config.seed)
        assert runner.defer_sampled_tokens
        if ahead:
            assert isinstance(engine._steps, InlineSteps) and engine._compute is None
            engine._steps.runner = runner  # launched from the engine's thread
        if graphs:
            sizes = [1, 4]  # decode batches of 2 and 3 get padding rows
            runner.allocate_graph_inputs(sizes[-1], engine.plan.max_model_len)
            for size in sizes:
                runner.graphs[size] = EagerReplay(lambda size=size: runner.graph_forward(size))
                runner.graph_outputs[size] = runner.graphs[size].output
            runner.graph_sizes = sizes
        engine.runner = runner
        # The decoder's and the vision tower's norms, rotary embedding and activations take
        # the Triton kernels a GPU takes (counted, to know they ran).
        monkeypatch.setattr(fused, "_TRITON_DEVICES", {"cuda", "cpu"})
        calls = collections.Counter()

        def counted(name, kernel):
            def call(*args):
                calls[name] += 1
                return kernel(*args)
            return call

        for name in ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul", "quick_gelu"):
            monkeypatch.setattr(triton_fused, name, counted(name, getattr(triton_fused, name)))
        # Prompt steps run the last layer for the sampled rows alone, through Triton's decode
        # path and the runner's K/V writer.
        first, *_, last = (m for m in engine.model.modules() if isinstance(m, DecoderLayer))
        rows: dict[str, list[int]] = {"first": [], "last": []}
        first.mlp.register_forward_hook(lambda m, args, out: rows["first"].append(len(args[0])))
        last.mlp.register_forward_hook(lambda m, args, out: rows["last"].append(len(args[0])))
        caplog.clear()  # what start-up said is not a step's failure
        with caplog.at_level(logging.WARNING, logger="mmserve"):
            assert _generate(llm) == cpu_runner_tokens
        assert any(n < m for n, m in zip(rows["last"], rows["first"], strict=True))
        failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not failures
        assert set(calls) == {"rms_norm", "add_rms_norm", "rotary", "silu_and_mul",
                              "quick_gelu"}
        if graphs:
            assert runner.graphs[1].replays > 0 and runner.graphs[4].replays > 0
        if ahead:
            assert engine.num_steps_ahead > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels in the CPU interpreter")
def test_profile_run_of_the_memory_plan(clip_llama: str):
    """The memory plan's worst-case batch (a prompt chunk with an image and many decodes) runs
    through the CUDA runner's input preparation and kernels, and leaves no encoder output."""
    from mmserve.engine.profile_batch import profile_batch
    from mmserve.worker.dry_run import profile_blocks

    engine = LLM(clip_llama, **ENGINE_ARGS).engine
    tokens_per_image = engine.processor.tokens_per_image
    size = engine.model.config.vision_config.image_size
    profile = profile_batch(num_tokens=48, max_num_seqs=6, max_positions=2048, block_size=16,
                            num_images=1, tokens_per_image=tokens_per_image,
                            encoder_input={"pixel_values": torch.zeros(1, 3, size, size)})
    batch = profile.scheduler_output
    runner = InterpretedCUDARunner(engine.model, profile_blocks(batch), 16, torch.float32, 0)
    runner.profile_run(batch, profile.encoder_pixels)
    assert not runner.encoder_outputs
    written = [c[0].abs().sum(dim=(1, 2, 3)).nonzero().numel() for c in runner.kv_caches]
    assert written == [profile_blocks(batch)] * len(runner.kv_caches)


class _PositionsModel(torch.nn.Module):
    """Stands in for a decoder: records the positions it is called with."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.hidden = hidden
        self.vocab_size = 16
        self.seen: list[torch.Tensor] = []

    def attention_layers(self) -> list:
        return []

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.hidden)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        self.seen.append(positions.clone())
        return embeds + 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels in the CPU interpreter")
@pytest.mark.parametrize("rows", [1, 3])
def test_graph_buffers_hold_positions_of_any_rows(rows: int) -> None:
    """The static position buffer is ``[rows, max_batch]``; a padded decode batch copies its
    ``[rows, n]`` positions in (``[n]`` for one row, as LLaMA's rope takes them), and the
    graph's decoder reads them with zeros in the padding columns."""
    from mmserve.sampling_params import SamplingParams as Params
    from mmserve.step import DecodeRows, ScheduledRequest

    model = _PositionsModel()
    runner = InterpretedCUDARunner(model, 4, 16, torch.float32, 0)
    runner.allocate_graph_inputs(4, 64, position_rows=rows)
    assert runner._static["positions"].shape == (rows, 4)
    runner.graphs[4] = EagerReplay(lambda: runner.graph_forward(4))
    runner.graph_outputs[4] = runner.graphs[4].output
    runner.graph_sizes = [4]
    reqs = [ScheduledRequest(f"r{i}", [5], 3 + i, [i], [], True, Params(),
                             positions=[[10 * i + row] for row in range(rows)])
            for i in range(3)]
    runner.block_tables.update(reqs)  # as launch() does first
    input_ids, positions, meta, _, _ = runner._prepare_inputs(DecodeRows(), reqs)
    assert positions.shape == ((4,) if rows == 1 else (rows, 4))
    model.seen.clear()
    runner._forward(positions, runner._embed(input_ids, reqs, 0), meta)
    assert runner.graphs[4].replays == 1
    expected = [[10 * i + row for i in range(3)] + [0] for row in range(rows)]
    (seen,) = model.seen
    assert seen.tolist() == (expected[0] if rows == 1 else expected)
