"""Keep the C heap's freed memory in the process while serving on the CPU.

A forward pass allocates and frees the same tens of megabytes of activations every step. With
glibc's defaults, blocks above a few megabytes come straight from ``mmap`` and go back to the
kernel when freed, and the top of the heap is trimmed, so the next step faults every page in
again: over a million page faults in a 64-request benchmark run, 13-18% of its wall time, paid
mostly inside elementwise ops (a fault costs more than the arithmetic on its page).

Serving from a heap that keeps freed memory removes that cost. The memory it keeps is at most
the step's peak activations, which the memory plan already reserves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# glibc refuses an mmap threshold above 32 MiB on 64-bit systems; larger blocks still use mmap.
_MAX_MMAP_THRESHOLD = 32 << 20
_NEVER_TRIM = 2**31 - 1  # the parameter is an int

DISABLE_ENV = "MMSERVE_KEEP_HEAP"

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Ask glibc to serve blocks up to 32 MiB from the heap, never trim it, and give the
    threads started later that same heap.

    Returns whether the setting is in effect. Does nothing (and returns False) off glibc, or
    when ``MMSERVE_KEEP_HEAP=0``. Process-wide and idempotent.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(DISABLE_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1 and ok
    # Threads started from now on (the server's stepping thread among them) share the main
    # heap. A thread's own arena grows in separate 64 MiB heaps, and glibc unmaps such a heap
    # whenever it empties, whatever the trim threshold: on glibc 2.39 a step on a thread
    # faulted its activations in afresh every time.
    ok = mallopt(_M_ARENA_MAX, 1) == 1 and ok
    _applied = ok
    if ok:
        logger.debug("glibc malloc: mmap threshold 32 MiB, no heap trimming")
    else:
        logger.warning("could not tune glibc malloc; CPU steps may spend time in page faults")
    return ok


def release_free_memory() -> bool:
    """Return the heap's free pages to the operating system (glibc's ``malloc_trim(0)``).

    ``keep_freed_memory()`` tells glibc never to trim, which suits the engine's steps (each
    reuses the last one's pages) but not one-off work that touches far more memory than a step:
    preprocessing large images in server threads can leave gigabytes of freed heap in the
    process for good (RSS 650 MB -> 2.1 GB, never returned). Call this after such work, for
    instance when a request's ``ProcessedPrompt.preprocess_peak_bytes`` is well above the
    step's peak activations, between steps rather than on every one: it walks every malloc
    arena, and the engine's kept activation pages go back too, so the next step faults them
    in once more (the cost ``keep_freed_memory`` otherwise saves, paid once).

    Returns whether any memory was released. Does nothing (and returns False) off glibc.
    Safe from any thread: glibc locks each arena while trimming it.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim(0) == 1


_MADV_HUGEPAGE = 14  # madvise advice (asm-generic/mman-common.h)
_HUGE_PAGE = 2 << 20


def advise_huge_pages(tensor) -> bool:
    """Ask Linux to back ``tensor``'s memory with 2 MiB pages (``madvise(MADV_HUGEPAGE)``),
    before anything touches it.

    Decode attention reads KV blocks scattered over the whole cache: with 4 KiB pages nearly
    every block costs TLB misses, with 2 MiB pages a block's neighbours share one entry.
    Linux gives huge pages to memory so advised when transparent huge pages are ``always`` or
    ``madvise`` (the common default); elsewhere this changes nothing. Only the 2 MiB-aligned
    middle of the tensor is advised. Returns whether the advice was taken."""
    if not sys.platform.startswith("linux"):
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    last = end // _HUGE_PAGE * _HUGE_PAGE
    if last <= first:
        return False
    try:
        madvise = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise(first, last - first, _MADV_HUGEPAGE) == 0
