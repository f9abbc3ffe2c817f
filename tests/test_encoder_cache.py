"""Encoder cache: the budget of seed 001 (vLLM PR #11895) and the hash-keyed manager."""

from __future__ import annotations

import pytest

from mmserve.engine.encoder_cache import (
    EncoderBudget,
    EncoderCacheManager,
    compute_encoder_budget,
)
from mmserve.engine.request import Request
from mmserve.inputs import ImageInput
from mmserve.sampling_params import SamplingParams

# ----------------------------------------------------------------------------- budget


def test_budget_item_larger_than_batch_is_one_item_plus_one() -> None:
    # The seed-001 numbers: an 8687-token image cannot be prefilled in one 8192-token step.
    budget = compute_encoder_budget(8687, 8192, max_num_seqs=2, max_items_per_prompt=1)
    assert budget == EncoderBudget(compute_tokens=8687, cache_tokens=2 * 8687,
                                   max_tokens_per_item=8687)
    assert budget.cache_items == 2


def test_budget_cdiv_branch_plus_one() -> None:
    # cdiv(8192, 576) = 15, plus one = 16 items of 576 tokens.
    budget = compute_encoder_budget(576, 8192, max_num_seqs=256, max_items_per_prompt=1)
    assert budget.cache_tokens == 16 * 576 == 9216
    assert budget.cache_items == 16
    assert budget.compute_tokens == 8192
    assert budget.max_tokens_per_item == 576


def test_budget_cdiv_exact_division_plus_one() -> None:
    budget = compute_encoder_budget(512, 8192, max_num_seqs=256, max_items_per_prompt=4)
    assert budget.cache_tokens == (16 + 1) * 512


def test_budget_item_equal_to_batch_uses_cdiv_branch() -> None:
    budget = compute_encoder_budget(8192, 8192, max_num_seqs=8, max_items_per_prompt=1)
    assert budget.cache_tokens == 2 * 8192
    assert budget.compute_tokens == 8192


@pytest.mark.parametrize(
    ("max_num_seqs", "max_items_per_prompt", "items"),
    [(4, 2, 8), (1, 1, 1), (3, 5, 15), (16, 1, 16), (17, 1, 16)],
)
def test_budget_is_capped_by_seqs_times_items_per_prompt(
    max_num_seqs: int, max_items_per_prompt: int, items: int
) -> None:
    budget = compute_encoder_budget(576, 8192, max_num_seqs, max_items_per_prompt)
    assert budget.cache_tokens == items * 576


def test_budget_cap_applies_to_the_large_item_branch() -> None:
    budget = compute_encoder_budget(8687, 8192, max_num_seqs=1, max_items_per_prompt=1)
    assert budget.cache_tokens == 8687
    assert budget.compute_tokens == 8687


def test_budget_compute_is_max_of_batch_and_item() -> None:
    assert compute_encoder_budget(100, 8192, 4, 1).compute_tokens == 8192
    assert compute_encoder_budget(9000, 8192, 4, 1).compute_tokens == 9000


def test_budget_user_override_accepted_when_it_holds_one_item() -> None:
    exact = compute_encoder_budget(8687, 8192, 2, 1, encoder_cache_size=8687)
    assert exact.cache_tokens == 8687
    assert exact.cache_items == 1
    assert exact.compute_tokens == 8687
    large = compute_encoder_budget(576, 8192, 256, 1, encoder_cache_size=100_000)
    assert large.cache_tokens == 100_000
    assert large.compute_tokens == 8192


def test_budget_user_override_below_one_item_is_an_error() -> None:
    with pytest.raises(ValueError, match="encoder_cache_size=8686"):
        compute_encoder_budget(8687, 8192, 2, 1, encoder_cache_size=8686)


def test_budget_rejects_non_positive_item_size() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_item"):
        compute_encoder_budget(0, 8192, 2, 1)


# ----------------------------------------------------------------------------- manager


