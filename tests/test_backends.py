"""The backends: the CPU backend equals the portable one (values, gradients, cache writes, decode,
generate), its native kernels are right and present where chosen, and the portable program has the
structure accelerators need, checked on the lowered program."""

import collections
import gc
import re
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import GPT, GPTConfig, KVCache, backends, generate, init_params, sampling
from jaxgpt.attention import einsum_attention
from jaxgpt.backends import PORTABLE, DecodeWeights, cpu, native
from jaxgpt.ops import linear
from jaxgpt.training.step import cross_entropy
from tests.helpers import run_for_marches, varied_params
from tests.xla_flags import AS_USERS_COMPILE

AVX512 = frozenset({"avx512f", "avx512bw", "avx2", "fma"})
AVX2 = frozenset({"avx2", "fma"})


def test_auto_picks_the_cpu_backend_on_a_cpu_and_the_environment_can_override(monkeypatch):
    monkeypatch.delenv("JAXGPT_KERNELS", raising=False)
    assert jax.default_backend() == "cpu"
    assert backends.resolve_name("auto") == "cpu" and backends.resolve_name("portable") == "portable"
    assert backends.resolve_name("auto", platform="metal") == "portable"
    assert backends.resolve("auto").name == "cpu" and backends.resolve("portable") is PORTABLE
    assert backends.resolve(GPTConfig(kernels="auto")).name == "cpu"
    monkeypatch.setenv("JAXGPT_KERNELS", "portable")
    assert backends.resolve_name("auto") == "portable" and backends.resolve_name("cpu") == "cpu"
    assert backends.resolve(GPTConfig(kernels="auto")) is PORTABLE
    assert backends.resolve(GPTConfig(kernels="cpu")).name == "cpu"
    monkeypatch.setenv("JAXGPT_KERNELS", "mps")
    with pytest.raises(ValueError, match="JAXGPT_KERNELS"):
        backends.resolve_name("auto")
    monkeypatch.delenv("JAXGPT_KERNELS")
    with pytest.raises(ValueError, match="kernels must be one of"):
        backends.resolve_name("mps")
    for bad in (123, None, {"kernels": "cpu"}):  # (123 raised AttributeError: 'int' object has no attribute)
        with pytest.raises(TypeError, match="resolve takes a GPTConfig or a backend name"):
            backends.resolve(bad)
    # the accelerator backends, picked by the platform the programs run on (interpreted off it)
    assert backends.resolve_name("auto", platform="tpu") == "tpu" == backends.resolve("auto", "tpu").name
    assert backends.resolve_name("auto", platform="gpu") == "gpu" == backends.resolve("auto", "cuda").name
    assert backends.resolve("tpu", "tpu") != backends.resolve("tpu") == backends.resolve("tpu", "cpu")


