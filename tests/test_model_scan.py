"""GPTConfig.scan_layers (stacked parameters, one lax.scan) and GPTConfig.remat: the same parameters, in
another layout, and the same results as the unrolled model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import GPT, GPTConfig, KVCache, generate, init_params
from jaxgpt.training.config import default_config, model_config_from, validate_config
from jaxgpt.model import convert_layers
from tests.helpers import STYLES, assert_same_training
from jaxgpt.training.step import create_train_state, cross_entropy, make_optimizer, make_train_step

MODES = [(scan, remat) for scan in (False, True) for remat in ("none", "block", "dots")]
MODE_IDS = [f"scan={scan}-remat={remat}" for scan, remat in MODES]


def tiny(style="gpt2", **kw):
    base = dict(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32, n_kv_head=2, **STYLES[style])
    base.update(kw)
    return GPTConfig(**base)


def _assert_trees_close(a, b, atol, what):
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        name = f"{what} {jax.tree_util.keystr(path)}"
        assert x.shape == y.shape, name
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0, err_msg=name)


def _loss_and_logits(cfg):
    def f(params, x, y):
        logits = GPT(cfg).apply({"params": params}, x)
        return cross_entropy(logits, y), logits

    return jax.jit(jax.value_and_grad(f, has_aux=True))


@pytest.fixture(scope="module", params=sorted(STYLES))
def reference(request):
    cfg = tiny(request.param)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 13), 0, cfg.vocab_size)
    x, y = tokens[:, :-1], tokens[:, 1:]
    (loss, logits), grads = _loss_and_logits(cfg)(params, x, y)
    return cfg, params, x, y, loss, logits, grads


@pytest.mark.parametrize("scan,remat", MODES, ids=MODE_IDS)
def test_init_gives_the_same_parameters_in_the_configs_layout(reference, scan, remat):
    cfg, params = reference[:2]
    got = init_params(cfg.replace(scan_layers=scan, remat=remat), jax.random.key(0))
    layers = {f"h_{i}" for i in range(cfg.n_layer)}
    assert layers <= set(params) and "h" not in params
    if scan:
        assert set(got) == set(params) - layers | {"h"}  # one stacked subtree, as MaxText and levanter store it
        assert got["h"]["attn"]["c_attn"]["kernel"].shape == (cfg.n_layer,) + params["h_0"]["attn"]["c_attn"]["kernel"].shape
        got = convert_layers(got, cfg)
    _assert_trees_close(got, params, 0.0, "init")


def test_convert_layers_round_trip_and_optimizer_state():
    cfg = tiny()
    scan = cfg.replace(scan_layers=True)
    params = init_params(cfg, jax.random.key(0))
    stacked = convert_layers(params, scan)
    assert convert_layers(stacked, scan) is not None and set(convert_layers(stacked, scan)) == set(stacked)
    _assert_trees_close(convert_layers(stacked, cfg), params, 0.0, "round trip")
    opt = make_optimizer(default_config().train)
    state = create_train_state(params, opt, jax.random.key(1))
    converted = convert_layers(state, scan)  # the optimizer's moments follow the parameters' layout
    _assert_trees_close(converted.opt_state, opt.init(stacked), 0.0, "opt state")


@pytest.mark.parametrize("remat", ["none", "block"])
def test_scan_prefill_and_decode_equal_unrolled(reference, remat):
    cfg, params = reference[:2]
    tokens = jax.random.randint(jax.random.key(2), (3, 10), 0, cfg.vocab_size)
    prompt_lengths = jnp.array([5, 2, 7], jnp.int32)
    prompt = jnp.where(jnp.arange(7)[None] < prompt_lengths[:, None], tokens[:, :7], 0)

    def run(c):
        model = GPT(c)
        p = convert_layers(params, c)
        prefill = jax.jit(lambda cache: model.apply({"params": p}, prompt, cache,
                                                    token_lengths=prompt_lengths))
        logits, cache = prefill(KVCache.create(c, 3, 10))
        outs, caches = [logits], [cache]
        step = jax.jit(lambda cache, tok: model.apply({"params": p}, tok, cache))
        for i in range(3):
            logits, cache = step(cache, tokens[:, 7 + i:8 + i])
            outs.append(logits)
            caches.append(cache)
        return outs, caches

    want_logits, want_caches = run(cfg)
    got_logits, got_caches = run(cfg.replace(scan_layers=True, remat=remat))
    for i, (a, b) in enumerate(zip(got_logits, want_logits)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0, err_msg=f"call {i}")
    for i, (a, b) in enumerate(zip(got_caches, want_caches)):
        np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
        for layer in range(cfg.n_layer):
            for x, y, name in zip(a.layer(layer), b.layer(layer), "kv"):
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=0,
                                           err_msg=f"{name} of layer {layer} after {i}")
    assert float(jnp.abs(got_caches[-1].layer(1)[0]).max()) > 0  # the last layer was written too


def test_scan_greedy_generate_equals_unrolled(reference):
    cfg, params = reference[:2]
    prompts = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 0, 0]])
    kw = dict(prompt_lengths=np.array([5, 3]), temperature=0.0)
    want = generate(params, cfg, prompts, 7, jax.random.key(0), **kw)
    scan = cfg.replace(scan_layers=True, remat="dots")
    got = generate(convert_layers(params, scan), scan, prompts, 7, jax.random.key(0), **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))


@pytest.mark.parametrize("scan", [False, True])
def test_dropout_with_remat_uses_the_same_masks_as_without(reference, scan):
    # remat recomputes the forward in the backward: it must draw the same dropout masks. (The scan draws
    # different masks from the unrolled model, by design, so each path is compared with itself.)
    params, x, no_dropout = reference[1], reference[2], reference[5]

    cfg = reference[0].replace(dropout=0.5, scan_layers=scan)
    params = convert_layers(params, cfg)

    def forward(remat):
        model = GPT(cfg.replace(remat=remat))

        def f(p, key):
            return model.apply({"params": p}, x, deterministic=False, rngs={"dropout": key})

        return jax.jit(lambda p, key: (f(p, key), jax.grad(lambda q: f(q, key).mean())(p)))

    plain, remat = forward("none"), forward("block")
    a, grads_a = remat(params, jax.random.key(1))
    b, _ = remat(params, jax.random.key(2))
    assert np.abs(np.asarray(a - no_dropout)).max() > 0 and np.abs(np.asarray(a - b)).max() > 0
    want, want_grads = plain(params, jax.random.key(1))
    np.testing.assert_allclose(np.asarray(a), np.asarray(want), atol=1e-5, rtol=0)
    _assert_trees_close(grads_a, want_grads, 1e-5, "dropout grad")


def _all_eqns(jaxpr):
    """Every equation of a jaxpr, including those of sub-jaxprs (scan bodies, custom_vjp calls, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


def _program(n_layer, grad=False, **kw):
    cfg = tiny(n_layer=n_layer, **kw)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    x = jnp.zeros((2, 8), jnp.int32)

    def f(p):
        return GPT(cfg).apply({"params": p}, x)

    fn = jax.grad(lambda p: f(p).mean()) if grad else f
    jaxpr = jax.make_jaxpr(fn)(params).jaxpr
    top = [e.primitive.name for e in jaxpr.eqns]
    dots = sum(e.primitive.name == "dot_general" for e in _all_eqns(jaxpr))
    return top, dots


@pytest.mark.parametrize("grad,remat", [(False, "none"), (True, "block"), (True, "dots")])
def test_scan_program_size_is_flat_in_depth(grad, remat):
    top2, dots2 = _program(2, grad, scan_layers=True, remat=remat)
    top4, dots4 = _program(4, grad, scan_layers=True, remat=remat)
    assert top2.count("scan") >= 1 and top4.count("scan") == top2.count("scan")
    assert dots2 == dots4 > 0  # the block's matmuls appear once, in the scan body
    _, unrolled2 = _program(2, grad, remat=remat)
    _, unrolled4 = _program(4, grad, remat=remat)
    assert unrolled4 > unrolled2  # the unrolled program grows with depth


def test_train_step_with_scan_and_remat_equals_default():
    train = default_config().train
    train.warmup_steps, train.lr = 0, 1e-2
    optimizer = make_optimizer(train)
    cfg = tiny()
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(3), (4, 13), 0, cfg.vocab_size)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def run(c):
        step = jax.jit(make_train_step(c, optimizer))
        state = create_train_state(convert_layers(params, c), optimizer, jax.random.key(1))
        losses = []
        for _ in range(2):
            state, metrics = step(state, x, y)
            losses.append(float(metrics["loss"]))
        return convert_layers(state, cfg), losses

    want, want_losses = run(cfg)
    got, got_losses = run(cfg.replace(scan_layers=True, remat="block"))
    np.testing.assert_allclose(got_losses, want_losses, atol=1e-5, rtol=0)
    assert_same_training(got, want, 1e-6, "after 2 steps")
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(want.params), jax.tree.leaves(params)))
    assert moved > 1e-3  # the steps really changed the parameters


