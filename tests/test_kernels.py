"""Triton kernels against the torch reference (``kernels/paged_attention.py``).

Without a GPU the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` before anything imports Triton). Shapes are small so the interpreter stays
fast. On a machine with CUDA the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mmserve.kernels import elementwise, fused, triton_fused
from mmserve.kernels.paged_attention import (
    AttentionMetadata,
    build_attention_metadata,
    padded_block_tables,
    paged_attention,
    write_kv_cache,
)
from mmserve.kernels.transfer import (
    PACK_ALIGN,
    host_tensor,
    pack,
    tensor_on,
    to_device,
    to_device_all,
    unpack,
)
from mmserve.kernels.triton_attention import TritonAttentionMetadata, triton_paged_attention
from mmserve.kernels.triton_kv_cache import triton_write_kv_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if DEVICE == "cpu":
    from triton.runtime.interpreter import InterpretedFunction

    from mmserve.kernels import triton_attention

    if not isinstance(triton_attention._paged_attention_kernel, InterpretedFunction):
        raise RuntimeError("Triton was imported before TRITON_INTERPRET=1 was set; "
                           "tests/conftest.py must set it before anything imports Triton")

# Tolerances, against a float32 reference computed from the same (rounded) inputs:
# - float32: the interpreter and the GPU ("ieee" dots) only reorder float32 sums; 1e-5.
# - float16: the output is rounded to float16 (half an ulp is 1e-3 for |x| in [2, 4]) and the
#   softmax weights are rounded to float16 before the P @ V dot (relative 2**-11 each); 4e-3.
# - bfloat16: the same with 8-bit mantissas (an ulp is 1.6e-2 in [2, 4]; the interpreter
#   truncates float32 -> bfloat16 instead of rounding, so its error reaches a whole ulp, measured
#   1.5e-2; on the GPU the weights are also rounded, 2**-8 relative); 3e-2.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# A sequence of a step: (query_len, seq_len). seq_len - query_len tokens were cached before.
DECODES = [(1, 1), (1, 17), (1, 33), (1, 8)]
PREFILLS = [(9, 9), (21, 21), (17, 17)]
CHUNKS = [(5, 23), (16, 40), (7, 7)]
MIXED = [(1, 20), (11, 11), (1, 3), (6, 38), (1, 1), (13, 29)]


def _block_tables(seqs: list[tuple[int, int]], block_size: int, num_blocks: int,
                  gen: torch.Generator) -> list[list[int]]:
    """Distinct, shuffled (non-contiguous) physical blocks for every sequence."""
    needed = [-(-s_len // block_size) for _, s_len in seqs]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    assert sum(needed) <= num_blocks
    tables, used = [], 0
    for n in needed:
        tables.append(perm[used:used + n])
        used += n
    return tables


def _reference_metadata(seqs: list[tuple[int, int]], tables: list[list[int]],
                        block_size: int) -> AttentionMetadata:
    """The CPU runner's metadata for the same batch."""
    return build_attention_metadata([q for q, _ in seqs], [s for _, s in seqs], tables,
                                    block_size)


def _run_both(seqs, num_heads, num_kv_heads, head_dim, dtype, block_size=16, seed=0):
    """Triton output and cache, and the float32 reference on the same rounded inputs."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(q for q, _ in seqs)
    num_blocks = sum(-(-s // block_size) for _, s in seqs) + 3
    tables = _block_tables(seqs, block_size, num_blocks, gen)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q = rand(num_tokens, num_heads, head_dim)
    k = rand(num_tokens, num_kv_heads, head_dim)
    v = rand(num_tokens, num_kv_heads, head_dim)
    # The cache starts with random content: the cached context of chunks and decodes, and
    # garbage in unused slots that must never be read.
    cache = rand(2, num_blocks, block_size, num_kv_heads, head_dim)
    scale = head_dim ** -0.5

    ref_cache = cache.float()
    ref_out = paged_attention(q.float(), k.float(), v.float(), ref_cache,
                              _reference_metadata(seqs, tables, block_size), scale)

    meta = TritonAttentionMetadata.build([q_len for q_len, _ in seqs],
                                         [s_len for _, s_len in seqs], tables, block_size,
                                         device=DEVICE)
    tri_cache = cache.to(DEVICE)
    out = triton_paged_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), tri_cache, meta,
                                 scale)
    return out.cpu(), tri_cache.cpu(), ref_out, ref_cache


def _check(seqs, num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, **kw):
    out, cache, ref_out, ref_cache = _run_both(seqs, num_heads, num_kv_heads, head_dim, dtype,
                                               **kw)
    # The KV write is a copy: exact in every dtype.
    assert torch.equal(cache, ref_cache.to(dtype))
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)


def test_host_tensors_reach_the_device_whole() -> None:
    """On a GPU through pinned memory without blocking; the values are read after the
    stream has run the copies."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [to_device(torch.arange(i, i + 1000), device) for i in range(20)]
    flags = tensor_on([True, False], torch.bool, device)
    assert all(r.device.type == device.type for r in rows) and flags.dtype == torch.bool
    assert [r.sum().item() for r in rows] == [sum(range(i, i + 1000)) for i in range(20)]
    assert flags.tolist() == [True, False]


