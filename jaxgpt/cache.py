"""KVCache: an immutable pytree of preallocated keys and values with per-row fill lengths."""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import struct

from jaxgpt.config import GPTConfig


@struct.dataclass
class KVCache:
    """Keys and values, one buffer per layer: k[i] / v[i] [B*K, max_len, H]; `lengths` int32 [B].

    Row b's key/value head j lives at index b*K + j of a layer's buffer (`layer(i)` gives the
    [B, K, max_len, H] view). `lengths[b]` counts the positions of row b that hold real keys; the next
    token of row b is written at position `lengths[b]`. The model takes a cache and returns a new one;
    nothing is mutated.

    The layout is what decoding reads fastest on XLA's CPU backend: each (row, head) is one contiguous
    [max_len, H] matrix that attention's batched matmuls read as it is (with [.., max_len, K, H] XLA
    copied both into that layout at every layer of every step: 6.6% of a batch-1 GPT-2 decode step,
    14% at batch 8); one buffer per layer, since a layer sliced out of one [L, ...] array is copied before
    the matmul reads it (15% of a batch-8 step); and B and K merged, since with a [1, K, ..] buffer XLA
    duplicated the in-place update around the dropped unit dimension and copied every layer three times
    per step at batch 1. `stacked()` / `from_stacked()` convert to and from [L, B*K, max_len, H] arrays.
    """

    k: tuple
    v: tuple
    lengths: jax.Array

    @classmethod
    def create(cls, config: GPTConfig, batch_size: int, max_len: int, dtype=None) -> "KVCache":
        """An empty cache for `batch_size` rows of up to `max_len` positions, in the compute dtype."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 1 <= max_len <= config.block_size:
            raise ValueError(f"max_len must be in [1, block_size={config.block_size}], got {max_len}")
        dtype = config.compute_dtype if dtype is None else jnp.dtype(dtype)
        shape = (batch_size * config.n_kv_head, max_len, config.head_dim)
        layers = range(config.n_layer)
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in layers), v=tuple(jnp.zeros(shape, dtype) for _ in layers),
                   lengths=jnp.zeros((batch_size,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values: 2 * L * B * K * max_len * H * itemsize."""
        return sum(2 * a.size * a.dtype.itemsize for a in self.k)

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        """Layer i's keys and values, each viewed as [B, K, max_len, H]."""
        b = self.batch_size
        return (self.k[i].reshape(b, -1, *self.k[i].shape[1:]), self.v[i].reshape(b, -1, *self.v[i].shape[1:]))

    def write(self, i: int, k_new: jax.Array, v_new: jax.Array) -> tuple["KVCache", jax.Array, jax.Array]:
        """Write layer i's new keys/values [B, T, K, H] at each row's `lengths`; returns the layer's updated
        buffers k, v [B*K, max_len, H].

        One dynamic_update_slice per row into the layer's buffer, which XLA performs in place. (A scatter
        was slower on CPU.) `i` is a Python int.
        """
        k, v = write_rows(self.k[i], k_new, self.lengths), write_rows(self.v[i], v_new, self.lengths)
        return self.replace(k=_set(self.k, i, k), v=_set(self.v, i, v)), k, v

    def stacked(self) -> tuple[jax.Array, jax.Array]:
        """k and v as [L, B*K, max_len, H] arrays (a copy)."""
        return jnp.stack(self.k), jnp.stack(self.v)

    def from_stacked(self, k: jax.Array, v: jax.Array) -> "KVCache":
        """This cache with its layers taken from [L, B*K, max_len, H] arrays (same lengths)."""
        return self.replace(k=tuple(k), v=tuple(v))

    def advance(self, n: jax.Array) -> "KVCache":
        """Mark `n` (int or int [B]) more positions of each row as filled."""
        return self.replace(lengths=self.lengths + jnp.asarray(n, jnp.int32))


def write_rows(buf: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
    """buf [B*K, S, H] with new [B, T, K, H] written at positions lengths[b] .. lengths[b] + T - 1."""
    b, t, kh, h = new.shape
    new = new.swapaxes(1, 2).reshape(b * kh, t, h).astype(buf.dtype)  # a small copy of the new positions
    zero = jnp.zeros((), jnp.int32)
    for r in range(b):
        buf = jax.lax.dynamic_update_slice(buf, new[r * kh:(r + 1) * kh], (jnp.int32(r * kh), lengths[r], zero))
    return buf


def _set(layers: tuple, i: int, value: jax.Array) -> tuple:
    return layers[:i] + (value,) + layers[i + 1:]


def cache_bytes(config: GPTConfig, batch_size: int, max_len: int, dtype=None) -> int:
    """KV cache size in bytes without allocating it."""
    itemsize = jnp.dtype(config.compute_dtype if dtype is None else dtype).itemsize
    return 2 * config.n_layer * batch_size * config.n_kv_head * max_len * config.head_dim * itemsize
