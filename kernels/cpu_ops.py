"""Compiled CPU kernels, built on first use with the machine's C++ compiler.

``decode_attention`` (``cpu_decode_attention.cpp``) reads each sequence's keys and values in
place from its KV blocks. The torch reference in ``paged_attention.py`` must first gather the
blocks into contiguous tensors and copy each head's keys again for ``bmm``: three to four times
the memory traffic of the one pass over K and one over V that decode attention needs.

Building takes about 30 s on two cores the first time; torch caches the library (under
``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) for later starts. Without
a compiler, or with ``MMSERVE_CPU_KERNELS=0``, ``load()`` returns None and the CPU runner uses
the torch reference, with one warning saying why.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

DISABLE_ENV = "MMSERVE_CPU_KERNELS"
_SOURCE = Path(__file__).with_name("cpu_decode_attention.cpp")
_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None


def load() -> ModuleType | None:
    """The compiled module, building it if needed; None when it cannot be had."""
    global _module, _failure
    with _lock:
        if _module is not None or _failure is not None:
            return _module
        if os.environ.get(DISABLE_ENV, "1") == "0":
            _failure = f"{DISABLE_ENV}=0"
            return None
        try:
            from torch.utils.cpp_extension import load as load_extension

            _module = load_extension(
                name="mmserve_cpu_decode_attention",
                sources=[str(_SOURCE)],
                # Reassociated float math (vectorized dot products and sums) but IEEE
                # inf/NaN handling; compile flags only, so the process's FP mode is untouched.
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno",
                              "-funsafe-math-optimizations"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as e:  # no compiler, no ninja, a build error: fall back, say why
            _failure = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''}"
            logger.warning("CPU attention kernel unavailable (%s); using the torch reference "
                           "(slower decode). Set %s=0 to skip the build.", _failure, DISABLE_ENV)
        return _module


def unavailable_reason() -> str | None:
    """Why ``load()`` returned None, once it has been called."""
    return _failure


def decode_attention(query, kv_cache, meta, scale: float):
    """``paged_attention``'s decode path (same arguments and result as the torch
    ``decode_attention``), with keys and values read in place by the compiled kernel."""
    if _module is None:  # per layer and step: no lock, the backend only exists after load()
        raise RuntimeError("the compiled CPU decode attention is not loaded; call load() first")
    return _module.decode_attention(query.contiguous(), kv_cache[0], kv_cache[1],
                                    meta.decode_block_tables, meta.decode_lens, scale)


def cpu_attention_backend():
    """The attention backend of the CPU runner: the torch reference for prompt chunks, the
    compiled kernel for decodes when it builds, the torch decode path otherwise."""
    from mmserve.kernels.paged_attention import paged_attention

    if load() is None:
        return paged_attention
    return functools.partial(paged_attention, decode=decode_attention)
