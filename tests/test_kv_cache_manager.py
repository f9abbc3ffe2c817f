"""KVCacheManager: per-request block tables, prefix caching and image-aware block hashes."""

from __future__ import annotations

import pytest

from mmserve.engine.kv_cache_manager import KVCacheManager, cdiv
from mmserve.engine.request import Request
from mmserve.inputs import ImageInput
from mmserve.sampling_params import SamplingParams

BS = 16
PLACEHOLDER = 9


def make_req(
    rid: str, token_ids: list[int], images: list[ImageInput] | None = None
) -> Request:
    return Request(rid, token_ids, SamplingParams(max_tokens=4), images=images, eos_token_id=2)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 5000 for i in range(n)]


def admit(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit a waiting request the way the scheduler does: hits, then the rest of the prompt."""
    hits = kv.get_computed_blocks(req)
    num_computed = len(hits) * kv.block_size
    blocks = kv.allocate_slots(req, req.num_tokens - num_computed, hits)
    assert blocks is not None
    req.num_computed_tokens = req.num_tokens
    return [b.block_id for b in hits]


def free_queue(kv: KVCacheManager) -> list[int]:
    return kv.pool.free_block_ids()


def test_cdiv() -> None:
    assert [cdiv(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_and_free_restore_free_count() -> None:
    kv = KVCacheManager(10, BS, enable_caching=True)
    req = make_req("a", prompt(40))
    blocks = kv.allocate_slots(req, 40)
    assert blocks is not None and len(blocks) == 3
    assert kv.num_free_blocks == 7
    assert len(set(kv.block_ids(req))) == 3
    kv.free(req)
    assert kv.num_free_blocks == 10
    assert kv.block_ids(req) == []
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_allocate_slots_grows_by_whole_blocks_only_when_needed() -> None:
    kv = KVCacheManager(10, BS, enable_caching=False)
    req = make_req("a", prompt(20))
    kv.allocate_slots(req, 20)
    req.num_computed_tokens = 20
    first = kv.block_ids(req)
    assert len(first) == 2
    for _ in range(12):  # decode up to 32 tokens: still two blocks
        req.append_token(5)
        kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    assert kv.block_ids(req) == first
    req.append_token(5)
    kv.allocate_slots(req, 1)  # token 33 needs a third block
    assert kv.block_ids(req)[:2] == first
    assert len(kv.block_ids(req)) == 3
    assert kv.num_free_blocks == 7


def test_free_is_tail_first() -> None:
    kv = KVCacheManager(4, BS, enable_caching=True)
    req = make_req("a", prompt(48))
    kv.allocate_slots(req, 48)
    assert kv.block_ids(req) == [0, 1, 2]
    hashes = list(req.block_hashes)
    assert len(hashes) == 3
    kv.free(req)
    assert free_queue(kv) == [3, 2, 1, 0]
    # The request's last block is reused (evicted) before its first one.
    other = make_req("b", prompt(32, seed=1))
    kv.allocate_slots(other, 32)
    assert kv.block_ids(other) == [3, 2]
    assert kv.pool.get_cached(hashes[2]) is None
    assert kv.pool.get_cached(hashes[1]) is kv.pool.blocks[1]
    assert kv.pool.get_cached(hashes[0]) is kv.pool.blocks[0]
    # The first two blocks of "a" are still cached: a repeat hits them.
    again = make_req("a2", prompt(48))
    assert [b.block_id for b in kv.get_computed_blocks(again)] == [0, 1]


def test_same_prefix_shares_blocks() -> None:
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = make_req("a", prompt(40))
    b = make_req("b", prompt(40)[:36] + [1, 2, 3, 4])  # differs in the third block only
    admit(kv, a)
    hits = admit(kv, b)
    assert hits == kv.block_ids(a)[:2]
    assert kv.block_ids(b)[:2] == kv.block_ids(a)[:2]
    assert kv.block_ids(b)[2] != kv.block_ids(a)[2]
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_ids(a)] == [2, 2, 1]
    assert kv.num_free_blocks == 16 - 4
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_ids(b)] == [1, 1, 1]
    kv.free(b)
    assert kv.num_free_blocks == 16


def test_different_prefix_does_not_share() -> None:
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = make_req("a", prompt(40))
    b = make_req("b", [7] + prompt(40)[1:])  # first token differs: hashes chain, nothing hits
    admit(kv, a)
    assert admit(kv, b) == []
    assert set(kv.block_ids(a)).isdisjoint(kv.block_ids(b))


@pytest.mark.parametrize(
    ("num_tokens", "expected_hit_blocks"),
    [(32, 1), (33, 2), (47, 2), (48, 2), (49, 3), (16, 0), (1, 0)],
)
def test_full_hit_still_recomputes_the_last_token(
    num_tokens: int, expected_hit_blocks: int
) -> None:
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = make_req("a", prompt(num_tokens))
    admit(kv, a)
    b = make_req("b", prompt(num_tokens))
    hits = kv.get_computed_blocks(b)
    assert len(hits) == expected_hit_blocks
    num_computed = len(hits) * BS
    assert num_computed <= num_tokens - 1
    assert num_computed == (num_tokens - 1) // BS * BS
    assert [h.block_id for h in hits] == kv.block_ids(a)[:expected_hit_blocks]


def test_hits_on_freed_cached_blocks_leave_the_free_queue() -> None:
    kv = KVCacheManager(6, BS, enable_caching=True)
    a = make_req("a", prompt(40))
    admit(kv, a)
    a_blocks = kv.block_ids(a)
    kv.free(a)
    assert kv.num_free_blocks == 6
    b = make_req("b", prompt(40))
    hits = admit(kv, b)
    assert hits == a_blocks[:2]
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in hits)
    assert not set(hits) & set(free_queue(kv))
    # Two hits taken from the free queue plus one new block.
    assert kv.num_free_blocks == 3
    # What is left to allocate never includes the hit blocks.
    c = make_req("c", prompt(48, seed=3))
    kv.allocate_slots(c, 48)
    assert set(kv.block_ids(c)).isdisjoint(kv.block_ids(b))
    assert kv.num_free_blocks == 0


def test_allocate_slots_returns_none_and_changes_nothing_when_too_few_free() -> None:
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = make_req("a", prompt(48))
    kv.allocate_slots(a, 48)
    b = make_req("b", prompt(32, seed=2))
    assert kv.allocate_slots(b, 32) is None
    assert kv.num_free_blocks == 1
    assert kv.block_ids(b) == []
    assert "b" not in kv.req_blocks
    # A running request that cannot grow keeps its table unchanged.
    a.num_computed_tokens = 48
    a_blocks = kv.block_ids(a)
    assert kv.allocate_slots(a, 17 + 16) is None  # needs 3 more blocks, 1 free
    assert kv.block_ids(a) == a_blocks
    assert kv.num_free_blocks == 1
    assert kv.allocate_slots(a, 16) is not None
    assert kv.num_free_blocks == 0


def test_allocate_slots_counts_free_hits_against_the_free_blocks() -> None:
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = make_req("a", prompt(48))
    admit(kv, a)
    kv.free(a)  # three cached blocks in the free queue, plus one never used
    filler = make_req("f", prompt(16, seed=5))
    kv.allocate_slots(filler, 16)  # takes the never-used block 3
    assert kv.num_free_blocks == 3
    b = make_req("b", prompt(48) + prompt(40, seed=9))  # three hit blocks + 40 new tokens
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 3
    # 3 free hits + 3 new blocks for 40 tokens after 48 > 3 free: refused, nothing touched.
    assert kv.allocate_slots(b, b.num_tokens - 48, hits) is None
    assert all(h.ref_cnt == 0 for h in hits)
    assert kv.num_free_blocks == 3
    assert "b" not in kv.req_blocks
    assert all(h.block_hash is not None and kv.pool.get_cached(h.block_hash) is h for h in hits)


def test_blocks_filled_by_decode_tokens_are_published() -> None:
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = make_req("a", prompt(10))
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    assert kv.pool.cached == {}
    for t in range(6):
        a.append_token(50 + t)
        kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert len(kv.pool.cached) == 1
    b = make_req("b", a.all_token_ids + [1])  # the prompt plus what "a" generated
    assert [h.block_id for h in kv.get_computed_blocks(b)] == kv.block_ids(a)[:1]


def image(h: str, offset: int, length: int) -> ImageInput:
    return ImageInput(h, offset, length)


def image_prompt(n: int, img: ImageInput) -> list[int]:
    ids = prompt(n)
    ids[img.offset:img.end] = [PLACEHOLDER] * img.length
    return ids


def test_block_hashes_include_the_image_hash() -> None:
    # Same token ids (placeholders are the same for every picture), image [24, 44) overlaps
    # blocks 1 and 2: block 0 is shared, blocks 1 and 2 are not.
    kv = KVCacheManager(32, BS, enable_caching=True)
    img_a, img_b = image("cat", 24, 20), image("dog", 24, 20)
    a = make_req("a", image_prompt(64, img_a), [img_a])
    b = make_req("b", image_prompt(64, img_b), [img_b])
    assert a.all_token_ids == b.all_token_ids
    admit(kv, a)
    hits_b = admit(kv, b)
    assert hits_b == kv.block_ids(a)[:1]
    assert kv.block_ids(b)[0] == kv.block_ids(a)[0]
    assert set(kv.block_ids(b)[1:]).isdisjoint(kv.block_ids(a))
    # The same picture shares every block up to the recomputed last token.
    c = make_req("c", image_prompt(64, image("cat", 24, 20)), [image("cat", 24, 20)])
    hits_c = admit(kv, c)
    assert hits_c == kv.block_ids(a)[:3]
    assert kv.pool.blocks[kv.block_ids(a)[0]].ref_cnt == 3
    assert kv.pool.blocks[kv.block_ids(a)[1]].ref_cnt == 2


def test_block_hashes_include_the_position_within_the_image() -> None:
    # Same picture and same token ids, but the image starts one block later: the blocks that
    # hold a different slice of the image must differ.
    kv = KVCacheManager(32, BS, enable_caching=True)
    tokens = [PLACEHOLDER] * 64
    a = make_req("a", tokens, [image("cat", 0, 48)])
    b = make_req("b", tokens, [image("cat", 16, 48)])
    admit(kv, a)
    assert admit(kv, b) == []


def test_block_after_an_image_differs_when_the_image_differs() -> None:
    # Blocks after the image do not overlap it, but they chain to a block that does.
    kv = KVCacheManager(32, BS, enable_caching=True)
    img_a, img_b = image("cat", 0, 16), image("dog", 0, 16)
    a = make_req("a", image_prompt(64, img_a), [img_a])
    b = make_req("b", image_prompt(64, img_b), [img_b])
    admit(kv, a)
    assert admit(kv, b) == []


def test_caching_disabled_gives_no_hits() -> None:
    kv = KVCacheManager(16, BS, enable_caching=False)
    a = make_req("a", prompt(64))
    assert admit(kv, a) == []
    assert kv.pool.cached == {}
    b = make_req("b", prompt(64))
    assert kv.get_computed_blocks(b) == []
    assert admit(kv, b) == []
    assert set(kv.block_ids(a)).isdisjoint(kv.block_ids(b))
    kv.free(a)
    c = make_req("c", prompt(64))
    assert kv.get_computed_blocks(c) == []
