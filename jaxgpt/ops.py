"""Matmuls for the model's dense layers, written for XLA's CPU backend and for mixed precision.

`linear(x, w, compute_dtype)` multiplies the last axis of x by w [in, out] as one 2-D matmul. Two
reasons it is not `nn.Dense`:

- XLA's CPU backend runs the backward of a dense layer on a 3-D activation [B, T, C] (the weight gradient
  contracts two axes at once) markedly slower than the same work on [B*T, C]: measured on the 6-layer
  config's MLP, forward+backward 236 ms with 3-D operands against 159 ms with the activation flattened.
- With a low-precision compute dtype, autodiff would give the backward's matmuls a float32 cotangent and
  run them in float32. The custom VJP here casts the cotangent to the compute dtype, so every matmul of the
  step (forward and both gradient matmuls) multiplies compute-dtype operands with float32 accumulation,
  and gradients come back in the parameters' dtype (float32 master weights).

In float32 the result and the gradients equal plain autodiff of `x @ w`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def _dot(a, b, contract_a: int, contract_b: int):
    return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                               preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x, w, compute_dtype, transpose_w):
    return _matmul_fwd(x, w, compute_dtype, transpose_w)[0]


def _matmul_fwd(x, w, compute_dtype, transpose_w):
    xc, wc = x.astype(compute_dtype), w.astype(compute_dtype)
    y = _dot(xc, wc, 1, 1 if transpose_w else 0)
    # the residuals carry the input dtypes only as zero-size placeholders
    return y, (xc, wc, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _matmul_bwd(compute_dtype, transpose_w, res, dy):
    xc, wc, x_proto, w_proto = res
    dy = dy.astype(compute_dtype)
    if transpose_w:  # y = x @ w.T with w [out, in]
        dx = _dot(dy, wc, 1, 0)
        dw = _dot(dy, xc, 0, 0)
    else:  # y = x @ w with w [in, out]
        dx = _dot(dy, wc, 1, 1)
        dw = _dot(xc, dy, 0, 0)
    return dx.astype(x_proto.dtype), dw.astype(w_proto.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


SMALL_ROWS = 16


def _few_rows(x, w, compute_dtype):
    """x [b, in] times w [out, in].T for a few rows (decode) as one multiply-and-sum over `in`.

    XLA's CPU matmul runs [8, 768] x [768, 50257] at a third of the rate it reads the weights for one row
    (GPT-2's head: 26 ms at 8 rows against 8 ms for 1), and it rewrites `(w @ x.T).T` back into that
    matmul. As a fused multiply-and-reduce each row of w is read once and multiplied by every row of x
    while it is in cache: 2-3x faster for 2-16 rows at GPT-2's shapes (see bench/README.md). Products and
    sums in float32 (the compute-dtype operands are upcast in registers), as the matmul path accumulates.
    """
    xc = x.astype(compute_dtype).astype(jnp.float32)
    wc = w.astype(compute_dtype).astype(jnp.float32)
    return jnp.sum(wc[None, :, :] * xc[:, None, :], axis=-1)


def linear(x: jax.Array, w: jax.Array, compute_dtype=jnp.float32, *, transpose_w: bool = False,
           out_dtype=None) -> jax.Array:
    """x [..., in] times w [in, out] (or w [out, in] with transpose_w) -> [..., out] in `out_dtype`
    (default: the compute dtype). Operands are cast to `compute_dtype`; accumulation is float32."""
    compute_dtype = jnp.dtype(compute_dtype)
    features = w.shape[0] if transpose_w else w.shape[1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if transpose_w and 1 < x2.shape[0] <= SMALL_ROWS:
        y = _few_rows(x2, w, compute_dtype)
    else:
        y = _matmul(x2, w, compute_dtype, transpose_w)
    return y.astype(out_dtype or compute_dtype).reshape(*lead, features)
