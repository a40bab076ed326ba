"""The modern (speedrun) recipe, each option against a reference or a property: QK-norm, ReLU^2, zero-init
output projections, logit soft-cap, embedding skips, value embeddings, the WSD schedule and Muon."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxgpt import GPTConfig, init_params
from jaxgpt.model import GPT, convert_layers
from jaxgpt.sampling import generate
from jaxgpt.training import train
from jaxgpt.training.config import default_config, validate_config
from jaxgpt.training.step import make_optimizer, muon_dimensions, wsd_schedule
from tests.helpers import tiny_config

BASE = dict(vocab_size=40, block_size=16, n_layer=3, n_head=4, n_embd=32)
RECIPE = dict(position="rope", norm="rmsnorm", bias=False, tie_embeddings=False, mlp="relu2", qk_norm=True,
              zero_init_proj=True, logit_softcap=10.0, embed_skip=True, value_embeds=1, n_kv_head=2)
TOKENS = np.random.default_rng(0).integers(0, 40, (2, 16)).astype(np.int32)


def _logits(cfg, params, tokens=TOKENS):
    return np.asarray(GPT(cfg).apply({"params": params}, jnp.asarray(tokens)))


def _perturbed(params, seed=1, scale=0.05):
    """params with every leaf moved at random: zero-initialised projections and mixing weights at their
    start values would hide what an option computes."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def test_qk_norm_makes_attention_blind_to_the_scale_of_q_and_k():
    for qk_norm in (True, False):
        cfg = GPTConfig(**BASE, qk_norm=qk_norm)
        p = init_params(cfg, jax.random.key(0))
        kernel = p["h_1"]["attn"]["c_attn"]["kernel"]
        scaled = jax.tree.map(lambda x: x, p)
        scaled["h_1"]["attn"]["c_attn"]["kernel"] = kernel.at[:, :2 * cfg.n_embd].multiply(7.0)  # q and k columns
        scaled["h_1"]["attn"]["c_attn"]["bias"] = p["h_1"]["attn"]["c_attn"]["bias"].at[:2 * cfg.n_embd].multiply(7.0)
        same = np.allclose(_logits(cfg, p), _logits(cfg, scaled), atol=2e-5)
        assert same == qk_norm


def test_relu2_mlp_is_the_square_of_relu():
    cfg = GPTConfig(**BASE, mlp="relu2")
    assert cfg.mlp_hidden == 4 * cfg.n_embd
    p = _perturbed(init_params(cfg, jax.random.key(0)))
    mlp = p["h_0"]["mlp"]
    x = jax.random.normal(jax.random.key(3), (2, 5, cfg.n_embd))
    from jaxgpt.backends import PORTABLE
    from jaxgpt.model import MLPS
    got = MLPS["relu2"](cfg, PORTABLE).apply({"params": mlp}, x)
    h = jnp.maximum(x @ mlp["c_fc"]["kernel"] + mlp["c_fc"]["bias"], 0.0) ** 2
    np.testing.assert_allclose(got, h @ mlp["c_proj"]["kernel"] + mlp["c_proj"]["bias"], atol=1e-5)


def test_zero_init_projections_start_every_block_as_the_identity_and_still_train():
    cfg = GPTConfig(**BASE, zero_init_proj=True, bias=False)
    p = init_params(cfg, jax.random.key(0))
    for i in range(cfg.n_layer):
        assert not np.any(p[f"h_{i}"]["attn"]["c_proj"]["kernel"]) and not np.any(p[f"h_{i}"]["mlp"]["c_proj"]["kernel"])
        assert np.any(p[f"h_{i}"]["attn"]["c_attn"]["kernel"])
    # identity blocks: the logits are ln_f(wte[x] + wpe) @ wte.T
    x = p["wte"]["embedding"][TOKENS] + p["wpe"]["embedding"][:16]
    x = (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + cfg.layer_norm_epsilon)
    np.testing.assert_allclose(_logits(cfg, p), x * p["ln_f"]["scale"] @ p["wte"]["embedding"].T, atol=1e-4)
    grads = jax.grad(lambda q: GPT(cfg).apply({"params": q}, jnp.asarray(TOKENS)).std())(p)
    assert float(jnp.abs(grads["h_0"]["mlp"]["c_proj"]["kernel"]).max()) > 0


