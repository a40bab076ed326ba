"""Kernels for XLA's CPU backend: the same functions as the portable core, in the forms XLA:CPU runs fastest.

Selected by `GPTConfig(kernels="cpu")`, or `"auto"` on a CPU. Each one equals its portable counterpart to
float rounding (tests/test_kernels.py). Why each exists, with the measurements, is in bench/README.md:

- `linear`: dense layers on 2-D operands ([B*T, C]; XLA:CPU's weight gradient over a 3-D activation is
  slower), and for 2..16 rows against [out, in] kernels in float32 a fused multiply-and-sum instead of a
  matmul (decode at small batch: XLA:CPU's matmul reads the weights several times over). In bf16 its
  weight gradient multiplies a row-major copy of the transposed activation: XLA:CPU ran `x.T @ dy` in
  float32. (With the CPU kernels a bf16 model's activations stay float32: `kernels.activation_dtype`.)
- `decode_params`: the kernels for decoding 1..16 rows in float32, made once per `generate` call: packed
  for the native multiply (`panels_linear`, kernels/native.py and rows.cc, where a C++ compiler is at
  hand), else transposed [out, in] for `_few_rows`.
- `causal_attention`: self-attention that never computes the masked half of the score matrix: the native
  kernel (kernels/attention.cc, forward and backward, float32) where it is built, else
  `blocked_causal_attention`, blocks of 64 queries in XLA, each attending only to the keys up to its end
  (a Python loop whose length grows with T: right for XLA:CPU, wrong for accelerators).
- The KV cache's buffers stored [B*K, S, H], written with one `dynamic_update_slice` per row (16-bit
  floats as their uint16 bits, which XLA:CPU updates in place), and
  `cached_attention` with the query heads of a group stacked into one matrix per (row, kv head).
- `tune_allocator`: glibc keeps freed memory for reuse instead of returning big blocks to the OS.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

from jaxgpt.attention import MASK_VALUE, causal_mask, check_shapes
from jaxgpt.kernels import native
from jaxgpt.ops import _dense_bwd as ops_dense_bwd
from jaxgpt.ops import _dense_fwd as ops_dense_fwd

SMALL_ROWS = 16  # up to this many rows, [out, in] kernels are multiplied by `_few_rows`


def has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512_BF16 or AMX-BF16, per /proc/cpuinfo).

    Without them XLA:CPU converts bf16 to float32 around every matmul and a bf16 step is slower than a
    float32 one (measured 58-82 against 101-135 GFLOP/s on such a machine; bench/README.md). Off Linux:
    True, so nothing is changed on a guess.
    """
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags
_ALLOCATOR_TUNED = False


def tune_allocator() -> None:
    """Make glibc's malloc keep freed memory in the process, once per process (a no-op elsewhere).

    XLA:CPU allocates each call's temporary buffers anew; by default glibc serves big ones with fresh
    mmap pages and unmaps them on free, so every call pays the page faults again (13 ms of a 47 ms CPU
    baby training step; bench/README.md). The price: the process keeps its peak memory.
    """
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED:
        return
    _ALLOCATOR_TUNED = True
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_trim_threshold, m_mmap_max = -1, -4  # mallopt parameters (malloc.h)
    libc.mallopt(m_mmap_max, 0)  # no mmap'd blocks: everything from the heap, reused
    libc.mallopt(m_trim_threshold, 1 << 30)  # give memory back only past 1 GiB of free top


# ---------------------------------------------------------------------------------------------------
# Dense layers

def _few_rows(x: jax.Array, w: jax.Array, compute_dtype) -> jax.Array:
    """x [b, in] times w [out, in].T as one multiply-and-sum over `in`, products and sums in float32:
    each weight row is read once and used for every row of x while it is in cache."""
    xc = x.astype(compute_dtype).astype(jnp.float32)
    wc = w.astype(compute_dtype).astype(jnp.float32)
    return jnp.sum(wc[None, :, :] * xc[:, None, :], axis=-1)


