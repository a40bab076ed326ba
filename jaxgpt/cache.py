"""KVCache: an immutable pytree of preallocated keys and values with per-row fill lengths."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from jaxgpt import kernels
from jaxgpt.config import GPTConfig
from jaxgpt.kernels import cpu


@struct.dataclass
class KVCache:
    """Keys and values of every layer for B rows of up to `max_len` positions; `lengths` int32 [B].

    `lengths[b]` counts the positions of row b that hold real keys; the next token of row b is written at
    position `lengths[b]`. The model takes a cache and returns an updated one; nothing is mutated.

    `k` and `v` hold one [B, K, S, H] buffer per layer (S = max_len): a tuple of L arrays, or one stacked
    [L, B, K, S, H] array for a model with `scan_layers` (the layer scan carries it). Head-major, so that
    each (row, head) is one contiguous [S, H] matrix: attention's matmuls read the cache as it is laid out,
    with no transposing copy per step (bench/README.md), and a NamedSharding can split it by batch or head.
    The CPU kernels store each buffer with B and K merged, [B*K, S, H] (`merged`; see kernels/cpu.py);
    `layer(i)` shows either as [B, K, S, H].
    """

    k: Any
    v: Any
    lengths: jax.Array
    merged: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def create(cls, config: GPTConfig, batch_size: int, max_len: int, dtype=None) -> "KVCache":
        """An empty cache for `batch_size` rows of up to `max_len` positions, in the compute dtype."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len <= config.block_size:
            raise ValueError(f"max_len must be an integer in [1, block_size={config.block_size}], got {max_len!r}")
        dtype = config.compute_dtype if dtype is None else jnp.dtype(dtype)
        merged = kernels.resolve(config.kernels) == "cpu"
        rows = (batch_size * config.n_kv_head,) if merged else (batch_size, config.n_kv_head)
        shape = rows + (max_len, config.head_dim)
        if config.scan_layers:
            k, v = (jnp.zeros((config.n_layer,) + shape, dtype) for _ in range(2))
        else:
            k, v = (tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layer)) for _ in range(2))
        return cls(k=k, v=v, lengths=jnp.zeros((batch_size,), jnp.int32), merged=merged)

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
        k, v = self.k[i], self.v[i]
        if self.merged:
            k, v = (a.reshape(self.batch_size, -1, *a.shape[1:]) for a in (k, v))
        return k, v

    def write(self, i, k_new: jax.Array, v_new: jax.Array) -> "KVCache":
        """Write layer i's new keys/values [B, T, K, H] at each row's `lengths`.

        `i` is a Python int, or a traced index into stacked buffers. One scatter per buffer whatever B.
        """
        write_rows = cpu.write_rows if self.merged else _write_rows  # XLA:CPU: kernels/cpu.py
        return self.replace(k=_write_layer(self.k, i, lambda buf, at: write_rows(buf, k_new, self.lengths, at)),
                            v=_write_layer(self.v, i, lambda buf, at: write_rows(buf, v_new, self.lengths, at)))

    def advance(self, n: jax.Array) -> "KVCache":
        """Mark `n` (int or int [B]) more positions of each row as filled."""
        return self.replace(lengths=self.lengths + jnp.asarray(n, jnp.int32))

    def overflow(self, num_tokens: int) -> jax.Array:
        """bool [B]: rows where writing `num_tokens` more positions would pass `max_len`.

        Raises ValueError when that is known here: `num_tokens` > max_len, or concrete lengths (outside
        jit) that overflow. Under jit the caller gets the mask (the model turns those rows' logits to NaN).
        """
        if num_tokens > self.max_len:
            raise ValueError(f"{num_tokens} tokens do not fit a KV cache of max_len {self.max_len}")
        over = self.lengths + num_tokens > self.max_len
        if not isinstance(over, jax.core.Tracer) and bool(over.any()):
            rows = [int(r) for r in jnp.flatnonzero(over)]
            raise ValueError(f"writing {num_tokens} token(s) overflows the KV cache (max_len {self.max_len}) in "
                             f"row(s) {rows} with lengths {[int(self.lengths[r]) for r in rows]}; create a "
                             "larger cache")
        return over


def _write_rows(buf: jax.Array, new: jax.Array, lengths: jax.Array, layer=None) -> jax.Array:
    """buf [B,K,S,H] (or layer `layer` of a stacked [L,B,K,S,H] buf) with new [B,T,K,H] written at
    positions lengths[b] .. lengths[b] + T - 1 of each row b, as one scatter."""
    b, t = new.shape[:2]
    rows = jnp.arange(b)[:, None]
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    at = (rows, slice(None), positions) if layer is None else (layer, rows, slice(None), positions)
    # (the overflow check above keeps positions inside the buffer)
    return buf.at[at].set(new.astype(buf.dtype), mode="promise_in_bounds")


def _write_layer(layers: Any, i, write: Callable) -> Any:
    """`write(buffer, layer_index)` applied to layer i of a tuple of buffers or of one stacked array."""
    if isinstance(layers, tuple):
        return layers[:i] + (write(layers[i], None),) + layers[i + 1:]
    return write(layers, i)


def cache_bytes(config: GPTConfig, batch_size: int, max_len: int, dtype=None) -> int:
    """KV cache size in bytes without allocating it."""
    itemsize = jnp.dtype(config.compute_dtype if dtype is None else dtype).itemsize
    return 2 * config.n_layer * batch_size * config.n_kv_head * max_len * config.head_dim * itemsize
