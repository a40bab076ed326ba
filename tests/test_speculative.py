"""Speculative decoding: greedy output equal to plain decoding (n-gram and model drafts, ragged rows, eos),
sampled output distributed as the target's own sampling (a chi-square test against the exact
probabilities), the n-gram lookup, and bad settings refused."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpt
from jaxgpt.speculative import Speculative, _filtered, _ngram_proposals

CFG = jaxgpt.GPTConfig(vocab_size=97, block_size=128, n_layer=2, n_head=4, n_embd=32)
DRAFT_CFG = CFG.replace(n_layer=1)


@pytest.fixture(scope="module")
def models():
    return jaxgpt.init_params(CFG, jax.random.key(0)), jaxgpt.init_params(DRAFT_CFG, jax.random.key(5))


def test_ngram_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    hist = jnp.array([[5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6, 0, 0, 0],
                      [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0]], jnp.int32)
    lengths = jnp.array([11, 8], jnp.int32)
    got = np.asarray(_ngram_proposals(hist, lengths, 2, 3))
    # row 0 ends with (5, 6): latest earlier occurrence at 5, followed by 7, 1, 5
    assert got[0].tolist() == [7, 1, 5]
    # row 1 ends with (7, 8), seen nowhere before: its last token repeated
    assert got[1].tolist() == [8, 8, 8]
    # continuations that run past the text so far stop there
    got = np.asarray(_ngram_proposals(jnp.array([[3, 4, 3, 4, 0, 0]], jnp.int32), jnp.array([4]), 2, 3))
    assert got[0].tolist() == [3, 4, 4]


@pytest.mark.parametrize("draft", ["ngram", "self", "small"])
def test_greedy_speculative_decoding_equals_plain_greedy_decoding(models, draft):
    params, d_params = models
    rng = np.random.default_rng(0)
    base = rng.integers(0, CFG.vocab_size, 6)
    prompts = np.stack([np.tile(base, 4)[:20], rng.integers(0, CFG.vocab_size, 20), np.tile(base[:3], 7)[:20]])
    lengths = np.array([20, 13, 17])  # ragged rows
    draft_arg = {"ngram": "ngram", "self": (params, CFG), "small": (d_params, DRAFT_CFG)}[draft]
    plain = jaxgpt.generate(params, CFG, prompts, 30, jax.random.key(1), prompt_lengths=lengths, temperature=0.0)
    for k in (1, 4):
        dec = jaxgpt.Decoder(params, CFG, speculative=Speculative(k=k, draft=draft_arg))
        out = dec.generate(prompts, 30, jax.random.key(1), prompt_lengths=lengths, temperature=0.0)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
        np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(plain.lengths))
        stats = dec.last_speculative_stats
        assert stats["proposed"] >= k and 0 <= stats["accepted"] <= stats["proposed"]
        if draft == "self":  # the target as its own draft: every proposal is its argmax
            assert stats["acceptance"] == 1.0
    # an end token stops a row as plain decoding does
    eos = int(np.asarray(plain.tokens)[1, lengths[1] + 4])
    want = jaxgpt.generate(params, CFG, prompts, 30, jax.random.key(1), prompt_lengths=lengths, temperature=0.0,
                           eos_id=eos)
    got = jaxgpt.Decoder(params, CFG, speculative=Speculative(k=3, draft=draft_arg)).generate(
        prompts, 30, jax.random.key(1), prompt_lengths=lengths, temperature=0.0, eos_id=eos)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))


def _exact_joint(params, cfg, prompt, steps, temperature, top_k):
    """The target's probability of every continuation of `steps` tokens after `prompt` (sampled with
    these settings): [V] * steps, from the full forward."""
    v = cfg.vocab_size
    seqs = np.array(list(itertools.product(range(v), repeat=steps)), np.int32)
    tokens = np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1)
    logits = jaxgpt.GPT(cfg).apply({"params": params}, jnp.asarray(tokens))
    logp = np.asarray(_filtered(logits, temperature, top_k, None), np.float64)
    p0 = len(prompt) - 1
    total = sum(logp[np.arange(len(seqs)), p0 + i, seqs[:, i]] for i in range(steps))
    return np.exp(total).reshape((v,) * steps)


@pytest.mark.parametrize("draft,top_k", [("ngram", None), ("small", None), ("small", 3)])
def test_sampled_speculative_decoding_follows_the_targets_distribution(draft, top_k):
    # the portable backend: its cache writes every row in one scatter (the cpu backend writes row by row,
    # a program that grows with the 12,000 rows)
    cfg = jaxgpt.GPTConfig(vocab_size=5, block_size=32, n_layer=2, n_head=2, n_embd=16, kernels="portable")
    d_cfg = cfg.replace(n_layer=1)
    params = jaxgpt.init_params(cfg, jax.random.key(3))
    # larger weights than the init's: distributions far from uniform, and far from the draft's
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)
    d_params = jaxgpt.init_params(d_cfg, jax.random.key(4))
    prompt = np.array([1, 3, 1, 3, 1], np.int32)  # repetitive: the n-gram draft proposes 3, 1, ...
    steps, n = 3, 12000
    exact = _exact_joint(params, cfg, prompt, steps, 1.0, top_k).ravel()
    draft_arg = "ngram" if draft == "ngram" else (d_params, d_cfg)
    dec = jaxgpt.Decoder(params, cfg, speculative=Speculative(k=2, draft=draft_arg))
    out = dec.generate(np.tile(prompt, (n, 1)), steps, jax.random.key(7), temperature=1.0, top_k=top_k)
    seqs = np.asarray(out.tokens)[:, len(prompt):]
    counts = np.bincount(np.ravel_multi_index(seqs.T, (cfg.vocab_size,) * steps), minlength=exact.size)
    stats = dec.last_speculative_stats
    assert 0 < stats["accepted"] < stats["proposed"]  # both the accept and the resample paths ran
    # chi-square over the cells with enough expected draws; the rest pooled
    expected = exact * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    chi2 = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    dof = int(keep.sum()) - 1
    # the 0.9999 quantile of chi-square(dof), by the Wilson-Hilferty approximation
    z = 3.719
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, dof, limit)
    if top_k is not None:  # nothing outside each step's top-k is ever drawn
        assert counts[exact == 0].sum() == 0


@pytest.mark.parametrize("kernels,dtype,draft", [("portable", "float32", "ngram"), ("portable", "bfloat16", "ngram"),
                                                 ("cpu", "float32", "ngram"), ("cpu", "bfloat16", "ngram"),
                                                 ("portable", "float32", "small"), ("cpu", "bfloat16", "small")])
def test_near_greedy_speculative_decoding_equals_greedy(kernels, dtype, draft):
    """Sampled speculation (acceptance by p / q, the residual's draw) at temperature 1e-30 or top_p 1e-40:
    p is a point mass on the target's top token, so the output is plain greedy decoding's."""
    from tests.helpers import varied_params
    cfg = CFG.replace(kernels=kernels, dtype=dtype)
    d_cfg = cfg.replace(n_layer=1)
    params, d_params = varied_params(cfg), varied_params(d_cfg, seed=5)
    logp = np.asarray(_filtered(jnp.asarray([[0.5, 3.0, 3.0 - 1e-6, -2.0]]), 1e-30, None, None))
    np.testing.assert_array_equal(np.exp(logp), [[0, 1, 0, 0]])  # (no NaN, no mass lost)
    rng = np.random.default_rng(0)
    base = rng.integers(0, CFG.vocab_size, 5)
    prompts = np.stack([np.tile(base, 3)[:12], rng.integers(0, CFG.vocab_size, 12)])
    greedy = jaxgpt.generate(params, cfg, prompts, 12, jax.random.key(1), temperature=0.0).tokens
    dec = jaxgpt.Decoder(params, cfg, speculative=Speculative(k=3, draft="ngram" if draft == "ngram" else
                                                              (d_params, d_cfg)))
    for kw in (dict(temperature=1e-30), dict(top_p=1e-40)):
        out = dec.generate(prompts, 12, jax.random.key(2), **kw)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(greedy), err_msg=str(kw))


def test_speculative_and_int8_weights_together_equal_int8_plain_decoding(models):
    params, d_params = models
    prompts = np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 9))
    want = jaxgpt.Decoder(params, CFG, quantize="int8").generate(prompts, 20, jax.random.key(0), temperature=0.0)
    got = jaxgpt.Decoder(params, CFG, quantize="int8", speculative=Speculative(k=3, draft=(d_params, DRAFT_CFG)))
    np.testing.assert_array_equal(np.asarray(got.generate(prompts, 20, jax.random.key(0), temperature=0.0).tokens),
                                  np.asarray(want.tokens))


def test_bad_speculative_settings_are_refused(models):
    params, _ = models
    with pytest.raises(ValueError, match="k must be"):
        Speculative(k=0)
    with pytest.raises(ValueError, match="draft must be"):
        Speculative(draft="eagle")
    with pytest.raises(ValueError, match="ngram must be"):
        Speculative(ngram=0)
    other = CFG.replace(vocab_size=50, n_layer=1)
    with pytest.raises(ValueError, match="vocab_size"):
        jaxgpt.Decoder(params, CFG, speculative=Speculative(draft=(jaxgpt.init_params(other, jax.random.key(0)), other)))
    with pytest.raises(ValueError, match="block_size"):
        jaxgpt.Decoder(params, CFG, speculative=Speculative(k=4)).generate(
            np.zeros((1, 100), np.int32), 26, jax.random.key(0), temperature=0.0)
