"""KVCache: an immutable pytree of preallocated keys and values with per-row fill lengths."""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import struct

from jaxgpt.config import GPTConfig


@struct.dataclass
class KVCache:
    """Keys and values for every layer, k/v [L, B, max_len, K, H], and `lengths` int32 [B].

    `lengths[b]` counts the positions of row b that hold real keys; the next token of row b is written at
    position `lengths[b]`. The model takes a cache and returns a new one; nothing is mutated.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def create(cls, config: GPTConfig, batch_size: int, max_len: int, dtype=None) -> "KVCache":
        """An empty cache for `batch_size` rows of up to `max_len` positions, in the compute dtype."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 1 <= max_len <= config.block_size:
            raise ValueError(f"max_len must be in [1, block_size={config.block_size}], got {max_len}")
        dtype = config.compute_dtype if dtype is None else jnp.dtype(dtype)
        shape = (config.n_layer, batch_size, max_len, config.n_kv_head, config.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch_size,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values: 2 * L * B * K * max_len * H * itemsize."""
        return 2 * self.k.size * self.k.dtype.itemsize

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        return self.k[i], self.v[i]

    def write(self, i: int, k_new: jax.Array, v_new: jax.Array) -> tuple["KVCache", jax.Array, jax.Array]:
        """Write layer i's new keys/values [B, T, K, H] at each row's `lengths`; returns the layer's k, v.

        One dynamic_update_slice per row straight into the [L, B, S, K, H] buffer, which XLA performs in
        place. (Slicing out the layer, updating it and setting it back copied the whole cache at every
        layer of every step; a scatter was slower still on CPU.)
        """
        k, v = self.k, self.v
        zero = jnp.zeros((), jnp.int32)
        for r in range(k_new.shape[0]):
            at = (jnp.int32(i), jnp.int32(r), self.lengths[r], zero, zero)
            k = jax.lax.dynamic_update_slice(k, k_new[r][None, None].astype(k.dtype), at)
            v = jax.lax.dynamic_update_slice(v, v_new[r][None, None].astype(v.dtype), at)
        return self.replace(k=k, v=v), k[i], v[i]

    def advance(self, n: jax.Array) -> "KVCache":
        """Mark `n` (int or int [B]) more positions of each row as filled."""
        return self.replace(lengths=self.lengths + jnp.asarray(n, jnp.int32))


def cache_bytes(config: GPTConfig, batch_size: int, max_len: int, dtype=None) -> int:
    """KV cache size in bytes without allocating it."""
    itemsize = jnp.dtype(config.compute_dtype if dtype is None else dtype).itemsize
    return 2 * config.n_layer * batch_size * config.n_kv_head * max_len * config.head_dim * itemsize
