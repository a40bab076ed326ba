"""Prefill plus cached decode must reproduce the full forward pass, row by row, on both kernel sets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import GPT, GPTConfig, KVCache, cache_bytes, resolve
from tests.helpers import STYLES

KERNELS = ["portable", "cpu"]


def _setup(attention="dot_product", n_kv_head=None, block_size=24, kernels="portable", scan_layers=False,
           style="gpt2"):
    cfg = GPTConfig(vocab_size=50, block_size=block_size, n_layer=2, n_head=4, n_embd=32, n_kv_head=n_kv_head,
                    attention=attention, kernels=kernels, scan_layers=scan_layers, **STYLES[style])
    variables = jax.jit(GPT(cfg).init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    return cfg, Compiled(GPT(cfg)), variables


def _cache(cfg, batch_size, max_len):
    """An empty cache in the layout of the config's backend (as generate makes it)."""
    return KVCache.create(cfg, batch_size, max_len, layout=resolve(cfg).cache_layout)


class Compiled:
    """The model with a jitted apply: one program per call signature instead of op-by-op dispatch."""

    def __init__(self, model):
        self.apply = jax.jit(model.apply)


def _decode_all(model, variables, cfg, tokens, prompt_lengths):
    """Prefill each row's prompt (ragged), then feed the rest one token at a time; logits per position.

    Every row takes a decode step until the longest has reached the end, so the cache holds
    t - min(prompt_lengths) more positions than the prompt: max_len = 2t - min(prompt_lengths) fits all.
    """
    b, t = tokens.shape
    p = int(max(prompt_lengths))
    cache = _cache(cfg, b, 2 * t - int(min(prompt_lengths)))
    prompt = jnp.where(jnp.arange(p)[None] < jnp.asarray(prompt_lengths)[:, None], tokens[:, :p], 0)
    logits, cache = model.apply(variables, prompt, cache, token_lengths=jnp.asarray(prompt_lengths))
    got = {(r, i): logits[r, i] for r in range(b) for i in range(prompt_lengths[r])}
    pos = np.array(prompt_lengths)
    step = jax.jit(lambda c, x: model.apply(variables, x, c))
    while pos.min() < t:
        nxt = tokens[jnp.arange(b), jnp.minimum(pos, t - 1)][:, None]
        out, cache = step(cache, nxt)
        assert np.isfinite(np.asarray(out)).all()  # no row overflowed its cache
        for r in range(b):
            if pos[r] < t:
                got[(r, pos[r])] = out[r, 0]
        pos = pos + 1
    assert np.array_equal(np.asarray(cache.lengths), pos)
    return got


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("attention,n_kv_head,style", [("dot_product", None, "gpt2"), ("dot_product", 2, "gpt2"),
                                                       ("dot_product", 1, "gpt2"), ("einsum", 2, "gpt2"),
                                                       ("dot_product", 2, "llama")])
def test_ragged_prefill_then_decode_equals_full_forward(kernels, attention, n_kv_head, style):
    cfg, model, variables = _setup(attention, n_kv_head, kernels=kernels, style=style)
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
    cache = KVCache.create(cfg, 1, 24)
    logits, cache = model.apply(variables, tokens[:, :prompt_len], cache)
    got = [logits[0, i] for i in range(prompt_len)]
    step = jax.jit(lambda c, x: model.apply(variables, x, c))
    for i in range(prompt_len, 24):
        out, cache = step(cache, tokens[:, i:i + 1])
        got.append(out[0, 0])
    np.testing.assert_allclose(np.asarray(jnp.stack(got)), np.asarray(full[0]), atol=1e-5)


def test_logits_index_selects_last_prompt_position():
    cfg, model, variables = _setup()
    tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, cfg.vocab_size)
    full = model.apply(variables, tokens)
    cache = KVCache.create(cfg, 2, 8)
    last, _ = model.apply(variables, tokens, cache, logits_index=jnp.array([7, 3]))
    assert last.shape == (2, 1, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(full[jnp.arange(2), jnp.array([7, 3])]),
                               atol=1e-5)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("scan_layers", [False, True])
