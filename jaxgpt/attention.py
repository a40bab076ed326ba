"""Causal attention as pure functions, and the registry that names them.

Every implementation has one signature, `fn(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT, kv_lengths_B)
-> out_BxTxNxH`: N query heads share K key/value heads (N % K == 0), keys head-major as the KV cache holds
them. Key s is visible to query t iff s <= q_positions[t] and s < kv_lengths. `q_positions=None` means
plain causal self-attention (queries and keys at 0..T-1), where a fused causal kernel may be used. A new
variant is one such function plus `@register_attention("name")`; the model calls it, through its backend,
for training, prefill and decode alike.

Document masking (training on windows that hold several documents, `data.doc_mask`): an implementation
that supports it also takes the keyword `segment_ids_BxT` (int [B, T], one id per document, contiguous)
in plain self-attention, where key s is then visible to query t iff s <= t and both share an id. The
built-ins do; the model refuses, in one line, an attention function that does not take the keyword.
"""

from __future__ import annotations

from typing import Callable, Optional

import inspect

import jax
import jax.numpy as jnp

from jaxgpt.registry import ATTENTION
from jaxgpt.report import warn

# A large finite negative instead of -inf: a fully masked row softmaxes to a finite uniform distribution.
MASK_VALUE = -1e30

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, Optional[jax.Array], Optional[jax.Array]], jax.Array]


def register_attention(name: str, *, replace: bool = False) -> Callable[[AttentionFn], AttentionFn]:
    """Decorator: make `fn` available as `GPTConfig(attention=name)`; a name already registered (a built-in
    such as "dot_product" included) needs `replace=True`, and every backend then runs the replacement."""
    return ATTENTION.register(name, replace=replace)


def attention_names() -> tuple[str, ...]:
    return ATTENTION.names()


def get_attention(name: str) -> AttentionFn:
    """The implementation registered as `name` (ValueError listing the known ones otherwise)."""
    return ATTENTION.get(name)


def split_heads(qkv_BxTxC: jax.Array, n_head: int, kv_heads: int):
    """A fused projection [B, T, (N + 2K) H] (q, then k, then v) -> q [B,T,N,H], k and v [B,T,K,H]."""
    b, t, c = qkv_BxTxC.shape
    h = c // (n_head + 2 * kv_heads)
    q, k, v = jnp.split(qkv_BxTxC, [n_head * h, (n_head + kv_heads) * h], axis=-1)
    return q.reshape(b, t, n_head, h), k.reshape(b, t, kv_heads, h), v.reshape(b, t, kv_heads, h)


def grouped_queries(q_BxTxNxH: jax.Array, kv_heads: int) -> jax.Array:
    """q scaled by 1/sqrt(H) -> [B, K, G, T, H]: the G query heads that share each key/value head."""
    b, t, n, h = q_BxTxNxH.shape
    scale = (1.0 / jnp.sqrt(jnp.asarray(h, jnp.float32))).astype(q_BxTxNxH.dtype)
    return (q_BxTxNxH * scale).reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)


def causal_mask(q_positions_BxT: jax.Array, kv_lengths_B: Optional[jax.Array], num_keys: int,
                segment_ids_BxT: Optional[jax.Array] = None) -> jax.Array:
    """bool [B, 1, T, S]: key s is visible to query t iff s <= q_positions[t] and s < kv_lengths (None:
    all keys), and, with `segment_ids` (self-attention: S == T), both belong to the same document. One
    rule serves training, document-masked training, prefill at an offset and one-token decode."""
    k_pos = jnp.arange(num_keys, dtype=jnp.int32)
    mask = k_pos[None, None, :] <= q_positions_BxT[:, :, None]
    if kv_lengths_B is not None:
        mask = mask & (k_pos[None, None, :] < kv_lengths_B[:, None, None])
    if segment_ids_BxT is not None:
        mask = mask & (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])
    return mask[:, None, :, :]


