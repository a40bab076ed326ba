"""GPTConfig: the model's shape and numerics, validated on construction."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

ATTENTION_IMPLEMENTATIONS = ("einsum", "dot_product")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A GPT-2 style decoder-only transformer's hyperparameters.

    `n_kv_head` < `n_head` gives grouped-query attention (1 = multi-query); `None` means `n_head`.
    `dtype` is the compute dtype; parameters are always kept in `param_dtype` (float32 by default).
    """

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_kv_head: Optional[int] = None
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention: str = "einsum"
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"GPTConfig.n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"GPTConfig.attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {self.attention!r}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"GPTConfig.{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        if self.layer_norm_epsilon <= 0:
            raise ValueError(f"GPTConfig.layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> "GPTConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields {unknown}; known fields are {sorted(known)}")
        return cls(**d)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without position embeddings (and token embeddings if untied)."""
        d, kv = self.n_embd, self.n_kv_head * self.head_dim
        b = 1 if self.bias else 0
        attn = d * (d + 2 * kv) + b * (d + 2 * kv) + d * d + b * d
        mlp = d * 4 * d + b * 4 * d + 4 * d * d + b * d
        ln = 2 * (d + b * d)
        per_layer = attn + mlp + ln
        total = self.n_layer * per_layer + (d + b * d) + self.vocab_size * d + self.block_size * d
        if not self.tie_embeddings:
            total += self.vocab_size * d
        if non_embedding:
            total -= self.block_size * d
        return total

    def flops_per_token(self, seq_len: Optional[int] = None, causal_halved: bool = False) -> float:
        """Training FLOPs per token: 6N plus attention's 12 * n_layer * T * n_embd (PaLM appendix B).

        N excludes the position embeddings (they cost no matmul); with `causal_halved` the attention term
        is halved since a causal mask skips half the score matrix.
        """
        t = self.block_size if seq_len is None else seq_len
        n = self.num_params(non_embedding=True)
        attn = 12 * self.n_layer * t * self.n_embd
        if causal_halved:
            attn /= 2
        return 6.0 * n + attn