def test_the_cpu_backend_uses_its_native_kernels_on_avx512_and_the_serving_ones_on_avx2(monkeypatch):
    monkeypatch.delenv("JAXGPT_NATIVE", raising=False)
    on, off = backends.cpu_backend(AVX512), backends.cpu_backend(AVX2)
    assert on.name == off.name == "cpu" and on != off
    assert on.prepare_decode.keywords == {"native_decode": True}
    # on AVX2 the w8a8 matmul, paged attention and the float32 decode matmul (up to 64 rows, its AVX2 form)
    # stay native (they beat XLA's forms there too)
    assert off.prepare_decode.keywords == {"native_decode": False, "native_w8a8": True, "float_rows": 64}
    assert on.paged_attention is off.paged_attention is cpu.native_paged_attention
    assert on.cache_attention is cpu.native_cache_attention and off.cache_attention is None
    assert dict(on.attention_kernels)["dot_product"].keywords == {"native_attention": True}
    assert dict(off.attention_kernels)["dot_product"].keywords == {"native_attention": False}
    assert backends.cpu_backend(AVX512) is on  # one value per choice: jitted callers are not retraced
    assert cpu.native_kernels_pay(AVX512) and not cpu.native_kernels_pay(AVX2)
    assert cpu.native_serving_kernels_pay(AVX512) and cpu.native_serving_kernels_pay(AVX2)
    bare = backends.cpu_backend(frozenset({"sse2", "avx"}))  # neither: XLA's forms everywhere
    assert bare.prepare_decode.keywords == {"native_decode": False} and bare.paged_attention is None
    # what the choice does: decode kernels packed in panels (with the kernel built) or [out, in]
    params = {"c_fc": {"kernel": jnp.ones((8, 32))}}
    form = "panels" if native.available() else "out_in"
    assert on.prepare_decode(params, 4, jnp.float32, False)["c_fc"]["kernel"].form == form
    assert on.prepare_decode(params, 32, jnp.float32, False) == {}  # AVX-512: panels up to 16 rows
    for rows in (1, 4, 32, 64):  # (without the kernel built: [out, in] up to 16 rows, else XLA's as stored)
        got = off.prepare_decode(params, rows, jnp.float32, False)
        assert (got["c_fc"]["kernel"].form if got else None) == (form if native.available() or rows == 4 else None)
    assert off.prepare_decode(params, 65, jnp.float32, False) == {}  # past 64 rows: XLA's matmul as stored
    assert cpu.native_float_rows(AVX512) == 16 and cpu.native_float_rows(AVX2) == 64
    assert cpu.native_float_rows(frozenset({"sse2", "avx"})) == 0
    # bf16 matmuls in hardware: AVX512_BF16 or AMX-BF16 (no flags at all: not Linux, no change on a guess)
    assert not cpu.has_bf16_matmul(frozenset({"avx2"}))
    assert not cpu.has_bf16_matmul(AVX512)
    assert cpu.has_bf16_matmul(frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert cpu.has_bf16_matmul(frozenset({"amx_bf16"})) and cpu.has_bf16_matmul(frozenset())
    assert not on.fast_bf16 and not off.fast_bf16  # a bf16 run says it computes in float32 on these
    assert backends.cpu_backend(AVX512 | {"avx512_bf16"}).fast_bf16
    monkeypatch.setenv("JAXGPT_NATIVE", "0")  # switched off: XLA's forms on AVX2 too
    assert backends.cpu_backend(AVX2).prepare_decode.keywords == {"native_decode": False}


# ---------------------------------------------------------------------------------------------------
# Each CPU backend function against its portable counterpart

@pytest.mark.parametrize("rows", [1, 2, 8, cpu.SMALL_ROWS, cpu.SMALL_ROWS + 1])
@pytest.mark.parametrize("w_out_in", [False, True])
def test_cpu_linear_equals_portable_values_and_grads(rows, w_out_in):
    kx, kw, kd = jax.random.split(jax.random.key(rows), 3)
    x = jax.random.normal(kx, (rows, 1, 48))
    w = jax.random.normal(kw, (40, 48) if w_out_in else (48, 40)) * 0.1
    d = jax.random.normal(kd, (rows, 1, 40))

    def loss(fn):
        return lambda x, w: jnp.sum(jnp.tanh(fn(x, w, jnp.float32, w_out_in=w_out_in)) * d)

    np.testing.assert_allclose(cpu.linear(x, w, w_out_in=w_out_in), linear(x, w, w_out_in=w_out_in),
                               rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.grad(loss(cpu.linear), (0, 1))(x, w), jax.grad(loss(linear), (0, 1))(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    jaxpr = jax.make_jaxpr(lambda x, w: cpu.linear(x, w, w_out_in=w_out_in))(x, w).jaxpr
    prims = {e.primitive.name for e in _primitives(jaxpr)}
    few = w_out_in and 1 < rows <= cpu.SMALL_ROWS
    assert ("dot_general" in prims) != few, prims  # 2..16 rows against [out, in]: multiply-and-sum


def test_cpu_few_rows_rounds_operands_to_the_compute_dtype_and_sums_in_float32_and_bf16_takes_the_matmul():
    kx, kw = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (4, 64))
    w = jax.random.normal(kw, (32, 64))
    got = cpu._few_rows(x, w, jnp.bfloat16)
    xb, wb = x.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_allclose(got, jnp.dot(xb, wb.T, precision="highest"), rtol=1e-5, atol=1e-4)
    assert float(jnp.abs(got - x @ w.T).max()) > 1e-3  # the bf16 rounding did happen
    # in bf16 XLA:CPU's matmul is the faster path: linear takes it, and decode keeps the kernels [in, out]
    np.testing.assert_allclose(cpu.linear(x, w, jnp.bfloat16, w_out_in=True, out_dtype=jnp.float32), got,
                               rtol=1e-5, atol=1e-4)
    jaxpr = jax.make_jaxpr(lambda x, w: cpu.linear(x, w, jnp.bfloat16, w_out_in=True))(x, w).jaxpr
    assert "dot_general" in {e.primitive.name for e in _primitives(jaxpr)}
    params = {"c_fc": {"kernel": w.T}}
    for native_decode in (True, False):
        assert cpu.decode_form(4, jnp.float32, native_decode) in ("panels", "out_in")
        assert cpu.decode_form(4, jnp.bfloat16, native_decode) is None
        assert cpu.prepare_decode(params, 4, jnp.bfloat16, False, native_decode=native_decode) == {}
        prepared = cpu.prepare_decode(params, 4, jnp.float32, False, native_decode=native_decode)
        assert prepared["c_fc"]["kernel"].form in ("panels", "out_in") and prepared["c_fc"]["kernel"].features == 32
    assert cpu.decode_form(4, jnp.float32, False) == "out_in"


def test_prepared_kernels_mirror_the_params_and_multiply_like_the_stored_ones():
    # the "prepared" collection: every dense kernel (stacked ones under h too) and a tied head's table
    kw, kx = jax.random.split(jax.random.key(4))
    w = jax.random.normal(kw, (48, 40))
    table = jax.random.normal(kw, (40, 48))
    params = {"wte": {"embedding": table}, "h_0": {"mlp": {"c_fc": {"kernel": w, "bias": jnp.zeros(40)}}},
              "h": {"attn": {"c_attn": {"kernel": jnp.stack([w, 2 * w])}}}, "ln_f": {"scale": jnp.ones(48)}}
    x = jax.random.normal(kx, (3, 48))
    for native_decode in (True, False):
        prepared = cpu.prepare_decode(params, 3, jnp.float32, True, native_decode=native_decode)
        assert set(prepared) == {"head", "h_0", "h"}
        assert set(prepared["h_0"]["mlp"]["c_fc"]) == {"kernel"}
        for got, want in ((prepared["h_0"]["mlp"]["c_fc"]["kernel"], x @ w), (prepared["head"], x @ table.T)):
            np.testing.assert_allclose(cpu.linear(x, got), want, rtol=1e-5, atol=1e-4)
        stacked = prepared["h"]["attn"]["c_attn"]["kernel"]
        one = jax.tree.map(lambda a: a[1], stacked)
        np.testing.assert_allclose(cpu.linear(x, one), x @ (2 * w), rtol=1e-5, atol=1e-4)
    assert cpu.prepare_decode(params, 3, jnp.float32, False, native_decode=False).keys() == {"h_0", "h"}


def _dot_operand_dtypes(hlo: str) -> list:
    """(lhs, rhs) element types of every dot in an optimized HLO module's text (fusion bodies included)."""
    types = dict(re.findall(r"%([\w.-]+) = (\w+)\[", hlo))
    return [(types[a], types[b]) for a, b in re.findall(r" dot\(%([\w.-]+), %([\w.-]+)\)", hlo)]


@pytest.mark.parametrize("w_out_in", [False, True])
def test_cpu_linear_in_bf16_multiplies_bf16_operands_in_the_compiled_backward(w_out_in):
    # XLA:CPU runs a bf16 matmul whose operand is read transposed (the weight gradient x.T @ dy) as a
    # float32 one; the CPU backend hands it a row-major copy of the transpose instead (backends/cpu.py)
    kx, kw, kd = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (4, 16, 48))
    w = jax.random.normal(kw, (40, 48) if w_out_in else (48, 40)) * 0.1
    d = jax.random.normal(kd, (4, 16, 40))

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w, jnp.bfloat16, w_out_in=w_out_in, out_dtype=jnp.float32) * d)

    grads = jax.jit(jax.grad(loss(cpu.linear), (0, 1)))
    for a, b in zip(grads(x, w), jax.jit(jax.grad(loss(linear), (0, 1)))(x, w)):
        assert a.dtype == jnp.float32 and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # the same bf16 products, float32 sums
    dots = _dot_operand_dtypes(grads.lower(x, w).compile(AS_USERS_COMPILE).as_text())
    assert len(dots) == 2 and all(dt == ("bf16", "bf16") for dt in dots), dots  # dx and dw


