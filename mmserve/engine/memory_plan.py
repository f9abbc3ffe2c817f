"""The memory plan: weights, activations, the encoder cache and the KV cache in one budget.

    budget    = device memory x gpu_memory_utilization
    KV bytes  = budget - weights - peak activations - encoder cache bytes
    KV blocks = KV bytes // (block_size x KV bytes per token)

then ``max_model_len`` and ``max_num_seqs`` are filled in from the block count, so that users
never search for settings that fit by relaunching.
The activations come from a profile run at ``max_num_batched_tokens`` tokens, never at
``max_model_len``, so the block count the memory allows does not move when the user changes
``max_model_len``. Everything here is arithmetic on plain numbers; ``startup.py`` gathers the
inputs from the settings and the checkpoint, for the engine and ``mmserve plan`` alike.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from mmserve.config import EngineConfig
from mmserve.engine.kv_cache_manager import cdiv

DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Where several engines share one GPU (a test suite's processes, notebooks), the default share
# of each may be set for all of them at once.
GPU_MEMORY_UTILIZATION_ENV = "MMSERVE_GPU_MEMORY_UTILIZATION"
# On the CPU the flag is the share of the RAM available at start-up. The rest stays free for
# what tensors do not show: the Python heap, tokenizer and processor, allocator slack, and
# other processes that grow later.
DEFAULT_CPU_MEMORY_UTILIZATION = 0.8


class InfeasiblePlanError(ValueError):
    """The settings cannot work on this device; the message gives the numbers and the fix."""


def default_memory_utilization(device: str) -> float:
    """The share of the device's memory a plan takes when ``gpu_memory_utilization`` is not
    given: 0.8 of the RAM available on the CPU; 0.9 of a GPU, or
    ``$MMSERVE_GPU_MEMORY_UTILIZATION``."""
    if device == "cpu":
        return DEFAULT_CPU_MEMORY_UTILIZATION
    raw = os.environ.get(GPU_MEMORY_UTILIZATION_ENV, "").strip()
    if not raw:
        return DEFAULT_GPU_MEMORY_UTILIZATION
    try:
        share = float(raw)
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        raise ValueError(f"{GPU_MEMORY_UTILIZATION_ENV}={raw!r}: expected a share of the GPU's "
                         "memory, 0 < share <= 1")
    return share


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan needs, measured by the engine or estimated by ``mmserve plan``."""

    device: str  # "cpu" or "cuda"
    memory_bytes: int  # GPU total memory, or the RAM available at start-up (per rank)
    gpu_memory_utilization: float
    weights_bytes: int
    activation_bytes: int  # peak of the profile run
    activation_method: str  # how activation_bytes was obtained, for the report
    encoder_cache_items: int
    encoder_cache_tokens: int
    encoder_bytes_per_token: int  # embedding width x dtype bytes
    kv_bytes_per_token: int  # 2 x layers x kv heads x head dim x dtype bytes
    block_size: int
    model_max_len: int  # the model's own limit (max_position_embeddings)
    max_model_len: int | None  # None = auto
    max_num_seqs: int | None  # None = auto
    kv_cache_memory: int | None = None  # bytes; sets the KV cache directly
    single_user_mode: bool = False
    min_model_len: int = 1  # an auto max_model_len below this (one image + one token) fails
    estimated: tuple[str, ...] = ()  # names of the figures above that are estimates
    # Encoder outputs beyond the reserve may borrow free KV blocks; what each cache saves per
    # byte it holds (model FLOPs), which decides whether they may displace prefix blocks.
    encoder_borrowing: bool = False
    encoder_flops_per_byte: float = 0.0
    prefill_flops_per_byte: float = 0.0
    # Ranks of tensor parallelism: every figure above is one rank's (its GPU, or its share of
    # the RAM; its weights, activations, KV heads and encoder cache).
    tensor_parallel_size: int = 1
    # Of weights_bytes, the LoRA adapters' slots (enable_lora: max_loras of max_lora_rank).
    lora_bytes: int = 0


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    max_model_len_source: str  # "given" or "auto"
    max_num_seqs: int
    max_num_seqs_source: str  # "given", "auto" or "single_user_mode"


