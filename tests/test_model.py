import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpt
from jaxgpt import GPT, GPTConfig
from tests.helpers import STYLES


def tiny(style="gpt2", **kw):
    base = dict(vocab_size=65, block_size=32, n_layer=2, n_head=4, n_embd=32, **STYLES[style])
    base.update(kw)
    return GPTConfig(**base)


@pytest.fixture(scope="module")
def model_and_vars():
    cfg = tiny()
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    return cfg, jax.jit(GPT(cfg).init)(jax.random.key(0), tokens), tokens  # (eager: a compile per op)


def test_gpt2_parameter_names(model_and_vars):
    _, variables, _ = model_and_vars
    p = variables["params"]
    assert set(p) == {"wte", "wpe", "h_0", "h_1", "ln_f"}
    assert set(p["h_0"]) == {"ln_1", "attn", "ln_2", "mlp"}
    assert set(p["h_0"]["attn"]) == {"c_attn", "c_proj"}
    assert set(p["h_0"]["mlp"]) == {"c_fc", "c_proj"}
    assert p["h_0"]["attn"]["c_attn"]["kernel"].shape == (32, 96)


def test_untied_head_bias_off_and_param_count():
    cfg = tiny(tie_embeddings=False, bias=False, n_kv_head=2)
    params = jaxgpt.init_params(cfg, jax.random.key(0))
    assert "lm_head" in params and "bias" not in params["h_0"]["attn"]["c_attn"]
    assert params["h_0"]["attn"]["c_attn"]["kernel"].shape == (32, 32 + 2 * 16)
    assert jaxgpt.count_params(params) == jaxgpt.num_params(cfg, non_embedding=False)
    assert jaxgpt.count_params(jaxgpt.init_params(tiny(), jax.random.key(0))) == \
        jaxgpt.num_params(tiny(), non_embedding=False)


def test_the_parameters_do_not_depend_on_the_attention_function():
    # cuDNN's attention needs its libraries even to trace: the parameter count (jaxgpt-aot's first step)
    # and init used to fail on a machine without them, though an attention function has no parameters
    cfg = tiny(attention="cudnn", dtype="bfloat16")
    assert jaxgpt.num_params(cfg) == jaxgpt.num_params(cfg.replace(attention="dot_product"))
    got, want = (jaxgpt.init_params(c, jax.random.key(0)) for c in (cfg, cfg.replace(attention="einsum")))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), got, want))


@pytest.mark.parametrize("tied", [True, False])
def test_flops_count_only_parameters_that_multiply(tied):
    # The N of 6N: position embeddings are a lookup; so is the token table when a separate lm_head
    # does the output matmul (then the table must not be counted, or MFU is overstated).
    cfg = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, tie_embeddings=tied)
    blocks = 12 * (4 * 768 * 768 + 4 * 768 + 8 * 768 * 768 + 5 * 768 + 4 * 768)  # attn, mlp, two LayerNorms
    head = 50257 * 768
    assert jaxgpt.num_params(cfg, non_embedding=True) == blocks + 2 * 768 + head
    assert jaxgpt.num_params(cfg, non_embedding=False) == blocks + 2 * 768 + head * (1 if tied else 2) + 1024 * 768
    assert jaxgpt.flops_per_token(cfg, 1024) == 6 * jaxgpt.num_params(cfg) + 12 * 12 * 1024 * 768


def test_logits_shape_and_dtype(model_and_vars):
    cfg, variables, tokens = model_and_vars
    logits = GPT(cfg).apply(variables, tokens)
    assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == jnp.float32


@pytest.mark.parametrize("style", sorted(STYLES))
def test_causality_by_perturbation(style):
    cfg = tiny(style)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    variables = GPT(cfg).init(jax.random.key(0), tokens)
    t = 7
    changed = tokens.at[:, t + 1:].set((tokens[:, t + 1:] + 5) % cfg.vocab_size)
    a = GPT(cfg).apply(variables, tokens)
    b = GPT(cfg).apply(variables, changed)
    np.testing.assert_array_equal(np.asarray(a[:, : t + 1]), np.asarray(b[:, : t + 1]))
    assert np.abs(np.asarray(a[:, t + 1:] - b[:, t + 1:])).max() > 0


