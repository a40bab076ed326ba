"""The GPT model as Flax Linen modules, with GPT-2's parameter names (wte, wpe, h_i/attn/c_attn, ...)."""

from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.attention import attention
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

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), self.param_dtype)
        out_dtype = self.out_dtype or self.dtype
        y = linear(x, kernel, self.dtype, out_dtype=jnp.float32 if self.use_bias else out_dtype)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
        return y.astype(out_dtype)


def _dense(cfg: GPTConfig, features: int, name: str, residual_out: bool = False) -> Dense:
    # GPT-2 scales the init of layers that write into the residual stream by 1/sqrt(2 * n_layer)
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if residual_out else 0.02
    return Dense(features, use_bias=cfg.bias, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype,
                 kernel_init=nn.initializers.normal(stddev=std), name=name)


def _layer_norm(cfg: GPTConfig, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, use_bias=cfg.bias, dtype=cfg.compute_dtype,
                        param_dtype=cfg.params_dtype, name=name)


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention, optionally reading and writing a KV cache."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x_BxTxD, positions_BxT, cache: Optional[KVCache], layer: int, deterministic: bool):
        cfg = self.config
        b, t, _ = x_BxTxD.shape
        n, kh, h = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        qkv = _dense(cfg, (n + 2 * kh) * h, "c_attn")(x_BxTxD)
        q, k, v = jnp.split(qkv, [n * h, (n + kh) * h], axis=-1)
        q_BxTxNxH = q.reshape(b, t, n, h)
        k_BxTxKxH = k.reshape(b, t, kh, h)
        v_BxTxKxH = v.reshape(b, t, kh, h)
        if cache is None:
            out = attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, positions_BxT, None, cfg.attention)
        else:
            kv_length = cache.lengths + t
            cache, k_all, v_all = cache.write(layer, k_BxTxKxH, v_BxTxKxH)
            out = attention(q_BxTxNxH, k_all.astype(q.dtype), v_all.astype(q.dtype), positions_BxT,
                            kv_length, cfg.attention)
        y = _dense(cfg, cfg.n_embd, "c_proj", residual_out=True)(out.reshape(b, t, n * h))
        return nn.Dropout(cfg.dropout)(y, deterministic=deterministic), cache


class MLP(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x, deterministic: bool):
        cfg = self.config
        x = _dense(cfg, 4 * cfg.n_embd, "c_fc")(x)
        x = nn.gelu(x, approximate=True)  # GPT-2's tanh approximation
        x = _dense(cfg, cfg.n_embd, "c_proj", residual_out=True)(x)
        return nn.Dropout(cfg.dropout)(x, deterministic=deterministic)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x, positions, cache: Optional[KVCache], layer: int, deterministic: bool):
        cfg = self.config
        y, cache = CausalSelfAttention(cfg, name="attn")(
            _layer_norm(cfg, "ln_1")(x), positions, cache, layer, deterministic)
        x = x + y
        x = x + MLP(cfg, name="mlp")(_layer_norm(cfg, "ln_2")(x), deterministic)
        return x, cache


class GPT(nn.Module):
    """GPT-2: token + position embeddings, n_layer blocks, final LayerNorm, (tied) output head.

    `model.apply(variables, tokens)` gives float32 logits [B, T, V]. With `cache=`, the tokens continue
    each row at its cache length and the call returns `(logits, new_cache)`. `token_lengths` [B] says how
    many of the T tokens of each row are real (ragged prefill; default all T), and `logits_index` [B]
    asks for the logits at one position per row only ([B, 1, V]), which spares the head's work on a prompt.
    """

    config: GPTConfig

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
        for i in range(cfg.n_layer):
            x, cache = Block(cfg, name=f"h_{i}")(x, positions, cache, i, deterministic)
        if cache is not None:
            cache = cache.advance(t if token_lengths is None else token_lengths)
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index.astype(jnp.int32)[:, None, None], axis=1)
        x = _layer_norm(cfg, "ln_f")(x)
        if cfg.tie_embeddings:  # x @ wte.T without materialising the transpose
            logits = linear(x, wte.embedding, cfg.compute_dtype, transpose_w=True, out_dtype=jnp.float32)
        else:
            logits = Dense(cfg.vocab_size, use_bias=False, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype,
                           out_dtype=jnp.float32, name="lm_head")(x)
        return logits if cache is None else (logits, cache)


def init_params(config: GPTConfig, rng: jax.Array) -> dict:
    """Freshly initialised parameters (the `params` collection) for `config`."""
    tokens = jnp.zeros((1, min(8, config.block_size)), jnp.int32)
    # one jitted program: eager init would compile every initializer op separately
    return jax.jit(lambda key: GPT(config).init(key, tokens)["params"])(rng)


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
