"""Pure causal attention: masks from positions, an einsum reference path, a fused path, and GQA.

Shapes: B batch, T queries, S keys, N query heads, K key/value heads (N % K == 0), H head dim.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

# A large finite negative instead of -inf: a fully masked row then softmaxes to a uniform (finite)
# distribution rather than NaN.
MASK_VALUE = -1e30


def causal_mask(q_positions: jax.Array, kv_length: Optional[jax.Array], num_keys: int) -> jax.Array:
    """Boolean mask [B, 1, T, S]: key s is visible to query t iff s <= pos[t] and s < kv_length.

    q_positions: int [B, T] absolute positions of the queries. kv_length: int [B] number of valid keys
    per row (None: all `num_keys`). One rule serves training, prefill at an offset and one-token decode.
    """
    k_pos = jnp.arange(num_keys, dtype=jnp.int32)
    mask = k_pos[None, None, :] <= q_positions[:, :, None]
    if kv_length is not None:
        mask = mask & (k_pos[None, None, :] < kv_length[:, None, None])
    return mask[:, None, :, :]


def _check_shapes(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention expects [B, T, N, H] arrays, got q{q.shape} k{k.shape} v{v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")


def einsum_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Reference attention. q [B,T,N,H], k/v [B,S,K,H], mask bool [B,1,T,S] -> [B,T,N,H]."""
    _check_shapes(q, k, v)
    b, t, n, h = q.shape
    kh = k.shape[2]
    q = q.reshape(b, t, kh, n // kh, h)  # group the query heads that share one key/value head
    scale = 1.0 / jnp.sqrt(jnp.asarray(h, jnp.float32))
    # scores and softmax in float32 whatever the compute dtype
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, :, None, :, :], scores, MASK_VALUE)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", weights, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h).astype(q.dtype)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """The same through `jax.nn.dot_product_attention` (XLA on CPU, cuDNN-capable on GPU)."""
    _check_shapes(q, k, v)
    return jax.nn.dot_product_attention(q, k, v, mask=mask)


IMPLEMENTATIONS = {"einsum": einsum_attention, "dot_product": fused_attention}


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
              kv_length: Optional[jax.Array] = None, implementation: str = "einsum") -> jax.Array:
    """Causal (grouped-query) attention of q [B,T,N,H] over k/v [B,S,K,H] -> [B,T,N,H]."""
    try:
        fn = IMPLEMENTATIONS[implementation]
    except KeyError:
        raise ValueError(
            f"unknown attention implementation {implementation!r}; choose from {sorted(IMPLEMENTATIONS)}"
        ) from None
    return fn(q, k, v, causal_mask(q_positions, kv_length, k.shape[1]))
