"""The compiled CPU kernels against the torch paths they replace, and their use by the CPU
runner: decode attention (``kernels/cpu_decode_attention.cpp``; bfloat16 with head sizes 64 and
128 takes its AVX512-BF16 path), the bfloat16 flash attention for prompt chunks and vision
towers (``cpu_flash_attention.cpp``), the fused norm, rotary and activations
(``cpu_elementwise.cpp``), the packed bfloat16 linear layers (``cpu_linear.cpp``), and for
float32 on CPUs with AVX2 and FMA the linear layers (``cpu_linear_f32.cpp``; ``OneDNNLinear`` on
other CPUs) and the flash attention (``cpu_attention_f32.cpp``).

Every test that takes the ``kernel`` fixture (``conftest.py``) runs once for each compiled path
this CPU supports (``cpu_ops.PATHS``): an AVX-512 machine tests the AVX2 build too. Skipped
only where there is no C++ compiler (the runner then uses torch's operators); where there is
one, a build failure fails these tests. The bfloat16 flash attention and packed linear tests
also need a path with AVX512-BF16 (elsewhere the module reports them unsupported and torch
runs).
"""

import contextlib
import functools
import itertools
import shutil
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from mmserve.kernels import cpu_ops
from mmserve.kernels.paged_attention import (
    PrefillSeq,
    build_attention_metadata,
    decode_attention,
    paged_attention,
)
from mmserve.kernels.paged_attention import prefill_attention as torch_prefill_attention
from mmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(shutil.which("c++") is None,
                                reason="no C++ compiler: the CPU runner uses the torch path")


@contextlib.contextmanager
def _torch_threads(n: int):
    """torch's thread count set to ``n`` for the block (which path the packed linear takes,
    and how many cores a kernel keeps busy, depend on it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (12, 4, 64), (16, 4, 64), (20, 4, 64), (14, 2, 64),  # groups of 3, 4, 5 and 7 (6 + 1)
    (8, 8, 80), (16, 2, 128), (4, 1, 96)])
def test_kernel_matches_torch_decode(kernel, dtype, atol, num_heads, num_kv_heads, head_dim):
    # Lengths on and off block boundaries, a single token, a long one.
    lens = [1, 15, 16, 17, 33, 100, 352]
    query, cache, meta = _decode_batch(lens, num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    expected = decode_attention(query.float(), cache.float(), meta, scale)
    got = cpu_ops.decode_attention(query, cache, meta, scale)
    assert got.dtype == dtype and got.shape == query.shape
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_fetching_ahead_over_uneven_and_empty_sequences(kernel, dtype, atol, threads):
    """Each thread fetches the next sequence's rows while it computes one: sequences of very
    different lengths (a short one before a long one) and an empty one mid-batch (whose
    share of the fetching once divided by zero) give each sequence its own result, zeros
    for the empty one."""
    lens = [5, 0, 1200, 1, 3, 900, 17, 1]
    query, cache, meta = _decode_batch([max(n, 1) for n in lens], 12, 4, 64, dtype)
    expected = decode_attention(query.float(), cache.float(), meta, 0.125)
    expected[1] = 0
    with _torch_threads(threads):
        got = kernel.decode_attention(query, cache[0], cache[1], meta.decode_block_tables,
                                      torch.tensor(lens), 0.125)
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize("lens", [[700], [33, 300, 1], [5, 64]])
def test_decode_attention_does_not_depend_on_how_heads_are_split(kernel, lens):
    """With fewer sequences than two per thread, a float32 sequence's KV heads are split
    between work items (read head by head); with more, one item takes them all (read token by
    token). Both compute every output in the same order: the same bits on 1 thread as on 3 or
    4, and as torch's reference within float32 rounding."""
    query, cache, meta = _decode_batch(lens, 12, 4, 64, torch.float32)
    expected = decode_attention(query, cache, meta, 0.125)
    results = []
    for threads in (1, 3, 4):
        with _torch_threads(threads):
            results.append(cpu_ops.decode_attention(query, cache, meta, 0.125))
    torch.testing.assert_close(results[0], expected, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(results[0], other) for other in results[1:])


def test_long_kernels_let_other_python_threads_run(kernel):
    """Decode attention and the packed linear layers give up the interpreter lock while they
    compute (as torch's operators do): a Python thread beside them keeps running, where it
    would otherwise wait for the whole call."""
    query, cache, meta = _decode_batch([2048] * 32, 8, 4, 64, torch.float32)
    calls = {"decode attention": lambda: cpu_ops.decode_attention(query, cache, meta, 0.125)}
    x = torch.randn(1024, 1024)
    if kernel.packed_linear_supported():
        bf16 = cpu_ops.PackedLinear(_bf16_linear(1024, 4096, False, seed=0))
        calls["bfloat16 linear"] = lambda: bf16(x.bfloat16())
    if kernel.packed_linear_f32_supported():
        f32 = cpu_ops.PackedLinearF32(_f32_linear(1024, 4096, False, seed=0))
        calls["float32 linear"] = lambda: f32(x)

    def longest_wait(call) -> tuple[float, float]:
        """The ticking thread's longest wait while ``call`` ran on another, and the call's
        time."""
        span: list[float] = []

        def run() -> None:
            span.append(time.perf_counter())
            call()
            span.append(time.perf_counter())

        ticks = [time.perf_counter()]
        worker = threading.Thread(target=run)
        worker.start()
        while worker.is_alive():
            ticks.append(time.perf_counter())
        worker.join()
        start, end = span
        inside = [start] + [t for t in ticks if start < t < end] + [end]
        return max(b - a for a, b in itertools.pairwise(inside)), end - start

    with _torch_threads(1):  # the kernel on one core, the ticking thread free to run
        for name, call in calls.items():
            call()  # warm up (first touch)
            # A call that kept the lock would make the other thread wait nearly all of it,
            # every time; on a busy machine the OS may also stall it once, so the best of
            # three tries counts.
            waited, took = min((longest_wait(call) for _ in range(3)),
                               key=lambda found: found[0] / found[1])
            assert waited < 0.25 * took, (
                f"{name}: the other thread waited {waited * 1e3:.1f} ms of the call's "
                f"{took * 1e3:.1f} ms")


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

    runner = LLM(clip_llama, device="cpu", max_model_len=256).engine.runner
    assert isinstance(runner.attention, functools.partial)
    assert runner.attention.keywords["decode"] is cpu_ops.decode_attention


@pytest.fixture(scope="module")
def flash(kernel):
    if not kernel.flash_attention_supported(64):
        pytest.skip("no AVX512-BF16 on this path: bfloat16 prompt and vision attention stay "
                    "on torch")
    return kernel


@pytest.fixture(params=["vector", "amx"])
def flash_path(flash, request):
    """The flash attention on its AVX512-BF16 vector code, or on AMX tiles where the CPU and
    kernel allow them."""
    amx = request.param == "amx"
    if amx and not flash.flash_attention_amx_supported():
        pytest.skip("no AMX tiles on this CPU (or the kernel refuses them to the process)")
    previous = flash.set_flash_attention_amx(amx)
    yield flash
    flash.set_flash_attention_amx(previous)


def _reference(q, k, v, scale, causal_offset):
    """float32 attention of bfloat16 inputs, [batch, len, heads, dim] layout."""
    q_len, kv_len = q.shape[1], k.shape[1]
    mask = None
    if causal_offset >= 0:
        mask = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + causal_offset
    out = F.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2),
        attn_mask=mask, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


@contextlib.contextmanager
def _vector_multiply(kernel, fma: bool, set_amx):
    """A bfloat16 kernel's vector code (its AMX tiles off through ``set_amx``, the kernel's
    setter) multiplying with float32 FMAs or with the pair dot product; the previous settings
    back afterwards."""
    amx = set_amx(False)
    previous = kernel.set_bf16_fma(fma)
    try:
        yield
    finally:
        kernel.set_bf16_fma(previous)
        set_amx(amx)