@dataclass(frozen=True)
class MemoryPlan:
    """The start-up report: every term of the budget and where each limit came from."""

    device: str
    memory_bytes: int
    gpu_memory_utilization: float
    budget_bytes: int
    weights_bytes: int
    activation_bytes: int
    activation_method: str
    encoder_cache_items: int
    encoder_cache_tokens: int
    encoder_cache_bytes: int
    kv_bytes_per_token: int
    block_size: int
    kv_budget_blocks: int  # what the memory (or kv_cache_memory) allows
    num_blocks: int  # what the engine allocates
    kv_cache_limited_by: str  # "memory", "kv_cache_memory" or "max_num_seqs x max_model_len"
    model_max_len: int
    max_model_len: int
    max_model_len_source: str
    max_num_seqs: int
    max_num_seqs_source: str
    estimated: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    encoder_borrowing: bool = False
    encoder_flops_per_byte: float = 0.0
    prefill_flops_per_byte: float = 0.0
    tensor_parallel_size: int = 1  # > 1: every figure is one rank's
    lora_bytes: int = 0  # of weights_bytes, the LoRA adapters' slots

    @property
    def encoder_displaces_prefix(self) -> bool:
        """Whether borrowed encoder outputs may take free blocks from the prefix cache: when
        keeping a byte of image embeddings saves more compute than a byte of KV does."""
        return self.encoder_borrowing and self.encoder_flops_per_byte > self.prefill_flops_per_byte

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache_tokens * self.kv_bytes_per_token

    @property
    def max_concurrency(self) -> float:
        """How many sequences of max_model_len fit in the KV cache at once."""
        return self.num_blocks / cdiv(self.max_model_len, self.block_size)

    def to_dict(self) -> dict:
        return {**asdict(self), "kv_cache_tokens": self.kv_cache_tokens,
                "kv_cache_bytes": self.kv_cache_bytes,
                "max_concurrency": round(self.max_concurrency, 2)}

    def _borrowing_text(self) -> str:
        if not self.encoder_borrowing:
            return "off: image embeddings leaving the encoder cache are dropped"
        saves = (f"a byte of image embeddings saves {self.encoder_flops_per_byte:,.0f} FLOPs, "
                 f"a byte of KV {self.prefill_flops_per_byte:,.0f}")
        rule = ("so they may also take the prefix cache's least recently used free blocks"
                if self.encoder_displaces_prefix
                else "so they never displace prefix-cached blocks")
        return ("image embeddings beyond the encoder cache stay in free KV blocks, given back "
                f"the moment the KV cache needs them; {saves}, {rule}")

    def summary(self) -> str:
        """The report as a few lines of text (logged at start-up, printed by ``mmserve plan``)."""

        def est(name: str) -> str:
            return " (estimate)" if name in self.estimated else ""

        base = "available RAM" if self.device == "cpu" else "GPU memory"
        ranks = self.tensor_parallel_size
        per_rank = f", per rank of {ranks}" if ranks > 1 else ""
        if ranks > 1:
            base = (f"({base} / {ranks} ranks)" if self.device == "cpu"
                    else f"{base} of each of {ranks} GPUs")
        kv_note = {"memory": "all the memory left",
                   "kv_cache_memory": "set by kv_cache_memory",
                   "max_num_seqs x max_model_len": (
                       f"all that max_num_seqs x max_model_len can use; the memory allows "
                       f"{self.kv_budget_blocks} blocks")}[self.kv_cache_limited_by]
        lines = [
            f"memory plan on {self.device}{per_rank}: budget {_size(self.budget_bytes)} = "
            f"{self.gpu_memory_utilization:g} x {_size(self.memory_bytes)} {base}"
            f"{est('memory_bytes')}",
            f"  weights           {_size(self.weights_bytes):>11}{est('weights_bytes')}"
            + (f" (LoRA adapters' slots {_size(self.lora_bytes)} of it)"
               if self.lora_bytes else ""),
            f"  peak activations  {_size(self.activation_bytes):>11}"
            f"{est('activation_bytes')}: {self.activation_method}",
            f"  encoder reserve   {_size(self.encoder_cache_bytes):>11}: "
            f"{self.encoder_cache_items} images, {self.encoder_cache_tokens} embedding tokens "
            "(the encoder cache's own memory)",
            f"  borrowing         {self._borrowing_text()}",
            f"  KV cache          {_size(self.kv_cache_bytes):>11}: {self.num_blocks} blocks x "
            f"{self.block_size} tokens = {self.kv_cache_tokens} tokens at "
            f"{self.kv_bytes_per_token} B/token ({kv_note})",
            f"  max_model_len={self.max_model_len} ({self.max_model_len_source}; model limit "
            f"{self.model_max_len}), max_num_seqs={self.max_num_seqs} "
            f"({self.max_num_seqs_source}), max concurrency at max_model_len "
            f"{self.max_concurrency:.2f}x",
        ]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def max_num_seqs_bound(config: EngineConfig) -> int:
    """The most sequences the engine may run, known before the KV cache is sized: an auto
    max_num_seqs counts as its largest auto value (256)."""
    return config.max_num_seqs or (1 if config.single_user_mode else DEFAULT_MAX_NUM_SEQS)


