"""The CPU runner's heap setting: freed activations are reused instead of faulted in again.

Counted in page faults, not time, so the result does not depend on the machine's load. Each
case runs in a fresh interpreter: the setting is process-wide and cannot be undone.
"""

import ctypes
import ctypes.util
import os
import subprocess
import sys
import textwrap

import pytest


def _glibc_with_mallinfo2() -> bool:
    if not sys.platform.startswith("linux") or not ctypes.util.find_library("c"):
        return False
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")  # glibc 2.33 and later
    except OSError:
        return False


pytestmark = pytest.mark.skipif(
    not _glibc_with_mallinfo2(),
    reason="the heap setting is for glibc on Linux; elsewhere keep_freed_memory() is a no-op",
)

# 15 rounds of four 16 MiB tensors (4096 pages each) alive at once, then freed, on the main
# thread or on a second one (the server steps the engine on one). Prints whether the setting is
# applied, whether the first 16 MiB block came from mmap, and the page faults of rounds 6-15.
_SCRIPT = textwrap.dedent("""
    import ctypes, resource, sys, threading
    import torch
    from mmserve.worker.cpu_allocator import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    applied = keep_freed_memory()
    assert keep_freed_memory() == applied  # idempotent

    def churn():
        x = torch.ones(4 << 20)
        churn.mmapped = libc.mallinfo2().hblkhd >= 16 << 20
        del x
        faults = []
        for _ in range(15):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            xs = [torch.ones(4 << 20) for _ in range(4)]
            del xs
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        churn.steady_faults = sum(faults[5:])

    if sys.argv[1] == "thread":
        t = threading.Thread(target=churn)
        t.start()
        t.join()
    else:
        churn()
    print(int(applied), int(churn.mmapped), churn.steady_faults)
""")


def _run(where: str, keep_heap: bool) -> tuple[bool, bool, int]:
    env = dict(os.environ, MMSERVE_KEEP_HEAP="1" if keep_heap else "0")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, where], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0] == "1", out[1] == "1", int(out[2])


@pytest.mark.parametrize("where", ["main", "thread"])
def test_activation_sized_blocks_come_from_a_heap_that_keeps_them(where):
    applied, mmapped, steady_faults = _run(where, keep_heap=True)
    assert applied
    assert not mmapped  # glibc's default maps a 16 MiB block afresh (next test)
    # Once warm, 40 more allocations of 4096 pages each fault in at most one block's pages.
    assert steady_faults < 4096, steady_faults


def test_opt_out_leaves_glibc_defaults():
    applied, mmapped, _ = _run("main", keep_heap=False)
    assert not applied
    assert mmapped


def test_cpu_runner_applies_the_setting(clip_llama):
    script = textwrap.dedent(f"""
        from mmserve import LLM
        from mmserve.worker import cpu_allocator
        assert cpu_allocator._applied is None
        LLM({clip_llama!r}, device="cpu", max_model_len=256)
        print(cpu_allocator._applied)
    """)
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                         text=True, env=dict(os.environ, MMSERVE_KEEP_HEAP="1")).stdout
    assert out.split()[-1] == "True"


def _huge_page_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def test_kv_cache_memory_is_advised_huge_pages():
    """The KV cache asks for 2 MiB pages before it is touched (decode attention reads blocks
    scattered across it); where Linux grants them, the process's huge pages grow by it."""
    import torch

    from mmserve.worker.cpu_allocator import advise_huge_pages

    assert not advise_huge_pages(torch.empty(1000))  # no whole 2 MiB page inside
    if _thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {_thp_mode()!r} here: the advice has no effect")
    before = _huge_page_kib()
    cache = torch.empty(64 << 20, dtype=torch.uint8)
    assert advise_huge_pages(cache)
    cache.zero_()
    assert _huge_page_kib() - before >= 32 << 10  # at least half of it (64 MiB)
