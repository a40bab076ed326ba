"""Prefill plus cached decode must reproduce the full forward pass, row by row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import GPT, GPTConfig, KVCache, cache_bytes


def _setup(attention="einsum", n_kv_head=None, block_size=24):
    cfg = GPTConfig(vocab_size=50, block_size=block_size, n_layer=2, n_head=4, n_embd=32,
                    n_kv_head=n_kv_head, attention=attention)
    variables = GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    return cfg, GPT(cfg), variables


def _decode_all(model, variables, cfg, tokens, prompt_lengths):
    """Prefill each row's prompt (ragged), then feed the rest one token at a time; logits per position."""
    b, t = tokens.shape
    p = int(max(prompt_lengths))
    cache = KVCache.create(cfg, b, t)
    prompt = jnp.where(jnp.arange(p)[None] < jnp.asarray(prompt_lengths)[:, None], tokens[:, :p], 0)
    logits, cache = model.apply(variables, prompt, cache, token_lengths=jnp.asarray(prompt_lengths))
    got = {(r, i): logits[r, i] for r in range(b) for i in range(prompt_lengths[r])}
    pos = np.array(prompt_lengths)
    step = jax.jit(lambda c, x: model.apply(variables, x, c))
    while pos.min() < t:
        nxt = tokens[jnp.arange(b), jnp.minimum(pos, t - 1)][:, None]
        out, cache = step(cache, nxt)
        for r in range(b):
            if pos[r] < t:
                got[(r, pos[r])] = out[r, 0]
        pos = pos + 1
    assert np.array_equal(np.asarray(cache.lengths), pos)
    return got


@pytest.mark.parametrize("attention", ["einsum", "dot_product"])
@pytest.mark.parametrize("n_kv_head", [None, 2, 1])
def test_ragged_prefill_then_decode_equals_full_forward(attention, n_kv_head):
    cfg, model, variables = _setup(attention, n_kv_head)
    tokens = jax.random.randint(jax.random.key(1), (3, 12), 0, cfg.vocab_size)
    full = model.apply(variables, tokens)
    got = _decode_all(model, variables, cfg, tokens, [5, 1, 9])
    for (r, i), v in got.items():
        np.testing.assert_allclose(np.asarray(v), np.asarray(full[r, i]), atol=1e-5, err_msg=f"row {r} pos {i}")


@pytest.mark.parametrize("prompt_len", [1, 23])
def test_single_prompt_short_and_near_block_size(prompt_len):
    cfg, model, variables = _setup(block_size=24)
    tokens = jax.random.randint(jax.random.key(2), (1, 24), 0, cfg.vocab_size)
    full = model.apply(variables, tokens)
    got = _decode_all(model, variables, cfg, tokens, [prompt_len])
    assert len(got) == 24
    for (r, i), v in got.items():
        np.testing.assert_allclose(np.asarray(v), np.asarray(full[r, i]), atol=1e-5)


def test_logits_index_selects_last_prompt_position():
    cfg, model, variables = _setup()
    tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, cfg.vocab_size)
    full = model.apply(variables, tokens)
    cache = KVCache.create(cfg, 2, 8)
    last, _ = model.apply(variables, tokens, cache, logits_index=jnp.array([7, 3]))
    assert last.shape == (2, 1, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(full[jnp.arange(2), jnp.array([7, 3])]),
                               atol=1e-5)


def test_cache_is_a_pytree_and_immutable():
    cfg, model, variables = _setup(n_kv_head=2)
    cache = KVCache.create(cfg, 2, 10)
    assert len(jax.tree_util.tree_leaves(cache)) == 2 * cfg.n_layer + 1  # k, v per layer; lengths
    _, new = model.apply(variables, jnp.ones((2, 3), jnp.int32), cache)
    assert int(cache.lengths.sum()) == 0 and float(jnp.abs(jnp.stack(cache.k)).sum()) == 0.0
    np.testing.assert_array_equal(np.asarray(new.lengths), [3, 3])
    assert cache.nbytes == cache_bytes(cfg, 2, 10) == 2 * 2 * 2 * 2 * 10 * 8 * 4


def test_gqa_shrinks_cache():
    assert cache_bytes(_setup()[0], 4, 16) == 4 * cache_bytes(_setup(n_kv_head=1)[0], 4, 16)


def test_create_rejects_bad_sizes():
    cfg = _setup()[0]
    with pytest.raises(ValueError, match="max_len"):
        KVCache.create(cfg, 1, cfg.block_size + 1)
    with pytest.raises(ValueError, match="batch_size"):
        KVCache.create(cfg, 0, 4)


def test_write_puts_each_row_at_its_length_and_layer_view_matches():
    cfg = _setup(n_kv_head=2)[0]  # 2 layers, 2 kv heads of 8
    cache = KVCache.create(cfg, 3, 6).advance(jnp.array([0, 2, 5]))
    k_new = jax.random.normal(jax.random.key(4), (3, 1, 2, 8))
    v_new = k_new + 1.0
    new, k_buf, v_buf = cache.write(1, k_new, v_new)
    assert k_buf.shape == (3 * 2, 6, 8) and new.k[1] is k_buf
    k_view, v_view = new.layer(1)  # [B, K, S, H]
    want = np.zeros((3, 2, 6, 8), np.float32)
    for r, pos in enumerate([0, 2, 5]):
        want[r, :, pos] = np.asarray(k_new[r, 0])
    np.testing.assert_array_equal(np.asarray(k_view), want)
    np.testing.assert_array_equal(np.asarray(v_view), np.where(want != 0, want + 1.0, 0.0))
    assert float(jnp.abs(new.k[0]).sum()) == 0.0  # other layers untouched
    k, v = new.stacked()
    assert k.shape == (cfg.n_layer, 6, 6, 8)
    again = new.from_stacked(k, v)
    for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(new)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