def test_packed_tensors_come_back_whole_and_aligned() -> None:
    """A step's host tensors travel in one buffer (``to_device_all``): each comes back with
    its dtype, shape and values, non-contiguous and empty ones too, from an aligned offset."""
    tensors = [torch.arange(5), torch.tensor([7, -1, 3], dtype=torch.int32),
               torch.tensor([True, False]), torch.randn(2, 3), torch.empty(0, dtype=torch.long),
               torch.arange(6).view(2, 3).t(), torch.tensor([[1, 2, 3]])[0]]
    buffer, layout = pack(tensors)
    copy = buffer.clone()  # (as the device's copy of the buffer)
    for want, got, (start, _, _) in zip(tensors, unpack(copy, layout), layout, strict=True):
        assert start % PACK_ALIGN == 0
        assert not got.numel() or got.data_ptr() == copy.data_ptr() + start  # a view
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sent = to_device_all(tensors, device)
    assert all(t.device.type == device.type for t in sent)
    assert all(torch.equal(t.cpu(), want) for t, want in zip(sent, tensors, strict=True))


@pytest.mark.parametrize("data, dtype", [
    ([3, 0, -7, 2**40], torch.long), ([5, 1, 9], torch.int32), ([], torch.long),
    ([True, False, True], torch.long), ([[1, 2], [3, 4]], torch.long),
    ([0.5, 2.0], torch.float32), ([True, False], torch.bool),
], ids=["longs", "int32", "empty", "bools-as-longs", "nested", "floats", "bools"])
def test_host_tensor_is_torch_tensor(data, dtype) -> None:
    """Flat integer lists go through numpy (faster), anything else through torch: the same
    values, dtype and shape either way."""
    got, want = host_tensor(data, dtype), torch.tensor(data, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_metadata_of_a_mixed_batch_finds_each_sequence() -> None:
    """Decodes among prefill chunks (one with cached tokens before it, one whole prompt): each
    decode's row, length and table, each chunk's rows, and every token's slot."""
    block_size = 4
    tables = [[7, 2], [4, 5, 6], [9], [1, 3]]
    #            decode  chunk (3 of 10)  decode  whole prompt of 5
    query_lens, context_lens = [1, 3, 1, 5], [6, 10, 2, 5]
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size)
    assert meta.decode_rows.tolist() == [0, 4]
    assert meta.decode_lens.tolist() == [6, 2]
    assert meta.decode_block_tables.tolist() == [[7, 2], [9, 0]]
    assert [(p.query_start, p.query_len, p.context_len) for p in meta.prefills] == [
        (1, 3, 10), (5, 5, 5)]
    chunk, whole = meta.prefills
    assert chunk.context_slots.tolist() == [16, 17, 18, 19, 20, 21, 22, 23, 24, 25]
    assert chunk.mask.shape == (3, 10) and chunk.mask[0].tolist() == [True] * 8 + [False] * 2
    assert whole.context_slots is None and whole.mask is None
    assert meta.slot_mapping.tolist() == [
        2 * 4 + 1,  # position 5: block 2, offset 1
        5 * 4 + 3, 6 * 4 + 0, 6 * 4 + 1,  # positions 7, 8, 9 of the chunk's sequence
        9 * 4 + 1,
        1 * 4 + 0, 1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 3 * 4 + 0]
    with pytest.raises(ValueError):
        build_attention_metadata([1, 1], [3], tables[:2], block_size)


