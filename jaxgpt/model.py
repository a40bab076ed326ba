"""The GPT model as Flax Linen modules, with GPT-2's parameter names (wte, wpe, h_i/attn/c_attn, ...)."""

from __future__ import annotations

import functools
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt import kernels, lora
from jaxgpt.attention import get_attention, rotary_embedding
from jaxgpt.cache import KVCache
from jaxgpt.config import GPTConfig
from jaxgpt.kernels import cpu, native
from jaxgpt.ops import linear

_init = nn.initializers.normal(stddev=0.02)


class Dense(nn.Module):
    """`nn.Dense`'s parameters (kernel [in, out], bias [out]) computed by `ops.linear`: compute-dtype
    operands and float32 sums in the forward and in both gradient matmuls. A LoRA adapter in the "lora"
    variable collection adds its low-rank term (jaxgpt/lora.py)."""

    features: int
    use_bias: bool
    config: GPTConfig
    kernel_init: nn.initializers.Initializer = _init
    out_dtype: Optional[jnp.dtype] = None  # default: the activations' dtype (kernels.activation_dtype)
    # how the kernel is stored: "in_out" ([in, out]); the CPU kernels' decode steps also take "out_in" and
    # "panels" (native.pack's [ceil(out/16), in, 16]), made by cpu.decode_params
    kernel_layout: str = "in_out"

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        shape = {"in_out": (x.shape[-1], self.features), "out_in": (self.features, x.shape[-1]),
                 "panels": native.panels_shape(x.shape[-1], self.features)}[self.kernel_layout]
        kernel = self.param("kernel", self.kernel_init, shape, cfg.params_dtype)
        out_dtype = self.out_dtype or kernels.activation_dtype(cfg)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), cfg.params_dtype) if self.use_bias else None
        if self.kernel_layout == "panels":
            matmul = functools.partial(cpu.panels_linear, features=self.features)
        else:  # XLA:CPU: kernels/cpu.py
            matmul = functools.partial(cpu.linear if kernels.resolve(cfg.kernels) == "cpu" else linear,
                                       w_out_in=self.kernel_layout == "out_in")
        if not self.has_variable("lora", "a"):
            return matmul(x, kernel, cfg.compute_dtype, b=bias, out_dtype=out_dtype)
        y = matmul(x, kernel, cfg.compute_dtype, b=bias, out_dtype=jnp.float32)
        return (y + lora.delta(x, self.variables["lora"])).astype(out_dtype)


def _dense(cfg: GPTConfig, features: int, name: str, kernel_layout: str, residual_out: bool = False) -> Dense:
    # GPT-2 scales the init of layers that write into the residual stream by 1/sqrt(2 * n_layer)
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if residual_out else 0.02
    return Dense(features, cfg.bias, cfg, nn.initializers.normal(stddev=std), kernel_layout=kernel_layout, name=name)


