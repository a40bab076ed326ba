"""Attention: the mask rule, every registered implementation against the reference, GQA, the registry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.attention import (MASK_VALUE, attention, attention_names, causal_mask, einsum_attention, get_attention,
                              register_attention)
from jaxgpt.registry import ATTENTION

PORTABLE = [name for name in attention_names() if name != "cudnn"]  # cudnn needs an NVIDIA GPU


def _qkv(key, b=2, t=6, s=None, n=4, k=4, h=8, dtype=jnp.float32):
    s = t if s is None else s
    kq, kk, kv = jax.random.split(key, 3)
    return (jax.random.normal(kq, (b, t, n, h), dtype), jax.random.normal(kk, (b, k, s, h), dtype),
            jax.random.normal(kv, (b, k, s, h), dtype))


def _positions(b, t, start=0):
    return jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32)[None], (b, t))


def _loop_reference(q, k, v, q_positions, kv_lengths):
    """Attention written out query by query, head by head, in float64 numpy (k, v [B, K, S, H])."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, n, h = q.shape
    g = n // k.shape[1]
    out = np.zeros_like(q)
    for r in range(b):
        for i in range(t):
            visible = [s for s in range(k.shape[2]) if s <= q_positions[r, i] and s < kv_lengths[r]]
            for head in range(n):
                kk, vv = k[r, head // g, visible], v[r, head // g, visible]
                scores = kk @ q[r, i, head] / np.sqrt(h)
                w = np.exp(scores - scores.max())
                out[r, i, head] = (w / w.sum()) @ vv
    return out


def test_textbook_example_first_row_and_no_future_weight():
    # One head over 4 positions of random inputs, d=3, with the upper-triangular (causal) mask.
    x = jax.random.normal(jax.random.key(0), (4, 3))
    wq, wk = jax.random.normal(jax.random.key(1), (2, 3, 3))
    scores = (x @ wq) @ (x @ wk).T / jnp.sqrt(3.0)
    mask = causal_mask(jnp.arange(4)[None], None, 4)[0, 0]
    weights = jax.nn.softmax(jnp.where(mask, scores, MASK_VALUE), axis=-1)
    np.testing.assert_array_equal(np.asarray(weights[0]), [1.0, 0.0, 0.0, 0.0])
    assert float(jnp.sum(jnp.triu(weights, k=1))) == 0.0
    np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)


def test_mask_from_positions_and_lengths():
    m = causal_mask(jnp.array([[2, 3]]), jnp.array([3]), 5)[0, 0]
    expect = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]], bool)  # key 3 is beyond the row's length
    np.testing.assert_array_equal(np.asarray(m), expect)


@pytest.mark.parametrize("name", PORTABLE)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_every_implementation_equals_a_loop_reference(name, kv_heads):
    # self-attention (positions None) and queries at an offset over a longer, partly filled key range
    q, k, v = _qkv(jax.random.key(kv_heads), t=5, s=5, k=kv_heads)
    got = get_attention(name)(q, k, v, None, None)
    want = _loop_reference(q, k, v, np.asarray(_positions(2, 5)), [5, 5])
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    q2, k2, v2 = _qkv(jax.random.key(10 + kv_heads), t=2, s=8, k=kv_heads)
    pos, lengths = jnp.array([[3, 4], [1, 2]]), jnp.array([5, 3])
    got = get_attention(name)(q2, k2, v2, pos, lengths)
    np.testing.assert_allclose(np.asarray(got), _loop_reference(q2, k2, v2, np.asarray(pos), [5, 3]), atol=1e-5)


def test_gqa_equals_repeated_kv_heads():
    q, k, v = _qkv(jax.random.key(1), n=4, k=2)
    gqa = attention(q, k, v)
    full = attention(q, jnp.repeat(k, 2, axis=1), jnp.repeat(v, 2, axis=1))
    np.testing.assert_allclose(np.asarray(gqa), np.asarray(full), atol=1e-6)


