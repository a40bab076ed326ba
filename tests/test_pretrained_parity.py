"""Parity with Hugging Face transformers' GPT-2 (PyTorch, CPU): import, greedy decoding, export.

Needs the `torch` extra: pip install torch==2.13.0 && pip install -e ".[torch]".
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import GPT, GPTConfig, generate, init_params
from jaxgpt.pretrained import from_nanogpt, from_pretrained, save_pretrained

torch = transformers = None  # imported when this file's first test runs, not at collection (2 s a process)


@pytest.fixture(scope="module", autouse=True)
def _torch_and_transformers():
    global torch, transformers
    torch = pytest.importorskip("torch", reason="parity tests need the torch extra: pip install torch==2.13.0")
    transformers = pytest.importorskip(
        "transformers", reason="parity tests need the torch extra: pip install -e '.[torch]'")

V, P = 97, 64


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def jax_logits(cfg, params, tokens):
    return np.asarray(jax.jit(GPT(cfg).apply)({"params": params}, jnp.asarray(tokens)))


@pytest.fixture(scope="module")
def hf_model():
    """A small random GPT2LMHeadModel with every tensor randomised (biases and LayerNorms included)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_positions=P, n_embd=32, n_layer=2, n_head=4,
                                     layer_norm_epsilon=1e-4, bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def imported(hf_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_gpt2")
    hf_model.save_pretrained(folder)
    return from_pretrained(folder)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, V, (3, 48))


def test_imported_logits_match_transformers(hf_model, imported, tokens):
    cfg, params = imported
    assert cfg.layer_norm_epsilon == 1e-4 and cfg.block_size == P and cfg.vocab_size == V
    ours, theirs = jax_logits(cfg, params, tokens), hf_logits(hf_model, tokens)
    diff = np.abs(ours - theirs).max()
    print(f"\nimport: max |logit diff| vs transformers = {diff:.3g} (logit scale {np.abs(theirs).max():.3g})")
    assert diff <= 1e-4


def test_greedy_generation_matches_transformers(hf_model, imported, tokens):
    cfg, params = imported
    prompts = tokens[:, :8]
    ours = generate(params, cfg, prompts, 32, jax.random.key(0), temperature=0).tokens
    with torch.no_grad():
        theirs = hf_model.generate(torch.as_tensor(prompts, dtype=torch.long),
                                   attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                                   max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                   pad_token_id=0).numpy()
    assert theirs.shape == (3, 40)
    np.testing.assert_array_equal(np.asarray(ours), theirs)


@pytest.mark.parametrize("kw", [dict(), dict(n_kv_head=2, bias=False, tie_embeddings=False), dict(mlp="relu2")],
                         ids=["gpt2", "gqa_nobias_untied", "relu2"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, tokens, kw):
    cfg = GPTConfig(vocab_size=V, block_size=P, n_layer=2, n_head=4, n_embd=32, **kw)
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map(
        lambda x: (rng.standard_normal(x.shape) * 0.3).astype(np.float32),
        jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))))
    folder = save_pretrained(params, cfg, tmp_path / "export")
    model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    ours, theirs = jax_logits(cfg, params, tokens), hf_logits(model, tokens)
    diff = np.abs(ours - theirs).max()
    print(f"\nexport {kw}: max |logit diff| vs transformers = {diff:.3g}")
    assert diff <= 1e-4


def test_export_of_an_imported_model_reloads_in_transformers(hf_model, imported, tokens, tmp_path):
    cfg, params = imported
    model = transformers.GPT2LMHeadModel.from_pretrained(save_pretrained(params, cfg, tmp_path)).eval()
    for (name, a), (_, b) in zip(hf_model.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    np.testing.assert_array_equal(hf_logits(model, tokens), hf_logits(hf_model, tokens))


def test_nanogpt_checkpoint_imports_like_the_hf_folder(hf_model, imported, tmp_path):
    # nanoGPT names its tensors as GPT-2 does, but stores nn.Linear weights [out, in], may carry
    # torch.compile's "_orig_mod." prefix and the mask buffers, and keeps a tied lm_head.weight.
    state = {}
    for name, t in hf_model.state_dict().items():
        if any(name.endswith(f"{m}.weight") for m in ("c_attn", "c_proj", "c_fc")):
            t = t.T.contiguous()
        state["_orig_mod." + name] = t
    state["_orig_mod.transformer.h.0.attn.bias"] = torch.tril(torch.ones(P, P)).view(1, 1, P, P)
    args = dict(n_layer=2, n_head=4, n_embd=32, block_size=P, bias=True, vocab_size=V, dropout=0.0)
    torch.save({"model": state, "model_args": args, "iter_num": 5, "config": {"dataset": "x"}},
               tmp_path / "ckpt.pt")
    cfg, params = from_nanogpt(tmp_path)
    want_cfg, want = imported
    assert cfg == want_cfg.replace(layer_norm_epsilon=1e-5)
    for x, y in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="not a nanoGPT checkpoint"):
        torch.save({"state_dict": state}, tmp_path / "other.pt")
        from_nanogpt(tmp_path / "other.pt")
