"""Positions computed once in processing, sliced by the scheduler, flattened by the runner.

A fake M-RoPE prompt (``[3, N]`` positions: text tokens count in all three rows, an image's
tokens carry their (temporal, row, column) in a grid, and decode positions continue from an
offset) goes through chunked prefill with its image split across chunks, a prefix-cache hit and
a preemption; every token must reach the runner with the positions of one unchunked run. No
model: the scheduler with mock requests, and the runner's input preparation alone.
"""

from __future__ import annotations

import numpy as np
import torch

from mmserve.engine.request import Request
from mmserve.engine.scheduler import Scheduler
from mmserve.inputs import ImageInput
from mmserve.sampling_params import SamplingParams
from mmserve.step import DecodeRows, ModelOutput, ScheduledRequest, SchedulerOutput
from mmserve.worker.block_tables import BlockTables
from mmserve.worker.model_runner import ModelRunner, flat_positions
from tests.test_scheduler import PLACEHOLDER, assert_no_leaks, check_step, make_sched

GRID = 4  # the image is GRID x GRID tokens
IMAGE_OFFSET = 5
NUM_PROMPT = 30


def mrope_positions(num_tokens: int, offset: int, grid: int) -> tuple[np.ndarray, int]:
    """Qwen2-VL-style positions for text, one image of ``grid`` x ``grid`` tokens at
    ``offset``, then text: ``[3, num_tokens]`` and the decode offset."""
    positions = np.zeros((3, num_tokens), dtype=np.int64)
    positions[:, :offset] = np.arange(offset)
    rows, cols = np.divmod(np.arange(grid * grid), grid)
    positions[0, offset:offset + grid * grid] = offset
    positions[1, offset:offset + grid * grid] = offset + rows
    positions[2, offset:offset + grid * grid] = offset + cols
    after = offset + grid  # text after the image continues from its largest position + 1
    positions[:, offset + grid * grid:] = after + np.arange(num_tokens - offset - grid * grid)
    return positions, int(positions.max()) + 1 - num_tokens


PROMPT_POSITIONS, DECODE_OFFSET = mrope_positions(NUM_PROMPT, IMAGE_OFFSET, GRID)


def mrope_request(rid: str, max_tokens: int = 6) -> Request:
    ids = [100 + i for i in range(NUM_PROMPT)]
    ids[IMAGE_OFFSET:IMAGE_OFFSET + GRID * GRID] = [PLACEHOLDER] * GRID * GRID
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   images=[ImageInput("img", IMAGE_OFFSET, GRID * GRID)], eos_token_id=2,
                   prompt_positions=PROMPT_POSITIONS, decode_offset=DECODE_OFFSET)


def expected_positions(index: int) -> tuple[int, int, int]:
    """What one unchunked run gives token ``index``: its prompt column, or index + offset."""
    if index < NUM_PROMPT:
        return tuple(int(p) for p in PROMPT_POSITIONS[:, index])  # type: ignore[return-value]
    return (index + DECODE_OFFSET,) * 3


def run(sched: Scheduler, reqs: list[Request], max_steps: int = 200) -> dict[str, list]:
    """Drive the scheduler to the end; each request's scheduled chunks as (start_pos,
    per-token positions, image slices), checking every token's positions on the way."""
    for r in reqs:
        sched.add_request(r)
    chunks: dict[str, list] = {r.request_id: [] for r in reqs}
    for i in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_step(sched, out)
        for s in out.requests:
            assert s.positions is not None and len(s.positions) == 3
            columns = list(zip(*s.positions, strict=True))
            assert len(columns) == len(s.token_ids)
            assert columns == [expected_positions(s.start_pos + j)
                               for j in range(len(s.token_ids))], (s.request_id, s.start_pos)
            chunks[s.request_id].append((s.start_pos, columns, s.image_slices))
        sched.update(out, ModelOutput({r.request_id: 1000 + i for r in out.requests
                                       if r.sample}))
    assert_no_leaks(sched)
    return chunks


def test_decode_positions_continue_from_the_offset() -> None:
    req = mrope_request("r", max_tokens=3)
    assert DECODE_OFFSET == IMAGE_OFFSET + GRID + (NUM_PROMPT - IMAGE_OFFSET - GRID * GRID) \
        - NUM_PROMPT
    assert req.positions(NUM_PROMPT - 1, NUM_PROMPT + 2) == [
        [int(PROMPT_POSITIONS[row, -1]), NUM_PROMPT + DECODE_OFFSET,
         NUM_PROMPT + 1 + DECODE_OFFSET] for row in range(3)]
    # Positions after the prompt are one past its largest, in every row.
    assert NUM_PROMPT + DECODE_OFFSET == PROMPT_POSITIONS.max() + 1


