"""LoRA: low-rank adapters on chosen dense layers, trained while the base model stays frozen.

A targeted dense layer y = x @ W (+ bias) becomes y = x @ W + scale * (x @ a) @ (b * cols) with a [in, r]
(random), b [r, out] (zeros, so a fresh adapter changes nothing), scale = alpha / r, and `cols` [out] a
0/1 mask of the output columns it adapts (all of them, or for Llama's q/k/v names one part of jaxgpt's
fused c_attn = [q | k | v]). A target is a name a layer declares for its kernel (schema.ParamInfo.targets:
q, k, v, o, gate, up, down for the built-in layers) or the end of a dense layer's path (c_attn,
mlp.c_proj, lm_head). The adapters are a pytree that mirrors the parameters down to each targeted
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

from flax import traverse_util

from jaxgpt.checks import is_int, is_real
from jaxgpt.config import GPTConfig
from jaxgpt.layers import unstack_layers
from jaxgpt.schema import leaf_infos

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


def _columns(module: tuple, targets: dict, aliases: set, target: str) -> tuple[bool, Optional[tuple]]:
    """Whether the dense layer at `module` (its path) is named by `target`, and which of its output
    columns ((lo, hi); None: all): by a name its kernel declares, else by the end of its path."""
    if target in aliases:
        return target in targets, targets.get(target)
    suffix = tuple(target.split("."))
    return tuple(module[-len(suffix):]) == suffix, None


def _selected(params, config: GPTConfig, spec: LoraSpec) -> list:
    """(module path, kernel, output column parts) of each dense kernel (schema role "matrix") that
    `spec.targets` name, in path order; ValueError for a target that names none."""
    flat = traverse_util.flatten_dict(params)
    kernels = {path[:-1]: (flat[path], dict(info.targets))
               for path, info in leaf_infos(params, config).items() if info.role == "matrix"}
    aliases = {name for _, targets in kernels.values() for name in targets}
    selected, used = [], set()
    for module, (kernel, targets) in sorted(kernels.items(), key=lambda e: e[0]):
        parts = set()
        for target in spec.targets:
            hit, part = _columns(module, targets, aliases, target)
            if hit:
                used.add(target)
                parts.add(part)
        selected.append((module, kernel, parts))
    unused = sorted(set(spec.targets) - used)
    if unused:
        names = sorted({".".join(m[-2:]) for m in kernels})
        raise ValueError(f"train.lora.targets {unused} name no dense layer of this model; its layers are {names} "
                         f"(and the names they answer to: {', '.join(sorted(aliases))})")
    return selected


def _check_rank(rank: int, selected: list) -> None:
    """A rank past an adapted matrix's smaller side adds nothing over training the matrix itself, and its
    adapters and activations grow with it (rank 100000 on a 128-wide model: 12+ GB): refused up front."""
    widths = []
    for module, kernel, parts in selected:
        fan_in, fan_out = kernel.shape[-2:]
        cols = sum(fan_out if part is None else part[1] - part[0] for part in parts)  # (parts do not overlap)
        if parts:
            widths.append((min(fan_in, cols, fan_out), ".".join(module), fan_in, min(cols, fan_out)))
    width, name, fan_in, cols = min(widths)
    if rank > width:
        raise ValueError(f"config.train.lora.rank={rank} is past the width of the layers it adapts: {name} is "
                         f"{fan_in} x {cols}, so the rank can be at most {width}; lower --config.train.lora.rank")


def init_adapters(params, config: GPTConfig, spec: LoraSpec, rng: jax.Array) -> dict:
    """Fresh adapters for `params` (either layer layout) on the dense kernels (schema role "matrix")
    that `spec.targets` name: a ~ N(0, 1/in), b = 0. ValueError, before anything is allocated, for a
    rank past a target's width."""
    selected = _selected(params, config, spec)
    _check_rank(spec.rank, selected)
    adapters: dict = {}
    for i, (module, kernel, parts) in enumerate(selected):
        if not parts:
            continue
        *lead, fan_in, fan_out = kernel.shape  # lead: [L] for stacked layers
        cols = jnp.zeros((fan_out,), jnp.float32)
        for part in parts:
            lo, hi = (0, fan_out) if part is None else part
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
    return adapters


def delta(x: jax.Array, adapter: dict) -> jax.Array:
    """scale * (x @ a) @ (b * cols) for one layer's adapter; float32. The constants get no gradient."""
    cols, scale = jax.lax.stop_gradient(adapter["cols"]), jax.lax.stop_gradient(adapter["scale"])
    low = jnp.einsum("...i,ir->...r", x.astype(jnp.float32), adapter["a"])
    return scale * jnp.einsum("...r,ro->...o", low, adapter["b"] * cols)


def merge(params, adapters) -> dict:
    """`params` with every adapter folded into its kernel: W + scale * a @ (b * cols) (same function).
    The kernel is the adapted layer's parameter shaped [..., in, out] like a @ b (its bias is [..., out])."""
    def fold(node, adapter_node):
        if adapter_node is None:
            return node
        if "a" in adapter_node:
            a, b = adapter_node["a"], adapter_node["b"]
            name = next(k for k, w in node.items() if getattr(w, "shape", None) == a.shape[:-1] + b.shape[-1:])
            w = node[name]
            d = jnp.einsum("...ir,...ro->...io", a, b * adapter_node["cols"][..., None, :])
            d = d * adapter_node["scale"][..., None, None]
            return {**node, name: (w.astype(jnp.float32) + d).astype(w.dtype)}
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


def adapter_decay_mask(adapters) -> dict:
    """Weight decay on the adapters' a and b (the matrices that train), as for every matrix."""
    return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) in TRAINABLE, adapters)


def trainable_labels(adapters) -> dict:
    """"train" for the a and b leaves, "freeze" for the constants (for optax.multi_transform)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "train" if getattr(path[-1], "key", None) in TRAINABLE else "freeze", adapters)