def _row_major_transpose(a: jax.Array) -> jax.Array:
    """a [m, n] -> a.T [n, m], copied into row-major order.

    XLA folds a plain transpose into the dot that reads it (as a column-major operand, or as contracting
    dimension 0), and XLA:CPU's bf16 matmul (YNNPACK) takes neither: it converts both operands to float32
    and multiplies there, at half the rate. Through a unit axis the transpose stays a copy.
    """
    m, n = a.shape
    return jnp.transpose(a.reshape(m, n, 1), (1, 0, 2)).reshape(n, m)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _dense(x2, w, b, compute_dtype, out_dtype, w_out_in):
    return ops_dense_fwd(x2, w, b, compute_dtype, out_dtype, w_out_in)[0]


def _dense_bwd(compute_dtype, out_dtype, w_out_in, res, g):
    """`ops.linear`'s backward on 2-D operands, the weight gradient a plain [in, rows] x [rows, out] matmul
    of the transposed copy (see _row_major_transpose) when the compute dtype is not float32."""
    if compute_dtype == jnp.float32:  # (float32 matmuls run at one rate in every layout)
        return ops_dense_bwd(compute_dtype, out_dtype, w_out_in, res, g)
    xc, wc, (x_proto, w_proto, b_proto) = res
    db = None if b_proto is None else jnp.sum(g.astype(jnp.float32), axis=0).astype(b_proto.dtype)
    dy = g.astype(compute_dtype)
    dx = jax.lax.dot_general(dy, wc, (((1,), (0 if w_out_in else 1,)), ((), ())), preferred_element_type=jnp.float32)
    a, c = (dy, xc) if w_out_in else (xc, dy)  # dw = a.T @ c: [out, in] or [in, out]
    dw = jnp.matmul(_row_major_transpose(a), c, preferred_element_type=jnp.float32)
    return dx.astype(x_proto.dtype), dw.astype(w_proto.dtype), db


_dense.defvjp(ops_dense_fwd, _dense_bwd)


def linear(x: jax.Array, w: jax.Array, compute_dtype=jnp.float32, *, b=None, w_out_in: bool = False,
           out_dtype=None) -> jax.Array:
    """`ops.linear` on a 2-D view of x; in float32, 2..16 rows against an [out, in] kernel take `_few_rows`."""
    compute_dtype = jnp.dtype(compute_dtype)
    out_dtype = jnp.dtype(out_dtype or compute_dtype)
    features = w.shape[0] if w_out_in else w.shape[1]
    x2 = x.reshape(-1, x.shape[-1])
    if w_out_in and 1 < x2.shape[0] <= SMALL_ROWS and compute_dtype == jnp.float32:  # (see decode_params)
        y = _few_rows(x2, w, compute_dtype)
        y = (y if b is None else y + b.astype(jnp.float32)).astype(out_dtype)
    else:
        y = _dense(x2, w, b, compute_dtype, out_dtype, w_out_in)
    return y.reshape(*x.shape[:-1], features)


def panels_linear(x: jax.Array, panels: jax.Array, compute_dtype=jnp.float32, *, features: int, b=None,
                  out_dtype=None) -> jax.Array:
    """`linear` for a kernel packed by `native.pack` (float32, 1..16 rows: `decode_params`): the native
    multiply (kernels/rows.cc), then the bias add, in float32. No gradient: decoding only."""
    x2 = x.reshape(-1, x.shape[-1])
    y = native.rows_matmul(x2.astype(compute_dtype).astype(jnp.float32), panels, features)
    y = (y if b is None else y + b.astype(jnp.float32)).astype(out_dtype or compute_dtype)
    return y.reshape(*x.shape[:-1], features)


