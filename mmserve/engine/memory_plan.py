"""Sizing the KV cache and deriving max_model_len / max_num_seqs from it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mmserve.engine.kv_cache_manager import cdiv

DEFAULT_MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class MemoryPlan:
    """What a start-up decided, and where each limit came from."""

    kv_bytes_per_token: int
    num_blocks: int
    block_size: int
    max_model_len: int
    max_model_len_source: str  # "given" or "auto"
    max_num_seqs: int
    max_num_seqs_source: str
    kv_cache_bytes: int

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many sequences of max_model_len fit in the KV cache at once."""
        return self.num_blocks / cdiv(self.max_model_len, self.block_size)

    def to_dict(self) -> dict:
        return {**asdict(self), "kv_cache_tokens": self.kv_cache_tokens,
                "max_concurrency": round(self.max_concurrency, 2)}


def resolve_limits(
    num_blocks: int,
    block_size: int,
    model_max_len: int,
    max_model_len: int | None,
    max_num_seqs: int | None,
    kv_bytes_per_token: int,
) -> MemoryPlan:
    """Fill in whichever of max_model_len / max_num_seqs is ``None`` from the block count.

    Raises ValueError with the numbers when even one sequence of the requested length cannot
    fit.
    """
    capacity = num_blocks * block_size
    if max_model_len is not None and max_model_len > model_max_len:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's limit of {model_max_len} tokens "
            "(max_position_embeddings); lower it.")
    if max_model_len is not None and cdiv(max_model_len, block_size) > num_blocks:
        raise ValueError(
            f"max_model_len={max_model_len} does not fit: the KV cache holds {num_blocks} blocks "
            f"of {block_size} tokens = {capacity} tokens ({capacity * kv_bytes_per_token} bytes "
            f"at {kv_bytes_per_token} bytes per token). Lower max_model_len to at most "
            f"{capacity}, or give the KV cache more memory.")
    if max_model_len is None:
        per_seq_blocks = num_blocks // (max_num_seqs or 1)
        if per_seq_blocks == 0:
            raise ValueError(
                f"max_num_seqs={max_num_seqs} sequences cannot each hold even one block: the KV "
                f"cache has {num_blocks} blocks of {block_size} tokens. Lower max_num_seqs to at "
                f"most {num_blocks}, or give the KV cache more memory.")
        len_source = "auto"
        max_model_len = min(model_max_len, per_seq_blocks * block_size)
    else:
        len_source = "given"
    if max_num_seqs is None:
        seqs_source = "auto"
        if len_source == "given":
            max_num_seqs = max(1, num_blocks // cdiv(max_model_len, block_size))
        else:
            max_num_seqs = max(1, min(DEFAULT_MAX_NUM_SEQS, num_blocks))
    else:
        seqs_source = "given"
    return MemoryPlan(
        kv_bytes_per_token=kv_bytes_per_token,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_model_len_source=len_source,
        max_num_seqs=max_num_seqs,
        max_num_seqs_source=seqs_source,
        kv_cache_bytes=num_blocks * block_size * kv_bytes_per_token,
    )