def test_cpu_backend_keeps_a_bf16_models_activations_in_float32():
    # XLA:CPU has no bf16 arithmetic outside matmuls: with the CPU backend only the dense layers' operands
    # are bf16; the portable backend carries its activations in bf16 (what accelerators want)
    assert cpu.make_backend(True, True).activation_dtype(jnp.bfloat16) == jnp.float32
    assert PORTABLE.activation_dtype(jnp.bfloat16) == jnp.bfloat16

    def bf16_ops(kernel_set):
        cfg = GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=32, dtype="bfloat16",
                        kernels=kernel_set)
        params = init_params(cfg, jax.random.key(0))
        tokens = jnp.zeros((2, 16), jnp.int32)
        loss = lambda p: cross_entropy(GPT(cfg).apply({"params": p}, tokens), tokens)  # noqa: E731
        eqns = _primitives(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
        dense = [e for e in eqns if e.primitive.name == "dot_general"
                 and all(v.aval.dtype == jnp.bfloat16 for v in e.invars)]
        moved = {"convert_element_type", "reshape", "transpose", "dot_general", "custom_vjp_call", "pjit", "jit"}
        arithmetic = {e.primitive.name for e in eqns if e.primitive.name not in moved
                      and any(getattr(v.aval, "dtype", None) == jnp.bfloat16 for v in e.outvars)}
        return len(dense), arithmetic

    dense, arithmetic = bf16_ops("cpu")
    assert dense >= 3 * (2 * 4 + 1), dense  # every dense layer's forward, dx and dw (and the tied head)
    assert not arithmetic, arithmetic
    assert bf16_ops("portable")[1] >= {"add", "mul"}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("layer", [None, 1])
def test_cpu_cache_write_equals_the_portable_one_and_writes_bf16_rows_in_place_in_16_bits(layer, dtype):
    # XLA:CPU computes a bf16 dynamic_update_slice in float32 over the whole buffer; written as uint16 bits
    b, t, kh, s, h = 3, 2, 2, 10, 8
    rows_layout = cpu.RowsCacheLayout()
    assert rows_layout.shape(b, kh, s, h) == (b * kh, s, h)
    shape = (b * kh, s, h) if layer is None else (2, b * kh, s, h)
    buf = jax.random.normal(jax.random.key(0), shape).astype(dtype)
    new = jax.random.normal(jax.random.key(1), (b, kh, t, h))
    lengths = jnp.array([0, 3, 8], jnp.int32)
    write = jax.jit(lambda buf, new, lengths: rows_layout.write(buf, new, lengths, layer))
    written = write(buf, new, lengths)
    assert written.dtype == dtype and written.shape == shape
    got = np.asarray(written.astype(jnp.float32))
    want = np.array(buf.astype(jnp.float32))
    rows = want if layer is None else want[layer]
    for r in range(b):
        for k in range(kh):
            rows[r * kh + k, int(lengths[r]):int(lengths[r]) + t] = np.asarray(new[r, k].astype(dtype), np.float32)
    np.testing.assert_array_equal(got, want)
    # the same values as the portable layout's scatter into [B, K, S, H], read back as [B, K, S, H]
    as_bkSh = lambda a: a.reshape(*a.shape[:-3], b, kh, s, h)  # noqa: E731
    portable = PORTABLE.cache_layout.write(as_bkSh(buf), new, lengths, layer)
    read = rows_layout.read(written if layer is None else written[layer], b)
    np.testing.assert_array_equal(np.asarray(read.astype(jnp.float32)),
                                  np.asarray((portable if layer is None else portable[layer]).astype(jnp.float32)))
    if dtype == jnp.bfloat16:
        hlo = write.lower(buf, new, lengths).compile(AS_USERS_COMPILE).as_text()
        assert f"f32[{','.join(map(str, shape))}]" not in hlo  # no float32 copy of the buffer


@pytest.mark.parametrize("scan", [False, True])
def test_a_kv_cache_in_the_cpu_layout_holds_what_the_portable_layout_holds(scan):
    cfg = GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, scan_layers=scan)
    layout = backends.cpu_backend().cache_layout
    assert isinstance(layout, cpu.RowsCacheLayout)
    rows, flat = KVCache.create(cfg, 3, 8, layout=layout), KVCache.create(cfg, 3, 8)
    assert rows.k[0].shape == (3 * 2, 8, 8) and flat.k[0].shape == (3, 2, 8, 8)
    k, v = jax.random.normal(jax.random.key(0), (2, 3, 2, 5, 8))
    got = [c.advance(jnp.array([0, 1, 3])).write(1, k, v).layer(1) for c in (rows, flat)]
    for a, b in zip(*got):
        assert a.shape == b.shape == (3, 2, 8, 8)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(got[0][0][1, :, 1:6]), np.asarray(k[1]))  # row 1 at its length


@pytest.mark.parametrize("t,block,kv_heads", [(6, 64, 4), (7, 3, 2), (16, 4, 1)])
def test_cpu_block_attention_equals_the_reference_values_and_grads(t, block, kv_heads):
    kq, kk, kv, kd = jax.random.split(jax.random.key(t), 4)
    q = jax.random.normal(kq, (2, t, 4, 8))
    k, v = jax.random.normal(kk, (2, kv_heads, t, 8)), jax.random.normal(kv, (2, kv_heads, t, 8))
    d = jax.random.normal(kd, q.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * d)

    def values_and_grads(fn):  # one compiled program each (op by op, the block loop costs seconds)
        return jax.jit(lambda q, k, v: (fn(q, k, v), jax.grad(loss(fn), (0, 1, 2))(q, k, v)))(q, k, v)

    out, grads = values_and_grads(lambda q, k, v: cpu.blocked_causal_attention(q, k, v, block))
    ref_out, ref_grads = values_and_grads(einsum_attention)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("t,s,kv_heads", [(1, 9, 2), (4, 9, 1), (3, 6, 4)])
def test_cpu_cached_attention_equals_the_reference(t, s, kv_heads):
    kq, kk, kv = jax.random.split(jax.random.key(t + s), 3)
    q = jax.random.normal(kq, (3, t, 4, 8))
    k, v = jax.random.normal(kk, (3, kv_heads, s, 8)), jax.random.normal(kv, (3, kv_heads, s, 8))
    lengths = jnp.array([t, s - 1, s], jnp.int32)
    positions = lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
    want = einsum_attention(q, k, v, positions, lengths)
    np.testing.assert_allclose(cpu.cached_attention(q, k, v, positions, lengths), want, rtol=1e-5, atol=1e-5)
    backend = backends.cpu_backend()
    got = backend.attention("dot_product")(q, k, v, positions, lengths)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# one query (a decode step) and several (a speculative step), grouped queries, head sizes 16..128, rows of