def _packed_multiply(kernel, fma: bool):
    """The packed linear's vector tiles multiplying with float32 FMAs or the pair dot product."""
    return _vector_multiply(kernel, fma, kernel.set_packed_linear_amx)


# batch, q_len, kv_len, heads, kv_heads, head_dim, causal_offset
_FLASH_SHAPES = [
    (1, 238, 238, 12, 4, 64, 0),  # a whole prompt, GQA
    (1, 5, 300, 12, 4, 64, 295),  # a chunk after a cached prefix
    (1, 100, 1000, 8, 2, 128, 900),  # head size 128, keys past one softmax step
    (1, 1, 1, 4, 4, 64, 0),  # one token
    (1, 17, 17, 4, 1, 128, 0),  # rows not a multiple of the 8-row tile, one KV head
    (3, 197, 197, 12, 12, 64, -1),  # vision: a batch of images, bidirectional
    (2, 128, 128, 2, 2, 64, -1),  # exact multiples of the tile and the key step
    (1, 128, 256, 4, 2, 64, 128),  # a chunk of one key step after a cached one
    (1, 33, 49, 4, 2, 64, 16),  # one row past two 16-row AMX tiles, keys past three groups
    (2, 16, 16, 2, 1, 128, 0),  # one AMX tile, one key group
]


@pytest.mark.parametrize("batch,q_len,kv_len,heads,kv_heads,head_dim,causal_offset",
                         _FLASH_SHAPES)
def test_flash_matches_reference(flash_path, batch, q_len, kv_len, heads, kv_heads, head_dim,
                                 causal_offset):
    """Both paths where the CPU has AMX: the tiles (16 query rows, whole tiles of 32 keys
    for the probabilities) and the vector code (8 rows)."""
    flash = flash_path
    g = torch.Generator().manual_seed(q_len * 7 + kv_len)
    q = torch.randn(batch, q_len, heads, head_dim, generator=g).bfloat16()
    k, v = (torch.randn(batch, kv_len, kv_heads, head_dim, generator=g).bfloat16()
            for _ in range(2))
    scale = head_dim ** -0.5
    got = flash.flash_attention(q, k, v, scale, causal_offset)
    expected = _reference(q, k, v, scale, causal_offset)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape and got.is_contiguous()
    # bfloat16 output and probabilities: torch's own bfloat16 attention is ~1e-2 from float32.
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("batch,q_len,kv_len,heads,kv_heads,head_dim,causal_offset",
                         _FLASH_SHAPES)
def test_flash_fma_and_pair_dot_product_agree_bit_for_bit(flash, batch, q_len, kv_len, heads,
                                                         kv_heads, head_dim, causal_offset):
    """The vector code's two multiplies (AVX512-BF16's pair dot product, float32 FMAs on
    widened inputs, each chosen where the core runs it faster) add the same products in the
    same order, for the scores and for the probabilities times the values: the same bits."""
    g = torch.Generator().manual_seed(q_len * 5 + kv_len)
    q = torch.randn(batch, q_len, heads, head_dim, generator=g).bfloat16()
    k, v = (torch.randn(batch, kv_len, kv_heads, head_dim, generator=g).bfloat16()
            for _ in range(2))
    results = []
    for fma in (False, True):
        with _vector_multiply(flash, fma, flash.set_flash_attention_amx):
            results.append(flash.flash_attention(q, k, v, head_dim ** -0.5, causal_offset))
    assert torch.equal(results[0].view(torch.int16), results[1].view(torch.int16))


def test_flash_amx_tiles_match_the_vector_code(flash):
    """On AMX tiles the sums are float32 as in the vector code, in another order: the outputs
    are the same to within a bfloat16 rounding (of the output, or of a probability near a
    rounding boundary), nearly all of them bit for bit."""
    if not flash.flash_attention_amx_supported():
        pytest.skip("no AMX tiles on this CPU (or the kernel refuses them to the process)")
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 150, 8, 64, generator=g).bfloat16()
    k, v = (torch.randn(2, 300, 2, 64, generator=g).bfloat16() for _ in range(2))
    try:
        assert flash.set_flash_attention_amx(True) is True  # on by default
        tiles = flash.flash_attention(q, k, v, 0.125, 150)
        assert flash.set_flash_attention_amx(False) is True
        vectors = flash.flash_attention(q, k, v, 0.125, 150)
    finally:
        flash.set_flash_attention_amx(True)
    torch.testing.assert_close(tiles.float(), vectors.float(), atol=2e-3, rtol=2 ** -7)
    assert (tiles == vectors).float().mean() > 0.99


