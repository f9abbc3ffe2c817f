"""KV block pool: ref counts, an LRU free list and the prefix-cache hash map."""

from __future__ import annotations

from collections import OrderedDict
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

    Free blocks wait in an LRU queue. A freed block that carries a hash stays findable through
    ``cached`` until it is handed out again (evicted); a block is only ever evicted at ref count 0.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Oldest-freed first; values unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the front of the free queue, evicting their old hashes."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with only {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the back of the LRU queue.

        Callers pass a request's blocks in reverse order so that the tail of a sequence, the part
        least likely to be shared, is evicted first.
        """
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"KV block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

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

    def reset_prefix_cache(self) -> None:
        self.uncache([b for b in self.blocks if b.ref_cnt == 0])
