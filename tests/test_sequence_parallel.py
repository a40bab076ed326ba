"""Sequence parallelism over `tensor` (issue 59; jaxgpt/sharding.py's `length` rule) and remat="offload", on
the fake CPU devices: the compiled step keeps each scanned block's saved input split along the sequence
over the tensor devices (and whole without the rule), training with it equals one device (dropout, scanned
and unrolled blocks, data x tensor and fsdp x tensor), decoding is not touched, and remat="offload" trains
as "block" with the saved inputs placed in host memory."""

import re

import jax
import numpy as np
import pytest

from jaxgpt import init_params
from jaxgpt.sharding import rules, sequence_axes
from jaxgpt.training import MeshRunner, create_train_state
from tests.helpers import assert_same_training
from tests.test_tensor_heads import CFG, OPT, ROWS, _batches, _devices, _run

SCANNED = CFG.replace(scan_layers=True, remat="block")


ON = "length=tensor"  # sequence parallelism (off by default)


def _lowered(cfg, mesh: str, table: str = ON):
    runner = MeshRunner(cfg, OPT, mesh=mesh, devices=_devices(mesh), rules=table)
    x, y = _batches(cfg, 1)[0]
    state = runner.abstract_state(lambda: create_train_state(init_params(cfg, jax.random.key(0)), OPT,
                                                             jax.random.key(1)))
    return runner, runner.jitted_step(state).lower(state, runner.put_batch(x), runner.put_batch(y))


def _saved_inputs(hlo: str, cfg, rows: int) -> set:
    """The per-device shapes [L, rows, T', D] in a compiled step: the scanned blocks' saved inputs."""
    found = set()
    for dims in re.findall(r"\w+\[([\d,]+)\]", hlo):
        d = tuple(int(v) for v in dims.split(","))
        if len(d) == 4 and d[0] == cfg.n_layer and d[1] == rows and d[3] == cfg.n_embd:
            found.add(d)
    return found


def test_the_length_rule_names_tensor_where_it_has_devices_and_carries_no_batch():
    assert sequence_axes({"data": 2, "tensor": 2}, rules(ON)) == ("tensor",)
    assert sequence_axes({"fsdp": 4, "tensor": 1}, rules(ON)) == ()
    assert sequence_axes({"data": 2, "tensor": 2}) == ()  # (off by default)
    assert sequence_axes({"data": 2, "tensor": 2}, rules("length=data")) == ()  # (data carries the batch)
    assert MeshRunner(CFG, OPT, mesh="data=2,tensor=2", rules=ON).backend.sequence_mesh is not None
    assert MeshRunner(CFG, OPT, mesh="data=2,tensor=2").backend.sequence_mesh is None
    assert MeshRunner(CFG, OPT, mesh="data=4").backend.sequence_mesh is None


@pytest.mark.parametrize("table, split", [(ON, True), ("", False)])
def test_the_saved_block_inputs_are_split_along_the_sequence_over_tensor(table, split):
    """What remat="block" keeps for the backward (each scanned block's input, [L, rows, T, D] per device)
    holds half the positions on each of the tensor=2 devices with the rule, all of them without."""
    _, lowered = _lowered(SCANNED, "data=2,tensor=2", table)
    rows, t = ROWS // 2, SCANNED.block_size
    shapes = _saved_inputs(lowered.compile().as_text(), SCANNED, rows)
    half, whole = (SCANNED.n_layer, rows, t // 2, SCANNED.n_embd), (SCANNED.n_layer, rows, t, SCANNED.n_embd)
    assert (half in shapes, whole in shapes) == (split, not split), shapes


@pytest.fixture(scope="module")
def one_device():
    cfgs = {"scanned": SCANNED.replace(dropout=0.1), "unrolled": CFG.replace(dropout=0.1)}
    return {k: _run(cfg, MeshRunner(cfg, OPT, devices=jax.devices()[:1])) for k, cfg in cfgs.items()}


@pytest.mark.parametrize("mesh", ["data=2,tensor=2", "fsdp=2,tensor=2"])
@pytest.mark.parametrize("layers", ["scanned", "unrolled"])
def test_sequence_parallel_training_equals_one_device(one_device, mesh, layers):
    cfg = (SCANNED if layers == "scanned" else CFG).replace(dropout=0.1)
    runner = MeshRunner(cfg, OPT, mesh=mesh, rules=ON)
    assert runner.backend.sequence_mesh is not None
    want_losses, want = one_device[layers]
    losses, state = _run(cfg, runner)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_same_training(state, want, atol=1e-5, what=f"{mesh}, {layers}")


def _host_puts(cfg) -> list:
    """The device_puts into host memory in the jaxpr of the model's gradient (text, one per match)."""
    import jax.numpy as jnp
    from jaxgpt import GPT
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    x = jnp.zeros((2, cfg.block_size), jnp.int32)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: GPT(cfg).apply({"params": p}, x).sum()))(params))
    return re.findall(r"device_put\[[^\]]*MemorySpace\.Host", jaxpr)


def test_remat_offload_moves_the_saved_block_inputs_to_the_host_and_trains_as_block():
    """remat="offload" asks for each scanned block's saved input in host memory (a device_put to the host
    in the forward, back in the backward; the CPU's compiler keeps it where it is), and trains as "block"
    does, on one device and at data=2,tensor=2 with sequence parallelism."""
    offload = SCANNED.replace(remat="offload")
    assert _host_puts(offload) and not _host_puts(SCANNED)
    assert _host_puts(CFG.replace(remat="offload")) == []  # (unrolled: "block")
    want_losses, want = _run(SCANNED, MeshRunner(SCANNED, OPT, devices=jax.devices()[:1]), steps=2)
    one, mesh = MeshRunner(offload, OPT, devices=jax.devices()[:1]), MeshRunner(offload, OPT, mesh="data=2,tensor=2", rules=ON)
    for runner in (one, mesh):
        losses, state = _run(offload, runner, steps=2)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        assert_same_training(state, want, atol=1e-5, what=runner.name)
