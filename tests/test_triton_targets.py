"""The Triton kernels compile for NVIDIA GPUs, checked without one.

``python -m mmserve.kernels.triton_targets`` records the launches the kernels' wrappers make
for the supported model families and compiles each for a GPU architecture (Triton ships the
compiler). It runs in a process of its own: this suite's processes import Triton with its
interpreter on, and an interpreted kernel cannot be compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mmserve.kernels import triton_targets
from mmserve.kernels.triton_attention import SHARED_MEMORY_BUDGET, paged_attention_tiles


def _run(*args: str) -> subprocess.CompletedProcess:
    """``python ARGS`` without Triton's interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=600)


def _rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.startswith("sm_")]


@pytest.mark.slow
def test_kernels_compile_for_the_gpus_with_least_and_most_shared_memory():
    # sm_89 (L4, RTX 40xx) has 99 KiB of shared memory a block, sm_90 (H100, H200) 227. The
    # two families: heads of 64 in GQA groups of 8 (the 1.4B bench checkpoint, CLIP's quick
    # GELU), heads of 128 in groups of 7 with a vision tower of rotary heads of 80, RMSNorms
    # and a gated SiLU (Qwen2.5-VL-7B). Float32 prompt chunks of heads of 128 took 115,200
    # bytes of shared memory before their key tiles narrowed.
    done = _run("-m", "mmserve.kernels.triton_targets", "--arch", "89,90",
                "--dtype", "bfloat16,float32", "--models", "llava-bench-1.4b,qwen2.5-vl-7b")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("all compiled")
    rows = _rows(done.stdout)
    assert {r[1] for r in rows} == {"rms_norm", "rotary", "silu_and_mul", "quick_gelu",
                                    "write_kv", "paged_attention"}
    assert {r[0] for r in rows} == {"sm_89", "sm_90"}
    for r in rows:
        shared = int(r[-5].replace(",", ""))
        assert shared <= triton_targets.ARCHS[int(r[0][3:])][0], r
    # Float32, where fused multiply-adds would change bits: the rotary kernel rounds each
    # product as torch does and must have none; the norm (compiled with them allowed) shows
    # that the count finds them.
    fp32 = [r for r in rows if r[2] == "fp32"]
    rotary = [r for r in fp32 if r[1] == "rotary"]
    assert {r[3] for r in rotary} == {"HALF=32", "HALF=40", "HALF=64"}
    assert not any(int(r[-2]) for r in rotary)
    norms = [int(r[-2]) for r in fp32 if r[1] == "rms_norm"]
    assert norms and all(norms)


_OVERSIZED = """
import torch
from mmserve.kernels import triton_targets
from mmserve.kernels.triton_attention import TritonAttentionMetadata, triton_paged_attention

# A float32 prompt chunk of heads of 256: 64 query rows of 256 values alone take 64 KiB.
with triton_targets.recording() as launches:
    meta = TritonAttentionMetadata.build([24], [24], [[0, 1]], 16)
    q = torch.zeros(24, 2, 256)
    triton_paged_attention(q, q, q, torch.zeros(2, 2, 16, 2, 256), meta, 0.0625)
attention = [lc for lc in launches if lc.name == "paged_attention"]
for arch in (86, 90):
    done = triton_targets.compile_launch(attention[0], arch)
    print(arch, done.shared, done.fits, done.error)
"""


def test_a_kernel_over_an_architectures_shared_memory_is_reported():
    done = _run("-c", _OVERSIZED)
    assert done.returncode == 0, done.stderr
    (arch86, shared86, fits86, error86), (arch90, shared90, fits90, error90) = (
        line.split() for line in done.stdout.split("\n") if line[:2] in ("86", "90"))
    assert shared86 == shared90 and int(shared86) > triton_targets.ARCHS[86][0]
    assert (fits86, fits90) == ("False", "True") and error86 == error90 == "None"


def test_interpreted_triton_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as this suite runs without a GPU
    with pytest.raises(SystemExit):
        triton_targets.main(["--arch", "90"])
    assert "TRITON_INTERPRET is set" in capsys.readouterr().err


@pytest.mark.parametrize("query_len", [1, 64])
@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("head_pad", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("group_pad", [1, 2, 4, 8, 16])
def test_attention_tiles_keep_to_the_shared_memory_budget(query_len, itemsize, head_pad,
                                                          group_pad):
    block_q, block_n = paged_attention_tiles(query_len, group_pad, head_pad, itemsize)
    rows = block_q * group_pad
    assert rows >= 16 and block_n >= 16  # tl.dot's smallest
    shared = (rows * head_pad + 2 * block_n * head_pad + rows * block_n) * itemsize
    # Narrowed only where the widest tile would not fit, and then as far as it goes.
    assert shared <= SHARED_MEMORY_BUDGET or block_n == 16
    if block_n < (64 if query_len > 1 else 32):
        wider = (rows * head_pad + 4 * block_n * head_pad + 2 * rows * block_n) * itemsize
        assert wider > SHARED_MEMORY_BUDGET
