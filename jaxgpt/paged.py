"""A paged KV cache: a pool of fixed-size pages that many requests share through block tables.

Each layer's keys (and values) are one pool [P, K, page, H] ("split", the default): page p holds `page`
consecutive positions of one request, for every kv head. The "combined" layout (a float pool only) keeps a
layer's keys and values in one buffer [P, page, 2K, H], key head k at 2k and its values at 2k + 1: the
layout JAX's ragged paged attention kernel for TPUs reads in place (`Backend.paged_layout` says which a
backend wants; `pool_layout` picks it for a pool). A request's block table lists its pages in order, so its position s lies in
page table[s // page] at offset s % page. Pages are handed out as tokens arrive and taken back when a
request ends (jaxgpt/engine/pages.py keeps that account on the host); the cache holds bytes in proportion
to the tokens in use, not to slots x max_len. Page 0 is never a request's: padding tokens write there.

One forward over a flat, ragged list of T tokens (`PagedCache.step`): token t belongs to row rows[t] of
the step (a request), sits at position positions[t] of it, and writes its keys and values at flat slot
slots[t] = page * page_size + offset. It then attends to its own row's positions 0 .. positions[t]: those
written by earlier steps and those of its own chunk written just before, in the same layer. Decoding
requests (one token each) and prompt chunks share that one forward, so every weight is read once a step.

`paged_attention` is the portable form in plain JAX (any backend; the oracle the native and Pallas kernels
are tested against): it walks the block tables a few pages at a time, each token gathering its own row's
pages, with a running (online) softmax, so it holds [T, K, tile, H] at once whatever the lengths. It reads
any layout.

The "flat" layout [P, page, K*H] (a float pool only) keeps each position's heads side by side in the last
dimension: a TPU stores an array in tiles of 8 x 128 over its last two dimensions, so a head of 64 in the
last dimension of the split or combined layouts is padded to 128, twice its bytes (GPT-2's heads: 64).
`pool_layout` picks it where a backend asks for "combined" and the heads are not a multiple of 128 wide
(the Pallas kernel's condition), which the portable form then reads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import struct

from jaxgpt.cache import CacheLayout, KVCache, _cache_dtype, _is_int8, dequantize_kv, quantize_kv
from jaxgpt.checks import is_int
from jaxgpt.config import GPTConfig

# positions a step of `paged_attention`'s walk covers (whole pages: at least one)
TILE_POSITIONS = 128

LAYOUTS = ("split", "combined", "flat")
LANES = 128  # a TPU tile's last dimension


def pool_shape(num_pages: int, kv_heads: int, page_size: int, head_dim: int, layout: str = "split") -> tuple:
    """One layer's buffer: [P, K, page, H] for each of keys and values ("split"), [P, page, 2K, H]
    holding both ("combined"), or [P, page, K*H] for each ("flat")."""
    if layout == "combined":
        return (num_pages, page_size, 2 * kv_heads, head_dim)
    if layout == "flat":
        return (num_pages, page_size, kv_heads * head_dim)
    return (num_pages, kv_heads, page_size, head_dim)


def pool_layout(config: GPTConfig, backend=None, dtype=None) -> str:
    """The layout of a pool for `backend` (its `paged_layout`; "split" without one): "split" for an int8
    pool whatever the backend wants (its per-vector scales are kept split; "combined" and "flat" are float
    only); "flat" where the backend wants "combined" for heads whose width is not a multiple of 128 (its
    kernel does not take them, and a TPU would pad them to 128 in the combined layout)."""
    if _is_int8(_cache_dtype(config, dtype)):
        return "split"
    layout = getattr(backend, "paged_layout", "split") or "split"
    return "flat" if layout == "combined" and config.head_dim % LANES else layout


@dataclasses.dataclass(frozen=True)
class _PoolHeads(CacheLayout):
    """A pool's `layout` for `KVCache.on_mesh`: the axis its kv heads lie on (split: 1; combined and flat:
    2, each head's keys and values, or its H columns, contiguous there), which a tensor axis may split."""

    axis: int = 1

    def heads_axis(self) -> Optional[int]:
        return self.axis


