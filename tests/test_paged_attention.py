"""Attention over a paged KV cache: `paged.paged_attention` (plain JAX) against a numpy loop, and the
native CPU kernel (paged_attention.cc) against `paged.paged_attention`."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import paged
from jaxgpt.backends import cpu, native


def _needs_native():
    if not native.available():
        pytest.skip(f"the native kernel cannot be built here: {native._state.get('why')}")


def make_step(seed, page, heads=4, kv_heads=2, head_dim=32, lengths=(37, 5, 70, 1), chunk=12, padding=3,
              int8=False):
    """A pool holding rows of `lengths` positions through shuffled block tables (row 1 shares row 0's first
    page, a shared prefix), and a step's tokens: row 0's last `chunk` positions (a prompt chunk), one decode
    token for each other row, `padding` tokens of limit 0, in a shuffled order. -> dict of numpy arrays."""
    rng = np.random.default_rng(seed)
    per_row = [-(-n // page) for n in lengths]
    width = max(per_row) + 1
    num_pages = sum(per_row) + 2
    pages = list(rng.permutation(np.arange(1, num_pages)))
    tables = np.zeros((len(lengths), width), np.int32)
    for r, n in enumerate(per_row):
        for i in range(n):
            tables[r, i] = pages.pop()
    if per_row[1] > 0:
        tables[1, 0] = tables[0, 0]  # shared prefix page
    shape = paged.pool_shape(num_pages, kv_heads, page, head_dim)
    if int8:
        k = rng.integers(-127, 128, shape).astype(np.int8)
        v = rng.integers(-127, 128, shape).astype(np.int8)
        ks, vs = (rng.uniform(0.005, 0.03, shape[:-1]).astype(np.float32) for _ in range(2))
    else:
        k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
        ks = vs = None
    rows = [0] * chunk + list(range(1, len(lengths))) + [0] * padding
    limits = list(range(lengths[0] - chunk + 1, lengths[0] + 1)) + list(lengths[1:]) + [0] * padding
    order = rng.permutation(len(rows))
    rows, limits = np.array(rows, np.int32)[order], np.array(limits, np.int32)[order]
    q = rng.standard_normal((len(rows), heads, head_dim)).astype(np.float32)
    return dict(q=q, k=k, v=v, rows=rows, limits=limits, tables=tables, ks=ks, vs=vs)


def numpy_loop(s):
    """The definition, one query at a time."""
    t, n, h = s["q"].shape
    kh, page = s["k"].shape[1], s["k"].shape[2]
    out = np.zeros((t, n, h), np.float64)
    for i in range(t):
        for head in range(n):
            j = head // (n // kh)
            keys, values = [], []
            for pos in range(s["limits"][i]):
                p, o = s["tables"][s["rows"][i], pos // page], pos % page
                kk, vv = s["k"][p, j, o].astype(np.float64), s["v"][p, j, o].astype(np.float64)
                if s["ks"] is not None:
                    kk, vv = kk * s["ks"][p, j, o], vv * s["vs"][p, j, o]
                keys.append(kk)
                values.append(vv)
            if not keys:
                continue
            scores = np.array(keys) @ s["q"][i, head].astype(np.float64) / math.sqrt(h)
            w = np.exp(scores - scores.max())
            out[i, head] = (w / w.sum()) @ np.array(values)
    return out


def oracle(s, **kw):
    scales = [None if a is None else jnp.asarray(a) for a in (s["ks"], s["vs"])]
    return np.asarray(paged.paged_attention(jnp.asarray(s["q"]), s["k"], s["v"], s["rows"], s["limits"], s["tables"],
                                            *scales, **kw))


def kernel(s):
    return np.asarray(jax.jit(native.paged_attention)(jnp.asarray(s["q"]), s["k"], s["v"], s["rows"], s["limits"],
                                                      s["tables"], s["ks"], s["vs"]))


@pytest.mark.parametrize("page,int8", [(1, False), (16, True), (64, False)])
def test_plain_jax_paged_attention_is_the_definition(page, int8):
    s = make_step(0, page, int8=int8)
    np.testing.assert_allclose(oracle(s, tile_positions=32), numpy_loop(s), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("page", [1, 16, 64, 128])
def test_native_kernel_matches_plain_jax(page, int8):
    _needs_native()
    s = make_step(page + int8, page, lengths=(150, 9, 70, 1, 131) if page > 1 else (37, 5, 70, 1), int8=int8,
                  chunk=40 if page > 1 else 12)
    got, want = kernel(s), oracle(s)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not np.any(got[s["limits"] == 0])  # padding: zeros


@pytest.mark.parametrize("int8", [False, True])
def test_native_kernel_cuts_a_long_prompt_chunk_into_blocks(int8):
    """A chunk of 150 tokens of one row: the kernel's blocks of 64 tokens (a row's tokens past one block,
    a last block of 22 whose tiles end mid-group on the diagonal), each query seeing its own prefix."""
    _needs_native()
    s = make_step(7 + int8, 16, lengths=(190, 9, 70, 1), int8=int8, chunk=150)
    got, want = kernel(s), oracle(s)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not np.any(got[s["limits"] == 0])


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 1, 16), (4, 4, 128), (12, 3, 80)])
def test_native_kernel_head_shapes(heads, kv_heads, head_dim):
    _needs_native()
    for int8 in (False, True):
        s = make_step(heads, 16, heads=heads, kv_heads=kv_heads, head_dim=head_dim, int8=int8)
        np.testing.assert_allclose(kernel(s), oracle(s), atol=1e-5, rtol=1e-5)


_AVX2_SCRIPT = """
import sys, numpy as np, jax, jax.numpy as jnp
from jaxgpt.backends import native
assert native.available(), native._state.get("why")
d, out = np.load(sys.argv[1]), {}
for i in range(int(d["cases"])):
    a = [d[f"{name}{i}"] for name in ("q", "k", "v", "rows", "limits", "tables")]
    scales = [d[f"ks{i}"], d[f"vs{i}"]] if f"ks{i}" in d.files else [None, None]
    out[f"o{i}"] = np.asarray(jax.jit(native.paged_attention)(jnp.asarray(a[0]), *a[1:], *scales))
