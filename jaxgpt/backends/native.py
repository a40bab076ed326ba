"""Native CPU kernels, XLA FFI calls compiled from C++ on first use: the decode step's matmul at 1..16 rows
(rows.cc, over weights packed in panels of 16 outputs by `pack`, float32 or int8 with scales, or int8 by
int8 rows for w8a8), causal self-attention for training, forward and backward (attention.cc), and a decode
step's attention over the KV cache, reading only each row's filled positions (cached_attention.cc), and a
ragged step's attention over a paged cache, reading only each token's visible positions (paged_attention.cc).

The sources are compiled with the machine's C++ compiler (`$CXX`, else `c++`, `-march=native`, or
`-march=$JAXGPT_NATIVE_MARCH`: tests build x86-64-v3, AVX2 without AVX-512, to check its kernels) against the
installed jaxlib's FFI headers into `kernels/` of `$JAXGPT_CACHE` (default `~/.cache/jaxgpt`), once per
source, jaxlib and CPU (about 10 s). The library's size and SHA-256 are recorded beside it (`.so.json`) and
checked before every load: one that does not match (cut short by a full disk or an interrupted copy, which
would crash the process with SIGBUS when loaded) is built again, with one warning line. With no compiler or
any failure (logged once) `available()` is False and the CPU backend runs XLA's forms instead: same results
to float rounding. Measurements: bench/README.md.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.report import warn

log = logging.getLogger(__name__)

TARGET = "jaxgpt_rows_matmul"
INT8_TARGET = "jaxgpt_rows_matmul_int8"
W8A8_TARGET = "jaxgpt_rows_matmul_w8a8"
PACK_TARGET = "jaxgpt_pack"
MAX_ROWS = 16
MAX_FLOAT_ROWS = 64  # rows_matmul's (float32 panels); MAX_ROWS is the int8 kernel's
INT8_PANEL = 64  # outputs per int8 panel: one cache line per input
W8A8_PANEL = 32  # outputs per w8a8 panel: 4 inputs of each, 128 bytes
ATTENTION_TARGET = "jaxgpt_causal_attention"
ATTENTION_BWD_TARGET = "jaxgpt_causal_attention_bwd"
ATTENTION_BWD_FUSED_TARGET = "jaxgpt_causal_attention_bwd_fused"
CACHED_ATTENTION_TARGET = "jaxgpt_cached_attention"
CACHED_ATTENTION_INT8_TARGET = "jaxgpt_cached_attention_int8"
PAGED_ATTENTION_TARGET = "jaxgpt_paged_attention"
PAGED_ATTENTION_INT8_TARGET = "jaxgpt_paged_attention_int8"
MAX_CACHED_QUERIES = 16  # queries per row that cached_attention takes (decode steps; longer chunks use XLA)
_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = tuple(os.path.join(_HERE, f) for f in ("rows.cc", "attention.cc", "cached_attention.cc",
                                                         "paged_attention.cc"))
HEADERS = (os.path.join(_HERE, "common.h"),)

_lock = threading.Lock()
_state: dict = {}  # "ok": bool once tried; "lib": the loaded library (kept alive); "why": reason if not ok


def _cpu_signature() -> str:
    """The CPU model and flags (the library is built for this CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor()


def _cache_dir() -> str:
    root = os.environ.get("JAXGPT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxgpt")
    return os.path.join(root, "kernels")


def _record_path(path: str) -> str:
    """Where the size and SHA-256 of the library at `path` are kept (beside it)."""
    return path + ".json"


def _digest(path: str) -> dict:
    """{"size": bytes, "sha256": hex} of the file at `path`."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"size": os.path.getsize(path), "sha256": h.hexdigest()}


def _damage(path: str) -> Optional[str]:
    """None when the library at `path` is the one its record describes, else what is wrong with it.

    Loading a library cut short (a full disk, an interrupted copy) dies of SIGBUS, which no handler can
    catch: so nothing is loaded that is not byte for byte what was built."""
    try:
        with open(_record_path(path)) as f:
            record = json.load(f)
        want = {"size": int(record["size"]), "sha256": str(record["sha256"])}
    except (OSError, ValueError, KeyError, TypeError):
        return "it has no readable record of its size and SHA-256"
    got = _digest(path)
    if got["size"] != want["size"]:
        return f"it is {got['size']} bytes, {want['size']} were built: cut short"
    if got["sha256"] != want["sha256"]:
        return "its SHA-256 is not the one recorded when it was built"
    return None


def _build() -> str:
    """Path of the compiled library, compiling it if this source/jaxlib/CPU has none yet, or if the one
    there is not what was built (then with one warning line)."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} not found)")
    sources = []
    for name in SOURCES + HEADERS:
        with open(name, "rb") as f:
            sources.append(f.read())
    import jaxlib
    # (b"recorded": libraries named so have a size + SHA-256 record beside them; older ones are not used)
    march = os.environ.get("JAXGPT_NATIVE_MARCH") or "native"
    key = hashlib.sha256(b"\0".join(sources + [jaxlib.__version__.encode(), compiler.encode(),
                                                _cpu_signature().encode(), b"recorded"]
                                     + ([] if march == "native" else [march.encode()]))).hexdigest()[:16]
    out_dir = _cache_dir()
    path = os.path.join(out_dir, f"jaxgpt-{key}.so")
    if os.path.exists(path):
        why = _damage(path)
        if why is None:
            return path
        warn(f"the native kernel library {path} is not the one built ({why}); building it again")
    os.makedirs(out_dir, exist_ok=True)
    # built aside, recorded, then renamed: a reader never sees a part-written library, and concurrent
    # builds are safe (each renames a whole file; the record is renamed into place after it)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    record_tmp = tmp + ".json"
    # -ffp-contract=fast: multiply-adds fused (ISO C++ modes leave them unfused)
    cmd = [compiler, "-O3", f"-march={march}", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-w",
           f"-I{jax.ffi.include_dir()}", *SOURCES, "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        with open(record_tmp, "w") as f:
            json.dump(_digest(tmp), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        os.replace(record_tmp, _record_path(path))
    finally:
        for leftover in (tmp, record_tmp):
            if os.path.exists(leftover):
                os.remove(leftover)
    return path


def available() -> bool:
    """Whether the native kernel is built and registered with XLA in this process (built on first call)."""
    with _lock:
        if "ok" not in _state:
            try:
                lib = ctypes.cdll.LoadLibrary(_build())
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxgptRowsMatmul), platform="cpu")
                jax.ffi.register_ffi_target(INT8_TARGET, jax.ffi.pycapsule(lib.JaxgptRowsMatmulInt8), platform="cpu")
                jax.ffi.register_ffi_target(W8A8_TARGET, jax.ffi.pycapsule(lib.JaxgptRowsMatmulW8A8), platform="cpu")
                jax.ffi.register_ffi_target(PACK_TARGET, jax.ffi.pycapsule(lib.JaxgptPack), platform="cpu")
                jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.JaxgptCausalAttention),
                                            platform="cpu")
                jax.ffi.register_ffi_target(ATTENTION_BWD_TARGET,
                                            jax.ffi.pycapsule(lib.JaxgptCausalAttentionBackward), platform="cpu")
                jax.ffi.register_ffi_target(ATTENTION_BWD_FUSED_TARGET,
                                            jax.ffi.pycapsule(lib.JaxgptCausalAttentionBackwardFused), platform="cpu")
                jax.ffi.register_ffi_target(CACHED_ATTENTION_TARGET, jax.ffi.pycapsule(lib.JaxgptCachedAttention),
                                            platform="cpu")
                jax.ffi.register_ffi_target(CACHED_ATTENTION_INT8_TARGET,
                                            jax.ffi.pycapsule(lib.JaxgptCachedAttentionInt8), platform="cpu")
                jax.ffi.register_ffi_target(PAGED_ATTENTION_TARGET, jax.ffi.pycapsule(lib.JaxgptPagedAttention),
                                            platform="cpu")
                jax.ffi.register_ffi_target(PAGED_ATTENTION_INT8_TARGET,
                                            jax.ffi.pycapsule(lib.JaxgptPagedAttentionInt8), platform="cpu")
                _state.update(ok=True, lib=lib)
            except Exception as e:  # no compiler, no headers, a failed build: decode through XLA instead
                _state.update(ok=False, why=str(e))
                log.warning("jaxgpt: the native CPU kernels are unavailable, decoding and attending through XLA (%s)", e)
        return _state["ok"]