def test_flash_reads_strided_views(flash):
    """The vision tower passes q, k, v as views of one projection: no copies needed."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 50, 3, 12, 64, generator=g).bfloat16()
    q, k, v = qkv.unbind(2)
    got = flash.flash_attention(q, k, v, 0.125, -1)
    torch.testing.assert_close(got.float(), _reference(q, k, v, 0.125, -1), atol=2e-2,
                               rtol=2e-2)


def test_flash_rejects_unsupported_inputs(flash):
    q = torch.randn(1, 4, 4, 64)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        flash.flash_attention(q, q, q, 0.125, 0)
    q = q.bfloat16()
    with pytest.raises(RuntimeError, match="head size of 64 or 128"):
        flash.flash_attention(q[..., :32], q[..., :32], q[..., :32], 0.125, 0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        flash.flash_attention(q[:, :, :3], q, q, 0.125, 0)
    assert not flash.flash_attention_supported(80)


def test_flash_prompt_chunks_in_a_mixed_batch(flash):
    """Through the CPU backend: a whole prompt, a chunk after cached blocks and decodes in one
    step agree with the torch reference on the same bfloat16 inputs."""
    g = torch.Generator().manual_seed(5)
    q_lens, ctx_lens, tables = [40, 1, 24, 1], [40, 20, 56, 33], [[0, 1, 2], [3, 4], [5, 6, 7, 8],
                                                                 [9, 10, 11]]
    n = sum(q_lens)
    q, k, v = (torch.randn(n, h, 64, generator=g).bfloat16() for h in (12, 4, 4))
    meta = build_attention_metadata(q_lens, ctx_lens, tables, 16)
    cache = torch.randn(2, 12, 16, 4, 64, generator=g).bfloat16()
    expected = paged_attention(q.float(), k.float(), v.float(), cache.float(), meta, 0.125)
    calls = []

    def spy(*args):
        calls.append(args[0].shape[0])
        return cpu_ops.prefill_attention(*args)

    got = paged_attention(q, k, v, cache.clone(), meta, 0.125, decode=cpu_ops.decode_attention,
                          prefill=spy)
    assert calls == [40, 24]
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def _set_amx(monkeypatch, amx: bool) -> None:
    """This CPU's flags with AMX or without it, for the choices made by the flags (torch's AMX
    paths or the kernels)."""
    flags = cpu_ops.cpu_flags() - {"amx_bf16"} | ({"amx_bf16"} if amx else set())
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: flags)


@pytest.mark.parametrize("amx, kernel_tiles", [(False, False), (True, False), (True, True)])
def test_long_bfloat16_prompt_chunks_take_torchs_attention_on_amx(flash, monkeypatch, amx,
                                                                   kernel_tiles):
    """On an AMX CPU whose kernel lacks the tile path, a chunk attending to
    ``AMX_KERNEL_CONTEXT`` positions or more (its prefix and itself) goes to torch's fused
    attention, shorter ones keep the kernel; without AMX, or with the kernel's tiles, the
    kernel serves them all. Either way the results are torch's within bfloat16's rounding."""
    _set_amx(monkeypatch, amx)
    calls = _spy_on(monkeypatch, flash, "flash_attention", lambda args: args[1].shape[1],
                    amx_tiles=kernel_tiles)
    g = torch.Generator().manual_seed(9)
    long = cpu_ops.AMX_KERNEL_CONTEXT
    for q_len, ctx in ((40, 40), (24, long - 1), (24, long), (long + 8, long + 8)):
        q = torch.randn(q_len, 12, 64, generator=g).bfloat16()
        k, v = (torch.randn(ctx, 4, 64, generator=g).bfloat16() for _ in range(2))
        seq = PrefillSeq(0, q_len, ctx, None if q_len == ctx else torch.arange(ctx),
                         None if q_len == ctx else
                         torch.ones(q_len, ctx, dtype=torch.bool).tril(ctx - q_len))
        expected = torch_prefill_attention(q.float(), k.float(), v.float(), seq, 0.125)
        got = cpu_ops.prefill_attention(q, k, v, seq, 0.125)
        torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
    torch_takes_long = amx and not kernel_tiles
    assert calls == ([40, long - 1] if torch_takes_long else [40, long - 1, long, long + 8])


def _spy_on(monkeypatch, kernel, name, record, amx_tiles=None):
    """Stand in for the loaded module with one whose function ``name`` first notes
    ``record(args)`` of each call, then runs the kernel's; the list of notes. ``amx_tiles``:
    what its ``flash_attention_amx_supported()`` says (None: the kernel's answer)."""
    calls = []
    real = getattr(kernel, name)

    class Spy:
        def __getattr__(self, attr):
            return getattr(kernel, attr)

    def spy(*args):
        calls.append(record(args))
        return real(*args)

    module = Spy()
    setattr(module, name, spy)
    if amx_tiles is not None:
        module.flash_attention_amx_supported = lambda: amx_tiles
    monkeypatch.setattr(cpu_ops, "_module", module)
    return calls


@pytest.mark.parametrize("amx, kernel_tiles", [(False, False), (True, False), (True, True)])
def test_encoder_attention_uses_the_kernel_for_bfloat16(flash, monkeypatch, amx, kernel_tiles):
    """... unless the CPU has AMX and the kernel lacks the tile path: torch's fused attention
    uses the tiles (faster there than the vector code)."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 30, 4, 64, generator=g) for _ in range(3))
    _set_amx(monkeypatch, amx)
    calls = _spy_on(monkeypatch, flash, "flash_attention", lambda args: args[0].dtype,
                    amx_tiles=kernel_tiles)
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), scale=0.125).transpose(1, 2)
    got = cpu_ops.encoder_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.125)
    assert calls == ([] if amx and not kernel_tiles else [torch.bfloat16])
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def flash_f32(kernel):
    if not kernel.flash_attention_f32_supported(64):
        pytest.skip("this CPU lacks AVX2 or FMA: float32 prompt and vision attention stay on "
                    "torch")
    return kernel


@pytest.mark.parametrize("batch,q_len,kv_len,heads,kv_heads,head_dim,causal_offset", [
    (1, 238, 238, 12, 4, 64, 0),  # a whole prompt, GQA
    (1, 5, 300, 12, 4, 64, 295),  # a chunk after a cached prefix
    (1, 100, 1000, 8, 2, 128, 900),  # head size 128, keys past one softmax step
    (1, 1, 1, 4, 4, 64, 0),  # one token
    (1, 17, 17, 4, 1, 80, 0),  # rows not a multiple of the 6-row tile, head size 80
    (3, 197, 197, 12, 12, 64, -1),  # vision: a batch of images, bidirectional
    (2, 64, 64, 2, 2, 64, -1),  # exact multiples of the key step
    (1, 70, 70, 2, 2, 16, -1),  # the smallest head size
])
def test_flash_f32_matches_torch(flash_f32, batch, q_len, kv_len, heads, kv_heads, head_dim,
                                 causal_offset):
    g = torch.Generator().manual_seed(q_len * 7 + kv_len)
    q = torch.randn(batch, q_len, heads, head_dim, generator=g)
    k, v = (torch.randn(batch, kv_len, kv_heads, head_dim, generator=g) for _ in range(2))
    scale = head_dim ** -0.5
    got = flash_f32.flash_attention_f32(q, k, v, scale, causal_offset)
    expected = _reference(q.double(), k.double(), v.double(), scale, causal_offset).double()
    assert got.dtype == torch.float32 and got.shape == q.shape and got.is_contiguous()
    # float32 throughout; only the order of the sums and exp (within 2 ulp) differ from an
    # exact softmax: a few float32 ulps of the output's scale, as torch's own attention.
    torch_out = _reference(q, k, v, scale, causal_offset)
    torch_err = (torch_out.double() - expected).abs().max()
    assert (got.double() - expected).abs().max() <= max(4 * torch_err, 2e-6)


def test_flash_f32_reads_strided_views_and_rejects_unsupported_inputs(flash_f32):
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 50, 3, 12, 64, generator=g)
    q, k, v = qkv.unbind(2)  # views of one projection, as the vision tower passes them
    got = flash_f32.flash_attention_f32(q, k, v, 0.125, -1)
    torch.testing.assert_close(got, _reference(q, k, v, 0.125, -1), atol=2e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="float32 only"):
        flash_f32.flash_attention_f32(q.double(), k.double(), v.double(), 0.125, -1)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        flash_f32.flash_attention_f32(q[..., :24], k[..., :24], v[..., :24], 0.125, -1)
    assert not flash_f32.flash_attention_f32_supported(272)


def test_float32_prompt_attention_takes_the_kernel(flash_f32, monkeypatch):
    """Through the CPU backend: a whole prompt, a chunk after cached blocks and decodes in one
    step take the kernel in float32; a vision tower's attention keeps torch's, exactly."""
    g = torch.Generator().manual_seed(5)
    q_lens, ctx_lens, tables = [40, 1, 24, 1], [40, 20, 56, 33], [[0, 1, 2], [3, 4], [5, 6, 7, 8],
                                                                 [9, 10, 11]]
    n = sum(q_lens)
    q, k, v = (torch.randn(n, h, 64, generator=g) for h in (12, 4, 4))
    meta = build_attention_metadata(q_lens, ctx_lens, tables, 16)
    cache = torch.randn(2, 12, 16, 4, 64, generator=g)
    expected = paged_attention(q, k, v, cache.clone(), meta, 0.125)
    calls = _spy_on(monkeypatch, flash_f32, "flash_attention_f32", lambda args: args[0].shape[1])
    got = paged_attention(q, k, v, cache.clone(), meta, 0.125, decode=cpu_ops.decode_attention,
                          prefill=cpu_ops.prefill_attention)
    assert calls == [40, 24]
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)
    qi, ki, vi = (torch.randn(2, 30, 4, 64, generator=g) for _ in range(3))
    sdpa = F.scaled_dot_product_attention(qi.transpose(1, 2), ki.transpose(1, 2),
                                          vi.transpose(1, 2), scale=0.125).transpose(1, 2)
    assert torch.equal(cpu_ops.encoder_attention(qi, ki, vi, 0.125), sdpa)
    assert calls == [40, 24]


def test_packed_encoder_attention_with_rotated_query_and_key(flash, monkeypatch):
    """Qwen2-VL's vision attention rotates q and k (fresh tensors) and passes v as a view of the
    fused projection: strides that differ between key and value still take the kernel."""
    _set_amx(monkeypatch, False)
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(70, 3, 4, 64, generator=g).bfloat16()
    q, k, v = qkv.unbind(1)
    q, k = q * 1, k * 1
    assert k.stride() != v.stride()
    boundaries = [0, 16, 32, 48, 70]  # three equal windows and a longer one
    got = cpu_ops.packed_encoder_attention(q, k, v, boundaries, 0.125)
    for start, end in itertools.pairwise(boundaries):
        expected = _reference(q[None, start:end], k[None, start:end], v[None, start:end],
                              0.125, -1)
        torch.testing.assert_close(got[start:end].float(), expected[0], atol=2e-2, rtol=2e-2)
    q, k, v = (t[:64] for t in (q, k, v))  # equal segments tiling the sequence: one call
    got = cpu_ops.packed_encoder_attention(q, k, v, [0, 16, 32, 48, 64], 0.125)
    expected = _reference(q.view(4, 16, 4, 64), k.view(4, 16, 4, 64), v.reshape(4, 16, 4, 64),
                          0.125, -1)
    torch.testing.assert_close(got.float(), expected.reshape(64, 4, 64), atol=2e-2, rtol=2e-2)


def test_cpu_runner_uses_the_flash_kernel(flash, clip_llama):
    from mmserve import LLM

    runner = LLM(clip_llama, device="cpu", max_model_len=256).engine.runner
    assert runner.attention.keywords["prefill"] is cpu_ops.prefill_attention


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bfloat16 steps between two bfloat16 tensors of finite values."""
    def ordered(t):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


def _assert_rounds_like_torch(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Fused kernels round where torch's ops round; only their float32 math differs (an exp or
    a sum in another order), which moves a rare value by one bfloat16 step."""
    assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == expected.shape
    apart = _ulps_apart(got, expected)
    assert apart.max() <= 1
    assert (apart == 0).float().mean() > 0.99


def test_rms_norm_matches_torch(kernel, monkeypatch):
    from mmserve.models import layers

    g = torch.Generator().manual_seed(7)
    norm = layers.RMSNorm(768, 1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(768, generator=g) * 0.1 + 1)
    wide = (torch.randn(300, 1000, generator=g) * 3).bfloat16()
    x = wide[:, 100:868]  # rows with a stride, as a slice of a larger activation
    with torch.no_grad():
        monkeypatch.setattr(layers, "fused_kernels", lambda t: None)
        expected = norm(x)  # the module's torch path
        monkeypatch.setattr(layers, "fused_kernels", lambda t: kernel)
        got = norm(x)  # the module's fused path
    _assert_rounds_like_torch(got, expected)
    _assert_rounds_like_torch(kernel.rms_norm(x, norm.weight, 1e-5), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_and_norm_updates_the_residual_and_norms_the_sum(kernel, monkeypatch, dtype):
    """``RMSNorm.add_and_norm``: the residual stream gets ``x`` added in place, rounded as
    torch's add (bit for bit), and the norm is of that sum, as ``rms_norm`` computes it."""
    from mmserve.models import layers

    g = torch.Generator().manual_seed(8)
    norm = layers.RMSNorm(768, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(768, generator=g) * 0.1 + 1)
    wide = (torch.randn(70, 1000, generator=g) * 3).to(dtype)
    x = wide[:, 100:868]  # rows with a stride: an attention output's slice
    residual = (torch.randn(70, 768, generator=g) * 3).to(dtype)
    stream = residual + x  # torch's add, rounded to the dtype
    with torch.no_grad():
        monkeypatch.setattr(layers, "fused_kernels", lambda t: None)
        expected_residual = residual.clone()
        expected = norm.add_and_norm(x, expected_residual)  # the module's torch path
        calls = _spy_on(monkeypatch, kernel, "add_rms_norm", lambda args: args[0].shape)
        monkeypatch.setattr(layers, "fused_kernels", lambda t: cpu_ops._module)
        got = norm.add_and_norm(x, residual)
    assert calls == [(70, 768)]
    assert torch.equal(residual, stream) and torch.equal(expected_residual, stream)
    if dtype == torch.bfloat16:
        _assert_rounds_like_torch(got, expected)
    else:
        _assert_float32_close(got, expected)
    with pytest.raises(RuntimeError, match="residual must be contiguous and of x's shape"):
        kernel.add_rms_norm(x, residual[:10], norm.weight, 1e-5)


def test_silu_and_mul_matches_torch(kernel):
    g = torch.Generator().manual_seed(8)
    gate_up = (torch.randn(257, 2 * 2048, generator=g) * 4).bfloat16()
    gate, up = gate_up[:, :2048], gate_up[:, 2048:]  # strided halves of one projection
    expected = F.silu(gate) * up
    _assert_rounds_like_torch(kernel.silu_and_mul(gate, up), expected)


def test_quick_gelu_matches_torch(kernel):
    from mmserve.models.layers import get_activation

    g = torch.Generator().manual_seed(9)
    x = (torch.randn(3, 197, 3072, generator=g) * 4).bfloat16()
    expected = x * torch.sigmoid(1.702 * x)
    _assert_rounds_like_torch(kernel.quick_gelu(x), expected)
    # In place, for a layer's output that nothing else reads: the same bits, into x.
    y = x.clone()
    assert kernel.quick_gelu_(y).data_ptr() == y.data_ptr()
    assert torch.equal(y, kernel.quick_gelu(x))
    with pytest.raises(RuntimeError, match="quick_gelu_: expected a contiguous tensor"):
        kernel.quick_gelu_(x.transpose(0, 1))
    # Extremes saturate instead of overflowing.
    edge = torch.tensor([-1e4, -100.0, 0.0, 100.0, 1e4]).bfloat16()
    torch.testing.assert_close(kernel.quick_gelu(edge), edge * torch.sigmoid(1.702 * edge))
    # The module's activation takes the fused path for both dtypes once the kernels load.
    xf = x.float()
    torch.testing.assert_close(get_activation("quick_gelu")(xf), xf * torch.sigmoid(1.702 * xf),
                               atol=0, rtol=4e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_rows_is_torchs_argmax(kernel, dtype):
    """Greedy sampling's argmax: the first of tied maxima, the first NaN where a row has one,
    an all -inf row's first index; rows whose length is not a multiple of 16 lanes, rows
    further apart than their length (a view), no rows."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(19, 32000, generator=g).to(dtype)
    logits[1, 7] = logits[1, 31990] = logits[1].max() + 1  # a tie: the first wins
    logits[2, 5000] = float("nan")
    logits[2, 6000] = float("inf")
    logits[3] = float("-inf")
    logits[4, [17, 40]] = float("nan")
    logits[5, -1] = 100  # the last element, in a full 16-lane vector
    for view in (logits, logits[:, :31999], logits[:, 3:1003], logits[:0]):
        got = kernel.argmax_rows(view)
        assert got.dtype == torch.long and torch.equal(got, view.argmax(dim=-1))
    assert kernel.argmax_rows(logits[:, 3:1003])[4].item() == 14  # NaN at 17, after the start
    with pytest.raises(RuntimeError, match="argmax_rows: expected"):
        kernel.argmax_rows(logits[:, :0])


def test_greedy_sampling_takes_the_kernels_argmax(kernel, monkeypatch):
    from mmserve.worker import sampler

    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(12)).bfloat16()
    calls = _spy_on(monkeypatch, kernel, "argmax_rows", lambda args: args[0].shape)
    tokens = sampler.sample_each(logits, [SamplingParams(temperature=0)] * 5, None)
    assert calls == [(5, 1000)] and tokens == logits.float().argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_matches_torch_exactly(kernel, monkeypatch, dtype):
    """Each product rounded where torch rounds it, and no multiply-add fused: bit for bit
    equal (in float32 too, where a fused multiply-add would round once instead of twice)."""
    from mmserve.models import layers

    rope = layers.RotaryEmbedding(64, 512, 10000.0)
    positions = torch.tensor([0, 1, 2, 7, 100, 511, 3, *range(200, 300)])
    cos_sin = rope.cos_sin(positions, dtype)
    g = torch.Generator().manual_seed(10)
    qkv = (torch.randn(len(positions), 12 + 4 + 4, 64, generator=g) * 3).to(dtype)
    q, k = qkv[:, :12], qkv[:, 12:16]  # head slices of one projection, as the decoder has them
    monkeypatch.setattr(layers, "fused_kernels", lambda t: None)
    expected = layers.apply_rotary(q, k, cos_sin)
    calls = _spy_on(monkeypatch, kernel, "rotary", lambda args: args[0].dtype)
    monkeypatch.setattr(layers, "fused_kernels", lambda t: cpu_ops._module)
    got = layers.apply_rotary(q, k, cos_sin)
    assert calls == [dtype, dtype]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_vision_layers_add_and_layer_norm_in_one_pass(kernel, monkeypatch):
    """``layers.add_layer_norm``: the vision tower's residual add and the LayerNorm after it,
    one kernel call for bfloat16 (the sum torch's bit for bit), torch's ops for float32."""
    from mmserve.models import layers

    g = torch.Generator().manual_seed(12)
    norm = torch.nn.LayerNorm(768, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(768, generator=g) * 0.1 + 1)
        norm.bias.copy_(torch.randn(768, generator=g) * 0.1)
    x, residual = (torch.randn(2, 197, 768, generator=g) * 3).unbind(0)
    monkeypatch.setattr(layers, "fused_kernels", lambda t: cpu_ops._module)
    calls = _spy_on(monkeypatch, kernel, "add_layer_norm", lambda args: args[0].dtype)
    with torch.no_grad():
        total, normed = layers.add_layer_norm(x, residual, norm)  # float32: torch's
        assert torch.equal(total, residual + x) and torch.equal(normed, norm(residual + x))
        norm = norm.bfloat16()
        x, residual = x.bfloat16(), residual.bfloat16()
        total, normed = layers.add_layer_norm(x, residual, norm)
    assert calls == [torch.bfloat16]
    assert torch.equal(total, residual + x)
    _assert_rounds_like_torch(normed, norm(residual + x))
    with pytest.raises(RuntimeError, match="add_layer_norm: bfloat16 only"):
        kernel.add_layer_norm(x.float(), residual.float(), norm.weight.float(),
                              norm.bias.float(), 1e-5)


def test_elementwise_kernels_round_like_torch_at_any_width(kernel):
    """Widths that leave part of a 16-lane vector (and rows shorter than one): the vector
    loops' masked tails read and write only the row's own elements."""
    from mmserve.models import layers

    g = torch.Generator().manual_seed(11)
    for width in (5, 37, 100):
        weight = (torch.randn(width, generator=g) * 0.1 + 1).bfloat16()
        wide = (torch.randn(41, width + 9, generator=g) * 3).bfloat16()
        x = wide[:, 4:4 + width]
        residual = (torch.randn(41, width, generator=g) * 3).bfloat16()
        stream = residual + x
        expected = layers.elementwise.rms_norm(stream, weight, 1e-5)  # torch's ops
        _assert_rounds_like_torch(kernel.add_rms_norm(x, residual, weight, 1e-5), expected)
        assert torch.equal(residual, stream)
        _assert_rounds_like_torch(kernel.rms_norm(residual, weight, 1e-5), expected)
        gate, up = wide[:, :width], wide[:, 9:9 + width]
        _assert_rounds_like_torch(kernel.silu_and_mul(gate, up), F.silu(gate) * up)
        _assert_rounds_like_torch(kernel.quick_gelu(x), x * torch.sigmoid(1.702 * x))
        layer_norm = torch.nn.LayerNorm(width, eps=1e-5).bfloat16()
        with torch.no_grad():
            layer_norm.weight.copy_(weight)
            layer_norm.bias.copy_(weight - 1)
            total, normed = kernel.add_layer_norm(x.contiguous(), residual, layer_norm.weight,
                                                  layer_norm.bias, 1e-5)
            assert torch.equal(total, residual + x)
            _assert_rounds_like_torch(normed, layer_norm(residual + x))
    # A head of 40 dimensions: 20 a half, one full vector and four lanes.
    rope = layers.RotaryEmbedding(40, 64, 10000.0)
    cos_sin = rope.cos_sin(torch.arange(7), torch.bfloat16)
    qk = (torch.randn(7, 3, 40, generator=g) * 3).bfloat16()
    expected = layers.elementwise.rotary(qk, *cos_sin)
    assert torch.equal(kernel.rotary(qk, *cos_sin), expected)


def _assert_float32_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: no rounding points to keep, only the math's own (an exp within 2 ulp, a sum of
    squares in another order): within a few ulp of torch's ops."""
    assert got.dtype == expected.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=4e-7)


def test_fused_layers_in_float32(kernel, monkeypatch):
    from mmserve.models import layers

    g = torch.Generator().manual_seed(11)
    norm = layers.RMSNorm(768, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(768, generator=g) * 0.1 + 1)
    x = (torch.randn(300, 1000, generator=g) * 3)[:, 100:868]
    gate_up = torch.randn(257, 2 * 2048, generator=g) * 4
    gate, up = gate_up[:, :2048], gate_up[:, 2048:]
    rope = layers.RotaryEmbedding(64, 512, 10000.0)
    cos_sin = rope.cos_sin(torch.tensor([0, 1, 2, 7, 100, 511, 3]), torch.float32)
    qkv = torch.randn(7, 20, 64, generator=g) * 3
    q, k = qkv[:, :12], qkv[:, 12:16]
    with torch.no_grad():
        monkeypatch.setattr(layers, "fused_kernels", lambda t: None)
        expected_norm = norm(x)
        expected_rope = q * cos_sin[0] + torch.cat((-q[..., 32:], q[..., :32]), -1) * cos_sin[1]
        monkeypatch.setattr(layers, "fused_kernels", lambda t: kernel)
        got_norm = norm(x)
    _assert_float32_close(got_norm, expected_norm)
    # The module's rotary keeps torch's ops in float32 (exactly); the kernel is within an ulp.
    assert torch.equal(layers.apply_rotary(q, k, cos_sin)[0], expected_rope)
    _assert_float32_close(kernel.rotary(q, cos_sin[0], cos_sin[1]), expected_rope)
    _assert_float32_close(kernel.silu_and_mul(gate, up), F.silu(gate) * up)
    edge = torch.tensor([-1e4, -100.0, -3.0, 0.0, 0.5, 100.0, 1e4])
    _assert_float32_close(kernel.quick_gelu(edge), edge * torch.sigmoid(1.702 * edge))
    row = edge.view(1, -1)
    _assert_float32_close(kernel.silu_and_mul(row, row), F.silu(row) * row)


def test_fused_layers_reject_other_dtypes(kernel):
    x = torch.randn(4, 64).double()
    with pytest.raises(RuntimeError, match="bfloat16 or float32 only"):
        kernel.rms_norm(x, torch.ones(64).double(), 1e-5)
    with pytest.raises(RuntimeError, match="all tensors must have one dtype"):
        kernel.silu_and_mul(x.float(), x.bfloat16())
    with pytest.raises(RuntimeError, match="one shape"):
        kernel.silu_and_mul(x.bfloat16(), x[:, :32].bfloat16())
    table = torch.ones(4, 1, 64).bfloat16()
    with pytest.raises(RuntimeError, match=r"cos and sin tables of \[tokens, 1, dim\]"):
        kernel.rotary(x.bfloat16().view(4, 1, 64), table[:2], table[:2])


def test_kernels_only_for_the_dtypes_they_serve(kernel):
    assert cpu_ops.fused_kernels(torch.zeros(2, dtype=torch.bfloat16)) is kernel
    assert cpu_ops.fused_kernels(torch.zeros(2)) is kernel
    assert cpu_ops.fused_kernels(torch.zeros(2, dtype=torch.float16)) is None
    assert cpu_ops.fused_kernels(torch.zeros(2, device="meta")) is None


@pytest.fixture(scope="module")
def packed(kernel):
    if not kernel.packed_linear_supported():
        pytest.skip("no AVX512-BF16 on this path: bfloat16 linear layers stay on torch")
    return kernel


def _f32_linear(in_features, out_features, bias, seed):
    g = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=g))
    return linear