np.savez(sys.argv[2], **out)
"""


def test_native_kernel_avx2_forms_match_plain_jax(tmp_path):
    """The kernel built for AVX2 without AVX-512 (-march=x86-64-v3: its AVX2 forms of the decode tile, the
    gathered tile, its 8 x 8 transposes and the float32 pools gathered too) against plain JAX, on any x86
    CPU with AVX2 and FMA (another process; on a CPU without AVX-512 the tests above run these forms too):
    prompt chunks cut into blocks, decode tokens, padding, int8 and float32 pools, head sizes 16 to 128."""
    import os
    import platform
    import subprocess
    import sys
    from jaxgpt.backends.cpu import cpu_flags
    _needs_native()
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("needs an x86 CPU with AVX2 and FMA")
    steps = [make_step(7 + int8, 16, lengths=(190, 9, 70, 1), int8=int8, chunk=150) for int8 in (False, True)]
    steps += [make_step(heads + int8, 16, heads=heads, kv_heads=kv_heads, head_dim=head_dim, int8=int8)
              for heads, kv_heads, head_dim in [(6, 1, 16), (4, 4, 128), (12, 3, 80), (12, 12, 64)]
              for int8 in (False, True)]
    arrays = {"cases": np.int64(len(steps))}
    for i, s in enumerate(steps):
        arrays.update({f"{name}{i}": s[name] for name in ("q", "k", "v", "rows", "limits", "tables")})
        if s["ks"] is not None:
            arrays[f"ks{i}"], arrays[f"vs{i}"] = s["ks"], s["vs"]
    np.savez(tmp_path / "in.npz", **arrays)
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXGPT_NATIVE_MARCH="x86-64-v3")
    done = subprocess.run([sys.executable, "-c", _AVX2_SCRIPT, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = np.load(tmp_path / "out.npz")
    for i, s in enumerate(steps):
        np.testing.assert_allclose(got[f"o{i}"], oracle(s), atol=1e-5, rtol=1e-5, err_msg=f"case {i}")
        assert not np.any(got[f"o{i}"][s["limits"] == 0])


def test_cpu_backend_takes_float32_and_int8_pools_and_declines_others():
    _needs_native()
    backend = cpu.make_backend(native_decode=True, native_attention=True)
    assert backend.paged_attention is cpu.native_paged_attention
    assert cpu.make_backend(native_decode=True, native_attention=False).paged_attention is None
    for int8 in (False, True):
        s = make_step(7, 16, int8=int8)
        args = (jnp.asarray(s["q"]), s["k"], s["v"], s["rows"], s["limits"] - 1, s["limits"], s["tables"],
                s["ks"], s["vs"])
        np.testing.assert_allclose(np.asarray(jax.jit(backend.paged_attention)(*args)), oracle(s), atol=1e-5,
                                   rtol=1e-5)
    s = make_step(8, 16)
    bf16 = (jnp.asarray(s["q"]), jnp.asarray(s["k"], jnp.bfloat16), jnp.asarray(s["v"], jnp.bfloat16),
            s["rows"], s["limits"] - 1, s["limits"], s["tables"], None, None)
    assert backend.paged_attention(*bf16) is None
    odd = make_step(9, 16, head_dim=8)
    assert backend.paged_attention(jnp.asarray(odd["q"]), odd["k"], odd["v"], odd["rows"], odd["limits"] - 1,
                                   odd["limits"], odd["tables"], None, None) is None


def test_model_attends_through_the_native_kernel_as_through_plain_jax():
    """`paged.attend` with the CPU backend (its kernel) and without (the plain-JAX form): same output."""
    _needs_native()
    s = make_step(11, 16, int8=True)
    backend = cpu.make_backend(native_decode=True, native_attention=True)
    cache = paged.PagedCache(k=(jnp.asarray(s["k"]),), v=(jnp.asarray(s["v"]),), lengths=jnp.zeros((1,), jnp.int32),
                             k_scale=(jnp.asarray(s["ks"]),), v_scale=(jnp.asarray(s["vs"]),))
    t = len(s["rows"])
    cache = cache.step(jnp.asarray(s["rows"]), jnp.asarray(s["limits"] - 1), jnp.zeros((t,), jnp.int32),
                       jnp.asarray(s["limits"]), jnp.asarray(s["tables"]))
    q = jnp.asarray(s["q"])[None]
    got = jax.jit(lambda q, c: paged.attend(q, c, 0, backend))(q, cache)
    want = jax.jit(lambda q, c: paged.attend(q, c, 0, None))(q, cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_native_kernel_reads_only_visible_positions():
    """NaN everywhere no token of the step may see (page 0, the tails of rows' last pages, unused pages):
    the kernel's output is the clean pool's."""
    _needs_native()
    s = make_step(12, 16, lengths=(40, 9, 23))
    want = oracle(s)
    page = s["k"].shape[2]
    seen = np.zeros(s["k"].shape[0] * page, bool)
    for r in range(s["tables"].shape[0]):
        for pos in range(s["limits"][s["rows"] == r].max(initial=0)):
            seen[s["tables"][r, pos // page] * page + pos % page] = True
    unseen = ~seen.reshape(s["k"].shape[0], 1, page)
    for name in ("k", "v"):
        s[name] = np.where(unseen[..., None], np.nan, s[name]).astype(np.float32)
    got = kernel(s)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype,scan", [("float32", False), ("int8", True)])
def test_model_steps_over_a_paged_cache_alike_with_and_without_the_kernel(kv_dtype, scan, monkeypatch):
    """Two prompts of different lengths and padding in one ragged step, then a decode step, through GPT:
    the CPU backend with its paged kernel gives the logits it gives with the plain-JAX form."""
    _needs_native()
    from jaxgpt import GPT, GPTConfig, init_params
    cfg = GPTConfig(vocab_size=40, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, scan_layers=scan)
    params = init_params(cfg, jax.random.key(0))
    kernel_fn = native.paged_attention
    page, tables = 4, jnp.array([[1, 5, 2, 7, 3], [6, 4, 0, 0, 0]], jnp.int32)
    lengths = (17, 6)
    rows = np.array([0] * lengths[0] + [1] * lengths[1] + [0, 0], np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(2, int)]).astype(np.int32)
    limits = np.where(np.arange(len(rows)) < sum(lengths), positions + 1, 0).astype(np.int32)
    decode = (np.array([0, 1], np.int32), np.array(lengths, np.int32))
    tokens = (jnp.arange(len(rows), dtype=jnp.int32)[None] % 40, jnp.array([[3, 9]], jnp.int32))
    logits, calls = {}, []
    monkeypatch.setattr(native, "paged_attention", lambda *a: calls.append(1) or kernel_fn(*a))
    for native_attention in (True, False):
        model = GPT(cfg, cpu.make_backend(native_decode=False, native_attention=native_attention))
        run = jax.jit(lambda c, x: model.apply({"params": params}, x, c))
        cache = paged.PagedCache.create_pool(cfg, 8, page, dtype=kv_dtype)
        out = []
        for x, (r, p) in zip(tokens, ((rows, positions), decode)):
            lim = limits if len(r) == len(rows) else p + 1
            slots = np.asarray(tables)[r, p // page] * page + p % page
            slots = np.where(lim > 0, slots, 0)  # padding writes to page 0
            step = cache.step(jnp.asarray(r), jnp.asarray(p), jnp.asarray(slots), jnp.asarray(lim), tables)
            y, cache = run(step, x)
            out.append(np.asarray(y))
            cache = cache.pool()
        logits[native_attention] = out
    assert calls  # (the kernel ran, traced once per layer and step, with native_attention only)
    for got, want, real in zip(logits[True], logits[False], (sum(lengths), 2)):  # (padding's logits: anything)
        np.testing.assert_allclose(got[0, :real], want[0, :real], atol=2e-5, rtol=1e-5)
