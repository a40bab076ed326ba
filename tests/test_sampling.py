import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpt
from jaxgpt import GPT, GPTConfig, generate, sample_logits, top_k_filter, top_p_filter
from jaxgpt import sampling
from tests.helpers import LLAMA, varied_params


@pytest.fixture(scope="module", params=["portable", "cpu"])
def tiny(request):
    # weights whose greedy continuations vary: at init scale greedy decoding repeats one token, and a
    # cache bug (a key written at the wrong position, the newest key invisible) would go unseen
    cfg = GPTConfig(vocab_size=40, block_size=32, n_layer=2, n_head=4, n_embd=32, n_kv_head=2,
                    kernels=request.param)
    return cfg, varied_params(cfg)


def test_llama_style_greedy_generate_equals_naive_full_forward():
    cfg = GPTConfig(vocab_size=40, block_size=32, n_layer=2, n_head=4, n_embd=32, n_kv_head=2, **LLAMA)
    params = varied_params(cfg)
    prompts = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 0, 0]])
    out = generate(params, cfg, prompts, 10, jax.random.key(0), prompt_lengths=np.array([5, 3]), temperature=0.0)
    assert np.asarray(out.tokens[0]).tolist() == _naive_greedy(cfg, params, [3, 1, 4, 1, 5], 10)
    assert np.asarray(out.tokens[1, :13]).tolist() == _naive_greedy(cfg, params, [9, 2, 6], 10)


def _kept(filtered):
    return set(np.flatnonzero(np.isfinite(np.asarray(filtered))).tolist())


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = jnp.array([1.0, 3.0, 3.0, 3.0, 0.5])
    assert len(_kept(top_k_filter(logits, 2))) == 2
    assert _kept(top_k_filter(logits, 2)) <= {1, 2, 3}
    assert _kept(top_k_filter(logits, 4)) == {0, 1, 2, 3}
    assert _kept(top_k_filter(logits, 5)) == {0, 1, 2, 3, 4}


def test_top_p_boundary_and_crossing_token():
    probs = jnp.array([0.25, 0.5, 0.125, 0.125])  # exact in binary floating point
    logits = jnp.log(probs)
    assert _kept(top_p_filter(logits, 0.5)) == {1}          # 0.5 reached exactly by the top token
    assert _kept(top_p_filter(logits, 0.75)) == {0, 1}      # reached exactly by two
    assert _kept(top_p_filter(logits, 0.76)) == {0, 1, 2}   # crossing token included
    assert _kept(top_p_filter(logits, 1e-6)) == {1}
    assert _kept(top_p_filter(logits, 1.0)) == {0, 1, 2, 3}


def test_top_p_with_ties_keeps_a_minimal_set():
    logits = jnp.log(jnp.array([0.25, 0.25, 0.25, 0.25]))
    assert len(_kept(top_p_filter(logits, 0.5))) == 2


def _top_p_reference(logits, p):
    # by sorting everything, in float64: token kept when the mass of the tokens before it (by probability,
    # ties in index order) is below p
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.lexsort((np.arange(len(logits)), -logits))
    before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(len(logits), bool)
    keep[order] = before < p
    return keep


def test_top_p_without_a_sort_keeps_what_a_sort_keeps():
    # peaked and flat rows, ties, each row its own p: the bisection's set is the sorted cumulative sum's
    rng = np.random.default_rng(3)
    v = 768
    logits = rng.normal(size=(6, v)).astype(np.float32)
    logits[0] *= 8  # peaked: a few tokens hold the mass
    logits[1] = np.round(logits[1] * 4)  # peaked, with ties
    logits[2] *= 0.1  # nearly flat: p = 0.9 needs most of the vocabulary
    p = np.array([0.9, 0.8, 0.9, 0.3, 0.999, 0.5], np.float32)
    got = np.asarray(jax.jit(sampling.top_p_mask)(jnp.asarray(logits), jnp.asarray(p)))
    sizes = got.sum(-1)
    assert sizes[0] < 50 and sizes[2] > 500 and 1 <= sizes[3] < sizes[2]
    for row in range(6):
        np.testing.assert_array_equal(got[row], _top_p_reference(logits[row].astype(np.float64), p[row]), row)
        one = np.asarray(top_p_filter(jnp.asarray(logits[row]), float(p[row])))  # the scalar form, a row alone
        np.testing.assert_array_equal(np.isfinite(one), got[row])
    # the order it bisects over is the floats' (-0.0 equal to 0.0)
    x = np.array([-np.inf, -3e38, -2.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0, 2.0, 3e38, np.inf], np.float32)
    keys = np.asarray(sampling._ordered_uint(jnp.asarray(x))).astype(np.int64)
    assert (np.diff(keys) > 0).sum() == len(x) - 2 and keys[5] == keys[6]