def _bf16_linear(in_features, out_features, bias, seed):
    return _f32_linear(in_features, out_features, bias, seed).bfloat16()


@pytest.mark.parametrize("rows,in_features,out_features,bias", [
    (1, 768, 2048, False),  # one decode
    (3, 64, 48, True),  # fewer rows than a tile, outputs not a multiple of the 32-wide panel
    (64, 768, 32000, False),  # a decode step through the LM head
    (300, 2048, 768, True),  # more rows than one streamed chunk: row chunks, a tile tail
    (9, 768, 256, False),
    # Up to 256 rows with at least four panels for each of the test's two threads are one
    # chunk that goes through the inputs in blocks of 128 pairs: a last block of 116 pairs,
    # bias; two tiles, then 26 (a tail of 3 rows) and a last panel of 10 outputs.
    (16, 1000, 4096, True),
    (203, 1000, 4010, True),
    (65, 256, 64, False),  # two panels: two chunks of 33 rows rather than 64 and 1
    # Output rows a multiple of 4 KiB long: written with streaming stores.
    (37, 64, 2048, True),
    (3, 128, 4096, False),
])
def test_packed_linear_matches_torch(packed, rows, in_features, out_features, bias):
    linear = _bf16_linear(in_features, out_features, bias, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    with _torch_threads(2), torch.no_grad():  # which inputs stream: panels per thread
        got = cpu_ops.PackedLinear(linear)(x)
    with torch.no_grad():
        torch_out = linear(x)
        exact = F.linear(x.float(), linear.weight.float(),
                         None if linear.bias is None else linear.bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == torch_out.shape
    # Both sum in float32 and round once; only the order of the sums differs.
    assert (got.float() - exact).abs().max() <= 1.5 * (torch_out.float() - exact).abs().max()
    assert _ulps_apart(got, torch_out).float().mean() < 0.05


def test_packed_linear_streamed_and_chunked_agree_bit_for_bit(packed):
    """Up to 256 rows are one chunk streamed in blocks while every thread has at least four
    panels, else chunks of up to 64 rows that compute from cache: the sums go in the same
    order, so the results are the same bits."""
    linear = _bf16_linear(1000, 768, True, seed=5)  # 24 panels
    x = torch.randn(200, 1000, generator=torch.Generator().manual_seed(6)).bfloat16()
    with _torch_threads(1), torch.no_grad():  # 24 panels for one thread: streamed
        streamed = cpu_ops.PackedLinear(linear)(x)
    with _torch_threads(8), torch.no_grad():  # 3 panels a thread: four chunks of 50 rows
        chunked = cpu_ops.PackedLinear(linear)(x)
    assert torch.equal(streamed, chunked)


@pytest.mark.parametrize("in_features, out_features, bias, threads", [
    (256, 96, True, 2), (96, 70, False, 2), (1000, 4010, True, 2), (2048, 40, False, 8),
], ids=["panels", "ragged-outputs", "streamed-blocks", "long-inputs-chunked"])
def test_packed_linear_fma_and_pair_dot_product_agree_bit_for_bit(packed, in_features,
                                                                  out_features, bias, threads):
    """The vector tiles multiply inputs of 16 rows or more with float32 FMAs on inputs widened
    to float32 where the core runs those faster, else with AVX512-BF16's pair dot product: the
    same products added in the same order, so the same bits, at row counts on both sides of 16,
    around the 8-row tiles, in streamed blocks and 64-row chunks, with input rows strided."""
    linear = _bf16_linear(in_features, out_features, bias, seed=out_features)
    layer = cpu_ops.PackedLinear(linear)
    g = torch.Generator().manual_seed(in_features)
    with _torch_threads(threads), torch.no_grad():
        for rows in (1, 15, 16, 17, 33, 64, 65, 200, 300):
            x = torch.randn(rows, in_features + 6, generator=g).bfloat16()[:, 3:-3]
            results = []
            for fma in (False, True):
                with _packed_multiply(packed, fma):
                    results.append(layer(x))
            assert torch.equal(*results), rows
    exact = F.linear(x.float(), linear.weight.float(),
                     None if linear.bias is None else linear.bias.float())
    torch.testing.assert_close(results[1].float(), exact,
                               atol=0.05 * (in_features / 256) ** 0.5, rtol=1e-2)


def test_packed_silu_and_mul_fma_and_pair_dot_product_agree_bit_for_bit(packed):
    linear = _bf16_linear(768, 2 * 1024, False, seed=4)
    fused = cpu_ops.PackedSiluAndMul(linear)
    for rows in (16, 40, 300):
        x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)).bfloat16()
        results = []
        for fma in (False, True):
            with _packed_multiply(packed, fma), torch.no_grad():
                results.append(fused(x))
        assert torch.equal(*results), rows


