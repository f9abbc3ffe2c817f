"""The runner's block tables (``worker/block_tables.py``): steps send only the block ids a
request adds, and the runner's rows stay equal to the scheduler's tables. The scheduler's
stress runs (``tests/test_scheduler.py``) check the same through preemption, aborts and prefix
hits; the engine's parity tests through real steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.sampling_params import SamplingParams
from mmserve.step import ScheduledRequest
from mmserve.worker.block_tables import BlockTables


def sent(rid: str, block_ids: list[int], blocks_from: int = 0) -> ScheduledRequest:
    return ScheduledRequest(rid, [1], 0, block_ids, [], True, SamplingParams(),
                            positions=[[0]], blocks_from=blocks_from)


def test_rows_grow_from_what_each_step_sends_and_finished_rows_are_reused() -> None:
    tables = BlockTables(rows=1, width=2)
    tables.update([sent("a", [7, 3]), sent("b", [5])])
    tables.update([sent("a", [9, 1, 4], blocks_from=2), sent("b", [], blocks_from=1)])
    rows = tables.rows(["b", "a"], width=5)
    assert rows[0, :1].tolist() == [5] and rows[1, :5].tolist() == [7, 3, 9, 1, 4]
    assert tables.table.shape[0] >= 2 and tables.table.shape[1] >= 5  # grew both ways
    # The same message again (a failed step's requests rerun one by one) changes nothing.
    before = tables.table.clone()
    tables.update([sent("a", [9, 1, 4], blocks_from=2)])
    assert torch.equal(tables.table, before)
    tables.release(["a", "never-seen"])
    tables.update([sent("c", [2, 8])])  # takes a's row: its first ids are overwritten
    assert tables.rows(["c"], width=2)[0].tolist() == [2, 8]
    assert len(tables) == 2


def test_a_request_readmitted_after_preemption_sends_its_new_table_whole() -> None:
    tables = BlockTables()
    tables.update([sent("a", [1, 2, 3, 4])])
    tables.update([sent("a", [6, 5])])  # new blocks from index 0: the old ones are void
    assert tables.rows(["a"], width=2)[0].tolist() == [6, 5]
    # and what it sends next continues the new table, not the old one
    with pytest.raises(ValueError, match="runner has 2 of its earlier ones"):
        tables.update([sent("a", [9], blocks_from=4)])


def test_ids_past_what_the_runner_holds_are_refused() -> None:
    """A message the runner never got would leave stale ids in the row: refused."""
    tables = BlockTables()
    with pytest.raises(ValueError, match="sends block ids from index 3"):
        tables.update([sent("a", [1], blocks_from=3)])
    tables.update([sent("b", [1, 2])])
    with pytest.raises(ValueError, match="from index 3, but the runner has 2"):
        tables.update([sent("b", [4], blocks_from=3)])


def test_ids_left_over_past_a_sequences_blocks_never_reach_a_kernel() -> None:
    """A reused row holds the earlier request's ids past the new one's blocks; the metadata
    of both attention paths zeroes them."""
    from mmserve.kernels.paged_attention import build_attention_metadata
    from mmserve.kernels.triton_attention import TritonAttentionMetadata

    tables = BlockTables()
    tables.update([sent("old", [9, 9, 9, 9])])
    tables.release(["old"])
    tables.update([sent("new", [3, 4])])  # the same row; 7 tokens of blocks of 4
    rows = tables.rows(["new"], width=4)
    assert rows[0].tolist() == [3, 4, 9, 9]
    meta = build_attention_metadata([1], [7], rows, 4)
    assert meta.decode_block_tables.tolist() == [[3, 4]]
    triton = TritonAttentionMetadata.build([1], [7], rows, 4, max_blocks=4)
    assert triton.block_tables.tolist() == [[3, 4, 0, 0]]
    assert meta.slot_mapping.tolist() == triton.slot_mapping.tolist() == [4 * 4 + 2]


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 1, 1], [1, 17, 40]),  # decodes only: each sequence's last token
    ([5, 1, 16], [5, 33, 20]),  # a prompt, a decode, a chunk after cached tokens
])
def test_slot_mapping_puts_each_token_in_its_block(query_lens, seq_lens) -> None:
    from mmserve.kernels.paged_attention import slot_mapping

    block_size = 16
    tables = torch.tensor([[7, 0, 0], [3, 9, 4], [5, 2, 8]])
    expected = []
    for i, (n, length) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for pos in range(length - n, length):
            expected.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    got = slot_mapping(np.array(query_lens), np.array(seq_lens), tables.numpy(), block_size)
    assert got.dtype == np.int64 and got.tolist() == expected
