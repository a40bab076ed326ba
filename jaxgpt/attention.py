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


def _grouped_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """Scaled q [B,T,N,H] -> [B,K,G,T,H]: the G query heads that share each of the K key/value heads."""
    b, t, n, h = q.shape
    scale = 1.0 / jnp.sqrt(jnp.asarray(h, jnp.float32))
    return (q * scale.astype(q.dtype)).reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)


def _attend(q_bkmh: jax.Array, k_bksh: jax.Array, v_bksh: jax.Array, visible: jax.Array) -> jax.Array:
    """Scaled queries [..., M, H] over head-major keys/values [..., S, H] (leading dims (B, K), or B*K
    merged); `visible` bool broadcasts to [..., M, S]. Scores and softmax in float32; returns float32
    [..., M, H]. Each matmul is one batched GEMM over the leading dims with no transposes, and the query
    heads of a group form one taller matrix."""
    scores = jnp.einsum("...mh,...sh->...ms", q_bkmh, k_bksh, preferred_element_type=jnp.float32)
    weights = jax.nn.softmax(jnp.where(visible, scores, MASK_VALUE), axis=-1).astype(v_bksh.dtype)
    return jnp.einsum("...ms,...sh->...mh", weights, v_bksh, preferred_element_type=jnp.float32)


def causal_block_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int = 64) -> jax.Array:
    """Causal self-attention of a whole sequence (query t sees keys 0..t), skipping the masked blocks.

    q [B,T,N,H], k/v [B,T,K,H] with queries and keys at positions 0..T-1 (training, eval, a plain
    forward). Queries go in blocks of `block` rows; block i attends only to keys [0, (i+1)*block), so the
    score matmuls, softmax and their gradients do about (n+1)/(2n) of the full T x T work for n blocks.
    Equals `einsum_attention` with the causal mask (to float32 rounding).
    """
    _check_shapes(q, k, v)
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    if k.shape[1] != t:
        raise ValueError(f"causal_block_attention needs as many keys as queries, got {t} and {k.shape[1]}")
    q_bkgth = _grouped_queries(q, kh)
    k_bksh, v_bksh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    outs = []
    for lo in range(0, t, block):
        hi = min(lo + block, t)
        q_pos = jnp.tile(jnp.arange(lo, hi, dtype=jnp.int32), g)  # row m is query lo + m % (hi - lo)
        visible = jnp.arange(hi, dtype=jnp.int32)[None, :] <= q_pos[:, None]
        out = _attend(q_bkgth[:, :, :, lo:hi].reshape(b, kh, g * (hi - lo), h), k_bksh[:, :, :hi],
                      v_bksh[:, :, :hi], visible)
        outs.append(out.reshape(b, kh, g, hi - lo, h))
    out = jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)


# "blocked" is `causal_block_attention` for a whole sequence (the model's path without a cache); for
# arbitrary positions (prefill at an offset, decode) it is the masked einsum.
IMPLEMENTATIONS = {"einsum": einsum_attention, "dot_product": fused_attention, "blocked": einsum_attention}


def cached_attention(q: jax.Array, k_nsh: jax.Array, v_nsh: jax.Array, q_positions: jax.Array,
                     kv_length: jax.Array, implementation: str = "einsum") -> jax.Array:
    """Attention of q [B,T,N,H] over one cache layer k/v [B*K, S, H] (row b's kv head j at b*K + j, the
    layout of `KVCache`) -> [B,T,N,H].

    The einsum path multiplies the cache as it is laid out; "dot_product" transposes it for
    `jax.nn.dot_product_attention`.
    """
    b, t, n, h = q.shape
    if k_nsh.ndim != 3 or k_nsh.shape != v_nsh.shape or k_nsh.shape[0] % b or n % (k_nsh.shape[0] // b):
        raise ValueError(f"cache layer k/v must be [B*K, S, H] with K dividing the {n} query heads, "
                         f"got k{k_nsh.shape} v{v_nsh.shape} for {b} rows")
    kh, s = k_nsh.shape[0] // b, k_nsh.shape[1]
    if implementation == "dot_product":
        k, v = (a.reshape(b, kh, s, h).swapaxes(1, 2) for a in (k_nsh, v_nsh))
        return attention(q, k, v, q_positions, kv_length, implementation)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; "
                         f"choose from {sorted(IMPLEMENTATIONS)}")
    g = n // kh
    mask = jnp.tile(causal_mask(q_positions, kv_length, s), (1, 1, g, 1))  # [B, 1, G*T, S]: row m is m % T
    mask = jnp.broadcast_to(mask, (b, kh, g * t, s)).reshape(b * kh, g * t, s)
    out = _attend(_grouped_queries(q, kh).reshape(b * kh, g * t, h), k_nsh.astype(q.dtype),
                  v_nsh.astype(q.dtype), mask)
    return out.reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)


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