def make_req(rid: str, *images: tuple[str, int]) -> Request:
    """A request whose images are (hash, length) pairs laid out back to back."""
    inputs, offset = [], 0
    for h, length in images:
        inputs.append(ImageInput(h, offset, length))
        offset += length
    return Request(rid, [9] * (offset + 1), SamplingParams(), images=inputs, eos_token_id=2)


def hit(cache: EncoderCacheManager, req: Request, idx: int) -> bool:
    """The scheduler's lookup: a cached image gets a reference for ``req``."""
    if not cache.is_cached(req.images[idx].hash):
        return False
    cache.add_reference(req, idx)
    return True


def test_miss_then_hit_from_another_request() -> None:
    cache = EncoderCacheManager(300)
    a, b = make_req("a", ("x", 100)), make_req("b", ("x", 100))
    assert not hit(cache, a, 0)
    assert cache.num_hits == 0
    cache.allocate(a, 0)
    assert cache.num_misses == 1
    assert cache.num_free_tokens == 200
    assert cache.num_used_tokens == 100
    assert cache.holds_reference(a, 0)
    assert not cache.holds_reference(b, 0)
    assert hit(cache, b, 0)
    assert cache.num_hits == 1
    assert cache.holds_reference(b, 0)
    assert cache.entries["x"].refs == {"a", "b"}
    # Asking again for a request that already holds it is not another hit.
    assert hit(cache, b, 0)
    assert cache.num_hits == 1
    assert cache.num_referenced_entries() == 1
    assert cache.num_free_tokens == 200  # shared, not stored twice


def test_unreferenced_entry_stays_cached_and_can_be_hit_again() -> None:
    cache = EncoderCacheManager(300)
    a, b, c = make_req("a", ("x", 100)), make_req("b", ("x", 100)), make_req("c", ("x", 100))
    cache.allocate(a, 0)
    hit(cache, b, 0)
    cache.release(a, 0)
    assert cache.num_referenced_entries() == 1
    cache.release(b, 0)
    assert cache.num_referenced_entries() == 0
    assert "x" in cache.entries
    assert cache.num_used_tokens == 100
    assert cache.num_reclaimable_tokens == 300
    assert hit(cache, c, 0)
    assert cache.num_hits == 2
    assert cache.num_misses == 1
    assert cache.num_reclaimable_tokens == 200
    assert cache.take_ops().freed == []
    assert cache.num_evictions == 0


def test_release_is_idempotent_and_ignores_strangers() -> None:
    cache = EncoderCacheManager(200)
    a, b = make_req("a", ("x", 100)), make_req("b", ("x", 100))
    cache.allocate(a, 0)
    cache.release(b, 0)  # never referenced it
    assert cache.holds_reference(a, 0)
    cache.release(a, 0)
    cache.release(a, 0)
    assert list(cache._unreferenced) == ["x"]
    assert cache.num_reclaimable_tokens == 200


def test_eviction_only_when_space_is_needed() -> None:
    cache = EncoderCacheManager(300)
    a, b = make_req("a", ("x", 100)), make_req("b", ("y", 100))
    cache.allocate(a, 0)
    cache.release(a, 0)
    cache.allocate(b, 0)  # 100 tokens still free: "x" stays
    assert set(cache.entries) == {"x", "y"}
    assert cache.take_ops().freed == []
    assert cache.num_evictions == 0


def test_eviction_is_oldest_unreferenced_first_and_never_referenced() -> None:
    cache = EncoderCacheManager(300)
    reqs = {h: make_req(f"r{h}", (h, 100)) for h in "abcde"}
    for h in "abc":
        cache.allocate(reqs[h], 0)
    cache.release(reqs["c"], 0)
    cache.release(reqs["a"], 0)  # unreferenced order: c, then a; b stays referenced
    cache.allocate(reqs["d"], 0)
    assert set(cache.entries) == {"a", "b", "d"}
    assert cache.take_ops().freed == ["c"]
    assert cache.take_ops().freed == []  # reported once
    cache.allocate(reqs["e"], 0)
    assert set(cache.entries) == {"b", "d", "e"}
    assert cache.take_ops().freed == ["a"]
    assert cache.num_evictions == 2
    assert cache.num_free_tokens == 0
    assert cache.num_reclaimable_tokens == 0
    assert cache.num_reclaimable_tokens == 0