def segment_positions(segment_ids_BxT: jax.Array) -> jax.Array:
    """int32 [B, T]: each token's index within its document (contiguous ids): 0 at each document's first
    token. What positions (learned or rotary) a document-masked window uses, so that every document is
    computed as if it stood alone."""
    t = segment_ids_BxT.shape[1]
    steps = jnp.arange(t, dtype=jnp.int32)[None, :]
    first = jnp.concatenate([jnp.ones_like(segment_ids_BxT[:, :1], bool),
                             segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)
    starts = jax.lax.cummax(jnp.where(first, steps, 0), axis=1)  # the latest document start at or before t
    return steps - starts


def takes_segments(fn: Callable) -> bool:
    """Whether an attention function takes `segment_ids_BxT=` (document masking)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "segment_ids_BxT" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def check_segments(q_positions_BxT, kv_lengths_B, segment_ids_BxT) -> None:
    """ValueError unless document segments come with plain self-attention (no positions, no cache)."""
    if segment_ids_BxT is not None and (q_positions_BxT is not None or kv_lengths_B is not None):
        raise ValueError("segment_ids_BxT (document masking) applies to self-attention without a cache only")


def self_positions(t: int) -> jax.Array:
    """int32 [1, T]: the positions 0..T-1 of plain self-attention."""
    return jnp.arange(t, dtype=jnp.int32)[None, :]


def rotary_embedding(x_BxTxNxH: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
    """RoPE in Hugging Face Llama's rotate-half layout: the pair (i, i + H/2) turns by
    position / theta^(2i/H). Computed in float32, returned in x's dtype."""
    h = x_BxTxNxH.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    angles = positions_BxT.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, T, 1, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x_BxTxNxH.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BxTxNxH.dtype)