def test_padded_block_tables_are_the_tables_then_zeros() -> None:
    tables = [[7, 3, 9], [], [4], [5, 6]]
    out = padded_block_tables(tables, 6, 4, torch.int32)
    assert out.dtype == torch.int32
    assert out.tolist() == [[7, 3, 9, 0], [0, 0, 0, 0], [4, 0, 0, 0], [5, 6, 0, 0],
                            [0, 0, 0, 0], [0, 0, 0, 0]]
    assert padded_block_tables([], 2, 1, torch.long).tolist() == [[0], [0]]


@pytest.mark.parametrize("seqs", [DECODES, PREFILLS, CHUNKS, MIXED],
                         ids=["decode", "prefill", "chunked-prefill", "mixed"])
def test_batch_kinds(seqs):
    _check(seqs)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_head_sizes(head_dim):
    _check(MIXED[:4], head_dim=head_dim)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [80, 128])
def test_dtypes(dtype, head_dim):
    _check(MIXED, head_dim=head_dim, dtype=dtype, seed=1)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (8, 1), (4, 4)],
                         ids=["mha", "gqa-3", "mqa-8", "mha-4"])
def test_gqa(num_heads, num_kv_heads):
    _check(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64)


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_block_sizes(block_size):
    # Tiles are independent of the block size: one block per token, a non-power-of-two size,
    # and blocks longer than a decode tile.
    _check(MIXED, block_size=block_size)


def test_long_chunk_spans_several_tiles():
    # 70 query tokens and 100 context positions: several query tiles and several KV tiles, with
    # the causal bound cutting through the middle of a KV tile.
    _check([(70, 100), (1, 90)], num_heads=2, num_kv_heads=1, head_dim=64, dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_write_kv_cache_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, heads, head_dim = 6, 5, 3, 80
    cache = torch.randn(2, num_blocks, block_size, heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:11]
    # Strided in the token and head dimensions, as a slice of a fused projection would be.
    key = torch.randn(11, heads, 2 * head_dim, generator=gen).to(dtype)[..., :head_dim]
    value = torch.randn(11, heads, head_dim, generator=gen).to(dtype)
    assert not key.is_contiguous()
    ref = cache.clone()
    write_kv_cache(key, value, ref, slots)
    out = cache.to(DEVICE)
    triton_write_kv_cache(key.to(DEVICE), value.to(DEVICE), out, slots.to(DEVICE))
    assert torch.equal(out.cpu(), ref)


def test_padding_slots_write_nothing():
    cache = torch.zeros(2, 4, 4, 2, 64, device=DEVICE)
    key = torch.ones(3, 2, 64, device=DEVICE)
    triton_write_kv_cache(key, key, cache, torch.tensor([5, -1, 9], device=DEVICE))
    written = cache[0].reshape(16, 2, 64).abs().sum(dim=(1, 2)).nonzero().flatten().tolist()
    assert written == [5, 9]
    assert torch.equal(cache[0], cache[1])


def test_build_metadata_layout():
    meta = TritonAttentionMetadata.build([1, 3], [6, 3], [[7, 2], [4]], block_size=4,
                                         num_seqs_padded=4, max_blocks=3)
    assert meta.query_start_loc.tolist() == [0, 1, 4, 4, 4]
    assert meta.seq_lens.tolist() == [6, 3, 0, 0]
    assert meta.block_tables.tolist() == [[7, 2, 0], [4, 0, 0], [0, 0, 0], [0, 0, 0]]
    # Position 5 of sequence 0 is in its second block (2), offset 1; sequence 1 fills block 4.
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 16, 17, 18, -1, -1]
    assert meta.max_query_len == 3
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == torch.int32


