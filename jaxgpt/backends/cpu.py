"""The CPU backend: the core's functions in the forms XLA's CPU backend runs fastest, and native kernels.

Each piece equals its portable counterpart to float rounding (tests/test_backends.py); why each exists,
with the measurements, is in bench/README.md. Native kernels (native.py) are used only on CPUs where
they measured faster: AVX-512 ones.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct, traverse_util

from jaxgpt.attention import MASK_VALUE, causal_mask, check_segments, check_shapes, grouped_queries
from jaxgpt.backends import native
from jaxgpt.backends.base import Backend, int8_prepared
from jaxgpt.cache import CacheLayout, update_blocks
from jaxgpt.ops import int8_linear, linear_bwd, linear_fwd
from jaxgpt.quantize import Int8Kernel, decode_kernels, weights_int8

SMALL_ROWS = 16  # up to this many rows, [out, in] kernels are multiplied by `_few_rows`


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset:
    """This CPU's feature flags from /proc/cpuinfo (empty off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_bf16_matmul(flags: Optional[frozenset] = None) -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX512_BF16 or AMX-BF16); off Linux, True (no
    change made on a guess). Without them a bf16 step is slower than a float32 one."""
    flags = cpu_flags() if flags is None else flags
    return not flags or bool({"avx512_bf16", "amx_bf16"} & flags)


def native_kernels_pay(flags: frozenset) -> bool:
    """Whether the native kernels beat XLA's forms on a CPU with these flags: with AVX-512 only (their
    register tiles assume 32 vector registers; on AVX2 + FMA the generic decode matmul measured 13x slower
    at batch 8, bench/README.md). The float32 decode matmul has an AVX2 form: `native_float_rows`."""
    return "avx512f" in flags


AVX2_FLOAT_ROWS = 64  # below 64 rows XLA's float32 dot is weak on AVX2 (17-47 G multiply-adds a second at 8-32)


def native_float_rows(flags: frozenset) -> int:
    """Most rows of a float32 decode step multiplied by the native matmul (its panels), 0 for none: 16 with
    AVX-512; 64 with AVX2 + FMA, its AVX2 form (2026-12-08, a 2-core AMD EPYC, Zen 3, GPT-2 124M's kernels:
    0.43-0.71x XLA's dot's time at 8 rows, 0.53-0.83x at 32, 0.82-0.99x at 64, level at 1; XLA's reaches 62-81
    G multiply-adds a second from 128 rows; bench/README.md); 0 otherwise."""
    if native_kernels_pay(flags):
        return SMALL_ROWS
    return AVX2_FLOAT_ROWS if {"avx2", "fma"} <= flags else 0


def native_serving_kernels_pay(flags: frozenset) -> bool:
    """Whether the w8a8 matmul and paged attention beat XLA's forms: with AVX-512, and with AVX2 + FMA too
    (2026-12-07, a 2-core AMD EPYC with AVX2 only: the w8a8 matmul 1.4-3.4x XLA's dots at 1 to 32 rows and
    level at 512; paged attention, with its AVX2 forms, 4-6x the plain-JAX form on a decode step and 13-15x on
    a 256-token prompt chunk; bench/README.md)."""
    return native_kernels_pay(flags) or {"avx2", "fma"} <= flags


_ALLOCATOR_TUNED = False
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # mallopt's parameters (malloc.h)


def _mallopt(param: int, value: int) -> bool:
    """glibc's mallopt(param, value); False where the C library is not glibc."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return False
    return bool(libc.mallopt(param, value))


def tune_allocator() -> None:
    """Make glibc's malloc keep freed memory in the process (once; a no-op elsewhere), so that XLA:CPU's
    per-call temporaries do not fault in fresh pages at every call."""
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED:
        return
    _ALLOCATOR_TUNED = True
    _mallopt(M_MMAP_MAX, 0)
    _mallopt(M_TRIM_THRESHOLD, 1 << 30)


def single_malloc_arena() -> bool:
    """Make every thread allocate from glibc's main arena (mallopt M_ARENA_MAX = 1), unless MALLOC_ARENA_MAX
    is set or the C library is not glibc; returns whether it did. For a process whose compiled calls run on
    a thread other than the main one (jaxgpt-serve's engine thread), called before JAX starts its own
    threads: a thread's arena is chosen at its first allocation. In a thread's own arena the freed
    temporaries of each call went back to the OS and every call faulted them in again: jaxgpt-serve, GPT-2
    124M, w8a8, 32 requests in flight, took 6.1 million minor faults in 33 s of load, 163 in one arena,
    and its throughput went from 496 to 652 tokens/s (bench/README.md)."""
    return "MALLOC_ARENA_MAX" not in os.environ and _mallopt(M_ARENA_MAX, 1)