def test_filters_are_batched():
    logits = jnp.array([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    f = np.isfinite(np.asarray(top_k_filter(logits, 1)))
    np.testing.assert_array_equal(f, [[False, False, True], [True, False, False]])


def test_argmax_last_is_argmax_with_ties_nans_and_infinities():
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, (64, 37)).astype(np.float32)  # many ties
    x[5] = -np.inf
    x[6, [4, 9]] = np.nan
    x[7] = np.nan
    x[8, 3] = np.inf
    x[9, [2, 30]] = np.inf
    x[10] = -0.0
    x[10, 20] = 0.0
    for a in (x, x[:, :1], x.reshape(8, 8, 37)):
        got = jax.jit(sampling.argmax_last)(jnp.asarray(a))
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), np.argmax(a, axis=-1))


def _inverse_cdf_reference(u, x):
    """float64: the first token whose running softmax mass exceeds u times the total."""
    p = np.exp(x.astype(np.float64) - x.max())
    return int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right"))


def test_inverse_cdf_is_the_float64_inverse_cdf_away_from_its_steps():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, 1000)).astype(np.float32) * 3  # 4 blocks, the last one part padding
    x[1, ::2] = -np.inf  # filtered logits
    x[2] = np.round(x[2])  # ties
    x[3, 7] = 40.0  # one token holds nearly all the mass
    x[4, 990:] = 30.0  # the mass in the last, partly padded block
    x[5, :-1] = -np.inf  # one token left, the last
    u = rng.random(size=(200, 6)).astype(np.float32)
    u[0] = 0.0
    u[1] = np.nextafter(np.float32(1), np.float32(0))
    got = np.asarray(jax.jit(jax.vmap(sampling.inverse_cdf, in_axes=(0, None)))(jnp.asarray(u), jnp.asarray(x)))
    checked = 0
    for j in range(u.shape[0]):
        for r in range(x.shape[0]):
            p = np.exp(x[r].astype(np.float64) - x[r].max())
            assert p[got[j, r]] > 0, "a token without mass was drawn"
            edges = np.cumsum(p) / p.sum()
            if np.min(np.abs(edges - u[j, r])) > 1e-5:  # float32 sums may move a step by that much
                assert got[j, r] == _inverse_cdf_reference(u[j, r], x[r])
                checked += 1
    assert checked > 1000


def test_categorical_draws_from_the_softmax():
    probs = np.array([0.45, 0.25, 0.0, 0.2, 0.1, 0.0], np.float32)
    x = np.where(probs > 0, np.log(np.maximum(probs, 1e-30)), -np.inf).astype(np.float32)  # zeros as -inf
    for n in (len(probs), 700):  # one block; three blocks, the mass in the first
        xs = np.concatenate([x, np.full(n - len(x), -np.inf, np.float32)])
        keys = jax.random.split(jax.random.key(5), 20_000)
        got = np.asarray(jax.jit(jax.vmap(sampling.categorical, in_axes=(0, None)))(keys, jnp.asarray(xs)))
        freq = np.bincount(got, minlength=n) / len(keys)
        assert freq[len(probs):].sum() == 0 and freq[2] == 0 and freq[5] == 0
        np.testing.assert_allclose(freq[:len(probs)], probs, atol=0.012)  # ~4 standard deviations