def test_logit_softcap_is_cap_times_tanh():
    cfg = GPTConfig(**BASE)
    p = jax.tree.map(lambda x: 4 * x, init_params(cfg, jax.random.key(0)))  # logits past the cap
    plain = _logits(cfg, p)
    capped = _logits(cfg.replace(logit_softcap=5.0), p)
    assert np.abs(plain).max() > 6.0 and np.abs(capped).max() < 5.0
    np.testing.assert_allclose(capped, 5.0 * np.tanh(plain / 5.0), atol=1e-4)


def test_embed_skip_starts_as_the_plain_model_and_its_weights_learn():
    cfg = GPTConfig(**BASE, embed_skip=True)
    p = init_params(cfg, jax.random.key(0))
    np.testing.assert_array_equal(p["embed_skip"], np.tile([1.0, 0.0], (cfg.n_layer, 1)))
    plain = {k: v for k, v in p.items() if k != "embed_skip"}
    np.testing.assert_allclose(_logits(cfg, p), _logits(cfg.replace(embed_skip=False), plain), atol=1e-6)
    # block 2 reading only the embedding: the model without blocks 0 and 1
    only = {**p, "embed_skip": p["embed_skip"].at[2].set(jnp.array([0.0, 1.0]))}
    short = {k: v for k, v in plain.items() if k not in ("h_0", "h_1", "h_2")} | {"h_0": p["h_2"]}
    np.testing.assert_allclose(_logits(cfg, only), _logits(cfg.replace(embed_skip=False, n_layer=1), short),
                               atol=1e-5)
    grads = jax.grad(lambda q: GPT(cfg).apply({"params": q}, jnp.asarray(TOKENS)).std())(_perturbed(p))
    assert float(jnp.abs(grads["embed_skip"][:, 1]).min()) > 0


def test_value_embeds_feed_the_first_and_last_blocks_only():
    cfg = GPTConfig(**BASE, value_embeds=1)
    p = _perturbed(init_params(cfg, jax.random.key(0)))
    assert p["wve_0"]["embedding"].shape == (cfg.vocab_size, cfg.n_kv_head * cfg.head_dim)
    # with the mixing weights at (1, 0) the values are the plain model's
    off = jax.tree.map(lambda x: x, p)
    plain = {k: v for k, v in p.items() if k != "wve_0"}
    for i in range(cfg.n_layer):
        off[f"h_{i}"]["attn"]["ve_mix"] = jnp.array([1.0, 0.0])
        plain[f"h_{i}"] = {**p[f"h_{i}"], "attn": {k: v for k, v in p[f"h_{i}"]["attn"].items() if k != "ve_mix"}}
    np.testing.assert_allclose(_logits(cfg, off), _logits(cfg.replace(value_embeds=0), plain), atol=1e-5)
    # the table's weight has a gradient in blocks 0 and 2 (table 0), none in block 1 (between them)
    grads = jax.grad(lambda q: GPT(cfg).apply({"params": q}, jnp.asarray(TOKENS)).std())(p)
    ve_weight = [float(jnp.abs(grads[f"h_{i}"]["attn"]["ve_mix"][1])) for i in range(cfg.n_layer)]
    assert ve_weight[0] > 0 and ve_weight[2] > 0 and ve_weight[1] == 0


