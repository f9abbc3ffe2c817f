"""The compiled CPU decode attention (``kernels/cpu_decode_attention.cpp``) against the torch
decode path it replaces, and its use by the CPU runner.

Skipped only where there is no C++ compiler (the runner then uses the torch path); where there
is one, a build failure fails these tests.
"""

import functools
import shutil

import pytest
import torch

from mmserve.kernels import cpu_ops
from mmserve.kernels.paged_attention import (
    build_attention_metadata,
    decode_attention,
    paged_attention,
)

pytestmark = pytest.mark.skipif(shutil.which("c++") is None,
                                reason="no C++ compiler: the CPU runner uses the torch path")


@pytest.fixture(scope="module")
def kernel():
    module = cpu_ops.load()
    assert module is not None, cpu_ops.unavailable_reason()
    return module


def _decode_batch(lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks
    tables, used = [], 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(perm[used:used + count])
        used += count
    meta = build_attention_metadata([1] * len(lens), lens, tables, block_size)
    query = torch.randn(len(lens), num_heads, head_dim, generator=g)
    return query.to(dtype), cache.to(dtype), meta


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                        (torch.float16, 2e-3)])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(12, 4, 64), (8, 8, 80),
                                                              (16, 2, 128), (4, 1, 96)])
def test_kernel_matches_torch_decode(kernel, dtype, atol, num_heads, num_kv_heads, head_dim):
    # Lengths on and off block boundaries, a single token, a long one.
    lens = [1, 15, 16, 17, 33, 100, 352]
    query, cache, meta = _decode_batch(lens, num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    expected = decode_attention(query.float(), cache.float(), meta, scale)
    got = cpu_ops.decode_attention(query, cache, meta, scale)
    assert got.dtype == dtype and got.shape == query.shape
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=atol)


def test_kernel_in_a_mixed_batch(kernel):
    """Through ``paged_attention``: prompt chunks keep the torch path, decodes use the kernel,
    and the step's own K/V (written first) are attended to."""
    g = torch.Generator().manual_seed(1)
    q_lens, ctx_lens, tables = [5, 1, 1, 8], [5, 20, 40, 24], [[0], [2, 3], [4, 5, 6], [7, 8]]
    n = sum(q_lens)
    q, k, v = (torch.randn(n, h, 64, generator=g) for h in (12, 4, 4))
    meta = build_attention_metadata(q_lens, ctx_lens, tables, 16)
    cache = torch.randn(2, 9, 16, 4, 64, generator=g)
    expected = paged_attention(q, k, v, cache.clone(), meta, 0.125)
    got = paged_attention(q, k, v, cache.clone(), meta, 0.125, decode=cpu_ops.decode_attention)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_kernel_rejects_mismatched_inputs(kernel):
    query, cache, meta = _decode_batch([20], 12, 4, 64, torch.float32)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel.decode_attention(query.bfloat16(), cache[0], cache[1], meta.decode_block_tables,
                                meta.decode_lens, 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernel.decode_attention(query[:, :10], cache[0], cache[1], meta.decode_block_tables,
                                meta.decode_lens, 0.125)


def test_cpu_runner_decodes_with_the_kernel(kernel, clip_llama):
    from mmserve import LLM

    runner = LLM(clip_llama, max_model_len=256).engine.runner
    assert isinstance(runner.attention, functools.partial)
    assert runner.attention.keywords["decode"] is cpu_ops.decode_attention