def plan_memory(inp: PlanInputs) -> MemoryPlan:
    """Size the KV cache from the budget and fill in the auto limits.

    Raises InfeasiblePlanError, before anything is served, when the weights alone exceed the
    budget, when no KV block is left, or when the limits cannot fit (see ``resolve_limits``).
    """
    budget = int(inp.memory_bytes * inp.gpu_memory_utilization)
    block_bytes = inp.kv_bytes_per_token * inp.block_size
    encoder_bytes = inp.encoder_cache_tokens * inp.encoder_bytes_per_token
    others = inp.weights_bytes + inp.activation_bytes + encoder_bytes
    warnings = []
    if inp.kv_cache_memory is not None:
        kv_bytes = inp.kv_cache_memory
        limited_by = "kv_cache_memory"
        if kv_bytes < block_bytes:
            raise InfeasiblePlanError(
                f"kv_cache_memory={kv_bytes} bytes is smaller than one KV block ({block_bytes} "
                f"bytes = {inp.block_size} tokens x {inp.kv_bytes_per_token} bytes per token); "
                "raise kv_cache_memory or lower block_size.")
        if others + kv_bytes > budget:
            warnings.append(
                f"kv_cache_memory={kv_bytes} bytes plus weights, activations and encoder cache "
                f"({others} bytes) exceed the budget of {budget} bytes")
    else:
        limited_by = "memory"
        util = inp.gpu_memory_utilization
        if inp.weights_bytes > budget:
            raise InfeasiblePlanError(
                f"the weights alone take {inp.weights_bytes} bytes, more than the budget of "
                f"{budget} bytes ({util:g} x {inp.memory_bytes} bytes). Raise "
                "--gpu-memory-utilization, use a smaller dtype, or a device with more memory.")
        kv_bytes = budget - others
        if kv_bytes < block_bytes:
            raise InfeasiblePlanError(
                f"no room for the KV cache: the budget of {budget} bytes ({util:g} x "
                f"{inp.memory_bytes}) minus weights {inp.weights_bytes}, peak activations "
                f"{inp.activation_bytes} and encoder cache {encoder_bytes} leaves "
                f"{max(kv_bytes, 0)} bytes, less than one block of {block_bytes} bytes "
                f"({inp.block_size} tokens x {inp.kv_bytes_per_token} bytes per token). Raise "
                "--gpu-memory-utilization, lower --max-num-batched-tokens (smaller "
                "activations), or set --kv-cache-memory.")
    budget_blocks = kv_bytes // block_bytes
    limits = resolve_limits(
        budget_blocks, inp.block_size, inp.model_max_len, inp.max_model_len, inp.max_num_seqs,
        inp.kv_bytes_per_token, single_user_mode=inp.single_user_mode,
        min_model_len=inp.min_model_len)
    num_blocks = budget_blocks
    # A KV tensor is allocated whole up front. On the CPU it is real RAM shared with the
    # machine, and in single-user mode nothing but one sequence can use it, so when the memory
    # would hold at least one more sequence of max_model_len than max_num_seqs can use, the
    # engine allocates only what max_num_seqs sequences fill (vLLM's CPU backend likewise
    # keeps a bounded KV space). Otherwise memory is what binds and the count stays the
    # memory's, which does not depend on max_model_len; kv_budget_blocks always keeps it.
    bounded = inp.kv_cache_memory is None and (inp.device == "cpu" or inp.single_user_mode)
    blocks_per_seq = cdiv(limits.max_model_len, inp.block_size)
    usable = limits.max_num_seqs * blocks_per_seq
    if bounded and usable + blocks_per_seq <= budget_blocks:
        num_blocks = usable
        limited_by = "max_num_seqs x max_model_len"
    fit = num_blocks // blocks_per_seq
    both_given = limits.max_model_len_source == limits.max_num_seqs_source == "given"
    if both_given and fit < limits.max_num_seqs:
        warnings.append(
            f"only {fit} of max_num_seqs={limits.max_num_seqs} sequences of max_model_len="
            f"{limits.max_model_len} tokens fit in the KV cache at once; longer ones wait or "
            "are preempted")
    return MemoryPlan(
        device=inp.device,
        memory_bytes=inp.memory_bytes,
        gpu_memory_utilization=inp.gpu_memory_utilization,
        budget_bytes=budget,
        weights_bytes=inp.weights_bytes,
        activation_bytes=inp.activation_bytes,
        activation_method=inp.activation_method,
        encoder_cache_items=inp.encoder_cache_items,
        encoder_cache_tokens=inp.encoder_cache_tokens,
        encoder_cache_bytes=encoder_bytes,
        kv_bytes_per_token=inp.kv_bytes_per_token,
        block_size=inp.block_size,
        kv_budget_blocks=budget_blocks,
        num_blocks=num_blocks,
        kv_cache_limited_by=limited_by,
        model_max_len=inp.model_max_len,
        max_model_len=limits.max_model_len,
        max_model_len_source=limits.max_model_len_source,
        max_num_seqs=limits.max_num_seqs,
        max_num_seqs_source=limits.max_num_seqs_source,
        encoder_borrowing=inp.encoder_borrowing,
        encoder_flops_per_byte=inp.encoder_flops_per_byte,
        prefill_flops_per_byte=inp.prefill_flops_per_byte,
        tensor_parallel_size=inp.tensor_parallel_size,
        lora_bytes=inp.lora_bytes,
        estimated=inp.estimated,
        warnings=tuple(warnings),
    )