def w8a8_tiles() -> bool:
    """Whether `rows_matmul_w8a8` multiplies blocks of 16 or more rows on AMX tiles here (a CPU with AMX-INT8,
    a kernel that lets the process use them, and no JAXGPT_AMX=0 in the environment when the library was
    first called); the vpdpbusd kernel gives the same bits otherwise."""
    return available() and bool(_state["lib"].jaxgpt_w8a8_tiles())


def pack(w: jax.Array, w_out_in: bool = False) -> jax.Array:
    """A kernel [..., in, out] (or [..., out, in] with `w_out_in`) -> panels [..., ceil(out/16), in, 16],
    float32, zero past `out`: panel p holds outputs 16p..16p+15 for every input, in input order.

    With the native kernel built, a native copy at memory speed (XLA's transposes for it ran at a few GB/s);
    else (and as the reference in tests) `pack_reference`."""
    if not available():
        return pack_reference(w, w_out_in)
    *_, a, b = w.shape
    n_in, out = (b, a) if w_out_in else (a, b)
    call = jax.ffi.ffi_call(PACK_TARGET, jax.ShapeDtypeStruct(panels_shape(n_in, out), jnp.float32),
                            vmap_method="sequential")  # stacked [L, ...] kernels: one call per layer
    fn = lambda m: call(m, out_in=np.int32(w_out_in))  # noqa: E731
    for _ in range(w.ndim - 2):
        fn = jax.vmap(fn)
    return fn(w.astype(jnp.float32))


