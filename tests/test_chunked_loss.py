"""The chunked loss (train.loss_chunk): the same value and gradients as the loss over the whole logits, for
tied and untied heads, a soft cap, LoRA on the head and chunks that do not divide T; the same train step
(dropout, grad_accum, an FSDP mesh) and eval step; and less compiled memory than the whole logits take."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import GPT, GPTConfig, aot, init_params
from jaxgpt.lora import LoraSpec, init_adapters
from jaxgpt.training import MeshRunner, create_train_state, make_eval_step, make_optimizer, make_train_step
from jaxgpt.training.config import default_config, validate_config
from jaxgpt.training.step import model_loss, model_variables
from tests.helpers import assert_same_training
from tests.xla_flags import AS_USERS_COMPILE

T = 12
needs_aot = pytest.mark.skipif(aot.missing_extra() is not None, reason=f"aot extra: {aot.missing_extra()}")


def _cfg(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=32), **kw})


def _batch(cfg: GPTConfig, rows: int = 3, t: int = T, seed: int = 0):
    d = jax.random.randint(jax.random.key(seed), (rows, t + 1), 0, cfg.vocab_size)
    return d[:, :-1], d[:, 1:]


def _loss_and_grads(cfg, variables, chunk, wrt="params"):
    """The loss and its gradients with respect to one collection of `variables` (the others held)."""
    x, y = _batch(cfg)
    model = GPT(cfg)

    def loss(part):
        return model_loss(model, {**variables, wrt: part}, x, y, chunk)

    return jax.jit(jax.value_and_grad(loss))(variables[wrt])


def _assert_same(got, want):
    (lg, gg), (lw, gw) = got, want
    np.testing.assert_allclose(float(lg), float(lw), rtol=1e-6)
    assert jax.tree_util.tree_structure(gg) == jax.tree_util.tree_structure(gw)
    for a, b in zip(jax.tree_util.tree_leaves(gg), jax.tree_util.tree_leaves(gw)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


# chunks that divide T = 12, leave a partial chunk, or exceed T; each with a tied and an untied head, and
# every pair of (tied, soft-capped) values once (the chunking does not depend on the head)
@pytest.mark.parametrize("chunk, tie, softcap", [(4, True, 0.0), (4, False, 3.0), (5, True, 3.0), (5, False, 0.0),
                                                 (64, True, 0.0), (64, False, 3.0)])
def test_chunked_loss_and_gradients_equal_the_whole_logits(chunk, tie, softcap):
    cfg = _cfg(tie_embeddings=tie, logit_softcap=softcap)
    variables = {"params": init_params(cfg, jax.random.key(0))}
    _assert_same(_loss_and_grads(cfg, variables, chunk), _loss_and_grads(cfg, variables, 0))


def test_chunked_loss_trains_lora_adapters_on_the_head_the_same():
    cfg = _cfg(tie_embeddings=False, logit_softcap=3.0)
    base = init_params(cfg, jax.random.key(0))
    adapters = init_adapters(base, cfg, LoraSpec(4, 8.0, ("c_attn", "lm_head")), jax.random.key(1))
    adapters = jax.tree_util.tree_map_with_path(  # b no longer zero, as after some training
        lambda p, a: jax.random.normal(jax.random.key(2), a.shape) * 0.3 if p[-1].key == "b" else a, adapters)
    assert "lm_head" in adapters
    variables = model_variables(adapters, base)
    _assert_same(_loss_and_grads(cfg, variables, 5, wrt="lora"), _loss_and_grads(cfg, variables, 0, wrt="lora"))


def test_hidden_then_head_is_the_full_forward():
    cfg = _cfg(tie_embeddings=False, logit_softcap=3.0)
    variables = {"params": init_params(cfg, jax.random.key(0))}
    x, _ = _batch(cfg)
    model = GPT(cfg)
    h = model.apply(variables, x, hidden=True)
    assert h.shape == (3, T, cfg.n_embd)
    np.testing.assert_array_equal(np.asarray(model.apply(variables, h, method=GPT.head)),
                                  np.asarray(model.apply(variables, x)))


def _train_cfg():
    t = default_config().train
    t.warmup_steps = 0
    t.lr = 1e-2
    return t


def test_the_train_step_with_dropout_and_grad_accum_is_the_same():
    cfg = _cfg(dropout=0.1)
    opt = make_optimizer(_train_cfg())
    state = create_train_state(init_params(cfg, jax.random.key(0)), opt, jax.random.key(1))
    x, y = _batch(cfg, rows=4)
    whole, mw = jax.jit(make_train_step(cfg, opt, 2))(state, x, y)
    chunked, mc = jax.jit(make_train_step(cfg, opt, 2, loss_chunk=5))(state, x, y)
    np.testing.assert_allclose(float(mc["loss"]), float(mw["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(mc["grad_norm"]), float(mw["grad_norm"]), rtol=1e-5)
    assert_same_training(chunked, whole, atol=1e-6, what="chunked")


def test_the_eval_step_is_the_same():
    cfg = _cfg()
    params = init_params(cfg, jax.random.key(0))
    x, y = _batch(cfg, rows=4)
    evals = [float(jax.jit(make_eval_step(cfg, loss_chunk=c))(params, x, y)) for c in (0, 5)]
    np.testing.assert_allclose(evals[1], evals[0], rtol=1e-6)


def test_an_fsdp_mesh_step_with_the_chunked_loss_is_the_same():
    cfg = _cfg()
    opt = make_optimizer(_train_cfg())
    state = create_train_state(init_params(cfg, jax.random.key(0)), opt, jax.random.key(1))
    x, y = (np.asarray(a) for a in _batch(cfg, rows=8))
    _, want = jax.jit(make_train_step(cfg, opt))(state, x, y)
    runner = MeshRunner(cfg, opt, fsdp=True, loss_chunk=5)
    _, got = runner.step(runner.put_state(state), x, y)
    np.testing.assert_allclose(float(runner.to_host(got)["loss"]), float(want["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(runner.to_host(got)["grad_norm"]), float(want["grad_norm"]), rtol=1e-5)


def test_a_bad_loss_chunk_is_refused_naming_the_key():
    opt = make_optimizer(_train_cfg())
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="train.loss_chunk"):
            make_train_step(_cfg(), opt, loss_chunk=bad)
    c = default_config()  # (the ConfigDict itself refuses a float for this int key)
    c.train.loss_chunk = -1
    with pytest.raises(ValueError, match="train.loss_chunk"):
        validate_config(c)


def test_chunks_take_less_compiled_memory_than_the_whole_logits():
    # vocab 4096, 4 rows of 64: the whole float32 logits alone are 4 MiB (and softmax temporaries as much
    # again); chunks of 16 positions hold a quarter of that at a time, forward and backward (about a third
    # of the whole's temporaries; chunks whose logits the backward keeps, without jax.checkpoint, ~80%)
    cfg = GPTConfig(vocab_size=4096, block_size=64, n_layer=1, n_head=2, n_embd=32)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((4, 64), jnp.int32)
    model = GPT(cfg)

    def temp_bytes(chunk):
        grad = jax.grad(lambda p, x, y: model_loss(model, {"params": p}, x, y, chunk))
        return jax.jit(grad).lower(params, tokens, tokens).compile(AS_USERS_COMPILE).memory_analysis().temp_size_in_bytes

    whole, chunked = temp_bytes(0), temp_bytes(16)
    logits_bytes = 4 * 64 * 4096 * 4
    assert whole > logits_bytes, (whole, chunked)
    assert chunked < whole // 2, (whole, chunked)


@needs_aot
def test_jaxgpt_aot_compiles_the_chunked_step_for_a_tpu_in_less_memory_than_the_logits():
    # 8 rows of 128 per chip: the whole float32 logits are 64 MiB per chip (the step with them peaks at
    # about 105 MiB), chunks of 32 positions 16 MiB
    aot.prepare_environment()
    c = default_config()
    c.train.parallel, c.train.fsdp, c.train.batch_size, c.train.loss_chunk = "mesh", True, 32, 32
    c.model.block_size, c.model.n_layer, c.model.n_head, c.model.n_embd = 128, 1, 2, 32
    train = aot.compile_for_target(c, aot.parse_target("tpu:v5e:2x2"), vocab_size=16384, programs=("train",),
                                   progress=False)["programs"]["train"]
    assert train["loss_chunk"] == 32 and train["flops_ratio"] is None  # (XLA counts one chunk's flops)
    assert train["peak_bytes"] < 8 * 128 * 16384 * 4, train["peak_bytes"]
