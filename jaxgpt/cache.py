"""KVCache: an immutable pytree of preallocated keys and values with per-row fill lengths.

A cache of dtype int8 stores each key and value vector (one row, kv head and position) as int8 with one
float32 scale, max |x| / 127 over the head dimension, and reads it back as q * scale: about half of
bfloat16's bytes and a quarter of float32's for head_dim 64, at the cost of rounding keys and values.
"""

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

    def heads_axis(self) -> Optional[int]:
        """The axis of `shape`'s (and `scale_shape`'s) form that holds only the kv heads, which a tensor
        mesh axis may split; None where heads share an axis with other things."""
        return 1

    def read(self, buf: jax.Array, batch: int) -> jax.Array:
        """A stored buffer as [B, K, S, H]."""
        return buf

    def write(self, buf: jax.Array, new_BxKxTxH: jax.Array, lengths_B: jax.Array, layer=None) -> jax.Array:
        """buf (or layer `layer` of stacked [L, ...] buffers) with new written at positions
        lengths[b] .. lengths[b] + T - 1 of each row b."""
        new_BxTxKxH = new_BxKxTxH.swapaxes(1, 2).astype(buf.dtype)  # the scatter's update order
        # (KVCache.overflow keeps positions inside the buffer)
        return buf.at[_at_positions(new_BxKxTxH, lengths_B, layer)].set(new_BxTxKxH, mode="promise_in_bounds")

    def write_slots(self, buf: jax.Array, new_GxKxWxH: jax.Array, slots_G: jax.Array, layer=None) -> jax.Array:
        """buf (or layer `layer` of stacked buffers) with new[g] at positions 0 .. W - 1 of row slots[g]
        (packed prompts, `KVCache.write_slots`): one dynamic_update_slice per row, in place."""
        return update_blocks(buf, new_GxKxWxH[:, None], slots_G, layer)

    # An int8 cache's scales, one float32 per (row, kv head, position). A layout that stores values
    # otherwise stores these its own way too.

    def scale_shape(self, batch: int, kv_heads: int, max_len: int) -> tuple[int, ...]:
        return (batch, kv_heads, max_len)

    def read_scale(self, buf: jax.Array, batch: int) -> jax.Array:
        """Stored scales as [B, K, S]."""
        return buf

    def write_scale(self, buf: jax.Array, new_BxKxT: jax.Array, lengths_B: jax.Array, layer=None) -> jax.Array:
        """`write` for scales: new [B, K, T] at positions lengths[b] .. lengths[b] + T - 1 of each row b."""
        new_BxTxK = new_BxKxT.swapaxes(1, 2).astype(buf.dtype)
        return buf.at[_at_positions(new_BxKxT, lengths_B, layer)].set(new_BxTxK, mode="promise_in_bounds")

    def write_slots_scale(self, buf: jax.Array, new_GxKxW: jax.Array, slots_G: jax.Array, layer=None) -> jax.Array:
        """`write_slots` for scales: new[g] [K, W] at positions 0 .. W - 1 of row slots[g]."""
        return update_blocks(buf, new_GxKxW[:, None], slots_G, layer)


def update_blocks(buf: jax.Array, blocks_G: jax.Array, first_G: jax.Array, layer=None) -> jax.Array:
    """buf (or layer `layer` of stacked buffers) with each block blocks[g] (as many axes as one layer's
    buffer) written from index first[g] of its first axis and 0 of the others: one dynamic_update_slice
    per block, in place."""
    zero = jnp.zeros((), jnp.int32)
    for g in range(blocks_G.shape[0]):
        block, start = blocks_G[g].astype(buf.dtype), (first_G[g],) + (zero,) * (blocks_G.ndim - 2)
        if layer is not None:
            block, start = block[None], (jnp.asarray(layer, jnp.int32),) + start
        buf = jax.lax.dynamic_update_slice(buf, block, start)
    return buf


def _at_positions(new: jax.Array, lengths_B: jax.Array, layer=None) -> tuple:
    """The scatter index of positions lengths[b] .. lengths[b] + T - 1 of each row b (of layer `layer`)
    in a [B, K, S, ...] buffer, for new values [B, K, T, ...] (updates [B, T, K, ...])."""
    b, t = new.shape[0], new.shape[2]
    rows = jnp.arange(b)[:, None]
    positions = lengths_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return (rows, slice(None), positions) if layer is None else (layer, rows, slice(None), positions)


