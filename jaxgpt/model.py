"""The GPT model as Flax Linen modules, with GPT-2's parameter names (wte, wpe, h_i/attn/c_attn, ...)."""

from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.attention import attention, cached_attention, causal_block_attention
from jaxgpt.cache import KVCache
from jaxgpt.config import GPTConfig
from jaxgpt.ops import linear

_init = nn.initializers.normal(stddev=0.02)


class Dense(nn.Module):
    """`nn.Dense`'s parameters (kernel [in, out], bias [out]) computed through `ops.linear`: one 2-D matmul
    with compute-dtype operands and float32 accumulation in the forward and in both gradient matmuls."""

    features: int
    use_bias: bool
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    kernel_init: nn.initializers.Initializer = _init
    out_dtype: Optional[jnp.dtype] = None  # default: the compute dtype
    kernel_out_in: bool = False  # the kernel is stored transposed, [out, in] (see `transpose_kernels`)

    @nn.compact
    def __call__(self, x):
        # [out, in] only ever holds parameters converted by `transpose_kernels`
        shape = (self.features, x.shape[-1]) if self.kernel_out_in else (x.shape[-1], self.features)
        kernel = self.param("kernel", self.kernel_init, shape, self.param_dtype)
        out_dtype = self.out_dtype or self.dtype
        y = linear(x, kernel, self.dtype, transpose_w=self.kernel_out_in,
                   out_dtype=jnp.float32 if self.use_bias else out_dtype)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
        return y.astype(out_dtype)


def _dense(cfg: GPTConfig, features: int, name: str, residual_out: bool = False,
           kernel_out_in: bool = False) -> Dense:
    # GPT-2 scales the init of layers that write into the residual stream by 1/sqrt(2 * n_layer)
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if residual_out else 0.02
    return Dense(features, use_bias=cfg.bias, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype,
                 kernel_init=nn.initializers.normal(stddev=std), kernel_out_in=kernel_out_in, name=name)


def transpose_kernels(params) -> dict:
    """The same parameters with every dense kernel stored [out, in], for `GPT(cfg, kernel_out_in=True)`.

    For decoding 2..16 rows: with kernels [out, in], `ops.linear` computes each dense layer as a fused
    multiply-and-sum that reads every weight row once (GPT-2 shapes, batch 8: c_fc 0.50 ms against 1.45 ms
    for XLA's matmul, the 50257-wide head 18 ms against 33 ms). `generate` converts once per call.
    """
    def convert(path, leaf):
        return leaf.T if getattr(path[-1], "key", None) == "kernel" and leaf.ndim == 2 else leaf

    return jax.tree_util.tree_map_with_path(convert, params)