@pytest.mark.parametrize("scan_layers", [False, True])
def test_the_whole_recipe_is_causal_and_the_cache_matches_the_full_forward(scan_layers):
    cfg = GPTConfig(**BASE, **RECIPE, scan_layers=scan_layers)
    unrolled = _perturbed(init_params(cfg.replace(scan_layers=False), jax.random.key(0)), scale=0.3)
    p = convert_layers(unrolled, cfg)
    full = _logits(cfg, p)
    if scan_layers:
        np.testing.assert_allclose(full, _logits(cfg.replace(scan_layers=False), unrolled), atol=1e-5)
    changed = TOKENS.copy()
    changed[:, 9:] = (changed[:, 9:] + 1) % 40
    np.testing.assert_allclose(_logits(cfg, p, changed)[:, :9], full[:, :9], atol=1e-5)
    assert not np.allclose(_logits(cfg, p, changed)[:, 9:], full[:, 9:], atol=1e-3)
    # greedy decoding with the cache: each new token is the full forward's argmax at the position before
    # it (one forward over the whole result, as the model is causal)
    seq = np.asarray(generate(p, cfg, TOKENS[:, :5], 8, jax.random.key(0), temperature=0.0).tokens)
    np.testing.assert_array_equal(seq[:, :5], TOKENS[:, :5])
    np.testing.assert_array_equal(seq[:, 5:], _logits(cfg, p, seq)[:, 4:-1].argmax(-1))
    assert len(np.unique(seq[:, 5:])) > 2  # a varied continuation: a cache bug would show


def test_wsd_schedule_warms_up_holds_then_decays_linearly():
    s = wsd_schedule(1e-2, 1e-3, warmup_steps=10, decay_steps=100, decay_fraction=0.3)
    lr = np.array([float(s(i)) for i in range(120)])
    np.testing.assert_allclose(lr[:11], np.linspace(0, 1e-2, 11), rtol=1e-6)
    np.testing.assert_allclose(lr[10:71], 1e-2, rtol=1e-6)
    np.testing.assert_allclose(lr[70:101], np.linspace(1e-2, 1e-3, 31), rtol=1e-5)
    np.testing.assert_allclose(lr[100:], 1e-3, rtol=1e-6)


