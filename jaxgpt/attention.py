"""Causal attention as pure functions, and the registry that names them.

Every implementation has one signature, `fn(q, k, v, q_positions, kv_lengths) -> out`:
q [B, T, N, H], k and v [B, S, K, H] (N query heads share K key/value heads, N % K == 0), out [B, T, N, H].
`q_positions` int [B, T] gives each query's absolute position and `kv_lengths` int [B] how many keys of each
row are real; key s is visible to query t iff s <= q_positions[t] and s < kv_lengths. `q_positions=None`
means plain causal self-attention (queries and keys both at 0..T-1), which lets an implementation use a
fused causal kernel. A new variant is one such function plus `@register_attention("name")`; GPTConfig's
`attention` field, the model's training path and its cached path all look it up here.
"""

from __future__ import annotations

from typing import Callable, Optional

import einops
import jax
import jax.numpy as jnp

# A large finite negative instead of -inf: a fully masked row then softmaxes to a uniform (finite)
# distribution rather than NaN.
MASK_VALUE = -1e30

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, Optional[jax.Array], Optional[jax.Array]], jax.Array]
_REGISTRY: dict[str, AttentionFn] = {}


def register_attention(name: str) -> Callable[[AttentionFn], AttentionFn]:
    """Decorator: make `fn` available as `GPTConfig(attention=name)`."""
    def register(fn: AttentionFn) -> AttentionFn:
        _REGISTRY[name] = fn
        return fn
    return register


def attention_names() -> tuple[str, ...]:
    """The registered implementation names."""
    return tuple(sorted(_REGISTRY))


def get_attention(name: str) -> AttentionFn:
    """The implementation registered as `name` (ValueError listing the known ones otherwise)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown attention implementation {name!r}; choose from {attention_names()}") from None


def causal_mask(q_positions: jax.Array, kv_lengths: Optional[jax.Array], num_keys: int) -> jax.Array:
    """Boolean mask [B, 1, T, S] from q_positions [B, T]: key s is visible to query t iff s <= pos[t] and
    s < kv_lengths (None: all keys). One rule serves training, prefill at an offset and one-token decode."""
    k_pos = jnp.arange(num_keys, dtype=jnp.int32)
    mask = k_pos[None, None, :] <= q_positions[:, :, None]
    if kv_lengths is not None:
        mask = mask & (k_pos[None, None, :] < kv_lengths[:, None, None])
    return mask[:, None, :, :]


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """RoPE: x [B, T, N, H] with each token's vector turned by its absolute position `positions` [B, T].

    Hugging Face Llama's rotate-half layout: the pair (i, i + H/2) turns by positions / theta^(2i/H).
    Computed in float32, returned in x's dtype.
    """
    h = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, T, 1, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def check_shapes(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: Optional[jax.Array] = None) -> None:
    """ValueError unless q [B,T,N,H], k = v [B,S,K,H] with K dividing N (and S == T without positions)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention expects [B, T, N, H] arrays, got q{q.shape} k{k.shape} v{v.shape}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k and v must both be [B, S, K, H] matching q{q.shape}, got k{k.shape} v{v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")
    if q_positions is None and k.shape[1] != q.shape[1]:
        raise ValueError(f"causal self-attention (no q_positions) needs as many keys as queries, "
                         f"got {q.shape[1]} and {k.shape[1]}")


@register_attention("einsum")
def einsum_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: Optional[jax.Array] = None,
                     kv_lengths: Optional[jax.Array] = None) -> jax.Array:
    """The reference: two einsums and a masked softmax, scores and softmax in float32."""
    check_shapes(q, k, v, q_positions)
    q_grouped = einops.rearrange(q, "b t (k g) h -> b t k g h", k=k.shape[2])
    scale = 1.0 / jnp.sqrt(jnp.asarray(q.shape[-1], jnp.float32))
    scores = jnp.einsum("btkgh,bskh->bkgts", q_grouped, k, preferred_element_type=jnp.float32) * scale
    if q_positions is None:
        q_positions = jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    mask = causal_mask(q_positions, kv_lengths, k.shape[1])
    scores = jnp.where(mask[:, :, None], scores, MASK_VALUE)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", weights, v, preferred_element_type=jnp.float32)
    return einops.rearrange(out, "b t k g h -> b t (k g) h").astype(q.dtype)


@register_attention("dot_product")
def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: Optional[jax.Array] = None,
                          kv_lengths: Optional[jax.Array] = None) -> jax.Array:
    """`jax.nn.dot_product_attention`: `is_causal=True` for self-attention, a position mask otherwise."""
    check_shapes(q, k, v, q_positions)
    if q_positions is None and kv_lengths is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    if q_positions is None:
        q_positions = jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=causal_mask(q_positions, kv_lengths, k.shape[1]))


@register_attention("cudnn")
def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: Optional[jax.Array] = None,
                    kv_lengths: Optional[jax.Array] = None) -> jax.Array:
    """cuDNN's fused (flash) causal attention on NVIDIA GPUs (bf16/fp16), which JAX 0.10's default does not
    pick; queries at other positions (prefill at an offset, decode) take the masked XLA path."""
    check_shapes(q, k, v, q_positions)
    if q_positions is None and kv_lengths is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return dot_product_attention(q, k, v, q_positions, kv_lengths)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: Optional[jax.Array] = None,
              kv_lengths: Optional[jax.Array] = None, implementation: str = "dot_product") -> jax.Array:
    """Causal (grouped-query) attention of q [B,T,N,H] over k/v [B,S,K,H] with a registered implementation."""
    return get_attention(implementation)(q, k, v, q_positions, kv_lengths)
