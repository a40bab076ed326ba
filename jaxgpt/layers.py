"""The blocks' two parameter layouts: GPT-2's h_0 ... h_{L-1}, and one stacked subtree `h` ([L, ...]
leaves) for `scan_layers`. GPT-2's names stay the exchange format (Hugging Face, checkpoints)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgpt.config import GPTConfig


def _is_params(node) -> bool:
    """A dict laid out like the parameters at their top: the params, an optimizer moment, LoRA adapters."""
    return isinstance(node, dict) and ("h" in node or any(k.startswith("h_") and k[2:].isdigit() for k in node))


def stack_layers(params: dict, n_layer: int, stack=None) -> dict:
    """GPT-2's h_0 ... h_{L-1} -> one subtree `h` with [L, ...] leaves (the scan_layers layout);
    `stack(*leaves)` makes each stacked leaf (default: jnp.stack; the schema stacks declarations)."""
    layers = [params[f"h_{i}"] for i in range(n_layer)]
    rest = {k: v for k, v in params.items() if not (k.startswith("h_") and k[2:].isdigit())}
    return {**rest, "h": jax.tree.map(stack or (lambda *xs: jnp.stack(xs)), *layers)}


def unstack_layers(params: dict, n_layer: int) -> dict:
    """The inverse of `stack_layers`."""
    rest = {k: v for k, v in params.items() if k != "h"}
    return {**rest, **{f"h_{i}": jax.tree.map(lambda x, i=i: x[i], params["h"]) for i in range(n_layer)}}


def convert_layers(tree, config: GPTConfig):
    """`tree` with every parameter-shaped dict in it (params, optimizer moments) in `config`'s layout:
    stacked for `scan_layers`, GPT-2's h_i otherwise. Dicts already in that layout are kept."""
    def convert(node):
        if not _is_params(node):
            return node
        if config.scan_layers and "h" not in node:
            return stack_layers(node, config.n_layer)
        if not config.scan_layers and "h" in node:
            return unstack_layers(node, config.n_layer)
        return node

    return jax.tree_util.tree_map(convert, tree, is_leaf=_is_params)
