"""GPTConfig: the model's shape and numerics, validated on construction."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax.numpy as jnp

from jaxgpt.checks import is_int, is_real
from jaxgpt.registry import ATTENTION, BACKEND_NAMES, BLOCKS

DTYPES = ("float32", "bfloat16", "float16")
REMAT_MODES = ("none", "block", "dots", "offload")
POSITIONS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu", "relu2")
_INT_FIELDS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head", "mlp_hidden")
_BOOL_FIELDS = ("bias", "tie_embeddings", "scan_layers", "qk_norm", "zero_init_proj", "embed_skip")
_REAL_FIELDS = ("dropout", "layer_norm_epsilon", "rope_theta", "logit_softcap")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A decoder-only transformer's hyperparameters; GPT-2 124M by default.

    Independent switches give Llama-style models: `position` "learned" (GPT-2's wpe) or "rope" (rotary, base
    `rope_theta`), `norm` "layernorm" or "rmsnorm", `mlp` "gelu" or "swiglu" (`mlp_hidden` None: 4 * n_embd
    for gelu, 8/3 * n_embd rounded up to 64 for swiglu), with `bias`, `tie_embeddings` and `n_kv_head` <
    `n_head` (grouped-query attention). `block` and `attention` name registered parts (jaxgpt.registry);
    `kernels` names the backend ("auto": by platform; jaxgpt.backends), which changes how, never what, is
    computed. `dtype` is the compute dtype, `param_dtype` the parameters'. `scan_layers` stores the blocks
    stacked ([L, ...] leaves under `h`) and runs them as one lax.scan; `remat` "block" or "dots" recomputes
    activations in the backward pass; "offload" is "block" with the scanned blocks' saved inputs kept in
    the host's memory (pinned_host) between the forward and the backward, not the device's (scan_layers;
    unrolled it is "block").

    The modern ("speedrun") recipe, each part off by default: `qk_norm` (RMS-normalise q and k per head),
    `mlp="relu2"` (relu(x)^2), `zero_init_proj` (output projections start at zero), `logit_softcap` (> 0:
    logits become cap * tanh(logits / cap)), `embed_skip` (every block's input mixes in the embedding,
    with two learned weights per block) and `value_embeds` (k > 0: k extra token tables whose rows are
    mixed into the values of the first k and last k blocks).
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
    attention: str = "dot_product"
    block: str = "gpt2"
    kernels: str = "auto"
    layer_norm_epsilon: float = 1e-5
    scan_layers: bool = False
    remat: str = "none"
    position: str = "learned"
    rope_theta: float = 10000.0
    norm: str = "layernorm"
    mlp: str = "gelu"
    mlp_hidden: Optional[int] = None
    qk_norm: bool = False
    zero_init_proj: bool = False
    logit_softcap: float = 0.0
    embed_skip: bool = False
    value_embeds: int = 0

    def __post_init__(self):
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        # NumPy (or 0-d array) numbers are taken, and kept as Python ones: a config is hashed, compared and
        # written to JSON
        for name in _INT_FIELDS + ("value_embeds",):
            if is_int(getattr(self, name)):
                object.__setattr__(self, name, int(getattr(self, name)))
        for name in _REAL_FIELDS:
            if is_real(getattr(self, name)):
                object.__setattr__(self, name, float(getattr(self, name)))
        if self.mlp_hidden is None and self.mlp in MLPS and isinstance(self.n_embd, int):
            width = 4 * self.n_embd if self.mlp != "swiglu" else -(-8 * self.n_embd // 3 // 64) * 64
            object.__setattr__(self, "mlp_hidden", width)
        choices = {"dtype": DTYPES, "param_dtype": DTYPES, "attention": ATTENTION.names(), "block": BLOCKS.names(),
                   "kernels": BACKEND_NAMES, "remat": REMAT_MODES, "position": POSITIONS, "norm": NORMS, "mlp": MLPS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if not (is_real(self.logit_softcap) and 0 <= self.logit_softcap < math.inf):
            raise ValueError(f"GPTConfig.logit_softcap must be a finite number >= 0 (0: off), got {self.logit_softcap!r}")
        if not (is_int(self.value_embeds) and 0 <= self.value_embeds <= self.n_layer):
            raise ValueError(f"GPTConfig.value_embeds must be an integer in [0, n_layer={self.n_layer}], got "
                             f"{self.value_embeds!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"GPTConfig.n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if not is_real(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be a number in [0, 1), got {self.dropout!r}")
        if not is_real(self.layer_norm_epsilon) or not 0 < self.layer_norm_epsilon < math.inf:
            raise ValueError(f"GPTConfig.layer_norm_epsilon must be a finite number > 0, got "
                             f"{self.layer_norm_epsilon!r}")
        if not is_real(self.rope_theta) or not 1 < self.rope_theta < math.inf:
            raise ValueError(f"GPTConfig.rope_theta must be a finite number > 1, got {self.rope_theta!r}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"GPTConfig.position='rope' needs an even head dimension (n_embd / n_head), got "
                             f"{self.head_dim}")

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
        if d.get("attention") == "blocked":  # checkpoints before the backend switch: now the cpu backend's job
            d = {**d, "attention": "dot_product"}
        return cls(**d)


_MOVED = ("default_config", "validate_config", "model_config_from", "MODEL_KEYS", "PARALLEL_MODES")


def __getattr__(name: str):
    """The training schema moved to jaxgpt.training.config; old config files that import it from here keep
    working, with a DeprecationWarning (this module itself depends on nothing but leaf modules)."""
    if name not in _MOVED:
        raise AttributeError(f"module 'jaxgpt.config' has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(f"jaxgpt.config.{name} moved to jaxgpt.training.config.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("jaxgpt.training.config"), name)