def inline_cpu_dispatch() -> bool:
    """Run CPU computations on the calling thread (`jax_cpu_enable_async_dispatch=False`) unless
    JAXGPT_CPU_ASYNC=1; only before JAX's first computation (the CLIs call it first). Returns whether it
    did. JAX's async threads re-fault large temporaries at every call (bench/README.md)."""
    if os.environ.get("JAXGPT_CPU_ASYNC", "0") == "1":
        return False
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return False
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True


def cpu_dispatch() -> str:
    """"inline" where JAX's CPU client runs computations on the calling thread, else "async"."""
    return "async" if jax.config.values["jax_cpu_enable_async_dispatch"] else "inline"


# ---------------------------------------------------------------------------------------------------
# Dense layers

@struct.dataclass
class PreparedKernel:
    """A dense kernel in a decode form: "panels" (native.pack's [ceil(out/16), in, 16], float32; or int8
    with `scale` per output, native.pack_int8's), "w8a8" (native.pack_w8a8's int8 panels, `scale` and
    `corr`) or "out_in"."""

    w: jax.Array
    features: int = struct.field(pytree_node=False)
    form: str = struct.field(pytree_node=False)
    scale: Optional[jax.Array] = None
    corr: Optional[jax.Array] = None


def _few_rows(x2: jax.Array, w_out_in: jax.Array, compute_dtype) -> jax.Array:
    """x [b, in] times w [out, in].T as one multiply-and-sum in float32: each weight row read once."""
    xc = x2.astype(compute_dtype).astype(jnp.float32)
    wc = w_out_in.astype(compute_dtype).astype(jnp.float32)
    return jnp.sum(wc[None, :, :] * xc[:, None, :], axis=-1)


def _row_major_transpose(a: jax.Array) -> jax.Array:
    """a [m, n] -> a.T [n, m] as a real copy: XLA:CPU's bf16 matmul runs in float32 on a folded transpose."""
    m, n = a.shape
    return jnp.transpose(a.reshape(m, n, 1), (1, 0, 2)).reshape(n, m)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _dense(x2, w, b, compute_dtype, out_dtype, w_out_in):
    return linear_fwd(x2, w, b, compute_dtype, out_dtype, w_out_in)[0]


def _dense_bwd(compute_dtype, out_dtype, w_out_in, res, g):
    """`ops.linear`'s backward on 2-D operands; in bf16 the weight gradient multiplies a row-major copy."""
    if compute_dtype == jnp.float32:
        return linear_bwd(compute_dtype, out_dtype, w_out_in, res, g)
    xc, wc, (x_proto, w_proto, b_proto) = res
    db = None if b_proto is None else jnp.sum(g.astype(jnp.float32), axis=0).astype(b_proto.dtype)
    dy = g.astype(compute_dtype)
    dx = jax.lax.dot_general(dy, wc, (((1,), (0 if w_out_in else 1,)), ((), ())), preferred_element_type=jnp.float32)
    a, c = (dy, xc) if w_out_in else (xc, dy)  # dw = a.T @ c: [out, in] or [in, out]
    dw = jnp.matmul(_row_major_transpose(a), c, preferred_element_type=jnp.float32)
    return dx.astype(x_proto.dtype), dw.astype(w_proto.dtype), db


_dense.defvjp(linear_fwd, _dense_bwd)