def pool_bytes(config: GPTConfig, num_pages: int, page_size: int, dtype=None) -> int:
    """The pool's bytes for every layer's keys and values (an int8 pool's float32 scales included)."""
    dtype = _cache_dtype(config, dtype)
    per_vector = config.head_dim * dtype.itemsize + (4 if _is_int8(dtype) else 0)
    return 2 * config.n_layer * num_pages * page_size * config.n_kv_head * per_vector


@struct.dataclass
class PagedCache(KVCache):
    """The page pool of every layer (`k`, `v`: a tuple of [P, K, page, H] buffers, or stacked [L, ...]
    with `scan_layers`; an int8 pool also `k_scale`, `v_scale` [P, K, page]; with `pool_layout`
    "combined" `k` holds [P, page, 2K, H] keys and values interleaved and `v` is None) and, inside a step, where
    that step's T tokens go: `token_rows` [T] (each token's row), `token_positions` [1, T], `slots` [T]
    (flat write index page * page_size + offset), `limits` [T] (the token sees its row's positions below
    it: position + 1, or 0 for a padding token, which sees nothing) and `block_tables` [R, M] (row r's
    pages in order; padding entries 0). `lengths` is unused ([1] zeros: the model's cache interface)."""

    token_rows: Any = None
    token_positions: Any = None
    slots: Any = None
    limits: Any = None
    block_tables: Any = None
    pool_layout: str = struct.field(pytree_node=False, default="split")

    @classmethod
    def create_pool(cls, config: GPTConfig, num_pages: int, page_size: int, dtype=None,
                    layout: str = "split") -> "PagedCache":
        """An empty pool of `num_pages` pages of `page_size` positions (page 0 included: the null page), in
        `layout` ("split", "combined" or "flat"; an int8 pool is split only)."""
        if layout not in LAYOUTS:
            raise ValueError(f"a page pool's layout is one of {LAYOUTS}, got {layout!r}")
        if not is_int(num_pages) or num_pages < 2:
            raise ValueError(f"num_pages must be an integer >= 2 (page 0 is kept for padding), got {num_pages!r}")
        if not is_int(page_size) or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        dtype = _cache_dtype(config, dtype)
        if layout != "split" and _is_int8(dtype):
            raise ValueError(f"an int8 page pool is split only (its scales are per vector, kept split), not "
                             f"{layout!r}: use layout='split' (jaxgpt.paged.pool_layout picks it)")

        def buffers(shape, dtype):
            if config.scan_layers:
                return jnp.zeros((config.n_layer,) + shape, dtype)
            return tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layer))

        shape = pool_shape(int(num_pages), config.n_kv_head, int(page_size), config.head_dim, layout)
        lengths = jnp.zeros((1,), jnp.int32)
        heads = _PoolHeads(1 if layout == "split" else 2)
        if layout == "combined":
            return cls(k=buffers(shape, dtype), v=None, lengths=lengths, pool_layout=layout, layout=heads)
        scales = {}
        if _is_int8(dtype):
            scales = dict(k_scale=buffers(shape[:-1], jnp.float32), v_scale=buffers(shape[:-1], jnp.float32))
        return cls(k=buffers(shape, dtype), v=buffers(shape, dtype), lengths=lengths, pool_layout=layout,
                   layout=heads, **scales)

    @property
    def page_size(self) -> int:
        return self.k[0].shape[-3 if self.pool_layout == "combined" else -2]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:  # (what one row can hold: its block table's width in positions)
        return self.block_tables.shape[1] * self.page_size

    def step(self, token_rows, positions, slots, limits, block_tables) -> "PagedCache":
        """This pool set up for one ragged step (see the class)."""
        return self.replace(token_rows=token_rows.astype(jnp.int32), token_positions=positions[None].astype(jnp.int32),
                            slots=slots.astype(jnp.int32), limits=limits.astype(jnp.int32),
                            block_tables=block_tables.astype(jnp.int32))

    def pool(self) -> "PagedCache":
        """The pool alone, without a step's token arrays (what the engine keeps between steps)."""
        return self.replace(token_rows=None, token_positions=None, slots=None, limits=None, block_tables=None)

    def write(self, i, k_BxKxTxH: jax.Array, v_BxKxTxH: jax.Array) -> "PagedCache":
        """Layer i's keys and values of the step's tokens ([1, K, T, H]) written at their slots (an int8
        pool's quantized, with their scales; a combined pool's interleaved, one write for both)."""
        ps = self.page_size
        page, offset = self.slots // ps, self.slots % ps
        # a token's vectors: [P, K, page, ...] split, [P, page, 2K, H] combined, [P, page, K*H] flat
        index = (page, slice(None), offset) if self.pool_layout == "split" else (page, offset)

        def put(layers, new_TxKx):
            def one(buf, layer=None):
                at = index if layer is None else (layer,) + index
                return buf.at[at].set(new_TxKx.astype(buf.dtype), mode="promise_in_bounds")
            if isinstance(layers, tuple):
                return layers[:i] + (one(layers[i]),) + layers[i + 1:]
            return one(layers, i)

        k_TxKxH, v_TxKxH = k_BxKxTxH[0].swapaxes(0, 1), v_BxKxTxH[0].swapaxes(0, 1)
        t, kh, h = k_TxKxH.shape
        if self.pool_layout == "combined":
            return self.replace(k=put(self.k, jnp.stack([k_TxKxH, v_TxKxH], axis=2).reshape(t, 2 * kh, h)))
        if self.pool_layout == "flat":
            return self.replace(k=put(self.k, k_TxKxH.reshape(t, kh * h)), v=put(self.v, v_TxKxH.reshape(t, kh * h)))
        if not self.quantized:
            return self.replace(k=put(self.k, k_TxKxH), v=put(self.v, v_TxKxH))
        (kq, ks), (vq, vs) = quantize_kv(k_TxKxH), quantize_kv(v_TxKxH)
        return self.replace(k=put(self.k, kq), v=put(self.v, vq), k_scale=put(self.k_scale, ks),
                            v_scale=put(self.v_scale, vs))

    def layer_pool(self, i) -> tuple:
        """Layer i's (k, v, k_scale, v_scale) pools as stored (scales None for a float pool; a combined
        pool's keys and values both in k, v None)."""
        def pick(layers):
            return None if layers is None else layers[i]
        return pick(self.k), pick(self.v), pick(self.k_scale), pick(self.v_scale)

    def positions(self, num_tokens: int) -> jax.Array:
        return self.token_positions

    def overflow(self, num_tokens: int) -> jax.Array:
        return jnp.zeros((1,), bool)

    def advance(self, n) -> "PagedCache":
        return self