def pack_reference(w: jax.Array, w_out_in: bool = False) -> jax.Array:
    """`pack` in jax.numpy."""
    if not w_out_in:
        w = jnp.swapaxes(w, -1, -2)  # [..., out, in]
    *lead, out, n_in = w.shape
    pad = -out % 16
    w = jnp.pad(w.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, pad), (0, 0)])
    return jnp.swapaxes(w.reshape(*lead, (out + pad) // 16, 16, n_in), -1, -2)


def panels_shape(n_in: int, out: int) -> tuple[int, int, int]:
    """The shape `pack` gives a kernel with `n_in` inputs and `out` outputs."""
    return (-(-out // 16), n_in, 16)


def rows_matmul(x: jax.Array, panels: jax.Array, out: int) -> jax.Array:
    """x float32 [R, in] (1 <= R <= MAX_FLOAT_ROWS) times the kernel packed in `panels` -> float32 [R, out]."""
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_FLOAT_ROWS or panels.shape != panels_shape(x.shape[1], out):
        raise ValueError(f"rows_matmul: x [R <= {MAX_FLOAT_ROWS}, in] and panels {panels_shape(x.shape[-1], out)}, "
                         f"got x{x.shape} and panels{panels.shape}")
    # (vmap: one call per element, e.g. when flax checks a stacked layer's shapes through a vmapped init)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], out), jnp.float32), vmap_method="sequential")
    return call(x.astype(jnp.float32), panels.astype(jnp.float32))


def pack_int8(q: jax.Array, scale: jax.Array, w_out_in: bool = False) -> tuple[jax.Array, jax.Array]:
    """An int8 kernel q [..., in, out] (or [..., out, in] with `w_out_in`) and its scale [..., out] ->
    (int8 panels [..., ceil(out/64), in, 64], panel p holding outputs 64p..64p+63 for every input in input
    order; float32 scale [..., 64 ceil(out/64)]), zero past `out`. In jax.numpy (made once per decoder)."""
    if not w_out_in:
        q = jnp.swapaxes(q, -1, -2)  # [..., out, in]
    *lead, out, n_in = q.shape
    pad = -out % INT8_PANEL
    q = jnp.pad(q.astype(jnp.int8), [(0, 0)] * len(lead) + [(0, pad), (0, 0)])
    panels = jnp.swapaxes(q.reshape(*lead, (out + pad) // INT8_PANEL, INT8_PANEL, n_in), -1, -2)
    scale = jnp.pad(scale.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, pad)])
    return panels, scale


def int8_panels_shape(n_in: int, out: int) -> tuple[int, int, int]:
    """The shape `pack_int8` gives a kernel with `n_in` inputs and `out` outputs."""
    return (-(-out // INT8_PANEL), n_in, INT8_PANEL)


def rows_matmul_int8(x: jax.Array, panels: jax.Array, scale: jax.Array, out: int) -> jax.Array:
    """x float32 [R, in] (1 <= R <= 16) times the int8 kernel in `panels` with its per-output `scale`
    (`pack_int8`'s) -> float32 [R, out]: (x @ q) * scale, the weights widened to float32 in registers."""
    shape = int8_panels_shape(x.shape[-1], out)
    if (x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS or panels.shape != shape or panels.dtype != jnp.int8
            or scale.shape != (shape[0] * INT8_PANEL,)):
        raise ValueError(f"rows_matmul_int8: x [R <= {MAX_ROWS}, in], int8 panels {shape} and scale "
                         f"({shape[0] * INT8_PANEL},), got x{x.shape}, panels{panels.shape} {panels.dtype}, scale{scale.shape}")
    _require()
    call = jax.ffi.ffi_call(INT8_TARGET, jax.ShapeDtypeStruct((x.shape[0], out), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), panels, scale.astype(jnp.float32))


def pack_w8a8(q: jax.Array, scale: jax.Array, w_out_in: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """An int8 kernel q [..., in, out] (or [..., out, in] with `w_out_in`) and its scale [..., out] -> the
    W8A8 kernel's operands: int8 panels [..., ceil(out/32), ceil(in/4), 128], panel p's group g holding
    inputs 4g..4g+3 of outputs 32p..32p+31 as [32 outputs][4 inputs]; float32 scale and int32 corr
    (128 * the sum of each output's int8 weights) [..., 32 ceil(out/32)]; zero past `out` and `in`. In
    jax.numpy (made once per decoder)."""
    if not w_out_in:
        q = jnp.swapaxes(q, -1, -2)  # [..., out, in]
    *lead, out, n_in = q.shape
    pad_out, pad_in = -out % W8A8_PANEL, -n_in % 4
    no_pad = [(0, 0)] * len(lead)
    q = jnp.pad(q.astype(jnp.int8), no_pad + [(0, pad_out), (0, pad_in)])
    groups = (n_in + pad_in) // 4
    panels = q.reshape(*lead, (out + pad_out) // W8A8_PANEL, W8A8_PANEL, groups, 4)
    panels = jnp.swapaxes(panels, -2, -3).reshape(*lead, (out + pad_out) // W8A8_PANEL, groups, 4 * W8A8_PANEL)
    corr = 128 * jnp.sum(q.astype(jnp.int32), axis=-1)
    return panels, jnp.pad(scale.astype(jnp.float32), no_pad + [(0, pad_out)]), corr


def w8a8_panels_shape(n_in: int, out: int) -> tuple[int, int, int]:
    """The shape `pack_w8a8` gives a kernel with `n_in` inputs and `out` outputs."""
    return (-(-out // W8A8_PANEL), -(-n_in // 4), 4 * W8A8_PANEL)


def rows_matmul_w8a8(x: jax.Array, panels: jax.Array, scale: jax.Array, corr: jax.Array, out: int) -> jax.Array:
    """x float32 [R, in] (any R >= 1: a decode step's rows or a prompt's) with each row rounded to int8
    (quantize.quantize_rows's scale and rounding, in the kernel) times the int8 kernel in `panels`
    (`pack_w8a8`'s, with its `scale` and `corr`) -> float32 [R, out]: (x_q @ q) * x_scale * scale, the
    products summed in int32."""
    shape = w8a8_panels_shape(x.shape[-1], out)
    n = shape[0] * W8A8_PANEL
    if (x.ndim != 2 or x.shape[0] < 1 or panels.shape != shape or panels.dtype != jnp.int8
            or scale.shape != (n,) or corr.shape != (n,)):
        raise ValueError(f"rows_matmul_w8a8: x [R, in], int8 panels {shape}, scale and corr ({n},), "
                         f"got x{x.shape}, panels{panels.shape} {panels.dtype}, scale{scale.shape}, corr{corr.shape}")
    _require()
    call = jax.ffi.ffi_call(W8A8_TARGET, jax.ShapeDtypeStruct((x.shape[0], out), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), panels, scale.astype(jnp.float32), corr.astype(jnp.int32))


def attention_supported(q_shape, k_shape) -> bool:
    """Whether `causal_attention` takes q [B, T, N, H] and k [B, T, K, H]: head sizes 16..128 in steps of
    16 (attention.cc compiles those), N a multiple of K, the kernels built."""
    h = q_shape[-1]
    return (len(q_shape) == len(k_shape) == 4 and h % 16 == 0 and 16 <= h <= 128 and k_shape[-1] == h
            and q_shape[2] % k_shape[2] == 0 and available())


def cached_attention_supported(q_shape, k_shape, dtype) -> bool:
    """Whether `cached_attention` (a float32 cache) or `cached_attention_int8` (an int8 one) takes q
    [B, T, N, H] over a cache k [B, K, S, H] of `dtype`: T up to MAX_CACHED_QUERIES, head sizes 16..128 in
    steps of 16, N a multiple of K, the kernels built."""
    h = q_shape[-1]
    return (len(q_shape) == len(k_shape) == 4 and q_shape[1] <= MAX_CACHED_QUERIES and h % 16 == 0
            and 16 <= h <= 128 and k_shape[-1] == h and q_shape[2] % k_shape[1] == 0
            and jnp.dtype(dtype) in (jnp.float32, jnp.int8) and available())


def cached_attention(q_BxTxNxH, k, v, q_positions_BxT, kv_lengths_B, kv_heads=None) -> jax.Array:
    """Attention of q [B, T, N, H] over a cache's keys and values (float32): [B, K, S, H], or as the CPU
    backend stores them, [R K, S, H] with `kv_heads` K and R >= B rows (rows past B unread). Query (b, t)
    sees positions s <= q_positions[b, t] and s < kv_lengths[b], scores scaled by 1/sqrt(H)
    (cached_attention.cc); only those positions are read. Check `cached_attention_supported` first."""
    return _cached(CACHED_ATTENTION_TARGET, q_BxTxNxH, (k, v), (), q_positions_BxT, kv_lengths_B, kv_heads)


def cached_attention_int8(q_BxTxNxH, k, v, k_scale, v_scale, q_positions_BxT, kv_lengths_B,
                          kv_heads=None) -> jax.Array:
    """`cached_attention` over an int8 cache (keys and values int8, [B, K, S, H] or [R K, S, H]; each
    position's value int8 * scale, scales [B, K, S] or [R K, S]): the int8 bytes are read and widened in
    registers."""
    return _cached(CACHED_ATTENTION_INT8_TARGET, q_BxTxNxH, (k, v), (k_scale, v_scale), q_positions_BxT,
                   kv_lengths_B, kv_heads)


def _cached(target: str, q_BxTxNxH, kv: tuple, scales: tuple, q_positions_BxT, kv_lengths_B, kv_heads) -> jax.Array:
    """The FFI call of either cached-attention kernel, keys and values (and scales) as [R K, S, ...]."""
    _require()
    b, t, n, h = q_BxTxNxH.shape
    if kv[0].ndim == 4:
        kv_heads = kv[0].shape[1]
    s = kv[0].shape[-2]
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((b, t, n * h), jnp.float32), vmap_method="sequential")
    out = call(q_BxTxNxH.reshape(b, t, n * h).astype(jnp.float32), *(a.reshape(-1, s, h) for a in kv),
               *(a.reshape(-1, s).astype(jnp.float32) for a in scales),
               jnp.broadcast_to(q_positions_BxT, (b, t)).astype(jnp.int32), kv_lengths_B.astype(jnp.int32),
               heads=np.int64(n), kv_heads=np.int64(kv_heads))
    return out.reshape(b, t, n, h)


def paged_attention_supported(q_shape, k_pool_shape, dtype) -> bool:
    """Whether `paged_attention` takes q [T, N, H] over pools [P, K, page, H] of `dtype`: float32, or int8
    with scales; head sizes 16..128 in steps of 16, N a multiple of K, the kernels built."""
    if len(q_shape) != 3 or len(k_pool_shape) != 4:
        return False
    h, kh = q_shape[-1], k_pool_shape[1]
    return (h % 16 == 0 and 16 <= h <= 128 and k_pool_shape[-1] == h and kh >= 1 and q_shape[1] % kh == 0
            and jnp.dtype(dtype) in (jnp.float32, jnp.int8) and available())


def paged_attention(q_TxNxH, k_pool, v_pool, token_rows, limits, block_tables, k_scale=None,
                    v_scale=None) -> jax.Array:
    """Attention of a ragged step's queries q [T, N, H] over a paged cache's layer (paged_attention.cc):
    pools [P, K, page, H], float32, or int8 with float32 scales [P, K, page]; query t sees row
    token_rows[t]'s positions below limits[t], read through block_tables [R, M]; scores scaled by
    1/sqrt(H); zeros for a query that sees nothing. -> [T, N, H] float32, as `jaxgpt.paged.paged_attention`
    (its oracle) to float rounding. Check `paged_attention_supported` first."""
    _require()
    t, n, h = q_TxNxH.shape
    quantized = k_scale is not None
    target = PAGED_ATTENTION_INT8_TARGET if quantized else PAGED_ATTENTION_TARGET
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((t, n * h), jnp.float32), vmap_method="sequential")
    if quantized:
        pools = (k_pool, v_pool, k_scale.astype(jnp.float32), v_scale.astype(jnp.float32))
    else:
        pools = (k_pool.astype(jnp.float32), v_pool.astype(jnp.float32))
    out = call(q_TxNxH.reshape(t, n * h).astype(jnp.float32), *pools, jnp.asarray(token_rows, jnp.int32),
               jnp.asarray(limits, jnp.int32), jnp.asarray(block_tables, jnp.int32))
    return out.reshape(t, n, h)


def _require() -> None:
    if not available():
        raise RuntimeError(f"jaxgpt's native CPU kernels are unavailable: {_state.get('why', 'not built')}")


def _attrs(heads, kv_heads, head_dim, fused=False):
    """attention.cc's attributes: where q, k and v start in their [B, T, C] arrays (one fused array, or
    three of their own)."""
    q_off, k_off, v_off = (0, heads * head_dim, (heads + kv_heads) * head_dim) if fused else (0, 0, 0)
    return dict(heads=np.int64(heads), kv_heads=np.int64(kv_heads), head_dim=np.int64(head_dim),
                q_off=np.int64(q_off), k_off=np.int64(k_off), v_off=np.int64(v_off))


def _forward(q3, k3, v3, attrs):
    """o [B, T, N H] and lse [B, N, T] of q, k, v given as [B, T, C] arrays (float32)."""
    _require()
    b, t, _ = q3.shape
    n, h = int(attrs["heads"]), int(attrs["head_dim"])
    call = jax.ffi.ffi_call(ATTENTION_TARGET, (jax.ShapeDtypeStruct((b, t, n * h), jnp.float32),
                                               jax.ShapeDtypeStruct((b, n, t), jnp.float32)),
                            vmap_method="sequential")
    return call(q3, k3, v3, **attrs)


@jax.custom_vjp
def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal self-attention of q [B,T,N,H] over k, v [B,T,K,H] (positions 0..T-1, scores scaled by
    1/sqrt(H)) in attention.cc, float32 inside; the backward is attention.cc's too. Check
    `attention_supported` first."""
    return _causal_attention_fwd(q, k, v)[0]


def _separate(q, k, v):
    """q [B,T,N,H], k, v [B,T,K,H] as [B, T, C] float32 arrays, and attention.cc's attributes."""
    b, t, n, h = q.shape
    flat = [a.reshape(b, t, -1).astype(jnp.float32) for a in (q, k, v)]
    return flat, _attrs(n, k.shape[2], h)


def _causal_attention_fwd(q, k, v):
    (q3, k3, v3), attrs = _separate(q, k, v)
    out, lse = _forward(q3, k3, v3, attrs)
    return out.reshape(q.shape).astype(q.dtype), (q, k, v, out, lse)


def _causal_attention_bwd(res, g):
    q, k, v, out, lse = res
    _require()
    (q3, k3, v3), attrs = _separate(q, k, v)
    f32 = lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32)  # noqa: E731
    call = jax.ffi.ffi_call(ATTENTION_BWD_TARGET, (f32(q3), f32(k3), f32(v3)), vmap_method="sequential")
    dq, dk, dv = call(q3, k3, v3, out, lse, g.reshape(out.shape).astype(jnp.float32), **attrs)
    return dq.reshape(q.shape).astype(q.dtype), dk.reshape(k.shape).astype(k.dtype), dv.reshape(v.shape).astype(v.dtype)


causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def causal_attention_qkv(qkv: jax.Array, heads: int, kv_heads: int) -> jax.Array:
    """`causal_attention` of a fused projection qkv [B, T, (N + 2K) H] (q, then k, then v) -> [B, T, N H],
    read in place; its gradient comes back as one array like qkv (no split or concatenation copied)."""
    return _qkv_fwd(qkv, heads, kv_heads)[0]


def _qkv_attrs(qkv, heads, kv_heads):
    return _attrs(heads, kv_heads, qkv.shape[-1] // (heads + 2 * kv_heads), fused=True)


def _qkv_fwd(qkv, heads, kv_heads):
    x = qkv.astype(jnp.float32)
    out, lse = _forward(x, x, x, _qkv_attrs(qkv, heads, kv_heads))
    return out.astype(qkv.dtype), (qkv, out, lse)


def _qkv_bwd(heads, kv_heads, res, g):
    qkv, out, lse = res
    _require()
    x = qkv.astype(jnp.float32)
    call = jax.ffi.ffi_call(ATTENTION_BWD_FUSED_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32),
                            vmap_method="sequential")
    dqkv = call(x, x, x, out, lse, g.astype(jnp.float32), **_qkv_attrs(qkv, heads, kv_heads))
    return (dqkv.astype(qkv.dtype),)


causal_attention_qkv.defvjp(_qkv_fwd, _qkv_bwd)
