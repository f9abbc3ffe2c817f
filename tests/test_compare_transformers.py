"""``benchmarks/compare_transformers.py`` runs end to end at a tiny scale: both sides on the
device the suite runs on, the float32 check exact, the bfloat16 comparison and mmserve's
device busy share reported."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmserve.config import cpu_supports_bf16
from mmserve.engine.memory_plan import GPU_MEMORY_UTILIZATION_ENV

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_transformers.py"


@pytest.mark.slow
def test_compare_transformers_on_a_tiny_checkpoint(clip_llama: str) -> None:
    dtype = "bfloat16" if torch.cuda.is_available() or cpu_supports_bf16() else "float32"
    argv = ["--model", clip_llama, "--num-prompts", "4", "--workloads", "mixed",
            "--mmserve-configs", "default", "--hf-batch-size", "4", "--image-sizes", "40x30",
            "--max-model-len", "256", "--fp32-check", "2", "--fp32-max-tokens", "4",
            "--dtype", dtype, "--gpu-memory-utilization",
            os.environ.get(GPU_MEMORY_UTILIZATION_ENV, "0.1")]
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"dtype {dtype}, device {device}" in out
    busy = re.search(r"mmserve's device busy ([\d.]+)% of the run .* from (.*?):", out)
    assert busy is not None, out
    assert 0 < float(busy.group(1)) <= 100
    assert busy.group(2) == ("CUDA events" if device == "cuda" else "the runner's wall time")
    assert "2/2 identical token for token" in out
    if dtype == "bfloat16":
        assert re.search(r"bfloat16 against transformers-float32 .* transformers-bfloat16 "
                         r"[\d.]+%, mmserve-bfloat16 [\d.]+%", out), out