# one filled position up to the whole buffer, a buffer length off the kernel's 16-float vectors
@pytest.mark.parametrize("b,t,n,kh,s,h", [(3, 1, 4, 4, 50, 64), (2, 5, 8, 2, 37, 32), (4, 1, 6, 1, 19, 16),
                                          (1, 16, 2, 1, 40, 128), (2, 3, 3, 3, 33, 48)])
def test_native_cached_attention_equals_the_reference_and_reads_only_the_visible_positions(native_kernel, b, t, n,
                                                                                           kh, s, h):
    kq, kk, kv, kl = jax.random.split(jax.random.key(b * s + h), 4)
    q = jax.random.normal(kq, (b, t, n, h))
    k, v = jax.random.normal(kk, (b, kh, s, h)), jax.random.normal(kv, (b, kh, s, h))
    lengths = jnp.concatenate([jnp.array([t, s], jnp.int32), jax.random.randint(kl, (b,), t, s + 1)])[:b]
    positions = lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
    got = jax.jit(native.cached_attention)(q, k, v, positions, lengths)
    np.testing.assert_allclose(got, einsum_attention(q, k, v, positions, lengths), rtol=1e-5, atol=1e-5)
    past = jnp.arange(s)[None, None, :, None] >= lengths[:, None, None, None]  # positions no query sees
    noisy = [jnp.where(past, jnp.nan, a) for a in (k, v)]
    np.testing.assert_array_equal(jax.jit(native.cached_attention)(q, *noisy, positions, lengths), got)


@pytest.mark.parametrize("b,t,n,kh,s,h", [(3, 1, 4, 4, 50, 64), (2, 5, 8, 2, 37, 32)])
def test_native_int8_cached_attention_equals_the_reference_over_the_dequantized_cache(native_kernel, b, t, n, kh, s,
                                                                                       h):
    from jaxgpt.cache import dequantize_kv, quantize_kv

    kq, kk, kv = jax.random.split(jax.random.key(s), 3)
    q = jax.random.normal(kq, (b, t, n, h))
    (k8, ks), (v8, vs) = (quantize_kv(jax.random.normal(key, (b, kh, s, h))) for key in (kk, kv))
    lengths = jnp.array([s, t, s // 2][:b], jnp.int32)
    positions = lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
    got = jax.jit(native.cached_attention_int8)(q, k8, v8, ks, vs, positions, lengths)
    want = einsum_attention(q, dequantize_kv(k8, ks), dequantize_kv(v8, vs), positions, lengths)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,target", [("float32", "jaxgpt_cached_attention"),
                                          ("int8", "jaxgpt_cached_attention_int8")])
def test_a_cache_is_attended_as_stored_by_the_native_kernel_only_when_it_is_on(native_cpu, monkeypatch, dtype, target):
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=64)
    params = init_params(cfg, jax.random.key(0))
    tokens = jnp.ones((2, 1), jnp.int32)
    for on in (True, False):
        _native(monkeypatch, on)
        backend = backends.cpu_backend()
        cache = KVCache.create(cfg, 4, 16, dtype=dtype, layout=backend.cache_layout)
        for c in (cache.view_first(2), cache.first(2)):  # a view of 4 rows' buffers, and 2 rows of their own
            fn = jax.jit(lambda p, c: GPT(cfg, backend).apply({"params": p}, tokens, c))
            assert (f"@{target}(" in fn.lower(params, c).as_text()) == on


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_decoding_the_first_rows_through_a_view_equals_decoding_them_alone(native_cpu, monkeypatch, dtype):
    """A view of the first rows over the whole cache's buffers (as the engine decodes its first slots):
    the same logits as those rows in a cache of their own, with the kernels on and off; the other rows'
    keys and values untouched."""
    cfg = GPTConfig(vocab_size=32, block_size=24, n_layer=2, n_head=4, n_embd=64, n_kv_head=2)
    params = varied_params(cfg)
    prompts = jax.random.randint(jax.random.key(1), (4, 6), 0, 32)
    for on in (True, False):
        _native(monkeypatch, on)
        model = GPT(cfg, backends.cpu_backend())
        cache = KVCache.create(cfg, 4, 24, dtype=dtype, layout=model.backend.cache_layout)
        _, cache = jax.jit(model.apply)({"params": params}, prompts, cache)
        nxt = jnp.array([[3], [7]], jnp.int32)
        got, view = jax.jit(model.apply)({"params": params}, nxt, cache.view_first(2))
        alone, _ = jax.jit(model.apply)({"params": params}, nxt, cache.first(2))
        np.testing.assert_allclose(got, alone, rtol=1e-5, atol=1e-5)
        merged = cache.merge_view(view)
        assert merged.batch_size == 4 and merged.lengths.tolist() == [7, 7, 6, 6]
        for a, b in zip(jax.tree.leaves(merged.slot(2, 2)), jax.tree.leaves(cache.slot(2, 2))):
            np.testing.assert_array_equal(a, b)


def test_cpu_attention_keeps_scores_in_float32_for_bf16():
    from tests.test_attention import float32_softmax_case

    q, k, v, weights = float32_softmax_case()  # k, v [B, K, S, H]
    qb, kb, vb = (a.astype(jnp.bfloat16) for a in (q, k, v))
    out = cpu.cached_attention(qb, kb, vb, jnp.array([[3]]), jnp.array([4]))
    np.testing.assert_allclose(np.asarray(out[0, 0, 0, :4], np.float32), weights, atol=1e-2)
    qb4 = jnp.concatenate([jnp.zeros((1, 3, 1, 64), jnp.bfloat16), qb], axis=1)  # the query at position 3
    for native_attention in (True, False):
        out = cpu.dot_product_attention(qb4, kb, vb, native_attention=native_attention)
        assert out.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(out[0, 3, 0, :4], np.float32), weights, atol=1e-2)
    out = cpu.blocked_causal_attention(qb4, kb, vb)
    np.testing.assert_allclose(np.asarray(out[0, 3, 0, :4], np.float32), weights, atol=1e-2)


# ---------------------------------------------------------------------------------------------------
# The whole model: both backends give the same results