@pytest.mark.parametrize("style", sorted(STYLES))
def test_causality_by_gradient(style):
    # Untied head, so each row of the token table feeds exactly one input position; the table is then
    # the identity of the inputs and d logits[t] / d embedding[s] must vanish for every s > t.
    cfg = tiny(style, vocab_size=16, tie_embeddings=False)
    model = GPT(cfg)
    ids = jnp.arange(16)[None, :]
    params = model.init(jax.random.key(0), ids)["params"]
    t = 5

    def logits_at_t(table):
        return model.apply({"params": {**params, "wte": {"embedding": table}}}, ids)[0, t].sum()

    g = jax.jit(jax.grad(logits_at_t))(params["wte"]["embedding"])
    assert np.abs(np.asarray(g[t + 1:])).max() == 0.0
    assert np.abs(np.asarray(g[: t + 1])).max() > 0


@pytest.mark.parametrize("kw,match", [
    (dict(n_embd=30), "n_embd"),
    (dict(n_kv_head=3), "n_kv_head"),
    (dict(attention="flash"), "attention"),
    (dict(attention="blocked"), "attention"),  # now the cpu backend's job: kernels="cpu"
    (dict(kernels="mps"), "kernels"),
    (dict(dtype="int8"), "dtype"),
    (dict(n_layer=0), "n_layer"),
    (dict(n_layer=2.0), "n_layer"),
    (dict(dropout=1.5), "dropout"),
    (dict(dropout=float("nan")), "dropout"),
    (dict(dropout="0.1"), "dropout"),
    (dict(bias="no"), "bias"),
    (dict(tie_embeddings=0), "tie_embeddings"),
    (dict(scan_layers=1), "scan_layers"),
    (dict(layer_norm_epsilon=float("nan")), "layer_norm_epsilon"),
    (dict(layer_norm_epsilon=0.0), "layer_norm_epsilon"),
    (dict(layer_norm_epsilon=True), "layer_norm_epsilon"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kw)


def test_numpy_numbers_in_a_config_are_taken_as_python_ones():
    import json

    cfg = GPTConfig(vocab_size=np.int64(65), block_size=np.int32(32), n_layer=np.array(2), n_head=jnp.int32(4),
                    n_embd=np.int64(32), dropout=np.float32(0.5), value_embeds=np.int64(1))
    assert cfg == tiny(dropout=float(np.float32(0.5)), value_embeds=1) and hash(cfg) == hash(tiny(
        dropout=float(np.float32(0.5)), value_embeds=1))
    assert all(type(getattr(cfg, k)) is int for k in ("vocab_size", "n_embd", "n_kv_head", "mlp_hidden", "value_embeds"))
    assert json.loads(json.dumps(cfg.to_dict()))["n_embd"] == 32  # (a NumPy integer is no JSON)
    for bad in (np.bool_(True), True, np.float64(32.0), np.array([32])):
        with pytest.raises(ValueError, match="n_embd must be a positive integer"):
            tiny(n_embd=bad)


def test_sequence_longer_than_block_size(model_and_vars):
    cfg, variables, _ = model_and_vars
    with pytest.raises(ValueError, match="block_size"):
        GPT(cfg).apply(variables, jnp.zeros((1, cfg.block_size + 1), jnp.int32))


def test_dropout_needs_rng_and_changes_output():
    cfg = tiny(dropout=0.5)
    tokens = jnp.zeros((1, 8), jnp.int32)
    variables = GPT(cfg).init(jax.random.key(0), tokens)
    det = GPT(cfg).apply(variables, tokens)
    a = GPT(cfg).apply(variables, tokens, deterministic=False, rngs={"dropout": jax.random.key(1)})
    b = GPT(cfg).apply(variables, tokens, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert np.abs(np.asarray(a - det)).max() > 0 and np.abs(np.asarray(a - b)).max() > 0


@pytest.mark.parametrize("kernels", ["portable", "cpu"])
def test_bf16_compute_keeps_float32_params_and_logits(kernels):
    cfg = tiny(dtype="bfloat16", kernels=kernels)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    params = jaxgpt.init_params(cfg, jax.random.key(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    params = jax.tree.map(lambda x: 4.0 * x if x.ndim >= 2 else x, params)  # logits of std ~0.5, not ~0.1
    logits = GPT(cfg).apply({"params": params}, tokens)
    ref = GPT(cfg.replace(dtype="float32")).apply({"params": params}, tokens)
    assert logits.dtype == jnp.float32
    err = float(jnp.abs(logits - ref).max()) / float(ref.std())
    assert 1e-4 < err < 0.06, err  # bf16 rounding really happened, and stayed at bf16's ~3 digits
