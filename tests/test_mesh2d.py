"""Meshes past one axis (train.mesh, issue 23): the strings, a 2-D data x fsdp mesh and a dcn x data mesh
training as one device does on the four fake CPU devices, where the state lives on them, checkpoints
across meshes, the tpu backend's splash kernel under shard_map, and train.mesh through train()."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxgpt import GPTConfig, init_params
from jaxgpt.backends import resolve
from jaxgpt.checkpoint import Checkpointer, abstract_like
from jaxgpt.training import MeshRunner, create_train_state, make_optimizer, train
from jaxgpt.training.config import default_config, parallel_mode, validate_config
from jaxgpt.training.mesh import build_mesh, mesh_sizes, parse_mesh
from tests.helpers import assert_same_training, tiny_config

CFG = GPTConfig(vocab_size=48, block_size=16, n_layer=1, n_head=2, n_embd=32, bias=False, kernels="portable")
STEPS = 3


def _opt():
    t = default_config().train
    t.warmup_steps, t.max_steps = 1, 10
    return make_optimizer(t)


OPT = _opt()


def _batches(n=STEPS, rows=8):
    r = np.random.default_rng(0)
    tokens = [r.integers(0, CFG.vocab_size, (rows, CFG.block_size + 1)).astype(np.int32) for _ in range(n)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _state():
    return create_train_state(init_params(CFG, jax.random.key(0)), OPT, jax.random.key(1))


def _run(runner, steps=STEPS):
    """(losses of `steps` steps, the state after them) from the same initial state and batches."""
    state = runner.init_state(_state)
    losses = []
    for x, y in _batches(steps):
        state, metrics = runner.step(state, x, y)
        losses.append(float(runner.to_host(metrics)["loss"]))
    return np.array(losses), state


@pytest.fixture(scope="module")
def one_device():
    return _run(MeshRunner(CFG, OPT, devices=jax.devices()[:1]))


def test_mesh_strings_and_their_errors():
    assert parse_mesh("fsdp=2, data=-1") == (("data", -1), ("fsdp", 2))  # laid out dcn, data, fsdp
    assert mesh_sizes("dcn=2,data=-1,fsdp=2", 8) == (("dcn", 2), ("data", 2), ("fsdp", 2))
    assert mesh_sizes("data=4", 4) == (("data", 4),)
    bad = {"data": "not AXIS=SIZE", "data=2;fsdp=2": "got '2;fsdp=2'", "model=2": "unknown axis 'model'",
           "data=2,data=2": "appears twice", "data=-1,fsdp=-1": "at most one axis", "data=0": "positive integer",
           "data=x": "positive integer", "data=2,fsdp=4": "mesh of 8 devices, but there are 4",
           "data=-1,fsdp=3": "do not divide the 4 devices", "": "must name axes"}
    for text, words in bad.items():
        with pytest.raises(ValueError, match=f"config.train.mesh: .*{words}"):
            mesh_sizes(text, 4)
    c = default_config()
    c.train.batch_size = 8
    c.train.mesh = "data=2,fsdp=2"
    validate_config(c)  # without a device count only the form is checked
    validate_config(c, 4)
    assert parallel_mode(c.train) == "mesh"  # train.mesh implies the mesh, whatever train.parallel says
    with pytest.raises(ValueError, match="config.train.mesh: 'data=2,fsdp=2' is a mesh of 4 devices"):
        validate_config(c, 8)
    c.train.mesh = "data=2,expert=2"
    with pytest.raises(ValueError, match="config.train.mesh: unknown axis 'expert'"):
        validate_config(c)
    c.train.mesh, c.train.fsdp = "data=2,fsdp=2", True
    with pytest.raises(ValueError, match="config.train.fsdp: .*name an fsdp axis in train.mesh"):
        validate_config(c)
    c.train.mesh, c.train.fsdp, c.train.batch_size = "dcn=2,data=-1", False, 6
    with pytest.raises(ValueError, match="config.train.batch_size: 6 must be divisible by the device count"):
        validate_config(c, 4)


def test_a_2d_mesh_trains_as_one_device_and_shards_over_fsdp_only(one_device):
    want_losses, want = one_device
    flat, _ = _run(MeshRunner(CFG, OPT, mesh="data=-1"))
    runner = MeshRunner(CFG, OPT, mesh="data=2,fsdp=2")
    assert dict(runner.mesh.shape) == {"data": 2, "fsdp": 2} and runner.name == "mesh (data=2, fsdp=2)"
    losses, state = _run(runner)
    np.testing.assert_allclose(flat, want_losses, rtol=1e-6)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    assert_same_training(state, want, atol=1e-6, what="data=2,fsdp=2")
    # sharded over fsdp (each device half of it), replicated over data (the same half twice)
    kernel = state.params["h_0"]["mlp"]["c_fc"]["kernel"]  # (32, 128)
    assert kernel.sharding.spec == P(None, "fsdp")
    assert {s.data.shape for s in kernel.addressable_shards} == {(32, 64)}
    assert len({str(s.index) for s in kernel.addressable_shards}) == 2
    mu = state.opt_state[1][0].mu["h_0"]["mlp"]["c_fc"]["kernel"]  # Adam's moments: as their params
    assert mu.sharding.spec == P(None, "fsdp")
    assert state.step.sharding.is_fully_replicated
    assert runner.batch_sharding.spec == P(("data", "fsdp"))


def test_a_dcn_mesh_trains_as_one_device(one_device):
    runner = MeshRunner(CFG, OPT, mesh="dcn=2,data=-1")
    assert dict(runner.mesh.shape) == {"dcn": 2, "data": 2}
    # the dcn axis is the outermost: it spans the processes (here, the first and last two devices)
    assert [d.id for d in runner.mesh.devices[0]] == [0, 1]
    losses, state = _run(runner)
    np.testing.assert_allclose(losses, one_device[0], rtol=1e-6)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state))  # no fsdp axis


def test_a_checkpoint_from_a_2d_mesh_restores_on_one_device_and_on_another_mesh(tmp_path):
    runner = MeshRunner(CFG, OPT, mesh="data=2,fsdp=2")
    _, state = _run(runner, steps=2)
    ck = Checkpointer(str(tmp_path))
    ck.save(2, runner.get_state(state), {"step": 2})
    ck.wait()
    template = jax.eval_shape(_state)
    one, _ = ck.restore(abstract_like(template))
    other = MeshRunner(CFG, OPT, mesh="fsdp=4")
    onto, _ = ck.restore(other.abstract_state(_state))
    ck.close()
    assert onto.params["h_0"]["mlp"]["c_fc"]["kernel"].sharding.spec == P(None, "fsdp")
    for a, b, c in zip(jax.tree.leaves(state), jax.tree.leaves(one), jax.tree.leaves(onto)):
        a, b, c = (jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v
                   for v in (a, b, c))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    x, y = _batches(1)[0]
    _, m_one = jax.jit(MeshRunner(CFG, OPT, devices=jax.devices()[:1])._train_step)(one, x, y)
    _, m_onto = other.step(onto, x, y)
    np.testing.assert_allclose(float(other.to_host(m_onto)["loss"]), float(m_one["loss"]), rtol=1e-6)


def test_the_tpu_backend_runs_splash_per_batch_shard_under_the_mesh():
    # its kernel interpreted on this CPU, under shard_map over the mesh's batch axes: the portable losses
    cfg = CFG.replace(kernels="tpu")
    runner = MeshRunner(cfg, OPT, mesh="data=2,fsdp=2")
    assert runner.backend.name == "tpu" and runner.backend.batch_mesh == (runner.mesh, ("data", "fsdp"))
    x, y = _batches(1)[0]
    text = runner.jitted_step(jax.eval_shape(_state)).lower(
        runner.abstract_state(_state), runner.put_batch(x), runner.put_batch(y)).as_text()
    assert "manual_computation" in text or "SPMDFullToShardShape" in text  # (Shardy or GSPMD)
    losses, _ = _run(runner, steps=1)
    np.testing.assert_allclose(losses, _run(MeshRunner(CFG, OPT, mesh="data=2,fsdp=2"), steps=1)[0], rtol=1e-5)
    assert resolve("portable").on_mesh(runner.mesh, ("data", "fsdp")).attention("dot_product") is not None
    assert resolve("tpu").on_mesh(build_mesh("data=1", jax.devices()[:1]), ("data",)).batch_mesh is None


def test_train_mesh_runs_through_train(tmp_path):
    c = tiny_config(tmp_path, max_steps=2, eval_interval=100, checkpoint_interval=100, log_interval=1,
                    mesh="data=2,fsdp=2")  # train.parallel stays "pmap": train.mesh implies the mesh
    c.model.n_layer = 1
    s = train(c)
    kernel = s["state"].params["h_0"]["mlp"]["c_fc"]["kernel"]
    assert s["steps"] == 2 and kernel.sharding.spec == P(None, "fsdp")
