"""KV block pool: ref counts, the free queues, lending to the encoder cache and the prefix-cache
hash map."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and its content hash known; kept after the block is freed so
    # that a later request with the same prefix can reuse it until the block is evicted.
    block_hash: bytes | None = None


class BlockPool:
    """Owns every KV block. Bookkeeping only: the runner holds the tensors.

    A free block is in one of three places, handed out in this order when the KV cache needs
    blocks: the empty queue (nothing worth keeping), lent out (holding encoder outputs that
    no running request needs; the lender gives them back on demand, see ``set_lender``), and
    the prefix-cache queue (a full block findable through ``cached`` until it is handed out
    again, least recently freed first). All three count as free: a request never waits, and is
    never preempted, for a block another cache keeps. A block is only ever evicted or lent at
    ref count 0.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Oldest-freed first; values unused (ordered sets).
        self._empty: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0
        self.num_lent = 0
        self._reclaim: Callable[[int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: empty, lent and prefix-cached ones."""
        return len(self._empty) + self.num_lent + len(self._cached_free)

    @property
    def num_empty_blocks(self) -> int:
        return len(self._empty)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    def free_block_ids(self) -> list[int]:
        """The free blocks that are not lent, in the order ``allocate`` hands them out."""
        return [*self._empty, *self._cached_free]

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    # ----------------------------------------------------------------- lending
    def set_lender(self, reclaim: Callable[[int], None]) -> None:
        """``reclaim(n)``: give back (``give_back``) lent blocks, at least ``n`` of them or all,
        when an allocation needs more than the empty queue holds."""
        self._reclaim = reclaim

    def lend(self, n: int, take_prefix_blocks: bool = False) -> list[int] | None:
        """Lend ``n`` empty blocks, or None when fewer are empty. ``take_prefix_blocks``: make
        up the difference from the least recently freed prefix-cache blocks (evicting them)."""
        available = len(self._empty) + (len(self._cached_free) if take_prefix_blocks else 0)
        if n > available:
            return None
        self.num_lent += n
        return [self._take().block_id for _ in range(n)]

    def give_back(self, block_ids: list[int]) -> None:
        """Lent blocks return to the empty queue (their content is not worth keeping)."""
        self.num_lent -= len(block_ids)
        assert self.num_lent >= 0, "gave back more blocks than were lent"
        for block_id in block_ids:
            self._empty[block_id] = None

    # ----------------------------------------------------------------- allocation
    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks: empty ones first, then lent ones (given back), then the least
        recently freed prefix-cache blocks (evicting their hashes)."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks with only {self.num_free_blocks} free")
        if n > len(self._empty) and self.num_lent and self._reclaim is not None:
            self._reclaim(n - len(self._empty))
        out = [self._take() for _ in range(n)]
        for block in out:
            block.ref_cnt = 1
        return out

    def _take(self) -> KVBlock:
        """The next free block: empty first, else the least recently freed prefix-cache block,
        its hash evicted."""
        queue = self._empty if self._empty else self._cached_free
        block = self.blocks[queue.popitem(last=False)[0]]
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1
        return block

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._cached_free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the back of their queue
        (the prefix-cache queue when findable by hash, the empty queue otherwise).

        Callers pass a request's blocks in reverse order so that the tail of a sequence, the part
        least likely to be shared, is evicted first.
        """
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"KV block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self._enqueue(block)

    def _enqueue(self, block: KVBlock) -> None:
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            self._cached_free[block.block_id] = None
        else:
            block.block_hash = None  # a duplicate nobody can find: nothing worth keeping
            self._empty[block.block_id] = None

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Publish a full block under its content hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def uncache(self, blocks: list[KVBlock]) -> None:
        """Withdraw blocks from the prefix cache: no later request will find them."""
        for block in blocks:
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
                if block.ref_cnt == 0 and self._cached_free.pop(block.block_id, 0) is None:
                    self._empty[block.block_id] = None

    def reset_prefix_cache(self) -> None:
        self.uncache([self.blocks[i] for i in list(self._cached_free)])