def test_bf16_multiply_switch(packed):
    """The bfloat16 kernels' multiply (the packed linear's and flash attention's vector code)
    is measured on this core on first use (a bool), and can be set; the setter returns the
    previous setting."""
    chosen = packed.bf16_fma()
    assert isinstance(chosen, bool)
    try:
        assert packed.set_bf16_fma(not chosen) is chosen
        assert packed.bf16_fma() is (not chosen)
        assert packed.set_bf16_fma(chosen) is (not chosen)
    finally:
        packed.set_bf16_fma(chosen)
    assert packed.bf16_fma() is chosen


def test_packed_linear_takes_strided_and_batched_inputs(packed):
    linear = _bf16_linear(64, 96, True, seed=2)
    wide = torch.randn(2, 5, 100, generator=torch.Generator().manual_seed(3)).bfloat16()
    x = wide[..., 10:74]  # rows with a stride, two leading dimensions
    with torch.no_grad():
        got = cpu_ops.PackedLinear(linear)(x)
        expected = linear(x.contiguous())
    assert got.shape == (2, 5, 96)
    torch.testing.assert_close(got.float(), expected.float(), atol=0.1, rtol=1e-2)
    columns = torch.randn(64, 7, generator=torch.Generator().manual_seed(4)).bfloat16().t()
    with torch.no_grad():  # features not contiguous: copied first
        torch.testing.assert_close(cpu_ops.PackedLinear(linear)(columns).float(),
                                   linear(columns.contiguous()).float(), atol=0.1, rtol=1e-2)