@pytest.mark.parametrize("bad", [
    dict(query_lens=[0], seq_lens=[3], block_tables=[[0]]),
    dict(query_lens=[4], seq_lens=[3], block_tables=[[0]]),
    dict(query_lens=[1], seq_lens=[9], block_tables=[[0, 1]]),
    dict(query_lens=[1], seq_lens=[3], block_tables=[[0]], num_seqs_padded=0),
    dict(query_lens=[1], seq_lens=[6], block_tables=[[0, 1]], max_blocks=1),
], ids=["empty-query", "query-longer-than-seq", "blocks-too-few", "padding-below",
        "needs-more-than-max-blocks"])
def test_build_metadata_rejects_bad_layouts(bad):
    with pytest.raises(ValueError):
        TritonAttentionMetadata.build(block_size=4, **bad)


def test_padded_decode_batch_matches_unpadded(monkeypatch):
    """A decode batch padded as for a CUDA graph: real rows unchanged, cache untouched by pads,
    and the padding rows' output zeros, not memory nobody wrote (made NaN here)."""
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like",
                        lambda t, **kw: empty_like(t, **kw).fill_(float("nan")))
    gen = torch.Generator().manual_seed(5)
    seqs = [(1, 9), (1, 4), (1, 20)]
    tables = _block_tables(seqs, 4, 16, gen)
    q = torch.randn(5, 4, 64, generator=gen).to(DEVICE)  # 3 real rows + 2 padding rows
    kv = torch.randn(5, 2, 64, generator=gen).to(DEVICE)
    cache = torch.randn(2, 16, 4, 2, 64, generator=gen).to(DEVICE)
    args = ([1, 1, 1], [9, 4, 20], tables, 4)
    plain_cache = cache.clone()
    plain = triton_paged_attention(q[:3], kv[:3], kv[:3], plain_cache,
                                   TritonAttentionMetadata.build(*args, device=DEVICE), 0.125)
    padded = triton_paged_attention(q, kv, kv, cache, TritonAttentionMetadata.build(
        *args, device=DEVICE, num_seqs_padded=5, max_blocks=8), 0.125)
    assert torch.equal(cache, plain_cache)
    torch.testing.assert_close(padded[:3], plain, atol=0, rtol=0)
    assert torch.equal(padded[3:], torch.zeros_like(padded[3:]))


# The fused elementwise kernels (kernels/triton_fused.py) against the torch ops they replace,
# which round after every op. They differ by the order of the norm's sum and, on a GPU, by the
# approximate exponential and reciprocal square root Triton compiles, which can move a rounded
# half-precision result by an ulp at each of two roundings (an ulp is up to 2**-10 relative in
# float16, 2**-7 in bfloat16); the interpreter truncates float32 -> bfloat16 instead of rounding.
FUSED_TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3,
                   torch.bfloat16: 1.6e-2 if DEVICE == "cuda" else 5e-2}