def test_categorical_rows_draw_what_each_row_draws_alone_in_any_batch():
    # the engine's rows and generate's batch of one draw alike: a row's token depends on its key and logits
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(33, 50257)).astype(np.float32) * 2)
    keys = jax.random.split(jax.random.key(4), 33)
    alone = [int(jax.jit(sampling.categorical)(keys[i], x[i])) for i in range(33)]
    assert [int(jax.jit(sampling.categorical)(keys[i], x[i:i + 1])[0]) for i in range(0, 33, 8)] == alone[::8]
    for s in (1, 2, 7, 8, 32, 33):
        got = jax.jit(sampling.categorical_rows)(keys[:s], x[:s])
        assert got.dtype == jnp.int32
        assert np.asarray(got).tolist() == alone[:s]


def test_categorical_of_nans_and_infinities_is_argmax():
    x = np.zeros((4, 300), np.float32)
    x[0, 5], x[0, 9] = np.nan, np.nan
    x[1, 17], x[1, 200] = np.inf, np.inf
    x[2] = -np.inf
    x[3, 250] = -np.inf  # an ordinary row: a draw, never the -inf token
    for i in range(5):
        got = np.asarray(jax.jit(sampling.categorical)(jax.random.key(i), jnp.asarray(x)))
        assert got[:3].tolist() == [5, 17, 0] and got[3] != 250