def linear(x: jax.Array, w, compute_dtype=jnp.float32, *, b=None, w_out_in: bool = False, out_dtype=None):
    """`ops.linear` on a 2-D view of x; 2..16 float32 rows against [out, in] take `_few_rows`, and a
    `PreparedKernel` its own multiply (no gradient: decoding only)."""
    compute_dtype = jnp.dtype(compute_dtype)
    out_dtype = jnp.dtype(out_dtype or compute_dtype)
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(w, Int8Kernel):
        return int8_linear(x, w, compute_dtype, b=b, w_out_in=w_out_in, out_dtype=out_dtype)
    if isinstance(w, PreparedKernel):
        features = w.features
        if w.form == "panels":  # the native kernels take up to MAX_ROWS (int8) or MAX_FLOAT_ROWS rows a call
            xf = x2.astype(compute_dtype).astype(jnp.float32)
            m = native.MAX_ROWS if w.scale is not None else native.MAX_FLOAT_ROWS
            if w.scale is not None:
                parts = [native.rows_matmul_int8(xf[i:i + m], w.w, w.scale, features) for i in range(0, len(xf), m)]
            else:
                parts = [native.rows_matmul(xf[i:i + m], w.w, features) for i in range(0, len(xf), m)]
            y = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
        elif w.form == "w8a8":  # any row count in one call (a prompt's chunk too)
            y = native.rows_matmul_w8a8(x2.astype(jnp.float32), w.w, w.scale, w.corr, features)
        else:
            y = _few_rows(x2, w.w, compute_dtype)
        y = (y if b is None else y + b.astype(jnp.float32)).astype(out_dtype)
    else:
        features = w.shape[0] if w_out_in else w.shape[1]
        if w_out_in and 1 < x2.shape[0] <= SMALL_ROWS and compute_dtype == jnp.float32:
            y = _few_rows(x2, w, compute_dtype)
            y = (y if b is None else y + b.astype(jnp.float32)).astype(out_dtype)
        else:
            y = _dense(x2, w, b, compute_dtype, out_dtype, w_out_in)
    return y.reshape(*x.shape[:-1], features)


def decode_form(batch_size: int, compute_dtype, native_decode: bool, panel_rows: int = SMALL_ROWS) -> Optional[str]:
    """The decode steps' kernel form for `batch_size` rows, float32 only: "panels" with the native multiply
    up to `panel_rows` rows, else "out_in" for 2..16 rows; None keeps the stored [in, out] (XLA's matmul is
    faster in bf16 and at more rows)."""
    if batch_size < 1 or jnp.dtype(compute_dtype) != jnp.float32:
        return None
    if native_decode and batch_size <= panel_rows and native.available():
        return "panels"
    return "out_in" if 1 < batch_size <= SMALL_ROWS else None


def _prepare(w: jax.Array, form: str, w_out_in: bool = False) -> PreparedKernel:
    features = w.shape[-2] if w_out_in else w.shape[-1]
    if form == "panels":
        return PreparedKernel(native.pack(w, w_out_in=w_out_in), features, form)
    return PreparedKernel(w if w_out_in else w.swapaxes(-1, -2), features, form)


def _prepare_int8(k: Int8Kernel, w_out_in: bool) -> PreparedKernel:
    features = k.q.shape[-2] if w_out_in else k.q.shape[-1]
    if k.activations == "int8":
        panels, scale, corr = native.pack_w8a8(k.q, k.scale, w_out_in=w_out_in)
        return PreparedKernel(panels, features, "w8a8", scale, corr)
    panels, scale = native.pack_int8(k.q, k.scale, w_out_in=w_out_in)
    return PreparedKernel(panels, features, "panels", scale)


def prepare_decode(params: dict, batch_size: int, compute_dtype, tie_embeddings: bool, quantize=None, *,
                   native_decode: bool, config=None, native_w8a8: Optional[bool] = None,
                   float_rows: Optional[int] = None) -> dict:
    """The "prepared" collection for decode steps of `batch_size` rows: every dense kernel ([in, out], or
    stacked [L, in, out] for scan_layers) in `decode_form`, and a tied head's table as `head` (the leaves
    the parameter schema marks `decode`, quantize.decode_kernels; `config`: the model's). With
    quantize="int8" and the native kernels on, int8 panels (any row count, 16 rows a call; any dtype), with
    "w8a8" the W8A8 kernel's panels. Without them the params (the dequantized model, quantize.dequantized)
    keep their float forms for "int8": XLA:CPU's int8 forms ran 10x slower than float32 (bench/README.md),
    so the same tokens come at float32's speed; "w8a8" multiplies `Int8Kernel`s with XLA's int8 dot
    (its tokens need the rounded activations; slow, but the same integers as the native kernel).
    `native_w8a8` (default `native_decode`) decides for "w8a8" alone: its kernel pays on AVX2 too; and
    `float_rows` (default 16 with `native_decode`, else 0) for the float32 panels alone: up to how many rows
    (`native_float_rows`)."""
    native_ok = native_decode if quantize != "w8a8" or native_w8a8 is None else native_w8a8
    if weights_int8(quantize) and native_ok and native.available():
        return int8_prepared(params, tie_embeddings, _prepare_int8, config=config, quantize=quantize)
    if quantize == "w8a8":
        return int8_prepared(params, tie_embeddings, config=config, quantize=quantize)
    rows = (SMALL_ROWS if native_decode else 0) if float_rows is None else float_rows
    form = decode_form(batch_size, compute_dtype, rows > 0, rows)
    if form is None:
        return {}
    flat = traverse_util.flatten_dict(params)
    prepared = {where: _prepare(flat[path], form, w_out_in=w_out_in)
                for path, (where, w_out_in) in decode_kernels(params, tie_embeddings, config).items()}
    return traverse_util.unflatten_dict(prepared)