def test_packed_linear_rejects_mismatched_inputs(packed):
    weights = packed.pack_linear_weight(torch.randn(40, 64).bfloat16())
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="x has 32 features, the weight takes 64"):
        packed.packed_linear(x[:, :32], weights, None, 40)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        packed.packed_linear(x, weights, None, 70)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        packed.packed_linear(x, weights, torch.zeros(40).bfloat16(), 40)
    with pytest.raises(RuntimeError, match="input size must be even"):
        packed.pack_linear_weight(torch.randn(4, 7).bfloat16())


def test_pack_linear_layers_replaces_only_what_it_can_serve(packed):
    model = torch.nn.ModuleDict({
        "a": _bf16_linear(64, 64, False, seed=4),
        "odd": _bf16_linear(63, 64, False, seed=5),
        "tied": _bf16_linear(64, 100, False, seed=6),
        "fp32": torch.nn.Linear(64, 64),
    })
    model["embed"] = torch.nn.Embedding(100, 64).bfloat16()
    model["embed"].weight = model["tied"].weight  # an LM head tied to the embeddings
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    float32_layer = cpu_ops.float32_linear()  # the path's: oneDNN's or the AVX2 kernel
    with torch.no_grad():
        before = model["a"](x)
        assert cpu_ops.pack_linear_layers(model) == 1 + (float32_layer is not None)
        after = model["a"](x)
    assert isinstance(model["a"], cpu_ops.bfloat16_linear())
    assert all(isinstance(model[k], torch.nn.Linear) for k in ("odd", "tied"))
    assert isinstance(model["fp32"], float32_layer or torch.nn.Linear)
    torch.testing.assert_close(after.float(), before.float(), atol=0.1, rtol=1e-2)