def test_sample_rows_mixed_rows_each_equal_sample_logits():
    """One step's rows: greedy, top-k (the candidates' path), top-p alone (the sort) and no filter, each row
    drawing what `sample_logits` draws for it alone; and greedy rows alone take argmax."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(5, 300)).astype(np.float32))
    # (top-p 0.7 keeps about a third of the tokens, 0.999 nearly all)
    settings = [(0.0, 0, 1.0), (0.8, 20, 1.0), (1.3, 0, 0.7), (1.0, 0, 1.0), (1.0, 0, 0.999)]
    keys = jax.random.split(jax.random.key(3), 5)
    rows = sampling.RowSettings(
        temperature=jnp.asarray([t for t, _, _ in settings], jnp.float32),
        top_k=jnp.asarray([k for _, k, _ in settings], jnp.int32),
        top_p=jnp.asarray([p for _, _, p in settings], jnp.float32),
        key_data=jax.vmap(jax.random.key_data)(keys), index=jnp.asarray([5, 6, 7, 8, 9], jnp.int32))
    got = np.asarray(sampling.sample_rows(logits, rows))
    for s, (t, k, p) in enumerate(settings):
        want = sample_logits(jax.random.fold_in(keys[s], 5 + s), logits[s:s + 1], t, k or None, p)
        assert got[s] == int(want[0]), s
    only_greedy = rows._replace(temperature=jnp.zeros(5, jnp.float32))
    np.testing.assert_array_equal(np.asarray(sampling.sample_rows(logits, only_greedy)),
                                  np.argmax(np.asarray(logits), -1))


def test_sample_logits_greedy_and_filters_match_argmax():
    logits = jax.random.normal(jax.random.key(0), (8, 40))
    greedy = np.asarray(jnp.argmax(logits, -1))
    for kw in [dict(temperature=0.0), dict(top_k=1), dict(top_p=1e-6)]:
        np.testing.assert_array_equal(np.asarray(sample_logits(jax.random.key(1), logits, **kw)), greedy)


def _peaked_logits(dtype):
    """[6, 300] logits whose top token is unique in `dtype`, in rows from flat to peaked."""
    x = jax.random.normal(jax.random.key(11), (6, 300)) * jnp.array([0.1, 1, 3, 10, 30, 100])[:, None]
    x = x.astype(dtype)
    top = jnp.argmax(x, -1)
    return x.at[jnp.arange(6), top].add(jnp.asarray(0.5, dtype)), top  # (bf16 rounds ties into the data)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_filters_where_logits_over_a_tiny_temperature_overflow_keep_the_top_token(dtype):
    """logits / 1e-30 overflows float32, and a compiled division need not round the largest logit as its
    row's max does (a reciprocal, a fused multiply-add): inf - inf or a top short of 1 had the draw fall to
    token 0. Scaled, the top logit is exactly 0 and the rest <= 0; top-p with p that float32 flushes to 0
    keeps the top token; every draw is argmax."""
    logits, top = _peaked_logits(dtype)
    rows = np.arange(6)
    for t in (1e-6, 1e-12, 1e-30, sampling.MIN_TEMPERATURE):
        x = np.asarray(jax.jit(sampling.scale_logits)(logits, t))
        assert (x[rows, top] == 0).all() and (x <= 0).all() and not np.isnan(x).any(), t
        inv = np.asarray(jax.jit(sampling.inverse_cdf)(jnp.full((6,), 0.999), jnp.asarray(x)))
        np.testing.assert_array_equal(inv, top)
    for p in (1e-40, 1e-45, 0.0):  # (0 is refused from users; it is what a flushed subnormal p becomes)
        keep = np.asarray(jax.jit(sampling.top_p_mask)(logits, p))
        np.testing.assert_array_equal(keep, np.arange(300)[None, :] == np.asarray(top)[:, None])
        assert _kept(top_p_filter(logits[3], p)) == {int(top[3])}
        ordered = -jnp.sort(-logits.astype(jnp.float32), axis=-1)
        assert np.asarray(sampling._top_p_keep(ordered, p)).sum(-1).tolist() == [1] * 6
    for key in range(4):
        for t, k, p in ((1e-12, None, None), (1e-30, None, None), (1e-40, None, None), (1.0, None, 1e-40),
                        (1e-30, 5, None), (0.7, 5, 1e-40), (1e-30, 100, 1e-40)):
            draw = jax.jit(lambda r, x: sample_logits(r, x, t, k, p))(jax.random.key(key), logits)
            np.testing.assert_array_equal(np.asarray(draw), top, err_msg=str((t, k, p)))


def test_sample_rows_at_tiny_temperatures_and_top_p_is_argmax():
    """Every row path of the engine's sampler (the top-k candidates, the full sort, top-p over the
    vocabulary, no filter) at temperatures down to 1e-40 and top_p 1e-40: argmax, never token 0."""
    logits, top = _peaked_logits(jnp.float32)
    logits = jnp.concatenate([logits, logits.astype(jnp.bfloat16).astype(jnp.float32)])
    top = jnp.concatenate([top, top])
    settings = [(1e-30, 0, 1.0), (1e-12, 20, 1.0), (1e-30, 100, 1.0), (1.0, 0, 1e-40), (0.9, 20, 1e-40),
                (1e-40, 100, 1e-40), (1e-38, 0, 1.0), (0.5, 0, 1e-45), (1e-20, 0, 0.5), (1e-15, 300, 1.0),
                (1e-30, 64, 1e-40), (1e-10, 0, 1.0)]
    for key in range(3):
        rows = sampling.RowSettings(
            temperature=jnp.asarray([t for t, _, _ in settings], jnp.float32),
            top_k=jnp.asarray([k for _, k, _ in settings], jnp.int32),
            top_p=jnp.asarray([p for _, _, p in settings], jnp.float32),
            key_data=jax.vmap(jax.random.key_data)(jax.random.split(jax.random.key(key), 12)),
            index=jnp.arange(12, dtype=jnp.int32))
        np.testing.assert_array_equal(np.asarray(jax.jit(sampling.sample_rows)(logits, rows)), top)


@pytest.mark.parametrize("kernels", ["portable", "cpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_near_greedy_settings_generate_the_greedy_tokens(kernels, dtype):
    """temperature -> 0 tends to greedy, and the top token is always in the nucleus: temperature 1e-30
    gave [.., 0, 0, 20, 7, 0, 0 ..] and top_p 1e-40 all zeros where greedy gives ten distinct tokens."""
    cfg = GPTConfig(vocab_size=40, block_size=32, n_layer=2, n_head=4, n_embd=32, n_kv_head=2, kernels=kernels,
                    dtype=dtype)
    params = varied_params(cfg)
    prompts = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    dec = jaxgpt.Decoder(params, cfg)
    greedy = np.asarray(dec.generate(prompts, 12, jax.random.key(0), temperature=0.0).tokens)
    assert len(set(greedy[0, 5:].tolist())) >= 4  # (a continuation that varies)
    for kw in (dict(temperature=1e-30), dict(top_p=1e-40), dict(temperature=1e-12, top_k=5, top_p=1e-40)):
        out = dec.generate(prompts, 12, jax.random.key(3), **kw)
        np.testing.assert_array_equal(np.asarray(out.tokens), greedy, err_msg=str(kw))
    stream = np.concatenate(list(dec.stream(prompts, 12, jax.random.key(3), chunk_size=5, temperature=1e-300)), 1)
    np.testing.assert_array_equal(stream, greedy[:, 5:])


@pytest.mark.parametrize("top_k,top_p", [(None, None), (4, None), (None, 0.7), (4, 0.7), (12, 0.9)])
def test_sample_logits_draws_from_the_filtered_softmax(top_k, top_p):
    logits = jax.random.normal(jax.random.key(3), (10,)) * 1.5
    temperature = 0.8
    expect = logits / temperature
    if top_k is not None:
        expect = top_k_filter(expect, top_k)
    if top_p is not None:
        expect = top_p_filter(expect, top_p)
    expect = np.asarray(jax.nn.softmax(expect))
    n = 20000
    draws = sample_logits(jax.random.key(4), jnp.broadcast_to(logits, (n, 10)), temperature, top_k, top_p)
    freq = np.bincount(np.asarray(draws), minlength=10) / n
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(expect > 0))
    np.testing.assert_allclose(freq, expect, atol=0.015)


def _naive_greedy(cfg, params, prompt, n):
    # full forward over a fixed-length padded sequence; causality makes the padding irrelevant
    forward = jax.jit(lambda x: GPT(cfg).apply({"params": params}, x))
    seq = list(prompt)
    for _ in range(n):
        padded = jnp.array([seq + [0] * (len(prompt) + n - len(seq))])
        seq.append(int(jnp.argmax(forward(padded)[0, len(seq) - 1])))
    return seq


@pytest.mark.parametrize("prompt", [[3, 1, 4, 1, 5], [7], [2, 9, 11, 30, 8, 0, 19]])
def test_greedy_generate_equals_naive_full_forward(tiny, prompt):
    cfg, params = tiny
    out = generate(params, cfg, np.array([prompt]), 12, jax.random.key(0), temperature=0.0)
    assert out.tokens.shape == (1, len(prompt) + 12) and int(out.lengths[0]) == len(prompt) + 12
    new = np.asarray(out.tokens[0]).tolist()
    assert new == _naive_greedy(cfg, params, prompt, 12)
    assert len(set(new[len(prompt):])) >= 4, new  # the continuation varies: a cache bug would show


def test_top_k1_and_tiny_top_p_equal_greedy(tiny):
    cfg, params = tiny
    prompts = np.array([[1, 2, 3], [4, 5, 6]])
    greedy = generate(params, cfg, prompts, 6, jax.random.key(0), temperature=0.0).tokens
    for kw in [dict(top_k=1), dict(top_p=1e-6)]:
        out = generate(params, cfg, prompts, 6, jax.random.key(7), temperature=1.3, **kw).tokens
        np.testing.assert_array_equal(np.asarray(out), np.asarray(greedy))


def test_ragged_batch_equals_each_row_alone(tiny):
    cfg, params = tiny
    prompts = np.array([[5, 6, 7, 8, 9], [1, 2, 0, 0, 0], [3, 0, 0, 0, 0]])
    lengths = np.array([5, 2, 1])
    out = generate(params, cfg, prompts, 7, jax.random.key(0), prompt_lengths=lengths, temperature=0.0)
    for r in range(3):
        alone = generate(params, cfg, prompts[r:r + 1, : lengths[r]], 7, jax.random.key(0), temperature=0.0)
        n = int(out.lengths[r])
        assert n == lengths[r] + 7
        np.testing.assert_array_equal(np.asarray(out.tokens[r, :n]), np.asarray(alone.tokens[0]))
        assert (np.asarray(out.tokens[r, n:]) == 0).all()


def test_a_list_of_prompts_of_different_lengths_is_padded_for_you(tiny):
    """generate([[1, 2, 3], [4]]) raised numpy's "inhomogeneous shape" error."""
    cfg, params = tiny
    decoder = jaxgpt.Decoder(params, cfg)
    out = decoder.generate([[5, 6, 7], [4], (1, 2)], 4, jax.random.key(0), temperature=0.0)
    padded = decoder.generate(np.array([[5, 6, 7], [4, 0, 0], [1, 2, 0]]), 4, jax.random.key(0), temperature=0.0,
                              prompt_lengths=[3, 1, 2])
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(padded.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), [7, 5, 6])
    with pytest.raises(ValueError, match="give their own lengths: leave prompt_lengths out"):
        decoder.generate([[1, 2, 3], [4]], 2, jax.random.key(0), prompt_lengths=[3, 1])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        decoder.generate([[1, 2], []], 2, jax.random.key(0))
    with pytest.raises(ValueError, match="pad them to one length and pass prompt_lengths"):
        decoder.generate([[[1, 2]], [3]], 2, jax.random.key(0))