# ---------------------------------------------------------------------------------------------------
# Attention

def _attend(q, k, v, visible):
    """Scaled queries [..., M, H] over keys/values [..., S, H]; `visible` broadcasts to [..., M, S]. One
    batched GEMM per matmul with no transposes; float32 scores, softmax and output."""
    scores = jnp.einsum("...mh,...sh->...ms", q, k, preferred_element_type=jnp.float32)
    weights = jax.nn.softmax(jnp.where(visible, scores, MASK_VALUE), axis=-1).astype(v.dtype)
    return jnp.einsum("...ms,...sh->...mh", weights, v, preferred_element_type=jnp.float32)


def blocked_causal_attention(q_BxTxNxH, k_BxKxTxH, v_BxKxTxH, block: int = 64, segment_ids_BxT=None) -> jax.Array:
    """Causal self-attention in XLA in query blocks: block i attends to keys [0, (i+1) * block) only,
    about (n+1)/(2n) of the full work for n blocks (a Python loop: right for XLA:CPU only); with
    `segment_ids_BxT` each query sees only keys of its own document."""
    check_shapes(q_BxTxNxH, k_BxKxTxH, v_BxKxTxH)
    b, t, n, h = q_BxTxNxH.shape
    kh = k_BxKxTxH.shape[1]
    g = n // kh
    q_BxKxGxTxH = grouped_queries(q_BxTxNxH, kh)
    outs = []
    for lo in range(0, t, block):
        hi = min(lo + block, t)
        q_pos = jnp.tile(jnp.arange(lo, hi, dtype=jnp.int32), g)  # row m is query lo + m % (hi - lo)
        visible = jnp.arange(hi, dtype=jnp.int32)[None, :] <= q_pos[:, None]
        if segment_ids_BxT is not None:  # [B, 1, G*M, hi]: the query's document is the key's
            q_seg = jnp.tile(segment_ids_BxT[:, lo:hi], (1, g))
            visible = visible & (q_seg[:, None, :, None] == segment_ids_BxT[:, None, None, :hi])
        out = _attend(q_BxKxGxTxH[:, :, :, lo:hi].reshape(b, kh, g * (hi - lo), h), k_BxKxTxH[:, :, :hi],
                      v_BxKxTxH[:, :, :hi], visible)
        outs.append(out.reshape(b, kh, g, hi - lo, h))
    out = jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_BxTxNxH.dtype)


def cached_attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT, kv_lengths_B) -> jax.Array:
    """Attention over a cache with the G query heads of each kv head stacked into one taller matrix:
    one batched GEMM per (row, kv head)."""
    b, t, n, h = q_BxTxNxH.shape
    kh, s = k_BxKxSxH.shape[1], k_BxKxSxH.shape[2]
    g = n // kh
    mask = jnp.tile(causal_mask(q_positions_BxT, kv_lengths_B, s), (1, 1, g, 1))  # [B, 1, G*T, S]
    mask = jnp.broadcast_to(mask, (b, kh, g * t, s)).reshape(b * kh, g * t, s)
    out = _attend(grouped_queries(q_BxTxNxH, kh).reshape(b * kh, g * t, h), k_BxKxSxH.reshape(b * kh, s, h),
                  v_BxKxSxH.reshape(b * kh, s, h), mask)
    return out.reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_BxTxNxH.dtype)


