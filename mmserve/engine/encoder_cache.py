"""Global cache of vision-encoder outputs: bookkeeping by image hash, and its budget."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from mmserve.engine.kv_cache_manager import cdiv
from mmserve.engine.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncoderBudget:
    """How many embedding tokens the encoder may compute per step and the cache may hold."""

    compute_tokens: int
    cache_tokens: int
    max_tokens_per_item: int

    @property
    def cache_items(self) -> int:
        return self.cache_tokens // self.max_tokens_per_item


def compute_encoder_budget(
    max_tokens_per_item: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_items_per_prompt: int,
    encoder_cache_size: int | None = None,
) -> EncoderBudget:
    """Size the encoder cache from the scheduler's limits (the rule of vLLM PR #11895).

    ``encoder_cache_size`` (embedding tokens) overrides the derived cache size; it must hold at
    least one item of the largest size.
    """
    if max_tokens_per_item <= 0:
        raise ValueError(f"max_tokens_per_item must be positive, got {max_tokens_per_item}.")
    if max_tokens_per_item > max_num_batched_tokens:
        # The largest item cannot be prefilled in one step: it is encoded once, cached and
        # sliced over several steps.
        num_items = 1
    else:
        # Worst case: every item is as large as possible and a step covers all of them but the
        # last one, which straddles into the next step.
        num_items = cdiv(max_num_batched_tokens, max_tokens_per_item)
    # Room for one more item. Two requests that share a prefix ending inside an image: the
    # second one gets a full prefix hit and recomputes its last block, which needs that image's
    # embeddings again while the first request's copy may still occupy the cache. Without this
    # slot the scheduler would find no space and could only schedule a negative token count.
    num_items += 1
    # Never more than every running request can use at once.
    num_items = min(num_items, max(1, max_num_seqs * max_items_per_prompt))
    cache_tokens = num_items * max_tokens_per_item
    if encoder_cache_size is not None:
        if encoder_cache_size < max_tokens_per_item:
            raise ValueError(
                f"encoder_cache_size={encoder_cache_size} embedding tokens cannot hold one image "
                f"of this model ({max_tokens_per_item} tokens); set it to at least "
                f"{max_tokens_per_item} or leave it unset to size it automatically.")
        cache_tokens = encoder_cache_size
    return EncoderBudget(
        compute_tokens=max(max_num_batched_tokens, max_tokens_per_item),
        cache_tokens=cache_tokens,
        max_tokens_per_item=max_tokens_per_item,
    )


@dataclass
class _Entry:
    num_tokens: int
    refs: set[str]


class EncoderCacheManager:
    """Which image embeddings live in the runner's encoder cache, and who still needs them.

    Entries are keyed by image content hash and shared by every request with that image. An
    entry nobody references stays cached (a later request may reuse it) until its space is
    needed; the oldest such entry goes first. Evicted hashes are reported so the runner drops
    the tensors.
    """

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_tokens = cache_size
        self.entries: dict[str, _Entry] = {}
        self._unreferenced: OrderedDict[str, None] = OrderedDict()  # oldest first
        self._num_unreferenced_tokens = 0
        self._freed: list[str] = []
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0

    @property
    def num_reclaimable_tokens(self) -> int:
        """Free tokens plus those of entries nobody references (evictable on demand)."""
        return self.num_free_tokens + self._num_unreferenced_tokens

    @property
    def num_used_tokens(self) -> int:
        return self.cache_size - self.num_free_tokens

    def is_cached(self, image_hash: str) -> bool:
        return image_hash in self.entries

    def evictable_tokens(self, image_hash: str) -> int:
        """Tokens the entry would give back if evicted now (0 while it is referenced)."""
        return self.entries[image_hash].num_tokens if image_hash in self._unreferenced else 0

    def add_reference(self, req: Request, input_idx: int) -> None:
        """``req`` will read this cached image: keep it until ``req`` releases it (a hit)."""
        image = req.images[input_idx]
        entry = self.entries[image.hash]
        if req.request_id in entry.refs:
            return
        if not entry.refs:
            del self._unreferenced[image.hash]
            self._num_unreferenced_tokens -= entry.num_tokens
        entry.refs.add(req.request_id)
        self.num_hits += 1

    def holds_reference(self, req: Request, input_idx: int) -> bool:
        entry = self.entries.get(req.images[input_idx].hash)
        return entry is not None and req.request_id in entry.refs

    def allocate(self, req: Request, input_idx: int) -> None:
        """Reserve space for an image the runner will encode this step, evicting if needed."""
        image = req.images[input_idx]
        if image.length > self.num_reclaimable_tokens:
            raise RuntimeError(f"encoder cache cannot hold {image.length} more tokens: "
                               f"{self.num_reclaimable_tokens} reclaimable")
        while self.num_free_tokens < image.length:
            victim, _ = self._unreferenced.popitem(last=False)
            num_tokens = self.entries.pop(victim).num_tokens
            self._num_unreferenced_tokens -= num_tokens
            self.num_free_tokens += num_tokens
            self._freed.append(victim)
            self.num_evictions += 1
        self.num_free_tokens -= image.length
        self.entries[image.hash] = _Entry(image.length, {req.request_id})
        self.num_misses += 1

    def release(self, req: Request, input_idx: int) -> None:
        """``req`` no longer needs this image; the entry stays cached until evicted."""
        image = req.images[input_idx]
        entry = self.entries.get(image.hash)
        if entry is None or req.request_id not in entry.refs:
            return
        entry.refs.discard(req.request_id)
        if not entry.refs:
            self._unreferenced[image.hash] = None
            self._num_unreferenced_tokens += entry.num_tokens

    def release_all(self, req: Request) -> None:
        for i in range(len(req.images)):
            self.release(req, i)

    def discard(self, image_hash: str) -> None:
        """Forget an entry whose embeddings were never made (its encoding failed): a later
        request showing the image encodes it again instead of reading nothing."""
        entry = self.entries.pop(image_hash, None)
        if entry is None:
            return
        if image_hash in self._unreferenced:
            del self._unreferenced[image_hash]
            self._num_unreferenced_tokens -= entry.num_tokens
        self.num_free_tokens += entry.num_tokens

    def evict_unreferenced(self) -> int:
        """Evict every entry no request references (the cache starts cold for the next
        requests); returns how many. Not counted in ``num_evictions``, which counts evictions
        forced by a lack of space."""
        count = len(self._unreferenced)
        for victim in self._unreferenced:
            self.num_free_tokens += self.entries.pop(victim).num_tokens
            self._freed.append(victim)
        self._unreferenced.clear()
        self._num_unreferenced_tokens = 0
        return count

    def take_freed(self) -> list[str]:
        """Hashes evicted since the last call: the runner must drop these tensors."""
        freed, self._freed = self._freed, []
        return freed

    def num_referenced_entries(self) -> int:
        return sum(1 for e in self.entries.values() if e.refs)
