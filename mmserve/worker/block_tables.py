"""The runner's copy of every running request's KV block table, kept between steps.

A request's table only grows while it runs (a block every ``block_size`` tokens), so a step's
message carries only the ids the runner does not have yet (``ScheduledRequest.block_ids``,
starting at index ``blocks_from``) and the runner writes them into the request's row of one
tensor. A step's tables are then one gather of its requests' rows, whatever their length:
no per-request list is copied, padded or turned into a tensor every step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mmserve.kernels.transfer import int_tensor
from mmserve.step import DecodeRows, ScheduledRequest


class BlockTables:
    """Rows of block ids by request id, in a ``[rows, width]`` int64 tensor on the CPU that
    doubles as requests or blocks outgrow it. A finished request's row is reused; ids past a
    request's current blocks may be left over from an earlier request (the attention
    metadata zeroes every id past a sequence's blocks)."""

    def __init__(self, rows: int = 16, width: int = 16) -> None:
        self.table = torch.zeros(rows, width, dtype=torch.long)
        self._rows: dict[str, int] = {}
        self._lengths: dict[str, int] = {}  # ids each request's row holds
        self._free: list[int] = list(range(rows - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._rows)

    def update(self, requests: Iterable[ScheduledRequest]) -> None:
        """Write each request's new block ids into its row (a new request gets a row). The
        same message applied twice leaves the same rows (a failed step's requests rerun)."""
        lengths, row_of = self._lengths, self._rows
        for r in requests:
            rid = r.request_id
            held = lengths.get(rid, 0)
            if r.blocks_from > held:  # a message the runner never got: its ids would be stale
                raise ValueError(f"request {rid} sends block ids from index {r.blocks_from}, "
                                 f"but the runner has {held} of its earlier ones")
            if not r.block_ids and r.blocks_from and rid in row_of:
                continue  # nothing new for a table the runner has (most decodes)
            row = row_of.get(rid)
            if row is None:
                row = row_of[rid] = self._take_row()
            end = r.blocks_from + len(r.block_ids)
            # From index 0: a new table (admission, or again after a preemption).
            lengths[rid] = end if r.blocks_from == 0 else max(held, end)
            if not r.block_ids:
                continue
            if end > self.table.shape[1]:
                self._grow(self.table.shape[0], max(end, 2 * self.table.shape[1]))
            self.table[row, r.blocks_from:end] = torch.tensor(r.block_ids, dtype=torch.long)

    def update_decodes(self, decodes: DecodeRows) -> None:
        """``update`` for a step's decode rows: only those that add blocks have any."""
        if decodes.new_blocks:
            self.update([decodes.request(i) for i in decodes.new_blocks])

    def rows(self, request_ids: list[str], width: int) -> torch.Tensor:
        """``[len(request_ids), width]``: the first ``width`` ids of the requests' tables (at
        most as many as the widest holds), in order."""
        row_of = self._rows
        index = int_tensor([row_of[rid] for rid in request_ids])
        return self.table[:, :width].index_select(0, index)

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests (ids the runner never saw are ignored)."""
        for rid in request_ids:
            row = self._rows.pop(rid, None)
            self._lengths.pop(rid, None)
            if row is not None:
                self._free.append(row)

    def clear(self) -> None:
        self.release(list(self._rows))

    def _take_row(self) -> int:
        if not self._free:
            rows = self.table.shape[0]
            self._grow(2 * rows, self.table.shape[1])
            self._free.extend(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def _grow(self, rows: int, width: int) -> None:
        grown = torch.zeros(rows, width, dtype=torch.long)
        grown[:self.table.shape[0], :self.table.shape[1]] = self.table
        self.table = grown