def dot_product_attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT=None, kv_lengths_B=None, *,
                          native_attention: bool = True, segment_ids_BxT=None) -> jax.Array:
    """The registry's "dot_product" attention for XLA:CPU: self-attention through the native kernel where
    it takes the shapes (else `blocked_causal_attention`), attention over a cache by `cached_attention`.
    Document-masked self-attention (`segment_ids_BxT`) always takes `blocked_causal_attention`: the native
    kernel has no document mask."""
    check_shapes(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT)
    check_segments(q_positions_BxT, kv_lengths_B, segment_ids_BxT)
    if segment_ids_BxT is not None:
        return blocked_causal_attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, segment_ids_BxT=segment_ids_BxT)
    if q_positions_BxT is not None or kv_lengths_B is not None:
        if q_positions_BxT is None:
            q_positions_BxT = jnp.arange(q_BxTxNxH.shape[1], dtype=jnp.int32)[None, :]
        return cached_attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT, kv_lengths_B)
    b, t, n, h = q_BxTxNxH.shape
    kh = k_BxKxSxH.shape[1]
    if native_attention and native.attention_supported((b, t, n, h), (b, t, kh, h)):
        # q, k, v joined as the fused [B, T, (N + 2K) H] projection they were split from: XLA folds the
        # concatenation of those slices back into the projection, and the kernel reads it in place
        # (and writes its gradient so), where separate operands would be copied out (bench/README.md)
        qkv = jnp.concatenate([q_BxTxNxH.reshape(b, t, n * h), k_BxKxSxH.swapaxes(1, 2).reshape(b, t, kh * h),
                               v_BxKxSxH.swapaxes(1, 2).reshape(b, t, kh * h)], axis=-1)
        return native.causal_attention_qkv(qkv, n, kh).reshape(b, t, n, h)
    return blocked_causal_attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH)


def native_cache_attention(q_BxTxNxH, cache, layer, q_positions_BxT, kv_lengths_B):
    """Attention over a KV cache in its stored form (RowsCacheLayout's [rows K, S, H] buffers, float32 or
    int8 with scales; a view's buffers may hold more rows than q) by the native kernel, which reads only
    each row's filled positions; None where the kernel does not take it (then XLA's form runs)."""
    if not isinstance(cache.layout, RowsCacheLayout):
        return None
    k, v = cache.k[layer], cache.v[layer]
    b, t, n, h = q_BxTxNxH.shape
    kh = k.shape[0] // cache.buffer_rows if cache.buffer_rows else k.shape[0] // b
    shape = (b, t, n, h)
    if not native.cached_attention_supported(shape, (b, kh, k.shape[1], k.shape[2]), k.dtype):
        return None
    if cache.quantized:
        out = native.cached_attention_int8(q_BxTxNxH, k, v, cache.k_scale[layer], cache.v_scale[layer],
                                           q_positions_BxT, kv_lengths_B, kv_heads=kh)
    else:
        out = native.cached_attention(q_BxTxNxH, k, v, q_positions_BxT, kv_lengths_B, kv_heads=kh)
    return out.astype(q_BxTxNxH.dtype)


def native_paged_attention(q_TxNxH, k, v, token_rows, positions, limits, block_tables, k_scale=None, v_scale=None):
    """Attention of a ragged step's queries over a paged cache's layer as stored (jaxgpt/paged.py; the
    signature of `Backend.paged_attention`) by the native kernel, which reads only each token's visible
    positions, through its row's block table; None where the kernel does not take it (a combined pool,
    16-bit pools, a head
    size it does not compile, no kernels built: then `paged.paged_attention` runs)."""
    int8 = k.dtype == jnp.int8
    if v is None or v.dtype != k.dtype or int8 != (k_scale is not None) or not native.paged_attention_supported(
            q_TxNxH.shape, k.shape, k.dtype):
        return None
    out = native.paged_attention(q_TxNxH, k, v, token_rows, limits, block_tables, k_scale, v_scale)
    return out.astype(q_TxNxH.dtype)


# ---------------------------------------------------------------------------------------------------
# The KV cache

