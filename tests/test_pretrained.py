"""GPT-2 import/export with numpy and safetensors only: checkpoints are built here, in GPT-2's layout."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxgpt import GPT, GPTConfig, init_params
from jaxgpt.pretrained import from_pretrained, save_pretrained

V, P, D, L, N = 61, 16, 16, 2, 2  # vocab, positions, width, layers, heads


def hf_config(**kw):
    """A config.json as the Hub's gpt2 has it (n_ctx included), at a tiny size."""
    c = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], activation_function="gelu_new",
             vocab_size=V, n_positions=P, n_ctx=P, n_embd=D, n_layer=L, n_head=N,
             layer_norm_epsilon=1e-4, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
             bos_token_id=0, eos_token_id=0)
    c.update(kw)
    return c


def gpt2_tensors(seed=0):
    """Random GPT-2 tensors, named as in the Hub's gpt2 model.safetensors (no prefix, with buffers)."""
    rng = np.random.default_rng(seed)
    r = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(np.float32)
    t = {"wte.weight": r(V, D), "wpe.weight": r(P, D), "ln_f.weight": 1 + r(D), "ln_f.bias": r(D)}
    for i in range(L):
        t.update({f"h.{i}.ln_1.weight": 1 + r(D), f"h.{i}.ln_1.bias": r(D),
                  f"h.{i}.attn.c_attn.weight": r(D, 3 * D), f"h.{i}.attn.c_attn.bias": r(3 * D),
                  f"h.{i}.attn.c_proj.weight": r(D, D), f"h.{i}.attn.c_proj.bias": r(D),
                  f"h.{i}.ln_2.weight": 1 + r(D), f"h.{i}.ln_2.bias": r(D),
                  f"h.{i}.mlp.c_fc.weight": r(D, 4 * D), f"h.{i}.mlp.c_fc.bias": r(4 * D),
                  f"h.{i}.mlp.c_proj.weight": r(4 * D, D), f"h.{i}.mlp.c_proj.bias": r(D),
                  # the causal-mask buffers older transformers versions saved
                  f"h.{i}.attn.bias": np.tril(np.ones((P, P), np.float32))[None, None],
                  f"h.{i}.attn.masked_bias": np.array(-1e4, np.float32)})
    return t