def decode_layout(batch_size: int, compute_dtype=jnp.float32) -> str:
    """How `decode_params` stores the kernels for decode steps of `batch_size` rows. In float32, 1..16 rows:
    "panels" with the native kernel (`native.available()`), else "out_in" for 2..16 rows. In bf16 XLA:CPU's
    matmul is the faster form (8 rows x [768, 3072]: 0.25 ms against 1.4 ms for the few-row sum): "in_out",
    the stored layout, as for more rows."""
    if not 1 <= batch_size <= SMALL_ROWS or jnp.dtype(compute_dtype) != jnp.float32:
        return "in_out"
    if native.available():
        return "panels"
    return "out_in" if batch_size > 1 else "in_out"


def decode_params(params: dict, batch_size: int, compute_dtype=jnp.float32, tie_embeddings: bool = True,
                  layout: Optional[str] = None) -> tuple[dict, str]:
    """(params, layout) for the decode steps of `batch_size` rows (the prefill keeps the stored layout),
    the layout `decode_layout`'s unless given: every dense kernel packed in panels for the native multiply,
    and a tied head's table too, as `wte_panels` beside `wte` (which the token lookup still reads); or every
    dense kernel transposed [out, in] (stacked [L, in, out] kernels too) for `_few_rows`."""
    layout = layout or decode_layout(batch_size, compute_dtype)
    if layout == "in_out":
        return params, layout

    def convert(path, leaf):
        if getattr(path[-1], "key", None) != "kernel":
            return leaf
        return native.pack(leaf) if layout == "panels" else leaf.swapaxes(-1, -2)

    params = jax.tree_util.tree_map_with_path(convert, params)
    if layout == "panels" and tie_embeddings and "wte" in params:
        params = {**params, "wte_panels": native.pack(params["wte"]["embedding"], w_out_in=True)}
    return params, layout


# ---------------------------------------------------------------------------------------------------
# Attention

