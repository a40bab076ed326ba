"""Causal self-attention on NVIDIA GPUs: the Pallas (Triton) flash attention of
jax.experimental.pallas.ops.gpu.attention, or cuDNN's fused attention through jax.nn.dot_product_attention.

Both take the registry's plain causal case, q [B, T, N, H] over k, v [B, T, K, H] at positions 0..T-1,
forward and backward. The Pallas kernel wants as many key/value heads as query heads (GQA repeats them;
the repeat's gradient sums back over each group) and T a multiple of its blocks: T is padded at the end
to a multiple of 16, exact under a causal mask (a real query never sees a later, padded key). cuDNN
handles GQA and any T itself, in bf16/fp16 on Ampere or newer, and needs the cuDNN libraries to compile.
The Pallas kernel takes segment ids (document masking) itself; cuDNN's path here does not (the model's
attention="cudnn" runs document-masked windows in XLA). `interpret=True` runs the Pallas program on any
backend (the tests do, on CPU).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

_MIN_BLOCK = 16  # Triton's smallest tile side
_FWD_BLOCKS = (128, 64, 32, 16)
_BWD_BLOCKS = (32, 16)  # the kernel's backward tiles (its defaults are 32)


def padded_length(t: int) -> int:
    """T rounded up to a multiple of 16."""
    return -(-t // _MIN_BLOCK) * _MIN_BLOCK


def _largest_dividing(t: int, choices) -> int:
    return next(b for b in choices if t % b == 0)


def _check(q, k, v) -> None:
    b, t, n, h = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != h or n % k.shape[2]:
        raise ValueError(f"GPU attention takes q [B, T, N, H] and k = v [B, T, K, H] with K dividing N, "
                         f"got q{q.shape} k{k.shape} v{v.shape}")


def pallas_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool = False,
                     segment_ids: Optional[jax.Array] = None) -> jax.Array:
    """Causal self-attention out [B, T, N, H] with the Pallas GPU flash-attention kernel; with
    `segment_ids` int [B, T] a query sees only keys of its own segment (document), the kernel's own mask."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

    _check(q, k, v)
    b, t, n, h = q.shape
    groups = n // k.shape[2]
    if groups > 1:  # query head i reads kv head i // groups, as the einsum reference groups them
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    tp = padded_length(t)
    if tp != t:
        pad = ((0, 0), (0, tp - t), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        if segment_ids is not None:  # (padded positions: a segment of their own)
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, tp - t)), constant_values=-1)
    fwd, bwd = _largest_dividing(tp, _FWD_BLOCKS), _largest_dividing(tp, _BWD_BLOCKS)
    sizes = pallas_gpu.BlockSizes(block_q=fwd, block_k=fwd, block_q_dkv=bwd, block_kv_dkv=bwd,
                                  block_q_dq=bwd, block_kv_dq=bwd)
    ids = None if segment_ids is None else segment_ids.astype(jnp.int32)
    out = pallas_gpu.mha(q, k, v, ids, 1.0 / h ** 0.5, True, sizes, interpret=interpret)
    return out[:, :t]


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool = False) -> jax.Array:
    """Causal self-attention out [B, T, N, H] with cuDNN's fused kernel (NVIDIA GPUs, bf16/fp16).
    There is no interpreter for cuDNN: `interpret=True` computes the same function with XLA instead."""
    _check(q, k, v)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla" if interpret else "cudnn")


def gpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool = False,
                  implementation: str = "pallas") -> jax.Array:
    """Causal self-attention with `implementation` "pallas" (any dtype) or "cudnn" (bf16/fp16)."""
    if implementation == "pallas":
        return pallas_attention(q, k, v, interpret=interpret)
    if implementation == "cudnn":
        return cudnn_attention(q, k, v, interpret=interpret)
    raise ValueError(f"GPU attention implementation must be 'pallas' or 'cudnn', got {implementation!r}")