def write(folder, tensors, config=None, prefix=""):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config() if config is None else config))
    save_file({prefix + k: v for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def numpy_gpt2(t, tokens, eps=1e-4):
    """GPT-2's forward in float64 numpy: the meaning of each tensor, independent of jaxgpt."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    b, s = tokens.shape
    h = D // N

    def ln(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * t[name + ".weight"] + t[name + ".bias"]

    def linear(x, name):
        return x @ t[name + ".weight"] + t[name + ".bias"]

    x = t["wte.weight"][tokens] + t["wpe.weight"][:s]
    causal = np.tril(np.ones((s, s), bool))
    for i in range(L):
        q, k, v = np.split(linear(ln(x, f"h.{i}.ln_1"), f"h.{i}.attn.c_attn"), 3, axis=-1)
        q, k, v = (a.reshape(b, s, N, h) for a in (q, k, v))
        scores = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(h)
        scores = np.where(causal, scores, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        x = x + linear(np.einsum("bnqk,bknh->bqnh", w, v).reshape(b, s, D), f"h.{i}.attn.c_proj")
        m = linear(ln(x, f"h.{i}.ln_2"), f"h.{i}.mlp.c_fc")
        m = 0.5 * m * (1 + np.tanh(np.sqrt(2 / np.pi) * (m + 0.044715 * m ** 3)))
        x = x + linear(m, f"h.{i}.mlp.c_proj")
    return ln(x, "ln_f") @ t["wte.weight"].T


def logits(cfg, params, tokens):
    return np.asarray(jax.jit(GPT(cfg).apply)({"params": params}, jnp.asarray(tokens)))


def random_params(cfg, seed=0):
    """Random numpy params of jaxgpt's shapes (larger than init, so a misplaced tensor would show)."""
    rng = np.random.default_rng(seed)
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    return jax.tree_util.tree_map(lambda x: (rng.standard_normal(x.shape) * 0.3).astype(np.float32),
                                  abstract)


def assert_trees_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def tensors():
    return gpt2_tensors()


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(1).integers(0, V, (2, P))


def test_import_matches_numpy_gpt2_and_reads_config(tmp_path, tensors, tokens):
    cfg, params = from_pretrained(write(tmp_path / "gpt2", tensors))
    assert cfg == GPTConfig(vocab_size=V, block_size=P, n_layer=L, n_head=N, n_embd=D,
                            layer_norm_epsilon=1e-4, dropout=0.0)
    np.testing.assert_array_equal(params["h_1"]["attn"]["c_attn"]["kernel"],
                                  tensors["h.1.attn.c_attn.weight"])
    np.testing.assert_array_equal(params["h_0"]["ln_2"]["scale"], tensors["h.0.ln_2.weight"])
    np.testing.assert_allclose(logits(cfg, params, tokens), numpy_gpt2(tensors, tokens), atol=1e-4)


def test_prefix_and_shards_load_the_same(tmp_path, tensors):
    _, plain = from_pretrained(write(tmp_path / "plain", tensors))
    _, prefixed = from_pretrained(write(tmp_path / "prefixed", tensors, prefix="transformer."))
    assert_trees_equal(plain, prefixed)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(hf_config()))
    names = sorted(tensors)
    weight_map = {}
    for j, part in enumerate((names[::2], names[1::2])):
        shard = f"model-0000{j + 1}-of-00002.safetensors"
        save_file({"transformer." + k: tensors[k] for k in part}, str(sharded / shard))
        weight_map.update({"transformer." + k: shard for k in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_trees_equal(plain, from_pretrained(sharded)[1])


def test_overrides_and_block_size_crop(tmp_path, tensors):
    folder = write(tmp_path / "gpt2", tensors)
    cfg, params = from_pretrained(folder, dtype="bfloat16", attention="dot_product", dropout=0.1,
                                  block_size=8)
    assert (cfg.dtype, cfg.attention, cfg.dropout, cfg.block_size) == ("bfloat16", "dot_product", 0.1, 8)
    np.testing.assert_array_equal(params["wpe"]["embedding"], tensors["wpe.weight"][:8])
    cfg, params = from_pretrained(folder, param_dtype="bfloat16")
    assert params["wte"]["embedding"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="exceeds the checkpoint's n_positions"):
        from_pretrained(folder, block_size=P + 1)
    with pytest.raises(ValueError, match="GPTConfig.attention"):
        from_pretrained(folder, attention="flash")


def test_export_round_trip_is_exact(tmp_path, tensors):
    cfg, params = from_pretrained(write(tmp_path / "in", tensors))
    out = save_pretrained(params, cfg, tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "gpt2" and written["layer_norm_epsilon"] == 1e-4
    cfg2, params2 = from_pretrained(out)
    assert cfg2 == cfg
    assert_trees_equal(params, params2)


def test_export_of_gqa_untied_biasless_model_is_the_same_function(tmp_path, tokens):
    cfg = GPTConfig(vocab_size=V, block_size=P, n_layer=L, n_head=4, n_kv_head=2, n_embd=D,
                    bias=False, tie_embeddings=False)
    params = random_params(cfg)
    cfg2, params2 = from_pretrained(save_pretrained({"params": params}, cfg, tmp_path / "out"))
    assert (cfg2.n_kv_head, cfg2.bias, cfg2.tie_embeddings) == (4, True, False)
    np.testing.assert_allclose(logits(cfg2, params2, tokens), logits(cfg, params, tokens), atol=1e-5)


def test_export_rejects_params_that_do_not_fit_the_config(tmp_path):
    cfg = GPTConfig(vocab_size=V, block_size=P, n_layer=L, n_head=N, n_embd=D)
    params = random_params(cfg)
    with pytest.raises(ValueError, match="wte/embedding has shape"):
        save_pretrained(params, cfg.replace(vocab_size=V + 1), tmp_path / "a")
    with pytest.raises(ValueError, match="h_2"):
        save_pretrained(params, cfg.replace(n_layer=L + 1), tmp_path / "b")


def test_bad_folders_raise_clear_errors(tmp_path, tensors):
    with pytest.raises(FileNotFoundError, match="neither a folder nor one of the GPT-2 names"):
        from_pretrained(tmp_path / "nowhere")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(hf_config()))
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors.*pytorch_model.bin"):
        from_pretrained(no_weights)
    no_config = tmp_path / "no_config"
    write(no_config, tensors)
    (no_config / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(no_config)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="bert"), "model_type='bert'; jaxgpt imports 'gpt2' and 'llama'"),
    (dict(activation_function="relu"), "activation_function='relu'"),
    (dict(n_inner=3 * D), "n_inner=48"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (dict(n_head=3), "GPTConfig.n_embd"),
])
def test_configs_that_are_not_gpt2_are_rejected(tmp_path, tensors, change, message):
    with pytest.raises(ValueError, match=message):
        from_pretrained(write(tmp_path / "x", tensors, hf_config(**change)))


def test_tensors_that_disagree_with_the_config_are_rejected(tmp_path, tensors):
    with pytest.raises(ValueError, match=r"'wte.weight' has shape \(61, 16\).*implies \(62, 16\)"):
        from_pretrained(write(tmp_path / "vocab", tensors, hf_config(vocab_size=V + 1)))
    with pytest.raises(ValueError, match="lacks 12 tensors.*'h.2.attn.c_attn.bias'"):
        from_pretrained(write(tmp_path / "layers", tensors, hf_config(n_layer=L + 1)))
    extra = dict(tensors, **{"h.0.crossattention.c_attn.weight": tensors["h.0.attn.c_attn.weight"]})
    with pytest.raises(ValueError, match="does not use: 'h.0.crossattention"):
        from_pretrained(write(tmp_path / "extra", extra))


def test_gpt2_name_offline_is_a_clear_error(tmp_path, monkeypatch):
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="could not download 'gpt2'.*pass its path"):
        from_pretrained("gpt2", cache_dir=tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ImportError, match=r"jaxgpt\[hf\]"):
        from_pretrained("gpt2-xl", cache_dir=tmp_path)


def test_truncated_weights_and_a_file_as_the_export_folder_are_clear_errors(tmp_path, tensors):
    folder = write(tmp_path / "cut", tensors)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # a download that stopped early
    with pytest.raises(ValueError, match=r"model\.safetensors' is not a readable safetensors file .*truncated"):
        from_pretrained(folder)
    cfg = GPTConfig(vocab_size=V, block_size=P, n_layer=L, n_head=N, n_embd=D)
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="is a file; save_pretrained writes a folder"):
        save_pretrained(random_params(cfg), cfg, tmp_path / "a_file")
    with pytest.raises(ValueError, match="cannot create the folder"):
        save_pretrained(random_params(cfg), cfg, tmp_path / "a_file" / "inside")