def test_eos_stops_a_row(tiny):
    cfg, params = tiny
    prompts = np.array([[1, 2, 3], [7, 8, 9]])
    free = generate(params, cfg, prompts, 10, jax.random.key(0), temperature=0.0)
    eos = int(free.tokens[0, 5])  # the third generated token of row 0 becomes the end token
    first = np.flatnonzero(np.asarray(free.tokens[0, 3:]) == eos)[0]
    out = generate(params, cfg, prompts, 10, jax.random.key(0), temperature=0.0, eos_id=eos, pad_id=0)
    n0 = 3 + first + 1
    assert int(out.lengths[0]) == n0
    np.testing.assert_array_equal(np.asarray(out.tokens[0, :n0]), np.asarray(free.tokens[0, :n0]))
    assert (np.asarray(out.tokens[0, n0:]) == 0).all()
    for r in range(2):  # rows whose tokens never hit eos run to the end unchanged
        row = np.asarray(free.tokens[r, 3:])
        if eos not in row:
            assert int(out.lengths[r]) == 13
            np.testing.assert_array_equal(np.asarray(out.tokens[r]), np.asarray(free.tokens[r]))


def test_same_rng_same_output_and_no_retrace(tiny):
    cfg, params = tiny
    kw = dict(temperature=0.9, top_k=10, top_p=0.9)
    a = generate(params, cfg, np.array([[1, 2, 3, 4]]), 6, jax.random.key(5), **kw)
    count = sampling.TRACE_COUNT
    b = generate(params, cfg, np.array([[1, 2, 3, 4]]), 6, jax.random.key(5), **kw)
    c = generate(params, cfg, np.array([[9, 8, 7, 6]]), 6, jax.random.key(6), **kw)
    assert sampling.TRACE_COUNT == count, "new prompt values of the same shape must not retrace"
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert np.asarray(c.tokens[0, :4]).tolist() == [9, 8, 7, 6]
    generate(params, cfg, np.array([[1, 2, 3, 4, 5]]), 6, jax.random.key(5), **kw)
    assert sampling.TRACE_COUNT == count + 1