def _newton_schulz(g, steps=5):
    """Muon's quintic Newton-Schulz iteration, written out: x <- a x + (b A + c A^2) x, A = x x^T, on the
    wide orientation of g after scaling it to unit Frobenius norm."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = g.shape[0] > g.shape[1]
    x = g.T if tall else g
    x = x / (jnp.linalg.norm(x) + 1e-8)
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def _train_cfg(**kw):
    t = default_config().train
    t.optimizer, t.grad_clip, t.warmup_steps, t.max_steps, t.weight_decay = "muon", 0.0, 0, 10, 0.1
    t.lr, t.muon_lr, t.min_lr, t.muon_momentum = 1e-3, 0.05, 1e-3, 0.9
    for k, v in kw.items():
        t[k] = v
    return t


def test_muon_orthogonalises_the_block_kernels_with_nesterov_momentum_and_adamw_trains_the_rest():
    rng = np.random.default_rng(0)
    params = {"h_0": {"attn": {"c_attn": {"kernel": jnp.asarray(rng.normal(size=(8, 24)), jnp.float32),
                                          "bias": jnp.zeros(24)}},
                      "mlp": {"c_proj": {"kernel": jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)}}},
              "wte": {"embedding": jnp.asarray(rng.normal(size=(40, 8)), jnp.float32)}}
    t = _train_cfg(min_lr=1e-3)  # a constant lr: the schedule's value is lr from step 1 on (warmup 0)
    opt = make_optimizer(t)
    adamw = optax.adamw(1e-3, b1=t.beta1, b2=t.beta2, weight_decay=t.weight_decay)
    state, adam_state = opt.init(params), adamw.init(params["wte"])
    beta, p, mu = t.muon_momentum, params, {}
    for step in range(1, 4):
        grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
        updates, state = opt.update(grads, state, p)
        for name, kernel in (("c_attn", p["h_0"]["attn"]["c_attn"]["kernel"]),
                             ("c_proj", p["h_0"]["mlp"]["c_proj"]["kernel"])):
            g = grads["h_0"]["attn" if name == "c_attn" else "mlp"][name]["kernel"]
            mu[name] = beta * mu.get(name, 0.0) + (1 - beta) * g
            # Nesterov with bias correction, as optax defines it
            m_hat = beta * mu[name] / (1 - beta ** (step + 1)) + (1 - beta) * g / (1 - beta ** step)
            width = max(1.0, kernel.shape[1] / kernel.shape[0]) ** 0.5
            want = -t.muon_lr * (width * _newton_schulz(m_hat) + t.weight_decay * kernel)
            got = updates["h_0"]["attn" if name == "c_attn" else "mlp"][name]["kernel"]
            np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
        want_adam, adam_state = adamw.update(grads["wte"], adam_state, p["wte"])
        np.testing.assert_allclose(updates["wte"]["embedding"], want_adam["embedding"], rtol=1e-5, atol=1e-8)
        p = optax.apply_updates(p, updates)
    # the orthogonalised update's singular values sit near 1 (the quintic's band, roughly 0.7 to 1.2)
    s = np.linalg.svd(np.asarray(_newton_schulz(jnp.asarray(rng.normal(size=(16, 48)), jnp.float32))),
                      compute_uv=False)
    assert 0.6 < s.min() and s.max() < 1.25


def test_muon_takes_the_stacked_blocks_of_scan_layers_one_layer_at_a_time():
    cfg = GPTConfig(**BASE, scan_layers=True)
    dims = muon_dimensions(init_params(cfg, jax.random.key(0)))
    kernel = dims["h"]["attn"]["c_attn"]["kernel"]
    assert (kernel.reduction_axis, kernel.output_axis) == (1, 2)
    assert dims["h"]["attn"]["c_attn"]["bias"] is None and dims["wte"]["embedding"] is None


def test_a_muon_wsd_run_with_the_recipe_resumes_exactly(tmp_path):
    def config(path, max_steps):
        c = tiny_config(path, max_steps=max_steps, decay_steps=8, warmup_steps=2, log_interval=1,
                        checkpoint_interval=4, eval_interval=4, optimizer="muon", schedule="wsd", decay_fraction=0.5)
        for k, v in RECIPE.items():
            c.model[k] = v
        c.model.n_kv_head = 1
        return c

    full = config(tmp_path / "a", 8)
    train(full)
    half = config(tmp_path / "b", 4)
    train(half)
    half.init_from, half.train.max_steps = "resume", 8
    assert train(half)["start_step"] == 4

    def losses(c):
        with open(os.path.join(c.out_dir, "metrics.jsonl")) as f:
            return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}

    a, b = losses(full), losses(half)
    assert sorted(a) == sorted(b) == list(range(1, 9)) and [a[k] for k in a] == [b[k] for k in a]


@pytest.mark.parametrize("key,value,message", [
    ("train.optimizer", "sgd", "must be one of"),
    ("train.schedule", "linear", "must be one of"),
    ("train.decay_fraction", 0.0, "(0, 1]"),
    ("train.muon_lr", -1.0, "> 0"),
    ("model.value_embeds", 9, "[0, n_layer"),
    ("model.logit_softcap", -1.0, ">= 0"),
])
def test_bad_recipe_settings_are_refused_by_name(key, value, message):
    c = default_config()
    section, name = key.split(".")
    c[section][name] = value
    with pytest.raises(ValueError) as e:
        validate_config(c)
    assert message in str(e.value) and name in str(e.value)


@pytest.mark.parametrize("option", [dict(qk_norm=True), dict(logit_softcap=30.0),
                                    dict(embed_skip=True), dict(value_embeds=1)])
def test_export_to_hugging_face_refuses_what_transformers_cannot_compute(tmp_path, option):
    from jaxgpt.pretrained import save_pretrained
    cfg = GPTConfig(**BASE, **option)
    with pytest.raises(ValueError) as e:
        save_pretrained(init_params(cfg, jax.random.key(0)), cfg, tmp_path / "hf")
    assert list(option)[0] in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "hf").exists()


def test_zero_init_projections_export_like_any_gpt2(tmp_path):
    from jaxgpt.pretrained import save_pretrained
    cfg = GPTConfig(**BASE, zero_init_proj=True)
    assert (save_pretrained(init_params(cfg, jax.random.key(0)), cfg, tmp_path / "hf") / "config.json").exists()


def test_relu2_exports_as_gpt2_with_its_activation_and_comes_back(tmp_path):
    # transformers' GPT-2 MLP applies ACT2FN[activation_function], and ACT2FN["relu2"] is relu(x) ** 2
    # (tests/test_pretrained_parity.py compares the logits in transformers)
    import json

    from jaxgpt.pretrained import from_pretrained, save_pretrained
    cfg = GPTConfig(**BASE, mlp="relu2")
    params = init_params(cfg, jax.random.key(0))
    folder = save_pretrained(params, cfg, tmp_path / "hf")
    assert json.loads((folder / "config.json").read_text())["activation_function"] == "relu2"
    back, got = from_pretrained(folder)
    assert back.mlp == "relu2" and back.replace(dropout=cfg.dropout) == cfg
    jax.tree.map(np.testing.assert_array_equal, got, params)
    with pytest.raises(ValueError, match="no Hugging Face architecture"):  # Llama's MLP is gated: not relu2's
        save_pretrained(params, cfg.replace(position="rope", norm="rmsnorm"), tmp_path / "llama")


def test_newton_schulz_in_bfloat16_stays_near_float32_and_float32_equals_optax_muon():
    from jaxgpt.training.step import newton_schulz
    rng = np.random.default_rng(3)
    g = jnp.asarray(rng.normal(size=(24, 8)), jnp.float32)  # tall: orthogonalised on its wide orientation
    want = np.asarray(_newton_schulz(g))
    np.testing.assert_allclose(newton_schulz(g), want, rtol=2e-4, atol=1e-6)
    half = np.asarray(newton_schulz(g, dtype=jnp.bfloat16))
    assert np.abs(half - want).max() < 0.05 * np.abs(want).max() and np.abs(half - want).max() > 0
    # stacked [L, in, out] matrices are orthogonalised one by one
    stack = jnp.stack([g, 2 * g + 1])
    np.testing.assert_allclose(newton_schulz(stack)[1], _newton_schulz(2 * g + 1), rtol=2e-4, atol=1e-6)
    # the whole Muon transform, float32, against optax's own Muon with its 5 iterations
    params = {"h_0": {"mlp": {"c_fc": {"kernel": g}}}}
    t = _train_cfg(min_lr=1e-3, weight_decay=0.0)
    ours = make_optimizer(t)
    theirs = optax.chain(optax.contrib.scale_by_muon(beta=t.muon_momentum, nesterov=True,
                                                     weight_dimension_numbers=muon_dimensions),
                         optax.scale(-t.muon_lr))
    s1, s2 = ours.init(params), theirs.init(params)
    for step in range(3):
        grads = {"h_0": {"mlp": {"c_fc": {"kernel": jnp.asarray(rng.normal(size=g.shape), jnp.float32)}}}}
        u1, s1 = ours.update(grads, s1, params)
        u2, s2 = theirs.update(grads, s2, params)
        np.testing.assert_allclose(u1["h_0"]["mlp"]["c_fc"]["kernel"], u2["h_0"]["mlp"]["c_fc"]["kernel"],
                                   rtol=2e-4, atol=1e-6)
    t.muon_ns_dtype = "float16"
    c = default_config()
    c.train = t
    with pytest.raises(ValueError, match="muon_ns_dtype"):
        validate_config(c)


def test_a_target_val_loss_stops_the_run_at_the_first_eval_that_reaches_it_with_a_checkpoint(tmp_path, capsys):
    from jaxgpt.checkpoint import existing_steps
    c = tiny_config(tmp_path, max_steps=30, eval_interval=10, checkpoint_interval=30, target_val_loss=50.0)
    summary = train(c)
    assert summary["steps"] == 10 and summary["reached_target"] and summary["target_step"] == 10
    assert existing_steps(c.out_dir) == [10]
    assert "<= train.target_val_loss 50 at step 10" in capsys.readouterr().out
    c = tiny_config(tmp_path / "b", max_steps=20, eval_interval=10, target_val_loss=0.01)  # out of reach
    summary = train(c)
    assert summary["steps"] == 20 and "reached_target" not in summary
    c.train.target_val_loss = -1.0
    with pytest.raises(ValueError, match="target_val_loss"):
        validate_config(c)
