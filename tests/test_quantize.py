"""int8 weights for decoding: the quantized matmul's error bound, the native int8 kernel against the
float one, and decoding (Decoder, Engine) equal to the full forward of the dequantized model; w8a8 (int8
rows too): its products against exact integers, and its decoding the same on every backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpt
from jaxgpt import quantize as Q
from jaxgpt.backends import native
from jaxgpt.engine import Engine
from jaxgpt.ops import linear
from tests.helpers import run_for_marches

CFG = jaxgpt.GPTConfig(vocab_size=97, block_size=64, n_layer=2, n_head=4, n_embd=32)


@pytest.fixture(scope="module")
def params():
    return jaxgpt.init_params(CFG, jax.random.key(0))


def test_quantize_int8_rounds_each_weight_within_half_a_step_and_the_matmul_within_its_bound():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 40)).astype(np.float32) * rng.uniform(0.01, 3, (1, 40)).astype(np.float32)
    w[:, 7] = 0.0  # an all-zero output channel
    k = Q.quantize_int8(jnp.asarray(w))
    assert k.q.dtype == jnp.int8 and k.q.shape == w.shape and k.scale.shape == (40,)
    assert int(jnp.max(jnp.abs(k.q.astype(jnp.int32)))) == 127
    dq = np.asarray(k.dequantize())
    step = np.asarray(k.scale)[None, :]
    assert np.all(np.abs(dq - w) <= step / 2 * (1 + 1e-6))
    assert np.all(dq[:, 7] == 0)
    # each output of x @ w moves by at most sum_i |x_i| * step / 2
    x = rng.standard_normal((5, 64)).astype(np.float32)
    y, yq = x @ w, np.asarray(linear(jnp.asarray(x), k))
    bound = np.abs(x).sum(1, keepdims=True) * step / 2
    assert np.all(np.abs(yq - y) <= bound * (1 + 1e-5) + 1e-5)
    # the head's form: [out, in] with a scale per row
    kt = Q.quantize_int8(jnp.asarray(w.T), w_out_in=True)
    np.testing.assert_array_equal(np.asarray(kt.q), np.asarray(k.q).T)
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), kt, w_out_in=True)), yq, rtol=1e-5, atol=1e-5)


def test_dequantized_params_quantize_again_to_the_same_int8_values(params):
    dq = Q.dequantized(params, CFG)
    flat, flat_dq = (jax.tree_util.tree_flatten_with_path(p)[0] for p in (params, dq))
    paths = Q.quantized_paths(params, CFG)
    assert ("wte", "embedding") in paths and any(p[0] == "h_0" for p in paths)
    for path, w_out_in in paths.items():
        leaf = params
        leaf_dq = dq
        for key in path:
            leaf, leaf_dq = leaf[key], leaf_dq[key]
        a, b = Q.quantize_int8(leaf, w_out_in), Q.quantize_int8(leaf_dq, w_out_in)
        np.testing.assert_array_equal(np.asarray(a.q), np.asarray(b.q))
        np.testing.assert_allclose(np.asarray(a.scale), np.asarray(b.scale), rtol=1e-6)
    # layer norms, biases and positions are kept as they were
    np.testing.assert_array_equal(np.asarray(dq["wpe"]["embedding"]), np.asarray(params["wpe"]["embedding"]))
    bytes_ = Q.int8_bytes(params, CFG)
    assert bytes_["int8"] < 0.3 * bytes_["float"]
    assert len(flat) == len(flat_dq)


@pytest.mark.skipif(not native.available(), reason="the native CPU kernels are not built here")
@pytest.mark.parametrize("rows,n_in,out", [(1, 64, 40), (3, 48, 16), (6, 40, 200), (8, 96, 130), (14, 24, 70), (16, 32, 7)])
def test_native_int8_kernel_equals_the_float_product_of_its_dequantized_weights(rows, n_in, out):
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((n_in, out)).astype(np.float32)
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    k = Q.quantize_int8(jnp.asarray(w))
    panels, scale = native.pack_int8(k.q, k.scale)
    assert panels.dtype == jnp.int8 and panels.shape == native.int8_panels_shape(n_in, out)
    y = np.asarray(jax.jit(lambda a, p, s: native.rows_matmul_int8(a, p, s, out))(jnp.asarray(x), panels, scale))
    ref = x.astype(np.float64) @ np.asarray(k.dequantize()).astype(np.float64)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # the same kernel in the [out, in] form a tied head uses
    kt = Q.quantize_int8(jnp.asarray(w.T), w_out_in=True)
    pt, st = native.pack_int8(kt.q, kt.scale, w_out_in=True)
    np.testing.assert_array_equal(np.asarray(pt), np.asarray(panels))
    np.testing.assert_array_equal(np.asarray(st), np.asarray(scale))
    with pytest.raises(ValueError, match="int8 panels"):
        native.rows_matmul_int8(jnp.asarray(x), panels.astype(jnp.float32), scale, out)


@pytest.mark.parametrize("kernels", ["cpu", "portable"])
@pytest.mark.parametrize("tie", [True, False])
def test_int8_decoding_equals_generate_on_the_dequantized_model(kernels, tie):
    cfg = CFG.replace(kernels=kernels, tie_embeddings=tie)
    p = jaxgpt.init_params(cfg, jax.random.key(1))
    dq = Q.dequantized(p, cfg)
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 7))
    dec = jaxgpt.Decoder(p, cfg, quantize="int8")
    for b, s in ((1, dict(temperature=0.0)), (3, dict(temperature=0.9, top_k=20))):
        got = dec.generate(prompts[:b], 16, jax.random.key(2), **s)
        want = jaxgpt.generate(dq, cfg, prompts[:b], 16, jax.random.key(2), **s)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    # the decode steps multiply int8 kernels (not float copies of them), except on the cpu backend without
    # its native kernels (a CPU without AVX-512), where XLA:CPU's int8 forms are slower than float32
    leaves = jax.tree.leaves(dec.weights(3).prepared)
    native_int8 = kernels == "portable" or dec.backend.prepare_decode.keywords["native_decode"] and native.available()
    assert any(leaf.dtype == jnp.int8 for leaf in leaves) == native_int8


def test_int8_engine_logprobs_equal_the_dequantized_full_forward(params):
    dq = Q.dequantized(params, CFG)
    eng = Engine(params, CFG, slots=4, max_len=64, prefill_chunk=16, quantize="int8")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (5, 21, 9)]
    outs = eng.run([dict(prompt=pr, max_tokens=12, temperature=0.8, seed=i, logprobs=2)
                    for i, pr in enumerate(prompts)])
    for pr, o in zip(prompts, outs):
        logits = jaxgpt.GPT(CFG).apply({"params": dq}, jnp.array([pr + o.token_ids]))[0]
        rows = np.asarray(jax.nn.log_softmax(logits, -1))[len(pr) - 1:len(pr) - 1 + 12]
        np.testing.assert_allclose([t.logprob for t in o.tokens], rows[np.arange(12), o.token_ids], atol=1e-5)


def test_quantize_rows_rounds_each_row_within_half_its_step():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 50)).astype(np.float32) * rng.uniform(0.01, 30, (6, 1)).astype(np.float32)
    x[2] = 0.0  # a row of zeros: scale 1, all zero
    q, s = Q.quantize_rows(jnp.asarray(x))
    q, s = np.asarray(q, np.int32), np.asarray(s)
    assert q.dtype == np.int32 and s.shape == (6, 1) and s[2, 0] == 1.0 and not q[2].any()
    assert all(np.abs(q[i]).max() == 127 for i in (0, 1, 3, 4, 5))
    assert np.all(np.abs(q * s - x) <= s / 2 * (1 + 1e-6))


def _w8a8_reference(x, k: Q.Int8Kernel, w_out_in=False):
    """(x's rows rounded to int8) @ q in exact integers, times both scales, in float64."""
    xq, xs = Q.quantize_rows(jnp.asarray(x))
    q = np.asarray(k.q, np.int64)
    acc = np.asarray(xq, np.int64) @ (q.T if w_out_in else q)
    return acc * np.asarray(xs, np.float64) * np.asarray(k.scale, np.float64)


@pytest.mark.parametrize("rows,n_in,out", [(1, 64, 40), (3, 30, 16), (8, 96, 130), (14, 24, 70), (15, 44, 33),
                                           (16, 32, 7), (41, 100, 70), (130, 520, 33),
                                           # inputs a multiple of 64 and 16+ rows: AMX tiles where there are
                                           (16, 64, 40), (33, 128, 70), (70, 256, 33)])
def test_w8a8_products_equal_the_integer_product_of_the_rounded_rows(rows, n_in, out):
    """Both ways w8a8 is multiplied (the native kernel when built, XLA's int8 dot in ops.int8_linear) give
    (x_q @ q) * x_scale * scale: the same integers, scaled to float rounding."""
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((n_in, out)).astype(np.float32)
    x = (rng.standard_normal((rows, n_in)) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
    k = Q.quantize_int8(jnp.asarray(w), activations="int8")
    ref = _w8a8_reference(x, k)
    tol = dict(rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), k)), ref, **tol)
    kt = Q.quantize_int8(jnp.asarray(w.T), w_out_in=True, activations="int8")
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), kt, w_out_in=True)), ref, **tol)
    # a row with a NaN (the model marks an overflowing row so) gives NaN, one with an infinity no finite
    # product; the others are unchanged
    xn = x.copy()
    xn[0, n_in // 2] = np.nan
    xn[1:2, n_in - 1] = np.inf
    for y in (linear(jnp.asarray(xn), k), *([jax.jit(lambda a: native.rows_matmul_w8a8(
            a, *native.pack_w8a8(k.q, k.scale), out))(jnp.asarray(xn))] if native.available() else [])):
        y = np.asarray(y)
        assert np.isnan(y[0]).all() and not np.isfinite(y[1:2]).any()
        np.testing.assert_allclose(y[2:], ref[2:], **tol)
    # and it is not the float product of the weights (the rows are rounded): int8 weights alone differ
    assert not np.allclose(np.asarray(linear(jnp.asarray(x), Q.quantize_int8(jnp.asarray(w)))), ref, **tol)
    if not native.available():
        return
    panels, scale, corr = native.pack_w8a8(k.q, k.scale)
    assert panels.dtype == jnp.int8 and panels.shape == native.w8a8_panels_shape(n_in, out)
    y = jax.jit(lambda a, p, s, c: native.rows_matmul_w8a8(a, p, s, c, out))(jnp.asarray(x), panels, scale, corr)
    np.testing.assert_allclose(np.asarray(y), ref, **tol)
    pt = native.pack_w8a8(kt.q, kt.scale, w_out_in=True)
    for a, b in zip(pt, (panels, scale, corr)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="int8 panels"):
        native.rows_matmul_w8a8(jnp.asarray(x), panels, scale, corr, out + 32)



@pytest.mark.skipif(not native.available(), reason="the native kernels are not built here")
@pytest.mark.parametrize("rows", [3, 32])
def test_native_rounds_rows_as_ieee_division_even_a_hair_from_a_half(rows):
    """The native kernel rounds x * (1 / s) and divides only where that lies near a half: its int8 rows are
    those of x / s (IEEE division, halves to even) on rows made of values within a few ulps of k + 1/2
    steps, where x * (1 / s) alone rounds some the other way. Read through identity weights of scale 1:
    y = x_q * s. (Not against quantize_rows' bits: XLA:CPU divides by a broadcast scale as a product by its
    reciprocal, so there such values round either way.)"""
    rng = np.random.default_rng(rows)
    n = 128
    s = rng.uniform(0.01, 3.0, (rows, 1)).astype(np.float32)
    k = rng.integers(-127, 127, (rows, n)).astype(np.float32) + np.float32(0.5)
    x = (k * s).astype(np.float32)
    for _ in range(int(rng.integers(0, 4))):
        x = np.nextafter(x, np.where(rng.random(x.shape) < 0.5, np.inf, -np.inf)).astype(np.float32)
    x[:, 0] = np.float32(127) * s[:, 0]  # (each row's max: its scale close to s)
    x[0, 1:6] = [0.0, -0.0, 1e-30, -1e-30, 3e-39]
    amax = np.abs(x).max(axis=1, keepdims=True)
    s_ref = np.where(amax == 0, np.float32(1), amax / np.float32(127)).astype(np.float32)
    q_ref = np.clip(np.round(x / s_ref), -127, 127)
    # (the test can fail: the product by the reciprocal alone rounds some of these elsewhere)
    assert (np.round(x * (np.float32(1) / s_ref)) != np.round(x / s_ref)).any()
    panels, scale, corr = native.pack_w8a8(jnp.eye(n, dtype=jnp.int8), jnp.ones(n, jnp.float32))
    y = jax.jit(lambda a, p, sc, c: native.rows_matmul_w8a8(a, p, sc, c, n))(jnp.asarray(x), panels, scale, corr)
    np.testing.assert_array_equal(np.asarray(y), q_ref.astype(np.float32) * s_ref)

_W8A8_SCRIPT = """
import sys, numpy as np, jax, jax.numpy as jnp
from jaxgpt.backends import native
d = np.load(sys.argv[1])
ys = {}
for name in [n for n in d.files if n.startswith("x")]:
    x, i = d[name], name[1:]
    f = jax.jit(lambda a, p, s, c: native.rows_matmul_w8a8(a, p, s, c, int(d["out" + i])))
    ys["y" + i] = np.asarray(f(jnp.asarray(x), jnp.asarray(d["p" + i]), jnp.asarray(d["s" + i]), jnp.asarray(d["c" + i])))
np.savez(sys.argv[2], tiles=native.w8a8_tiles(), **ys)
"""


def test_w8a8_tiles_give_the_vector_kernels_bits(tmp_path):
    """The AMX tile kernel (16+ rows, inputs a multiple of 64, on a CPU with AMX-INT8) and the vpdpbusd one
    (JAXGPT_AMX=0, another process) give the same bits: the same integer sums, scaled alike. On a CPU with
    AMX-INT8 the tiles are in use unless the environment says JAXGPT_AMX=0."""
    if not native.available():
        pytest.skip("the native kernels are unavailable")
    import os
    import subprocess
    import sys
    from jaxgpt.backends.cpu import cpu_flags
    rng = np.random.default_rng(0)
    arrays = {}
    # (past 768 inputs the tiles take them in slabs, partial sums kept between: 3072 and 1600 = 768 + 768 + 64)
    cases = [(16, 64, 40), (17, 128, 33), (32, 768, 100), (45, 192, 64), (300, 64, 7), (70, 3072, 40), (33, 1600, 65)]
    for i, (rows, n_in, out) in enumerate(cases):
        w = rng.standard_normal((n_in, out)).astype(np.float32)
        k = Q.quantize_int8(jnp.asarray(w), activations="int8")
        for name, a in zip("psc", native.pack_w8a8(k.q, k.scale)):
            arrays[f"{name}{i}"] = np.asarray(a)
        arrays[f"x{i}"] = (rng.standard_normal((rows, n_in)) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
        arrays[f"out{i}"] = np.int64(out)
    np.savez(tmp_path / "in.npz", **arrays)
    results = {}
    for amx in ("1", "0"):
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAXGPT_AMX=amx)
        done = subprocess.run([sys.executable, "-c", _W8A8_SCRIPT, str(tmp_path / "in.npz"), str(tmp_path / f"{amx}.npz")],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        results[amx] = np.load(tmp_path / f"{amx}.npz")
    assert not results["0"]["tiles"]
    if "amx_int8" in cpu_flags():  # (Linux lists the flag only where it hands processes the tile state)
        assert results["1"]["tiles"], "AMX-INT8 here, yet the w8a8 kernel does not use the tiles"
    for name in [n for n in results["0"].files if n.startswith("y")]:
        np.testing.assert_array_equal(results["1"][name], results["0"][name])


def test_w8a8_avx2_kernel_gives_this_cpus_bits(tmp_path):
    """The w8a8 kernel built for AVX2 without AVX-512 or VNNI (-march=x86-64-v3: vpmaddubsw of |x| and the
    weights given x's sign, sums without corr) gives the bits of this CPU's own build (VNNI or AMX tiles on
    AVX-512 CPUs), edge rows included: zeros, a NaN, and rows and weights all at -127 (the largest pairs
    vpmaddubsw adds). Runs on any x86 CPU with AVX2 (another process per build)."""
    import platform
    from jaxgpt.backends.cpu import cpu_flags
    if not native.available() or platform.machine() not in ("x86_64", "AMD64") or "avx2" not in cpu_flags():
        pytest.skip("needs the native kernels on an x86 CPU with AVX2")
    rng = np.random.default_rng(1)
    arrays = {}
    cases = [(1, 768, 100), (3, 20, 33), (8, 3072, 64), (15, 1600, 65), (17, 64, 40), (64, 768, 96), (130, 192, 7)]
    for i, (rows, n_in, out) in enumerate(cases):
        w = rng.standard_normal((n_in, out)).astype(np.float32)
        x = (rng.standard_normal((rows, n_in)) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
        if i == 2:  # every product -127 x -127
            w[:], x[:] = -1.0, -3.0
        elif rows > 2:
            x[1], x[2, 5] = 0.0, np.nan
        k = Q.quantize_int8(jnp.asarray(w), activations="int8")
        for name, a in zip("psc", native.pack_w8a8(k.q, k.scale)):
            arrays[f"{name}{i}"] = np.asarray(a)
        arrays[f"x{i}"], arrays[f"out{i}"] = x, np.int64(out)
    results = run_for_marches(_W8A8_SCRIPT, tmp_path, arrays)
    assert np.isnan(results["native"]["y0"]).sum() == 0 and np.isnan(results["native"]["y1"]).any()
    np.testing.assert_allclose(results["native"]["y2"], 3.0 * 3072, rtol=1e-6)  # (-127 x -127: nothing saturates)
    for name in [n for n in results["native"].files if n.startswith("y")]:
        np.testing.assert_array_equal(results["x86-64-v3"][name], results["native"][name])


@pytest.mark.parametrize("tie", [True, False])
def test_w8a8_decoding_is_the_same_on_every_backend_and_near_the_dequantized_model(tie):
    """The cpu backend (its native W8A8 kernel where built) and the portable one (XLA's int8 dot) decode
    the same tokens and logprobs; the logprobs stay near the float model's (the rows' rounding) and are
    not int8-weights' (the rows are rounded)."""
    runs = {}
    for kernels in ("cpu", "portable"):
        cfg = CFG.replace(kernels=kernels, tie_embeddings=tie)
        p = jaxgpt.init_params(cfg, jax.random.key(1))
        prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 7))
        dec = jaxgpt.Decoder(p, cfg, quantize="w8a8")
        # int8 kernels in the decode steps on both; the native kernel's (with its int32 corr) where built
        dtypes = {np.dtype(leaf.dtype) for leaf in jax.tree.leaves(dec.weights(3).prepared)}
        assert np.dtype(np.int8) in dtypes
        keywords = dec.backend.prepare_decode.keywords if kernels == "cpu" else {}
        native_w8a8 = bool(keywords.get("native_w8a8", keywords.get("native_decode"))) and native.available()
        assert (np.dtype(np.int32) in dtypes) == native_w8a8
        toks = [np.asarray(dec.generate(prompts[:b], 16, jax.random.key(2), **s).tokens)
                for b, s in ((1, dict(temperature=0.0)), (3, dict(temperature=0.9, top_k=20)))]
        reqs = [dict(prompt=pr.tolist(), max_tokens=10, temperature=0.0, logprobs=1) for pr in prompts]
        outs = {q: Engine(p, cfg, slots=4, max_len=64, prefill_chunk=16, quantize=q).run(reqs)
                for q in ("w8a8", "int8")}
        runs[kernels] = (toks, outs)
    (toks_c, outs_c), (toks_p, outs_p) = runs["cpu"], runs["portable"]
    for a, b in zip(toks_c, toks_p):
        np.testing.assert_array_equal(a, b)
    lp = {k: np.array([[t.logprob for t in o.tokens] for o in outs["w8a8"]]) for k, (_, outs) in runs.items()}
    np.testing.assert_allclose(lp["cpu"], lp["portable"], atol=1e-4)
    assert [o.token_ids for o in outs_c["w8a8"]] == [o.token_ids for o in outs_p["w8a8"]]
    cfg = CFG.replace(tie_embeddings=tie)
    dq = Q.dequantized(jaxgpt.init_params(cfg, jax.random.key(1)), cfg)
    model = jaxgpt.GPT(cfg)
    diff_int8 = 0.0
    for o, o8, pr in zip(outs_c["w8a8"], outs_c["int8"], prompts):
        logits = model.apply({"params": dq}, jnp.array([pr.tolist() + o.token_ids]))[0]
        rows = np.asarray(jax.nn.log_softmax(logits, -1))[len(pr) - 1:len(pr) - 1 + 10]
        np.testing.assert_allclose([t.logprob for t in o.tokens], rows[np.arange(10), o.token_ids], atol=0.05)
        if o8.token_ids == o.token_ids:
            diff_int8 = max(diff_int8, np.abs(np.subtract([t.logprob for t in o.tokens],
                                                          [t.logprob for t in o8.tokens])).max())
    assert diff_int8 > 1e-6


@pytest.mark.parametrize("kernels", ["cpu", "portable"])
def test_w8a8_prompts_round_their_rows_as_decode_steps_do(kernels):
    """With w8a8 a prompt's matmuls round their rows as a decode step's do, so prefill and decoding are one
    model: the engine's prompt logprobs (in chunks) and token logprobs, and Decoder's greedy tokens, equal
    the full forward of the int8 kernels over the whole sequence, not the dequantized float model's."""
    cfg = CFG.replace(kernels=kernels)
    params = jaxgpt.init_params(cfg, jax.random.key(3))
    prompts = [np.random.default_rng(n).integers(0, cfg.vocab_size, n).tolist() for n in (5, 19)]
    eng = Engine(params, cfg, slots=2, max_len=64, prefill_chunk=8, quantize="w8a8")
    outs = eng.run([dict(prompt=p, max_tokens=8, temperature=0.0, logprobs=0, prompt_logprobs=True) for p in prompts])
    model = jaxgpt.GPT(eng.config, eng.backend)
    float_model = jaxgpt.GPT(cfg)
    worst_float = 0.0
    for p, o in zip(prompts, outs):
        seq = p + o.token_ids
        want = []
        dequantized = {"params": Q.dequantized(params, cfg)}
        for variables, m in ((eng.weights[1].variables(), model), (dequantized, float_model)):
            lsm = np.asarray(jax.nn.log_softmax(m.apply(variables, jnp.array([seq]))[0], -1))
            want.append(lsm[np.arange(len(seq) - 1), seq[1:]])
        got = np.array(o.prompt_logprobs[1:] + [t.logprob for t in o.tokens], np.float64)
        np.testing.assert_allclose(got, want[0], atol=2e-5)
        worst_float = max(worst_float, float(np.abs(got - want[1]).max()))
        # Decoder's prefill (the whole prompt at once) rounds the same way: the same greedy tokens
        dec = jaxgpt.Decoder(params, cfg, quantize="w8a8")
        toks = np.asarray(dec.generate(np.array([p]), 8, jax.random.key(0), temperature=0.0).tokens)[0, len(p):]
        assert toks.tolist() == o.token_ids
    assert worst_float > 1e-4  # (the rounding is there: not the float model)


def test_quantize_refuses_an_unknown_format(params):
    with pytest.raises(ValueError, match="quantize must be one of"):
        jaxgpt.Decoder(params, CFG, quantize="int4")
    with pytest.raises(ValueError, match="quantize must be one of"):
        Engine(params, CFG, slots=2, max_len=16, quantize="fp8")


def test_an_int8_kv_cache_through_the_decoder_and_the_engine(params):
    prompts = [list(np.random.default_rng(4).integers(0, CFG.vocab_size, n)) for n in (6, 11)]
    dec = jaxgpt.Decoder(params, CFG, kv_dtype="int8")
    eng = Engine(params, CFG, slots=2, max_len=64, prefill_chunk=8, kv_dtype="int8")
    assert eng.cache.k[0].dtype == jnp.int8
    # int8 values and a float32 scale per (row, kv head, position): (8 + 4) / 32 of float32 at head_dim 8
    assert eng.cache_bytes == jaxgpt.cache_bytes(CFG, 2, 64, "int8") == 12 * Engine(params, CFG, slots=2, max_len=64).cache_bytes // 32
    outs = eng.run([dict(prompt=p, max_tokens=12, temperature=0.0, logprobs=1) for p in prompts])
    for p, o in zip(prompts, outs):
        # the decoder's int8 cache and the engine's (filled in chunks) round the same keys and values alike
        alone = dec.generate(np.array([p]), 12, jax.random.key(0), temperature=0.0)
        assert np.asarray(alone.tokens)[0, len(p):].tolist() == o.token_ids
        # and the logprobs stay within the int8 cache's rounding of the float model's
        logits = jaxgpt.GPT(CFG).apply({"params": params}, jnp.array([p + o.token_ids]))[0]
        rows = np.asarray(jax.nn.log_softmax(logits, -1))[len(p) - 1:len(p) - 1 + 12]
        np.testing.assert_allclose([t.logprob for t in o.tokens], rows[np.arange(12), o.token_ids], atol=3e-3)
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        jaxgpt.Decoder(params, CFG, kv_dtype="int4")