def paged_attention(q_TxNxH, k_pool, v_pool, token_rows_T, limits_T, block_tables_RxM, k_scale=None, v_scale=None,
                    tile_positions: int = TILE_POSITIONS) -> jax.Array:
    """Attention of T ragged queries over a paged cache, in plain JAX: query t (row token_rows[t]) sees
    its row's positions below limits[t], read through block_tables[row]; scores scaled by 1/sqrt(H), the
    softmax in float32. Pools [P, K, page, H] (int8 with float32 scales [P, K, page], or float), flat float
    pools [P, page, K*H], or with v_pool None one combined float pool [P, page, 2K, H] (key head k at 2k, its
    values at 2k + 1); N a multiple of K (grouped queries). A query that sees nothing (limit 0: padding) gets zeros. -> [T, N, H]
    in q's dtype. Walks ceil(max(limits) / tile) tiles of whole pages, so short rows cost short walks."""
    combined = v_pool is None
    k_pool, token_rows_T, limits_T, block_tables_RxM = (
        jnp.asarray(a) for a in (k_pool, token_rows_T, limits_T, block_tables_RxM))
    t, n, h = q_TxNxH.shape
    flat = k_pool.ndim == 3
    if combined or flat:
        ps, kh = k_pool.shape[1], k_pool.shape[2] // (2 if combined else h)
    else:
        ps, kh = k_pool.shape[2:0:-1]
    g = n // kh
    per_tile = max(1, tile_positions // ps)  # pages a step
    m = block_tables_RxM.shape[1]
    tables = jnp.pad(block_tables_RxM, ((0, 0), (0, -m % per_tile)))
    tables_T = tables[token_rows_T]  # [T, M'] each token's own table
    q = q_TxNxH.reshape(t, kh, g, h).astype(jnp.float32) * (1.0 / math.sqrt(h))
    span = per_tile * ps

    def heads_first(x):  # [T, pages, K, ps, H] -> [T, K, span, H] float32
        return x.astype(jnp.float32).transpose(0, 2, 1, 3, 4).reshape(t, kh, span, h)

    def read(pages_TxP):
        if combined:  # [T, pages, ps, 2K, H]: one gather for keys and values
            x = k_pool[pages_TxP].reshape(t, per_tile, ps, kh, 2, h).swapaxes(2, 3)
            return heads_first(x[..., 0, :]), heads_first(x[..., 1, :])
        kv = []
        for pool, scale in ((k_pool, k_scale), (jnp.asarray(v_pool), v_scale)):
            x = pool[pages_TxP]  # [T, pages, K, ps, H] (flat: [T, pages, ps, K*H])
            if flat:
                x = x.reshape(t, per_tile, ps, kh, h).swapaxes(2, 3)
            kv.append(heads_first(x if scale is None else dequantize_kv(x, scale[pages_TxP])))
        return kv

    return _online_softmax(q, read, tables_T, limits_T, per_tile, span).reshape(t, n, h).astype(q_TxNxH.dtype)


def _online_softmax(q_TxKxGxH, read, tables_T, limits_T, per_tile: int, span: int) -> jax.Array:
    """The walk of `paged_attention`: tile j's keys and values `read(pages [T, per_tile])` ([T, K, span, H]
    each), a running max and sum per query head. -> [T, K, G, H] float32 (zeros where nothing is seen)."""
    t, kh, g, h = q_TxKxGxH.shape
    tiles = (jnp.max(limits_T) + span - 1) // span

    def body(j, carry):
        mx, denom, acc = carry
        k, v = read(jax.lax.dynamic_slice_in_dim(tables_T, j * per_tile, per_tile, axis=1))
        s = jnp.einsum("tkgh,tksh->tkgs", q_TxKxGxH, k)
        seen = (j * span + jnp.arange(span, dtype=jnp.int32))[None, :] < limits_T[:, None]  # [T, span]
        s = jnp.where(seen[:, None, None, :], s, -jnp.inf)
        new_mx = jnp.maximum(mx, jnp.max(s, axis=-1))
        safe = jnp.where(jnp.isfinite(new_mx), new_mx, 0.0)
        p = jnp.exp(s - safe[..., None])
        fade = jnp.exp(jnp.where(jnp.isfinite(mx), mx - safe, -jnp.inf))
        denom = denom * fade + jnp.sum(p, axis=-1)
        acc = acc * fade[..., None] + jnp.einsum("tkgs,tksh->tkgh", p, v)
        return new_mx, denom, acc

    init = (jnp.full((t, kh, g), -jnp.inf, jnp.float32), jnp.zeros((t, kh, g), jnp.float32),
            jnp.zeros((t, kh, g, h), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(0, tiles, body, init)
    return jnp.where(denom[..., None] > 0, acc / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)


def attend(q_BxTxNxH, cache: PagedCache, layer, backend=None) -> jax.Array:
    """The model's attention over a paged cache in a step (q [1, T, N, H]): the backend's own kernel where
    it has one for this cache (`Backend.paged_attention`, which may decline with None), else
    `paged_attention`."""
    k, v, ks, vs = cache.layer_pool(layer)
    # (a backend's own kernel is one device's: over a mesh XLA partitions the portable form)
    on_mesh = getattr(backend, "head_mesh", None) is not None or getattr(backend, "batch_mesh", None) is not None
    own: Optional[Any] = None if on_mesh else getattr(backend, "paged_attention", None)
    if own is not None:
        out = own(q_BxTxNxH[0], k, v, cache.token_rows, cache.token_positions[0], cache.limits, cache.block_tables,
                  ks, vs)
        if out is not None:
            return out[None].astype(q_BxTxNxH.dtype)
    return paged_attention(q_BxTxNxH[0], k, v, cache.token_rows, cache.limits, cache.block_tables, ks, vs)[None]