def _configs(**kw):
    base = dict(vocab_size=40, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    base.update(kw)
    return GPTConfig(kernels="portable", **base), GPTConfig(kernels="cpu", **base)


@pytest.mark.parametrize("tie,bias,scan", [(True, True, False), (False, False, False), (True, True, True)])
def test_logits_and_gradients_equal_between_backends(tie, bias, scan):
    portable, on_cpu = _configs(tie_embeddings=tie, bias=bias, scan_layers=scan)
    params = init_params(portable, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 20), 0, 40)

    def loss_and_logits(cfg):
        def f(p):
            logits = GPT(cfg).apply({"params": p}, tokens[:, :-1])
            return cross_entropy(logits, tokens[:, 1:]), logits
        return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

    (loss_a, logits_a), grads_a = loss_and_logits(portable)
    (loss_b, logits_b), grads_b = loss_and_logits(on_cpu)
    np.testing.assert_allclose(logits_b, logits_a, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def _native(monkeypatch, on: bool) -> None:
    """Decode with the native kernels (where they can be built and pay) or through XLA only: the CPU
    backend that `resolve` builds from here on reads JAXGPT_NATIVE."""
    monkeypatch.setenv("JAXGPT_NATIVE", "1" if on else "0")


# one row, the few rows (native panels, or XLA's [out, in] few-row sum), past them; the stacked layout
# once (its layers run the same kernels); past the few rows once (there the native switch changes no
# multiply: both are XLA's matmul)
@pytest.mark.parametrize("batch,scan,native_on", [(1, False, True), (1, False, False), (3, False, True),
                                                  (3, False, False), (17, False, True), (3, True, False)])
def test_generate_gives_the_same_tokens_with_both_backends(monkeypatch, batch, scan, native_on):
    _native(monkeypatch, native_on)
    portable, on_cpu = _configs(scan_layers=scan)
    params = varied_params(portable)
    prompts = np.asarray(jax.random.randint(jax.random.key(2), (batch, 5), 0, 40))
    lengths = 5 - np.arange(batch) % 5
    for kw in (dict(temperature=0.0), dict(temperature=1.0, top_k=10)):
        a = generate(params, portable, prompts, 9, jax.random.key(0), prompt_lengths=lengths, **kw)
        b = generate(params, on_cpu, prompts, 9, jax.random.key(0), prompt_lengths=lengths, **kw)
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens), err_msg=str(kw))
        np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
    new = [np.asarray(a.tokens)[r, n:n + 9].tolist() for r, n in enumerate(lengths)]
    assert len(set(sum(new, []))) > 3, new  # tokens that vary, so that a mismatch would show


# ---------------------------------------------------------------------------------------------------
# The native decode multiply (backends/native.py, backends/rows.cc)

@pytest.fixture
def native_kernel():
    if not native.available():
        pytest.skip(f"the native kernel cannot be built here: {native._state.get('why')}")


@pytest.fixture
def native_cpu(native_kernel):
    """The CPU backend chooses the native kernels only where they pay: CPUs with AVX-512."""
    if not cpu.native_kernels_pay(cpu.cpu_flags()):
        pytest.skip("the native kernels are used on CPUs with AVX-512 only")


@pytest.mark.parametrize("rows", [1, 3, 8, native.MAX_ROWS])
def test_native_rows_matmul_equals_a_float32_matmul_in_either_stored_layout(native_kernel, rows):
    kx, kw = jax.random.split(jax.random.key(rows))
    x = jax.random.normal(kx, (rows, 48))
    w = jax.random.normal(kw, (48, 40))  # 40 outputs: the last panel is partial
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    mul = jax.jit(native.rows_matmul, static_argnums=2)
    for panels in (native.pack(w), native.pack(w.T, w_out_in=True)):
        assert panels.shape == native.panels_shape(48, 40) == (3, 48, 16)
        np.testing.assert_allclose(mul(x, panels, 40), want, rtol=1e-5, atol=1e-5)
    for w_out_in, stored in ((False, w), (True, w.T), (False, jnp.stack([w, 2 * w]))):  # stacked kernels too
        np.testing.assert_array_equal(native.pack(stored, w_out_in), native.pack_reference(stored, w_out_in))
    np.testing.assert_array_equal(native.pack(jnp.stack([w, 2 * w]))[1], native.pack(2 * w))
    with pytest.raises(ValueError, match="rows_matmul"):
        native.rows_matmul(jnp.ones((native.MAX_FLOAT_ROWS + 1, 48)), native.pack(w), 40)
    with pytest.raises(ValueError, match="rows_matmul"):
        native.rows_matmul(x, native.pack(w), 56)  # panels for 33..48 outputs
    # the CPU backend's linear over a prepared panels kernel: the same multiply
    prepared = cpu.prepare_decode({"c_fc": {"kernel": w}}, rows, jnp.float32, False, native_decode=True)
    assert prepared["c_fc"]["kernel"].form == "panels"
    np.testing.assert_allclose(cpu.linear(x, prepared["c_fc"]["kernel"]), want, rtol=1e-5, atol=1e-5)


_FLOAT_ROWS_SCRIPT = """
import sys, numpy as np, jax, jax.numpy as jnp
from jaxgpt.backends import native
d = np.load(sys.argv[1])
f = jax.jit(native.rows_matmul, static_argnums=2)
ys = {"y" + n[1:]: np.asarray(f(jnp.asarray(d[n]), native.pack(jnp.asarray(d["w" + n[1:]])), d["w" + n[1:]].shape[1]))
      for n in d.files if n.startswith("x")}
np.savez(sys.argv[2], **ys)
"""


