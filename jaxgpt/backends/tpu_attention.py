"""Causal self-attention on TPUs: Pallas splash attention (jax.experimental.pallas.ops.tpu.splash_attention).

`splash_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH)` is the registry's plain causal case (queries and keys
both at 0..T-1), forward and backward, with grouped-query attention done by the kernel itself (N query
heads over K key/value heads). Splash tiles the sequence in blocks whose kv side must be a multiple of
128 lanes: T is padded at the end to such a multiple, which is exact under a causal mask (a real query
never sees a key after it, so never a padded one) and whose padded rows are sliced off. Document masking
(`segment_ids` [B, T]) is splash's own SegmentIds, and-ed with the causal mask; padded positions take id
-1. `interpret=True` runs the kernel's Pallas program on any backend (the tests do, on CPU).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

LANES = 128  # splash's kv compute block must be a multiple of the TPU's 128 lanes
_BLOCKS = (512, 256, 128)  # largest first: fewer grid steps; 512 is what splash's users pick at T >= 1024


def padded_length(t: int) -> int:
    """T rounded up to a multiple of 128 (splash's smallest block)."""
    return -(-t // LANES) * LANES


def block_size(t_padded: int) -> int:
    """The largest of 512, 256, 128 that divides the padded sequence length."""
    return next(b for b in _BLOCKS if t_padded % b == 0)


@functools.lru_cache(maxsize=32)
def _kernel(num_heads: int, t_padded: int, block: int, interpret: bool):
    """The splash kernel for [N, Tp, H] queries (one batch row), causal, blocks of `block` both ways."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    mask = masks.MultiHeadMask([masks.CausalMask((t_padded, t_padded)) for _ in range(num_heads)])
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)
    # its mask tables are made with jnp.array: made concrete even inside a trace (shard_map stages them
    # out), or the cached kernel would hold the first trace's tracers
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool = False,
                     segment_ids: Optional[jax.Array] = None) -> jax.Array:
    """Causal self-attention out [B, T, N, H] of q [B, T, N, H] over k, v [B, T, K, H] (K divides N);
    with `segment_ids` int [B, T] a query sees only keys of its own segment (document)."""
    b, t, n, h = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != h or n % k.shape[2]:
        raise ValueError(f"splash attention takes q [B, T, N, H] and k = v [B, T, K, H] with K dividing N, "
                         f"got q{q.shape} k{k.shape} v{v.shape}")
    tp = padded_length(t)
    kernel = _kernel(n, tp, block_size(tp), bool(interpret))
    # splash takes heads first, one batch row at a time, and applies no 1/sqrt(H) itself
    scale = jnp.asarray(1.0 / h ** 0.5, q.dtype)

    def heads_first(x):
        x = jnp.swapaxes(x, 1, 2)  # [B, heads, T, H]
        return jnp.pad(x, ((0, 0), (0, 0), (0, tp - t), (0, 0))) if tp != t else x

    if segment_ids is None:
        out = jax.vmap(kernel)(heads_first(q * scale), heads_first(k), heads_first(v))  # [B, N, Tp, H]
    else:
        from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

        ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, tp - t)), constant_values=-1)
        out = jax.vmap(lambda q_, k_, v_, s_: kernel(q_, k_, v_, segment_ids=SegmentIds(q=s_, kv=s_)))(
            heads_first(q * scale), heads_first(k), heads_first(v), ids)
    return jnp.swapaxes(out[:, :, :t], 1, 2).astype(q.dtype)


# ---------------------------------------------------------------------------------------------------
# Ragged paged attention over a combined page pool (jaxgpt/paged.py)

KV_BLOCK_POSITIONS = 512  # positions of cache a kernel block reads (whole pages); the kernel's own default is
Q_BLOCK = 32              # 128 pages and 32 queries, but picks by asking the device, which a CPU compiling
                          # for a TPU target cannot answer: so chosen here


def ragged_paged_supported(q_shape: tuple, pool_shape: tuple, dtype) -> bool:
    """Whether the kernel takes a [T, N, H] query over a combined pool [P, page, 2K, H] of `dtype`: a float
    pool whose 2K heads the kernel can tile (its own rule: a multiple of 8 packed rows, or 1, 2, 4, 8), and
    H a multiple of 128 (the kernel keeps its softmax sums 128 lanes wide and widens them to H by repeating:
    GPT-2's heads of 64 are not taken)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

    if len(pool_shape) != 4 or not jnp.issubdtype(dtype, jnp.floating) or q_shape[2] != pool_shape[3]:
        return False
    if q_shape[2] % LANES:
        return False
    if q_shape[1] % (pool_shape[2] // 2):
        return False
    try:
        rpa.get_min_heads_per_blk(q_shape[1], pool_shape[2], dtype, dtype)
    except ValueError:
        return False
    return True


def ragged_paged_attention(q_TxNxH, kv_pages, token_rows_T, limits_T, block_tables_RxM) -> jax.Array:
    """`paged.paged_attention` over a combined pool by JAX's Pallas ragged paged attention kernel, for the
    engine's layout of a step: each row's tokens contiguous, rows in order from row 0, every token that
    sees something (limit > 0) before the padding, and a row's tokens at its last positions (limits
    kv_len - q_len + 1 .. kv_len). Row r's q extent and kv length come from its tokens; rows with no token
    are past `num_seqs`; padding tokens get zeros. -> [T, N, H] in q's dtype."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as kernel

    t, _, h = q_TxNxH.shape
    r, width = block_tables_RxM.shape
    real = limits_T > 0
    q_lens = jax.ops.segment_sum(real.astype(jnp.int32), token_rows_T, num_segments=r)
    kv_lens = jnp.maximum(jax.ops.segment_max(jnp.where(real, limits_T, 0), token_rows_T, num_segments=r), 0)
    cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
    num_seqs = jnp.sum(q_lens > 0, dtype=jnp.int32)[None]
    pages_per_block = min(width, max(1, KV_BLOCK_POSITIONS // kv_pages.shape[1]))
    out = kernel(q_TxNxH.astype(kv_pages.dtype), kv_pages, kv_lens.astype(jnp.int32),
                 block_tables_RxM.astype(jnp.int32), cu_q_lens, num_seqs, sm_scale=1.0 / h ** 0.5,
                 num_kv_pages_per_block=pages_per_block, num_queries_per_block=min(t, Q_BLOCK))
    return jnp.where(real[:, None, None], out, 0).astype(q_TxNxH.dtype)