@pytest.mark.parametrize("kw,match", [
    (dict(remat="full"), "GPTConfig.remat"),
    (dict(remat=None), "GPTConfig.remat"),
    (dict(scan_layers="yes"), "GPTConfig.scan_layers"),
])
def test_bad_values_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kw)


def test_training_config_keys_reach_gpt_config():
    c = default_config()
    assert c.model.scan_layers is False and c.model.remat == "none"
    c.model.scan_layers, c.model.remat = True, "dots"
    gcfg = model_config_from(c, vocab_size=65)
    assert gcfg.scan_layers is True and gcfg.remat == "dots"
    c.model.remat = "everything"
    with pytest.raises(ValueError, match="remat"):
        validate_config(c)


def test_a_checkpoint_resumes_in_the_other_layout_and_back(tmp_path):
    import json
    import os

    from jaxgpt.loading import load_model
    from jaxgpt.training import train
    from tests.helpers import tiny_config

    def losses(out_dir):
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}

    kw = dict(decay_steps=12, warmup_steps=2, log_interval=1, checkpoint_interval=4, eval_interval=4)
    full = tiny_config(tmp_path / "a", max_steps=12, **kw)
    train(full)
    part = tiny_config(tmp_path / "b", max_steps=4, **kw)
    train(part)  # unrolled, steps 1-4
    part.init_from, part.model.scan_layers, part.train.max_steps = "resume", True, 8
    assert train(part)["start_step"] == 4  # stacked, steps 5-8
    config, params, _, _ = load_model(part.out_dir)  # what jaxgpt-sample reads: the layout it was saved in
    assert config.scan_layers and "h" in params and "h_0" not in params
    part.model.scan_layers, part.train.max_steps = False, 12
    assert train(part)["start_step"] == 8  # unrolled again, steps 9-12
    a, b = losses(full.out_dir), losses(part.out_dir)
    assert sorted(a) == sorted(b) == list(range(1, 13))
    np.testing.assert_allclose([b[k] for k in sorted(b)], [a[k] for k in sorted(a)], rtol=0, atol=1e-5)