def test_cache_is_a_pytree_and_immutable(kernels, scan_layers):
    cfg, model, _ = _setup(n_kv_head=2, kernels=kernels, scan_layers=scan_layers)
    variables = {"params": jax.jit(lambda k: GPT(cfg).init(k, jnp.zeros((1, 4), jnp.int32)))(jax.random.key(0))["params"]}
    cache = _cache(cfg, 2, 10)
    leaves = jax.tree_util.tree_leaves(cache)
    assert len(leaves) == (3 if scan_layers else 2 * cfg.n_layer + 1)  # k, v (per layer or stacked); lengths
    _, new = model.apply(variables, jnp.ones((2, 3), jnp.int32), cache)
    assert int(cache.lengths.sum()) == 0 and all(float(jnp.abs(x).sum()) == 0.0 for x in leaves[:-1])
    np.testing.assert_array_equal(np.asarray(new.lengths), [3, 3])
    assert cache.nbytes == cache_bytes(cfg, 2, 10) == 2 * 2 * 2 * 2 * 10 * 8 * 4
    assert cache.max_len == 10 and cache.batch_size == 2
    k, v = new.layer(1)
    assert k.shape == v.shape == (2, 2, 10, 8)  # [B, K, S, H] whatever the storage


def test_portable_buffers_are_head_major_and_shardable_by_batch():
    cfg = _setup(n_kv_head=2)[0]
    cache = KVCache.create(cfg, 4, 6)
    assert all(x.shape == (4, 2, 6, 8) for x in cache.k)  # batch and kv head on their own axes
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    placed = jax.device_put(cache.k[0], sharding)
    assert {s.data.shape for s in placed.addressable_shards} == {(2, 2, 6, 8)}


def test_gqa_shrinks_cache():
    assert cache_bytes(_setup()[0], 4, 16) == 4 * cache_bytes(_setup(n_kv_head=1)[0], 4, 16)


def test_create_rejects_bad_sizes():
    cfg = _setup()[0]
    with pytest.raises(ValueError, match="max_len"):
        KVCache.create(cfg, 1, cfg.block_size + 1)
    with pytest.raises(ValueError, match="batch_size"):
        KVCache.create(cfg, 0, 4)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("scan_layers", [False, True])
def test_write_puts_each_row_at_its_length(kernels, scan_layers):
    cfg = _setup(n_kv_head=2, kernels=kernels, scan_layers=scan_layers)[0]  # 2 layers, 2 kv heads of 8
    cache = _cache(cfg, 3, 6).advance(jnp.array([0, 2, 4]))
    k_new = jax.random.normal(jax.random.key(4), (3, 2, 2, 8))  # [B, K, T, H]: two new positions per row
    new = cache.write(1, k_new, k_new + 1.0)
    k_view, v_view = new.layer(1)  # [B, K, S, H]
    want = np.zeros((3, 2, 6, 8), np.float32)
    for r, pos in enumerate([0, 2, 4]):
        want[r, :, pos:pos + 2] = np.asarray(k_new[r])
    np.testing.assert_array_equal(np.asarray(k_view), want)
    np.testing.assert_array_equal(np.asarray(v_view), np.where(want != 0, want + 1.0, 0.0))
    assert float(jnp.abs(new.layer(0)[0]).sum()) == 0.0  # other layers untouched
    if scan_layers:  # a traced layer index writes the same
        traced = jax.jit(lambda c, i: c.write(i, k_new, k_new + 1.0))(cache, 1)
        np.testing.assert_array_equal(np.asarray(traced.layer(1)[0]), want)


def test_portable_write_is_one_op_whatever_the_batch():
    cfg = _setup(n_kv_head=2)[0]

    def ops(b):
        cache = KVCache.create(cfg, b, 6)
        new = jnp.zeros((b, 2, 1, 8))
        return len(jax.make_jaxpr(lambda c: c.write(0, new, new))(cache).jaxpr.eqns)

    assert ops(1) == ops(8)


@pytest.mark.parametrize("kernels", KERNELS)
def test_overflow_is_an_error_outside_jit_and_nan_logits_inside(kernels):
    cfg, _, variables = _setup(kernels=kernels)
    model = GPT(cfg)  # called op by op: the overflow check needs concrete lengths
    tokens = jnp.ones((2, 3), jnp.int32)
    cache = _cache(cfg, 2, 4)
    with pytest.raises(ValueError, match="do not fit"):
        model.apply(variables, jnp.ones((2, 5), jnp.int32), cache)
    _, cache = model.apply(variables, tokens, cache.replace(lengths=jnp.array([0, 0])))
    with pytest.raises(ValueError, match=r"overflows the KV cache.*row\(s\) \[0, 1\]"):
        model.apply(variables, tokens, cache)
    step = jax.jit(lambda c, x: model.apply(variables, x, c))
    logits, _ = step(cache.replace(lengths=jnp.array([2, 3])), jnp.ones((2, 2), jnp.int32))
    assert np.isfinite(np.asarray(logits[0])).all()  # 2 + 2 positions fit in 4
    assert np.isnan(np.asarray(logits[1])).all()     # 3 + 2 do not: the row's logits are NaN