def test_self_attention_without_positions_equals_the_mask_rule():
    q, k, v = _qkv(jax.random.key(2), t=7)
    for name in PORTABLE:
        np.testing.assert_allclose(np.asarray(attention(q, k, v, None, None, name)),
                                   np.asarray(attention(q, k, v, _positions(2, 7), None, name)), atol=1e-6)


@pytest.mark.parametrize("name", PORTABLE)
def test_fully_masked_rows_are_finite(name):
    q, k, v = _qkv(jax.random.key(3))
    out = get_attention(name)(q, k, v, _positions(2, 6), jnp.zeros((2,), jnp.int32))
    assert np.isfinite(np.asarray(out)).all()


def float32_softmax_case():
    """bf16-exact q, k, v whose scores (256, 257, 258, 259) bf16 cannot hold (its spacing there is 2): an
    implementation that rounds scores to bf16 before the softmax gets weights up to 0.2 off."""
    h = 64
    q = jnp.ones((1, 1, 1, h))  # scale 1/sqrt(64): score = sum(k) / 8
    k = jnp.zeros((1, 1, 4, h)).at[0, 0, :, 0].set(2048.0).at[0, 0, :, 1].set(8.0 * jnp.arange(4))
    v = jnp.eye(4, h)[None, None]  # output [:4] = the attention weights
    weights = np.asarray(jax.nn.softmax(jnp.arange(4.0)))
    return q, k, v, weights


@pytest.mark.parametrize("name", PORTABLE)
def test_scores_and_softmax_run_in_float32_for_bf16_inputs(name):
    q, k, v, weights = float32_softmax_case()
    out = get_attention(name)(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                              jnp.array([[3]]), None)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out[0, 0, 0, :4], np.float32), weights, atol=1e-2)


def test_bad_shapes_and_implementation():
    q, k, v = _qkv(jax.random.key(5), n=4, k=3)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k, v)
    with pytest.raises(ValueError, match="unknown attention implementation"):
        attention(*_qkv(jax.random.key(5)), implementation="flash")
    q, k, v = _qkv(jax.random.key(5), t=3, s=5)
    with pytest.raises(ValueError, match="as many keys as queries"):
        attention(q, k, v)


def test_a_new_variant_is_one_function_and_one_registry_entry():
    from jaxgpt import GPT, GPTConfig, KVCache

    calls = []

    @register_attention("test_recorded")
    def recorded(q, k, v, q_positions, kv_lengths):
        calls.append(q_positions is None)
        return einsum_attention(q, k, v, q_positions, kv_lengths)

    try:
        cfg = GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=16, attention="test_recorded")
        model = GPT(cfg)
        tokens = jnp.arange(6)[None] % 20
        variables = model.init(jax.random.key(0), tokens)
        full = model.apply(variables, tokens)
        logits, _ = model.apply(variables, tokens, KVCache.create(cfg, 1, 8))
        np.testing.assert_allclose(np.asarray(logits), np.asarray(full), atol=1e-5)
        assert True in calls and False in calls  # the training path and the cached path both used it
    finally:
        ATTENTION.unregister("test_recorded")
    with pytest.raises(ValueError, match="attention"):
        GPTConfig(attention="test_recorded")


@pytest.mark.parametrize("window", [None, 100, 128])  # (no segment is longer than the window)
def test_packed_attention_equals_each_segment_alone(window):
    """Several sequences in one row (segment ids): each token's output is causal attention over its own
    segment alone, with the whole mask or with the tiles over a bounded window (grouped-query heads)."""
    from jaxgpt.attention import packed_attention

    lengths = [40, 60, 1, 100, 50, 30]
    n = sum(lengths) + 19  # padding at the end: segment -1
    segments = np.concatenate([np.repeat(np.arange(len(lengths)), lengths), np.full(19, -1)]).astype(np.int32)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, n, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, 2, n, 8)), jnp.float32) for _ in range(2))
    out = np.asarray(packed_attention(q, k, v, jnp.asarray(segments), window))
    at = 0
    for m in lengths:
        want = einsum_attention(q[:, at:at + m], k[:, :, at:at + m], v[:, :, at:at + m])
        np.testing.assert_allclose(out[0, at:at + m], np.asarray(want)[0], atol=1e-5)
        at += m