def quantize_kv(x_BxKxTxH: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per vector: (q int8 [..., H], scale float32 [...]) with x ~= q * scale, scale =
    max |x| / 127 over the last axis (0 for an all-zero vector, whose q is 0)."""
    x = x_BxKxTxH.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    q = jnp.clip(jnp.round(x * inv[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


def dequantize_kv(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """q [..., H] int8 times scale [...] (float32) in `dtype`."""
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def _is_int8(dtype) -> bool:
    return jnp.dtype(dtype) == jnp.int8


@struct.dataclass
class KVCache:
    """Keys and values of every layer for B rows of up to `max_len` positions; `lengths` int32 [B] counts
    each row's filled positions. `k`, `v`: one buffer per layer in `layout`'s form (a tuple, or one stacked
    [L, ...] array with `scan_layers`); `layer(i)` shows layer i as [B, K, S, H]. An int8 cache also holds
    `k_scale`, `v_scale` (float32, one per row, kv head and position, in `layout.scale_shape`'s form, a
    tuple or stacked like `k`); a float cache holds None there."""

    k: Any
    v: Any
    lengths: jax.Array
    layout: CacheLayout = struct.field(pytree_node=False, default=CacheLayout())
    k_scale: Any = None
    v_scale: Any = None
    # a view of the first batch_size rows of buffers that hold `buffer_rows` rows (`view_first`); None: the
    # buffers hold exactly batch_size rows
    buffer_rows: Optional[int] = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, config: GPTConfig, batch_size: int, max_len: int, dtype=None,
               layout: Optional[CacheLayout] = None) -> "KVCache":
        """An empty cache for `batch_size` rows of up to `max_len` positions, in `dtype` (default the
        compute dtype); dtype "int8" (or jnp.int8) quantizes keys and values as they are written, with a
        float32 scale per row, kv head and position, and reads them back in the compute dtype."""
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if not is_int(max_len) or not 1 <= max_len <= config.block_size:
            raise ValueError(f"max_len must be an integer in [1, block_size={config.block_size}], got {max_len!r}")
        layout = CacheLayout() if layout is None else layout
        dtype = _cache_dtype(config, dtype)
        b, s = int(batch_size), int(max_len)

        def buffers(shape, dtype):
            if config.scan_layers:
                return jnp.zeros((config.n_layer,) + shape, dtype)
            return tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layer))

        shape = layout.shape(b, config.n_kv_head, s, config.head_dim)
        k, v = buffers(shape, dtype), buffers(shape, dtype)
        scales = {}
        if _is_int8(dtype):
            scale_shape = layout.scale_shape(b, config.n_kv_head, s)
            scales = dict(k_scale=buffers(scale_shape, jnp.float32), v_scale=buffers(scale_shape, jnp.float32))
        return cls(k=k, v=v, lengths=jnp.zeros((batch_size,), jnp.int32), layout=layout, **scales)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[-2] if isinstance(self.k, tuple) else self.k.shape[-2]

    @property
    def quantized(self) -> bool:
        """Whether keys and values are stored as int8 with scales."""
        return self.k_scale is not None

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values (and an int8 cache's scales): 2 * L * B * K * max_len * H *
        itemsize, plus 2 * L * B * K * max_len * 4 for the scales."""
        leaves = jax.tree_util.tree_leaves((self.k, self.v, self.k_scale, self.v_scale))
        return sum(a.size * jnp.dtype(a.dtype).itemsize for a in leaves)

    def layer(self, i, dtype=None) -> tuple[jax.Array, jax.Array]:
        """Layer i's keys and values, each [B, K, S, H]: as stored, or an int8 cache's dequantized, in
        `dtype` (default float32). (A view's rows are sliced out of its buffers: a copy.)"""
        b, rows = self.batch_size, self.buffer_rows or self.batch_size

        def read(buf):
            out = self.layout.read(buf, rows)
            return out if rows == b else out[:b]

        def read_scale(buf):
            out = self.layout.read_scale(buf, rows)
            return out if rows == b else out[:b]

        if not self.quantized:
            return read(self.k[i]), read(self.v[i])
        return tuple(dequantize_kv(read(q[i]), read_scale(s[i]), dtype or jnp.float32)
                     for q, s in ((self.k, self.k_scale), (self.v, self.v_scale)))

    def on_mesh(self, mesh, axis: str = "tensor", *, inside_jit: bool = False, abstract: bool = False) -> "KVCache":
        """This cache placed on `mesh`: keys and values (and an int8 cache's scales) split by kv head over
        mesh axis `axis`, as tensor parallelism splits attention's heads, where the layout keeps the heads
        on an axis of their own and the axis's size divides them; replicated otherwise (lengths always).
        `inside_jit`: as sharding constraints in a traced program (a cache that a program allocates);
        `abstract`: a cache of shapes (jax.eval_shape's) as ShapeDtypeStructs carrying those shardings
        (a program's abstract argument, jaxgpt-aot's)."""
        from jax.sharding import NamedSharding, PartitionSpec as P

        size = dict(mesh.shape).get(axis, 1)
        at = self.layout.heads_axis()
        stacked = not isinstance(self.k, tuple)
        if abstract:
            put = lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)  # noqa: E731
        else:
            put = jax.lax.with_sharding_constraint if inside_jit else jax.device_put

        def place(buf):
            parts = [None] * buf.ndim
            if at is not None and size > 1 and buf.shape[at + stacked] % size == 0:
                parts[at + stacked] = axis
            return put(buf, NamedSharding(mesh, P(*parts)))

        return self.replace(k=jax.tree.map(place, self.k), v=jax.tree.map(place, self.v),
                            k_scale=jax.tree.map(place, self.k_scale), v_scale=jax.tree.map(place, self.v_scale),
                            lengths=put(self.lengths, NamedSharding(mesh, P())))

    def view_first(self, n: int) -> "KVCache":
        """The first n rows as a cache of batch n over the same buffers (no copy): writes go to those rows
        of the buffers; a backend's `cache_attention` reads them in place, `layer` copies them out.
        `merge_view` gives the whole cache back."""
        return self.replace(lengths=self.lengths[:n], buffer_rows=self.buffer_rows or self.batch_size)

    def merge_view(self, view: "KVCache") -> "KVCache":
        """This cache with a `view_first` view's buffers and lengths."""
        return view.replace(lengths=jax.lax.dynamic_update_slice_in_dim(self.lengths, view.lengths, 0, 0),
                            buffer_rows=self.buffer_rows)

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
        """Layer i's new keys and values written at each row's `lengths` (an int8 cache's quantized, with
        their scales); `i` is a Python int, or a traced index into stacked buffers."""
        def put(layers, new, write):
            if isinstance(layers, tuple):
                return layers[:i] + (write(layers[i], new, self.lengths),) + layers[i + 1:]
            return write(layers, new, self.lengths, i)

        if not self.quantized:
            return self.replace(k=put(self.k, k_BxKxTxH, self.layout.write),
                                v=put(self.v, v_BxKxTxH, self.layout.write))
        (kq, ks), (vq, vs) = quantize_kv(k_BxKxTxH), quantize_kv(v_BxKxTxH)
        return self.replace(k=put(self.k, kq, self.layout.write), v=put(self.v, vq, self.layout.write),
                            k_scale=put(self.k_scale, ks, self.layout.write_scale),
                            v_scale=put(self.v_scale, vs, self.layout.write_scale))

    def write_slots(self, i: int, k_GxKxWxH: jax.Array, v_GxKxWxH: jax.Array, slots_G: jax.Array,
                    k_scale_GxKxW=None, v_scale_GxKxW=None) -> "KVCache":
        """Layer i's keys and values for positions 0 .. W - 1 of rows slots[g] (an int8 cache's quantized,
        with their scales, unless given as int8 with `k_scale`, `v_scale`). Lengths stay: the caller sets
        them. (Packed prompts: `PackedCache.write_into`.)"""
        def put(layers, new, write):
            if isinstance(layers, tuple):
                return layers[:i] + (write(layers[i], new, slots_G),) + layers[i + 1:]
            return write(layers, new, slots_G, i)

        lay = self.layout
        if not self.quantized:
            return self.replace(k=put(self.k, k_GxKxWxH, lay.write_slots), v=put(self.v, v_GxKxWxH, lay.write_slots))
        if k_scale_GxKxW is None:
            (kq, ks), (vq, vs) = quantize_kv(k_GxKxWxH), quantize_kv(v_GxKxWxH)
        else:
            kq, ks, vq, vs = k_GxKxWxH, k_scale_GxKxW, v_GxKxWxH, v_scale_GxKxW
        return self.replace(k=put(self.k, kq, lay.write_slots), v=put(self.v, vq, lay.write_slots),
                            k_scale=put(self.k_scale, ks, lay.write_slots_scale),
                            v_scale=put(self.v_scale, vs, lay.write_slots_scale))

    def positions(self, num_tokens: int) -> jax.Array:
        """int32 [B, T]: the positions of `num_tokens` new tokens in each row (from its length on)."""
        return self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]

    def _buffers(self) -> tuple:
        """The fields that hold per-row buffers: keys and values, and an int8 cache's scales."""
        return ("k", "v", "k_scale", "v_scale") if self.quantized else ("k", "v")

    def _map_rows(self, fn, other: Optional["KVCache"] = None) -> "KVCache":
        """Every layer's buffer (and an int8 cache's scales) through fn(buf, batch_axis, rows_per_slot,
        other_buf): a layout stores the batch first (or batch-major, joined with the kv heads), after the
        layer axis of stacked buffers; `other_buf` is `other`'s matching buffer (None without `other`)."""
        def one(buf, other_buf, axis):
            return fn(buf, axis, buf.shape[axis] // self.batch_size, other_buf)

        out = {}
        for name in self._buffers():
            mine, theirs = getattr(self, name), None if other is None else getattr(other, name)
            if isinstance(mine, tuple):
                out[name] = tuple(one(b, None if theirs is None else theirs[j], 0) for j, b in enumerate(mine))
            else:
                out[name] = one(mine, theirs, 1)
        return self.replace(**out)

    def slot(self, i: jax.Array, count: int = 1, window: Optional[int] = None) -> "KVCache":
        """Rows i .. i + count - 1 (i an int or traced int32) as a cache of batch `count`; with `window` (a
        Python int) only their positions 0 .. window - 1, a cache of max_len `window` (what a prefill chunk
        ending by then reads and writes: the copy out and back, and XLA's attention over it, cost by
        positions, not by filled ones)."""
        i = jnp.asarray(i, jnp.int32)
        window = self.max_len if window is None else window
        if not is_int(window) or not 1 <= window <= self.max_len:
            raise ValueError(f"window must be an integer in [1, max_len={self.max_len}], got {window!r}")

        one = self._map_rows(lambda buf, axis, r, _: jax.lax.dynamic_slice_in_dim(buf, i * r, count * r, axis))
        if window < self.max_len:  # positions: the axis before the head size (keys, values), the last (scales)
            def cut(tree, from_end):
                return jax.tree.map(lambda b: jax.lax.slice_in_dim(b, 0, window, axis=b.ndim - from_end), tree)
            one = one.replace(k=cut(one.k, 2), v=cut(one.v, 2), k_scale=cut(one.k_scale, 1),
                              v_scale=cut(one.v_scale, 1))
        return one.replace(lengths=jax.lax.dynamic_slice_in_dim(self.lengths, i, count))

    def put_slot(self, i: jax.Array, one: "KVCache") -> "KVCache":
        """This cache with rows i .. i + one.batch_size - 1 replaced by `one` (from `slot`; a window's
        positions 0 .. one.max_len - 1 only)."""
        i = jnp.asarray(i, jnp.int32)
        if one.quantized != self.quantized:
            raise ValueError("put_slot: an int8 cache's rows and a float cache's do not mix")
        out = self._map_rows(lambda buf, axis, r, new: jax.lax.dynamic_update_slice_in_dim(buf, new, i * r, axis), one)
        return out.replace(lengths=jax.lax.dynamic_update_slice_in_dim(self.lengths, one.lengths, i, 0))

    def put_positions(self, i: jax.Array, one: "KVCache", start: jax.Array, count: int) -> "KVCache":
        """This cache with positions start .. start + count - 1 of rows i .. i + one.batch_size - 1 taken
        from `one` (from `slot`, any window holding them), and their lengths `one`'s: what a prefill chunk
        wrote, without the rest of the window. (Putting the whole window back, a compiler may copy the whole
        cache around a one-token write: bench/README.md, "Prefill windows".)"""
        i, start = jnp.asarray(i, jnp.int32), jnp.asarray(start, jnp.int32)
        if one.quantized != self.quantized:
            raise ValueError("put_positions: an int8 cache's rows and a float cache's do not mix")
        zero = jnp.zeros((), jnp.int32)

        def put(buf, new, from_end):
            at, axis = buf.ndim - from_end, 0 if isinstance(self.k, tuple) else 1  # (stacked: after the layers)
            r = buf.shape[axis] // self.batch_size
            part = jax.lax.dynamic_slice_in_dim(new, start, count, at)
            starts = [zero] * buf.ndim
            starts[axis], starts[at] = i * r, start
            return jax.lax.dynamic_update_slice(buf, part.astype(buf.dtype), starts)

        out = {name: jax.tree.map(lambda b, n, f=(2 if name in ("k", "v") else 1): put(b, n, f),
                                  getattr(self, name), getattr(one, name))
               for name in self._buffers()}
        return self.replace(lengths=jax.lax.dynamic_update_slice_in_dim(self.lengths, one.lengths, i, 0), **out)

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


@struct.dataclass
class PackedCache(KVCache):
    """Several prompts packed into one row of N tokens, for one forward: token n belongs to prompt
    `segments[n]` and sits at position `token_positions[0, n]` of it. Attention runs within each prompt
    (token n sees the earlier tokens of its own segment only: `attention.packed_attention`); the buffers
    (batch 1, max_len N, the portable layout) keep every layer's keys and values in packed order, for
    `write_into` to place into each prompt's row of the real cache afterwards."""

    segments: Any = None  # int32 [N]
    token_positions: Any = None  # int32 [1, N]
    window: Optional[int] = struct.field(pytree_node=False, default=None)  # the longest segment, if bounded

    @classmethod
    def pack(cls, config: GPTConfig, segments_N: jax.Array, positions_N: jax.Array, dtype=None,
             window: Optional[int] = None) -> "PackedCache":
        """Empty buffers for the packed tokens in `dtype` (the real cache's: an int8 one's prompts attend
        to their rounded keys and values, as they would in their own rows); `window`: no segment is longer
        (attention then reads only that far back: `attention.packed_attention`)."""
        n = segments_N.shape[0]
        layout, dtype = CacheLayout(), _cache_dtype(config, dtype)

        def buffers(shape, dtype):
            if config.scan_layers:
                return jnp.zeros((config.n_layer,) + shape, dtype)
            return tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layer))

        shape = layout.shape(1, config.n_kv_head, n, config.head_dim)
        scales = {}
        if _is_int8(dtype):
            scale_shape = layout.scale_shape(1, config.n_kv_head, n)
            scales = dict(k_scale=buffers(scale_shape, jnp.float32), v_scale=buffers(scale_shape, jnp.float32))
        return cls(k=buffers(shape, dtype), v=buffers(shape, dtype), lengths=jnp.zeros((1,), jnp.int32),
                   segments=segments_N, token_positions=positions_N[None, :].astype(jnp.int32), window=window,
                   **scales)

    def write_into(self, cache: KVCache, offsets_G: jax.Array, slots_G: jax.Array, width: int) -> KVCache:
        """`cache` with every layer's packed keys and values (as stored: an int8 pack's with its scales) of
        tokens offsets[g] .. offsets[g] + width - 1 at positions 0 .. width - 1 of row slots[g]
        (`KVCache.write_slots`). Past a segment's end that is the next one's tokens or padding: positions
        beyond the row's length, which nothing reads."""
        at_GxW = offsets_G[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]

        def rows(buf):  # [1, K, N, ...] -> [G, K, width, ...], the packed row padded by width at its end
            padded = jnp.pad(buf[0], [(0, 0), (0, width)] + [(0, 0)] * (buf.ndim - 3))
            return jnp.moveaxis(padded[:, at_GxW], 1, 0)

        for i in range(len(self.k) if isinstance(self.k, tuple) else self.k.shape[0]):
            scales = {}
            if self.quantized:
                scales = dict(k_scale_GxKxW=rows(self.k_scale[i]), v_scale_GxKxW=rows(self.v_scale[i]))
            cache = cache.write_slots(i, rows(self.k[i]), rows(self.v[i]), slots_G, **scales)
        return cache

    def positions(self, num_tokens: int) -> jax.Array:
        return self.token_positions

    def overflow(self, num_tokens: int) -> jax.Array:
        return jnp.zeros((1,), bool)


def _cache_dtype(config: GPTConfig, dtype) -> jnp.dtype:
    dtype = jnp.dtype(config.compute_dtype if dtype is None else dtype)
    if not (jnp.issubdtype(dtype, jnp.floating) or _is_int8(dtype)):
        raise ValueError(f"a KV cache's dtype must be a float dtype or int8, got {dtype}")
    return dtype


def cache_bytes(config: GPTConfig, batch_size: int, max_len: int, dtype=None) -> int:
    """KV cache size in bytes without allocating it (an int8 cache's float32 scales included)."""
    dtype = _cache_dtype(config, dtype)
    per_vector = config.head_dim * dtype.itemsize + (4 if _is_int8(dtype) else 0)
    return 2 * config.n_layer * batch_size * config.n_kv_head * max_len * per_vector
