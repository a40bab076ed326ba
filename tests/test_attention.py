import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.attention import (MASK_VALUE, attention, causal_block_attention, causal_mask, einsum_attention,
                              fused_attention)


def _qkv(key, b=2, t=6, s=None, n=4, k=4, h=8, dtype=jnp.float32):
    s = t if s is None else s
    kq, kk, kv = jax.random.split(key, 3)
    return (jax.random.normal(kq, (b, t, n, h), dtype), jax.random.normal(kk, (b, s, k, h), dtype),
            jax.random.normal(kv, (b, s, k, h), dtype))


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


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_einsum_equals_fused(kv_heads):
    q, k, v = _qkv(jax.random.key(0), k=kv_heads)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    a = attention(q, k, v, pos, None, "einsum")
    b = attention(q, k, v, pos, None, "dot_product")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_gqa_equals_repeated_kv_heads():
    q, k, v = _qkv(jax.random.key(1), n=4, k=2)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    gqa = attention(q, k, v, pos)
    full = attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), pos)
    np.testing.assert_allclose(np.asarray(gqa), np.asarray(full), atol=1e-6)


def test_offset_queries_against_longer_keys():
    # queries at positions 3..4 over 8 cache slots of which 5 are valid == full attention's rows 3..4
    q, k, v = _qkv(jax.random.key(2), t=5, s=5)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    full = attention(q, k, v, pos)
    pad = jnp.zeros((2, 3, 4, 8))
    k8, v8 = jnp.concatenate([k, pad + 7.0], 1), jnp.concatenate([v, pad + 7.0], 1)
    part = attention(q[:, 3:], k8, v8, pos[:, 3:], jnp.array([5, 5]))
    np.testing.assert_allclose(np.asarray(part), np.asarray(full[:, 3:]), atol=1e-6)


@pytest.mark.parametrize("fn", [einsum_attention, fused_attention])
def test_fully_masked_rows_are_finite(fn):
    q, k, v = _qkv(jax.random.key(3))
    mask = jnp.zeros((2, 1, 6, 6), bool)
    assert np.isfinite(np.asarray(fn(q, k, v, mask))).all()


def test_softmax_in_float32_for_bf16():
    q, k, v = _qkv(jax.random.key(4), dtype=jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    out = attention(q, k, v, pos)
    ref = attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), pos)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=3e-2)


def test_bad_shapes_and_implementation():
    q, k, v = _qkv(jax.random.key(5), n=4, k=3)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k, v, pos)
    with pytest.raises(ValueError, match="unknown attention implementation"):
        attention(*_qkv(jax.random.key(5)), pos, implementation="flash")


@pytest.mark.parametrize("t,block,kv_heads", [(6, 64, 4), (7, 3, 2), (16, 4, 1), (16, 1, 4)])
def test_causal_blocks_equal_masked_einsum_values_and_grads(t, block, kv_heads):
    q, k, v = _qkv(jax.random.key(t), t=t, k=kv_heads)
    pos = jnp.broadcast_to(jnp.arange(t)[None], (2, t))
    d = jax.random.normal(jax.random.key(9), q.shape)

    def blocked(q, k, v):
        return jnp.sum(causal_block_attention(q, k, v, block) * d)

    def reference(q, k, v):
        return jnp.sum(einsum_attention(q, k, v, causal_mask(pos, None, t)) * d)

    np.testing.assert_allclose(causal_block_attention(q, k, v, block),
                               einsum_attention(q, k, v, causal_mask(pos, None, t)), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.grad(blocked, (0, 1, 2))(q, k, v), jax.grad(reference, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_causal_blocks_are_causal_and_check_shapes():
    q, k, v = _qkv(jax.random.key(1), t=9)
    out = causal_block_attention(q, k, v, 4)
    k2, v2 = k.at[:, 5:].add(3.0), v.at[:, 5:].add(3.0)  # change the future of query 4
    np.testing.assert_array_equal(causal_block_attention(q, k2, v2, 4)[:, :5], out[:, :5])
    assert not np.allclose(causal_block_attention(q, k2, v2, 4)[:, 5:], out[:, 5:])
    with pytest.raises(ValueError, match="as many keys as queries"):
        causal_block_attention(q, k[:, :4], v[:, :4])
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out_bf16 = causal_block_attention(qb, kb, vb, 4)
    assert out_bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(out_bf16.astype(jnp.float32), out, atol=5e-2)