def check_shapes(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: Optional[jax.Array] = None) -> None:
    """ValueError unless q [B,T,N,H], k = v [B,K,S,H] with K dividing N (and S == T without positions)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention expects q [B, T, N, H] and k, v [B, K, S, H], got q{q.shape} k{k.shape} "
                         f"v{v.shape}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k and v must both be [B, K, S, H] matching q{q.shape}, got k{k.shape} v{v.shape}")
    if q.shape[2] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[1]})")
    if q_positions is None and k.shape[2] != q.shape[1]:
        raise ValueError(f"causal self-attention (no q_positions) needs as many keys as queries, "
                         f"got {q.shape[1]} and {k.shape[2]}")


@ATTENTION.register("einsum", builtin=True)
def einsum_attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT=None, kv_lengths_B=None, *,
                     segment_ids_BxT=None) -> jax.Array:
    """The reference: two einsums and a masked softmax, scores and softmax in float32."""
    check_shapes(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT)
    check_segments(q_positions_BxT, kv_lengths_B, segment_ids_BxT)
    b, t, n, h = q_BxTxNxH.shape
    if q_positions_BxT is None:
        q_positions_BxT = self_positions(t)
    q_BxKxGxTxH = grouped_queries(q_BxTxNxH, k_BxKxSxH.shape[1])
    scores = jnp.einsum("bkgth,bksh->bkgts", q_BxKxGxTxH, k_BxKxSxH, preferred_element_type=jnp.float32)
    mask = causal_mask(q_positions_BxT, kv_lengths_B, k_BxKxSxH.shape[2], segment_ids_BxT)[:, :, None]  # [B,1,1,T,S]
    weights = jax.nn.softmax(jnp.where(mask, scores, MASK_VALUE), axis=-1).astype(v_BxKxSxH.dtype)
    out = jnp.einsum("bkgts,bksh->btkgh", weights, v_BxKxSxH, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h).astype(q_BxTxNxH.dtype)


@ATTENTION.register("dot_product", builtin=True)
def dot_product_attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT=None, kv_lengths_B=None, *,
                          segment_ids_BxT=None) -> jax.Array:
    """`jax.nn.dot_product_attention`: `is_causal=True` for self-attention, a position (and document)
    mask otherwise."""
    check_shapes(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT)
    check_segments(q_positions_BxT, kv_lengths_B, segment_ids_BxT)
    k_BxSxKxH, v_BxSxKxH = k_BxKxSxH.swapaxes(1, 2), v_BxKxSxH.swapaxes(1, 2)  # its layout
    if q_positions_BxT is None and kv_lengths_B is None and segment_ids_BxT is None:
        return jax.nn.dot_product_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, is_causal=True)
    if q_positions_BxT is None:
        q_positions_BxT = self_positions(q_BxTxNxH.shape[1])
    mask = causal_mask(q_positions_BxT, kv_lengths_B, k_BxSxKxH.shape[1], segment_ids_BxT)
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask=mask)


@ATTENTION.register("cudnn", builtin=True)
def cudnn_attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT=None, kv_lengths_B=None, *,
                    segment_ids_BxT=None) -> jax.Array:
    """cuDNN's fused causal attention on NVIDIA GPUs (bf16/fp16) for self-attention; queries at other
    positions (prefill at an offset, decode) and document-masked windows take the masked XLA path."""
    check_shapes(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT)
    if q_positions_BxT is None and kv_lengths_B is None and segment_ids_BxT is None:
        return jax.nn.dot_product_attention(q_BxTxNxH, k_BxKxSxH.swapaxes(1, 2), v_BxKxSxH.swapaxes(1, 2),
                                            is_causal=True, implementation="cudnn")
    if segment_ids_BxT is not None:
        warn("attention='cudnn' has no document mask here: document-masked attention runs in XLA "
             "(attention='dot_product' on the gpu backend runs it in the Pallas flash kernel)")
    return dot_product_attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT, kv_lengths_B,
                                 segment_ids_BxT=segment_ids_BxT)


PACKED_TILE = 64  # queries per tile of packed attention


def packed_attention(q_1xNxHxD, k_1xKxNxD, v_1xKxNxD, segments_N, window=None) -> jax.Array:
    """Causal attention inside each segment of one packed row of N tokens (several prompts in one forward,
    `cache.PackedCache`): token i sees token j when j <= i and both belong to the same segment. With
    `window` (no segment longer than it), queries go in tiles of 64, each over its own keys and the
    `window` before them: N x (64 + window) scores instead of N x N."""
    n = q_1xNxHxD.shape[1]
    if window is None or window + PACKED_TILE >= n:
        idx = jnp.arange(n)
        mask = (segments_N[:, None] == segments_N[None, :]) & (idx[None, :] <= idx[:, None])
        return jax.nn.dot_product_attention(q_1xNxHxD, k_1xKxNxD.swapaxes(1, 2), v_1xKxNxD.swapaxes(1, 2),
                                            mask=mask[None, None])
    t = PACKED_TILE
    tiles = -(-n // t)
    end = tiles * t - n
    q = jnp.pad(q_1xNxHxD[0], ((0, end), (0, 0), (0, 0))).reshape(tiles, t, *q_1xNxHxD.shape[2:])
    # keys with `window` padding in front: tile i's keys are padded positions i t .. i t + t + window - 1
    k, v = (jnp.pad(a[0].swapaxes(0, 1), ((window, end), (0, 0), (0, 0))) for a in (k_1xKxNxD, v_1xKxNxD))
    seg = jnp.pad(segments_N, (window, end), constant_values=-1)
    at_TxW = jnp.arange(tiles)[:, None] * t + jnp.arange(t + window)[None, :]
    q_seg = seg[window:].reshape(tiles, t)
    k_seg = seg[at_TxW]
    causal = jnp.arange(t)[:, None] + window >= jnp.arange(t + window)[None, :]  # key j of tile: j - window
    mask = (q_seg[:, :, None] == k_seg[:, None, :]) & causal[None] & (k_seg[:, None, :] >= 0)
    out = jax.nn.dot_product_attention(q, k[at_TxW], v[at_TxW], mask=mask[:, None])
    return out.reshape(tiles * t, *out.shape[2:])[None, :n]


def attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT=None, kv_lengths_B=None,
              implementation: str = "dot_product", segment_ids_BxT=None) -> jax.Array:
    """Causal (grouped-query) attention with a registered implementation (document-masked with
    `segment_ids_BxT`)."""
    fn = get_attention(implementation)
    if segment_ids_BxT is None:
        return fn(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT, kv_lengths_B)
    return fn(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT, kv_lengths_B, segment_ids_BxT=segment_ids_BxT)
