"""Scheduler: one token budget per step shared by decodes, prefill chunks and images.

Bookkeeping only: a simulated runner samples a token for every request whose chunk reaches its
last known token. Every drive checks per-step invariants and ends with a leak check.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest

from mmserve.engine.encoder_cache import KVLending, compute_encoder_budget
from mmserve.engine.kv_cache_manager import KVCacheManager, cdiv
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.scheduler import Scheduler, SchedulerConfig
from mmserve.inputs import ImageInput
from mmserve.sampling_params import SamplingParams
from mmserve.step import ModelOutput, SchedulerOutput
from mmserve.worker.block_tables import BlockTables

PLACEHOLDER = 9
EOS = 2
TOKEN = 5  # what the simulated runner samples unless told otherwise


# ----------------------------------------------------------------------------- helpers


def make_sched(
    *,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 4096,
    block_size: int = 16,
    num_blocks: int = 256,
    enable_caching: bool = True,
    max_tokens_per_item: int = 32,
    max_items_per_prompt: int = 2,
    encoder_cache_size: int | None = None,
    borrowing: bool = False,
) -> Scheduler:
    """``borrowing``: encoder outputs may borrow free KV blocks, one embedding token per
    block slot (an entry of n tokens takes cdiv(n, block_size) blocks)."""
    kv = KVCacheManager(num_blocks, block_size, enable_caching)
    return Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, block_size),
        kv,
        compute_encoder_budget(max_tokens_per_item, max_num_batched_tokens, max_num_seqs,
                               max_items_per_prompt, encoder_cache_size),
        KVLending(kv.pool, block_elements=2 * block_size, token_elements=2)
        if borrowing else None,
    )


def make_req(
    rid: str,
    num_tokens: int,
    images: list[ImageInput] | None = None,
    *,
    seed: int = 0,
    eos_token_id: int | None = EOS,
    **params: object,
) -> Request:
    """A prompt of ``num_tokens`` ids (never EOS) with placeholder ids under each image."""
    ids = [100 + (seed * 7919 + i * 31) % 5000 for i in range(num_tokens)]
    for img in images or []:
        assert img.end <= num_tokens
        ids[img.offset:img.end] = [PLACEHOLDER] * img.length
    params.setdefault("max_tokens", 4)
    return Request(rid, ids, SamplingParams(**params), images=images,  # type: ignore[arg-type]
                   eos_token_id=eos_token_id)


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """Invariants that hold after every ``schedule()``."""
    kv = sched.kv_cache
    bs = kv.block_size
    assert out.num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(out.requests) <= sched.max_num_seqs
    assert len(sched.running) <= sched.max_num_seqs
    rids = [r.request_id for r in out.requests]
    assert len(rids) == len(set(rids)), rids
    assert sum(out.images_to_encode.values()) <= sched.encoder_compute_budget
    scheduled_images = {(img.hash, img.length) for s in out.requests
                        for img in sched.requests[s.request_id].images}
    for h, length in out.images_to_encode.items():
        assert (h, length) in scheduled_images  # an image of a request scheduled this step
        assert h in sched.encoder_cache.entries
    for s in out.requests:
        n = len(s.token_ids)
        assert n > 0, f"{s.request_id} scheduled {n} tokens"
        req = sched.requests[s.request_id]
        assert req.status == RequestStatus.RUNNING
        assert req.num_computed_tokens == s.start_pos + n
        assert s.token_ids == req.all_token_ids[s.start_pos:s.start_pos + n]
        assert s.sample == (s.start_pos + n == req.num_tokens)
        assert s.positions == req.positions(s.start_pos, s.start_pos + n)
        # The blocks not sent before, up to the request's whole table: enough for the chunk.
        assert s.block_ids == kv.block_ids(req, s.blocks_from)
        assert s.blocks_from + len(s.block_ids) == len(kv.block_ids(req))
        assert len(kv.block_ids(req)) * bs >= s.start_pos + n
        assert len(set(kv.block_ids(req))) == len(kv.block_ids(req))
        # Every placeholder in the chunk is covered by exactly one slice, of an image that the
        # runner has (cached or encoded this step).
        expected = []
        for img in req.images:
            lo, hi = max(img.offset, s.start_pos), min(img.end, s.start_pos + n)
            if lo < hi:
                expected.append((img.hash, lo - img.offset, lo - s.start_pos, hi - lo))
        got = [(sl.image_hash, sl.src_start, sl.dst_start, sl.length) for sl in s.image_slices]
        assert got == expected
        for sl in s.image_slices:
            assert sl.image_hash in sched.encoder_cache.entries
    # Steady decodes travel as decode rows (columns), first in the batch; everything else as
    # objects: prompt chunks, a request with a grammar, and a request's first step after a
    # prefix hit that covered all but its last token (its images not yet looked at).
    assert out.request_ids()[:len(out.decodes)] == out.decodes.request_ids
    for rid in out.decodes.request_ids:
        req = sched.requests[rid]
        assert req.num_computed_tokens == req.num_tokens > req.num_prompt_tokens
        assert req.grammar is None
    for s in out.chunks:
        req = sched.requests[s.request_id]
        assert (len(s.token_ids) > 1 or s.start_pos < req.num_prompt_tokens or not s.sample
                or req.grammar is not None or s.blocks_from == 0), s.request_id
    # Block ownership: a block in k live tables has ref_cnt k; shared ones are cached prefix
    # blocks; owned blocks are never free; free + owned = all.
    owners: Counter[int] = Counter()
    for rid, blocks in kv.req_blocks.items():
        assert rid in sched.requests
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), (rid, ids)
        owners.update(ids)
    free = set(kv.pool.free_block_ids())
    for bid, k in owners.items():
        block = kv.pool.blocks[bid]
        assert block.ref_cnt == k, (bid, block.ref_cnt, k)
        assert bid not in free
        if k > 1:
            assert block.block_hash is not None
    # Borrowed entries hold the lent blocks, which are neither owned nor in a free queue.
    lent = [b for _, blocks in sched.encoder_cache.borrowed.values() for b in blocks]
    assert len(lent) == len(set(lent)) == kv.pool.num_lent
    assert not set(lent) & (free | set(owners))
    assert not set(sched.encoder_cache.borrowed) & set(sched.encoder_cache.entries)
    assert len(free) + len(owners) + len(lent) == kv.pool.num_blocks
    # Waiting (and preempted) requests hold no KV blocks.
    for req in sched.waiting:
        assert req.request_id not in kv.req_blocks
        assert req.num_computed_tokens == 0


Sampler = Callable[[str, int], int]


def step(
    sched: Scheduler, sampler: Sampler | None = None, step_no: int = 0
) -> SchedulerOutput:
    out = sched.schedule()
    check_step(sched, out)
    sample = sampler or (lambda rid, i: TOKEN)
    sched.update(out, ModelOutput({r.request_id: sample(r.request_id, step_no)
                                   for r in out.requests if r.sample}))
    return out


def drain(
    sched: Scheduler, max_steps: int = 100, sampler: Sampler | None = None
) -> list[SchedulerOutput]:
    outs = []
    for i in range(max_steps):
        if not sched.has_unfinished():
            return outs
        outs.append(step(sched, sampler, i))
    assert not sched.has_unfinished(), f"did not drain in {max_steps} steps: {sched.running}"
    return outs


def assert_no_leaks(sched: Scheduler) -> None:
    assert not sched.has_unfinished()
    assert sched.requests == {}
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.pool.num_blocks
    assert sched.kv_cache.req_blocks == {}
    assert all(b.ref_cnt == 0 for b in sched.kv_cache.pool.blocks)
    assert sched.encoder_cache.num_referenced_entries() == 0


def counts(out: SchedulerOutput) -> dict[str, int]:
    return {r.request_id: len(r.token_ids) for r in out.requests}


# ----------------------------------------------------------------------------- budget, order


def test_token_budget_and_running_before_waiting() -> None:
    sched = make_sched(max_num_batched_tokens=64)
    reqs = [make_req(f"r{i}", 40, seed=i, max_tokens=3) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out1 = step(sched)
    assert counts(out1) == {"r0": 40, "r1": 24}
    assert [r.request_id for r in out1.requests] == ["r0", "r1"]
    out2 = step(sched)
    # Running first, in admission order: r0 decodes, r1 finishes its prompt, then r2.
    assert [r.request_id for r in out2.requests] == ["r0", "r1", "r2"]
    assert out2.decodes.request_ids == ["r0"]
    assert counts(out2) == {"r0": 1, "r1": 16, "r2": 40}
    assert out2.num_scheduled_tokens == 57
    drain(sched)
    assert all(r.num_output_tokens == 3 for r in reqs)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert_no_leaks(sched)


def test_budget_is_filled_exactly_under_load() -> None:
    sched = make_sched(max_num_batched_tokens=50, max_num_seqs=8)
    for i in range(6):
        sched.add_request(make_req(f"r{i}", 70, seed=i, max_tokens=2))
    outs = drain(sched)
    # While prompts are pending, every step spends the whole budget.
    assert [o.num_scheduled_tokens for o in outs[:5]] == [50] * 5
    assert max(o.num_scheduled_tokens for o in outs) <= 50
    # The running count (/metrics' mmserve_scheduled_tokens): prompts and decodes.
    assert sched.num_scheduled_tokens == sum(o.num_scheduled_tokens for o in outs) == 6 * 71
    assert_no_leaks(sched)


def test_max_num_seqs_is_respected() -> None:
    sched = make_sched(max_num_seqs=2, max_num_batched_tokens=256)
    reqs = [make_req(f"r{i}", 10, seed=i, max_tokens=3) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    outs = drain(sched)
    assert all(len(o.requests) <= 2 for o in outs)
    first_r2 = next(i for i, o in enumerate(outs) if "r2" in counts(o))
    # r2 is admitted only once r0 and r1 finished (3 steps: prefill+sample, 2 decodes).
    assert first_r2 == 3
    assert set(counts(outs[0])) == {"r0", "r1"}
    assert [o.decodes.request_ids for o in outs[1:3]] == [["r0", "r1"]] * 2
    assert not outs[1].chunks and not outs[2].chunks
    assert all(r.num_output_tokens == 3 for r in reqs)
    assert_no_leaks(sched)


def test_decode_rows_cut_down_and_made_into_objects() -> None:
    """A step's decode rows less some requests (a stale step's) keep each row's columns,
    new blocks included, as the objects the whole step would have made."""
    sched = make_sched(max_num_batched_tokens=64, block_size=16)
    for rid, n in (("r0", 10), ("r1", 16), ("r2", 16)):
        sched.add_request(make_req(rid, n, seed=len(rid + str(n)), max_tokens=4))
    step(sched)
    out = sched.schedule()
    check_step(sched, out)
    assert out.decodes.request_ids == ["r0", "r1", "r2"] and not out.chunks
    assert sorted(out.decodes.new_blocks) == [1, 2]  # r1 and r2 start their second block
    whole = out.requests
    cut = out.without({"r1"})
    assert cut.request_ids() == cut.sampling_ids() == ["r0", "r2"]
    assert cut.num_requests == cut.num_scheduled_tokens == 2
    assert cut.requests == [whole[0], whole[2]]
    assert cut.decodes.new_blocks == {1: whole[2].block_ids}
    assert out.without(set()).requests == whole
    assert out.only(whole[1]).requests == [whole[1]]
    sched.update(out, ModelOutput(dict.fromkeys(out.sampling_ids(), TOKEN)))
    drain(sched)
    assert_no_leaks(sched)


def test_chunked_prefill_of_a_long_prompt() -> None:
    sched = make_sched(max_num_batched_tokens=64)
    req = make_req("long", 200, max_tokens=2)
    sched.add_request(req)
    outs = drain(sched)
    chunks = [(o.requests[0].start_pos, len(o.requests[0].token_ids), o.requests[0].sample)
              for o in outs]
    assert chunks == [(0, 64, False), (64, 64, False), (128, 64, False), (192, 8, True),
                      (200, 1, True)]
    assert [t for o in outs[:4] for t in o.requests[0].token_ids] == req.prompt_token_ids
    assert req.output_token_ids == [TOKEN, TOKEN]
    assert_no_leaks(sched)


# ----------------------------------------------------------------------------- images


def test_image_split_across_chunks_is_encoded_once_and_sliced_in_order() -> None:
    sched = make_sched(max_num_batched_tokens=64, max_tokens_per_item=40)
    img = ImageInput("cat", 50, 40)
    req = make_req("r", 100, [img], max_tokens=2)
    sched.add_request(req)
    out1 = step(sched)
    assert counts(out1) == {"r": 64}
    assert list(out1.images_to_encode) == ["cat"]
    (s1,) = out1.requests[0].image_slices
    assert (s1.image_hash, s1.src_start, s1.dst_start, s1.length) == ("cat", 0, 50, 14)
    # The image straddles the chunk: it stays referenced until its last placeholder is done.
    assert sched.encoder_cache.holds_reference(req, 0)
    out2 = step(sched)
    assert counts(out2) == {"r": 36}
    assert out2.images_to_encode == {}
    (s2,) = out2.requests[0].image_slices
    assert (s2.image_hash, s2.src_start, s2.dst_start, s2.length) == ("cat", 14, 0, 26)
    # Together the slices cover the image exactly once, in order.
    covered = [i for s in (s1, s2) for i in range(s.src_start, s.src_start + s.length)]
    assert covered == list(range(40))
    assert not sched.encoder_cache.holds_reference(req, 0)
    assert sched.encoder_cache.num_referenced_entries() == 0
    drain(sched)
    assert sched.encoder_cache.num_misses == 1
    assert_no_leaks(sched)


def test_shared_image_is_encoded_once_for_two_requests() -> None:
    sched = make_sched(max_num_batched_tokens=256, max_tokens_per_item=40)
    a = make_req("a", 60, [ImageInput("cat", 10, 40)], seed=1)
    b = make_req("b", 70, [ImageInput("cat", 20, 40)], seed=2)
    sched.add_request(a)
    sched.add_request(b)
    outs = drain(sched)
    encoded = [h for o in outs for h in o.images_to_encode]
    assert encoded == ["cat"]
    assert counts(outs[0]) == {"a": 60, "b": 70}
    assert sched.encoder_cache.num_misses == 1
    assert sched.encoder_cache.num_hits == 1
    assert_no_leaks(sched)


def test_two_images_within_the_compute_budget_are_encoded_in_one_step() -> None:
    # compute budget = max(80, 40) = 80 tokens: both 40-token images fit in one step.
    sched = make_sched(max_num_batched_tokens=80, max_tokens_per_item=40,
                       max_items_per_prompt=2)
    assert sched.encoder_compute_budget == 80
    req = make_req("r", 80, [ImageInput("a", 0, 40), ImageInput("b", 40, 40)])
    sched.add_request(req)
    out = step(sched)
    assert set(out.images_to_encode) == {"a", "b"}
    assert counts(out) == {"r": 80}
    drain(sched)
    assert_no_leaks(sched)


def test_encoder_compute_budget_stops_the_chunk_before_the_image() -> None:
    # compute budget = max(64, 40) = 64: "a" encodes 40, leaving 24 < 30 for "b"'s image.
    sched = make_sched(max_num_batched_tokens=64, max_tokens_per_item=40)
    assert sched.encoder_compute_budget == 64
    a = make_req("a", 45, [ImageInput("x", 0, 40)], seed=1)
    b = make_req("b", 50, [ImageInput("y", 5, 30)], seed=2)
    sched.add_request(a)
    sched.add_request(b)
    out1 = step(sched)
    assert counts(out1) == {"a": 45, "b": 5}
    assert list(out1.images_to_encode) == ["x"]
    assert out1.requests[1].image_slices == []
    out2 = step(sched)
    assert counts(out2) == {"a": 1, "b": 45}
    assert list(out2.images_to_encode) == ["y"]
    drain(sched)
    assert_no_leaks(sched)


def test_encoder_cache_space_stops_the_chunk_before_the_image() -> None:
    # Room for exactly one 40-token image.
    sched = make_sched(max_num_batched_tokens=64, max_tokens_per_item=40,
                       encoder_cache_size=40)
    a = make_req("a", 100, [ImageInput("x", 30, 40)], seed=1, max_tokens=3)
    b = make_req("b", 50, [ImageInput("z", 5, 40)], seed=2)
    sched.add_request(a)
    out1 = step(sched)
    assert counts(out1) == {"a": 64}
    sched.add_request(b)
    # "a" still needs "x" (placeholders 64..69): no space for "z", so "b" stops at 5 tokens.
    out2 = step(sched)
    assert counts(out2) == {"a": 36, "b": 5}
    assert out2.images_to_encode == {}
    # "a" passed its image: "x" is unreferenced and evicted for "z".
    out3 = step(sched)
    assert counts(out3) == {"a": 1, "b": 45}
    assert list(out3.images_to_encode) == ["z"]
    assert out3.freed_encoder_hashes == ["x"]
    drain(sched)
    assert_no_leaks(sched)


def test_prefix_hit_ending_inside_an_evicted_image_waits_then_reencodes() -> None:
    # Seed 001's other case: the prefix is cached but the image it ends inside was evicted
    # from the encoder cache and cannot be encoded now. The request gets nothing (never a zero
    # or negative count), then re-encodes the image once there is space.
    sched = make_sched(max_num_batched_tokens=64, max_tokens_per_item=40,
                       encoder_cache_size=40)
    first = make_req("first", 48, [ImageInput("x", 8, 32)], max_tokens=1)
    sched.add_request(first)
    drain(sched)
    hog = make_req("hog", 100, [ImageInput("y", 40, 32)], seed=3, max_tokens=2)
    sched.add_request(hog)
    out = step(sched)
    assert counts(out) == {"hog": 64}
    assert out.freed_encoder_hashes == ["x"]  # "y" evicted "x"
    second = make_req("second", 48, [ImageInput("x", 8, 32)], max_tokens=1)
    sched.add_request(second)
    out = step(sched)
    assert counts(out) == {"hog": 36}  # "second" hits blocks 0-1, needs "x": no room
    assert second.status == RequestStatus.WAITING
    out = step(sched)
    assert counts(out) == {"hog": 1, "second": 16}
    assert list(out.images_to_encode) == ["x"]
    assert out.freed_encoder_hashes == ["y"]
    sl = out.requests[1].image_slices
    assert [(s.src_start, s.dst_start, s.length) for s in sl] == [(24, 0, 8)]
    assert sched.prefix_cache_hit_tokens == 32
    drain(sched)
    assert second.num_output_tokens == 1
    assert_no_leaks(sched)


def test_cached_image_hit_does_not_take_space_reserved_for_a_new_image() -> None:
    # The cache holds one 40-token image: "e", unreferenced. A request needing a new image "x"
    # and then "e" in one chunk: "x" may only use "e"'s space if "e" is not referenced too.
    sched = make_sched(max_num_batched_tokens=128, max_tokens_per_item=40,
                       encoder_cache_size=40)
    sched.add_request(make_req("warm", 45, [ImageInput("e", 0, 40)], max_tokens=1))
    drain(sched)
    assert sched.encoder_cache.num_reclaimable_tokens == 40
    req = make_req("r", 90, [ImageInput("x", 0, 40), ImageInput("e", 40, 40)], seed=4)
    sched.add_request(req)
    drain(sched)
    assert req.num_output_tokens == 4
    assert_no_leaks(sched)


# ----------------------------------------------------------------------------- preemption


def test_preemption_when_kv_blocks_run_out() -> None:
    # 8 blocks of 4 tokens; each request grows to 10 + 12 = 22 tokens (6 blocks).
    sched = make_sched(block_size=4, num_blocks=8, max_num_batched_tokens=64)
    reqs = [make_req(f"r{i}", 10, seed=i, max_tokens=12) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    seen_preemption = False
    scheduled = 0
    for i in range(100):
        if not sched.has_unfinished():
            break
        before = sched.num_preemptions
        out = sched.schedule()
        check_step(sched, out)
        scheduled += out.num_scheduled_tokens
        if sched.num_preemptions > before:
            seen_preemption = True
            victim = sched.waiting[0]
            assert victim.request_id == "r1"  # the newest running request
            assert victim.status == RequestStatus.PREEMPTED
            assert victim.num_computed_tokens == 0
            assert victim.num_preemptions >= 1
            assert "r1" not in counts(out)
            assert victim.request_id not in sched.kv_cache.req_blocks
        sched.update(out, ModelOutput({r.request_id: 10 + i for r in out.requests if r.sample}))
    assert seen_preemption
    assert sched.num_preemptions > 0
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == 12
    # The preempted request kept its outputs and recomputed them as part of its prompt.
    assert len(set(reqs[1].output_token_ids)) == 12
    # Recomputed tokens count again: more than the 2 x (10 + 11) of a run without preemption.
    assert sched.num_scheduled_tokens == scheduled > 2 * (10 + 11)
    assert_no_leaks(sched)


def test_preemption_with_images_releases_and_reacquires_encoder_entries() -> None:
    sched = make_sched(block_size=4, num_blocks=16, max_num_batched_tokens=64,
                       max_tokens_per_item=20)
    reqs = [make_req(f"r{i}", 30, [ImageInput(f"img{i % 2}", 5, 20)], seed=i, max_tokens=12)
            for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    drain(sched)
    assert sched.num_preemptions > 0
    assert all(r.num_output_tokens == 12 for r in reqs)
    assert_no_leaks(sched)


def test_decode_steps_do_not_look_at_images_already_released(monkeypatch) -> None:
    """Once a request's images have all passed, its decode steps release nothing again (at
    hundreds of requests a step, looking at every image each step was a sixth of the
    engine's scheduling time); a retried step that goes back before an image references it
    again, and it is released again once passed."""
    sched = make_sched(max_num_batched_tokens=64, max_tokens_per_item=16)
    images = [ImageInput("a", 2, 8), ImageInput("b", 12, 8), ImageInput("a", 24, 8)]
    req = make_req("r", 40, images, max_tokens=8)
    sched.add_request(req)
    releases: list[int] = []
    real = sched.encoder_cache.release
    monkeypatch.setattr(sched.encoder_cache, "release",
                        lambda r, idx: releases.append(idx) or real(r, idx))
    step(sched)  # the whole prompt, and its first token
    assert sorted(releases) == [0, 1, 2] and sched.encoder_cache.num_referenced_entries() == 0
    releases.clear()
    step(sched)
    step(sched)
    assert releases == []  # decode steps
    sched.retry_request("r", 20)  # a failed step: redo from inside the third image
    out = step(sched)
    assert [sl.image_hash for sl in out.requests[0].image_slices] == ["a"]
    assert releases == [0, 1, 2]  # referenced again for the redone tokens, then released
    assert sched.encoder_cache.num_referenced_entries() == 0
    drain(sched)
    assert_no_leaks(sched)


# ----------------------------------------------------------------------------- stops


def test_stop_on_eos() -> None:
    sched = make_sched()
    req = make_req("r", 10, max_tokens=10)
    sched.add_request(req)
    drain(sched, sampler=lambda rid, i: EOS if i == 3 else TOKEN)
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.status.finish_reason == "stop"
    assert req.output_token_ids == [TOKEN] * 3 + [EOS]
    assert_no_leaks(sched)


def test_ignore_eos_runs_to_max_tokens() -> None:
    sched = make_sched()
    req = make_req("r", 10, max_tokens=6, ignore_eos=True)
    sched.add_request(req)
    drain(sched, sampler=lambda rid, i: EOS)
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == [EOS] * 6
    assert_no_leaks(sched)


def test_no_eos_token_id_never_stops_on_eos() -> None:
    sched = make_sched()
    req = make_req("r", 10, eos_token_id=None, max_tokens=3)
    sched.add_request(req)
    drain(sched, sampler=lambda rid, i: EOS)
    assert req.num_output_tokens == 3
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_stop_token_ids() -> None:
    sched = make_sched()
    req = make_req("r", 10, max_tokens=10, stop_token_ids=[7])
    sched.add_request(req)
    drain(sched, sampler=lambda rid, i: 7 if i == 2 else TOKEN)
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [TOKEN, TOKEN, 7]
    assert_no_leaks(sched)


def test_max_tokens() -> None:
    sched = make_sched()
    req = make_req("r", 10, max_tokens=5)
    sched.add_request(req)
    outs = drain(sched)
    assert len(outs) == 5
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.status.finish_reason == "length"
    assert req.num_output_tokens == 5
    assert_no_leaks(sched)


def test_max_model_len() -> None:
    sched = make_sched(max_model_len=12)
    req = make_req("r", 10, max_tokens=100)
    sched.add_request(req)
    drain(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.num_tokens == 12
    assert req.num_output_tokens == 2
    assert_no_leaks(sched)


def test_finished_ids_are_reported_once() -> None:
    sched = make_sched()
    sched.add_request(make_req("r", 10, max_tokens=1))
    out = step(sched)
    assert out.finished_request_ids == []
    assert sched.schedule().finished_request_ids == ["r"]
    assert sched.schedule().finished_request_ids == []


# ----------------------------------------------------------------------------- abort


def test_abort_waiting_request() -> None:
    sched = make_sched(max_num_seqs=1)
    a = make_req("a", 10, max_tokens=3)
    b = make_req("b", 10, [ImageInput("x", 2, 5)], seed=1)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert b.status == RequestStatus.WAITING
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert b.status.finish_reason == "abort"
    assert b not in sched.waiting
    out = step(sched)
    assert "b" in out.finished_request_ids
    assert "b" not in counts(out)
    drain(sched)
    assert a.num_output_tokens == 3
    assert "x" not in sched.encoder_cache.entries
    assert_no_leaks(sched)


def test_abort_running_request_frees_blocks_and_encoder_refs() -> None:
    sched = make_sched(max_num_batched_tokens=32, max_tokens_per_item=40, num_blocks=32)
    req = make_req("r", 80, [ImageInput("x", 20, 40)], max_tokens=5)
    other = make_req("o", 20, seed=1, max_tokens=5)
    sched.add_request(req)
    step(sched)  # 32 tokens: "x" encoded and referenced, two KV blocks
    assert sched.encoder_cache.holds_reference(req, 0)
    assert sched.kv_cache.num_free_blocks == 30
    sched.add_request(other)
    out = sched.schedule()
    check_step(sched, out)
    # Abort between schedule and update: the update must skip it.
    sched.finish_request("r", RequestStatus.FINISHED_ABORTED)
    assert req not in sched.running
    assert sched.encoder_cache.num_referenced_entries() == 0
    assert "r" not in sched.kv_cache.req_blocks
    sched.update(out, ModelOutput({s.request_id: TOKEN for s in out.requests if s.sample}))
    assert req.num_output_tokens == 0
    assert req.status == RequestStatus.FINISHED_ABORTED
    drain(sched)
    assert other.num_output_tokens == 5
    # Aborting something finished or unknown is a no-op.
    sched.finish_request("r", RequestStatus.FINISHED_ABORTED)
    sched.finish_request("nope", RequestStatus.FINISHED_ABORTED)
    assert_no_leaks(sched)


# ----------------------------------------------------------------------------- seed 001


SEED_LEN, SEED_IMG_OFFSET, SEED_IMG_LEN = 16032, 7333, 8687


def seed_request(rid: str, max_tokens: int = 3) -> Request:
    img = ImageInput("same-image", SEED_IMG_OFFSET, SEED_IMG_LEN)
    assert img.end == 16020
    return make_req(rid, SEED_LEN, [img], max_tokens=max_tokens)


def seed_sched(encoder_cache_size: int | None = None) -> Scheduler:
    return make_sched(max_num_seqs=2, max_num_batched_tokens=8192, max_model_len=20000,
                      block_size=16, num_blocks=2 * cdiv(SEED_LEN + 8, 16),
                      max_tokens_per_item=SEED_IMG_LEN, max_items_per_prompt=1,
                      encoder_cache_size=encoder_cache_size)


@pytest.mark.parametrize("encoder_cache_size", [None, SEED_IMG_LEN])
def test_seed_001_shared_prefix_ending_inside_an_image(encoder_cache_size: int | None) -> None:
    sched = seed_sched(encoder_cache_size)
    assert sched.encoder_cache.cache_size == (encoder_cache_size or 2 * SEED_IMG_LEN)
    r0, r1 = seed_request("r0"), seed_request("r1")
    sched.add_request(r0)
    sched.add_request(r1)
    out0 = step(sched)
    assert counts(out0) == {"r0": 8192}
    assert list(out0.images_to_encode) == ["same-image"]
    out1 = step(sched)
    # r1 hits every block but the last full one (16016 tokens) and recomputes 16 tokens, four
    # of them placeholders of the image that r0 still references.
    assert counts(out1) == {"r0": SEED_LEN - 8192, "r1": 16}
    s1 = out1.requests[1]
    assert s1.start_pos == 16016
    assert [(s.src_start, s.dst_start, s.length) for s in s1.image_slices] == [(8683, 0, 4)]
    assert out1.images_to_encode == {}
    assert sched.prefix_cache_hit_tokens == 16016
    outs = drain(sched, max_steps=100)
    assert all(len(r.token_ids) > 0 for o in [out0, out1, *outs] for r in o.requests)
    assert r0.num_output_tokens == r1.num_output_tokens == 3
    assert sched.encoder_cache.num_misses == 1
    assert_no_leaks(sched)


@pytest.mark.parametrize("encoder_cache_size", [None, SEED_IMG_LEN])
@pytest.mark.parametrize("delay", [1, 2, 4])
def test_seed_001_second_request_arrives_later(
    encoder_cache_size: int | None, delay: int
) -> None:
    sched = seed_sched(encoder_cache_size)
    r0, r1 = seed_request("r0"), seed_request("r1")
    sched.add_request(r0)
    for _ in range(delay):
        step(sched)
    sched.add_request(r1)
    drain(sched, max_steps=100)
    assert r0.num_output_tokens == r1.num_output_tokens == 3
    assert sched.prefix_cache_hit_tokens == 16016
    assert_no_leaks(sched)


# ----------------------------------------------------------------------------- stress


class SimulatedEncoderOutputs:
    """The runner's encoder outputs as hashes: held as tensors, or copied into borrowed KV
    blocks, and its block tables (``BlockTables``, fed only what each step sends). Applies
    each step's messages in the runner's order and checks that every request's table equals
    the scheduler's, every slice reads an output that exists and every restore reads blocks no
    request has written since."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.tensors: set[str] = set()
        self.in_blocks: dict[str, list[int]] = {}
        self.tables = BlockTables(rows=2, width=2)  # small: grown while the run goes

    def apply(self, out: SchedulerOutput, sched: Scheduler) -> None:
        self.tables.release(out.finished_request_ids)
        self.tables.update(out.requests)
        bs = self.kv.block_size
        written = set()
        for r in out.requests:
            full = self.kv.block_ids(sched.requests[r.request_id])
            row = self.tables.rows([r.request_id], len(full))[0].tolist()
            assert row == full, (r.request_id, row, full)
            end = r.start_pos + len(r.token_ids)
            written.update(full[r.start_pos // bs:-(-end // bs)])
        self.tensors -= set(out.freed_encoder_hashes)
        for h, (_, blocks) in out.encoder_restores.items():
            assert self.in_blocks.pop(h, None) == blocks, f"{h} restored from lost blocks"
            self.tensors.add(h)
        for h, blocks in out.encoder_spills.items():
            assert h in self.tensors, h
            self.tensors.discard(h)
            self.in_blocks[h] = blocks
        self.tensors |= set(out.images_to_encode)
        for h in [h for h, blocks in self.in_blocks.items() if written & set(blocks)]:
            del self.in_blocks[h]  # overwritten: a restore of it would read garbage
        for r in out.requests:
            for sl in r.image_slices:
                assert sl.image_hash in self.tensors, sl.image_hash


def stress_run(seed: int, encoder_cache_size: int | None, borrowing: bool = False) -> Scheduler:
    """Random arrivals, shared prefixes and images, aborts and a small KV pool.

    Checks the per-step invariants and, at the end, that every request finished with the
    tokens it was given and that nothing leaked. Returns the scheduler for its counters.
    """
    rng = random.Random(seed)
    bs, num_blocks, max_model_len = 8, 20, 160  # one request needs at most 19 blocks
    sched = make_sched(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=max_model_len,
                       block_size=bs, num_blocks=num_blocks, max_tokens_per_item=24,
                       max_items_per_prompt=2, encoder_cache_size=encoder_cache_size,
                       borrowing=borrowing)
    runner = SimulatedEncoderOutputs(sched.kv_cache)
    # An image hash always comes with the same number of embeddings.
    image_lengths = {f"h{i}": rng.randint(4, 24) for i in range(5)}

    def template() -> tuple[list[int], list[ImageInput]]:
        n = rng.randint(1, 120)
        ids = [rng.randint(10, 60) for _ in range(n)]
        images: list[ImageInput] = []
        pos = 0
        for _ in range(rng.randint(0, 2)):
            h = rng.choice(sorted(image_lengths))
            length = image_lengths[h]
            start = rng.randint(pos, pos + 30)
            if start + length > n:
                break
            images.append(ImageInput(h, start, length))
            ids[start:start + length] = [PLACEHOLDER] * length
            pos = start + length
        return ids, images

    templates = [template() for _ in range(6)]
    reqs: dict[str, Request] = {}
    sampled: dict[str, list[int]] = {}
    aborted: set[str] = set()
    next_id = 0
    for step_no in range(400):
        if step_no < 150 and next_id < 40 and rng.random() < 0.6:
            ids, images = rng.choice(templates)
            ids = list(ids)
            if rng.random() < 0.5:  # same prefix, different tail
                ids += [rng.randint(10, 60) for _ in range(rng.randint(0, 20))]
            req = Request(f"q{next_id}", ids,
                          SamplingParams(max_tokens=rng.randint(1, 16)),
                          images=list(images), eos_token_id=EOS)
            next_id += 1
            reqs[req.request_id] = req
            sampled[req.request_id] = []
            sched.add_request(req)
        if sched.requests and rng.random() < 0.04:
            rid = rng.choice(sorted(sched.requests))
            sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            aborted.add(rid)
        if not sched.has_unfinished():
            if next_id >= 40 or step_no >= 150:
                break
            continue
        out = sched.schedule()
        check_step(sched, out)
        runner.apply(out, sched)
        tokens = {r.request_id: (EOS if rng.random() < 0.03 else rng.randint(10, 60))
                  for r in out.requests if r.sample}
        for rid, tok in tokens.items():
            sampled[rid].append(tok)
        sched.update(out, ModelOutput(tokens))
    assert not sched.has_unfinished(), f"seed {seed}: did not drain: {sched.running}"
    assert next_id >= 20
    for rid, req in reqs.items():
        assert req.finished
        if rid in aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
            continue
        # Preemption never loses or repeats an output token.
        assert req.output_token_ids == sampled[rid]
        if req.status == RequestStatus.FINISHED_STOPPED:
            assert req.output_token_ids[-1] == EOS
        else:
            assert req.status == RequestStatus.FINISHED_LENGTH
            assert (req.num_output_tokens == req.sampling_params.max_tokens
                    or req.num_tokens >= max_model_len)
    assert_no_leaks(sched)
    return sched


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("encoder_cache_size", [None, 24], ids=["auto-cache", "one-item-cache"])
@pytest.mark.parametrize("borrowing", [False, True], ids=["", "borrowing"])
def test_randomized_stress(seed: int, encoder_cache_size: int | None, borrowing: bool) -> None:
    stress_run(seed, encoder_cache_size, borrowing)


def test_randomized_stress_exercises_preemption_and_both_caches() -> None:
    # Guards the stress test itself: its workload must keep hitting the interesting paths.
    sched = stress_run(3, None)
    assert sched.num_preemptions > 0
    assert sched.prefix_cache_hit_tokens > 0
    assert sched.encoder_cache.num_hits > 0
    small = stress_run(3, 24)
    assert small.encoder_cache.num_evictions > 0
    assert small.num_preemptions > 0


def test_randomized_stress_exercises_borrowing() -> None:
    """With borrowing, the stress workload spills entries to free KV blocks and gives blocks
    back under KV pressure, and still drains with nothing leaked (restores:
    tests/test_encoder_borrowing.py)."""
    totals: Counter[str] = Counter()
    for seed in range(5):
        enc = stress_run(seed, 24, borrowing=True).encoder_cache
        totals.update(spills=enc.num_spills, restores=enc.num_restores,
                      pressure=enc.num_kv_pressure_evictions)
    assert totals["spills"] > 0 and totals["pressure"] > 0, totals


def test_a_schedule_that_raises_forgets_the_images_it_reserved(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine fails the requests in flight when scheduling raises; the encoder-cache entry
    reserved for an image that was never encoded must not survive as a hit for later."""
    sched = make_sched()
    req = make_req("a", 40, [ImageInput("img", 0, 32)])
    sched.add_request(req)

    def broken(_req: Request, _start: int = 0) -> list[int]:
        raise RuntimeError("a bug in the books")

    with monkeypatch.context() as m:
        m.setattr(sched.kv_cache, "block_ids", broken)
        with pytest.raises(RuntimeError, match="bug in the books"):
            sched.schedule()
    assert not sched.encoder_cache.is_cached("img")
    assert sched.encoder_cache.num_free_tokens == sched.encoder_cache.cache_size


def test_delay_factor_gathers_arrivals_while_requests_decode() -> None:
    """``delay_factor`` (vLLM's ``scheduler_delay_factor``): with requests running, waiting
    ones are admitted once the first has waited ``delay_factor`` times the last step that
    admitted some, all that fit together; with nothing running, at once."""
    now = [100.0]
    kv = KVCacheManager(256, 16, True)
    sched = Scheduler(SchedulerConfig(4, 64, 4096, 16, delay_factor=1.0), kv,
                      compute_encoder_budget(32, 64, 4, 2, None), clock=lambda: now[0])

    def arrive(rid: str) -> None:
        req = make_req(rid, 20, seed=len(sched.requests), max_tokens=50)
        req.arrival_time = now[0]
        sched.add_request(req)

    def step(at: float) -> list[str]:
        now[0] = at
        out = sched.schedule()
        check_step(sched, out)
        sched.update(out, ModelOutput(sampled={r.request_id: TOKEN for r in out.requests
                                               if r.sample}))
        return sorted(r.request_id for r in out.requests)

    arrive("a")
    assert step(100.0) == ["a"]  # nothing running: at once
    now[0] = 100.5
    arrive("b")
    assert step(100.5) == ["a"]  # the prompt step took 0.5 s: b waits that long
    now[0] = 100.8
    arrive("c")
    assert step(100.8) == ["a"]
    assert step(101.1) == ["a", "b", "c"]  # b has waited 0.6 s: b and c together
    # Without the factor a request is admitted in the step after it arrives.
    sched.delay_factor = 0.0
    now[0] = 101.2
    arrive("d")
    assert step(101.2) == ["a", "b", "c", "d"]
