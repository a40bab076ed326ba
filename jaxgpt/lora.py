"""LoRA: low-rank adapters on chosen dense layers, trained while the base model stays frozen.

A targeted dense layer y = x @ W (+ bias) becomes y = x @ W + scale * (x @ a) @ (b * cols) with a [in, r]
(random), b [r, out] (zeros, so a fresh adapter changes nothing), scale = alpha / r, and `cols` [out] a
0/1 mask of the output columns it adapts (all of them, or for Llama's q/k/v names one part of jaxgpt's
fused c_attn = [q | k | v]). The adapters are a pytree that mirrors the parameters down to each targeted
layer ({"a", "b", "cols", "scale"}; stacked [L, ...] under `h` for scan_layers models) and reaches the
model as the "lora" variable collection: `model.apply({"params": base, "lora": adapters}, tokens)`.
`merge` folds them into the base weights (for sampling and `save_pretrained`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.checks import is_int, is_real
from jaxgpt.config import GPTConfig
from jaxgpt.layers import unstack_layers

# target name -> (module path suffix, part of the layer's output columns: None = all of them)
_ALIASES = {
    "q": (("attn", "c_attn"), "q"), "k": (("attn", "c_attn"), "k"), "v": (("attn", "c_attn"), "v"),
    "o": (("attn", "c_proj"), None), "gate": (("mlp", "c_gate"), None), "up": (("mlp", "c_fc"), None),
    "down": (("mlp", "c_proj"), None),
}
TRAINABLE = ("a", "b")  # the other adapter leaves (cols, scale) are constants


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Which dense layers get adapters, of what rank, with what scale (alpha / rank)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    def __post_init__(self):
        if not is_int(self.rank) or self.rank < 1:
            raise ValueError(f"train.lora.rank must be an integer >= 1 (0 turns LoRA off), got {self.rank!r}")
        if not is_real(self.alpha) or not self.alpha > 0:
            raise ValueError(f"train.lora.alpha must be a number > 0, got {self.alpha!r}")
        if not self.targets:
            raise ValueError("train.lora.targets names no layer; e.g. 'c_attn,c_proj' or 'q,v'")

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    @classmethod
    def from_config(cls, lora_cfg) -> Optional["LoraSpec"]:
        """The spec of a training config's `train.lora` section; None when rank is 0 (LoRA off)."""
        if lora_cfg["rank"] == 0:
            return None
        targets = lora_cfg["targets"]
        if isinstance(targets, str):
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        return cls(rank=lora_cfg["rank"], alpha=lora_cfg["alpha"], targets=tuple(targets))


def _matches(path: tuple, target: str) -> tuple[bool, Optional[str]]:
    """Whether the dense layer at `path` (module names) is named by `target`, and which part of it."""
    if target in _ALIASES:
        suffix, part = _ALIASES[target]
    else:
        suffix, part = tuple(target.split(".")), None
    return tuple(path[-len(suffix):]) == suffix, part


def _column_ranges(config: GPTConfig) -> dict:
    n, kh, h = config.n_head, config.n_kv_head, config.head_dim
    return {"q": (0, n * h), "k": (n * h, (n + kh) * h), "v": ((n + kh) * h, (n + 2 * kh) * h)}


def init_adapters(params, config: GPTConfig, spec: LoraSpec, rng: jax.Array) -> dict:
    """Fresh adapters for `params` (either layer layout): a ~ N(0, 1/in), b = 0."""
    kernels = {tuple(getattr(k, "key", k) for k in path[:-1]): leaf
               for path, leaf in jax.tree_util.tree_leaves_with_path(params)
               if getattr(path[-1], "key", None) == "kernel"}
    adapters: dict = {}
    used = set()
    for i, (module, kernel) in enumerate(sorted(kernels.items())):
        parts = set()
        for target in spec.targets:
            hit, part = _matches(module, target)
            if hit:
                used.add(target)
                parts.add(part)
        if not parts:
            continue
        *lead, fan_in, fan_out = kernel.shape  # lead: [L] for stacked layers
        cols = jnp.zeros((fan_out,), jnp.float32)
        for part in parts:
            lo, hi = (0, fan_out) if part is None else _column_ranges(config)[part]
            cols = cols.at[lo:hi].set(1.0)
        key = jax.random.fold_in(rng, i)
        leaf = {"a": jax.random.normal(key, (*lead, fan_in, spec.rank), jnp.float32) / jnp.sqrt(fan_in),
                "b": jnp.zeros((*lead, spec.rank, fan_out), jnp.float32),
                "cols": jnp.broadcast_to(cols, (*lead, fan_out)),
                "scale": jnp.full(tuple(lead), spec.alpha / spec.rank, jnp.float32)}
        node = adapters
        for name in module[:-1]:
            node = node.setdefault(name, {})
        node[module[-1]] = leaf
    unused = sorted(set(spec.targets) - used)
    if unused:
        names = sorted({".".join(m[-2:]) for m in kernels})
        raise ValueError(f"train.lora.targets {unused} name no dense layer of this model; its layers are {names} "
                         f"(and Llama's q, k, v, o, gate, up, down)")
    return adapters


def delta(x: jax.Array, adapter: dict) -> jax.Array:
    """scale * (x @ a) @ (b * cols) for one layer's adapter; float32. The constants get no gradient."""
    cols, scale = jax.lax.stop_gradient(adapter["cols"]), jax.lax.stop_gradient(adapter["scale"])
    low = jnp.einsum("...i,ir->...r", x.astype(jnp.float32), adapter["a"])
    return scale * jnp.einsum("...r,ro->...o", low, adapter["b"] * cols)


def merge(params, adapters) -> dict:
    """`params` with every adapter folded into its kernel: W + scale * a @ (b * cols) (same function)."""
    def fold(node, adapter_node):
        if adapter_node is None:
            return node
        if "a" in adapter_node:
            w = node["kernel"]
            d = jnp.einsum("...ir,...ro->...io", adapter_node["a"], adapter_node["b"] * adapter_node["cols"][..., None, :])
            d = d * adapter_node["scale"][..., None, None]
            return {**node, "kernel": (w.astype(jnp.float32) + d).astype(w.dtype)}
        return {k: fold(v, adapter_node.get(k)) for k, v in node.items()}

    return fold(params, adapters)


def base_fingerprint(params, config: GPTConfig) -> str:
    """SHA-256 of the base weights a LoRA run adapts, as `config` uses them: the same in either layer
    layout, position table cropped to config.block_size. Its checkpoints refer to the base by folder and
    step (or name); this tells a base put in its place from the one the adapters were trained on."""
    if "h" in params:
        params = unstack_layers(params, config.n_layer)
    if "wpe" in params:
        params = {**params, "wpe": {**params["wpe"], "embedding": params["wpe"]["embedding"][:config.block_size]}}
    h = hashlib.sha256()
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params), key=lambda e: jax.tree_util.keystr(e[0])):
        x = np.ascontiguousarray(jax.device_get(leaf))
        h.update(f"{jax.tree_util.keystr(path)} {x.dtype} {x.shape}\n".encode())
        h.update(x.tobytes())
    return h.hexdigest()


def trainable_labels(adapters) -> dict:
    """"train" for the a and b leaves, "freeze" for the constants (for optax.multi_transform)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "train" if getattr(path[-1], "key", None) in TRAINABLE else "freeze", adapters)
