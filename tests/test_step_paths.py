"""One step, three paths: PmapRunner's pmap, the same per-device step under shard_map (its jitted_step,
what jaxgpt-aot compiles for a pmap config) and MeshRunner's jit give the same update, for one step and
for the K-step program; and the state the loop starts from is the one jaxgpt-aot lowers (4 CPU devices)."""

import time

import jax
import numpy as np
import pytest

from jaxgpt import GPTConfig, aot, init_params
from jaxgpt.training import MeshRunner, PmapRunner, create_train_state, make_optimizer
from jaxgpt.training.config import default_config
from jaxgpt.training.loop import _Run
from tests.helpers import assert_same_training, tiny_config

CFG = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _batches(k: int, b: int = 8, t: int = 16):
    """k batches x, y [k, b, t]."""
    x = np.random.default_rng(k).integers(0, CFG.vocab_size, (k, b, t + 1)).astype(np.int32)
    return x[..., :-1], x[..., 1:]


@pytest.fixture(scope="module")
def setup():
    t = default_config().train
    t.warmup_steps = 0  # lr > 0 from the first step: the update depends on the gradient
    opt = make_optimizer(t)
    state = create_train_state(init_params(CFG, jax.random.key(0)), opt, jax.random.key(1))
    return opt, state, PmapRunner(CFG, opt), MeshRunner(CFG, opt)


def _copy(state):
    return jax.tree.map(lambda v: v.copy(), state)  # (every path donates its state)


@pytest.mark.parametrize("many", [False, True], ids=["one step", "K steps"])
def test_pmap_its_shard_map_form_and_the_mesh_give_the_same_update(setup, many):
    _, state0, pm, mesh = setup
    assert pm.n == mesh.n == 4, "conftest sets four fake CPU devices"
    xs, ys = _batches(2)
    if not many:
        xs, ys = xs[0], ys[0]
    ran = {}
    s, m = (pm.steps if many else pm.step)(pm.put_state(_copy(state0)), xs, ys)
    ran["pmap"] = pm.get_state(s), pm.to_host(m)["loss"]
    put = lambda a: jax.device_put(a, pm.stack_sharding if many else pm.batch_sharding)  # noqa: E731
    start = jax.device_put(_copy(state0), pm.state_shardings(state0))
    s, m = pm.jitted_step(start, many=many)(start, put(xs), put(ys))
    ran["pmap as shard_map"] = s, np.asarray(m["loss"])
    s, m = (mesh.steps if many else mesh.step)(mesh.put_state(_copy(state0)), xs, ys)
    ran["mesh"] = s, mesh.to_host(m)["loss"]
    want, want_loss = ran["pmap"]
    assert np.shape(want_loss) == ((2,) if many else ())
    assert int(want.step) == (2 if many else 1)
    for name in ("pmap as shard_map", "mesh"):
        got, loss = ran[name]
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6, err_msg=name)
        assert int(got.step) == int(want.step)
        assert_same_training(got, want, atol=1e-6, what=f"{name} vs pmap")


def _abstract(tree):
    return jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), tree)


@pytest.mark.parametrize("lora", [0, 2], ids=["plain", "lora"])
def test_the_loop_and_aot_start_from_the_same_state(tmp_path, monkeypatch, lora):
    c = tiny_config(tmp_path, parallel="pmap")
    c.model.kernels = "portable"
    c.train.lora.rank = lora
    run = _Run(c, c.out_dir, 4, time.time())
    run.build()  # (data from the tiny corpus, the model, the runner: no step runs)
    # (a LoRA run's base would come from init_from; from scratch the loop's builder makes one of its shapes)
    loop_state = jax.eval_shape(run.make_state, *run.init_args)
    if lora:
        c.init_from = str(tmp_path / "base")  # what validation asks of a LoRA config (aot reads no weights)

    lowered = []

    class Captured(Exception):
        pass

    def capture(program, lower, devs, progress):
        lowered.append(lower())
        raise Captured

    monkeypatch.setattr(aot.programs, "_compile", capture)  # (where the compilers look it up)
    # the fake CPU devices stand in for a target's: the step is lowered, never compiled
    devs = aot.Devices(aot.parse_target("gpu:h100:4"), jax.devices()[:4], "cpu", 0, 0)
    with pytest.raises(Captured):
        aot.compile_train_step(c, devs, run.gcfg.vocab_size, progress=False)
    (aot_state, _, _), _ = lowered[0].args_info
    assert jax.tree.structure(aot_state) == jax.tree.structure(loop_state)
    assert _abstract(aot_state) == _abstract(loop_state)
    assert (loop_state.frozen is not None) == bool(lora)
