"""Global cache of vision-encoder outputs: bookkeeping by image hash, its budget, and the KV
blocks it borrows."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from mmserve.engine.block_pool import BlockPool
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


@dataclass(frozen=True)
class KVLending:
    """How encoder outputs fit in KV blocks: a block holds ``block_elements`` values of the
    model's dtype (all layers' keys and values), an embedding token ``token_elements``.
    ``take_prefix_blocks``: with no empty block left, borrow the prefix cache's least recently
    used free blocks too (when a byte of embeddings saves more compute than a byte of KV)."""

    pool: BlockPool
    block_elements: int
    token_elements: int
    take_prefix_blocks: bool = False

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens * self.token_elements, self.block_elements)


@dataclass
class EncoderCacheOps:
    """What the runner does to its encoder outputs before a step, in this order: drop
    ``freed``; rebuild each of ``restores`` (hash -> (tokens, KV block ids)) from its blocks;
    copy each of ``spills`` (hash -> KV block ids) into those blocks and drop the tensor.
    Restores go first because their blocks return to the pool at once and a spill, or a
    request's keys and values in the forward pass, may reuse them in the same step."""

    freed: list[str] = field(default_factory=list)
    spills: dict[str, list[int]] = field(default_factory=dict)
    restores: dict[str, tuple[int, list[int]]] = field(default_factory=dict)