@pytest.mark.parametrize("amx", [False, True])
def test_pack_linear_layers_gives_prompt_only_layers_their_own_matmul(packed, monkeypatch, amx):
    """Layers inside ``prompt_only`` (a vision tower) take oneDNN's matmul on a CPU with AMX,
    where it multiplies hundreds of rows faster, unless they have few outputs from not many
    inputs; the rest, and every layer elsewhere, take the path's bfloat16 layer. Either
    computes torch's product within bfloat16's rounding."""
    _set_amx(monkeypatch, amx)
    tower = torch.nn.Sequential(_bf16_linear(64, 1056, True, seed=9),
                                _bf16_linear(1056, 96, False, seed=8))
    model = torch.nn.ModuleDict({"tower": tower, "decoder": _bf16_linear(96, 64, False, seed=10)})
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(11)).bfloat16()
    with torch.no_grad():
        before = model["decoder"](model["tower"](x))
        assert cpu_ops.pack_linear_layers(model, prompt_only=[tower]) == 3
        after = model["decoder"](model["tower"](x))
    wide = (cpu_ops.OneDNNLinear if amx and cpu_ops.onednn_linear_supported()
            else cpu_ops.PackedLinear)
    assert cpu_ops.bfloat16_prompt_linear(64, 1056) is wide
    assert cpu_ops.bfloat16_prompt_linear(3584, 96) is wide  # many inputs
    assert cpu_ops.bfloat16_prompt_linear(1056, 96) is cpu_ops.bfloat16_linear()
    assert [type(m) for m in tower] == [wide, cpu_ops.bfloat16_linear()]
    assert type(model["decoder"]) is cpu_ops.bfloat16_linear()
    torch.testing.assert_close(after.float(), before.float(), atol=0.1, rtol=1e-2)


def test_cpu_runner_packs_bfloat16_linear_layers(packed, clip_llama):
    from mmserve import LLM

    def packed_layers(llm):
        return sum(isinstance(m, cpu_ops.bfloat16_linear()) and m.packed.dtype == torch.bfloat16
                   for m in llm.engine.model.modules())

    # (test_engine_inputs.py generates through them in bfloat16.)
    llm = LLM(clip_llama, device="cpu", dtype="bfloat16", max_model_len=96)
    assert packed_layers(llm) > 0
    # The vision tower and projector are packed for prompt-sized inputs (the model's
    # encoder_modules()), the decoder for decode steps.
    model = llm.engine.model
    linear = (torch.nn.Linear, cpu_ops.PackedLinear, cpu_ops.OneDNNLinear)
    tower = [m for enc in model.encoder_modules() for m in enc.modules() if isinstance(m, linear)]
    assert tower and all(
        isinstance(m, cpu_ops.bfloat16_prompt_linear(m.in_features, m.out_features))
        for m in tower)
    decoder = [m for m in model.model.language_model.modules() if isinstance(m, linear)]
    assert decoder and all(isinstance(m, cpu_ops.bfloat16_linear()) for m in decoder)
    # The MLPs' gate and up layers apply SiLU themselves where the packed kernel serves.
    mlps = [m.mlp.gate_up_proj for m in model.model.language_model.layers]
    assert all(isinstance(m, cpu_ops.PackedSiluAndMul) for m in mlps) == (
        cpu_ops.bfloat16_linear() is cpu_ops.PackedLinear)
    assert packed_layers(LLM(clip_llama, device="cpu", dtype="float32", max_model_len=96)) == 0


def test_bfloat16_linear_layers_stay_packed_where_the_cpu_has_amx(packed, monkeypatch):
    """The packed kernel serves bfloat16 layers on every CPU with AVX512-BF16: with AMX its own
    tile path multiplies the inputs of many rows. oneDNN's layer (which uses the tiles too)
    serves a CPU with AMX where the module's tile path is missing; both compute torch's product
    within bfloat16's rounding."""
    _set_amx(monkeypatch, False)
    assert cpu_ops.bfloat16_linear() is cpu_ops.PackedLinear
    _set_amx(monkeypatch, True)
    assert cpu_ops.bfloat16_linear() is cpu_ops.PackedLinear or (
        not packed.packed_linear_amx_supported())
    monkeypatch.setattr(packed, "packed_linear_amx_supported", lambda: False)
    assert cpu_ops.bfloat16_linear() is (
        cpu_ops.OneDNNLinear if cpu_ops.onednn_linear_supported() else cpu_ops.PackedLinear)
    linear = _bf16_linear(256, 96, True, seed=8)
    for rows in (1, 16, 300):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        with torch.no_grad():
            want = torch.nn.functional.linear(x.float(), linear.weight.float(),
                                              linear.bias.float())
            for layer in (cpu_ops.PackedLinear(linear), cpu_ops.OneDNNLinear(linear)):
                torch.testing.assert_close(layer(x).float(), want, atol=0.05, rtol=1e-2)


@pytest.mark.parametrize("in_features, out_features, bias", [
    (256, 96, True), (96, 70, False), (100, 64, True), (2048, 40, False),
], ids=["panels", "ragged-outputs", "inputs-off-the-tiles", "long-inputs"])
def test_packed_linear_on_amx_tiles_matches_its_vector_tiles(packed, in_features, out_features,
                                                             bias):
    """The AMX tile path (inputs a multiple of 32) against the AVX512-BF16 tiles on the same
    packed weight, and both against torch's product: row counts around the 16-row tiles, the
    32-row chunks and the 256-row blocks (a last chunk of few rows, the tiles configured anew),
    outputs that end mid-panel; 100 inputs stay on the vector tiles (not whole tile steps)."""
    if not packed.packed_linear_amx_supported():
        pytest.skip("no AMX tiles on this CPU (or the kernel refuses them to the process)")
    linear = _bf16_linear(in_features, out_features, bias, seed=in_features)
    layer = cpu_ops.PackedLinear(linear)
    try:
        for i, rows in enumerate((1, 8, 9, 16, 17, 32, 33, 300, 513)):
            x = torch.randn(rows, in_features,
                            generator=torch.Generator().manual_seed(rows)).bfloat16()
            with torch.no_grad():
                want = torch.nn.functional.linear(
                    x.float(), linear.weight.float(),
                    None if linear.bias is None else linear.bias.float())
                # On by default; off since the previous row count.
                assert packed.set_packed_linear_amx(True) is (i == 0)
                tiles = layer(x).float()
                assert packed.set_packed_linear_amx(False) is True
                vectors = layer(x).float()
            for got in (tiles, vectors):
                torch.testing.assert_close(got, want, atol=0.05 * (in_features / 256) ** 0.5,
                                           rtol=1e-2)
            # Both sum in float32 and round once: they differ by at most a bfloat16 rounding.
            torch.testing.assert_close(tiles, vectors, atol=1e-6, rtol=2 ** -7)
    finally:
        packed.set_packed_linear_amx(True)


@pytest.mark.parametrize("in_features, halves, bias", [
    (768, 2048, False), (96, 48, True), (100, 16, False),
], ids=["mlp", "bias", "inputs-off-the-amx-tiles"])
def test_packed_silu_and_mul_is_the_separate_ops_bit_for_bit(packed, in_features, halves, bias):
    """Gate and up packed in 16-output halves of each panel give silu(gate) * up straight from
    the sums: the same bits as the merged layer's output through ``silu_and_mul``, on the AMX
    tiles and the vector tiles, at row counts around their tiles and chunks."""
    linear = _bf16_linear(in_features, 2 * halves, bias, seed=halves)
    merged, fused = cpu_ops.PackedLinear(linear), cpu_ops.PackedSiluAndMul(linear)
    amx = [True, False] if packed.packed_linear_amx_supported() else [False]
    try:
        for tiles in amx:
            packed.set_packed_linear_amx(tiles)
            for rows in (1, 8, 9, 16, 17, 33, 300):
                x = torch.randn(rows, in_features,
                                generator=torch.Generator().manual_seed(rows)).bfloat16()
                with torch.no_grad():
                    gate, up = merged(x).split(halves, dim=-1)
                    got = fused(x)
                assert got.shape == (rows, halves)
                assert torch.equal(got, packed.silu_and_mul(gate, up)), (tiles, rows)
    finally:
        packed.set_packed_linear_amx(True)
    assert cpu_ops.PackedSiluAndMul.applies(linear)
    assert not cpu_ops.PackedSiluAndMul.applies(_bf16_linear(64, 2 * 40, False, seed=1))
    with pytest.raises(RuntimeError, match="gate and up must fill whole panels"):
        packed.packed_linear_silu_and_mul(x, merged.packed, None, 2 * halves - 2)


