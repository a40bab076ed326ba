"""ops.linear: equals plain autodiff in float32; in bf16 every matmul of forward and backward is bf16;
a few rows against [out, in] kernels (decode) take the multiply-and-sum path and give the same values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.ops import SMALL_ROWS, linear


def _inputs(transpose_w):
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (3, 7, 16))  # 21 rows: more than SMALL_ROWS, the matmul path
    w = jax.random.normal(kw, (24, 16) if transpose_w else (16, 24)) * 0.1
    d = jax.random.normal(kd, (3, 7, 24))
    return x, w, d


@pytest.mark.parametrize("transpose_w", [False, True])
def test_float32_equals_autodiff_of_plain_matmul(transpose_w):
    x, w, d = _inputs(transpose_w)

    def plain(x, w):
        return jnp.sum(jnp.sin(x @ (w.T if transpose_w else w)) * d)

    def ours(x, w):
        return jnp.sum(jnp.sin(linear(x, w, jnp.float32, transpose_w=transpose_w)) * d)

    np.testing.assert_allclose(ours(x, w), plain(x, w), rtol=1e-6)
    for g_ours, g_plain in zip(jax.grad(ours, (0, 1))(x, w), jax.grad(plain, (0, 1))(x, w)):
        np.testing.assert_allclose(g_ours, g_plain, rtol=1e-5, atol=1e-6)


def _dot_dtypes(jaxpr):
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
        for p in eqn.params.values():  # nested jaxprs (pjit, custom_vjp)
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                found += _dot_dtypes(inner)
    return found


@pytest.mark.parametrize("transpose_w", [False, True])
def test_bfloat16_runs_every_matmul_in_bf16_and_returns_float32_grads(transpose_w):
    x, w, d = _inputs(transpose_w)

    def loss(x, w, dtype):
        return jnp.sum(linear(x, w, dtype, transpose_w=transpose_w, out_dtype=jnp.float32) * d)

    grads = jax.grad(loss, (0, 1))(x, w, jnp.bfloat16)
    assert [g.dtype for g in grads] == [jnp.float32, jnp.float32]
    ref = jax.grad(loss, (0, 1))(x, w, jnp.float32)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g, r, rtol=5e-2, atol=5e-2)
    dots = _dot_dtypes(jax.make_jaxpr(jax.grad(loss, (0, 1)), static_argnums=2)(x, w, jnp.bfloat16).jaxpr)
    assert len(dots) == 3  # forward, dx, dw
    assert all(dt == ("bfloat16", "bfloat16") for dt in dots), dots


def test_output_shape_and_dtype():
    x, w, _ = _inputs(False)
    y = linear(x.astype(jnp.bfloat16), w, jnp.bfloat16)
    assert y.shape == (3, 7, 24) and y.dtype == jnp.bfloat16


def _primitives(jaxpr):
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                names |= _primitives(inner)
    return names


@pytest.mark.parametrize("rows", [1, 2, 8, SMALL_ROWS, SMALL_ROWS + 1])
def test_few_rows_against_out_in_kernel_equal_matmul(rows):
    kx, kw, kd = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (rows, 1, 48))
    w = jax.random.normal(kw, (40, 48)) * 0.1  # [out, in]
    d = jax.random.normal(kd, (rows, 1, 40))

    def plain(x, w):
        return jnp.sum(jnp.tanh(x @ w.T) * d)

    def ours(x, w):
        return jnp.sum(jnp.tanh(linear(x, w, jnp.float32, transpose_w=True)) * d)

    np.testing.assert_allclose(linear(x, w, transpose_w=True), x @ w.T, rtol=1e-5, atol=1e-5)
    for g_ours, g_plain in zip(jax.grad(ours, (0, 1))(x, w), jax.grad(plain, (0, 1))(x, w)):
        np.testing.assert_allclose(g_ours, g_plain, rtol=1e-5, atol=1e-5)
    prims = _primitives(jax.make_jaxpr(lambda x, w: linear(x, w, transpose_w=True))(x, w).jaxpr)
    few = 1 < rows <= SMALL_ROWS
    assert ("dot_general" in prims) != few, prims  # 2..SMALL_ROWS rows: multiply-and-sum, no matmul
    assert ("reduce_sum" in prims) == few, prims


def test_few_rows_rounds_operands_to_the_compute_dtype_and_sums_in_float32():
    kx, kw = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (4, 64))
    w = jax.random.normal(kw, (32, 64))
    got = linear(x, w, jnp.bfloat16, transpose_w=True, out_dtype=jnp.float32)
    xb, wb = x.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_allclose(got, jnp.dot(xb, wb.T, precision="highest"), rtol=1e-5, atol=1e-4)
    assert float(jnp.abs(got - x @ w.T).max()) > 1e-3  # the bf16 rounding did happen
