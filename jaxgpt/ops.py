"""The dense layers' matmul: one `dot_general` whose backward also runs in the compute dtype.

With a low-precision compute dtype, plain autodiff of a matmul that accumulates into float32 hands the
backward a float32 cotangent, so both gradient matmuls would run in float32. `linear`'s custom VJP (over
the matmul, the bias add and the cast to the output dtype together) hands them the cotangent in the
compute dtype: every matmul of a training step (forward, input gradient, weight gradient) multiplies
compute-dtype operands with float32 accumulation, on any backend, with no float32 round trip of the
activations' gradients, and the parameter gradients come back in the parameters' dtype. In float32 it
equals plain autodiff.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

from jaxgpt.quantize import Int8Kernel, quantize_rows


def _contract(a: jax.Array, b: jax.Array, a_axes: tuple, b_axes: tuple) -> jax.Array:
    return jax.lax.dot_general(a, b, ((a_axes, b_axes), ((), ())), preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _dense(x, w, b, compute_dtype, out_dtype, w_out_in):
    return linear_fwd(x, w, b, compute_dtype, out_dtype, w_out_in)[0]


def linear_fwd(x, w, b, compute_dtype, out_dtype, w_out_in):
    """`linear`'s forward and its residuals (a building block for a backend's own custom VJP)."""
    xc, wc = x.astype(compute_dtype), w.astype(compute_dtype)
    y = _contract(xc, wc, (x.ndim - 1,), (1 if w_out_in else 0,))  # float32
    if b is not None:
        y = y + b.astype(jnp.float32)
    # the input dtypes travel as zero-size placeholders (residuals must be arrays)
    protos = tuple(None if a is None else jnp.zeros((0,), a.dtype) for a in (x, w, b))
    return y.astype(out_dtype), (xc, wc, protos)


def linear_bwd(compute_dtype, out_dtype, w_out_in, res, g):
    """`linear`'s backward from `linear_fwd`'s residuals: both gradient matmuls in the compute dtype."""
    xc, wc, (x_proto, w_proto, b_proto) = res
    lead = tuple(range(g.ndim - 1))
    db = None if b_proto is None else jnp.sum(g.astype(jnp.float32), axis=lead).astype(b_proto.dtype)
    dy = g.astype(compute_dtype)  # a no-op when the output is in the compute dtype already
    dx = _contract(dy, wc, (dy.ndim - 1,), (0 if w_out_in else 1,))  # dy @ w.T
    # x.T @ dy (or dy.T @ x for [out, in]), summed over every leading axis
    dw = _contract(dy, xc, lead, lead) if w_out_in else _contract(xc, dy, lead, lead)
    return dx.astype(x_proto.dtype), dw.astype(w_proto.dtype), db


_dense.defvjp(linear_fwd, linear_bwd)


def linear(x: jax.Array, w: jax.Array, compute_dtype=jnp.float32, *, b: Optional[jax.Array] = None,
           w_out_in: bool = False, out_dtype=None) -> jax.Array:
    """x [..., in] times w [in, out] (w [out, in] with `w_out_in`, e.g. a tied embedding table), plus the
    bias b [out] -> [..., out] in `out_dtype` (default: the compute dtype).

    Operands are cast to `compute_dtype`; products and the bias add in float32, cast once at the end. The
    backward receives its cotangent in `out_dtype`, so with bf16 outputs no float32 round trip happens.
    """
    compute_dtype = jnp.dtype(compute_dtype)
    if isinstance(w, Int8Kernel):
        return int8_linear(x, w, compute_dtype, b=b, w_out_in=w_out_in, out_dtype=out_dtype)
    return _dense(x, w, b, compute_dtype, jnp.dtype(out_dtype or compute_dtype), w_out_in)


def int8_linear(x: jax.Array, w: Int8Kernel, compute_dtype=jnp.float32, *, b: Optional[jax.Array] = None,
                w_out_in: bool = False, out_dtype=None) -> jax.Array:
    """`linear` with an int8 kernel (decoding only, no gradient): the int8 values converted to the compute
    dtype inside the matmul (XLA reads the int8 bytes), float32 products scaled per output. With
    `w.activations == "int8"` (w8a8) x's rows are rounded to int8 (`quantize.quantize_rows`), multiplied
    int8 x int8 -> int32, and scaled by both scales."""
    compute_dtype = jnp.dtype(compute_dtype)
    k_axis = 1 if w_out_in else 0
    if w.activations == "int8":
        xq, xs = quantize_rows(x)
        y = jax.lax.dot_general(xq, w.q, (((x.ndim - 1,), (k_axis,)), ((), ())), preferred_element_type=jnp.int32)
        y = y.astype(jnp.float32) * xs
    else:
        y = _contract(x.astype(compute_dtype), w.q.astype(compute_dtype), (x.ndim - 1,), (k_axis,))
    y = y * w.scale.astype(jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(out_dtype or compute_dtype)
