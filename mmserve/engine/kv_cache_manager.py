"""Per-request KV block tables on top of the block pool, with prefix caching."""

from __future__ import annotations

import hashlib
import pickle

from mmserve.engine.block_pool import BlockPool, KVBlock
from mmserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: bytes | str | tuple | None, token_ids: list[int],
               extra: tuple) -> bytes:
    """A full block's content hash: chained to its parent (the first block's: the request's
    ``cache_salt`` and LoRA adapter, if any), so equal hashes mean equal prefixes."""
    return hashlib.sha256(pickle.dumps((parent, tuple(token_ids), extra))).digest()


def _first_parent(req: Request) -> str | tuple | None:
    """What a request's first block is chained to: its salt, and its adapter (whose keys and
    values differ from the base model's), as a tuple that no salt (a string) equals."""
    if req.lora_request is None:
        return req.cache_salt
    return ("lora", req.cache_salt, *req.lora_request.identity)


class KVCacheManager:
    """Maps requests to KV blocks. Bookkeeping only; the runner owns the cache tensors."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._req_block_ids: dict[str, list[int]] = {}  # the same blocks' ids, for each step
        self._num_published: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def _block_hashes(self, req: Request, num_full_blocks: int) -> list[bytes]:
        """Extend ``req.block_hashes`` to its first ``num_full_blocks`` blocks.

        A block's hash covers its token ids and, for every image overlapping it, the image's
        content hash and the block's offset into the image: placeholder ids are the same for
        every image, so the tokens alone would make two different pictures collide. The first
        block's parent is the request's ``cache_salt`` and LoRA adapter, so that only requests
        of the same salt and adapter share blocks.
        """
        bs = self.block_size
        hashes = req.block_hashes
        while len(hashes) < num_full_blocks:
            start = len(hashes) * bs
            end = start + bs
            extra = tuple((img.hash, start - img.offset) for img in req.images
                          if img.offset < end and img.end > start)
            parent = hashes[-1] if hashes else _first_parent(req)
            hashes.append(hash_block(parent, req.all_token_ids[start:end], extra))
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, req: Request) -> list[KVBlock]:
        """The longest run of cached blocks that prefixes ``req``.

        The last token is always left to compute, even on a full hit: the engine needs the
        logits at that position to sample the first output token.
        """
        if not self.enable_caching:
            return []
        hits = []
        for block_hash in self._block_hashes(req, (req.num_tokens - 1) // self.block_size):
            block = self.pool.get_cached(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` after the request's computed ones.

        ``computed_blocks`` are prefix-cache hits for a request being admitted. Returns the
        request's whole block list, or None (and changes nothing) when the pool is too small.
        """
        blocks = self.req_blocks.get(req.request_id, [])
        if not computed_blocks and blocks:  # a running request (most steps: no new block)
            total = req.num_computed_tokens + num_new_tokens
            if total <= len(blocks) * self.block_size:
                self.publish(req, min(total, req.num_tokens))
                return blocks
        computed_blocks = computed_blocks or []
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = cdiv(total, self.block_size) - len(blocks) - len(computed_blocks)
        # Hits sitting in the free queue stop being free once we take them.
        num_free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(num_needed, 0) + num_free_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(computed_blocks)
        blocks = self.req_blocks.setdefault(req.request_id, blocks)
        ids = self._req_block_ids.setdefault(req.request_id, [])
        new = computed_blocks + (self.pool.allocate(num_needed) if num_needed > 0 else [])
        blocks.extend(new)
        ids.extend(b.block_id for b in new)
        # Publish blocks that these tokens fill. Safe before the forward pass: each layer
        # writes every scheduled token's K/V before any sequence attends. Only tokens
        # already known: a token scheduled ahead of its sampling (asynchronous scheduling)
        # publishes its block on a later call, or when the request finishes (``publish``).
        self.publish(req, min(total, req.num_tokens))
        return blocks

    def publish(self, req: Request, num_tokens: int) -> None:
        """Put the request's blocks that its first ``num_tokens`` tokens fill in the prefix
        cache (those not there yet)."""
        if not self.enable_caching:
            return
        num_full = num_tokens // self.block_size
        first = self._num_published.get(req.request_id, 0)
        if num_full > first:
            blocks = self.req_blocks[req.request_id]
            hashes = self._block_hashes(req, num_full)
            for i in range(first, num_full):
                self.pool.cache_block(blocks[i], hashes[i])
            self._num_published[req.request_id] = num_full

    def free(self, req: Request, keep_cached: bool = True) -> None:
        """Release the request's blocks, tail first, so shared prefixes stay cached longest.

        ``keep_cached=False`` (a step failed for the request, so its blocks may hold wrong
        values) also withdraws the blocks only it holds from the prefix cache.
        """
        blocks = self.req_blocks.pop(req.request_id, [])
        self._req_block_ids.pop(req.request_id, None)
        self._num_published.pop(req.request_id, None)
        if not keep_cached:
            self.pool.uncache([b for b in blocks if b.ref_cnt == 1])
        self.pool.free(list(reversed(blocks)))

    def num_blocks(self, req: Request) -> int:
        return len(self._req_block_ids.get(req.request_id, ()))

    def block_ids(self, req: Request, start: int = 0) -> list[int]:
        """The request's block ids from index ``start`` on, in order (a copy, for a step's
        message: a running request's grow at the end only)."""
        return self._req_block_ids.get(req.request_id, [])[start:]
