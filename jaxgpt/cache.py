"""KVCache: an immutable pytree of preallocated keys and values with per-row fill lengths."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import struct

from jaxgpt.checks import is_int
from jaxgpt.config import GPTConfig


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """How a layer's keys (or values) are stored and written; it owns the buffer's shape. The portable
    layout: [B, K, S, H], each (row, head) one contiguous [S, H] matrix, written by one scatter. A backend
    may hand the cache a subclass that stores the same values differently."""

    def shape(self, batch: int, kv_heads: int, max_len: int, head_dim: int) -> tuple[int, ...]:
        return (batch, kv_heads, max_len, head_dim)

    def read(self, buf: jax.Array, batch: int) -> jax.Array:
        """A stored buffer as [B, K, S, H]."""
        return buf

    def write(self, buf: jax.Array, new_BxKxTxH: jax.Array, lengths_B: jax.Array, layer=None) -> jax.Array:
        """buf (or layer `layer` of stacked [L, ...] buffers) with new written at positions
        lengths[b] .. lengths[b] + T - 1 of each row b."""
        b, _, t, _ = new_BxKxTxH.shape
        rows = jnp.arange(b)[:, None]
        positions = lengths_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        new_BxTxKxH = new_BxKxTxH.swapaxes(1, 2).astype(buf.dtype)  # the scatter's update order
        at = (rows, slice(None), positions) if layer is None else (layer, rows, slice(None), positions)
        # (KVCache.overflow keeps positions inside the buffer)
        return buf.at[at].set(new_BxTxKxH, mode="promise_in_bounds")


@struct.dataclass
class KVCache:
    """Keys and values of every layer for B rows of up to `max_len` positions; `lengths` int32 [B] counts
    each row's filled positions. `k`, `v`: one buffer per layer in `layout`'s form (a tuple, or one stacked
    [L, ...] array with `scan_layers`); `layer(i)` shows layer i as [B, K, S, H]."""

    k: Any
    v: Any
    lengths: jax.Array
    layout: CacheLayout = struct.field(pytree_node=False, default=CacheLayout())

    @classmethod
    def create(cls, config: GPTConfig, batch_size: int, max_len: int, dtype=None,
               layout: Optional[CacheLayout] = None) -> "KVCache":
        """An empty cache for `batch_size` rows of up to `max_len` positions, in the compute dtype."""
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if not is_int(max_len) or not 1 <= max_len <= config.block_size:
            raise ValueError(f"max_len must be an integer in [1, block_size={config.block_size}], got {max_len!r}")
        layout = CacheLayout() if layout is None else layout
        dtype = config.compute_dtype if dtype is None else jnp.dtype(dtype)
        shape = layout.shape(int(batch_size), config.n_kv_head, int(max_len), config.head_dim)
        if config.scan_layers:
            k, v = (jnp.zeros((config.n_layer,) + shape, dtype) for _ in range(2))
        else:
            k, v = (tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layer)) for _ in range(2))
        return cls(k=k, v=v, lengths=jnp.zeros((batch_size,), jnp.int32), layout=layout)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[-2] if isinstance(self.k, tuple) else self.k.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values: 2 * L * B * K * max_len * H * itemsize."""
        return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves((self.k, self.v)))

    def layer(self, i) -> tuple[jax.Array, jax.Array]:
        """Layer i's keys and values, each [B, K, S, H]."""
        return self.layout.read(self.k[i], self.batch_size), self.layout.read(self.v[i], self.batch_size)

    def first(self, n: int) -> "KVCache":
        """The first n rows as a cache of their own (a copy of those rows only); `merge_first` writes them
        back. (A view of the shared buffers, sliced after each layer's write, made XLA:CPU fuse the write
        into the slice and copy every row's buffer at every step: a lone request in 32 slots decoded at
        0.26x of one slot.)"""
        return self.slot(0, n)

    def merge_first(self, view: "KVCache") -> "KVCache":
        """This cache with a `first` view's rows and lengths written back."""
        return self.put_slot(0, view)

    def write(self, i, k_BxKxTxH: jax.Array, v_BxKxTxH: jax.Array) -> "KVCache":
        """Layer i's new keys and values written at each row's `lengths`; `i` is a Python int, or a
        traced index into stacked buffers."""
        def put(layers, new):
            if isinstance(layers, tuple):
                return layers[:i] + (self.layout.write(layers[i], new, self.lengths),) + layers[i + 1:]
            return self.layout.write(layers, new, self.lengths, i)

        return self.replace(k=put(self.k, k_BxKxTxH), v=put(self.v, v_BxKxTxH))

    def _map_rows(self, fn) -> "KVCache":
        """Every layer's buffer through fn(buf, batch_axis, rows_per_slot): a layout stores the batch
        first (or batch-major, joined with the kv heads), after the layer axis of stacked buffers."""
        def one(buf, axis):
            return fn(buf, axis, buf.shape[axis] // self.batch_size)
        if isinstance(self.k, tuple):
            return self.replace(k=tuple(one(b, 0) for b in self.k), v=tuple(one(b, 0) for b in self.v))
        return self.replace(k=one(self.k, 1), v=one(self.v, 1))

    def slot(self, i: jax.Array, count: int = 1) -> "KVCache":
        """Rows i .. i + count - 1 (i an int or traced int32) as a cache of batch `count`."""
        i = jnp.asarray(i, jnp.int32)
        one = self._map_rows(lambda buf, axis, r: jax.lax.dynamic_slice_in_dim(buf, i * r, count * r, axis))
        return one.replace(lengths=jax.lax.dynamic_slice_in_dim(self.lengths, i, count))

    def put_slot(self, i: jax.Array, one: "KVCache") -> "KVCache":
        """This cache with rows i .. i + one.batch_size - 1 replaced by `one` (from `slot`)."""
        i = jnp.asarray(i, jnp.int32)
        k_v = iter(jax.tree_util.tree_leaves((one.k, one.v)))
        out = self._map_rows(lambda buf, axis, r: jax.lax.dynamic_update_slice_in_dim(buf, next(k_v), i * r, axis))
        return out.replace(lengths=jax.lax.dynamic_update_slice_in_dim(self.lengths, one.lengths, i, 0))

    def copy_slot(self, src: jax.Array, dst: jax.Array) -> "KVCache":
        """Row `dst` made a copy of row `src`, keys, values and length (prefix reuse)."""
        return self.put_slot(dst, self.slot(src))

    def advance(self, n: jax.Array) -> "KVCache":
        """Mark `n` (int or int [B]) more positions of each row as filled."""
        return self.replace(lengths=self.lengths + jnp.asarray(n, jnp.int32))

    def overflow(self, num_tokens: int) -> jax.Array:
        """bool [B]: rows that `num_tokens` more positions would overflow; a ValueError where that is
        known outside jit (under jit the model turns those rows' logits to NaN)."""
        if num_tokens > self.max_len:
            raise ValueError(f"{num_tokens} tokens do not fit a KV cache of max_len {self.max_len}")
        over = self.lengths + num_tokens > self.max_len
        if not isinstance(over, jax.core.Tracer) and bool(over.any()):
            rows = [int(r) for r in jnp.flatnonzero(over)]
            raise ValueError(f"writing {num_tokens} token(s) overflows the KV cache (max_len {self.max_len}) in "
                             f"row(s) {rows} with lengths {[int(self.lengths[r]) for r in rows]}; create a "
                             "larger cache")
        return over


def cache_bytes(config: GPTConfig, batch_size: int, max_len: int, dtype=None) -> int:
    """KV cache size in bytes without allocating it."""
    itemsize = jnp.dtype(config.compute_dtype if dtype is None else dtype).itemsize
    return 2 * config.n_layer * batch_size * config.n_kv_head * max_len * config.head_dim * itemsize
