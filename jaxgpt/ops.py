"""The dense layers' matmul: one `dot_general` whose backward also runs in the compute dtype.

With a low-precision compute dtype, plain autodiff of a matmul that accumulates into float32 hands the
backward a float32 cotangent, so both gradient matmuls would run in float32. `linear`'s custom VJP casts
the cotangent to the compute dtype: every matmul of a training step (forward, input gradient, weight
gradient) multiplies compute-dtype operands with float32 accumulation, on any backend, and the weight
gradient comes back in the parameters' dtype. In float32 it equals plain autodiff.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def _contract(a: jax.Array, b: jax.Array, a_axes: tuple, b_axes: tuple) -> jax.Array:
    return jax.lax.dot_general(a, b, ((a_axes, b_axes), ((), ())), preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def matmul(x: jax.Array, w: jax.Array, compute_dtype, w_out_in: bool = False) -> jax.Array:
    """x [..., in] @ w [in, out] (or w [out, in] with `w_out_in`) -> float32 [..., out], operands cast to
    `compute_dtype`."""
    return _matmul_fwd(x, w, compute_dtype, w_out_in)[0]


def _matmul_fwd(x, w, compute_dtype, w_out_in):
    xc, wc = x.astype(compute_dtype), w.astype(compute_dtype)
    y = _contract(xc, wc, (x.ndim - 1,), (1 if w_out_in else 0,))
    # the input dtypes travel as zero-size placeholders (residuals must be arrays)
    return y, (xc, wc, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _matmul_bwd(compute_dtype, w_out_in, res, dy):
    xc, wc, x_proto, w_proto = res
    dy = dy.astype(compute_dtype)
    lead = tuple(range(dy.ndim - 1))
    dx = _contract(dy, wc, (dy.ndim - 1,), (0 if w_out_in else 1,))  # dy @ w.T
    # x.T @ dy (or dy.T @ x for [out, in]), summed over every leading axis
    dw = _contract(dy, xc, lead, lead) if w_out_in else _contract(xc, dy, lead, lead)
    return dx.astype(x_proto.dtype), dw.astype(w_proto.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def linear(x: jax.Array, w: jax.Array, compute_dtype=jnp.float32, *, w_out_in: bool = False,
           out_dtype=None) -> jax.Array:
    """x [..., in] times w [in, out] (w [out, in] with `w_out_in`, e.g. a tied embedding table) -> [..., out]
    in `out_dtype` (default: the compute dtype). Operands are cast to `compute_dtype`; sums in float32."""
    compute_dtype = jnp.dtype(compute_dtype)
    return matmul(x, w, compute_dtype, w_out_in).astype(out_dtype or compute_dtype)