@pytest.mark.parametrize("kw,match", [
    (dict(max_new_tokens=30), "block_size"),
    (dict(prompts=np.array([[1, 2, 40]])), "outside the vocabulary"),
    (dict(prompts=np.array([[1, -1, 2]])), "outside the vocabulary"),
    (dict(prompt_lengths=[0]), "prompt_lengths"),
    (dict(prompt_lengths=[4]), "prompt_lengths"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(prompt_lengths=[2.7]), "prompt_lengths must be integers"),
    (dict(pad_id=40), "pad_id"),
    (dict(pad_id=-1), "pad_id"),
    (dict(eos_id=40), "eos_id"),
    (dict(rng=0), "rng must be a PRNG key"),
    (dict(rng=np.zeros(3, np.uint32)), "rng must be a PRNG key"),
])
def test_bad_input(tiny, kw, match):
    cfg, params = tiny
    args = dict(prompts=np.array([[1, 2, 3]]), max_new_tokens=4, prompt_lengths=None, rng=jax.random.key(0))
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        generate(params, cfg, args.pop("prompts"), args.pop("max_new_tokens"), args.pop("rng"), **args)


def test_settings_given_as_numpy_or_jax_scalars_are_the_plain_numbers(tiny):
    # jnp.float32(0.5) is a 0-d jax.Array, not a numbers.Real: it was refused while np.float32 was taken
    cfg, params = tiny
    prompts = np.array([[1, 2, 3]])
    want = generate(params, cfg, prompts, 5, jax.random.key(3), temperature=0.5, top_k=7, top_p=0.9).tokens
    for kw in [dict(temperature=np.float32(0.5), top_k=np.int64(7), top_p=np.float64(0.9)),
               dict(temperature=jnp.float32(0.5), top_k=jnp.int32(7), top_p=jnp.float32(0.9)),
               dict(temperature=np.array(0.5), top_k=np.array(7), top_p=np.array(0.9))]:
        got = generate(params, cfg, prompts, 5, jax.random.key(3), **kw).tokens
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for bad in (jnp.float32(-0.5), jnp.float32(jnp.nan), jnp.array([0.5]), jnp.bool_(True)):
        with pytest.raises(ValueError, match="temperature"):
            generate(params, cfg, prompts, 5, jax.random.key(3), temperature=bad)