def test_eviction_frees_as_many_entries_as_needed() -> None:
    cache = EncoderCacheManager(300)
    small = [make_req(f"s{i}", (f"s{i}", 100)) for i in range(3)]
    for r in small:
        cache.allocate(r, 0)
        cache.release(r, 0)
    big = make_req("big", ("big", 250))
    assert cache.num_reclaimable_tokens == 300
    cache.allocate(big, 0)
    assert cache.take_ops().freed == ["s0", "s1", "s2"]
    assert cache.num_free_tokens == 50


def test_rehit_moves_entry_to_the_back_of_the_eviction_order() -> None:
    cache = EncoderCacheManager(200)
    a, b, c = make_req("a", ("x", 100)), make_req("b", ("y", 100)), make_req("c", ("x", 100))
    cache.allocate(a, 0)
    cache.allocate(b, 0)
    cache.release(a, 0)
    cache.release(b, 0)
    assert hit(cache, c, 0)  # "x" is used again and released after "y"
    cache.release(c, 0)
    cache.allocate(make_req("d", ("z", 100)), 0)
    assert cache.take_ops().freed == ["y"]
    assert "x" in cache.entries


def test_reclaimable_space_counts_free_and_unreferenced_tokens() -> None:
    cache = EncoderCacheManager(200)
    a, b = make_req("a", ("x", 100)), make_req("b", ("y", 100))
    assert cache.num_reclaimable_tokens == 200
    cache.allocate(a, 0)
    cache.allocate(b, 0)
    assert cache.num_reclaimable_tokens == 0  # full of referenced entries
    assert cache.evictable_tokens("y") == 0
    cache.release(b, 0)
    assert cache.num_reclaimable_tokens == 100
    assert cache.evictable_tokens("y") == 100
    hit(cache, make_req("c", ("y", 100)), 0)  # referenced again: no longer evictable
    assert cache.num_reclaimable_tokens == 0
    assert cache.evictable_tokens("y") == 0


def test_release_all_and_num_referenced_entries() -> None:
    cache = EncoderCacheManager(400)
    a = make_req("a", ("x", 100), ("y", 100))
    b = make_req("b", ("y", 100), ("z", 100))
    cache.allocate(a, 0)
    cache.allocate(a, 1)
    assert hit(cache, b, 0)
    cache.allocate(b, 1)
    assert cache.num_referenced_entries() == 3
    cache.release_all(a)
    assert cache.num_referenced_entries() == 2
    assert cache.entries["y"].refs == {"b"}
    cache.release_all(b)
    assert cache.num_referenced_entries() == 0
    assert set(cache.entries) == {"x", "y", "z"}
    assert cache.num_reclaimable_tokens == 400
    cache.release_all(make_req("nobody", ("x", 100)))  # harmless
    assert cache.num_reclaimable_tokens == 400


def test_evict_unreferenced_keeps_what_requests_still_use() -> None:
    cache = EncoderCacheManager(300)
    a, b = make_req("a", ("x", 100)), make_req("b", ("y", 100))
    cache.allocate(a, 0)
    cache.allocate(b, 0)
    cache.release(a, 0)
    assert cache.evict_unreferenced() == 1
    assert cache.take_ops().freed == ["x"]
    assert not cache.is_cached("x") and cache.is_cached("y")
    assert cache.num_free_tokens == 200 and cache.num_reclaimable_tokens == 200
    assert cache.num_evictions == 0  # not an eviction forced by a lack of space
    cache.release(b, 0)
    assert cache.evict_unreferenced() == 1 and cache.num_free_tokens == 300