def test_chunked_prefill_prefix_hit_and_preemption_see_one_run_positions() -> None:
    whole = run(make_sched(max_num_batched_tokens=64, block_size=4),
                [mrope_request("r")])["r"]
    assert whole[0][0] == 0 and len(whole[0][1]) == NUM_PROMPT  # one prefill, then decodes

    # Chunks of 8 tokens: the 16-token image is split over its chunks.
    chunked = run(make_sched(max_num_batched_tokens=8, block_size=4,
                             max_tokens_per_item=GRID * GRID), [mrope_request("r")])["r"]
    assert len(chunked) > len(whole)
    assert any(sl.src_start > 0 for _, _, slices in chunked for sl in slices)

    def by_token(chunks: list) -> dict[int, tuple]:
        return {start + j: col for start, cols, _ in chunks for j, col in enumerate(cols)}

    assert by_token(chunked) == by_token(whole)

    # A prefix-cache hit: the second request starts past the cached blocks, with the same
    # numbers for the tokens it computes.
    sched = make_sched(max_num_batched_tokens=64, block_size=4)
    run(sched, [mrope_request("a")])
    second = mrope_request("b")
    hit = run(sched, [second])["b"]
    assert second.num_cached_tokens and second.num_cached_tokens > 0
    assert hit[0][0] == second.num_cached_tokens
    tokens = by_token(hit)
    assert tokens == {i: col for i, col in by_token(whole).items() if i >= hit[0][0]}

    # Preemption: 16 blocks of 4 tokens hold both prompts of 30 (8 blocks each) but not their
    # decodes (9 blocks each); the newer one is preempted and recomputes its prompt and its
    # generated tokens (now part of one prefill) with the same positions.
    sched = make_sched(max_num_batched_tokens=64, block_size=4, num_blocks=16,
                       enable_caching=False)
    reqs = [mrope_request("p0"), mrope_request("p1")]
    runs = run(sched, reqs)
    assert sched.num_preemptions > 0
    for rid, chunks in runs.items():
        seen: dict[int, tuple] = {}
        for start, cols, _ in chunks:
            for j, col in enumerate(cols):
                assert seen.setdefault(start + j, col) == col  # recomputed alike
        assert seen == by_token(whole), rid
    assert any(r.num_preemptions > 0 and r.num_output_tokens == 6 for r in reqs)
    # The recompute after the preemption is one chunk from 0 past the prompt's end.
    assert any(start == 0 and len(cols) > NUM_PROMPT for chunks in runs.values()
               for start, cols, _ in chunks)


def _sched_req(rid: str, start: int, positions: list[list[int]],
               num_tokens: int, sample: bool = True) -> ScheduledRequest:
    return ScheduledRequest(rid, [7] * num_tokens, start, [0, 1, 2, 3], [], sample,
                            SamplingParams(), positions=positions)


def test_runner_flattens_three_row_positions() -> None:
    prefill = _sched_req("a", 0, [[0, 1, 2, 2], [0, 1, 2, 3], [0, 1, 3, 2]], 4, sample=False)
    decode = _sched_req("b", 9, [[5], [5], [5]], 1)
    decodes = DecodeRows(position_rows=3)  # b again, as a decode row (its rows alike)
    decodes.append("b", 7, 9, 5, SamplingParams(), 0)
    decodes.new_blocks[0] = [4, 5, 6]
    runner = ModelRunner.__new__(ModelRunner)  # input preparation needs no model
    runner.block_size = 4
    runner.block_tables = BlockTables()
    for rows in (DecodeRows(), [prefill, decode]), (decodes, [prefill]):
        runner.block_tables.update(rows[1])  # as launch() does first
        runner.block_tables.update_decodes(rows[0])
        input_ids, positions, meta, sample_rows, _ = runner._prepare_inputs(*rows)
        assert input_ids.shape == (5,)
        assert positions.shape == (3, 5) and positions.dtype == torch.long
        if rows[0].request_ids:  # decode rows come first
            assert positions.tolist() == [[5, 0, 1, 2, 2], [5, 0, 1, 2, 3], [5, 0, 1, 3, 2]]
            assert sample_rows.tolist() == [0]
        else:
            assert positions.tolist() == [[0, 1, 2, 2, 5], [0, 1, 2, 3, 5], [0, 1, 3, 2, 5]]
            assert sample_rows.tolist() == [4]
        # Padding rows (CUDA decode batches) add zero columns in every row.
        padded = flat_positions(*rows, num_padding=2)
        assert padded.shape == (3, 7) and padded[:, 5:].eq(0).all()
    assert runner.block_tables.rows(["b"], 3)[0].tolist() == [4, 5, 6]


def test_runner_squeezes_one_row_positions() -> None:
    # One row stays [num_tokens], as LLaMA's rope takes it.
    reqs = [_sched_req("a", 0, [[0, 1, 2]], 3), _sched_req("b", 6, [[6, 7]], 2)]
    positions = flat_positions(DecodeRows(), reqs, num_padding=1)
    assert positions.shape == (6,)
    assert positions.tolist() == [0, 1, 2, 6, 7, 0]


def test_scheduler_output_positions_stay_plain() -> None:
    sched = make_sched(max_num_batched_tokens=64, block_size=4)
    sched.add_request(mrope_request("r"))
    out: SchedulerOutput = sched.schedule()
    (s,) = out.requests
    assert isinstance(s.positions, list)
    assert all(isinstance(row, list) and all(type(p) is int for p in row) for row in s.positions)


def test_llava_positions_are_one_counting_row(clip_llama: str) -> None:
    """LLaVA's family: one row, ``arange(N)``, offset 0, stored on the processed prompt and
    kept by the engine's request, which hands out the counter the runner always used."""
    from transformers import AutoConfig

    from mmserve.processing.processor import InputProcessor
    from tests.conftest import make_image

    proc = InputProcessor(clip_llama, AutoConfig.from_pretrained(clip_llama), 1_000_000)
    assert proc.family.position_rows == 1
    out = proc.process({"messages": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "what is this?"}]}],
        "images": [make_image(1, (40, 30))]})
    n = len(out.token_ids)
    assert out.positions is not None and out.positions.shape == (1, n)
    assert out.positions.tolist() == [list(range(n))] and out.decode_offset == 0
    req = Request("r", out.token_ids, SamplingParams(), out.images,
                  prompt_positions=out.positions, decode_offset=out.decode_offset)
    req.append_token(5)
    assert req.positions(n - 2, n + 1) == [[n - 2, n - 1, n]]