def test_the_float_decode_matmul_built_for_avx2_gives_this_cpus_bits(tmp_path):
    """The float32 decode matmul built for AVX2 without AVX-512 (-march=x86-64-v3: blocks of up to 6 rows in
    named registers) gives the bits of this CPU's own build (the generic 16-float form on AVX-512 CPUs: both
    sum each output in input order, one FMA an input) and a float64 product's values, at 1 to 64 rows (blocks
    of 6 or 16 and what is left) and with the last panel partial. Runs on any x86 CPU with AVX2 (another
    process per build)."""
    import platform
    if not native.available() or platform.machine() not in ("x86_64", "AMD64") or "avx2" not in cpu.cpu_flags():
        pytest.skip("needs the native kernels on an x86 CPU with AVX2")
    rng = np.random.default_rng(3)
    cases = [(1, 768, 100), (5, 48, 40), (6, 64, 16), (7, 300, 33), (16, 96, 48), (17, 768, 70), (40, 50, 7),
             (native.MAX_FLOAT_ROWS, 256, 130)]
    arrays = {}
    for i, (rows, n_in, out) in enumerate(cases):
        arrays[f"x{i}"] = rng.standard_normal((rows, n_in)).astype(np.float32)
        arrays[f"w{i}"] = rng.standard_normal((n_in, out)).astype(np.float32)
    results = run_for_marches(_FLOAT_ROWS_SCRIPT, tmp_path, arrays)
    for i in range(len(cases)):
        want = arrays[f"x{i}"].astype(np.float64) @ arrays[f"w{i}"].astype(np.float64)
        np.testing.assert_allclose(results["x86-64-v3"][f"y{i}"], want, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(results["x86-64-v3"][f"y{i}"], results["native"][f"y{i}"])


def _ffi_targets(jaxpr) -> collections.Counter:
    return collections.Counter(e.params["target_name"] for e in _primitives(jaxpr) if e.primitive.name == "ffi_call")


@pytest.mark.parametrize("tie", [True, False])
def test_generate_decodes_through_the_native_kernel_only_when_it_is_on(native_cpu, monkeypatch, tie):
    _, on_cpu = _configs(tie_embeddings=tie)
    params = varied_params(on_cpu)
    prompts = np.asarray(jax.random.randint(jax.random.key(2), (3, 5), 0, 40))
    tokens, packs, steps = {}, {}, {}
    for on in (True, False):
        _native(monkeypatch, on)
        tokens[on] = np.asarray(generate(params, on_cpu, prompts, 9, jax.random.key(0), temperature=0.0).tokens)
        _, prepare_jaxpr, generate_jaxpr = _generate_jaxprs(on_cpu, 3)
        packs[on], steps[on] = _ffi_targets(prepare_jaxpr), _ffi_targets(generate_jaxpr)
    np.testing.assert_array_equal(tokens[True], tokens[False])
    assert not packs[False] and not steps[False]
    # every dense layer of the decode step, and the head (tied or not): packed once per decoder, multiplied
    # per step (the prefill, 15 rows of one program, takes XLA's matmul)
    assert packs[True] == {native.PACK_TARGET: 2 * 4 + 1}
    assert steps[True] == {native.TARGET: 2 * 4 + 1}


def test_a_decoder_keeps_its_prepared_weights_across_calls_and_a_new_one_prepares_them_again(monkeypatch):
    _, on_cpu = _configs()
    params = varied_params(on_cpu)
    prompts = np.zeros((2, 3), np.int32)
    made = []
    prepare = sampling._prepare_jit

    def counting(*args, **kw):
        made.append(kw["batch_size"])
        return prepare(*args, **kw)

    monkeypatch.setattr(sampling, "_prepare_jit", counting)
    decoder = sampling.Decoder(params, on_cpu)
    assert decoder.backend.name == "cpu"
    first = decoder.generate(prompts, 4, jax.random.key(0), temperature=0.0).tokens
    weights = decoder.weights(2)
    assert isinstance(weights, DecodeWeights) and weights.prepared  # 2 float32 rows: kernels in a decode form
    again = decoder.generate(prompts, 4, jax.random.key(0), temperature=0.0).tokens
    streamed = np.concatenate(list(decoder.stream(prompts, 4, jax.random.key(0), chunk_size=3, temperature=0.0)), 1)
    assert decoder.weights(2) is weights and made == [2]  # not made again
    np.testing.assert_array_equal(again, first)
    np.testing.assert_array_equal(streamed, np.asarray(first)[:, 3:])
    # generate() builds a decoder per call: it prepares them each time, from the arrays it is given
    np.testing.assert_array_equal(generate(params, on_cpu, prompts, 4, jax.random.key(0), temperature=0.0).tokens,
                                  first)
    assert made == [2, 2]
    other = jax.tree.map(lambda x: x * 1.5, params)
    changed = generate(other, on_cpu, prompts, 4, jax.random.key(0), temperature=0.0).tokens
    assert made == [2, 2, 2] and not np.array_equal(changed, first)
    # another batch size: prepared for it (the decoder keeps the latest only)
    decoder.generate(np.zeros((3, 3), np.int32), 2, jax.random.key(0), temperature=0.0)
    assert made == [2, 2, 2, 3] and decoder.weights(3) is not weights
    # nothing global keeps them: gone with the decoder
    ref = weakref.ref(weights)
    del decoder, weights
    gc.collect()
    assert ref() is None


def test_without_a_compiler_the_cpu_backend_decodes_through_xla(monkeypatch, caplog):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("CXX", "no-such-compiler-for-jaxgpt")
    assert not native.available()
    assert "through XLA" in caplog.text and "no C++ compiler" in caplog.text
    params = {"c_fc": {"kernel": jnp.ones((8, 32))}}
    assert cpu.decode_form(4, jnp.float32, native_decode=True) == "out_in"
    assert cpu.prepare_decode(params, 1, jnp.float32, False, native_decode=True) == {}
    got = cpu.prepare_decode(params, 4, jnp.float32, False, native_decode=True)["c_fc"]["kernel"]
    assert got.form == "out_in" and got.w.shape == (32, 8) and got.features == 32
    q, k, v, _ = _attention_case(1, 12, 2, 1, 16)
    assert not native.attention_supported(q.shape, k.shape)
    out = cpu.dot_product_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2))  # XLA's blocks
    np.testing.assert_allclose(out, einsum_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2)), rtol=1e-5, atol=1e-5)
    # switched off (JAXGPT_NATIVE=0, read by cpu_backend): neither chosen nor even built, even on AVX-512
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("JAXGPT_NATIVE", "0")
    off = backends.cpu_backend(AVX512)
    assert off is backends.cpu_backend(AVX2) and off.prepare_decode.keywords == {"native_decode": False}
    assert off.paged_attention is None
    assert off.prepare_decode(params, 4, jnp.float32, False)["c_fc"]["kernel"].form == "out_in"
    off.attention("dot_product")(q, k.swapaxes(1, 2), v.swapaxes(1, 2), None, None)
    assert native._state == {}
    monkeypatch.setenv("JAXGPT_NATIVE", "1")
    assert backends.cpu_backend(AVX512).prepare_decode.keywords == {"native_decode": True}


# ---------------------------------------------------------------------------------------------------
# The native causal attention (backends/attention.cc): forward and backward