def _norm(cfg: GPTConfig, name: str) -> nn.Module:
    """LayerNorm (GPT-2; a bias when cfg.bias) or RMSNorm (Llama); either has a `scale`."""
    dtype = kernels.activation_dtype(cfg)
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(epsilon=cfg.layer_norm_epsilon, dtype=dtype, param_dtype=cfg.params_dtype, name=name)
    return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, use_bias=cfg.bias, dtype=dtype, param_dtype=cfg.params_dtype,
                        name=name)


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention, optionally reading and writing a KV cache."""

    config: GPTConfig
    kernel_layout: str = "in_out"

    @nn.compact
    def __call__(self, x_BxTxD, positions_BxT, cache: Optional[KVCache], layer, deterministic: bool):
        cfg = self.config
        b, t, _ = x_BxTxD.shape
        n, kh, h = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        qkv = _dense(cfg, (n + 2 * kh) * h, "c_attn", self.kernel_layout)(x_BxTxD)
        if cache is None and cfg.position != "rope" and kernels.cpu_attention(cfg):
            out = cpu.causal_attention_qkv(qkv, n, kh)  # XLA:CPU: read in place, not split (kernels/cpu.py)
        else:
            out, cache = self._attend(qkv, positions_BxT, cache, layer)
        y = _dense(cfg, cfg.n_embd, "c_proj", self.kernel_layout, residual_out=True)(out.reshape(b, t, n * h))
        return nn.Dropout(cfg.dropout)(y, deterministic=deterministic), cache

    def _attend(self, qkv, positions_BxT, cache: Optional[KVCache], layer):
        """Attention of the projection qkv [B, T, (N + 2K) H] -> ([B,T,N,H], the cache with this step's k/v)."""
        cfg = self.config
        b, t, _ = qkv.shape
        n, kh, h = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        q, k, v = jnp.split(qkv, [n * h, (n + kh) * h], axis=-1)
        q_BxTxNxH = q.reshape(b, t, n, h)
        k_BxTxKxH = k.reshape(b, t, kh, h)
        v_BxTxKxH = v.reshape(b, t, kh, h)
        if cfg.position == "rope":
            q_BxTxNxH = rotary_embedding(q_BxTxNxH, positions_BxT, cfg.rope_theta)
            k_BxTxKxH = rotary_embedding(k_BxTxKxH, positions_BxT, cfg.rope_theta)
        if cache is None:  # queries and keys at 0..t-1
            if kernels.cpu_attention(cfg):  # XLA:CPU: skip the masked blocks (kernels/cpu.py)
                return cpu.causal_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH), cache
            return get_attention(cfg.attention)(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, None, None), cache
        kv_lengths = cache.lengths + t
        cache = cache.write(layer, k_BxTxKxH, v_BxTxKxH)
        # [B, K, S, H]; a cache kept in another dtype is read in the compute dtype
        keys, values = (a.astype(q_BxTxNxH.dtype) for a in cache.layer(layer))
        if kernels.cpu_attention(cfg):  # XLA:CPU: kernels/cpu.py
            return cpu.cached_attention(q_BxTxNxH, keys, values, positions_BxT, kv_lengths), cache
        return get_attention(cfg.attention)(q_BxTxNxH, keys.swapaxes(1, 2), values.swapaxes(1, 2), positions_BxT,
                                            kv_lengths), cache


