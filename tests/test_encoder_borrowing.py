"""Encoder outputs borrowing free KV blocks: scheduler bookkeeping with mock requests, no model.

Beyond its reserve (seed 001's budget), the encoder cache keeps entries no running request
needs in KV blocks that are free; a hit takes them back; the KV cache takes the blocks back the
moment it needs them, before evicting any prefix-cache block and before preempting anyone.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mmserve.engine.block_pool import BlockPool
from mmserve.engine.encoder_cache import EncoderCacheManager, KVLending
from mmserve.engine.request import RequestStatus
from mmserve.inputs import ImageInput
from mmserve.step import ModelOutput
from mmserve.worker.model_runner import CPUModelRunner
from tests.test_scheduler import (
    SimulatedEncoderOutputs,
    assert_no_leaks,
    check_step,
    make_req,
    make_sched,
)

BS = 16


def image_request(rid: str, image: str, text: int = 8, **params):
    """An image of 32 tokens at the start, then ``text`` tokens."""
    return make_req(rid, 32 + text, [ImageInput(image, 0, 32)], seed=hash(rid) % 97, **params)


def run(sched, runner: SimulatedEncoderOutputs | None = None, max_steps: int = 50) -> list:
    runner = runner or SimulatedEncoderOutputs(sched.kv_cache)
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_step(sched, out)
        runner.apply(out, sched)
        sched.update(out, ModelOutput({r.request_id: 5 for r in out.requests if r.sample}))
        outs.append(out)
    assert not sched.has_unfinished()
    return outs


def one_item_sched(**kwargs):
    """A reserve of one 32-token image; 64 KV blocks of 16 tokens."""
    options = {"max_num_seqs": 1, "block_size": BS, "num_blocks": 64, "max_tokens_per_item": 32,
               "encoder_cache_size": 32, "enable_caching": False, "borrowing": True}
    return make_sched(**{**options, **kwargs})


def test_an_entry_leaving_the_reserve_borrows_free_blocks_and_comes_back_on_a_hit() -> None:
    sched = one_item_sched()
    runner = SimulatedEncoderOutputs(sched.kv_cache)
    sched.add_request(image_request("a", "img-a"))
    run(sched, runner)
    sched.add_request(image_request("b", "img-b"))
    outs = run(sched, runner)
    spills = {h: b for out in outs for h, b in out.encoder_spills.items()}
    assert list(spills) == ["img-a"] and len(spills["img-a"]) == 2  # 32 tokens, 16 per block
    enc = sched.encoder_cache
    assert enc.is_borrowed("img-a") and sched.kv_cache.pool.num_lent == 2
    assert sched.kv_cache.num_free_blocks == 64  # lent blocks still count as free
    sched.add_request(image_request("c", "img-a"))
    outs = run(sched, runner)
    assert "img-a" not in {h for out in outs for h in out.images_to_encode}  # not re-encoded
    assert outs[0].encoder_restores == {"img-a": (32, spills["img-a"])}
    assert "img-b" in outs[0].encoder_spills  # made room for it in the reserve
    assert enc.num_restores == 1 and enc.num_hits == 1 and enc.num_misses == 2
    assert enc.num_evictions == 0
    assert_no_leaks(sched)


def test_without_borrowing_the_entry_is_dropped_and_encoded_again() -> None:
    sched = one_item_sched(borrowing=False)
    runner = SimulatedEncoderOutputs(sched.kv_cache)
    for rid, image in (("a", "img-a"), ("b", "img-b"), ("c", "img-a")):
        sched.add_request(image_request(rid, image))
        run(sched, runner)
    enc = sched.encoder_cache
    assert enc.num_misses == 3 and enc.num_evictions == 2 and not enc.borrowed


def test_kv_cache_takes_borrowed_blocks_before_prefix_blocks_and_without_preempting() -> None:
    sched = one_item_sched(num_blocks=12, enable_caching=True, max_num_seqs=2,
                           max_num_batched_tokens=256)
    pool = sched.kv_cache.pool
    runner = SimulatedEncoderOutputs(sched.kv_cache)
    for rid, image in (("a", "img-a"), ("b", "img-b"), ("c", "img-c")):
        sched.add_request(image_request(rid, image))
        run(sched, runner)
    enc = sched.encoder_cache
    assert set(enc.borrowed) == {"img-a", "img-b"} and pool.num_lent == 4
    prefix_blocks = pool.num_cached_free_blocks
    assert prefix_blocks > 0 and pool.num_empty_blocks == 12 - 4 - prefix_blocks
    # A long text prompt needs every block but the prefix-cached ones, and one more.
    long = make_req("long", BS * (12 - prefix_blocks) - 4, seed=7, max_tokens=2)
    sched.add_request(long)
    run(sched, runner)
    assert enc.num_kv_pressure_evictions == 2 and not enc.borrowed and pool.num_lent == 0
    assert pool.num_evictions == 0  # every prefix block is still cached
    assert sched.num_preemptions == 0
    assert_no_leaks(sched)


def test_abort_and_preemption_leave_nothing_borrowed_behind() -> None:
    sched = one_item_sched(num_blocks=10, max_num_seqs=3, max_num_batched_tokens=256)
    for i in range(6):
        sched.add_request(image_request(f"r{i}", f"img-{i % 4}", text=30, max_tokens=40))
    runner = SimulatedEncoderOutputs(sched.kv_cache)
    for step_no in range(200):
        if not sched.has_unfinished():
            break
        if step_no == 3:
            sched.finish_request(sorted(sched.requests)[0], RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        check_step(sched, out)
        runner.apply(out, sched)
        sched.update(out, ModelOutput({r.request_id: 5 for r in out.requests if r.sample}))
    assert sched.num_preemptions > 0
    assert_no_leaks(sched)
    enc = sched.encoder_cache
    assert sched.kv_cache.pool.num_lent == enc.num_borrowed_blocks
    enc.evict_unreferenced()  # a cold start gives every borrowed block back
    assert sched.kv_cache.pool.num_lent == 0 and not enc.borrowed


def test_a_spill_taken_back_in_the_same_step_is_dropped_not_copied() -> None:
    pool = BlockPool(8, enable_caching=False)
    cache = EncoderCacheManager(32, KVLending(pool, block_elements=BS, token_elements=1))
    a, b = image_request("a", "img-a"), image_request("b", "img-b")
    cache.allocate(a, 0)
    cache.release(a, 0)
    cache.allocate(b, 0)  # img-a leaves the reserve for two lent blocks
    assert cache.is_borrowed("img-a") and pool.num_lent == 2
    pool.allocate(7)  # the KV cache needs all but one block: img-a gives its two back
    ops = cache.take_ops()
    assert ops.spills == {} and ops.freed == ["img-a"] and not cache.borrowed
    assert cache.num_kv_pressure_evictions == 1


def test_a_hit_on_an_entry_spilled_in_the_same_step_keeps_the_tensor() -> None:
    pool = BlockPool(8, enable_caching=False)
    cache = EncoderCacheManager(64, KVLending(pool, block_elements=BS, token_elements=1))
    a, b, c = (image_request(r, f"img-{r}") for r in "abc")
    for req in (a, b):
        cache.allocate(req, 0)
        cache.release(req, 0)
    cache.allocate(c, 0)  # the oldest, img-a, spills
    again = image_request("a2", "img-a")
    cache.restore(again, 0)  # and is wanted at once: img-b spills to make room
    ops = cache.take_ops()
    assert ops.restores == {} and set(ops.spills) == {"img-b"} and ops.freed == []
    assert "img-a" in cache.entries and pool.num_lent == 2


def test_eviction_keeps_what_waiting_requests_show() -> None:
    """Queue-aware: of the unreferenced entries, the one a waiting request shows goes last,
    even though it is the oldest; plain LRU evicts it first."""
    def waiting() -> set[str]:
        return {"img-a"}

    for wanted, evicted in ((waiting, "img-b"), (None, "img-a")):
        cache = EncoderCacheManager(64, wanted=wanted)
        for rid in "ab":
            req = image_request(rid, f"img-{rid}")
            cache.allocate(req, 0)
            cache.release(req, 0)
        cache.allocate(image_request("c", "img-c"), 0)
        assert cache.take_ops().freed == [evicted]


def test_kv_pressure_gives_back_entries_nobody_waits_for_first() -> None:
    pool = BlockPool(8, enable_caching=False)
    waiting = {"img-a"}
    cache = EncoderCacheManager(32, KVLending(pool, block_elements=BS, token_elements=1),
                                wanted=lambda: waiting)
    for rid in "abc":
        req = image_request(rid, f"img-{rid}")
        cache.allocate(req, 0)
        cache.release(req, 0)
    assert list(cache.borrowed) == ["img-a", "img-b"]  # oldest first, two blocks each
    pool.allocate(5)  # the KV cache needs one lent block's pair back
    assert list(cache.borrowed) == ["img-a"]  # img-b went, though img-a is older


def test_a_full_prefix_hit_over_an_image_neither_encodes_nor_pins_it() -> None:
    """Image tokens wholly inside prefix-cache blocks need no embeddings: a second request
    with the same image-and-text prefix schedules no encoder work and holds no entry."""
    sched = one_item_sched(enable_caching=True, max_num_batched_tokens=128)
    runner = SimulatedEncoderOutputs(sched.kv_cache)
    first = make_req("first", 70, [ImageInput("img-a", 0, 32)], seed=3)
    sched.add_request(first)
    run(sched, runner)
    sched.encoder_cache.evict_unreferenced()  # the embeddings are gone; the KV blocks stay
    second = make_req("second", 70, [ImageInput("img-a", 0, 32)], seed=3)
    sched.add_request(second)
    outs = run(sched, runner)
    assert outs[0].requests[0].start_pos == 64  # 4 blocks hit: the image and beyond
    assert all(not out.images_to_encode and not out.encoder_restores for out in outs)
    assert sched.encoder_cache.num_hits == 0 and sched.encoder_cache.num_misses == 1


def test_lending_may_take_prefix_blocks_only_when_told() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks):
        pool.cache_block(block, f"h{i}".encode())
    pool.free(blocks[:2])  # two prefix-cached free blocks, no empty one
    assert pool.lend(1) is None
    assert pool.lend(1, take_prefix_blocks=True) == [0]
    assert pool.get_cached(b"h0") is None and pool.num_evictions == 1
    assert pool.get_cached(b"h1") is blocks[1]


def test_plan_says_what_borrowing_does_and_the_flag_turns_it_off(clip_llama: str) -> None:
    from mmserve import LLM

    on = LLM(clip_llama, dtype="float32").engine
    plan = on.plan
    assert plan.encoder_borrowing and plan.encoder_flops_per_byte > 0
    assert plan.prefill_flops_per_byte > 0
    assert "stay in free KV blocks" in plan.summary()
    assert on.scheduler.encoder_cache.lending.take_prefix_blocks == (
        plan.encoder_flops_per_byte > plan.prefill_flops_per_byte)
    off = LLM(clip_llama, dtype="float32", encoder_cache_borrowing=False).engine
    assert not off.plan.encoder_borrowing and off.scheduler.encoder_cache.lending is None
    assert "borrowing         off" in off.plan.summary()


@pytest.mark.parametrize(("shapes", "tensors"), [([(2, 8)] * 3, 1),
                                                  ([(2, 8), (2, 8), (1, 16), (2, 4)], 3)],
                         ids=["layers of one shape", "layers of several"])
def test_an_encoder_output_comes_back_from_borrowed_blocks_as_it_went(shapes, tensors) -> None:
    """Written piece after piece (each layer's keys, then its values), the blocks' share of
    each, the last piece's tail zeros; read back the same; no other block touched.
    Consecutive layers of one shape share one tensor (one copy each way over all of them)."""
    layers = [SimpleNamespace(num_kv_heads=h, head_dim=d, kv_cache=None) for h, d in shapes]
    model = SimpleNamespace(attention_layers=lambda: layers, hidden_size=24,
                            vocab_size=16)
    runner = CPUModelRunner(model, 12, 4, torch.float32, 0)
    assert [a.kv_cache for a in layers] == runner.kv_caches
    assert len(runner._kv_groups) == tensors
    embeds = torch.randn(38, 24)  # 912 values: 3 blocks of 384 (or 320) over every piece
    block_ids = [7, 2, 9]
    before = [c.clone() for c in runner.kv_caches]
    runner._write_kv_blocks(block_ids, embeds)
    assert torch.equal(runner._read_kv_blocks(block_ids, 38), embeds)
    others = [b for b in range(12) if b not in block_ids]
    for old, new in zip(before, runner.kv_caches, strict=True):
        assert torch.equal(old[:, others], new[:, others])
    flat, start = embeds.reshape(-1), 0
    for cache in runner.kv_caches:
        for piece in cache:  # keys, then values
            values = piece[block_ids].reshape(-1)
            expected = flat[start:start + len(values)]
            assert torch.equal(values[:len(expected)], expected)
            assert not values[len(expected):].any()
            start += len(values)
