"""BlockPool: ref counts, the LRU free queue and the prefix-cache hash map (bookkeeping only)."""

from __future__ import annotations

import pytest

from mmserve.engine.block_pool import BlockPool, KVBlock


def free_queue(pool: BlockPool) -> list[int]:
    """The free blocks in the order they are handed out: empty ones, then prefix-cached."""
    return pool.free_block_ids()


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0, enable_caching=True)


def test_allocate_and_free_restore_free_count() -> None:
    pool = BlockPool(8, enable_caching=False)
    assert pool.num_free_blocks == 8
    assert pool.usage == 0.0
    blocks = pool.allocate(3)
    assert ids(blocks) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 5
    assert pool.usage == pytest.approx(3 / 8)
    more = pool.allocate(5)
    assert pool.num_free_blocks == 0
    assert set(ids(blocks)).isdisjoint(ids(more))
    pool.free(blocks)
    pool.free(more)
    assert pool.num_free_blocks == 8
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_allocating_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4, enable_caching=False)
    pool.allocate(3)
    before = free_queue(pool)
    with pytest.raises(RuntimeError, match="only 1 free"):
        pool.allocate(2)
    assert free_queue(pool) == before
    assert pool.blocks[3].ref_cnt == 0


def test_ref_counts_shared_block_freed_only_at_zero() -> None:
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.touch([block])  # a second request shares it
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1
    assert block.block_id not in free_queue(pool)
    assert pool.num_free_blocks == 3
    pool.free([block])
    assert block.ref_cnt == 0
    assert free_queue(pool)[-1] == block.block_id
    assert pool.num_free_blocks == 4


def test_double_free_is_caught() -> None:
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([block])


def test_freed_blocks_join_back_of_free_queue() -> None:
    pool = BlockPool(4, enable_caching=False)
    a, b = pool.allocate(2)
    assert free_queue(pool) == [2, 3]
    pool.free([b])
    pool.free([a])
    assert free_queue(pool) == [2, 3, 1, 0]
    # Handed out front first: never-used blocks, then the least recently freed.
    assert ids(pool.allocate(4)) == [2, 3, 1, 0]


def test_free_order_is_the_callers_order() -> None:
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.allocate(3)
    pool.free(list(reversed(blocks)))
    assert free_queue(pool) == [2, 1, 0]


def test_cached_free_block_is_evicted_only_when_reallocated() -> None:
    pool = BlockPool(3, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"h0")
    pool.free([block])
    # Free, but still findable: the hash is kept until the block is handed out again.
    assert pool.get_cached(b"h0") is block
    assert block.block_hash == b"h0"
    assert free_queue(pool) == [1, 2, 0]
    assert ids(pool.allocate(2)) == [1, 2]
    assert pool.get_cached(b"h0") is block
    assert pool.num_evictions == 0
    (again,) = pool.allocate(1)
    assert again is block
    assert pool.get_cached(b"h0") is None
    assert block.block_hash is None
    assert block.ref_cnt == 1
    assert pool.num_evictions == 1


def test_touch_pulls_a_free_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(3, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"h0")
    pool.free([block])
    hit = pool.get_cached(b"h0")
    assert hit is block
    pool.touch([hit])
    assert block.ref_cnt == 1
    assert block.block_id not in free_queue(pool)
    assert pool.num_free_blocks == 2
    # It is not handed out to someone else while in use, and keeps its hash.
    assert block.block_id not in ids(pool.allocate(2))
    assert pool.get_cached(b"h0") is block


def test_cache_block_is_a_no_op_without_caching() -> None:
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"h0")
    assert block.block_hash is None
    assert pool.get_cached(b"h0") is None


def test_cache_block_first_writer_wins_and_duplicate_eviction_keeps_the_entry() -> None:
    pool = BlockPool(4, enable_caching=True)
    first, dup = pool.allocate(2)
    pool.cache_block(first, b"h")
    pool.cache_block(dup, b"h")
    assert pool.get_cached(b"h") is first
    # Re-publishing a block under a new hash does not change it.
    pool.cache_block(first, b"other")
    assert first.block_hash == b"h"
    assert pool.get_cached(b"other") is None
    # Evicting the duplicate must not drop the entry that points at the first block.
    pool.free([dup])
    pool.allocate(3)  # blocks 2, 3 and then the duplicate
    assert dup.block_hash is None
    assert pool.get_cached(b"h") is first


def test_reset_prefix_cache_drops_only_free_blocks() -> None:
    pool = BlockPool(3, enable_caching=True)
    used, freed = pool.allocate(2)
    pool.cache_block(used, b"used")
    pool.cache_block(freed, b"freed")
    pool.free([freed])
    pool.reset_prefix_cache()
    assert pool.get_cached(b"freed") is None
    assert freed.block_hash is None
    assert pool.get_cached(b"used") is used


def test_reset_prefix_cache_keeps_the_entry_of_a_block_in_use_with_a_free_duplicate() -> None:
    # Two blocks with equal content happen when a request with a fully cached prompt
    # recomputes its last block. Only the first is in the map; resetting the free duplicate
    # must not drop the in-use block's entry.
    pool = BlockPool(3, enable_caching=True)
    used, dup = pool.allocate(2)
    pool.cache_block(used, b"h")
    pool.cache_block(dup, b"h")
    pool.free([dup])
    pool.reset_prefix_cache()
    assert dup.block_hash is None
    assert pool.get_cached(b"h") is used


def test_empty_blocks_are_handed_out_before_prefix_cached_ones() -> None:
    """A freed block nobody can find again (no hash) goes before any prefix-cache block, even
    one freed earlier: keeping a cached prefix costs nothing while empty blocks remain."""
    pool = BlockPool(4, enable_caching=True)
    full, partial, _, _ = pool.allocate(4)
    pool.cache_block(full, b"prefix")
    pool.free([full])
    pool.free([partial])
    assert free_queue(pool) == [partial.block_id, full.block_id]
    assert ids(pool.allocate(1)) == [partial.block_id]
    assert pool.get_cached(b"prefix") is full and pool.num_evictions == 0


def test_lent_blocks_are_free_and_given_back_before_prefix_blocks_are_evicted() -> None:
    pool = BlockPool(6, enable_caching=True)
    cached = pool.allocate(2)
    for i, block in enumerate(cached):
        pool.cache_block(block, f"h{i}".encode())
    pool.free(cached)
    lent = pool.lend(3)
    assert lent == [2, 3, 4] and pool.num_lent == 3
    assert pool.lend(2) is None  # one empty block left; prefix blocks are never lent
    assert pool.num_free_blocks == 6  # lent blocks count as free
    asked = []

    def reclaim(n: int) -> None:
        asked.append(n)
        pool.give_back(lent)  # the lender drops its whole entry

    pool.set_lender(reclaim)
    got = pool.allocate(3)
    assert asked == [2]  # one empty block was there; two more were needed
    assert ids(got) == [5, 2, 3] and pool.num_lent == 0
    assert pool.num_evictions == 0
    assert pool.get_cached(b"h0") is cached[0] and pool.get_cached(b"h1") is cached[1]
    assert free_queue(pool) == [4, 0, 1]


def test_uncache_moves_a_free_block_to_the_empty_queue() -> None:
    pool = BlockPool(3, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"h")
    pool.free([block])
    pool.uncache([block])
    assert free_queue(pool) == [1, 2, 0]
    assert pool.num_cached_free_blocks == 0 and pool.num_free_blocks == 3