def _layer_norm(cfg: GPTConfig, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, use_bias=cfg.bias, dtype=cfg.compute_dtype,
                        param_dtype=cfg.params_dtype, name=name)


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention, optionally reading and writing a KV cache."""

    config: GPTConfig
    kernel_out_in: bool = False

    @nn.compact
    def __call__(self, x_BxTxD, positions_BxT, cache: Optional[KVCache], layer: int, deterministic: bool):
        cfg = self.config
        b, t, _ = x_BxTxD.shape
        n, kh, h = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        qkv = _dense(cfg, (n + 2 * kh) * h, "c_attn", kernel_out_in=self.kernel_out_in)(x_BxTxD)
        q, k, v = jnp.split(qkv, [n * h, (n + kh) * h], axis=-1)
        q_BxTxNxH = q.reshape(b, t, n, h)
        k_BxTxKxH = k.reshape(b, t, kh, h)
        v_BxTxKxH = v.reshape(b, t, kh, h)
        if cache is None and cfg.attention == "blocked":  # positions are 0..t-1: skip the masked blocks
            out = causal_block_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH)
        elif cache is None:
            out = attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, positions_BxT, None, cfg.attention)
        else:
            kv_length = cache.lengths + t
            cache, k_BKxSxH, v_BKxSxH = cache.write(layer, k_BxTxKxH, v_BxTxKxH)
            out = cached_attention(q_BxTxNxH, k_BKxSxH, v_BKxSxH, positions_BxT, kv_length, cfg.attention)
        y = _dense(cfg, cfg.n_embd, "c_proj", True, self.kernel_out_in)(out.reshape(b, t, n * h))
        return nn.Dropout(cfg.dropout)(y, deterministic=deterministic), cache


class MLP(nn.Module):
    config: GPTConfig
    kernel_out_in: bool = False

    @nn.compact
    def __call__(self, x, deterministic: bool):
        cfg = self.config
        x = _dense(cfg, 4 * cfg.n_embd, "c_fc", kernel_out_in=self.kernel_out_in)(x)
        x = nn.gelu(x, approximate=True)  # GPT-2's tanh approximation
        x = _dense(cfg, cfg.n_embd, "c_proj", True, self.kernel_out_in)(x)
        return nn.Dropout(cfg.dropout)(x, deterministic=deterministic)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    config: GPTConfig
    kernel_out_in: bool = False

    @nn.compact
    def __call__(self, x, positions, cache: Optional[KVCache], layer: int, deterministic: bool):
        cfg = self.config
        y, cache = CausalSelfAttention(cfg, self.kernel_out_in, name="attn")(
            _layer_norm(cfg, "ln_1")(x), positions, cache, layer, deterministic)
        x = x + y
        x = x + MLP(cfg, self.kernel_out_in, name="mlp")(_layer_norm(cfg, "ln_2")(x), deterministic)
        return x, cache


# GPTConfig.remat -> jax.checkpoint policy: None saves nothing (the block is recomputed from its input),
# the dots policy keeps the outputs of matmuls without batch dimensions (the dense layers').
_REMAT_POLICIES = {"block": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
# Block.__call__(self, x, positions, cache, layer, deterministic): layer and deterministic are Python values
_REMAT_BLOCKS = {mode: nn.remat(Block, policy=policy, static_argnums=(4, 5))
                 for mode, policy in _REMAT_POLICIES.items()}


class GPT(nn.Module):
    """GPT-2: token + position embeddings, n_layer blocks, final LayerNorm, (tied) output head.

    `model.apply(variables, tokens)` gives float32 logits [B, T, V]. With `cache=`, the tokens continue
    each row at its cache length and the call returns `(logits, new_cache)`. `token_lengths` [B] says how
    many of the T tokens of each row are real (ragged prefill; default all T), and `logits_index` [B]
    asks for the logits at one position per row only ([B, 1, V]), which spares the head's work on a prompt.

    The parameters are always h_0 ... h_{L-1} as in GPT-2, whatever `config.scan_layers` and `config.remat`.
    With `scan_layers`, `init` still builds the blocks in a Python loop (so the parameters get those names
    and the same values), while `apply` stacks the h_i subtrees along a new leading axis and runs one
    `jax.lax.scan` over the layers; a KV cache's layers go in and come out stacked. The stacking copies the
    block parameters (and the cache) once per call (their gradient is sliced back per layer), which is why
    `generate` decodes layer by layer whatever `scan_layers` says. Dropout inside the scan draws one
    "dropout" key and folds in the layer index, so its masks differ from the unrolled model's (same
    distribution, different draws); without dropout both give the same results. `remat` ("block" or
    "dots") recomputes each block's activations in the backward pass (`jax.checkpoint` around the scanned
    layer, `nn.remat(Block)` when unrolled); it applies to calls without a cache only, since decoding is
    not differentiated.

    `kernel_out_in=True` reads every dense kernel as [out, in]: the layout `transpose_kernels` makes for
    decoding (`generate` uses it); parameter names are unchanged.
    """

    config: GPTConfig
    kernel_out_in: bool = False

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

        wte = nn.Embed(cfg.vocab_size, cfg.n_embd, embedding_init=_init, dtype=cfg.compute_dtype,
                       param_dtype=cfg.params_dtype, name="wte")
        wpe = nn.Embed(cfg.block_size, cfg.n_embd, embedding_init=_init, dtype=cfg.compute_dtype,
                       param_dtype=cfg.params_dtype, name="wpe")
        x = wte(tokens_BxT) + wpe(positions)
        x = nn.Dropout(cfg.dropout)(x, deterministic=deterministic)
        if cfg.scan_layers and not self.is_initializing():
            x, cache = self._scan_blocks(x, positions, cache, deterministic)
        else:
            remat = cfg.remat != "none" and cache is None and not self.is_initializing()
            block = _REMAT_BLOCKS[cfg.remat] if remat else Block
            for i in range(cfg.n_layer):
                x, cache = block(cfg, self.kernel_out_in, name=f"h_{i}")(x, positions, cache, i, deterministic)
        if cache is not None:
            cache = cache.advance(t if token_lengths is None else token_lengths)
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index.astype(jnp.int32)[:, None, None], axis=1)
        x = _layer_norm(cfg, "ln_f")(x)
        if cfg.tie_embeddings:  # x @ wte.T without materialising the transpose
            logits = linear(x, wte.embedding, cfg.compute_dtype, transpose_w=True, out_dtype=jnp.float32)
        else:
            logits = Dense(cfg.vocab_size, use_bias=False, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype,
                           out_dtype=jnp.float32, kernel_out_in=self.kernel_out_in, name="lm_head")(x)
        return logits if cache is None else (logits, cache)

    def _scan_blocks(self, x, positions, cache: Optional[KVCache], deterministic: bool):
        """The n_layer blocks as one lax.scan over their stacked parameters; same result as the loop."""
        cfg = self.config
        params = self.variables["params"]
        # [L, ...] leaves with the h_i layout; built per call, since the stored tree keeps GPT-2's names
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves),
                               *[params[f"h_{i}"] for i in range(cfg.n_layer)])
        block = Block(cfg, self.kernel_out_in, parent=None)  # unbound: applied to one layer's parameters at a time
        dropout_rng = None if deterministic or cfg.dropout == 0.0 else self.make_rng("dropout")

        def layer(x, layer_params, i, kv):
            rngs = {} if dropout_rng is None else {"dropout": jax.random.fold_in(dropout_rng, i)}
            # one layer's cache as a one-layer KVCache (its layer 0); None without a cache
            one = None if kv is None else KVCache(k=(kv[0],), v=(kv[1],), lengths=cache.lengths)
            x, one = block.apply({"params": layer_params}, x, positions, one, 0, deterministic, rngs=rngs)
            return x, None if one is None else (one.k[0], one.v[0])

        if cfg.remat != "none" and cache is None:
            layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)

        def body(x, xs):
            return layer(x, *xs)

        # the cache's layers go in and come out stacked [L, ...] (copies: `generate` decodes unrolled)
        kv = None if cache is None else cache.stacked()
        x, new_kv = jax.lax.scan(body, x, (stacked, jnp.arange(cfg.n_layer, dtype=jnp.int32), kv))
        return x, None if cache is None else cache.from_stacked(*new_kv)


def init_params(config: GPTConfig, rng: jax.Array) -> dict:
    """Freshly initialised parameters (the `params` collection) for `config`."""
    tokens = jnp.zeros((1, min(8, config.block_size)), jnp.int32)
    # one jitted program: eager init would compile every initializer op separately
    return jax.jit(lambda key: GPT(config).init(key, tokens)["params"])(rng)


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
