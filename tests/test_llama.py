"""Llama-style options: rotary positions, RMSNorm and SwiGLU against references, and the properties every
model keeps (resume exact, pmap = mesh); parity with transformers' LlamaForCausalLM needs the torch extra."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import jaxgpt
import pytest

from jaxgpt import GPT, GPTConfig, generate, init_params
from jaxgpt.attention import rotary_embedding
from jaxgpt.training.config import default_config
from jaxgpt.model import count_params
from jaxgpt.training import MeshRunner, PmapRunner, create_train_state, make_optimizer, train
from tests.helpers import LLAMA, assert_same_training, tiny_config

CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, **LLAMA)


def test_rotary_embedding_equals_a_loop_reference_and_depends_only_on_distance():
    x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
    pos = jnp.array([[0, 3, 7, 100, 2]])
    got = np.asarray(rotary_embedding(x, pos, 10000.0))
    want = np.zeros_like(got)
    for t in range(5):
        for i in range(4):  # the pair (i, i + 4) turns by pos / 10000^(2i/8)
            a = float(pos[0, t]) / 10000.0 ** (2 * i / 8)
            c, s = np.cos(a), np.sin(a)
            x1, x2 = np.asarray(x[0, t, :, i]), np.asarray(x[0, t, :, i + 4])
            want[0, t, :, i], want[0, t, :, i + 4] = x1 * c - x2 * s, x2 * c + x1 * s
    np.testing.assert_allclose(got, want, atol=1e-5)
    q, k = jax.random.normal(jax.random.key(1), (2, 1, 1, 1, 8))

    def score(pq, pk):
        return float(jnp.sum(rotary_embedding(q, jnp.array([[pq]]), 1e4) * rotary_embedding(k, jnp.array([[pk]]), 1e4)))

    assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-5) != pytest.approx(score(5, 3), abs=1e-3)


def test_llama_parameter_tree_and_counts():
    params = init_params(CFG, jax.random.key(0))
    assert "wpe" not in params and "lm_head" in params
    layer = params["h_0"]
    assert set(layer["mlp"]) == {"c_fc", "c_gate", "c_proj"} and set(layer["ln_1"]) == {"scale"}
    assert layer["mlp"]["c_gate"]["kernel"].shape == (64, CFG.mlp_hidden) and CFG.mlp_hidden == 192
    d, kv, f = 64, 2 * 16, CFG.mlp_hidden
    per_layer = d * (d + 2 * kv) + d * d + 3 * d * f + 2 * d
    assert count_params(params) == jaxgpt.num_params(CFG, non_embedding=False) == 2 * 256 * d + 2 * per_layer + d
    assert jaxgpt.num_params(CFG) == 256 * d + 2 * per_layer + d  # the token table is only looked up
    assert jaxgpt.flops_per_token(CFG, 64) == 6 * jaxgpt.num_params(CFG) + 12 * 2 * 64 * 64


@pytest.mark.parametrize("kw,match", [
    (dict(position="alibi"), "position"), (dict(norm="batchnorm"), "norm"), (dict(mlp="relu"), "mlp"),
    (dict(rope_theta=0.5), "rope_theta"), (dict(mlp_hidden=0), "mlp_hidden"),
    (dict(n_embd=60, n_head=4, position="rope"), "even head dimension"),
])
def test_option_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**dict(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=16), **kw})


def _llama_train_config(tmp_path, **train):
    c = tiny_config(tmp_path, **train)
    for k, v in LLAMA.items():
        c.model[k] = v
    c.model.n_kv_head = 1
    return c


def _losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_llama_style_resume_gives_the_same_losses(tmp_path):
    kw = dict(decay_steps=8, warmup_steps=2, log_interval=1, checkpoint_interval=4, eval_interval=4)
    full = _llama_train_config(tmp_path / "a", max_steps=8, **kw)
    train(full)
    half = _llama_train_config(tmp_path / "b", max_steps=4, **kw)
    train(half)
    half.init_from, half.train.max_steps = "resume", 8
    assert train(half)["start_step"] == 4
    a, b = _losses(full.out_dir), _losses(half.out_dir)
    assert sorted(a) == sorted(b) == list(range(1, 9)) and [a[k] for k in a] == [b[k] for k in a]


def test_llama_style_pmap_equals_mesh():
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32, **LLAMA)
    tcfg = default_config().train
    tcfg.warmup_steps = 0
    opt = make_optimizer(tcfg)
    start = jax.device_get(init_params(cfg, jax.random.key(0)))
    tokens = np.random.default_rng(0).integers(0, 50, (3, 8, 17)).astype(np.int32)
    out = {}
    for runner in (PmapRunner(cfg, opt, devices=jax.devices()[:4]), MeshRunner(cfg, opt, devices=jax.devices()[:4])):
        s = runner.put_state(create_train_state(jax.tree.map(jnp.asarray, start), opt, jax.random.key(1)))
        for batch in tokens:
            s, metrics = runner.step(s, batch[:, :-1], batch[:, 1:])
        out[runner.name] = jax.device_get(runner.get_state(s))
    assert_same_training(out["mesh"], out["pmap"], atol=1e-6, what="mesh")
    moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(out["pmap"].params),
                                                            jax.tree.leaves(start)))
    assert moved > 1e-3


def test_llama_config_trains_with_the_same_budget_as_gpt2():
    from configs import llama_char_cpu, shakespeare_char_cpu

    llama, gpt2 = llama_char_cpu.get_config(), shakespeare_char_cpu.get_config()
    assert (llama.model.position, llama.model.norm, llama.model.mlp) == ("rope", "rmsnorm", "swiglu")
    for key in ("block_size", "n_layer", "n_head", "n_embd"):
        assert llama.model[key] == gpt2.model[key]
    assert llama.train.to_dict() == gpt2.train.to_dict() and llama.data.to_dict() == gpt2.data.to_dict()


# ---------------------------------------------------------------------------------------------------
# Parity with transformers (torch extra)

@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    torch = pytest.importorskip("torch", reason="parity tests need the torch extra")
    transformers = pytest.importorskip("transformers", reason="parity tests need the torch extra")
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500.0,
                                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # RMSNorm weights away from 1, so that a misplaced norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder, max_shard_size="100KB")  # sharded: an index and several files
    return torch, transformers, model, folder


def _hf_logits(torch, model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def test_llama_import_matches_transformers_logits_and_greedy_tokens(hf_llama):
    torch, _, model, folder = hf_llama
    assert (folder / "model.safetensors.index.json").exists()
    cfg, params = __import__("jaxgpt").from_pretrained(folder)
    assert (cfg.position, cfg.norm, cfg.mlp, cfg.n_kv_head, cfg.rope_theta, cfg.mlp_hidden) == \
        ("rope", "rmsnorm", "swiglu", 2, 500.0, 160)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 40))
    ours = np.asarray(GPT(cfg).apply({"params": params}, jnp.asarray(tokens)))
    np.testing.assert_allclose(ours, _hf_logits(torch, model, tokens), atol=1e-4, rtol=0)
    prompt = tokens[:1, :8]
    with torch.no_grad():
        theirs = model.generate(torch.as_tensor(prompt), attention_mask=torch.ones(1, 8, dtype=torch.long),
                                do_sample=False, max_new_tokens=24, min_new_tokens=24, pad_token_id=0).numpy()
    got = generate(params, cfg, prompt, 24, jax.random.key(0), temperature=0.0)
    np.testing.assert_array_equal(np.asarray(got.tokens), theirs)


def test_llama_export_round_trip_is_exact(hf_llama, tmp_path):
    torch, transformers, model, folder = hf_llama
    from jaxgpt.pretrained import from_pretrained, save_pretrained

    cfg, params = from_pretrained(folder)
    save_pretrained(params, cfg, tmp_path / "out")
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    want, got = model.state_dict(), again.state_dict()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    tokens = np.random.default_rng(1).integers(0, 256, (1, 16))
    np.testing.assert_array_equal(_hf_logits(torch, again, tokens), _hf_logits(torch, model, tokens))


def test_export_refuses_a_mix_no_hugging_face_class_computes(tmp_path):
    from jaxgpt.pretrained import save_pretrained

    cfg = GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=16, position="rope")
    with pytest.raises(ValueError, match="no Hugging Face architecture"):
        save_pretrained(init_params(cfg, jax.random.key(0)), cfg, tmp_path / "x")
