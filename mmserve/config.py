"""Engine configuration: one frozen dataclass built by the CLI, the Python API and the server."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch

DEVICES = ("auto", "cpu", "cuda")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of one engine. Fields left as ``None`` are decided at start-up.

    Names follow vLLM's engine arguments so that habits carry over.
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"  # auto = cuda when a CUDA device is visible, else cpu
    enforce_eager: bool = False  # no CUDA graphs for decode batches
    seed: int = 0
    # Scheduling. ``None`` or "auto": sized by the memory plan at start-up.
    max_model_len: int | str | None = None
    max_num_seqs: int | str | None = None
    max_num_batched_tokens: int = 2048
    # KV cache.
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes; sets the KV cache size directly
    # Share of the device's memory the engine may use: a GPU's total memory, or on the CPU the
    # RAM available at start-up. None: 0.9 on a GPU, 0.8 on the CPU (see memory_plan.py).
    gpu_memory_utilization: float | None = None
    single_user_mode: bool = False  # max_num_seqs = 1; the KV cache for that one sequence
    # Multimodal. ``limit_mm_per_prompt`` is taken in vLLM's forms: an image count, or
    # ``{"image": N}`` or ``{"image": {"count": N, "width": W, "height": H}}`` (also as JSON
    # text); it is stored as the count, and the size, the largest image the memory plan must
    # provision for, as ``max_image_size`` (width, height).
    limit_mm_per_prompt: int | dict | str = 4
    max_image_size: tuple[int, int] | None = None
    encoder_cache_size: int | None = None
    max_image_pixels: int = 50_000_000

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs"):
            value = getattr(self, name)
            if value == "auto":
                object.__setattr__(self, name, None)
            elif value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be a positive integer or 'auto', got {value!r}.")
        util = self.gpu_memory_utilization
        if util is not None and not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util}.")
        if self.single_user_mode and self.max_num_seqs not in (None, 1):
            raise ValueError(f"single_user_mode runs one sequence but max_num_seqs="
                             f"{self.max_num_seqs}; drop one of the two.")

        def positive(name: str, value: int | None) -> None:
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value}.")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "kv_cache_memory", "encoder_cache_size", "max_image_pixels"):
            positive(name, getattr(self, name))
        count, size = parse_mm_limit(self.limit_mm_per_prompt)
        object.__setattr__(self, "limit_mm_per_prompt", count)
        if size is not None:
            object.__setattr__(self, "max_image_size", size)
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}.")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}.")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu' "
                             "(or 'auto'), or install a CUDA build of torch.")

    @property
    def resolved_device(self) -> str:
        """``cpu`` or ``cuda``: ``auto`` picks cuda when torch sees a CUDA device."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def torch_dtype(self) -> torch.dtype:
        """The weights' and activations' dtype (``auto``: bfloat16 on GPUs and CPUs with it)."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.resolved_device == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def cpu_supports_bf16() -> bool:
    """True when the CPU has native bfloat16 matmul (AVX512-BF16 or AMX)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def parse_mm_limit(value: Any) -> tuple[int, tuple[int, int] | None]:
    """``limit_mm_per_prompt`` in any of vLLM's forms -> (images per prompt, largest image's
    (width, height) or None)."""
    usage = ('limit_mm_per_prompt must be an image count or JSON such as \'{"image": 2}\' or '
             '\'{"image": {"count": 2, "width": 1024, "height": 1024}}\'')
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{usage}, got {value!r}.") from None
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"image"})
        if unknown:
            what = "video is not supported yet" if "video" in unknown else "unknown modality"
            raise ValueError(f"limit_mm_per_prompt: {what} ({', '.join(unknown)}); mmserve "
                             'takes images only: \'{"image": N}\'.')
        value = value.get("image", 0)
    size = None
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"count", "width", "height"})
        if unknown or "count" not in value:
            raise ValueError(f'{usage}; the "image" object takes "count", "width" and '
                             f'"height", got {sorted(value)}.')
        if ("width" in value) != ("height" in value):
            raise ValueError('limit_mm_per_prompt: give both "width" and "height" of the '
                             "largest image, or neither.")
        if "width" in value:
            width, height = value["width"], value["height"]
            if not all(_is_int(v) and v > 0 for v in (width, height)):
                raise ValueError("limit_mm_per_prompt: width and height must be positive "
                                 f"integers, got {width!r} x {height!r}.")
            size = (width, height)
        value = value["count"]
    if not _is_int(value) or value < 0:
        raise ValueError(f"{usage}; the count must be an integer >= 0, got {value!r}.")
    return value, size


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
