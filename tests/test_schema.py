"""The parameter schema: layers declare their parameters, and Muon, weight decay, LoRA, decode packing,
int8 and the FLOP count read the declarations, so a block whose parameters have other names gets all of
them exactly as the built-in block does; every leaf has one logical axis per dimension."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from jaxgpt import GPT, GPTConfig, init_params, resolve
from jaxgpt import quantize as Q
from jaxgpt import schema
from jaxgpt.attention import split_heads
from jaxgpt.backends import PORTABLE
from jaxgpt.backends.cpu import PreparedKernel
from jaxgpt.cache import KVCache
from jaxgpt.lora import LoraSpec, init_adapters, merge
from jaxgpt.model import (UP, CausalSelfAttention, Dense, abstract_params, flops_per_token, norm, qkv_info,
                          recompute_flops_per_token)
from jaxgpt.registry import BLOCKS
from jaxgpt.training.config import default_config
from jaxgpt.training.step import decay_mask, make_optimizer, muon_dimensions
from tests.helpers import LLAMA

CPU = resolve("cpu")


# ---------------------------------------------------------------------------------------------------
# GPT-2's block written again with other names: projections qkv, out, up, down, kernels w, norms
# norm1 and norm2, the attention and MLP modules attention and ffn

class RenamedAttention(CausalSelfAttention):
    @nn.compact
    def __call__(self, x_BxTxD, positions_BxT, cache=None, layer=None):
        cfg, be = self.config, self.backend
        b, t, _ = x_BxTxD.shape
        n, kh, h = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        qkv = Dense((n + 2 * kh) * h, cfg.bias, cfg, be, info=qkv_info(cfg), kernel_name="w", name="qkv")(x_BxTxD)
        q, k, v = split_heads(qkv, n, kh)
        out, cache = self.attend(q, k.swapaxes(1, 2), v.swapaxes(1, 2), positions_BxT, cache, layer)
        info = schema.matrix("heads", "embed", targets=(("o", None),), output_only=self.output_only)
        y = Dense(cfg.n_embd, cfg.bias, cfg, be, info=info, kernel_name="w", name="out")(out.reshape(b, t, n * h))
        return y, cache


class RenamedMLP(nn.Module):
    config: GPTConfig
    backend: object
    deterministic: bool = True
    output_only: bool = True

    @nn.compact
    def __call__(self, x_BxTxD):
        cfg, be = self.config, self.backend
        hidden = nn.gelu(Dense(cfg.mlp_hidden, cfg.bias, cfg, be, info=UP, kernel_name="w", name="up")(x_BxTxD),
                         approximate=True)
        info = schema.matrix("mlp", "embed", targets=(("down", None),), output_only=self.output_only)
        return Dense(cfg.n_embd, cfg.bias, cfg, be, info=info, kernel_name="w", name="down")(hidden)


class RenamedBlock(nn.Module):
    config: GPTConfig
    backend: object
    deterministic: bool = True

    @nn.compact
    def __call__(self, x, positions, cache=None, layer=None):
        cfg, be, det = self.config, self.backend, self.deterministic
        y, cache = RenamedAttention(cfg, be, det, name="attention")(norm(cfg, be, "norm1")(x), positions, cache, layer)
        x = x + y
        return x + RenamedMLP(cfg, be, det, name="ffn")(norm(cfg, be, "norm2")(x)), cache


class RenamedParallelBlock(nn.Module):
    config: GPTConfig
    backend: object
    deterministic: bool = True

    @nn.compact
    def __call__(self, x, positions, cache=None, layer=None):
        cfg, be, det = self.config, self.backend, self.deterministic
        h = norm(cfg, be, "norm1")(x)
        y, cache = RenamedAttention(cfg, be, det, output_only=True, name="attention")(h, positions, cache, layer)
        return x + y + RenamedMLP(cfg, be, det, name="ffn")(h), cache


_RENAMES = {"attn": "attention", "mlp": "ffn", "c_attn": "qkv", "c_fc": "up", "ln_1": "norm1", "ln_2": "norm2",
            "kernel": "w"}


def _renamed(path: tuple) -> tuple:
    """A built-in block's parameter path -> the renamed block's."""
    out = []
    for i, key in enumerate(path):
        if key == "c_proj":
            key = "out" if path[i - 1] == "attn" else "down"
        out.append(_RENAMES.get(key, key))
    return tuple(out)


@pytest.fixture(scope="module", autouse=True)
def renamed_blocks():
    BLOCKS.register("renamed")(RenamedBlock)
    BLOCKS.register("renamed_parallel")(RenamedParallelBlock)
    yield
    BLOCKS.unregister("renamed")
    BLOCKS.unregister("renamed_parallel")


def _cfgs(**kw):
    """(built-in, renamed) configs of the same shape."""
    base = GPTConfig(**{**dict(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=32), **kw})
    return base, base.replace(block="renamed_parallel" if base.block == "parallel" else "renamed")


def _by_builtin_path(tree) -> dict:
    return {path: leaf for path, leaf in traverse_util.flatten_dict(tree).items()}


def _tokens(cfg, b=2, t=12):
    return jax.random.randint(jax.random.key(7), (b, t), 0, cfg.vocab_size)


def _decode(cfg, backend, params, tokens, prepared=None, prompt=5):
    """Logits after `prompt`: a prefill, then one-token cached steps applied with `prepared` kernels."""
    model = GPT(cfg, backend)
    apply = jax.jit(lambda v, x, c: model.apply(v, x, c))
    cache = KVCache.create(cfg, tokens.shape[0], tokens.shape[1], layout=backend.cache_layout)
    _, cache = apply({"params": params}, tokens[:, :prompt], cache)
    step_vars = {"params": params, **({"prepared": prepared} if prepared else {})}
    out = []
    for i in range(prompt, tokens.shape[1]):
        logits, cache = apply(step_vars, tokens[:, i:i + 1], cache)
        out.append(logits[:, 0])
    return jnp.stack(out, axis=1)


# ---------------------------------------------------------------------------------------------------
# The renamed block gets what the built-in one gets

@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan_layers"])
def test_a_renamed_block_trains_its_matrices_with_muon_and_decays_what_the_builtin_decays(scan):
    builtin, renamed = _cfgs(scan_layers=scan)
    p_builtin, p_renamed = init_params(builtin, jax.random.key(0)), init_params(renamed, jax.random.key(0))
    for fn in (muon_dimensions, decay_mask):
        want, got = _by_builtin_path(fn(p_builtin)), _by_builtin_path(fn(p_renamed))
        assert len(want) == len(got) == len(traverse_util.flatten_dict(p_renamed))
        for path, value in want.items():
            assert got[_renamed(path)] == value, (fn.__name__, path)
        assert _by_builtin_path(fn(p_renamed, renamed)) == got  # found from the tree alone, or from the config
    n_matrices = sum(d is not None for d in _by_builtin_path(muon_dimensions(p_renamed)).values())
    assert n_matrices == 4 * (1 if scan else builtin.n_layer)
    # a Muon step: the renamed block's kernels take Muon's orthogonalised update, as the built-in's do
    t = default_config().train
    t.optimizer, t.grad_clip, t.warmup_steps, t.weight_decay, t.muon_lr, t.lr = "muon", 0.0, 0, 0.0, 0.05, 1e-3
    grads = jax.tree.map(lambda x: jnp.asarray(np.random.default_rng(0).normal(size=x.shape), x.dtype), p_builtin)
    updates = {}
    for cfg, params, g in ((builtin, p_builtin, grads), (renamed, p_renamed, None)):
        if g is None:  # the same gradients, leaf for leaf
            flat = _by_builtin_path(grads)
            g = traverse_util.unflatten_dict({_renamed(p): x for p, x in flat.items()})
        opt = make_optimizer(t, cfg)
        u, _ = opt.update(g, opt.init(params), params)
        updates[cfg.block] = _by_builtin_path(u)
    for path, u in updates[builtin.block].items():
        np.testing.assert_allclose(updates[renamed.block][_renamed(path)], u, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan_layers"])
def test_a_renamed_block_takes_lora_by_the_names_its_layers_declare(scan):
    _, cfg = _cfgs(scan_layers=scan)
    params = init_params(cfg, jax.random.key(0))
    spec = LoraSpec(4, 8.0, ("q", "v", "o", "down"))
    adapters = init_adapters(params, cfg, spec, jax.random.key(1))
    block = "h" if scan else "h_0"
    assert set(adapters[block]) == {"attention", "ffn"}
    assert set(adapters[block]["attention"]) == {"qkv", "out"} and set(adapters[block]["ffn"]) == {"down"}
    cols = np.asarray(adapters[block]["attention"]["qkv"]["cols"]).reshape(-1, 64)[0]
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    assert cols[:q].all() and not cols[q:q + kv].any() and cols[q + kv:].all()  # q and v, not k
    tokens = _tokens(cfg)
    base = GPT(cfg).apply({"params": params}, tokens)
    np.testing.assert_array_equal(GPT(cfg).apply({"params": params, "lora": adapters}, tokens), base)
    trained = jax.tree_util.tree_map_with_path(
        lambda p, x: jax.random.normal(jax.random.key(5), x.shape) * 0.3 if p[-1].key == "b" else x, adapters)
    applied = GPT(cfg).apply({"params": params, "lora": trained}, tokens)
    assert float(jnp.abs(applied - base).max()) > 1e-2
    np.testing.assert_allclose(GPT(cfg).apply({"params": merge(params, trained)}, tokens), applied, atol=1e-5)
    with pytest.raises(ValueError, match=r"\['gate'\].*attention\.qkv"):  # no gate in a GELU MLP
        init_adapters(params, cfg, LoraSpec(4, 8.0, ("gate",)), jax.random.key(1))


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan_layers"])
def test_a_renamed_block_decodes_with_the_cpu_backends_packed_weights(scan):
    builtin, cfg = _cfgs(scan_layers=scan)
    params = init_params(cfg, jax.random.key(0))
    tokens = _tokens(cfg)
    prepared = CPU.prepare_decode(params, tokens.shape[0], jnp.float32, cfg.tie_embeddings)
    packed = traverse_util.flatten_dict(prepared)
    kernels = {p for p in traverse_util.flatten_dict(params) if p[-1] == "w"}
    assert set(packed) == kernels | {schema.HEAD} and len(kernels) == 4 * (1 if scan else cfg.n_layer)
    assert all(isinstance(k, PreparedKernel) for k in packed.values())
    # the same leaves as the built-in block's, by position
    want = traverse_util.flatten_dict(CPU.prepare_decode(init_params(builtin, jax.random.key(0)), tokens.shape[0],
                                                         jnp.float32, True))
    assert {_renamed(p) for p in want} == set(packed)
    got = _decode(cfg, CPU, params, tokens, prepared)
    np.testing.assert_allclose(got, _decode(cfg, PORTABLE, params, tokens), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(got, GPT(cfg).apply({"params": params}, tokens)[:, 5:], atol=1e-4, rtol=1e-4)
    # the decode steps multiply the packed kernels, not the stored ones: packed zeros change the logits
    block = "h" if scan else "h_0"
    zeroed = {**params, block: {**params[block], "ffn": jax.tree.map(jnp.zeros_like, params[block]["ffn"])}}
    wrong = CPU.prepare_decode(zeroed, tokens.shape[0], jnp.float32, cfg.tie_embeddings)
    assert float(jnp.abs(_decode(cfg, CPU, params, tokens, wrong) - got).max()) > 1e-3


def test_a_renamed_block_quantizes_to_int8_like_the_builtin():
    builtin, cfg = _cfgs()
    params = init_params(cfg, jax.random.key(0))
    want = Q.quantized_paths(init_params(builtin, jax.random.key(0)), builtin)
    assert Q.quantized_paths(params, cfg) == {_renamed(p): w_out_in for p, w_out_in in want.items()}
    dq = Q.dequantized(params, cfg)
    assert float(jnp.abs(dq["h_0"]["ffn"]["up"]["w"] - params["h_0"]["ffn"]["up"]["w"]).max()) > 0
    np.testing.assert_array_equal(dq["h_0"]["norm1"]["scale"], params["h_0"]["norm1"]["scale"])
    tokens = _tokens(cfg)
    full = GPT(cfg).apply({"params": dq}, tokens)[:, 5:]
    for backend in (PORTABLE, CPU):
        prepared = traverse_util.flatten_dict(backend.prepare_decode(dq, tokens.shape[0], jnp.float32,
                                                                     cfg.tie_embeddings, "int8"))
        assert {p for p in prepared if p != schema.HEAD} == {p for p in Q.quantized_paths(params, cfg) if p[-1] == "w"}
        assert all(isinstance(k, (Q.Int8Kernel, PreparedKernel)) for k in prepared.values())
        prepared = traverse_util.unflatten_dict(prepared)
        np.testing.assert_allclose(_decode(cfg, backend, dq, tokens, prepared), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block", ["gpt2", "parallel"])
def test_a_renamed_block_reports_the_same_flops(block):
    builtin, renamed = _cfgs(block=block, remat="block")
    assert flops_per_token(renamed) == flops_per_token(builtin)
    assert recompute_flops_per_token(renamed, 16) == recompute_flops_per_token(builtin, 16) > 0
    assert recompute_flops_per_token(renamed.replace(remat="dots")) == 0


def test_the_parallel_block_skips_both_projections_in_the_recomputed_flops():
    seq, par = (GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32, remat="block", block=b)
                for b in ("gpt2", "parallel"))
    d = 32
    attn_proj = (d * d + d) * 2  # attention's c_proj, both layers: skipped by the parallel block only
    ln_2 = 2 * d * 2  # the parallel block has one norm
    assert recompute_flops_per_token(seq) - recompute_flops_per_token(par) == 2.0 * (attn_proj + ln_2)


# ---------------------------------------------------------------------------------------------------
# Logical axes and the schema itself

STYLES = {"gpt2": {}, "parallel": {"block": "parallel"}, "llama": {**LLAMA, "tie_embeddings": False},
          "speedrun": {"mlp": "relu2", "embed_skip": True, "value_embeds": 1, "qk_norm": True}}


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan_layers"])
@pytest.mark.parametrize("style", sorted(STYLES))
def test_every_leaf_has_one_logical_axis_per_dimension(style, scan):
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=3, n_head=4, n_kv_head=2, n_embd=32, scan_layers=scan,
                    **STYLES[style])
    params = traverse_util.flatten_dict(abstract_params(cfg))
    flat = traverse_util.flatten_dict(schema.param_schema(cfg))
    assert set(flat) == set(params)
    for path, leaf in params.items():
        info = flat[path]
        assert len(info.axes) == leaf.ndim, (path, info.axes, leaf.shape)
        assert set(info.axes) <= set(schema.AXES), (path, info.axes)
        if info.block:  # (embed_skip [L, 2] also has a layers axis: a weight pair per block)
            assert (info.axes[0] == "layers") == scan, path
    block = ("h",) if scan else ("h_1",)
    lead = ("layers",) if scan else ()
    assert flat[block + ("attn", "c_attn", "kernel")].axes == lead + ("embed", "qkv")
    assert flat[block + ("attn", "c_proj", "kernel")].axes == lead + ("heads", "embed")
    assert flat[block + ("mlp", "c_proj", "kernel")].axes == lead + ("mlp", "embed")
    assert flat[("wte", "embedding")].axes == ("vocab", "embed")
    assert not any(schema.UNNAMED in info.axes for info in flat.values())  # every leaf declared


def test_the_schema_is_computed_once_per_config_without_weights_and_says_what_each_leaf_is():
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_embeddings=False)
    assert schema.param_schema(cfg) == schema.param_schema(cfg)
    hits = schema._layouts.cache_info().hits
    schema.param_schema(cfg)
    assert schema._layouts.cache_info().hits == hits + 1
    flat = traverse_util.flatten_dict(schema.param_schema(cfg))
    head, wte = flat[("lm_head", "kernel")], flat[("wte", "embedding")]
    assert head.role == "matrix" and not head.muon and head.decode and head.decay and not head.block
    assert wte.role == "embedding" and not wte.decode and wte.decay  # untied: only looked up
    ln = flat[("h_0", "ln_1", "scale")]
    assert ln.role == "vector" and not ln.decay and ln.block and ln.hf_name == ("input_layernorm.weight",)
    qkv = flat[("h_0", "attn", "c_attn", "kernel")]
    assert dict(qkv.targets) == {"q": (0, 32), "k": (32, 64), "v": (64, 96)} and len(qkv.hf_name) == 3
    assert flat[("h_0", "mlp", "c_proj", "kernel")].output_only
    assert not flat[("h_0", "attn", "c_proj", "kernel")].output_only  # ln_2 reads it in the gpt2 block
    with pytest.raises(ValueError, match="role"):
        schema.ParamInfo("weights", ("embed",))


def test_a_parameter_declared_with_the_wrong_number_of_axes_is_refused_by_name():
    class Wrong(nn.Module):
        config: GPTConfig
        backend: object
        deterministic: bool = True

        @nn.compact
        def __call__(self, x, positions, cache=None, layer=None):
            w = schema.param(self, "w", nn.initializers.zeros, (x.shape[-1],), jnp.float32, schema.vector("embed"))
            schema.declare(self, "v", schema.vector("embed"))  # a parameter of two dimensions, one axis declared
            v = self.param("v", nn.initializers.zeros, (x.shape[-1], x.shape[-1]), jnp.float32)
            return x * w + x @ v, cache

    BLOCKS.register("wrong_axes")(Wrong)
    try:
        with pytest.raises(ValueError, match=r"h_0/v has 2 dimensions .* logical axes \('embed',\)"):
            schema.param_schema(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32,
                                          block="wrong_axes"))
    finally:
        BLOCKS.unregister("wrong_axes")


def test_a_hand_made_tree_is_read_by_the_builtin_layers_names():
    w = jnp.ones((8, 4))
    tree = {"h_0": {"mlp": {"c_fc": {"kernel": w, "bias": jnp.zeros(4)}}}, "lm_head": {"kernel": w},
            "wte": {"embedding": w}}
    infos = schema.leaf_infos(tree)
    assert infos[("h_0", "mlp", "c_fc", "kernel")].muon and not infos[("lm_head", "kernel")].muon
    assert not infos[("h_0", "mlp", "c_fc", "bias")].decay and infos[("wte", "embedding")].decay
    masked = {**tree, "lm_head": {"kernel": optax.MaskedNode()}}  # optax's placeholders are kept
    assert decay_mask(masked)["lm_head"]["kernel"] == optax.MaskedNode()
