"""The CPU kernels' benchmark scripts run (at a tiny size), so that the tables behind the kernel
choices can be taken again on any machine. Their figures are not checked: they depend on the
machine and what else runs on it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mmserve.kernels import cpu_ops

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_linear_benchmark_prints_its_table(dtype):
    if "avx2" not in cpu_ops.cpu_flags() or (
            dtype == "bfloat16" and "avx512f" not in cpu_ops.cpu_flags()):
        pytest.skip(f"the {dtype} table needs the kernel path this CPU lacks")
    run = _run("benchmarks/cpu_linear.py", "--dtype", dtype, "--rows", "1,3",
               "--weights-mb", "1", "--min-seconds", "0.01")
    assert run.returncode == 0, run.stderr
    assert f"threads; {dtype}" in run.stdout
    assert run.stdout.count("GFLOP/s") == 2 * 5  # two row counts of five shapes


def test_cpu_attention_benchmark_prints_its_table_or_why_not():
    run = _run("benchmarks/cpu_attention.py", "--heads", "2", "--repeats", "1")
    if "avx512_bf16" not in cpu_ops.cpu_flags():
        assert run.returncode != 0 and "needs AVX512-BF16" in run.stderr
        return
    assert run.returncode == 0, run.stderr
    # Five images and five prompts: the kernel (its AMX tiles where the CPU has AMX, its
    # vector code with each multiply) and torch.
    header = next(line for line in run.stdout.splitlines() if line.split()[:1] == ["shape"])
    columns = 4 if "AMX tiles" in header else 3
    assert "dot" in header and "FMA" in header
    assert run.stdout.count(" ms") == columns * 10


def test_cpu_elementwise_benchmark_prints_its_table():
    run = _run("benchmarks/cpu_elementwise.py", "--rows", "3", "--repeats", "1")
    assert run.returncode == 0, run.stderr
    header, *rows = run.stdout.splitlines()[1:]
    paths = [p for p in ("avx2", "avx512") if p in cpu_ops.supported_paths()]
    assert header.split() == ["torch"] + [w for p in paths for w in (p, "path")]
    assert [row.split()[0] for row in rows] == ["rms_norm", "add_rms_norm", "rotary",
                                                "silu_and_mul", "quick_gelu", "add_layer_norm"]
    for row in rows:  # torch's time, then each path's
        assert all(float(ms) >= 0 for ms in row.split()[-1 - len(paths):])
        assert row.split()[-2 - len(paths)].isdigit()  # the shape ends before them