class EncoderCacheManager:
    """Which image embeddings the encoder cache holds, and who still needs them.

    Entries are keyed by image content hash and shared by every request with that image. The
    reserve (``cache_size`` tokens, the seed-001 budget: the items a step needs plus one) holds
    the embeddings running requests read. An entry nobody references stays cached until its
    reserve space is needed; then, with ``lending`` (borrowing on), it moves into KV blocks the
    pool lends while they are free (the runner copies it there), and comes back into the
    reserve on a hit. Borrowed entries give their blocks back the moment the KV cache needs
    them, which is bookkeeping only: the embeddings are simply gone. Without lending, or when
    no empty block is free, an entry leaving the reserve is dropped.
    """

    def __init__(self, cache_size: int, lending: KVLending | None = None,
                 wanted: Callable[[], set[str]] | None = None) -> None:
        """``wanted()``: the image hashes waiting requests show, for queue-aware eviction
        (None: plain LRU)."""
        self.cache_size = cache_size
        self.wanted = wanted
        self.num_free_tokens = cache_size
        self.entries: dict[str, _Entry] = {}
        self._unreferenced: OrderedDict[str, None] = OrderedDict()  # oldest first
        self._num_unreferenced_tokens = 0
        self.lending = lending
        # Entries in borrowed KV blocks, oldest first: hash -> (tokens, block ids).
        self.borrowed: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()
        self._ops = EncoderCacheOps()
        if lending is not None:
            lending.pool.set_lender(self._give_back)
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0  # entries dropped because the reserve was full (capacity)
        self.num_kv_pressure_evictions = 0  # borrowed entries dropped for the KV cache
        self.num_spills = 0
        self.num_restores = 0

    @property
    def num_reclaimable_tokens(self) -> int:
        """Free tokens plus those of entries nobody references (evictable on demand)."""
        return self.num_free_tokens + self._num_unreferenced_tokens

    @property
    def num_used_tokens(self) -> int:
        return self.cache_size - self.num_free_tokens

    @property
    def num_borrowed_tokens(self) -> int:
        return sum(tokens for tokens, _ in self.borrowed.values())

    @property
    def num_borrowed_blocks(self) -> int:
        return sum(len(blocks) for _, blocks in self.borrowed.values())

    def is_cached(self, image_hash: str) -> bool:
        return image_hash in self.entries or image_hash in self.borrowed

    def is_borrowed(self, image_hash: str) -> bool:
        return image_hash in self.borrowed

    def evictable_tokens(self, image_hash: str) -> int:
        """Reserve tokens the entry would give back if evicted now (0 while it is referenced,
        and for a borrowed entry, which takes none)."""
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
        """Reserve space for an image the runner will encode this step, making room if
        needed (the oldest unreferenced entries leave the reserve: borrowed, or dropped)."""
        image = req.images[input_idx]
        self._make_room(image.length)
        self.num_free_tokens -= image.length
        self.entries[image.hash] = _Entry(image.length, {req.request_id})
        self.num_misses += 1

    def restore(self, req: Request, input_idx: int) -> None:
        """A hit on a borrowed entry: back into the reserve (the runner rebuilds it from its
        KV blocks this step), referenced by ``req``."""
        image = req.images[input_idx]
        num_tokens, blocks = self.borrowed.pop(image.hash)
        self._make_room(num_tokens)
        if self._ops.spills.pop(image.hash, None) is not None:
            self.lending.pool.give_back(blocks)  # spilled this very step: the tensor is there
        else:
            self._ops.restores[image.hash] = (num_tokens, blocks)
            self.lending.pool.give_back(blocks)  # read before anything writes them
            self.num_restores += 1
        self.num_free_tokens -= num_tokens
        self.entries[image.hash] = _Entry(num_tokens, {req.request_id})
        self.num_hits += 1

    def _make_room(self, num_tokens: int) -> None:
        if num_tokens > self.num_reclaimable_tokens:
            raise RuntimeError(f"encoder cache cannot hold {num_tokens} more tokens: "
                               f"{self.num_reclaimable_tokens} reclaimable")
        wanted = self._wanted() if self.num_free_tokens < num_tokens else set()
        while self.num_free_tokens < num_tokens:
            victim = _victim(self._unreferenced, wanted)
            del self._unreferenced[victim]
            tokens = self.entries.pop(victim).num_tokens
            self._num_unreferenced_tokens -= tokens
            self.num_free_tokens += tokens
            blocks = None
            if self.lending is not None:
                blocks = self.lending.pool.lend(self.lending.blocks_for(tokens),
                                                self.lending.take_prefix_blocks)
            if blocks is None:
                self._ops.freed.append(victim)
                self.num_evictions += 1
            else:
                self.borrowed[victim] = (tokens, blocks)
                self._ops.spills[victim] = blocks
                self.num_spills += 1

    def _wanted(self) -> set[str]:
        return self.wanted() if self.wanted is not None else set()

    def _give_back(self, num_blocks: int) -> None:
        """The KV cache needs ``num_blocks`` more blocks: drop borrowed entries, oldest first,
        until that many are given back (or none is left)."""
        given = 0
        wanted = self._wanted()
        while given < num_blocks and self.borrowed:
            victim = _victim(self.borrowed, wanted)
            _, blocks = self.borrowed.pop(victim)
            if self._ops.spills.pop(victim, None) is not None:
                self._ops.freed.append(victim)  # never copied: the runner drops the tensor
            self.lending.pool.give_back(blocks)
            given += len(blocks)
            self.num_kv_pressure_evictions += 1

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
        """Evict every entry no request references, borrowed ones too (the cache starts cold
        for the next requests); returns how many. Not counted in the eviction counters, which
        count evictions forced by a lack of space."""
        count = len(self._unreferenced) + len(self.borrowed)
        for victim in self._unreferenced:
            self.num_free_tokens += self.entries.pop(victim).num_tokens
            self._ops.freed.append(victim)
        self._unreferenced.clear()
        self._num_unreferenced_tokens = 0
        for victim, (_, blocks) in self.borrowed.items():
            if self._ops.spills.pop(victim, None) is not None:
                self._ops.freed.append(victim)
            self.lending.pool.give_back(blocks)
        self.borrowed.clear()
        return count

    def take_ops(self) -> EncoderCacheOps:
        """What the runner must do before this step (see ``EncoderCacheOps``)."""
        ops, self._ops = self._ops, EncoderCacheOps()
        return ops

    def num_referenced_entries(self) -> int:
        return sum(1 for e in self.entries.values() if e.refs)


def _victim(entries: OrderedDict[str, object], wanted: set[str]) -> str:
    """The entry to evict: the oldest that no waiting request shows, else the oldest.

    Why this order: an entry a waiting request shows will be read again soon, for certain, and
    evicting it costs a whole encoder run when that request is admitted; an entry nobody has
    asked for again may never be read. Age still orders each class, since among entries no one
    is waiting for, the most recently used is the likeliest to come back (LRU's bet)."""
    if wanted:
        for image_hash in entries:
            if image_hash not in wanted:
                return image_hash
    return next(iter(entries))
