"""ops.linear: equals plain autodiff in float32; in bf16 every matmul of forward and backward is bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.ops import linear


def _inputs(w_out_in):
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (3, 7, 16))
    w = jax.random.normal(kw, (24, 16) if w_out_in else (16, 24)) * 0.1
    d = jax.random.normal(kd, (3, 7, 24))
    return x, w, d


@pytest.mark.parametrize("w_out_in", [False, True])
def test_float32_equals_autodiff_of_plain_matmul(w_out_in):
    x, w, d = _inputs(w_out_in)

    def plain(x, w):
        return jnp.sum(jnp.sin(x @ (w.T if w_out_in else w)) * d)

    def ours(x, w):
        return jnp.sum(jnp.sin(linear(x, w, jnp.float32, w_out_in=w_out_in)) * d)

    np.testing.assert_allclose(ours(x, w), plain(x, w), rtol=1e-6)
    for g_ours, g_plain in zip(jax.grad(ours, (0, 1))(x, w), jax.grad(plain, (0, 1))(x, w)):
        np.testing.assert_allclose(g_ours, g_plain, rtol=1e-5, atol=1e-6)


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():  # nested jaxprs (pjit, custom_vjp)
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                yield from _eqns(inner)


@pytest.mark.parametrize("w_out_in", [False, True])
def test_bfloat16_runs_every_matmul_in_bf16_and_returns_float32_grads(w_out_in):
    x, w, d = _inputs(w_out_in)

    def loss(x, w, dtype):
        return jnp.sum(linear(x, w, dtype, w_out_in=w_out_in, out_dtype=jnp.float32) * d)

    grads = jax.grad(loss, (0, 1))(x, w, jnp.bfloat16)
    assert [g.dtype for g in grads] == [jnp.float32, jnp.float32]
    ref = jax.grad(loss, (0, 1))(x, w, jnp.float32)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g, r, rtol=5e-2, atol=5e-2)
    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)), static_argnums=2)(x, w, jnp.bfloat16).jaxpr
    dots = [tuple(str(v.aval.dtype) for v in e.invars) for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 3  # forward, dx, dw: one dot_general each, on the 3-D activation as it is
    assert all(dt == ("bfloat16", "bfloat16") for dt in dots), dots
    assert not any(e.primitive.name == "transpose" for e in _eqns(jaxpr))


def test_output_shape_and_dtype():
    x, w, _ = _inputs(False)
    y = linear(x.astype(jnp.bfloat16), w, jnp.bfloat16)
    assert y.shape == (3, 7, 24) and y.dtype == jnp.bfloat16
    assert linear(x, w, out_dtype=jnp.float32).dtype == jnp.float32