class MLP(nn.Module):
    """GPT-2's c_fc, GELU, c_proj; or SwiGLU's c_proj(silu(c_gate(x)) * c_fc(x)) (Llama's gate/up/down)."""

    config: GPTConfig
    kernel_layout: str = "in_out"

    @nn.compact
    def __call__(self, x, deterministic: bool):
        cfg = self.config
        up = _dense(cfg, cfg.mlp_hidden, "c_fc", self.kernel_layout)(x)
        if cfg.mlp == "swiglu":
            x = nn.silu(_dense(cfg, cfg.mlp_hidden, "c_gate", self.kernel_layout)(x)) * up
        else:
            x = nn.gelu(up, approximate=True)  # GPT-2's tanh approximation
        x = _dense(cfg, cfg.n_embd, "c_proj", self.kernel_layout, residual_out=True)(x)
        return nn.Dropout(cfg.dropout)(x, deterministic=deterministic)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)) (Llama's too)."""

    config: GPTConfig
    kernel_layout: str = "in_out"

    @nn.compact
    def __call__(self, x, positions, cache: Optional[KVCache], layer, deterministic: bool):
        cfg = self.config
        y, cache = CausalSelfAttention(cfg, self.kernel_layout, name="attn")(
            _norm(cfg, "ln_1")(x), positions, cache, layer, deterministic)
        x = x + y
        x = x + MLP(cfg, self.kernel_layout, name="mlp")(_norm(cfg, "ln_2")(x), deterministic)
        return x, cache


# GPTConfig.remat -> jax.checkpoint policy: None saves nothing (the block is recomputed from its input),
# the dots policy keeps the outputs of matmuls without batch dimensions (the dense layers').
_REMAT_POLICIES = {"block": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
# Block.__call__(self, x, positions, cache, layer, deterministic): layer and deterministic are Python values
_REMAT_BLOCKS = {mode: nn.remat(Block, policy=policy, static_argnums=(4, 5))
                 for mode, policy in _REMAT_POLICIES.items()}


class GPT(nn.Module):
    """GPT-2: token + position embeddings, n_layer blocks, final LayerNorm, (tied) output head; with the
    config's options, Llama-style (rotary positions and no wpe, RMSNorm, SwiGLU).

    `model.apply(variables, tokens)` gives float32 logits [B, T, V]. With `cache=`, the tokens continue
    each row at its cache length and the call returns `(logits, new_cache)`; a row whose tokens would not
    fit the cache gets NaN logits under jit (a ValueError outside it). `token_lengths` [B] says how many of
    the T tokens of each row are real (ragged prefill; default all T), and `logits_index` [B] asks for
    the logits at one position per row only ([B, 1, V]), which spares the head's work on a prompt.

    The blocks' parameters are h_0 ... h_{L-1} as in GPT-2, or with `config.scan_layers` one stacked
    subtree `h` ([L, ...] leaves) that a `jax.lax.scan` runs through (a KV cache's layers then come
    stacked too). Dropout inside the scan folds the layer index into one key, so its masks differ from
    the unrolled model's (same distribution). `remat` recomputes each block's activations in the backward
    pass; it applies to calls without a cache only, since decoding is not differentiated.
    """

    config: GPTConfig
    kernel_layout: str = "in_out"  # how dense kernels are stored (see Dense); the CPU kernels' decode only

    @nn.compact
    def __call__(self, tokens_BxT: jax.Array, cache: Optional[KVCache] = None, *,
                 token_lengths: Optional[jax.Array] = None, logits_index: Optional[jax.Array] = None,
                 deterministic: bool = True):
        cfg = self.config
        if tokens_BxT.ndim != 2:
            raise ValueError(f"tokens must be int [batch, time], got shape {tokens_BxT.shape}")
        b, t = tokens_BxT.shape
        if t > cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {cfg.block_size}")
        steps = jnp.arange(t, dtype=jnp.int32)[None, :]
        positions = jnp.broadcast_to(steps, (b, t)) if cache is None else cache.lengths[:, None] + steps
        overflow = None if cache is None else cache.overflow(t)

        act_dtype = kernels.activation_dtype(cfg)  # (float32 under the CPU kernels)
        wte = nn.Embed(cfg.vocab_size, cfg.n_embd, embedding_init=_init, dtype=act_dtype,
                       param_dtype=cfg.params_dtype, name="wte")
        x = wte(tokens_BxT)
        if cfg.position == "learned":  # (rotary positions are applied to q and k inside attention)
            x = x + nn.Embed(cfg.block_size, cfg.n_embd, embedding_init=_init, dtype=act_dtype,
                             param_dtype=cfg.params_dtype, name="wpe")(positions)
        x = nn.Dropout(cfg.dropout)(x, deterministic=deterministic)
        if cfg.scan_layers:
            x, cache = self._scan_blocks(x, positions, cache, deterministic)
        else:
            remat = cfg.remat != "none" and cache is None and not self.is_initializing()
            block = _REMAT_BLOCKS[cfg.remat] if remat else Block
            for i in range(cfg.n_layer):
                x, cache = block(cfg, self.kernel_layout, name=f"h_{i}")(x, positions, cache, i, deterministic)
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index.astype(jnp.int32)[:, None, None], axis=1)
        x = _norm(cfg, "ln_f")(x)
        if cfg.tie_embeddings and self.kernel_layout == "panels":  # the table's packed copy (decode_params)
            panels = self.param("wte_panels", nn.initializers.zeros, native.panels_shape(cfg.n_embd, cfg.vocab_size))
            logits = cpu.panels_linear(x, panels, cfg.compute_dtype, features=cfg.vocab_size, out_dtype=jnp.float32)
        elif cfg.tie_embeddings:  # x @ wte.T, contracting the table as it is stored
            matmul = cpu.linear if kernels.resolve(cfg.kernels) == "cpu" else linear  # XLA:CPU: kernels/cpu.py
            logits = matmul(x, wte.embedding, cfg.compute_dtype, w_out_in=True, out_dtype=jnp.float32)
        else:
            logits = Dense(cfg.vocab_size, False, cfg, out_dtype=jnp.float32, kernel_layout=self.kernel_layout,
                           name="lm_head")(x)
        if cache is None:
            return logits
        cache = cache.advance(t if token_lengths is None else token_lengths)
        return jnp.where(overflow[:, None, None], jnp.nan, logits), cache

    def _scan_blocks(self, x, positions, cache: Optional[KVCache], deterministic: bool):
        """The blocks as one lax.scan over the stacked parameters `h` (and the stacked cache, if any)."""
        cfg = self.config
        block = Block(cfg, self.kernel_layout, parent=None)  # unbound: applied to one layer's parameters

        def init_stacked(rng, x, positions):
            def one(key):
                return block.init({"params": key}, x, positions, None, 0, True)["params"]
            return jax.vmap(one)(jax.random.split(rng, cfg.n_layer))

        stacked = self.param("h", init_stacked, x, positions)
        adapters = self.variables.get("lora", {}).get("h")  # LoRA adapters, stacked like the layers
        dropout_rng = None if deterministic or cfg.dropout == 0.0 else self.make_rng("dropout")

        def layer(carry, xs):
            x, cache = carry
            layer_params, layer_adapters, i = xs
            rngs = {} if dropout_rng is None else {"dropout": jax.random.fold_in(dropout_rng, i)}
            variables = {"params": layer_params}
            if layer_adapters is not None:
                variables["lora"] = layer_adapters
            x, cache = block.apply(variables, x, positions, cache, i, deterministic, rngs=rngs)
            return (x, cache), None

        if cfg.remat != "none" and cache is None:
            layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
        xs = (stacked, adapters, jnp.arange(cfg.n_layer, dtype=jnp.int32))
        (x, cache), _ = jax.lax.scan(layer, (x, cache), xs)
        return x, cache


# ---------------------------------------------------------------------------------------------------
# Parameters

def init_params(config: GPTConfig, rng: jax.Array) -> dict:
    """Freshly initialised parameters (the `params` collection) for `config`.

    Built as the unrolled model and stacked for `scan_layers`, so both layouts start from the same values.
    """
    tokens = jnp.zeros((1, min(8, config.block_size)), jnp.int32)
    unrolled = GPT(config.replace(scan_layers=False, remat="none"))
    # one jitted program: eager init would compile every initializer op separately
    return jax.jit(lambda key: convert_layers(unrolled.init(key, tokens)["params"], config))(rng)


@functools.lru_cache(maxsize=64)
def abstract_params(config: GPTConfig):
    """The parameters' shapes and dtypes (jax.ShapeDtypeStruct leaves), without allocating them."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


def count_params(params, non_embedding: bool = False) -> int:
    """Number of parameters; `non_embedding` leaves out the tables that are only looked up: wpe, and wte
    when an untied `lm_head` does the output matmul."""
    total = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
    if non_embedding:
        lookups = ["wpe"] + (["wte"] if "lm_head" in params else [])
        total -= sum(int(x.size) for name in lookups if name in params
                     for x in jax.tree_util.tree_leaves(params[name]))
    return total


def _is_params(node) -> bool:
    """A dict laid out like the parameters at their top: the params, an optimizer moment, LoRA adapters."""
    return isinstance(node, dict) and ("h" in node or any(k.startswith("h_") and k[2:].isdigit() for k in node))


def stack_layers(params: dict, n_layer: int) -> dict:
    """GPT-2's h_0 ... h_{L-1} -> one subtree `h` with [L, ...] leaves (the scan_layers layout)."""
    layers = [params[f"h_{i}"] for i in range(n_layer)]
    rest = {k: v for k, v in params.items() if not (k.startswith("h_") and k[2:].isdigit())}
    return {**rest, "h": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}


def unstack_layers(params: dict, n_layer: int) -> dict:
    """The inverse of `stack_layers`."""
    rest = {k: v for k, v in params.items() if k != "h"}
    return {**rest, **{f"h_{i}": jax.tree.map(lambda x, i=i: x[i], params["h"]) for i in range(n_layer)}}


def convert_layers(tree, config: GPTConfig):
    """`tree` with every parameter-shaped dict in it (the params, the optimizer's moments) in `config`'s
    layout: stacked for `scan_layers`, GPT-2's h_i otherwise. Dicts already in that layout are kept."""
    def convert(node):
        if not _is_params(node):
            return node
        if config.scan_layers and "h" not in node:
            return stack_layers(node, config.n_layer)
        if not config.scan_layers and "h" in node:
            return unstack_layers(node, config.n_layer)
        return node

    return jax.tree_util.tree_map(convert, tree, is_leaf=_is_params)