def _grouped_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """Scaled q [B,T,N,H] -> [B,K,G,T,H]: the G query heads that share each of the K key/value heads."""
    b, t, n, h = q.shape
    scale = 1.0 / jnp.sqrt(jnp.asarray(h, jnp.float32))
    return (q * scale.astype(q.dtype)).reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """Scaled queries [..., M, H] over head-major keys/values [..., S, H]; `visible` broadcasts to
    [..., M, S]. One batched GEMM per matmul with no transposes; float32 scores, softmax and output."""
    scores = jnp.einsum("...mh,...sh->...ms", q, k, preferred_element_type=jnp.float32)
    weights = jax.nn.softmax(jnp.where(visible, scores, MASK_VALUE), axis=-1).astype(v.dtype)
    return jnp.einsum("...ms,...sh->...mh", weights, v, preferred_element_type=jnp.float32)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal self-attention (positions 0..T-1) of q [B,T,N,H] over k/v [B,T,K,H]: the native kernel
    (kernels/attention.cc, forward and backward) where it is built and takes the head size, else
    `blocked_causal_attention` in XLA."""
    check_shapes(q, k, v)
    if native.attention_supported(q.shape, k.shape):
        return native.causal_attention(q, k, v)
    return blocked_causal_attention(q, k, v)


def causal_attention_qkv(qkv: jax.Array, n_head: int, kv_heads: int) -> jax.Array:
    """`causal_attention` of a fused projection qkv [B, T, (N + 2K) H] (q, k, v in that order) -> [B,T,N,H].
    The native kernel reads it in place and returns its gradient as one array, where XLA would copy q, k
    and v out of it and concatenate their gradients back (~10 ms of a 6L train step, bench/README.md)."""
    b, t, c = qkv.shape
    h = c // (n_head + 2 * kv_heads)
    if native.attention_supported((b, t, n_head, h), (b, t, kv_heads, h)):
        return native.causal_attention_qkv(qkv, n_head, kv_heads).reshape(b, t, n_head, h)
    q, k, v = jnp.split(qkv, [n_head * h, (n_head + kv_heads) * h], axis=-1)
    return blocked_causal_attention(q.reshape(b, t, n_head, h), k.reshape(b, t, kv_heads, h),
                                    v.reshape(b, t, kv_heads, h))


def blocked_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int = 64) -> jax.Array:
    """Causal self-attention (positions 0..T-1) of q [B,T,N,H] over k/v [B,T,K,H] in XLA, in query blocks:
    block i attends to keys [0, (i+1)*block) only, about (n+1)/(2n) of the full work for n blocks."""
    check_shapes(q, k, v)
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    q_bkgth = _grouped_queries(q, kh)
    k_bksh, v_bksh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    outs = []
    for lo in range(0, t, block):
        hi = min(lo + block, t)
        q_pos = jnp.tile(jnp.arange(lo, hi, dtype=jnp.int32), g)  # row m is query lo + m % (hi - lo)
        visible = jnp.arange(hi, dtype=jnp.int32)[None, :] <= q_pos[:, None]
        out = _attend(q_bkgth[:, :, :, lo:hi].reshape(b, kh, g * (hi - lo), h), k_bksh[:, :, :hi],
                      v_bksh[:, :, :hi], visible)
        outs.append(out.reshape(b, kh, g, hi - lo, h))
    out = jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)


# ---------------------------------------------------------------------------------------------------
# The KV cache: each layer's buffer stored [B*K, S, H] (`KVCache.merged`), [L, B*K, S, H] when stacked.
# With the portable [B, K, S, H] buffers XLA:CPU copies every layer around its in-place update at batch 1
# (a unit dimension), and the scatter write is slower than a row loop (bench/README.md).

def write_rows(buf: jax.Array, new: jax.Array, lengths: jax.Array, layer=None) -> jax.Array:
    """new [B,T,K,H] written at positions lengths[b].. of each row b of buf [B*K, S, H] (or of layer
    `layer` of a stacked [L, B*K, S, H] buf): one dynamic_update_slice per row, done in place.

    A bf16 (or float16) buffer is written as its bits (uint16): XLA:CPU computes a dynamic_update_slice on
    a 16-bit float in float32, converting the whole buffer there and back at every row's write (bf16
    decode at batch 8: 2 ms per layer and step, 48 against 223 tok/s in float32)."""
    if jnp.issubdtype(buf.dtype, jnp.floating) and buf.dtype.itemsize == 2:
        as_bits = lambda a: jax.lax.bitcast_convert_type(a.astype(buf.dtype), jnp.uint16)  # noqa: E731
        return jax.lax.bitcast_convert_type(write_rows(as_bits(buf), as_bits(new), lengths, layer), buf.dtype)
    b, t, kh, h = new.shape
    new = new.swapaxes(1, 2).reshape(b * kh, t, h).astype(buf.dtype)
    zero = jnp.zeros((), jnp.int32)
    for r in range(b):
        rows = new[r * kh:(r + 1) * kh]
        start = (jnp.int32(r * kh), lengths[r], zero)
        if layer is not None:
            rows, start = rows[None], (jnp.asarray(layer, jnp.int32),) + start
        buf = jax.lax.dynamic_update_slice(buf, rows, start)
    return buf


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                     kv_lengths: jax.Array) -> jax.Array:
    """Attention of q [B,T,N,H] at `q_positions` over one layer's cache k/v [B, K, S, H] -> [B,T,N,H]: the
    G query heads of each kv head stacked into one taller matrix, one batched GEMM per (row, kv head)."""
    b, t, n, h = q.shape
    kh, s = k.shape[1], k.shape[2]
    g = n // kh
    mask = jnp.tile(causal_mask(q_positions, kv_lengths, s), (1, 1, g, 1))  # [B, 1, G*T, S]: row m is m % T
    mask = jnp.broadcast_to(mask, (b, kh, g * t, s)).reshape(b * kh, g * t, s)
    out = _attend(_grouped_queries(q, kh).reshape(b * kh, g * t, h), k.reshape(b * kh, s, h),
                  v.reshape(b * kh, s, h), mask)
    return out.reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)