def test_a_legacy_uint32_key_works_too(tiny):
    cfg, params = tiny
    a = generate(params, cfg, np.array([[1, 2]]), 3, jax.random.PRNGKey(0), temperature=0.0)
    b = generate(params, cfg, np.array([[1, 2]]), 3, jax.random.key(0), temperature=0.0)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


@pytest.mark.parametrize("chunk", [1, 4, 32])
def test_stream_yields_what_generate_returns_chunk_by_chunk(tiny, chunk):
    cfg, params = tiny
    prompts, lengths = np.array([[5, 6, 7, 8], [1, 2, 0, 0]]), np.array([4, 2])
    kw = dict(prompt_lengths=lengths, temperature=0.9, top_k=10)
    want = generate(params, cfg, prompts, 10, jax.random.key(3), **kw)
    chunks = list(sampling.generate_stream(params, cfg, prompts, 10, jax.random.key(3), chunk_size=chunk, **kw))
    assert [c.shape[1] for c in chunks] == [min(chunk, 10 - i) for i in range(0, 10, chunk)]
    got = np.concatenate(chunks, axis=1)
    for r in range(2):
        np.testing.assert_array_equal(got[r], np.asarray(want.tokens)[r, lengths[r]:lengths[r] + 10])


def test_stream_stops_when_every_row_has_ended(tiny):
    cfg, params = tiny
    free = generate(params, cfg, np.array([[1, 2, 3]]), 12, jax.random.key(0), temperature=0.0)
    eos = int(free.tokens[0, 4])  # the second generated token
    chunks = list(sampling.generate_stream(params, cfg, np.array([[1, 2, 3]]), 12, jax.random.key(0),
                                           chunk_size=3, temperature=0.0, eos_id=eos))
    assert len(chunks) == 1 and eos in chunks[0][0].tolist()
    with pytest.raises(ValueError, match="chunk_size"):
        next(sampling.generate_stream(params, cfg, np.array([[1]]), 2, jax.random.key(0), chunk_size=0))
