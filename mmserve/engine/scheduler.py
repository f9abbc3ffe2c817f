"""The scheduler: one token budget per step, shared by decodes, prefill chunks and images.

There is no prefill or decode phase. Every request has ``num_computed_tokens`` catching up with
``num_tokens``; each step gives running requests their share first, then admits waiting ones.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mmserve.engine.encoder_cache import EncoderBudget, EncoderCacheManager, KVLending
from mmserve.engine.kv_cache_manager import KVCacheManager
from mmserve.engine.lora import LoRASlots
from mmserve.engine.request import Request, RequestStatus
from mmserve.step import (
    PENDING_TOKEN,
    ImageSlice,
    ModelOutput,
    ScheduledRequest,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)

# Looked up for every request every step: a module global costs less than the enum's class.
_RUNNING = RequestStatus.RUNNING


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    # While requests run, admit waiting ones only once the oldest has waited this many times
    # the last prompt step's duration (0: at once).
    delay_factor: float = 0.0
    # "fcfs" or "priority": the order of the waiting queue and of preemption.
    policy: str = "fcfs"


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        encoder_budget: EncoderBudget,
        lending: KVLending | None = None,
        queue_aware_eviction: bool = True,
        clock: Callable[[], float] = time.time,
        lora_slots: LoRASlots | None = None,
    ) -> None:
        """``lending``: how encoder outputs fit in the KV cache's blocks, to let them borrow
        free ones (None: they never do). ``queue_aware_eviction``: cached image embeddings
        that waiting requests show are evicted last (else plain LRU). ``clock``: the time of
        requests' ``arrival_time``. ``lora_slots``: the runner's LoRA adapter slots (None: no
        request has an adapter); a request whose adapter has none waits in the queue."""
        self.lora_slots = lora_slots
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.kv_cache = kv_cache
        self.encoder_cache = EncoderCacheManager(
            encoder_budget.cache_tokens, lending,
            self._waiting_image_hashes if queue_aware_eviction else None)
        self.encoder_compute_budget = encoder_budget.compute_tokens
        self.delay_factor = config.delay_factor
        self.by_priority = config.policy == "priority"
        self._clock = clock
        self._last_schedule: float | None = None  # when the step before was scheduled
        self._admitted_last = False  # whether that step admitted waiting requests
        self._prompt_step_s = 0.0  # how long the last step that admitted some took
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0
        self.num_scheduled_tokens = 0  # prompt and decode tokens of every step scheduled
        self.prefix_cache_queried_tokens = 0

    # ----------------------------------------------------------------- queue
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self._enqueue(req)

    def _enqueue(self, req: Request, preempted: bool = False) -> None:
        """Into the waiting queue: at its end, or a preempted request at its front; by
        priority, after every request of a lower or equal (priority, arrival)."""
        if not self.by_priority:
            if preempted:
                self.waiting.appendleft(req)
            else:
                self.waiting.append(req)
            return
        self.waiting.insert(bisect.bisect_right(self.waiting, _priority_key(req),
                                                key=_priority_key), req)

    def _start_running(self, req: Request) -> None:
        """Into ``running``: at its end (admission order), or by priority after every
        request of a lower or equal (priority, arrival), so that the last one is always the
        one to preempt and the requests scheduled before it in a step never are."""
        if self.by_priority:
            bisect.insort_right(self.running, req, key=_priority_key)
        else:
            self.running.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish a live request (stop string, abort) and release everything it holds."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._free(req, status)

    def _free(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        # A failed step may have left the request's blocks half written: never share them.
        self.kv_cache.free(req, keep_cached=status != RequestStatus.FINISHED_ERROR)
        self.encoder_cache.release_all(req)
        self._release_lora(req)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.lora_slots.release(req.lora_slot)
            req.lora_slot = -1

    def _preempt(self, req: Request) -> None:
        self.kv_cache.free(req)
        self.encoder_cache.release_all(req)
        self._release_lora(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.images_checked_at = -1
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, preempted=True)
        logger.warning(
            "Request %s was preempted (recomputed later) because the KV cache is full; "
            "give the KV cache more memory or lower max_num_seqs. Preemptions so far: %d.",
            req.request_id, self.num_preemptions)

    def _waiting_image_hashes(self) -> set[str]:
        return {image.hash for req in self.waiting for image in req.images}

    # ----------------------------------------------------------------- images
    def _schedule_images(
        self, req: Request, num_computed: int, num_new: int, compute_budget: int
    ) -> tuple[list[int], int, int, list[int]]:
        """Decide the images the tokens ``[num_computed, num_computed + num_new)`` need.

        Cached images are referenced at once. An image that is neither cached nor affordable
        (compute budget or cache space) cuts the chunk short just before it; so does one in
        borrowed KV blocks that the reserve has no room to take back. Returns the images to
        encode or to take back from borrowed blocks (no compute), the possibly shrunk token
        count (never negative), the remaining compute budget and the images newly referenced
        here (to roll back if the request is not scheduled after all).
        """
        if num_computed >= req.images_end:  # past every image (every decode step)
            return [], num_new, compute_budget, []
        to_encode: list[int] = []
        referenced: list[int] = []
        pending_hashes: set[str] = set()
        reserved = 0  # cache tokens the images in ``to_encode`` will take
        end = num_computed + num_new
        cache = self.encoder_cache
        for i, image in enumerate(req.images):
            if image.offset >= end:
                break
            if image.end <= num_computed or image.hash in pending_hashes:
                continue
            if cache.holds_reference(req, i):
                continue
            if cache.is_borrowed(image.hash):
                if reserved + image.length <= cache.num_reclaimable_tokens:
                    to_encode.append(i)  # taken back by ``commit``, not encoded
                    pending_hashes.add(image.hash)
                    reserved += image.length
                    continue
            elif cache.is_cached(image.hash):
                # Referencing a cached entry takes it off the evictable list: only do so if the
                # space already promised to this chunk's new images stays reclaimable.
                if reserved <= cache.num_reclaimable_tokens - cache.evictable_tokens(image.hash):
                    cache.add_reference(req, i)
                    referenced.append(i)
                    continue
            elif (image.length <= compute_budget
                  and reserved + image.length <= cache.num_reclaimable_tokens):
                to_encode.append(i)
                pending_hashes.add(image.hash)
                reserved += image.length
                compute_budget -= image.length
                continue
            # Stop before this image. If the computed tokens already reach into it (a prefix
            # hit that ends mid-image), nothing can be scheduled this step: zero, not negative.
            num_new = max(0, image.offset - num_computed)
            break
        return to_encode, num_new, compute_budget, referenced

    def _image_slices(self, req: Request, num_computed: int, num_new: int) -> list[ImageSlice]:
        end = num_computed + num_new
        slices = []
        for image in req.images:
            lo, hi = max(image.offset, num_computed), min(image.end, end)
            if lo < hi:
                slices.append(ImageSlice(image.hash, lo - image.offset, lo - num_computed, hi - lo))
        return slices

    # ----------------------------------------------------------------- step
    def schedule(self, pending: frozenset[str] = frozenset(),
                 ahead: bool = False) -> SchedulerOutput:
        """The next step. If scheduling raises (a bug in the books; the engine then fails
        the requests in flight), the encoder-cache entries it reserved are forgotten: their
        images were never encoded, and a later hit must not read nothing.

        ``pending``: scheduling ahead (asynchronous scheduling), while the step before runs;
        these requests sample a token in that step. Each gets its next token scheduled as
        ``PENDING_TOKEN`` (the runner writes in what it sampled), unless that token will end
        it (``max_tokens``, ``max_model_len``). ``ahead``: scheduling while a step runs,
        whether or not anybody samples there: nobody is preempted (a request that does not
        fit waits for the next step, scheduled once this one's results are known)."""
        out = SchedulerOutput(ahead=ahead or bool(pending))
        try:
            return self._schedule(out, pending)
        except Exception:
            for image_hash in out.images_to_encode:
                self.encoder_cache.discard(image_hash)
            raise

    def _schedule(self, out: SchedulerOutput, pending: frozenset[str]) -> SchedulerOutput:
        token_budget = self.max_num_batched_tokens
        compute_budget = self.encoder_compute_budget
        scheduled: list[tuple[Request, int, int]] = []  # request, new tokens, its total
        # A running request lacked room (it preempted others, or, scheduling ahead, waits):
        # no waiting request is admitted this step.
        short = False
        ahead = out.ahead

        def commit(req: Request, num_new: int, total: int, to_encode: list[int]) -> None:
            for i in to_encode:
                image = req.images[i]
                if self.encoder_cache.is_borrowed(image.hash):
                    self.encoder_cache.restore(req, i)
                else:
                    self.encoder_cache.allocate(req, i)
                    out.images_to_encode[image.hash] = image.length
            scheduled.append((req, num_new, total))

        # Running requests first, in admission order (by priority: priority, then arrival);
        # the last is preempted first.
        i = 0
        while i < len(self.running) and token_budget > 0:
            req = self.running[i]
            if req.aborting:
                i += 1
                continue
            total = self._num_tokens(req, pending) if pending else req.num_tokens
            num_new = min(total - req.num_computed_tokens, token_budget)
            if req.num_computed_tokens >= req.images_end:  # past its images (every decode)
                to_encode, new_compute_budget = (), compute_budget
            else:
                to_encode, num_new, new_compute_budget, _ = self._schedule_images(
                    req, req.num_computed_tokens, num_new, compute_budget)
            if num_new <= 0:
                i += 1
                continue
            if ahead:
                if self.kv_cache.allocate_slots(req, num_new) is None:
                    short = True  # no room without preempting: the rest waits a step
                    break
            else:
                while self.kv_cache.allocate_slots(req, num_new) is None:
                    victim = self.running.pop()
                    self._preempt(victim)
                    short = True
                    if victim is req:
                        break
                if req.status != _RUNNING:
                    break
            if to_encode:
                commit(req, num_new, total, to_encode)
            else:
                scheduled.append((req, num_new, total))
            compute_budget = new_compute_budget
            token_budget -= num_new
            i += 1

        # Then waiting requests in queue order (first come first served, or by priority);
        # none once a running one lacked room.
        admit = self._admission_due()
        admitted = len(self.running)
        while (admit and self.waiting and token_budget > 0 and not short
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            lora = req.lora_request
            if lora is not None and not self.lora_slots.available(lora):
                break  # every adapter slot is in use: it waits for one to be given back
            # Prompt logprobs, and an embedding pooled over the prompt, need every prompt
            # position computed, cached or not.
            params = req.sampling_params
            hits = ([] if params.prompt_logprobs is not None or params.pooling != "last"
                    else self.kv_cache.get_computed_blocks(req))
            num_computed = len(hits) * self.kv_cache.block_size
            num_new = min(req.num_tokens - num_computed, token_budget)
            to_encode, num_new, new_compute_budget, referenced = self._schedule_images(
                req, num_computed, num_new, compute_budget)
            if num_new == 0 or self.kv_cache.allocate_slots(req, num_new, hits) is None:
                for idx in referenced:
                    self.encoder_cache.release(req, idx)
                break
            self.waiting.popleft()
            if lora is not None:
                req.lora_slot, load = self.lora_slots.acquire(lora)
                out.loads_lora = out.loads_lora or load
            self._start_running(req)
            req.status = RequestStatus.RUNNING
            req.num_blocks_sent = 0  # new blocks (after a preemption too): send them all
            req.history_stale = req.sampling_params.uses_history
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_computed
            self.prefix_cache_queried_tokens += req.num_tokens
            self.prefix_cache_hit_tokens += num_computed
            commit(req, num_new, req.num_tokens, to_encode)
            compute_budget = new_compute_budget
            token_budget -= num_new
        self._admitted_last = len(self.running) > admitted

        decodes, num_blocks = out.decodes, self.kv_cache.num_blocks
        for req, num_new, total in scheduled:
            if req.lora_slot >= 0:
                out.lora_adapters[req.lora_slot] = req.lora_request.identity
            start = req.num_computed_tokens
            assert num_new > 0, f"scheduled {num_new} tokens for {req}"
            if (num_new == 1 and start + 1 == total and start >= req.num_prompt_tokens
                    and req.grammar is None and req.images_checked_at >= req.images_end
                    and not req.history_stale):
                # A decode: a row of columns. A token scheduled ahead of its sampling is
                # the only one past the request's known tokens.
                sent = req.num_blocks_sent
                if num_blocks(req) > sent:  # its token starts a block
                    new_blocks = self.kv_cache.block_ids(req, sent)
                    decodes.new_blocks[len(decodes)] = new_blocks
                    req.num_blocks_sent = sent + len(new_blocks)
                decodes.position_rows = req.position_rows
                decodes.append(req.request_id, req.all_token_ids[start]
                               if start < len(req.all_token_ids) else PENDING_TOKEN,
                               start, start + req.decode_offset, req.sampling_params, sent,
                               req.lora_slot)
                req.num_computed_tokens = total
                continue
            token_ids = req.all_token_ids[start:start + num_new]
            if len(token_ids) < num_new:  # a token scheduled ahead of its sampling
                token_ids += [PENDING_TOKEN] * (num_new - len(token_ids))
            known = None
            if req.history_stale:  # every token is known here (none is scheduled ahead yet)
                known, req.history_stale = list(req.all_token_ids), False
            new_blocks = self.kv_cache.block_ids(req, req.num_blocks_sent)
            out.chunks.append(ScheduledRequest(
                request_id=req.request_id,
                token_ids=token_ids,
                start_pos=start,
                block_ids=new_blocks,
                blocks_from=req.num_blocks_sent,
                image_slices=([] if start >= req.images_end
                              else self._image_slices(req, start, num_new)),
                sample=start + num_new == total,
                sampling_params=req.sampling_params,
                positions=req.positions(start, start + num_new),
                prompt_logprob_targets=(
                    [] if req.sampling_params.prompt_logprobs is None
                    else req.all_token_ids[start + 1:min(start + num_new + 1,
                                                         req.num_prompt_tokens)]),
                known_token_ids=known,
                num_prompt_tokens=req.num_prompt_tokens,
                lora_slot=req.lora_slot,
            ))
            # Tokens count as computed once scheduled: steps run in the order scheduled.
            req.num_computed_tokens += num_new
            req.num_blocks_sent += len(new_blocks)
            if req.images_checked_at < req.images_end:  # else nothing to release (decodes)
                self._release_passed_images(req)
        ops = self.encoder_cache.take_ops()
        out.freed_encoder_hashes = ops.freed
        out.encoder_restores, out.encoder_spills = ops.restores, ops.spills
        out.finished_request_ids, self._finished_ids = self._finished_ids, []
        self.num_scheduled_tokens += self.max_num_batched_tokens - token_budget
        return out

    def _admission_due(self) -> bool:
        """Whether waiting requests may be admitted in the step being scheduled: at once
        without ``delay_factor`` or with nothing running; else once the oldest in the queue
        has waited ``delay_factor`` times the duration of the last step that admitted some
        (from its scheduling to the next step's), so that arrivals are prefilled together
        instead of each in a long step of its own between the running requests' decodes."""
        now = self._clock()
        if self._admitted_last and self._last_schedule is not None:
            self._prompt_step_s = now - self._last_schedule
        self._last_schedule = now
        if self.delay_factor <= 0 or not self.running or not self.waiting:
            return True
        oldest = (min(r.arrival_time for r in self.waiting) if self.by_priority
                  else self.waiting[0].arrival_time)
        return now - oldest >= self.delay_factor * self._prompt_step_s

    def _num_tokens(self, req: Request, pending: frozenset[str]) -> int:
        """The tokens ``req`` will have once the step in flight ends: one more when it samples
        there, unless that token ends it (it is not scheduled then)."""
        if req.request_id not in pending:
            return req.num_tokens
        ends = (req.num_output_tokens + 1 >= req.sampling_params.max_tokens
                or req.num_tokens + 1 >= self.max_model_len)
        return req.num_tokens + (not ends)

    def _release_passed_images(self, req: Request) -> None:
        """Drop references to images whose every placeholder is now computed. Called only
        while ``req.images_checked_at < req.images_end``: once every image has passed and
        been released, the request is not looked at again (decode steps cost nothing per
        image) until its computed tokens go back (a preemption, a retried step), which may
        reference images again."""
        req.images_checked_at = req.num_computed_tokens
        still_needed = {img.hash for img in req.images if img.end > req.num_computed_tokens}
        for i, image in enumerate(req.images):
            if image.hash not in still_needed:
                self.encoder_cache.release(req, i)

    def fail_request(self, request_id: str, reason: str) -> None:
        """A step failed for this request: finish it with an error and release what it holds
        (its blocks leave the prefix cache, since they may be half written)."""
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            req.error = reason
            self.finish_request(request_id, RequestStatus.FINISHED_ERROR)

    def retry_request(self, request_id: str, start_pos: int) -> None:
        """A step failed for this request but it may succeed again: forget the tokens the
        step was to compute (``start_pos``: the step's first), so the next step redoes them."""
        req = self.requests.get(request_id)
        if req is not None and req.status == RequestStatus.RUNNING:
            req.num_computed_tokens = min(req.num_computed_tokens, start_pos)
            req.images_checked_at = -1
            # The failed step's token, and one a step scheduled after it sampled, may have
            # been counted: count its tokens afresh.
            req.history_stale = req.sampling_params.uses_history

    def update(self, out: SchedulerOutput, result: ModelOutput) -> list[Request]:
        """Append sampled tokens and apply stop conditions. Returns requests that got a token.

        Requests in ``result.errors`` are the engine's to fail or retry (``fail_request``,
        ``retry_request``); images whose encoding failed are forgotten here, so that a later
        request showing them encodes them again instead of reading nothing.
        """
        for image_hash in result.failed_images:
            self.encoder_cache.discard(image_hash)
        changed = []
        sampled, requests = result.sampled, self.requests
        for rid in out.sampling_ids():
            token = sampled.get(rid)
            req = requests.get(rid)
            if token is None or req is None or req.status != _RUNNING:
                continue
            req.append_token(token)
            changed.append(req)
            status = self._check_stop(req, token)
            if status is not None:
                # A block its last computed tokens fill, if a step scheduled ahead left it
                # unpublished (the token it sampled last is never computed).
                self.kv_cache.publish(req, min(req.num_computed_tokens, req.num_tokens - 1))
                self.running.remove(req)
                self._free(req, status)
        return changed

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if not params.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _priority_key(req: Request) -> tuple[int, float]:
    return req.sampling_params.priority, req.arrival_time