def _fused_inputs(dtype: torch.dtype, *shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _assert_fused_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = FUSED_TOLERANCE[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", list(FUSED_TOLERANCE), ids=str)
def test_fused_norms_and_activations_match_torchs_ops(dtype: torch.dtype) -> None:
    """RMSNorm with and without the residual add (which happens in place), SiLU-and-mul of a
    merged projection's strided halves, quick GELU over more than one program's elements; a
    hidden size that is no power of two and single-row and many-row programs."""
    for rows, hidden in ((7, 96), (3, 1200)):
        x, residual = _fused_inputs(dtype, rows, hidden), _fused_inputs(dtype, rows, hidden, seed=1)
        weight = _fused_inputs(dtype, hidden, seed=2)
        _assert_fused_close(triton_fused.rms_norm(x, weight, 1e-5),
                            elementwise.rms_norm(x, weight, 1e-5))
        fused_sum = residual.clone()
        out = triton_fused.add_rms_norm(x, fused_sum, weight, 1e-5)
        _assert_fused_close(fused_sum, residual + x)
        _assert_fused_close(out, elementwise.rms_norm(residual + x, weight, 1e-5))

    merged = _fused_inputs(dtype, 6, 2 * 50)
    gate, up = merged.split(50, dim=-1)
    _assert_fused_close(triton_fused.silu_and_mul(gate, up), elementwise.silu_and_mul(gate, up))
    x = _fused_inputs(dtype, 3, 5, 77)
    _assert_fused_close(triton_fused.quick_gelu(x), elementwise.quick_gelu(x))


@pytest.mark.parametrize("dtype", list(FUSED_TOLERANCE), ids=str)
def test_fused_rotary_gives_torchs_bits(dtype: torch.dtype) -> None:
    """q as the view of a merged q/k/v projection (strided rows), a head count that is no power
    of two: each product rounded before the sum, no fused multiply-add, so torch's bits (the
    interpreter's bfloat16 truncation aside)."""
    tokens, heads, dim = 5, 3, 16
    merged = _fused_inputs(dtype, tokens, 3 * heads * dim)
    q = merged[:, :heads * dim].view(tokens, heads, dim)
    cos, sin = _fused_inputs(dtype, tokens, 1, dim, seed=1), _fused_inputs(dtype, tokens, 1, dim,
                                                                          seed=2)
    out = triton_fused.rotary(q, cos, sin)
    ref = elementwise.rotary(q, cos, sin)
    assert out.is_contiguous()
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        _assert_fused_close(out, ref)
    else:
        assert torch.equal(out, ref)


def test_fused_kernels_refuse_what_they_cannot_compute() -> None:
    x = _fused_inputs(torch.float32, 4, 8)
    with pytest.raises(ValueError, match="contiguous rows"):
        triton_fused.rms_norm(x.t(), torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        triton_fused.rms_norm(x, torch.ones(8, dtype=torch.float16, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="even, contiguous"):
        triton_fused.rotary(x.view(4, 1, 8)[..., :7], x, x)
    with pytest.raises(ValueError, match="cos table"):
        triton_fused.rotary(x.view(4, 1, 8), x[:2], x)


def test_fused_kernels_by_device_and_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA tensors take the Triton kernels (here the CPU stands in for a GPU), except under
    MMSERVE_GPU_KERNELS=torch; integer tensors and the meta device take torch's ops."""
    monkeypatch.setattr(fused, "_TRITON_DEVICES", {"cuda", DEVICE})
    monkeypatch.setattr(fused, "_triton_module", functools.cache(fused._triton_module.__wrapped__))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert fused.fused_kernels(torch.zeros(2, dtype=dtype, device=DEVICE)) is triton_fused
    assert fused.fused_kernels(torch.zeros(2, dtype=torch.int64, device=DEVICE)) is None
    assert fused.fused_kernels(torch.zeros(2, device="meta")) is None
    monkeypatch.setattr(fused, "_triton_module", functools.cache(fused._triton_module.__wrapped__))
    monkeypatch.setenv("MMSERVE_GPU_KERNELS", "torch")
    assert fused.fused_kernels(torch.zeros(2, device=DEVICE)) is None
    monkeypatch.setenv("MMSERVE_GPU_KERNELS", "cutlass")
    with pytest.raises(ValueError, match="MMSERVE_GPU_KERNELS='cutlass'"):
        fused.gpu_path()


def test_fused_kernels_that_fail_their_check_leave_torchs_ops(monkeypatch, caplog) -> None:
    """The check runs every kernel once per device and dtype (here in the interpreter, and it
    passes); a kernel that cannot compile or computes something else leaves that dtype to
    torch's ops, with a warning, instead of failing the engine's start."""
    monkeypatch.setattr(fused, "_TRITON_DEVICES", {"cuda", DEVICE})
    monkeypatch.setattr(fused, "_triton_module", functools.cache(fused._triton_module.__wrapped__))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        triton_fused.check(torch.device(DEVICE), dtype)

    def broken(x):
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(triton_fused, "quick_gelu", broken)
    with caplog.at_level("WARNING", logger="mmserve.kernels.fused"):
        assert fused.fused_kernels(torch.zeros(2, device=DEVICE)) is None
    assert "failed their check" in caplog.text and "PTX assembly failed" in caplog.text
    monkeypatch.setattr(triton_fused, "quick_gelu", lambda x: x)  # computes something else
    with pytest.raises(RuntimeError, match="quick_gelu differs"):
        triton_fused.check(torch.device(DEVICE), torch.float32)
