"""The GPT model as Flax Linen modules, with GPT-2's parameter names (wte, wpe, h_i/attn/c_attn, ...).

Every module is handed the `Backend` (jaxgpt.backends) that computes its matmuls, attention and cache
writes; the model itself names none. Blocks are registered classes (`register_block`), chosen by
`GPTConfig.block`; attention functions are registered in jaxgpt.attention, chosen by `GPTConfig.attention`.
Each layer declares what its parameters are where it creates them (jaxgpt/schema.py): the optimizer,
LoRA, decoding and the FLOP count read those declarations, never the names.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.ad_checkpoint import checkpoint_name

from jaxgpt import lora, paged
from jaxgpt.attention import packed_attention, rotary_embedding, segment_positions, takes_segments
from jaxgpt.backends import PORTABLE, Backend, resolve
from jaxgpt.cache import KVCache, PackedCache
from jaxgpt.config import GPTConfig
from jaxgpt.layers import convert_layers, stack_layers, unstack_layers  # noqa: F401  (re-exported)
from jaxgpt.paged import PagedCache
from jaxgpt.registry import BLOCKS
from jaxgpt.schema import (HEAD, UNNAMED, ParamInfo, declare, declare_block, embedding, leaf_infos, matrix,
                           param_schema, vector)
from jaxgpt.schema import install as install_schema

_init = nn.initializers.normal(stddev=0.02)


def register_block(name: str, *, replace: bool = False):
    """Decorator: make a block class available as `GPTConfig(block=name)`. A block is a Linen module with
    fields (config, backend, deterministic) and `__call__(x_BxTxD, positions_BxT, cache, layer) -> (x, cache)`;
    with GPTConfig.value_embeds it is also given `value_embed=` [B, T, K*H] for its attention, and with
    document masking `segment_ids=` [B, T] (both passed on to CausalSelfAttention). A name already
    registered ("gpt2", "parallel" included) needs `replace=True`."""
    return BLOCKS.register(name, replace=replace)


class Dense(nn.Module):
    """`nn.Dense`'s parameters (kernel [in, out], bias [out]) multiplied by the backend's `linear`. A
    "prepared" kernel (the backend's decode form) is used instead of the stored one when present, and a
    LoRA adapter in the "lora" collection adds its low-rank term (jaxgpt/lora.py). `info` declares the
    kernel (schema.matrix: its logical axes, LoRA names, ...); the bias is declared from it. The
    parameters may take other names (`kernel_name`, `bias_name`). `parts`: the head counts of the parts
    its columns hold one after another (attention's fused [q | k | v]): it then returns each part as
    [..., heads, features // sum(parts)], on a tensor mesh (`Backend.head_mesh`) each computed from its
    own columns with its heads split over `tensor` (column-parallel, each device on whole heads)."""

    features: int
    use_bias: bool
    config: GPTConfig
    backend: Backend
    kernel_init: nn.initializers.Initializer = _init
    out_dtype: Optional[jnp.dtype] = None  # default: the backend's activation dtype
    info: Optional[ParamInfo] = None
    kernel_name: str = "kernel"
    bias_name: str = "bias"
    parts: tuple = ()

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        prepared = self.has_variable("prepared", self.kernel_name)
        if prepared:
            kernel = self.get_variable("prepared", self.kernel_name)
        else:
            if self.info is not None:
                declare(self, self.kernel_name, self.info)
            kernel = self.param(self.kernel_name, self.kernel_init, (x.shape[-1], self.features), cfg.params_dtype)
        bias = None
        if self.use_bias:
            if self.info is not None:
                declare(self, self.bias_name, bias_info(self.info))
            bias = self.param(self.bias_name, nn.initializers.zeros, (self.features,), cfg.params_dtype)
        out_dtype = self.out_dtype or self.backend.activation_dtype(cfg.compute_dtype)
        if not self.parts:
            return self._fused(x, kernel, bias, out_dtype)
        h = self.features // sum(self.parts)
        bounds = [sum(self.parts[:i]) * h for i in range(len(self.parts) + 1)]
        # a prepared kernel (a backend's decode form) and a LoRA adapter act on all the columns at once
        if self.backend.head_mesh is None or prepared or self.has_variable("lora", "a"):
            # (split as one op: XLA then folds a backend's join of q, k and v back into the projection, which
            # the native CPU attention reads in place; three slices are copied out)
            y = self._fused(x, kernel, bias, out_dtype)
            return tuple(p.reshape(*p.shape[:-1], n, h)
                         for n, p in zip(self.parts, jnp.split(y, bounds[1:-1], axis=-1)))
        return self._by_heads(x, kernel, bias, out_dtype, h, bounds)

    def _by_heads(self, x, kernel, bias, out_dtype, h: int, bounds: list) -> tuple:
        """The parts from their own columns, split by heads over the tensor axis. With g = the fewest heads
        of a part (the kv heads) a multiple of the tensor size, the columns are regrouped [embed, g, heads
        per group, H] (group j: its query heads, then its key head, then its value head; or the decoder's
        `GROUPED` copy, `group_by_heads`) and multiplied at once: each device holds whole groups, and the
        backward sums the input's gradient in one all-reduce.
        Else each part separately, a part whose heads the tensor size does not divide computed whole (GQA's
        kv heads, replicated)."""
        cfg, backend, parts, e = self.config, self.backend, self.parts, kernel.shape[0]
        g = min(parts)
        if g % backend.tensor_size:
            outs = []
            for n, lo, hi in zip(parts, bounds, bounds[1:]):
                w = backend.shard_heads(backend.whole(kernel[:, lo:hi]), 1, n, rows=False)
                b = None if bias is None else bias[lo:hi]
                y = backend.linear(x, w, cfg.compute_dtype, b=b, out_dtype=out_dtype)
                outs.append(backend.shard_heads(y.reshape(*y.shape[:-1], n, h), y.ndim - 1, n))
            return tuple(outs)
        spans = list(zip(parts, bounds, bounds[1:]))
        if self.has_variable("prepared", GROUPED):  # regrouped once per call by the decoder (`heads_grouped`)
            w = self.get_variable("prepared", GROUPED)
        else:  # regrouped whole (the kernel is whole on each tensor device), then each device keeps its own
            # groups: nothing moves (GSPMD would otherwise split the slices in contiguous blocks and permute them)
            w = jnp.concatenate([kernel[:, lo:hi].reshape(e, g, n // g, h) for n, lo, hi in spans], axis=2)
            w = backend.whole(w)
        w = backend.shard_heads(w, 1, g, rows=False).reshape(e, -1)
        b = None if bias is None else jnp.concatenate([bias[lo:hi].reshape(g, n // g, h) for n, lo, hi in spans], 1)
        y = backend.linear(x, w, cfg.compute_dtype, b=None if b is None else b.reshape(-1), out_dtype=out_dtype)
        y = backend.shard_heads(y.reshape(*y.shape[:-1], g, -1, h), y.ndim - 1, g)  # [..., g, heads per group, H]
        cuts = [sum(parts[:i]) // g for i in range(len(parts) + 1)]
        return tuple(backend.shard_heads(y[..., lo:hi, :].reshape(*y.shape[:-3], n, h), y.ndim - 3, n)
                     for n, lo, hi in zip(parts, cuts, cuts[1:]))

    def _fused(self, x, kernel, bias, out_dtype):
        cfg = self.config
        if not self.has_variable("lora", "a"):
            return self.backend.linear(x, kernel, cfg.compute_dtype, b=bias, out_dtype=out_dtype)
        y = self.backend.linear(x, kernel, cfg.compute_dtype, b=bias, out_dtype=jnp.float32)
        return (y + lora.delta(x, self.variables["lora"])).astype(out_dtype)


GROUPED = "kernel_by_heads"  # c_attn's kernel regrouped by kv head, in the "prepared" collection (`heads_grouped`)


def group_by_heads(kernel, parts: tuple, h: int, backend: Backend) -> jax.Array:
    """A fused kernel [..., embed, (sum parts) H] of parts whose head counts the fewest (g) divides,
    regrouped [..., embed, g, heads per group, H] (group j: each part's heads of group j, one part after
    another) and split over the `head_mesh`'s tensor axis by group: one gather of the columns in their new
    order, its output split, so that each device gathers only its own groups' columns from the kernel
    (whole on each tensor device). The decoder's (`heads_grouped`); the model regroups in a training step
    as before (`Dense._by_heads`): the 3 parts' slices, each held whole on every device (1 GiB over Llama
    3 8B's 32 layers at tensor=8 when a decoder made them once per call), concatenated."""
    g, cols = min(parts), kernel.shape[-1]
    bounds = [sum(parts[:i]) * h for i in range(len(parts) + 1)]
    order = np.arange(cols).reshape(cols // h, h)
    order = np.concatenate([order[lo // h:hi // h].reshape(g, n // g, h) for n, lo, hi in
                            zip(parts, bounds, bounds[1:])], axis=1).reshape(-1)
    w = backend.shard_heads(jnp.take(kernel, order, axis=-1), kernel.ndim - 1, g, rows=False)
    return backend.shard_heads(w.reshape(*kernel.shape[:-1], g, -1, h), kernel.ndim - 1, g, rows=False)


def heads_grouped(params, config: GPTConfig, backend: Backend) -> dict:
    """A "prepared" collection of every c_attn kernel in `params` regrouped by kv head (`group_by_heads`,
    as `GROUPED`) when `backend` splits attention by heads (`head_mesh`, the tensor size dividing the kv
    heads), else {}. A decoder makes it once per call, outside its loop over the new tokens: built inside
    the model instead, XLA hoists the loop-invariant regrouping out of the loop whole, one kernel on every
    device for each layer (issue 59: 48 MiB a layer of Llama 3 8B at tensor=8), where each device needs
    only its own groups."""
    if backend.head_mesh is None or config.n_kv_head % backend.tensor_size:
        return {}
    parts = (config.n_head, config.n_kv_head, config.n_kv_head)
    grouped = {path[:-1] + (GROUPED,): group_by_heads(w, parts, config.head_dim, backend)
               for path, w in traverse_util.flatten_dict(params).items() if path[-2:] == ("c_attn", "kernel")}
    return traverse_util.unflatten_dict(grouped)


def bias_info(kernel: ParamInfo) -> ParamInfo:
    """A dense layer's bias [out], declared from its kernel's declaration."""
    names = tuple(n.rsplit(".", 1)[0] + ".bias" for n in kernel.hf_name)
    return vector(kernel.axes[-1], output_only=kernel.output_only, hf_name=names)


def _dense(cfg: GPTConfig, backend: Backend, features: int, name: str, info: ParamInfo,
           residual_out: bool = False) -> Dense:
    # GPT-2 scales the init of layers that write into the residual stream by 1/sqrt(2 * n_layer);
    # `zero_init_proj` starts them at zero (each block then begins as the identity)
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if residual_out else 0.02
    init = nn.initializers.zeros if residual_out and cfg.zero_init_proj else nn.initializers.normal(stddev=std)
    return Dense(features, cfg.bias, cfg, backend, init, info=info, name=name)


def rms_normalize(x, eps: float = 1e-6):
    """x / rms(x) over the last axis, computed in float32, without a learned scale (QK-norm's)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _layer_norm(cfg: GPTConfig, dtype, name: str) -> nn.Module:
    return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, use_bias=cfg.bias, dtype=dtype, param_dtype=cfg.params_dtype,
                        name=name)


def _rms_norm(cfg: GPTConfig, dtype, name: str) -> nn.Module:
    return nn.RMSNorm(epsilon=cfg.layer_norm_epsilon, dtype=dtype, param_dtype=cfg.params_dtype, name=name)


NORMS = {"layernorm": _layer_norm, "rmsnorm": _rms_norm}  # GPTConfig.norm -> a norm with a `scale`


def norm(cfg: GPTConfig, backend: Backend, name: str, hf_name: str = "") -> nn.Module:
    """The config's norm layer (LayerNorm with a bias when cfg.bias, or RMSNorm); its scale (and bias)
    declared as vectors over `embed`, `hf_name` the scale's Llama name."""
    layer = NORMS[cfg.norm](cfg, backend.activation_dtype(cfg.compute_dtype), name)
    declare(layer, "scale", vector("embed", hf_name=hf_name or ()))
    declare(layer, "bias", vector("embed"))
    return layer


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention, reading and writing a KV cache when given one."""

    config: GPTConfig
    backend: Backend
    deterministic: bool = True
    output_only: bool = False  # c_proj's output feeds only the block's output (the parallel block's)

    @nn.compact
    def __call__(self, x_BxTxD, positions_BxT, cache: Optional[KVCache] = None, layer=None, value_embed=None,
                 segment_ids=None):
        """`value_embed` [B, T, K*H] (GPTConfig.value_embeds): mixed into the values with two learned
        weights, `ve_mix`, before they are attended to or cached. `segment_ids` [B, T]: document masking."""
        cfg, backend = self.config, self.backend
        b, t, _ = x_BxTxD.shape
        n, kh, h = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # q, k and v from c_attn's [q | k | v] columns: on a tensor mesh each split by heads over it
        c_attn = Dense((n + 2 * kh) * h, cfg.bias, cfg, backend, info=qkv_info(cfg), parts=(n, kh, kh), name="c_attn")
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = c_attn(x_BxTxD)
        if value_embed is not None:
            declare(self, "ve_mix", ParamInfo("mixing", ("mix",)))
            mix = self.param("ve_mix", nn.initializers.constant(0.5), (2,), jnp.float32).astype(v_BxTxKxH.dtype)
            v_BxTxKxH = mix[0] * v_BxTxKxH + mix[1] * value_embed.reshape(b, t, kh, h).astype(v_BxTxKxH.dtype)
        if cfg.qk_norm:
            q_BxTxNxH, k_BxTxKxH = rms_normalize(q_BxTxNxH), rms_normalize(k_BxTxKxH)
        if cfg.position == "rope":
            q_BxTxNxH = rotary_embedding(q_BxTxNxH, positions_BxT, cfg.rope_theta)
            k_BxTxKxH = rotary_embedding(k_BxTxKxH, positions_BxT, cfg.rope_theta)
        # (segment ids only when given: an `attend` edited in a fork keeps its six arguments otherwise)
        segment_kw = {} if segment_ids is None else {"segment_ids": segment_ids}
        out_BxTxNxH, cache = self.attend(q_BxTxNxH, k_BxTxKxH.swapaxes(1, 2), v_BxTxKxH.swapaxes(1, 2),
                                         positions_BxT, cache, layer, **segment_kw)
        if backend.sequence_mesh is not None:  # (and its gradient: else GSPMD splits it along T, as c_proj's)
            out_BxTxNxH = backend.shard_heads(out_BxTxNxH, 2, n)
        out_info = matrix("heads", "embed", targets=(("o", None),), output_only=self.output_only,
                          hf_name="self_attn.o_proj.weight")
        y = _dense(cfg, backend, cfg.n_embd, "c_proj", out_info, residual_out=True)(out_BxTxNxH.reshape(b, t, n * h))
        y = backend.shard_sequence(y)  # (sequence parallelism: each device keeps the sums of its positions)
        return nn.Dropout(cfg.dropout)(y, deterministic=self.deterministic), cache

    def attend(self, q_BxTxNxH, k_BxKxTxH, v_BxKxTxH, positions_BxT, cache: Optional[KVCache], layer,
               segment_ids=None):
        """Attention's one call site for training, prefill and decode: the registered function (as the
        backend computes it) over these keys, or over the cache once they are written into it."""
        attend = self.backend.attention(self.config.attention)
        if segment_ids is not None:  # queries and keys at 0..T-1, each within its document
            if not takes_segments(attend):
                raise ValueError(f"attention {self.config.attention!r} takes no segment_ids_BxT keyword, which "
                                 "document masking needs; add it to the registered function (jaxgpt/attention.py) "
                                 "or train without document masking (data.doc_mask=False)")
            return attend(q_BxTxNxH, k_BxKxTxH, v_BxKxTxH, None, None, segment_ids_BxT=segment_ids), None
        if cache is None:  # queries and keys at 0..T-1
            return attend(q_BxTxNxH, k_BxKxTxH, v_BxKxTxH, None, None), None
        if isinstance(cache, PagedCache):  # a ragged step over a page pool: each token within its own request
            cache = cache.write(layer, k_BxKxTxH, v_BxKxTxH)
            return paged.attend(q_BxTxNxH, cache, layer, self.backend), cache
        if isinstance(cache, PackedCache):  # several prompts in one row: each attends within itself
            cache = cache.write(layer, k_BxKxTxH, v_BxKxTxH)
            k_BxKxTxH, v_BxKxTxH = (a.astype(q_BxTxNxH.dtype) for a in cache.layer(layer))
            return packed_attention(q_BxTxNxH, k_BxKxTxH, v_BxKxTxH, cache.segments, cache.window), cache
        kv_lengths_B = cache.lengths + q_BxTxNxH.shape[1]
        cache = cache.write(layer, k_BxKxTxH, v_BxKxTxH)
        own = self.backend.cache_attention
        # (only for the backend's own built-in: a replaced "dot_product" runs as written)
        if own is not None and attend is dict(self.backend.attention_kernels).get("dot_product"):
            out = own(q_BxTxNxH, cache, layer, positions_BxT, kv_lengths_B)
            if out is not None:  # the backend reads the keys and values as they are stored
                return out, cache
        # a cache kept in another dtype is read in the compute dtype
        k_BxKxSxH, v_BxKxSxH = (a.astype(q_BxTxNxH.dtype) for a in cache.layer(layer))
        return in_query_chunks(attend, q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, positions_BxT, kv_lengths_B), cache


QUERY_CHUNK = 256  # queries attended at once over a cache (a prompt's prefill): `in_query_chunks`


def in_query_chunks(attend, q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, positions_BxT, kv_lengths_B, chunk=None):
    """`attend(q, k, v, positions, kv_lengths)` over a cache, the queries `chunk` at a time in a loop when
    there are more: each query attends alone, so the output is the same, but the scores (float32 [B, N,
    T, S] in XLA's attention) are held for `chunk` (default QUERY_CHUNK) queries, not all of them (issue 59:
    a 2048-token prompt over a 4096-position cache held 1 GiB of them a chip). The last chunk is padded (its
    position repeated)."""
    b, t = q_BxTxNxH.shape[:2]
    chunk = chunk or QUERY_CHUNK
    if t <= chunk or positions_BxT is None:
        return attend(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, positions_BxT, kv_lengths_B)
    n = -(-t // chunk)
    q = jnp.pad(q_BxTxNxH, ((0, 0), (0, n * chunk - t), (0, 0), (0, 0)))
    positions = jnp.pad(positions_BxT, ((0, 0), (0, n * chunk - t)), mode="edge")
    q_CxBxTxNxH = q.reshape(b, n, chunk, *q.shape[2:]).swapaxes(0, 1)
    positions_CxBxT = positions.reshape(b, n, chunk).swapaxes(0, 1)
    out = jax.lax.map(lambda qp: attend(qp[0], k_BxKxSxH, v_BxKxSxH, qp[1], kv_lengths_B),
                      (q_CxBxTxNxH, positions_CxBxT))
    return out.swapaxes(0, 1).reshape(b, n * chunk, *out.shape[3:])[:, :t]


def qkv_info(cfg: GPTConfig) -> ParamInfo:
    """Attention's fused projection [embed, (N + 2K) H] = [q | k | v]: LoRA's q, k and v adapt one part
    of its columns each; Llama stores it as three tensors."""
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    parts = (("q", (0, q)), ("k", (q, q + kv)), ("v", (q + kv, q + 2 * kv)))
    return matrix("embed", "qkv", targets=parts, hf_name=tuple(f"self_attn.{x}_proj.weight" for x in "qkv"))


def _mlp_columns(backend: Backend, y):
    """The MLP's hidden activations [B, T, mlp] held split over tensor by columns (c_fc's, c_gate's) under
    sequence parallelism, and so their gradients: left free, GSPMD splits the backward's along T instead and
    moves them with all-to-alls (issue 59). `y` itself without a sequence mesh."""
    return y if backend.sequence_mesh is None else backend.shard_heads(y, y.ndim - 1, y.shape[-1])


UP = matrix("embed", "mlp", targets=(("up", None),), hf_name="mlp.up_proj.weight")
GATE = matrix("embed", "mlp", targets=(("gate", None),), hf_name="mlp.gate_proj.weight")


class GeluMLP(nn.Module):
    """GPT-2's MLP: c_fc, GELU (tanh approximation), c_proj."""

    config: GPTConfig
    backend: Backend
    deterministic: bool = True
    output_only: bool = True  # c_proj's output feeds only the block's output

    def hidden(self, x_BxTxD):
        up = _mlp_columns(self.backend, _dense(self.config, self.backend, self.config.mlp_hidden, "c_fc", UP)(x_BxTxD))
        return nn.gelu(up, approximate=True)

    @nn.compact
    def __call__(self, x_BxTxD):
        down = matrix("mlp", "embed", targets=(("down", None),), output_only=self.output_only,
                      hf_name="mlp.down_proj.weight")
        cfg = self.config
        y = _dense(cfg, self.backend, cfg.n_embd, "c_proj", down, residual_out=True)(self.hidden(x_BxTxD))
        y = self.backend.shard_sequence(y)  # (sequence parallelism: each device keeps the sums of its positions)
        return nn.Dropout(self.config.dropout)(y, deterministic=self.deterministic)


class SwiGLUMLP(GeluMLP):
    """Llama's MLP: c_proj(silu(c_gate(x)) * c_fc(x)) (gate / up / down)."""

    def hidden(self, x_BxTxD):
        cfg, backend = self.config, self.backend
        up = _mlp_columns(backend, _dense(cfg, backend, cfg.mlp_hidden, "c_fc", UP)(x_BxTxD))
        gate = _mlp_columns(backend, _dense(cfg, backend, cfg.mlp_hidden, "c_gate", GATE)(x_BxTxD))
        return nn.silu(gate) * up


class ReluSquaredMLP(GeluMLP):
    """The speedrun's MLP: c_proj(relu(c_fc(x)) ** 2)."""

    def hidden(self, x_BxTxD):
        up = _mlp_columns(self.backend, _dense(self.config, self.backend, self.config.mlp_hidden, "c_fc", UP)(x_BxTxD))
        return jnp.square(nn.relu(up))


MLPS = {"gelu": GeluMLP, "swiglu": SwiGLUMLP, "relu2": ReluSquaredMLP}  # GPTConfig.mlp -> the MLP module


@BLOCKS.register("gpt2", builtin=True)
class Block(nn.Module):
    """Pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x)); GPT-2's block, and Llama's with its parts."""

    config: GPTConfig
    backend: Backend
    deterministic: bool = True

    @nn.compact
    def __call__(self, x_BxTxD, positions_BxT, cache: Optional[KVCache] = None, layer=None, **extras):
        cfg, backend, det = self.config, self.backend, self.deterministic
        # (with sequence parallelism x is split along T; each norm's output is gathered for the matmuls)
        h = backend.gather_sequence(norm(cfg, backend, "ln_1", "input_layernorm.weight")(x_BxTxD))
        y, cache = CausalSelfAttention(cfg, backend, det, name="attn")(h, positions_BxT, cache, layer, **extras)
        x_BxTxD = x_BxTxD + y
        h = backend.gather_sequence(norm(cfg, backend, "ln_2", "post_attention_layernorm.weight")(x_BxTxD))
        x_BxTxD = x_BxTxD + MLPS[cfg.mlp](cfg, backend, det, name="mlp")(h)
        return x_BxTxD, cache


@BLOCKS.register("parallel", builtin=True)
class ParallelBlock(nn.Module):
    """GPT-J / PaLM's parallel block: x + attn(ln_1(x)) + mlp(ln_1(x)), one norm for both branches."""

    config: GPTConfig
    backend: Backend
    deterministic: bool = True

    @nn.compact
    def __call__(self, x_BxTxD, positions_BxT, cache: Optional[KVCache] = None, layer=None, **extras):
        cfg, backend, det = self.config, self.backend, self.deterministic
        h = backend.gather_sequence(norm(cfg, backend, "ln_1", "input_layernorm.weight")(x_BxTxD))
        # both branches' projections write only the block's output
        y, cache = CausalSelfAttention(cfg, backend, det, output_only=True, name="attn")(h, positions_BxT, cache,
                                                                                       layer, **extras)
        return x_BxTxD + y + MLPS[cfg.mlp](cfg, backend, det, name="mlp")(h), cache


# GPTConfig.remat -> jax.checkpoint policy: None saves nothing (the block is recomputed from its input),
# "dots" keeps the outputs of matmuls without batch dimensions (the dense layers'). "offload" is "block" with
# the scanned blocks' saved inputs moved to the host's memory (`_OFFLOAD_POLICY`, in `GPT._scan_blocks`);
# unrolled (no scan_layers) it is "block".
_REMAT_POLICIES = {"block": None, "offload": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
BLOCK_INPUT = "block_input"  # the checkpoint name of a scanned block's input (remat="offload")
# (JAX's host offload: the named value goes to pinned host memory in the forward and comes back in the backward)
_OFFLOAD_POLICY = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=[BLOCK_INPUT], offload_src="device",
    offload_dst="pinned_host")


@functools.lru_cache(maxsize=None)
def _remat(block_cls, mode: str):
    return nn.remat(block_cls, policy=_REMAT_POLICIES[mode])


class GPT(nn.Module):
    """Token (+ position) embeddings, `n_layer` registered blocks, a final norm, a (tied) head -> float32
    logits [B, T, V]. With `cache=` the tokens continue each row at its cache length and the call returns
    `(logits, new_cache)` (NaN logits for a row that overflows it, under jit); `token_lengths` [B] counts
    each row's real tokens, `logits_index` [B] keeps one position per row. `hidden=True` returns the final
    norm's output [B, T, D] instead of logits, for `head` to turn into logits a piece at a time (the
    chunked loss, jaxgpt.training.step). `segment_ids` int [B, T] (no cache; contiguous ids, one per
    document): each document computed as if it stood alone, its positions from 0 and its tokens attending
    only to its own earlier tokens (document masking). `backend` None: resolve(config)."""

    config: GPTConfig
    backend: Optional[Backend] = None

    def setup(self):
        # the untied head is made here, not inline in __call__, so that `head` also runs on its own
        # (`model.apply(variables, h, method=GPT.head)`); its parameters keep the name lm_head
        if not self.config.tie_embeddings:
            self.lm_head = Dense(self.config.vocab_size, False, self.config, self._backend(), out_dtype=jnp.float32,
                                 info=matrix("embed", "vocab", muon=False, hf_name="lm_head.weight"))

    @nn.nowrap
    def _backend(self) -> Backend:
        return self.backend or resolve(self.config)

    @nn.compact
    def __call__(self, tokens_BxT: jax.Array, cache: Optional[KVCache] = None, *,
                 token_lengths: Optional[jax.Array] = None, logits_index: Optional[jax.Array] = None,
                 deterministic: bool = True, hidden: bool = False, segment_ids: Optional[jax.Array] = None):
        cfg = self.config
        backend = self._backend()
        if tokens_BxT.ndim != 2:
            raise ValueError(f"tokens must be int [batch, time], got shape {tokens_BxT.shape}")
        b, t = tokens_BxT.shape
        if t > cfg.block_size and not isinstance(cache, PagedCache):  # (a paged step's tokens are many requests')
            raise ValueError(f"sequence length {t} exceeds block_size {cfg.block_size}")
        positions_BxT = self._positions(b, t, cache, segment_ids)
        overflow_B = None if cache is None else cache.overflow(t)
        per_row = cache is not None or segment_ids is not None  # (else every row has positions 0..t-1)
        x_BxTxD = self._embed(tokens_BxT, positions_BxT, backend, deterministic, per_row)
        skip_Lx2, ve_L = self._layer_inputs(tokens_BxT, backend)
        x0_BxTxD = x_BxTxD if skip_Lx2 is not None else None
        x_BxTxD = backend.shard_sequence(x_BxTxD)  # (sequence parallelism: the blocks' inputs split along T)
        if cfg.scan_layers:
            x_BxTxD, cache = self._scan_blocks(x_BxTxD, positions_BxT, cache, backend, deterministic,
                                               x0_BxTxD, skip_Lx2, ve_L, segment_ids)
        else:
            remat = cfg.remat != "none" and cache is None and not self.is_initializing()
            block_cls = _remat(BLOCKS.get(cfg.block), cfg.remat) if remat else BLOCKS.get(cfg.block)
            for i in range(cfg.n_layer):
                x_BxTxD = _mix_embedding(x_BxTxD, x0_BxTxD, None if skip_Lx2 is None else skip_Lx2[i])
                extras = {} if ve_L is None else {"value_embed": ve_L[i]}
                if segment_ids is not None:
                    extras["segment_ids"] = segment_ids
                block = block_cls(cfg, backend, deterministic, name=f"h_{i}")
                declare_block(block)
                out = block(x_BxTxD, positions_BxT, cache, None if cache is None else i, **extras)
                x_BxTxD, cache = _checked_block_output(out, x_BxTxD, cfg)
                x_BxTxD = backend.shard_sequence(x_BxTxD)
        x_BxTxD = backend.gather_sequence(x_BxTxD)
        if logits_index is not None:
            x_BxTxD = jnp.take_along_axis(x_BxTxD, logits_index.astype(jnp.int32)[:, None, None], axis=1)
        h_BxTxD = norm(cfg, backend, "ln_f", "model.norm.weight")(x_BxTxD)
        if cache is not None:  # an overflowing row's output is NaN (marked on [B, T, D], not on the logits)
            h_BxTxD = jnp.where(overflow_B[:, None, None], jnp.nan, h_BxTxD)
        out = h_BxTxD if hidden else self.head(h_BxTxD)
        if cache is None:
            return out
        return out, cache.advance(t if token_lengths is None else token_lengths)

    @nn.nowrap
    def _positions(self, b: int, t: int, cache: Optional[KVCache], segment_ids: Optional[jax.Array]):
        """int32 [B, T]: each token's position: 0..T-1, after the cache's tokens, or within its document."""
        if segment_ids is not None:
            if cache is not None:
                raise ValueError("segment_ids (document masking) is for the forward without a cache")
            if segment_ids.shape != (b, t):
                raise ValueError(f"segment_ids must be int [batch, time] = {(b, t)}, got {segment_ids.shape}")
            return segment_positions(segment_ids)
        if cache is not None:
            return cache.positions(t)
        return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))

    def _embed(self, tokens_BxT, positions_BxT, backend: Backend, deterministic: bool, per_row: bool):
        """Token (+ learned position) embeddings, after dropout."""
        cfg = self.config
        act_dtype = backend.activation_dtype(cfg.compute_dtype)
        wte = nn.Embed(cfg.vocab_size, cfg.n_embd, embedding_init=_init, dtype=act_dtype,
                       param_dtype=cfg.params_dtype, name="wte")
        declare(wte, "embedding", embedding("vocab", "embed", head=cfg.tie_embeddings,
                                            hf_name="model.embed_tokens.weight"))
        x_BxTxD = wte(tokens_BxT)
        if cfg.position == "learned":  # (rotary positions turn q and k inside attention)
            wpe = nn.Embed(cfg.block_size, cfg.n_embd, embedding_init=_init, dtype=act_dtype,
                           param_dtype=cfg.params_dtype, name="wpe")
            declare(wpe, "embedding", embedding("position", "embed"))
            # without a cache every row has positions 0..t-1: one [1, T, D] lookup broadcast over the rows
            # (its gradient a sum over the rows, which a batch sharded on a mesh reduces where it lies)
            steps = jnp.arange(tokens_BxT.shape[1], dtype=jnp.int32)[None, :]
            x_BxTxD = x_BxTxD + (wpe(positions_BxT) if per_row else wpe(steps))
        return nn.Dropout(cfg.dropout)(x_BxTxD, deterministic=deterministic)

    def _layer_inputs(self, tokens_BxT, backend: Backend):
        """What each block takes besides the residual stream: the embedding-skip weights [L, 2]
        (`embed_skip`: block i's input is w[i, 0] * x + w[i, 1] * embedding, starting at 1 and 0) and the
        value embeddings, one [B, T, K*H] per block (`value_embeds` = k: tables 0..k-1 feed blocks 0..k-1
        and again the last k blocks; the blocks between get zeros). None for an option that is off."""
        cfg = self.config
        skip_Lx2 = None
        if cfg.embed_skip:
            def init(_, shape):
                return jnp.zeros(shape, jnp.float32).at[:, 0].set(1.0)
            # (two dimensions: decayed, as every parameter of two dimensions was before the schema)
            declare(self, "embed_skip", ParamInfo("mixing", ("layers", "mix"), decay=True))
            skip_Lx2 = self.param("embed_skip", init, (cfg.n_layer, 2))
        if not cfg.value_embeds:
            return skip_Lx2, None
        k, width = cfg.value_embeds, cfg.n_kv_head * cfg.head_dim
        act_dtype = backend.activation_dtype(cfg.compute_dtype)
        tables = []
        for j in range(k):
            table = nn.Embed(cfg.vocab_size, width, embedding_init=_init, dtype=act_dtype,
                             param_dtype=cfg.params_dtype, name=f"wve_{j}")
            declare(table, "embedding", embedding("vocab", "kv_heads"))
            tables.append(table(tokens_BxT))
        zeros = jnp.zeros(tokens_BxT.shape + (width,), act_dtype)
        ve_L = [tables[i] if i < k else tables[i - (cfg.n_layer - k)] if i >= cfg.n_layer - k else zeros
                for i in range(cfg.n_layer)]
        return skip_Lx2, ve_L

    def head(self, h_BxTxD: jax.Array) -> jax.Array:
        """float32 logits [B, T, V] of final-norm outputs h [B, T, D]: the untied `lm_head`, or h @ wte.T
        contracting the table as it is stored (or the backend's prepared copy of it); soft-capped to
        (-cap, cap) with `logit_softcap`. The model's one head, for the full forward and the chunked loss."""
        cfg = self.config
        if not cfg.tie_embeddings:
            logits = self.lm_head(h_BxTxD)
        else:
            head = (self.get_variable("prepared", *HEAD) if self.has_variable("prepared", *HEAD)
                    else self.get_variable("params", "wte")["embedding"])
            logits = self._backend().linear(h_BxTxD, head, cfg.compute_dtype, w_out_in=True, out_dtype=jnp.float32)
        if cfg.logit_softcap:
            logits = cfg.logit_softcap * jnp.tanh(logits / cfg.logit_softcap)
        return logits

    def _scan_blocks(self, x_BxTxD, positions_BxT, cache: Optional[KVCache], backend: Backend,
                     deterministic: bool, x0_BxTxD=None, skip_Lx2=None, ve_L=None, segment_ids=None):
        """The blocks as one lax.scan over the stacked parameters `h` (and the stacked cache, if any), with
        each block's embedding-skip weights and value embedding (`_layer_inputs`) scanned beside them;
        `segment_ids` (document masking) the same for every block."""
        cfg = self.config
        block = BLOCKS.get(cfg.block)(cfg, backend, deterministic, parent=None)  # applied to one layer's params

        probe = {} if ve_L is None else {"value_embed": ve_L[0]}

        def init_stacked(rng, x, positions):
            def one(key):
                return block.init({"params": key}, x, positions, **probe)["params"]
            return jax.vmap(one)(jax.random.split(rng, cfg.n_layer))

        stacked = self.param("h", init_stacked, x_BxTxD, positions_BxT)
        # LoRA adapters and a backend's prepared kernels, stacked like the layers
        extra = {c: self.variables[c]["h"] for c in ("lora", "prepared") if "h" in self.variables.get(c, {})}
        dropout_rng = None if deterministic or cfg.dropout == 0.0 else self.make_rng("dropout")

        def layer(carry, xs):
            x, cache = carry
            if cfg.remat == "offload" and cache is None:  # (the block's input, which remat saves, kept on the host)
                x = checkpoint_name(x, BLOCK_INPUT)
            variables, i, skip_2, ve = xs
            rngs = {} if dropout_rng is None else {"dropout": jax.random.fold_in(dropout_rng, i)}
            extras = {} if ve is None else {"value_embed": ve}
            if segment_ids is not None:
                extras["segment_ids"] = segment_ids
            out = block.apply(variables, _mix_embedding(x, x0_BxTxD, skip_2), positions_BxT, cache,
                              None if cache is None else i, rngs=rngs, **extras)
            x, cache = _checked_block_output(out, x, cfg)
            return (backend.shard_sequence(x), cache), None  # (the carry, which remat saves, split along T)

        if cfg.remat != "none" and cache is None:
            policy = _OFFLOAD_POLICY if cfg.remat == "offload" else _REMAT_POLICIES[cfg.remat]
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
        xs = ({"params": stacked, **extra}, jnp.arange(cfg.n_layer, dtype=jnp.int32), skip_Lx2,
              None if ve_L is None else jnp.stack(ve_L))
        (x_BxTxD, cache), _ = jax.lax.scan(layer, (x_BxTxD, cache), xs)
        return x_BxTxD, cache


def _checked_block_output(out, x_BxTxD, cfg: GPTConfig):
    """A block's (x, cache), checked while tracing: x must keep its input's shape [B, T, D], or the
    logits and the loss would silently broadcast over a wrong one."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and hasattr(out[0], "shape")):
        raise TypeError(f"block {cfg.block!r} ({BLOCKS.get(cfg.block).__name__}) returned "
                        f"{type(out).__name__}; a block returns (x [B, T, D], cache)")
    if out[0].shape != x_BxTxD.shape:
        raise ValueError(f"block {cfg.block!r} ({BLOCKS.get(cfg.block).__name__}) returned x of shape "
                         f"{tuple(out[0].shape)} for an input of {tuple(x_BxTxD.shape)}; a block returns x of "
                         "its input's shape [B, T, D]")
    return tuple(out)


def _mix_embedding(x_BxTxD, x0_BxTxD, skip_2):
    """Block input with the embedding mixed in: skip[0] * x + skip[1] * x0 (x itself when off)."""
    if skip_2 is None:
        return x_BxTxD
    w = skip_2.astype(x_BxTxD.dtype)
    return w[0] * x_BxTxD + w[1] * x0_BxTxD


# ---------------------------------------------------------------------------------------------------
# Parameters

def init_params(config: GPTConfig, rng: jax.Array) -> dict:
    """Freshly initialised parameters (the `params` collection); built unrolled and stacked for
    `scan_layers`, so both layouts start from the same values. Backend-independent (portable). Their
    schema is computed too (once per config), so code given only these params finds it."""
    param_schema(config)
    tokens = jnp.zeros((1, min(8, config.block_size)), jnp.int32)
    # an attention function has no parameters: the reference one builds the same tree without needing
    # what another may (cuDNN's needs its libraries even to trace)
    unrolled = GPT(config.replace(scan_layers=False, remat="none", attention="dot_product"), backend=PORTABLE)
    # one jitted program: eager init would compile every initializer op separately
    return jax.jit(lambda key: convert_layers(unrolled.init(key, tokens)["params"], config))(rng)


@functools.lru_cache(maxsize=64)
def abstract_params(config: GPTConfig):
    """The parameters' shapes and dtypes (jax.ShapeDtypeStruct leaves), without allocating them."""
    param_schema(config)
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


def count_params(params, non_embedding: bool = False) -> int:
    """Number of parameters; `non_embedding` leaves out the tables that are only looked up: wpe, and wte
    when an untied `lm_head` does the output matmul."""
    total = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
    if non_embedding:
        lookups = ["wpe"] + [k for k in params if k.startswith("wve_")] + (["wte"] if "lm_head" in params else [])
        total -= sum(int(x.size) for name in lookups if name in params
                     for x in jax.tree_util.tree_leaves(params[name]))
    return total


def num_params(config: GPTConfig, non_embedding: bool = True) -> int:
    """Parameters of the model `config` builds, counted on its abstract parameter tree."""
    return count_params(abstract_params(config), non_embedding=non_embedding)


def recompute_flops_per_token(config: GPTConfig, seq_len: Optional[int] = None) -> float:
    """The forward FLOPs per token that `config.remat` does again in the backward, beyond flops_per_token:
    with "block" (and "offload") each block's forward from its saved input (attention's 4 * n_layer * T *
    n_embd and 2 x the matmul parameters, less the projections whose outputs feed only the block's output:
    the MLP's c_proj, and attention's too in the parallel block; XLA drops those); 0 with "none" (nothing
    recomputed) and "dots" (matmul outputs kept: only elementwise work is redone)."""
    if config.remat not in ("block", "offload"):
        return 0.0
    t = config.block_size if seq_len is None else seq_len
    params = abstract_params(config)
    infos = leaf_infos(params, config)
    sizes = {path: int(x.size) for path, x in traverse_util.flatten_dict(params).items()}
    in_blocks = sum(n for path, n in sizes.items() if infos[path].block)
    skipped = sum(n for path, n in sizes.items() if infos[path].block and infos[path].output_only)
    return 2.0 * (in_blocks - skipped) + 4 * config.n_layer * t * config.n_head * config.head_dim


def flops_per_token(config: GPTConfig, seq_len: Optional[int] = None, causal_halved: bool = False) -> float:
    """Training FLOPs per token: 6N plus attention's 12 * n_layer * T * n_embd (PaLM appendix B), N the
    parameters that take part in a matmul; `causal_halved` halves the attention term."""
    t = config.block_size if seq_len is None else seq_len
    attn = 12 * config.n_layer * t * config.n_head * config.head_dim
    return 6.0 * num_params(config, non_embedding=True) + (attn / 2 if causal_halved else attn)


def _trace_init(config: GPTConfig):
    """The unrolled model's abstract params, its init traced (jax.eval_shape): what `param_schema` records
    the declarations of."""
    tokens = jnp.zeros((1, min(8, config.block_size)), jnp.int32)
    return jax.eval_shape(lambda: GPT(config, backend=PORTABLE).init(jax.random.key(0), tokens))["params"]


def undeclared_info(path: tuple, shape: tuple) -> ParamInfo:
    """What a parameter that no layer declared is taken to be (a hand-made params tree's, or a custom
    layer's that declares nothing): read from the names this module's layers give theirs, as everything
    was before the schema. A `kernel` of two dimensions (per layer) is a matrix, trained by Muon inside a
    block (`h_i`, or the stacked `h`); `wte` is the table a tied head uses; two or more dimensions
    (per layer) are decayed. No logical axes are known."""
    stacked = path[0] == "h"
    block = stacked or (path[0].startswith("h_") and path[0][2:].isdigit())
    per_layer = len(shape) - stacked
    axes = ("layers",) * stacked + (UNNAMED,) * per_layer
    if path[-1] == "kernel" and len(shape) >= 2:
        return ParamInfo("matrix", axes, muon=block, decay=per_layer >= 2, decode=per_layer == 2, block=block)
    if path == ("wte", "embedding"):
        return ParamInfo("embedding", axes, decay=True, decode=True)
    return ParamInfo("embedding" if per_layer >= 2 else "vector", axes, decay=per_layer >= 2, block=block)


install_schema(_trace_init, undeclared_info)
