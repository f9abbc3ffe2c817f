"""Memory measurements for the memory plan: device memory, weights, peak activations.

The CPU has no allocator statistics like ``torch.cuda.max_memory_allocated``, so the peak of a
profile run is measured by watching every tensor storage that the run's operators create and
noting when each one dies. The same tracker works on the meta device, where it turns a dry run
with no data into an exact count of the bytes the same run would allocate for real.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mmserve.config import EngineConfig
from mmserve.engine.encoder_cache import EncoderBudget
from mmserve.engine.memory_plan import max_num_seqs_bound
from mmserve.engine.request import ImageInput
from mmserve.engine.scheduler import ImageSlice, ScheduledRequest, SchedulerOutput
from mmserve.sampling_params import SamplingParams

T = TypeVar("T")


class _PeakTracker(TorchDispatchMode):
    """Sum of live tensor storages created by operators inside the mode, and its maximum.

    A storage is new when no input of the operator shares it: views, in-place updates and
    ``out=`` writes return an input's storage and are not allocations. Allocations made inside
    a kernel (scratch buffers) are invisible here; they are small next to the activations.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs:
            return out
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs or {}))
                  if isinstance(t, torch.Tensor)}
        for t in outputs:
            # Storages keep one Python object for their whole life, so its id is stable and
            # its finalizer runs exactly when the memory is released.
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, key)
        return out


def track_peak_bytes(fn: Callable[[], T]) -> tuple[T, int]:
    """Run ``fn`` and return its result and the peak bytes of tensors it had alive at once.

    Tensors that existed before the call (weights, caches) are not counted; tensors the result
    still holds are counted while they were alive.
    """
    tracker = _PeakTracker()
    with tracker:
        result = fn()
    return result, tracker.peak


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (the weights an engine holds)."""
    tensors: list[Any] = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def device_memory(device: torch.device) -> int:
    """The memory a plan may take a share of: a GPU's total memory, or the RAM available now.

    On a GPU this is the device's capacity, as in vLLM. On the CPU the process shares RAM with
    everything else on the machine, so the base is what the kernel reports as available
    (``MemAvailable``: free memory plus reclaimable page cache) when the engine starts.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def profile_batch(
    num_tokens: int,
    max_num_seqs: int,
    max_positions: int,
    block_size: int,
    num_images: int,
    tokens_per_image: int,
    pixel_shape: tuple[int, ...],
) -> SchedulerOutput:
    """The worst step the scheduler can produce, as dummy requests.

    ``num_tokens`` tokens in all (``max_num_batched_tokens``): ``max_num_seqs - 1`` decodes,
    each sampling a row of logits, and the rest as one prompt chunk (split where it would pass
    ``max_positions``) whose first tokens are image placeholders. ``num_images`` images of
    ``tokens_per_image`` embeddings are encoded in the step, as many as the encoder budget
    allows. Token ids are 0 and pixels are zeros: no random numbers are drawn.
    """
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    prompt_tokens = num_tokens - (num_seqs - 1)
    lengths = [1] * (num_seqs - 1)
    while prompt_tokens > 0:
        lengths.insert(0, min(prompt_tokens, max_positions))
        prompt_tokens -= lengths[0]
    images = [ImageInput(f"profile-{k}", offset=k * tokens_per_image, length=tokens_per_image,
                         pixel_values=torch.zeros(pixel_shape)) for k in range(num_images)]
    greedy = SamplingParams(temperature=0.0)
    requests = []
    next_block = 0
    for i, n in enumerate(lengths):
        num_blocks = -(-n // block_size)
        slices = []
        if i == 0:
            for img in images:
                if img.offset >= n:
                    break
                slices.append(ImageSlice(img.hash, 0, img.offset, min(img.length, n - img.offset)))
        requests.append(ScheduledRequest(
            request_id=f"profile-{i}", token_ids=[0] * n, start_pos=0,
            block_ids=list(range(next_block, next_block + num_blocks)), image_slices=slices,
            sample=True, sampling_params=greedy))
        next_block += num_blocks
    return SchedulerOutput(requests=requests, encoder_inputs={img.hash: img for img in images})


def profile_batch_for(config: EngineConfig, hf_config, encoder_budget: EncoderBudget,
                      num_images: int) -> SchedulerOutput:
    """``profile_batch`` for an engine's settings and checkpoint."""
    size = hf_config.vision_config.image_size
    return profile_batch(
        num_tokens=config.max_num_batched_tokens,
        max_num_seqs=max_num_seqs_bound(config),
        max_positions=hf_config.text_config.max_position_embeddings,
        block_size=config.block_size,
        num_images=num_images,
        tokens_per_image=encoder_budget.max_tokens_per_item,
        pixel_shape=(1, 3, size, size),
    )
