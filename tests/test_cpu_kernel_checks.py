"""The compiled CPU kernels refuse, with a RuntimeError that says what is wrong, every input
their pointer arithmetic cannot take: wrong dims, dtypes, devices, layouts, strides, sizes that
disagree between arguments, and block tables or lengths that would index past the KV cache.
Each check runs before any data pointer is read; several of these inputs crashed the process
(a segmentation fault or a division by zero) before the checks existed.

Each runs on every compiled path this CPU supports (the ``kernel`` fixture, ``conftest.py``).
Skipped only where there is no C++ compiler; the bfloat16 flash attention and linear layers
need AVX512-BF16 and the float32 ones AVX2 and FMA (the module's ``*_supported()`` says).
"""

import shutil

import pytest
import torch

pytestmark = pytest.mark.skipif(shutil.which("c++") is None,
                                reason="no C++ compiler: the CPU runner uses the torch path")


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


# ---------------------------------------------------------------------------------------------
# decode_attention(query [seqs, heads, dim], key_cache, value_cache [blocks, block_size,
# kv_heads, dim], block_tables [seqs, max_blocks], seq_lens [seqs], scale)


def _decode_args(seqs=2, heads=4, kv_heads=2, dim=64, blocks=6, block_size=16, max_blocks=3,
                 dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    query = torch.randn(seqs, heads, dim, generator=g).to(dtype)
    cache = torch.randn(2, blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    tables = torch.arange(seqs * max_blocks).view(seqs, max_blocks) % blocks
    lens = torch.full((seqs,), max_blocks * block_size - 5)
    return [query, cache[0], cache[1], tables, lens, dim ** -0.5]


def test_decode_attention_takes_valid_inputs(kernel):
    """The arguments the checks below spoil one at a time are valid as they are."""
    args = _decode_args()
    out = kernel.decode_attention(*args)
    assert out.shape == args[0].shape and torch.isfinite(out).all()
    args[3] = args[3].int()  # int32 tables and lengths are read as int64
    args[4] = args[4].int()
    torch.testing.assert_close(kernel.decode_attention(*args), out)


def test_decode_attention_rejects_block_ids_outside_the_cache(kernel):
    """A block id past the cache (or negative) was read as an address: a segmentation fault."""
    for bad in (100_000_000, 6, -1):
        args = _decode_args()
        args[3][1, 2] = bad
        with pytest.raises(RuntimeError, match=rf"decode_attention: block table entry 2 of "
                                               rf"sequence 1 is {bad}, outside the caches' 6 "
                                               rf"blocks"):
            kernel.decode_attention(*args)


def test_decode_attention_ignores_padding_past_a_sequences_blocks(kernel):
    """Entries past a sequence's ``ceil(len / block_size)`` blocks are padding: never read."""
    args = _decode_args()
    expected = kernel.decode_attention(*args)
    args[4][0] = 20  # two blocks of 16
    expected_short = kernel.decode_attention(*args)
    args[3][0, 2] = -1  # padding past them
    torch.testing.assert_close(kernel.decode_attention(*args), expected_short)
    assert not torch.equal(expected_short[0], expected[0])


def test_decode_attention_rejects_lengths_its_table_cannot_hold(kernel):
    """A length past ``max_blocks * block_size`` read block ids past the table's row."""
    args = _decode_args()
    args[4][0] = 3 * 16 + 1
    with pytest.raises(RuntimeError, match="decode_attention: sequence 0 has length 49, but its "
                                           "block table holds 3 blocks of 16 tokens"):
        kernel.decode_attention(*args)
    args[4][0] = -3
    with pytest.raises(RuntimeError, match="decode_attention: sequence 0 has length -3"):
        kernel.decode_attention(*args)


def test_decode_attention_rejects_zero_kv_heads_or_block_size(kernel):
    """Both divide: zero was a floating point exception (SIGFPE) that killed the process."""
    query = torch.randn(1, 4, 64)
    for cache in (torch.zeros(4, 16, 0, 64), torch.zeros(4, 0, 2, 64)):
        with pytest.raises(RuntimeError, match="decode_attention: the caches need a block size "
                                               "and a number of KV heads of at least 1"):
            kernel.decode_attention(query, cache, cache, torch.tensor([[1]]), torch.tensor([5]),
                                    0.125)


def test_decode_attention_rejects_bad_block_tables_and_lengths(kernel):
    args = _decode_args()
    for tables in (args[3].float(), args[3].bool(), args[3].flatten()):
        bad = list(args)
        bad[3] = tables
        with pytest.raises(RuntimeError, match=r"decode_attention: block_tables must be an "
                                               r"integer tensor \[seqs, max_blocks\]"):
            kernel.decode_attention(*bad)
    for lens in (args[4].float(), args[4].view(2, 1)):
        bad = list(args)
        bad[4] = lens
        with pytest.raises(RuntimeError, match=r"decode_attention: seq_lens must be an integer "
                                               r"tensor \[seqs\]"):
            kernel.decode_attention(*bad)
    bad = list(args)
    bad[3] = args[3][:1]
    with pytest.raises(RuntimeError, match=r"decode_attention: one block table and length per "
                                           r"sequence \(2 sequences, 1 block tables, 2 lengths\)"):
        kernel.decode_attention(*bad)
    bad = list(args)
    bad[4] = args[4][:1]
    with pytest.raises(RuntimeError, match="one block table and length per sequence"):
        kernel.decode_attention(*bad)


def test_decode_attention_rejects_bad_shapes_dtypes_and_strides(kernel):
    args = _decode_args()
    cases = [
        (0, args[0][0], r"expected query \[seqs, heads, dim\]"),
        (1, args[1][0], r"expected query \[seqs, heads, dim\]"),
        (2, args[2][:5], r"expected query \[seqs, heads, dim\]"),
        (0, args[0].transpose(0, 1).contiguous().transpose(0, 1), "must be contiguous"),
        (1, args[1].transpose(1, 2).contiguous().transpose(1, 2), "must be contiguous"),
        (2, args[2].bfloat16(), "must share a dtype"),
        (0, args[0][:, :3].contiguous(), "heads are not a multiple of KV heads"),
        (0, args[0][..., :32].contiguous(), "head sizes differ"),
    ]
    for index, value, message in cases:
        bad = list(args)
        bad[index] = value
        with pytest.raises(RuntimeError, match=f"decode_attention: .*{message}"):
            kernel.decode_attention(*bad)
    bad = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
           for a in args]
    with pytest.raises(RuntimeError, match=r"decode_attention: unsupported dtype Double "
                                           r"\(float32, bfloat16 or float16 only\)"):
        kernel.decode_attention(*bad)


def test_decode_attention_rejects_tensors_off_the_cpu(kernel):
    args = _decode_args()
    names = ["query", "key_cache", "value_cache", "block_tables", "seq_lens"]
    for index, name in enumerate(names):
        bad = list(args)
        bad[index] = _meta(*args[index].shape, dtype=args[index].dtype)
        with pytest.raises(RuntimeError, match=f"decode_attention: {name} must be a CPU tensor, "
                                               f"not one on meta"):
            kernel.decode_attention(*bad)
    bad = list(args)
    bad[0] = args[0].to_sparse()
    with pytest.raises(RuntimeError, match="decode_attention: query must be a dense "
                                           r"\(strided\) tensor"):
        kernel.decode_attention(*bad)


# ---------------------------------------------------------------------------------------------
# flash_attention (bfloat16) and flash_attention_f32: query [batch, q_len, heads, dim], key and
# value [batch, kv_len, kv_heads, dim]


@pytest.fixture(params=["flash_attention", "flash_attention_f32"])
def flash(request, kernel):
    """(the function, its name, its dtype) for each flash attention this CPU has."""
    name = request.param
    if not getattr(kernel, f"{name}_supported")(64):
        pytest.skip(f"{name} is not in this build (its CPU instructions are missing)")
    dtype = torch.bfloat16 if name == "flash_attention" else torch.float32
    return getattr(kernel, name), name, dtype


def _flash_args(dtype, batch=1, q_len=5, kv_len=9, heads=4, kv_heads=2, dim=64):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, q_len, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_len, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def test_flash_attention_takes_valid_inputs(flash):
    fn, _, dtype = flash
    q, k, v = _flash_args(dtype)
    out = fn(q, k, v, 0.125, 4)
    assert out.shape == q.shape and torch.isfinite(out.float()).all()


def test_flash_attention_rejects_zero_kv_heads(flash):
    """``heads % kv_heads`` with no KV heads was a floating point exception (SIGFPE)."""
    fn, name, dtype = flash
    q, k, v = _flash_args(dtype)
    with pytest.raises(RuntimeError, match=f"{name}: key and value have no KV heads"):
        fn(q, k[:, :, :0], v[:, :, :0], 0.125, -1)


def test_flash_attention_rejects_tensors_off_the_cpu(flash):
    fn, name, dtype = flash
    args = list(_flash_args(dtype))
    for index, arg in enumerate(("query", "key", "value")):
        bad = list(args)
        bad[index] = _meta(*args[index].shape, dtype=dtype)
        with pytest.raises(RuntimeError, match=f"{name}: {arg} must be a CPU tensor, not one "
                                               f"on meta"):
            fn(*bad, 0.125, -1)


def test_flash_attention_rejects_bad_shapes_dtypes_and_strides(flash):
    fn, name, dtype = flash
    q, k, v = _flash_args(dtype)
    other = torch.float32 if dtype == torch.bfloat16 else torch.float64
    wide_k = torch.randn(1, 9, 2, 128).to(dtype)[..., :64]  # rows with another stride
    cases = [
        ((q[0], k, v), r"expected query \[batch, q_len, heads, dim\]"),
        ((q, k, v[:, :8]), r"expected query \[batch, q_len, heads, dim\]"),
        ((q, k.to(other), v.to(other)), "only"),
        ((q.transpose(1, 3).contiguous().transpose(1, 3), k, v),
         "the head dimension must be contiguous"),
        ((q[:, :, :3], k, v), "heads are not a multiple of KV heads"),
        ((torch.cat([q, q]), k, v), "batch or head sizes differ"),
        ((q[..., :24], k[..., :24], v[..., :24]), "head size"),
        ((q, k[:, :0], v[:, :0]), "no keys"),
        ((q, wide_k, v), "key and value strides differ"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=f"{name}: .*{message}"):
            fn(*args, 0.125, -1)


# ---------------------------------------------------------------------------------------------
# rms_norm, add_layer_norm, silu_and_mul, quick_gelu, rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layers_take_valid_inputs(kernel, dtype):
    x = torch.randn(3, 8).to(dtype)
    assert kernel.rms_norm(x, torch.ones(8, dtype=dtype), 1e-6).shape == (3, 8)
    assert kernel.silu_and_mul(x, x).shape == (3, 8)
    assert kernel.quick_gelu(x).shape == (3, 8)
    table = torch.ones(3, 1, 8, dtype=dtype)
    assert kernel.rotary(x.view(3, 1, 8), table, table).shape == (3, 1, 8)
    assert kernel.quick_gelu_(x.clone()).shape == (3, 8)
    if dtype == torch.bfloat16:
        w = torch.ones(8, dtype=dtype)
        assert [t.shape for t in kernel.add_layer_norm(x, x, w, w, 1e-6)] == [(3, 8), (3, 8)]


def test_fused_layers_reject_tensors_off_the_cpu_or_not_dense(kernel):
    x, w, table = torch.randn(3, 8), torch.ones(8), torch.ones(3, 1, 8)
    meta = _meta(3, 8)
    off_cpu = [
        ("rms_norm", lambda: kernel.rms_norm(meta, w, 1e-6)),
        ("rms_norm", lambda: kernel.rms_norm(x, _meta(8), 1e-6)),
        ("silu_and_mul", lambda: kernel.silu_and_mul(meta, x)),
        ("silu_and_mul", lambda: kernel.silu_and_mul(x, meta)),
        ("quick_gelu", lambda: kernel.quick_gelu(meta)),
        ("quick_gelu_", lambda: kernel.quick_gelu_(meta)),
        ("add_layer_norm", lambda: kernel.add_layer_norm(x, meta, w, w, 1e-6)),
        ("rotary", lambda: kernel.rotary(meta.view(3, 1, 8), table, table)),
        ("rotary", lambda: kernel.rotary(x.view(3, 1, 8), table, _meta(3, 1, 8))),
    ]
    for name, call in off_cpu:
        with pytest.raises(RuntimeError, match=f"{name}: CPU tensors only, got one on meta"):
            call()
    sparse = [
        ("rms_norm", lambda: kernel.rms_norm(x.to_sparse(), w, 1e-6)),
        ("silu_and_mul", lambda: kernel.silu_and_mul(x, x.to_sparse())),
        ("quick_gelu", lambda: kernel.quick_gelu(x.to_sparse())),
        ("add_layer_norm", lambda: kernel.add_layer_norm(x.to_sparse(), x, w, w, 1e-6)),
        ("rotary", lambda: kernel.rotary(x.view(3, 1, 8).to_sparse(), table, table)),
    ]
    for name, call in sparse:
        with pytest.raises(RuntimeError, match=rf"{name}: dense \(strided\) tensors only"):
            call()


def test_fused_layers_reject_bad_shapes_and_strides(kernel):
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match=r"rms_norm: expected \[rows, hidden\], rows "
                                           r"contiguous"):
        kernel.rms_norm(x.view(3, 1, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match=r"rms_norm: expected \[rows, hidden\]"):
        kernel.rms_norm(x.t(), torch.ones(3), 1e-6)
    for weight in (torch.ones(7), torch.ones(16)[::2], torch.ones(1, 8)):
        with pytest.raises(RuntimeError, match=r"rms_norm: weight must be \[hidden\]"):
            kernel.rms_norm(x, weight, 1e-6)
    with pytest.raises(RuntimeError, match="rms_norm: all tensors must have one dtype"):
        kernel.rms_norm(x, torch.ones(8).bfloat16(), 1e-6)
    for gate, up in ((x, x[:, :4]), (x.t(), x.t()), (x.view(3, 2, 4), x.view(3, 2, 4)),
                     (x, torch.randn(8, 3).t())):
        with pytest.raises(RuntimeError, match="silu_and_mul: expected gate and up of one shape"):
            kernel.silu_and_mul(gate, up)
    with pytest.raises(RuntimeError, match="quick_gelu: bfloat16 or float32 only"):
        kernel.quick_gelu(x.double())
    xb, wb = x.bfloat16(), torch.ones(8).bfloat16()
    with pytest.raises(RuntimeError, match="add_layer_norm: expected contiguous x and residual"):
        kernel.add_layer_norm(xb, xb[:2], wb, wb, 1e-6)
    with pytest.raises(RuntimeError, match="add_layer_norm: expected contiguous x and residual"):
        kernel.add_layer_norm(xb.t(), xb.t(), torch.ones(3).bfloat16(), wb[:3], 1e-6)
    with pytest.raises(RuntimeError, match=r"add_layer_norm: weight and bias must be \[hidden\]"):
        kernel.add_layer_norm(xb, xb, wb, wb[:7], 1e-6)
    table = torch.ones(3, 1, 8)
    for bad in (torch.randn(3, 1, 7), torch.randn(3, 1, 16)[..., ::2], torch.randn(3, 8)):
        with pytest.raises(RuntimeError, match="rotary: expected x .* even, contiguous last"):
            kernel.rotary(bad, table[..., :bad.shape[-1]], table[..., :bad.shape[-1]])
    xr = x.view(3, 1, 8)
    for cos in (table[:2], torch.ones(3, 1, 16)[..., ::2]):
        with pytest.raises(RuntimeError, match=r"rotary: expected contiguous cos and sin tables"):
            kernel.rotary(xr, cos, table)
        with pytest.raises(RuntimeError, match=r"rotary: expected contiguous cos and sin tables"):
            kernel.rotary(xr, table, cos)


# ---------------------------------------------------------------------------------------------
# pack_linear_weight / packed_linear (bfloat16) and pack_linear_weight_f32 / packed_linear_f32


@pytest.fixture(params=["bf16", "f32"])
def linear(request, kernel):
    """(pack, matmul, name, dtype, panel width) for each packed linear this CPU has."""
    if request.param == "bf16":
        if not kernel.packed_linear_supported():
            pytest.skip("no AVX512-BF16 in this build: bfloat16 linear layers stay on torch")
        return (kernel.pack_linear_weight, kernel.packed_linear, "packed_linear", torch.bfloat16,
                32)
    if not kernel.packed_linear_f32_supported():
        pytest.skip("no AVX2 and FMA in this build: float32 linear layers use oneDNN")
    return (kernel.pack_linear_weight_f32, kernel.packed_linear_f32, "packed_linear_f32",
            torch.float32, 16)


def test_packed_linear_takes_valid_inputs(linear):
    pack, matmul, _, dtype, panel = linear
    weight = torch.randn(40, 64).to(dtype)
    x = torch.randn(3, 64).to(dtype)
    bias = torch.zeros(-(-40 // panel) * panel)
    bias[:40] = torch.randn(40)
    out = matmul(x, pack(weight), bias, 40)
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias[:40])
    torch.testing.assert_close(out.float(), expected, atol=0.5, rtol=2e-2)


def test_packed_linear_without_inputs_is_the_bias(linear):
    """No inputs (an empty weight): every output is its bias; the float32 kernel once left
    them uninitialized."""
    pack, matmul, _, dtype, panel = linear
    weight = torch.zeros(5, 0, dtype=dtype)
    bias = torch.zeros(panel)
    bias[:5] = torch.arange(1.0, 6.0)
    x = torch.zeros(7, 0, dtype=dtype)
    out = matmul(x, pack(weight), bias, 5)
    torch.testing.assert_close(out.float(), bias[:5].expand(7, 5))
    torch.testing.assert_close(matmul(x, pack(weight), None, 5).float(), torch.zeros(7, 5))


def test_packed_linear_rejects_tensors_off_the_cpu(linear):
    pack, matmul, name, dtype, panel = linear
    weight, x = torch.randn(40, 64).to(dtype), torch.randn(3, 64).to(dtype)
    packed, bias = pack(weight), torch.zeros(-(-40 // panel) * panel)
    pack_name = "pack_linear_weight" + ("_f32" if name.endswith("f32") else "")
    with pytest.raises(RuntimeError, match=f"{pack_name}: the weight must be a CPU tensor, not "
                                           f"one on meta"):
        pack(_meta(40, 64, dtype=dtype))
    with pytest.raises(RuntimeError, match=f"{name}: x must be a CPU tensor, not one on meta"):
        matmul(_meta(3, 64, dtype=dtype), packed, bias, 40)
    with pytest.raises(RuntimeError, match=f"{name}: the packed weight must be a CPU tensor"):
        matmul(x, _meta(*packed.shape, dtype=dtype), bias, 40)
    with pytest.raises(RuntimeError, match=f"{name}: the bias must be a CPU tensor"):
        matmul(x, packed, _meta(*bias.shape), 40)
    with pytest.raises(RuntimeError, match=rf"{name}: x must be a dense \(strided\) tensor"):
        matmul(x.to_sparse(), packed, bias, 40)


def test_packed_linear_rejects_mismatched_inputs(linear):
    pack, matmul, name, dtype, panel = linear
    weight, x = torch.randn(40, 64).to(dtype), torch.randn(3, 64).to(dtype)
    packed, panels = pack(weight), -(-40 // panel)
    bias = torch.zeros(panels * panel)
    pack_name = "pack_linear_weight" + ("_f32" if name.endswith("f32") else "")
    other = torch.float32 if dtype == torch.bfloat16 else torch.float64
    for bad in (weight.to(other), weight.t(), weight[None]):
        with pytest.raises(RuntimeError, match=f"{pack_name}: expected a contiguous"):
            pack(bad)
    for bad in (x.to(other), x.t().contiguous().t(), x[None]):
        with pytest.raises(RuntimeError, match=f"{name}: expected .* x \\[rows, in\\] with "
                                               f"contiguous rows"):
            matmul(bad, packed, bias, 40)
    for bad in (packed.to(other), packed[None], packed[:, :, :8], packed.transpose(0, 1)):
        with pytest.raises(RuntimeError, match=f"{name}: the weight must come from {pack_name}"):
            matmul(x, bad, bias, 40)
    with pytest.raises(RuntimeError, match=f"{name}: x has 32 features, the weight takes 64"):
        matmul(x[:, :32], packed, bias, 40)
    for out_features in (-1, 0, panels * panel - panel, panels * panel + 1):
        with pytest.raises(RuntimeError, match=f"{name}: out_features does not match the packed "
                                               f"weight \\({out_features} outputs, {panels} "
                                               f"panels of {panel}\\)"):
            matmul(x, packed, bias, out_features)
    for bad in (bias[:40], bias.double(), torch.zeros(panels * panel * 2)[::2]):
        with pytest.raises(RuntimeError, match=f"{name}: the bias must be float32, padded to "
                                               f"{panels * panel}"):
            matmul(x, packed, bad, 40)


def test_packed_linear_rejects_negative_out_features_of_an_empty_weight(linear):
    """No panels: a negative out_features passed the range check and reached ``empty``."""
    pack, matmul, name, dtype, _ = linear
    packed = pack(torch.zeros(0, 64, dtype=dtype))
    x = torch.randn(2, 64).to(dtype)
    assert matmul(x, packed, None, 0).shape == (2, 0)
    with pytest.raises(RuntimeError, match=f"{name}: out_features does not match the packed "
                                           f"weight \\(-5 outputs, 0 panels"):
        matmul(x, packed, None, -5)
