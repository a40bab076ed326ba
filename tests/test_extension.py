"""Extension points: the new-attention (README.md) and new-block (docs/extending.md) examples run as
written, and a change to the model's attention reaches training and decoding on every backend alike."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import GPT, init_params, resolve
from jaxgpt.backends import PORTABLE
from jaxgpt.model import CausalSelfAttention
from jaxgpt.registry import ATTENTION, BLOCKS
from jaxgpt.training.step import cross_entropy
from tests.helpers import cached_logits, doc_example, varied_params

BACKENDS = [PORTABLE, resolve("cpu")]


def _tiny():
    from jaxgpt import GPTConfig  # head size 16: the native CPU attention kernel takes it

    return GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _tokens(cfg, b=2, t=12):
    return jax.random.randint(jax.random.key(7), (b, t + 1), 0, cfg.vocab_size)


def _loss(cfg, backend, params, data):
    model = GPT(cfg, backend)
    loss = jax.jit(lambda p, d: cross_entropy(model.apply({"params": p}, d[:, :-1]), d[:, 1:]))
    return float(loss(params, data))


@pytest.fixture
def sharper():
    ns = {}
    exec(doc_example("README.md", "**A new attention variant**"), ns)
    yield ns
    ATTENTION.unregister("sharper")


@pytest.fixture
def post_norm():
    ns = {}
    exec(doc_example("docs/extending.md", "**A new block**"), ns)
    yield ns
    BLOCKS.unregister("post_norm")


def test_readme_attention_variant_changes_training_and_decoding_on_every_backend(sharper):
    cfg = sharper["cfg"]
    assert sharper["out"].tokens.shape == (1, 12)
    params = varied_params(cfg)  # at init scale attention is nearly uniform whatever the scores' scale
    data = _tokens(cfg)
    plain = cfg.replace(attention="dot_product")
    for backend in BACKENDS:
        assert abs(_loss(cfg, backend, params, data) - _loss(plain, backend, params, data)) > 1e-4
        full = GPT(cfg, backend).apply({"params": params}, data)[:, 5:]
        np.testing.assert_allclose(cached_logits(cfg, backend, params, data), full, atol=1e-4)
        assert float(jnp.abs(cached_logits(plain, backend, params, data) - full).max()) > 1e-3
    np.testing.assert_allclose(*[_loss(cfg, b, params, data) for b in BACKENDS], rtol=1e-5)


def test_a_change_to_the_model_attention_reaches_the_cpu_training_path_and_decode(monkeypatch):
    cfg = _tiny()
    params = varied_params(cfg)
    data = _tokens(cfg)
    before = {b.name: (_loss(cfg, b, params, data), cached_logits(cfg, b, params, data)) for b in BACKENDS}
    original = CausalSelfAttention.attend

    def doubled_queries(self, q, k, v, positions, cache, layer):  # a forker's edit of the one call site
        return original(self, 2.0 * q, k, v, positions, cache, layer)

    monkeypatch.setattr(CausalSelfAttention, "attend", doubled_queries)
    for b in BACKENDS:
        loss, decoded = _loss(cfg, b, params, data), cached_logits(cfg, b, params, data)
        assert abs(loss - before[b.name][0]) > 1e-4, f"the {b.name} backend's training loss ignored the edit"
        assert float(jnp.abs(decoded - before[b.name][1]).max()) > 1e-3
        np.testing.assert_allclose(decoded, GPT(cfg, b).apply({"params": params}, data)[:, 5:], atol=1e-4)


def test_documented_block_registers_trains_and_decodes_like_its_full_forward(post_norm):
    cfg = post_norm["cfg"]
    params = init_params(cfg, jax.random.key(0))
    data = _tokens(cfg)
    gpt2 = cfg.replace(block="gpt2")  # the same parameter names and shapes, another function
    for backend in BACKENDS:
        full = GPT(cfg, backend).apply({"params": params}, data)
        assert float(jnp.abs(full - GPT(gpt2, backend).apply({"params": params}, data)).max()) > 1e-3
        np.testing.assert_allclose(cached_logits(cfg, backend, params, data), full[:, 5:], atol=1e-4)
        grads = jax.jit(jax.grad(lambda p: cross_entropy(GPT(cfg, backend).apply({"params": p}, data[:, :-1]),
                                                         data[:, 1:])))(params)
        assert all(np.isfinite(g).all() and np.abs(g).sum() > 0 for g in map(np.asarray, jax.tree.leaves(grads)))
    scanned = cfg.replace(scan_layers=True)
    from jaxgpt import convert_layers
    np.testing.assert_allclose(GPT(scanned).apply({"params": convert_layers(params, scanned)}, data),
                               GPT(cfg).apply({"params": params}, data), atol=1e-5)


@pytest.fixture
def gain_mlp():
    ns = {}
    exec(doc_example("docs/extending.md", "**A block with its own names**"), ns)
    yield ns
    BLOCKS.unregister("gain_mlp")


def test_documented_declarations_reach_muon_decay_lora_and_decoding(gain_mlp):
    from flax import traverse_util

    from jaxgpt.lora import LoraSpec, init_adapters
    from jaxgpt.training.step import decay_mask, muon_dimensions

    cfg = gain_mlp["cfg"]
    params = init_params(cfg, jax.random.key(0))
    mlp = gain_mlp["infos"]["h_0"]["mlp"]
    assert mlp["w_in"]["w"].axes == ("embed", "mlp") and mlp["gain"].axes == ("mlp",)
    muon, decay = muon_dimensions(params)["h_0"]["mlp"], decay_mask(params)["h_0"]["mlp"]
    assert muon["w_in"]["w"] is not None and muon["w_out"]["w"] is not None and muon["gain"] is None
    assert decay["w_out"]["w"] and not decay["gain"]
    adapters = init_adapters(params, cfg, LoraSpec(2, 2.0, ("up", "down")), jax.random.key(1))
    assert set(adapters["h_0"]["mlp"]) == {"w_in", "w_out"}
    prepared = traverse_util.flatten_dict(resolve("cpu").prepare_decode(params, 2, jnp.float32, True))
    assert ("h_1", "mlp", "w_out", "w") in prepared and not any("gain" in p for p in prepared)
    data = _tokens(cfg)
    full = GPT(cfg).apply({"params": params}, data)
    np.testing.assert_allclose(cached_logits(cfg, PORTABLE, params, data), full[:, 5:], atol=1e-4)


def test_the_parallel_block_is_built_in_and_differs_from_gpt2():
    cfg = _tiny().replace(block="parallel")
    params = init_params(cfg, jax.random.key(0))
    assert "ln_2" not in params["h_0"]  # one norm feeds both branches
    data = _tokens(cfg)
    for backend in BACKENDS:
        full = GPT(cfg, backend).apply({"params": params}, data)
        np.testing.assert_allclose(cached_logits(cfg, backend, params, data), full[:, 5:], atol=1e-4)


def test_unknown_block_names_the_choices():
    from jaxgpt import GPTConfig

    with pytest.raises(ValueError, match=r"GPTConfig.block must be one of .*gpt2.*parallel"):
        GPTConfig(block="nope")


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scan_layers"])
def test_a_block_that_returns_the_wrong_shape_is_refused_by_name(scan_layers):
    import flax.linen as nn

    from jaxgpt import register_block
    from jaxgpt.model import Block

    @register_block("one_position")
    class OnePosition(nn.Module):  # keeps the first position only: the logits used to broadcast to a loss
        config: object
        backend: object
        deterministic: bool = True

        @nn.compact
        def __call__(self, x, positions, cache=None, layer=None, **extras):
            x, cache = Block(self.config, self.backend, self.deterministic, name="inner")(x, positions, cache, layer)
            return x[:, :1], cache

    @register_block("no_cache")
    class NoCache(nn.Module):  # returns x alone, not (x, cache)
        config: object
        backend: object
        deterministic: bool = True

        @nn.compact
        def __call__(self, x, positions, cache=None, layer=None, **extras):
            return nn.Dense(x.shape[-1], name="proj")(x)

    try:
        cfg = _tiny().replace(scan_layers=scan_layers)
        with pytest.raises(ValueError, match=r"block 'one_position' \(OnePosition\) returned x of shape \(2, 1, 32\) "
                                             r"for an input of \(2, 8, 32\)"):
            GPT(cfg.replace(block="one_position")).init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))
        with pytest.raises(ValueError, match="one_position"):
            init_params(cfg.replace(block="one_position"), jax.random.key(0))
        with pytest.raises(TypeError, match=r"block 'no_cache' \(NoCache\) returned .*\(x \[B, T, D\], cache\)"):
            GPT(cfg.replace(block="no_cache")).init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))
    finally:
        BLOCKS.unregister("one_position")
        BLOCKS.unregister("no_cache")