def _attention_case(b, t, n, kh, h, seed=0):
    """q [B,T,N,H], k, v [B,T,K,H] (native.causal_attention's layout; the registry's is k.swapaxes(1, 2))."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q, dout = jax.random.normal(keys[0], (b, t, n, h)), jax.random.normal(keys[3], (b, t, n, h))
    return q, jax.random.normal(keys[1], (b, t, kh, h)), jax.random.normal(keys[2], (b, t, kh, h)), dout


def _float64_attention(q, k, v, dout):
    """Output and (dq, dk, dv) of causal attention in float64 numpy: the reference for the native kernel."""
    q, k, v, dout = (np.asarray(a, np.float64) for a in (q, k, v, dout))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head n reads kv head n // g
    t, h = q.shape[1], q.shape[3]
    s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", p, v)
    dp = np.einsum("btnh,bsnh->bnts", dout, v)
    ds = p * (dp - np.einsum("btnh,btnh->bnt", dout, out)[..., None]) / np.sqrt(h)
    dq = np.einsum("bnts,bsnh->btnh", ds, k)
    dk = np.einsum("bnts,btnh->bsnh", ds, q)
    dv = np.einsum("bnts,btnh->bsnh", p, dout)
    fold = lambda a: a.reshape(*a.shape[:2], -1, g, h).sum(3)  # noqa: E731  (back onto the kv heads)
    return out, (dq, fold(dk), fold(dv))


# T off every tile size (8, 32, 64) and on them; one query block and several; grouped queries (2 and 4 query
# heads per kv head); each head size class of the kernel's tiles (16: 8 rows, 48: 4 rows, 64, 128: 2 rows)
@pytest.mark.parametrize("b,t,n,kh,h", [(2, 70, 4, 2, 32), (1, 7, 2, 2, 16), (3, 130, 6, 6, 64),
                                        (2, 64, 4, 1, 48), (1, 200, 2, 2, 128), (2, 33, 2, 2, 80)])
def test_native_attention_equals_float64_attention_values_and_grads(native_kernel, b, t, n, kh, h):
    q, k, v, dout = _attention_case(b, t, n, kh, h)
    out, vjp = jax.jit(lambda q, k, v: jax.vjp(native.causal_attention, q, k, v))(q, k, v)
    grads = jax.jit(vjp)(dout)
    want_out, want_grads = _float64_attention(q, k, v, dout)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=2e-5)
    for name, got, want in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=5e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("n,kh,h", [(4, 2, 32), (2, 2, 64), (6, 1, 16)])
def test_cpu_backend_attention_equals_float64_attention_through_the_native_kernel_and_xla(native_cpu, monkeypatch,
                                                                                           n, kh, h):
    # the CPU backend's entry point (the registry's layout, k and v [B, K, T, H]): the same values and
    # gradients through the native kernel (JAXGPT_NATIVE=1 on AVX-512) and through XLA's blocks
    b, t = 2, 45
    q, k, v, dout = _attention_case(b, t, n, kh, h, seed=n)
    kr, vr = k.swapaxes(1, 2), v.swapaxes(1, 2)
    want_out, want_grads = _float64_attention(q, k, v, dout)
    for on in (True, False):
        _native(monkeypatch, on)
        attend = backends.cpu_backend().attention("dot_product")
        fn = jax.jit(lambda q, k, v: attend(q, k, v, None, None))  # a new function: traced again
        assert ("jaxgpt_causal_attention" in fn.lower(q, kr, vr).as_text()) == on
        out, vjp = jax.vjp(fn, q, kr, vr)
        np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=2e-5)
        dq, dk, dv = vjp(dout)
        for name, got, want in zip("qkv", (dq, dk.swapaxes(1, 2), dv.swapaxes(1, 2)), want_grads):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=5e-5, err_msg=f"d{name} native={on}")


def test_native_attention_is_causal_and_batched_rows_are_independent(native_kernel):
    q, k, v, _ = _attention_case(3, 40, 4, 2, 32, seed=1)
    out = native.causal_attention(q, k, v)
    changed = native.causal_attention(q, k.at[:, 25:].add(3.0), v.at[:, 25:].add(3.0))
    np.testing.assert_array_equal(out[:, :25], changed[:, :25])  # the future cannot move the past
    assert not np.allclose(out[:, 25:], changed[:, 25:])
    alone = native.causal_attention(q[1:2], k[1:2], v[1:2])
    np.testing.assert_array_equal(out[1:2], alone)
    stacked = jax.vmap(native.causal_attention)(q[None].repeat(2, 0), k[None].repeat(2, 0), v[None].repeat(2, 0))
    np.testing.assert_array_equal(stacked[1], out)


def test_cpu_attention_runs_the_native_kernel_for_the_head_sizes_it_has(native_cpu, monkeypatch):
    def targets(h, on=True):
        _native(monkeypatch, on)
        attend = backends.cpu_backend().attention("dot_product")
        q, k, v, dout = _attention_case(1, 12, 2, 1, h)
        k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
        fn = lambda q, k, v: attend(q, k, v, None, None)  # noqa: E731
        jaxpr = jax.make_jaxpr(lambda q, k, v: jax.vjp(fn, q, k, v)[1](dout))(q, k, v)
        return set(_ffi_targets(jaxpr.jaxpr))

    both = {native.ATTENTION_TARGET, native.ATTENTION_BWD_FUSED_TARGET}
    assert targets(16) == targets(64) == targets(128) == both
    assert targets(8) == targets(24) == targets(144) == set()  # no compiled kernel: XLA's blocks
    assert targets(64, on=False) == set()
    assert not native.attention_supported((1, 12, 3, 64), (1, 12, 2, 64))  # 3 query heads on 2 kv heads


# a head size the native kernel takes (16), scanned layers and not; the attention custom calls are in the
# compiled train step, so the native forward and backward are what is compared
@pytest.mark.parametrize("scan", [False, True])
def test_train_gradients_equal_between_backends_through_the_native_attention(native_cpu, monkeypatch, scan):
    monkeypatch.delenv("JAXGPT_NATIVE", raising=False)
    portable, on_cpu = _configs(n_embd=64, scan_layers=scan)
    params = init_params(portable, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 30), 0, 40)

    def loss(cfg):
        return jax.jit(jax.value_and_grad(
            lambda p: cross_entropy(GPT(cfg).apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])))

    targets = set(re.findall(r"jaxgpt_\w+", loss(on_cpu).lower(params).as_text()))
    assert targets == {native.ATTENTION_TARGET, native.ATTENTION_BWD_FUSED_TARGET}
    # the kernel reads the fused q/k/v projection in place and writes its gradient so: XLA folds the
    # backend's join of the model's q, k, v back into the projection, and no slice of it is copied out
    compiled = loss(on_cpu).lower(params).compile(AS_USERS_COMPILE).as_text()
    assert not re.findall(r"= \S+ (slice|concatenate)\(\S*c_attn", compiled)
    assert not [line for line in compiled.splitlines() if re.search(r"= f32\S* slice\(", line)]
    assert not re.findall(r"jaxgpt_\w+", loss(portable).lower(params).as_text())
    (loss_a, grads_a), (loss_b, grads_b) = loss(portable)(params), loss(on_cpu)(params)
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("opt_out", [False, True])
def test_inline_cpu_dispatch_takes_effect_only_before_the_first_computation(opt_out):
    import os
    import subprocess
    import sys

    code = ("import jax\n"
            "from jaxgpt.backends import cpu\n"
            "first = cpu.inline_cpu_dispatch()\n"
            "flag = jax.config.values[\"jax_cpu_enable_async_dispatch\"]\n"
            "jax.numpy.ones(3).block_until_ready()\n"
            "print(first, flag, cpu.inline_cpu_dispatch(), cpu.cpu_dispatch())\n")
    env = {k: v for k, v in os.environ.items() if k != "JAXGPT_CPU_ASYNC"}
    if opt_out:
        env["JAXGPT_CPU_ASYNC"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # taken before any computation (and the flag set); never after one, nor when JAXGPT_CPU_ASYNC=1
    want = "False True False async" if opt_out else "True False False inline"
    assert out.stdout.split("\n")[-2] == want


# ---------------------------------------------------------------------------------------------------
# Structure of the portable program: what makes it fit accelerators

def _count_eqns(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _count_eqns(inner)
    return n


def _primitives(jaxpr) -> list:
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _primitives(inner)
    return out


def _decode_step_ops(cfg, batch):
    backend = backends.resolve(cfg)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    cache = jax.eval_shape(lambda: KVCache.create(cfg, batch, 16, layout=backend.cache_layout))
    tok = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    model = GPT(cfg, backend)
    return _count_eqns(jax.make_jaxpr(lambda p, c, t: model.apply({"params": p}, t, c))(params, cache, tok).jaxpr)


def test_decode_step_op_count_does_not_depend_on_the_batch():
    portable, on_cpu = _configs()
    assert _decode_step_ops(portable, 1) == _decode_step_ops(portable, 8)
    assert _decode_step_ops(on_cpu, 8) > _decode_step_ops(on_cpu, 1)  # the CPU backend writes row by row


def _forward_ops(cfg, t):
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    x = jax.ShapeDtypeStruct((2, t), jnp.int32)
    return _count_eqns(jax.make_jaxpr(lambda p, x: GPT(cfg).apply({"params": p}, x))(params, x).jaxpr)


def test_training_forward_op_count_does_not_depend_on_the_sequence_length(monkeypatch):
    _native(monkeypatch, False)  # XLA's blocks (the native kernel is one call whatever T)
    portable, on_cpu = _configs(block_size=512)
    assert _forward_ops(portable, 128) == _forward_ops(portable, 512)
    assert _forward_ops(on_cpu, 512) > _forward_ops(on_cpu, 128)  # the CPU backend loops over query blocks


def _generate_jaxprs(cfg, batch):
    """The params, and the jaxprs of a decoder's two programs: preparing the decode weights (once per
    decoder and batch size) and a generate call given them."""
    backend = backends.resolve(cfg)
    params = init_params(cfg, jax.random.key(0))
    prompts, lengths = jnp.zeros((batch, 4), jnp.int32), jnp.full((batch,), 4, jnp.int32)
    s = sampling.Sampler(1.0, 5, None, None, 0)
    prepare = lambda p: sampling._prepare_jit(p, config=cfg, backend=backend, batch_size=batch)  # noqa: E731
    prepared = jax.eval_shape(prepare, params)
    fn = lambda w, x, n, key: sampling._generate(w, x, n, key, config=cfg, backend=backend, max_new_tokens=6,  # noqa
                                                 sampler=s)
    generate_jaxpr = jax.make_jaxpr(fn)(DecodeWeights(params, prepared), prompts, lengths, jax.random.key(0)).jaxpr
    return params, jax.make_jaxpr(prepare)(params).jaxpr, generate_jaxpr


@pytest.mark.parametrize("scan", [False, True])
def test_generate_neither_transposes_nor_copies_the_parameters_per_call(monkeypatch, scan):
    portable, on_cpu = _configs(scan_layers=scan)
    for cfg, batch, native_on in ((portable, 1, True), (portable, 4, True), (on_cpu, 1, True), (on_cpu, 4, True),
                                  (on_cpu, 1, False), (on_cpu, 4, False)):
        _native(monkeypatch, native_on)
        params, prepare_jaxpr, jaxpr = _generate_jaxprs(cfg, batch)
        weight_shapes = {tuple(x.shape) for x in jax.tree.leaves(params) if x.ndim >= 2}
        moved = [e for e in _primitives(jaxpr) if e.primitive.name in ("transpose", "concatenate", "copy")
                 and any(tuple(v.aval.shape) in weight_shapes for v in e.outvars)]
        assert not moved, [str(e)[:120] for e in moved]
        backend = backends.resolve(cfg)
        kw = backend.prepare_decode.keywords if backend.prepare_decode is not PORTABLE.prepare_decode else {}
        float_rows = kw.get("float_rows", cpu.SMALL_ROWS if kw.get("native_decode") else 0)  # (64 on AVX2)
        native_decode = float_rows >= batch and native.available()
        kernels = (4 if scan else 2 * 4) + 1  # dense layers (stacked: one [L, ...] kernel each) and the head
        packs = _ffi_targets(prepare_jaxpr)[native.PACK_TARGET]
        transposes = [e for e in _primitives(prepare_jaxpr) if e.primitive.name == "transpose"]
        if cfg.kernels == "portable" or (batch == 1 and not native_decode):
            assert not [e for e in _primitives(prepare_jaxpr) if e.primitive.name not in ("jit", "pjit")]
        elif native_decode:  # the CPU backend's decode form: each kernel packed once per decoder
            assert packs == kernels and not transposes, (packs, len(transposes))
        else:  # or transposed to [out, in] once per decoder (the tied table is [out, in] as stored)
            assert not packs and len(transposes) == kernels - 1, len(transposes)
