"""The int8 KV cache (`KVCache.create(..., dtype="int8")`): keys and values stored as int8 with a float32
scale per row, kv head and position, written in place, read back dequantized.

The cache is lossy, so decoding through it is compared with a full forward whose attention rounds its keys
and values the same way (`_ROUNDED`): those agree to float rounding, as a float cache agrees with the plain
full forward (tests/test_cache.py). Against the plain float forward the int8 cache is only close; the
bound below is what these tiny random models measured, with margin."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import GPT, GPTConfig, KVCache, cache_bytes, resolve
from jaxgpt.attention import dot_product_attention, register_attention
from jaxgpt.backends import cpu
from jaxgpt.cache import dequantize_kv, quantize_kv
from jaxgpt.registry import ATTENTION
from tests.helpers import STYLES, whole_buffer_copies
from tests.xla_flags import AS_USERS_COMPILE

_ROUNDED = "test_kv_int8_rounded"


def _rounded_attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT=None, kv_lengths_B=None):
    """The reference attention: keys and values rounded through int8 as the cache stores them."""
    k, v = (dequantize_kv(*quantize_kv(a), a.dtype) for a in (k_BxKxSxH, v_BxKxSxH))
    return dot_product_attention(q_BxTxNxH, k, v, q_positions_BxT, kv_lengths_B)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register_attention(_ROUNDED)(_rounded_attention)
    yield
    ATTENTION.unregister(_ROUNDED)


def _config(kernels="portable", n_kv_head=None, scan_layers=False, style="gpt2", block_size=24, **kw):
    return GPTConfig(vocab_size=50, block_size=block_size, n_layer=2, n_head=4, n_embd=32, n_kv_head=n_kv_head,
                     kernels=kernels, scan_layers=scan_layers, **STYLES[style], **kw)


def _int8_cache(cfg, batch_size, max_len):
    return KVCache.create(cfg, batch_size, max_len, dtype="int8", layout=resolve(cfg).cache_layout)


def _decode_all(cfg, variables, tokens, prompt_lengths):
    """Each row's (ragged) prompt prefilled into an int8 cache, then the rest fed one token at a time:
    logits [B, T, V] at every position of every row."""
    model = GPT(cfg)
    b, t = tokens.shape
    p = int(max(prompt_lengths))
    lengths = jnp.asarray(prompt_lengths, jnp.int32)
    prompt = jnp.where(jnp.arange(p)[None] < lengths[:, None], tokens[:, :p], 0)
    cache = _int8_cache(cfg, b, 2 * t - int(min(prompt_lengths)))
    logits, cache = jax.jit(model.apply)(variables, prompt, cache, token_lengths=lengths)
    got = np.zeros((b, t, cfg.vocab_size), np.float32)
    for r in range(b):
        got[r, :prompt_lengths[r]] = logits[r, :prompt_lengths[r]]
    step = jax.jit(lambda c, x: model.apply(variables, x, c))
    pos = np.array(prompt_lengths)
    while pos.min() < t:
        out, cache = step(cache, tokens[jnp.arange(b), jnp.minimum(pos, t - 1)][:, None])
        for r in range(b):
            if pos[r] < t:
                got[r, pos[r]] = out[r, 0]
        pos = pos + 1
    assert cache.quantized and np.array_equal(np.asarray(cache.lengths), pos)
    return got


@pytest.mark.parametrize("kernels", ["portable", "cpu"])
@pytest.mark.parametrize("n_kv_head,scan,style", [(None, False, "gpt2"), (2, True, "gpt2"), (1, False, "llama")])
def test_int8_cache_decoding_equals_the_full_forward_with_keys_and_values_rounded_alike(kernels, n_kv_head, scan,
                                                                                        style):
    cfg = _config(kernels, n_kv_head, scan, style)
    variables = jax.jit(GPT(cfg).init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    tokens = jax.random.randint(jax.random.key(1), (3, 12), 0, cfg.vocab_size)
    got = _decode_all(cfg, variables, tokens, [5, 1, 9])
    rounded = np.asarray(jax.jit(GPT(cfg.replace(attention=_ROUNDED)).apply)(variables, tokens))
    # measured at most 1.2e-7 (logits of order 0.5): float rounding, the float cache's bound (test_cache.py)
    np.testing.assert_allclose(got, rounded, atol=1e-5, rtol=0)
    # against the float forward: the int8 rounding itself, measured 2.6e-4 .. 4.1e-4 here
    full = np.asarray(jax.jit(GPT(cfg).apply)(variables, tokens))
    assert 0 < np.abs(got - full).max() < 3e-3
    assert (got.argmax(-1) == full.argmax(-1)).mean() > 0.9


def test_quantize_kv_rounds_each_vector_to_within_half_a_step():
    x = jax.random.normal(jax.random.key(0), (2, 3, 5, 16)) * jnp.array([1e-3, 1.0, 30.0])[None, :, None, None]
    x = x.at[0, 0, 0].set(0.0)  # an all-zero vector: scale 0, q 0
    q, scale = quantize_kv(x)
    assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
    np.testing.assert_allclose(np.asarray(scale), np.abs(np.asarray(x)).max(-1) / 127, rtol=1e-6)
    assert int(jnp.abs(q).max()) == 127 and int(jnp.abs(q[0, 0, 0]).max()) == 0
    err = np.abs(np.asarray(dequantize_kv(q, scale)) - np.asarray(x))
    assert (err <= np.asarray(scale)[..., None] * 0.5 * (1 + 1e-5)).all()
    assert float(dequantize_kv(q, scale)[0, 0, 0].max()) == 0.0


def test_int8_cache_bytes_are_about_half_of_bfloat16_and_a_quarter_of_float32():
    cfg = GPTConfig(vocab_size=64, block_size=2048, n_layer=12, n_head=12, n_embd=768)  # head_dim 64
    int8, bf16, f32 = (cache_bytes(cfg, 8, 2048, d) for d in ("int8", "bfloat16", "float32"))
    assert int8 == 2 * 12 * 8 * 12 * 2048 * (64 + 4)  # int8 values plus a float32 scale per vector
    assert int8 / bf16 == pytest.approx(68 / 128) and int8 / f32 == pytest.approx(68 / 256)
    assert cache_bytes(cfg, 8, 2048, jnp.int8) == int8


@pytest.mark.parametrize("kernels", ["portable", "cpu"])
@pytest.mark.parametrize("scan", [False, True])
def test_int8_cache_nbytes_counts_values_and_scales(kernels, scan):
    cfg = _config(kernels, 2, scan)
    cache = _int8_cache(cfg, 3, 20)
    assert cache.nbytes == cache_bytes(cfg, 3, 20, "int8") == 2 * 2 * 3 * 2 * 20 * (8 + 4)
    abstract = jax.eval_shape(lambda: _int8_cache(cfg, 3, 20))  # as the engine sizes its cache
    assert abstract.nbytes == cache.nbytes and abstract.max_len == 20
    leaves = jax.tree_util.tree_leaves(cache.k) + jax.tree_util.tree_leaves(cache.v)
    assert all(a.dtype == jnp.int8 for a in leaves)


def test_a_cache_dtype_must_be_a_float_or_int8():
    with pytest.raises(ValueError, match="int8"):
        KVCache.create(_config(), 1, 8, dtype="int32")
    assert not KVCache.create(_config(), 1, 8).quantized


@pytest.mark.parametrize("scan", [False, True])
def test_int8_caches_in_the_cpu_and_portable_layouts_hold_the_same_values(scan):
    cfg = _config("portable", 2, scan)
    rows, flat = (KVCache.create(cfg, 3, 8, dtype="int8", layout=layout)
                  for layout in (cpu.RowsCacheLayout(), None))
    k, v = jax.random.normal(jax.random.key(0), (2, 3, 2, 5, 8))
    got = [jax.jit(lambda c: c.advance(jnp.array([0, 1, 3])).write(1, k, v))(c) for c in (rows, flat)]
    for a, b in zip(got[0].layer(1), got[1].layer(1)):
        assert a.shape == b.shape == (3, 2, 8, 8) and a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # what was written reads back rounded to within half a step; what was not stays zero
    kb = np.asarray(got[1].layer(1)[0])
    half_step = float(jnp.abs(k).max()) / 254 + 1e-6
    for r, start in enumerate([0, 1, 3]):
        np.testing.assert_allclose(kb[r, :, start:start + 5], np.asarray(k[r]), atol=half_step)
        assert not kb[r, :, :start].any() and not kb[r, :, start + 5:].any()
    assert not np.asarray(got[0].layer(0)[0]).any()


@pytest.mark.parametrize("kernels", ["portable", "cpu"])
def test_slot_copies_carry_the_scales(kernels):
    cfg = _config(kernels, 2)
    k, v = jax.random.normal(jax.random.key(0), (2, 3, 2, 4, 8))
    cache = jax.jit(lambda c: c.write(0, k, v).write(1, 2 * k, 3 * v).advance(4))(_int8_cache(cfg, 3, 8))
    copied = jax.jit(lambda c: c.copy_slot(0, 2))(cache)
    for layer in (0, 1):
        for a in copied.layer(layer):
            np.testing.assert_array_equal(np.asarray(a[2]), np.asarray(a[0]))
    first = jax.jit(lambda c: c.first(2))(cache)
    assert first.quantized and first.batch_size == 2
    merged = jax.jit(lambda c, f: c.merge_first(f.write(1, k[:2] * 0, v[:2] * 0)))(cache, first)
    assert not np.asarray(merged.layer(1)[0][:2, :, 4:5]).any()
    with pytest.raises(ValueError, match="int8"):
        cache.put_slot(0, KVCache.create(cfg, 1, 8, layout=cache.layout))


@pytest.mark.parametrize("kernels", ["portable", "cpu"])
@pytest.mark.parametrize("dtype,scan", [(None, False), ("int8", False), ("int8", True), (None, True)])
def test_a_slots_window_reads_and_writes_its_first_positions_only(kernels, dtype, scan):
    """KVCache.slot(i, window=W): slot i's positions 0 .. W - 1 (keys, values, an int8 cache's scales,
    in either layout, stacked or not); written and put back (the window, or with put_positions the
    positions written), the positions past W keep what they held, and the slot reads as if the whole of
    it had been written."""
    cfg = _config(kernels, 2, scan)
    k, v = jax.random.normal(jax.random.key(0), (2, 3, 2, 10, 8))
    full = jax.jit(lambda c: c.write(0, k, v).write(1, 2 * k, 3 * v).advance(10))(
        KVCache.create(cfg, 3, 16, dtype=dtype, layout=resolve(cfg).cache_layout))
    one = jax.jit(lambda c: c.slot(1, window=12))(full)
    assert one.max_len == 12 and one.batch_size == 1 and one.quantized == (dtype == "int8")
    for layer in (0, 1):
        for a, b in zip(one.layer(layer), full.layer(layer)):
            np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[1, :, :12]))
    new_k, new_v = jax.random.normal(jax.random.key(1), (2, 1, 2, 2, 8))
    put = jax.jit(lambda c, o: c.put_slot(1, o.write(0, new_k, new_v).advance(2)))(full, one)
    # (put_positions: only the positions written, 10 and 11, go back)
    part = jax.jit(lambda c, o: c.put_positions(1, o.write(0, new_k, new_v).advance(2), 10, 2))(full, one)
    whole = jax.jit(lambda c: c.put_slot(1, c.slot(1).write(0, new_k, new_v).advance(2)))(full)
    assert put.lengths.tolist() == part.lengths.tolist() == whole.lengths.tolist() == [10, 12, 10]
    for a, b, c in zip(jax.tree.leaves(put), jax.tree.leaves(part), jax.tree.leaves(whole)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
        np.testing.assert_array_equal(np.asarray(b), np.asarray(c))
    with pytest.raises(ValueError, match="window"):
        full.slot(0, window=17)


@pytest.mark.parametrize("kernels", ["portable", "cpu"])
@pytest.mark.parametrize("scan,batch", [(False, 1), (False, 3), (True, 3)])
def test_an_int8_decode_step_writes_the_cache_in_place(kernels, scan, batch):
    cfg = _config(kernels, 2, scan, block_size=64)
    variables = jax.jit(GPT(cfg).init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    cache = _int8_cache(cfg, batch, 64)
    step = jax.jit(lambda c, x: GPT(cfg).apply(variables, x, c), donate_argnums=(0,))
    hlo = step.lower(cache, jnp.zeros((batch, 1), jnp.int32)).compile(AS_USERS_COMPILE).as_text()
    value_shapes = [a.shape for a in jax.tree_util.tree_leaves((cache.k, cache.v, cache.k_scale, cache.v_scale))]
    shapes = {f"{d}[{','.join(map(str, s))}]" for s in value_shapes for d in ("s8", "f32")}
    assert not whole_buffer_copies(hlo, shapes)
    assert "dynamic-update-slice" in hlo or "scatter" in hlo


def test_bfloat16_compute_reads_an_int8_cache():
    cfg = _config("portable", 2, dtype="bfloat16")
    variables = jax.jit(GPT(cfg).init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
    logits, cache = jax.jit(GPT(cfg).apply)(variables, tokens, _int8_cache(cfg, 2, 12))
    full = jax.jit(GPT(cfg).apply)(variables, tokens)
    assert cache.k[0].dtype == jnp.int8 and logits.dtype == full.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full), atol=3e-2)