def resolve_limits(
    num_blocks: int,
    block_size: int,
    model_max_len: int,
    max_model_len: int | None,
    max_num_seqs: int | None,
    kv_bytes_per_token: int,
    single_user_mode: bool = False,
    min_model_len: int = 1,
) -> Limits:
    """Fill in whichever of max_model_len / max_num_seqs is ``None`` (auto) from the blocks.

    - neither given: max_model_len = the longest sequence the cache holds, capped at the
      model's limit; max_num_seqs = 256, capped at the block count (each running sequence
      needs a block);
    - max_num_seqs given (or single_user_mode, which means 1): max_model_len = the longest
      length that lets that many sequences fit at once;
    - max_model_len given: max_num_seqs = how many sequences of it fit, at most 256;
    - both given: kept, provided one sequence of max_model_len fits.

    Raises InfeasiblePlanError with the numbers and what to change otherwise.
    """
    capacity = num_blocks * block_size
    seqs_source = "given"
    if single_user_mode:
        if max_num_seqs not in (None, 1):
            raise InfeasiblePlanError(
                f"single_user_mode runs one sequence, but max_num_seqs={max_num_seqs} was "
                "given; drop one of the two.")
        max_num_seqs, seqs_source = 1, "single_user_mode"
    if max_model_len is not None:
        if max_model_len > model_max_len:
            raise InfeasiblePlanError(
                f"max_model_len={max_model_len} exceeds the model's limit of {model_max_len} "
                "tokens (max_position_embeddings); lower it or leave it auto.")
        blocks_per_seq = cdiv(max_model_len, block_size)
        if blocks_per_seq > num_blocks:
            raise InfeasiblePlanError(
                f"max_model_len={max_model_len} does not fit: the KV cache holds {num_blocks} "
                f"blocks of {block_size} tokens = {capacity} tokens "
                f"({capacity * kv_bytes_per_token} bytes at {kv_bytes_per_token} bytes per "
                f"token), and one sequence needs "
                f"{blocks_per_seq} blocks. Lower max_model_len to at most {capacity} (or leave "
                "it auto), or give the KV cache more memory.")
        if max_num_seqs is None:
            max_num_seqs = min(DEFAULT_MAX_NUM_SEQS, num_blocks // blocks_per_seq)
            seqs_source = "auto"
        return Limits(max_model_len, "given", max_num_seqs, seqs_source)

    if max_num_seqs is None:
        max_num_seqs = min(DEFAULT_MAX_NUM_SEQS, num_blocks)
        seqs_source = "auto"
        per_seq_blocks = num_blocks
    else:
        per_seq_blocks = num_blocks // max_num_seqs
    if per_seq_blocks == 0:
        raise InfeasiblePlanError(
            f"max_num_seqs={max_num_seqs} sequences cannot each hold even one block: the KV "
            f"cache has {num_blocks} blocks of {block_size} tokens ({kv_bytes_per_token} bytes "
            f"per token). Lower max_num_seqs to at most {num_blocks}, or give the KV cache "
            "more memory.")
    max_model_len = min(model_max_len, per_seq_blocks * block_size)
    if max_model_len < min_model_len:
        raise InfeasiblePlanError(
            f"the KV cache holds {per_seq_blocks * block_size} tokens per sequence "
            f"({num_blocks} blocks of {block_size} tokens for {max_num_seqs} sequences at "
            f"{kv_bytes_per_token} bytes per token), less than the {min_model_len} tokens of "
            "one image and one generated token. Give the KV cache more memory, lower "
            "max_num_seqs, or lower --max-num-batched-tokens (smaller activations).")
    return Limits(max_model_len, "auto", max_num_seqs, seqs_source)


def feasible_pairs(plan: MemoryPlan, max_rows: int = 8) -> list[tuple[int, int]]:
    """(max_model_len, sequences of it that fit at once) for a ladder of lengths.

    Lengths: the longest that fits (capped at the model's limit), then halving down to 256.
    Uses the block count the memory allows, not the possibly bounded allocation.
    """
    blocks, bs = plan.kv_budget_blocks, plan.block_size
    length = min(plan.model_max_len, blocks * bs)
    rows = []
    while length >= 1 and len(rows) < max_rows:
        rows.append((length, blocks // cdiv(length, bs)))
        if length <= 256:
            break
        length = max(256, 1 << ((length - 1).bit_length() - 1))  # previous power of two
    return rows


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