def test_pack_linear_layers_fuses_silu_into_the_gate_and_up_layers(packed):
    """A merged gate and up layer that asks for it (``fused_activation``) becomes one whose
    output is the activation's, where it fills whole panels; others stay plain."""
    from mmserve.models.layers import MergedLinear

    def merged(halves):
        layer = MergedLinear(64, {"gate_proj": halves, "up_proj": halves}, bias=False,
                             fused_activation="silu_and_mul").bfloat16()
        torch.nn.init.normal_(layer.weight, generator=torch.Generator().manual_seed(halves))
        return layer

    model = torch.nn.ModuleDict({"fits": merged(32), "ragged": merged(40),
                                 "tower": merged(32)})
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        gate, up = model["fits"](x).split(32, dim=-1)
        assert cpu_ops.pack_linear_layers(model, prompt_only=[model["tower"]]) == 3
        got = model["fits"](x)
    assert type(model["fits"]) is cpu_ops.PackedSiluAndMul and model["fits"].applies_activation
    assert type(model["ragged"]) is cpu_ops.PackedLinear
    assert not isinstance(model["tower"], cpu_ops.PackedSiluAndMul)
    assert torch.equal(got, packed.silu_and_mul(gate, up))


@pytest.fixture(scope="module")
def packed_f32(kernel):
    if not kernel.packed_linear_f32_supported():
        pytest.skip("this CPU lacks AVX2 or FMA: float32 linear layers use oneDNN")
    return kernel


def _assert_float32_linear_close(got, linear, x):
    """Within a few float32 roundings of the exact sum, as close as torch's own ``F.linear``:
    both sum in float32, only the order differs."""
    with torch.no_grad():
        torch_out = linear(x)
        exact = F.linear(x.double(), linear.weight.double(),
                         None if linear.bias is None else linear.bias.double())
    assert got.dtype == torch.float32 and got.shape == torch_out.shape
    # float32's rounding of a sum of K products is at most about K * 2^-24 of the sum of their
    # magnitudes; 4 * sqrt(K) * 2^-24 of it bounds a random-order sum's error with room.
    magnitudes = F.linear(x.double().abs(), linear.weight.double().abs(),
                          None if linear.bias is None else linear.bias.double().abs())
    bound = 4 * (x.shape[-1] ** 0.5) * 2.0 ** -24 * magnitudes
    assert ((got.double() - exact).abs() <= bound).all()
    assert ((torch_out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("rows,in_features,out_features,bias", [
    (1, 768, 2048, False),  # one decode
    (3, 64, 40, True),  # fewer rows than a tile, a last panel of 8 outputs
    (8, 768, 32000, False),  # a decode step through the LM head
    (200, 2048, 768, True),  # several row chunks and input blocks, a tile tail, bias
    (97, 300, 17, False),  # an input block tail, one output past a panel, chunks of 54 and 43
    (13, 7, 5, True),  # fewer inputs than a block, one narrow panel
])
def test_packed_linear_f32_matches_torch(packed_f32, rows, in_features, out_features, bias):
    linear = _f32_linear(in_features, out_features, bias, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = cpu_ops.PackedLinearF32(linear)(x)
    _assert_float32_linear_close(got, linear, x)


def test_packed_linear_f32_does_not_depend_on_the_thread_split(packed_f32):
    """The kernel's work items (a chunk of rows, a panel of outputs) go to threads a few at a
    time as they come free, and a thread's batch may cross from one chunk to the next: whoever
    computes it, every output is the same sum in the same order, bit for bit."""
    linear = _f32_linear(300, 100, True, seed=5)  # 7 panels, the last one narrow
    x = torch.randn(203, 300, generator=torch.Generator().manual_seed(6))  # 3 chunks, a tail
    layer = cpu_ops.PackedLinearF32(linear)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            with torch.no_grad():
                outputs.append(layer(x))
    finally:
        torch.set_num_threads(threads)
    _assert_float32_linear_close(outputs[0], linear, x)
    for got in outputs[1:]:
        assert torch.equal(got, outputs[0])


def test_packed_linear_f32_rows_do_not_depend_on_the_other_rows(packed_f32):
    """The rows of one call are cut into chunks of about equal size, so a row's chunk and its
    place in a tile change with the number of rows (100 rows: 54 + 46; 203: 72 + 72 + 59):
    each row's outputs are still the same sum in the same order as in any other call."""
    linear = _f32_linear(300, 100, True, seed=7)
    x = torch.randn(203, 300, generator=torch.Generator().manual_seed(8))
    layer = cpu_ops.PackedLinearF32(linear)
    with torch.no_grad():
        full = layer(x)
        _assert_float32_linear_close(full, linear, x)
        for rows in (1, 5, 6, 96, 97, 100, 150, 193):
            assert torch.equal(layer(x[:rows]), full[:rows]), rows
            assert torch.equal(layer(x[-rows:]), full[-rows:]), rows


def test_onednn_linear_matches_torch():
    if not cpu_ops.onednn_linear_supported():
        pytest.skip("this torch build has no oneDNN")
    for rows, in_features, out_features, bias in [(1, 768, 2048, False), (70, 96, 50, True)]:
        linear = _f32_linear(in_features, out_features, bias, seed=rows)
        x = torch.randn(2, rows, in_features, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            got = cpu_ops.OneDNNLinear(linear)(x)
        _assert_float32_linear_close(got, linear, x)


def test_packed_linear_f32_takes_strided_inputs_and_rejects_mismatches(packed_f32):
    linear = _f32_linear(64, 96, True, seed=2)
    layer = cpu_ops.PackedLinearF32(linear)
    wide = torch.randn(2, 5, 100, generator=torch.Generator().manual_seed(3))
    x = wide[..., 10:74]  # rows with a stride, two leading dimensions
    with torch.no_grad():
        got, expected = layer(x), linear(x.contiguous())
        columns = torch.randn(64, 7, generator=torch.Generator().manual_seed(4)).t()
        torch.testing.assert_close(layer(columns), linear(columns.contiguous()))
    assert got.shape == (2, 5, 96)
    torch.testing.assert_close(got, expected)
    weights = packed_f32.pack_linear_weight_f32(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="x has 32 features, the weight takes 64"):
        packed_f32.packed_linear_f32(torch.randn(2, 32), weights, None, 40)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        packed_f32.packed_linear_f32(torch.randn(2, 64), weights, None, 50)
    with pytest.raises(RuntimeError, match="bias must be float32, padded to 48"):
        packed_f32.packed_linear_f32(torch.randn(2, 64), weights, torch.zeros(40), 40)


def test_cpu_runner_packs_float32_linear_layers(kernel, clip_llama):
    from mmserve import LLM

    layer = cpu_ops.float32_linear()
    # x86 builds of torch have oneDNN
    assert layer is {"packed": cpu_ops.PackedLinearF32, "onednn": cpu_ops.OneDNNLinear}[
        cpu_ops.active_path().float32_linear]
    model = LLM(clip_llama, device="cpu", dtype="float32", max_model_len=96).engine.model
    packed = [m for m in model.modules() if isinstance(m, layer)]
    assert packed and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