@dataclasses.dataclass(frozen=True)
class RowsCacheLayout(CacheLayout):
    """Each layer stored [B*K, S, H] and written with one dynamic_update_slice per row, in place: with
    [B, K, S, H] XLA:CPU copies the buffer around the update at batch 1, and its scatter is slower.
    16-bit floats are written as their uint16 bits (XLA:CPU would convert the whole buffer to float32)."""

    def shape(self, batch, kv_heads, max_len, head_dim):
        return (batch * kv_heads, max_len, head_dim)

    def heads_axis(self):
        return None  # (rows and heads share the first axis: a tensor mesh keeps this cache whole)

    def read(self, buf, batch):
        return buf.reshape(batch, -1, *buf.shape[1:])

    def write(self, buf, new_BxKxTxH, lengths_B, layer=None):
        if jnp.issubdtype(buf.dtype, jnp.floating) and buf.dtype.itemsize == 2:
            bits = lambda a: jax.lax.bitcast_convert_type(a.astype(buf.dtype), jnp.uint16)  # noqa: E731
            return jax.lax.bitcast_convert_type(self.write(bits(buf), bits(new_BxKxTxH), lengths_B, layer), buf.dtype)
        b, kh, t, h = new_BxKxTxH.shape
        new = new_BxKxTxH.reshape(b * kh, t, h).astype(buf.dtype)
        zero = jnp.zeros((), jnp.int32)
        for r in range(b):
            rows, start = new[r * kh:(r + 1) * kh], (jnp.int32(r * kh), lengths_B[r], zero)
            if layer is not None:
                rows, start = rows[None], (jnp.asarray(layer, jnp.int32),) + start
            buf = jax.lax.dynamic_update_slice(buf, rows, start)
        return buf

    # an int8 cache's scales: [B*K, S], written as the values are (one dynamic_update_slice per row)

    def scale_shape(self, batch, kv_heads, max_len):
        return (batch * kv_heads, max_len)

    def read_scale(self, buf, batch):
        return buf.reshape(batch, -1, buf.shape[-1])

    def write_scale(self, buf, new_BxKxT, lengths_B, layer=None):
        b, kh, _ = new_BxKxT.shape
        new = new_BxKxT.reshape(b * kh, -1).astype(buf.dtype)
        for r in range(b):
            rows, start = new[r * kh:(r + 1) * kh], (jnp.int32(r * kh), lengths_B[r])
            if layer is not None:
                rows, start = rows[None], (jnp.asarray(layer, jnp.int32),) + start
            buf = jax.lax.dynamic_update_slice(buf, rows, start)
        return buf

    # packed prompts (KVCache.write_slots): row r's kv heads are rows r K .. r K + K - 1

    def write_slots(self, buf, new_GxKxWxH, slots_G, layer=None):
        if jnp.issubdtype(buf.dtype, jnp.floating) and buf.dtype.itemsize == 2:
            bits = lambda a: jax.lax.bitcast_convert_type(a.astype(buf.dtype), jnp.uint16)  # noqa: E731
            return jax.lax.bitcast_convert_type(self.write_slots(bits(buf), bits(new_GxKxWxH), slots_G, layer),
                                                buf.dtype)
        return update_blocks(buf, new_GxKxWxH, slots_G * new_GxKxWxH.shape[1], layer)

    def write_slots_scale(self, buf, new_GxKxW, slots_G, layer=None):
        return update_blocks(buf, new_GxKxW, slots_G * new_GxKxW.shape[1], layer)


@functools.lru_cache(maxsize=None)
def make_backend(native_decode: bool, native_attention: bool, fast_bf16: bool = True,
                 native_serving: Optional[bool] = None, float_rows: Optional[int] = None) -> Backend:
    """The CPU backend, with or without each native kernel (one value per choice); `native_serving` decides
    the w8a8 matmul and paged attention apart from the rest (default: as `native_decode` and
    `native_attention`), and `float_rows` the float32 decode matmul's rows (`prepare_decode`)."""
    paged = native_attention if native_serving is None else native_serving
    decode = {"native_decode": native_decode}
    if native_serving is not None and native_serving != native_decode:
        decode["native_w8a8"] = native_serving
    if float_rows is not None and float_rows != (SMALL_ROWS if native_decode else 0):
        decode["float_rows"] = float_rows
    return Backend(
        name="cpu", linear=linear,
        attention_kernels=(("dot_product", partial(dot_product_attention, native_attention=native_attention)),),
        cache_layout=RowsCacheLayout(),
        prepare_decode=partial(prepare_decode, **decode),
        float32_activations=True,  # XLA:CPU has no bf16 arithmetic outside matmuls: converts cost the gain
        fast_bf16=fast_bf16,
        run_once_options=(("xla_backend_optimization_level", 0),),  # halves the init's compile time
        setup=tune_allocator,
        cache_attention=native_cache_attention if native_attention else None,
        paged_attention=native_paged_attention if paged else None)
