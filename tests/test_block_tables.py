"""The runner's block tables (``worker/block_tables.py``): steps send only the block ids a
request adds, and the runner's rows stay equal to the scheduler's tables. The scheduler's
stress runs (``tests/test_scheduler.py``) check the same through preemption, aborts and prefix
hits; the engine's parity tests through real steps."""

from __future__ import annotations

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
    rows = tables.rows([sent("b", []), sent("a", [])])
    assert rows[0, :1].tolist() == [5] and rows[1, :5].tolist() == [7, 3, 9, 1, 4]
    assert tables.table.shape[0] >= 2 and tables.table.shape[1] >= 5  # grew both ways
    # The same message again (a failed step's requests rerun one by one) changes nothing.
    before = tables.table.clone()
    tables.update([sent("a", [9, 1, 4], blocks_from=2)])
    assert torch.equal(tables.table, before)
    tables.release(["a", "never-seen"])
    tables.update([sent("c", [2, 8])])  # takes a's row: its first ids are overwritten
    assert tables.rows([sent("c", [])])[0, :2].tolist() == [2, 8]
    assert len(tables) == 2


def test_a_request_readmitted_after_preemption_sends_its_new_table_whole() -> None:
    tables = BlockTables()
    tables.update([sent("a", [1, 2, 3, 4])])
    tables.update([sent("a", [6, 5])])  # new blocks from index 0: the old ones are void
    assert tables.rows([sent("a", [])])[0, :2].tolist() == [6, 5]


def test_ids_from_past_the_start_of_an_unknown_table_are_refused() -> None:
    with pytest.raises(ValueError, match="sends block ids from index 3"):
        BlockTables().update([sent("a", [1], blocks_from=3)])
