"""The two ways to run the step on many devices, each in one place: pmap, and jit over a Mesh."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxgpt.config import GPTConfig
from jaxgpt.training.step import make_eval_step, make_train_step

AXIS = "data"


class PmapRunner:
    """Data parallel over local devices with `jax.pmap`; state replicated with a leading device axis."""

    name = "pmap"

    def __init__(self, config: GPTConfig, optimizer, grad_accum: int = 1, schedule=None, devices=None):
        self.devices = list(devices or jax.local_devices())
        self.n = len(self.devices)
        step = make_train_step(config, optimizer, grad_accum, axis_name=AXIS, schedule=schedule)
        self._step = jax.pmap(step, axis_name=AXIS, devices=self.devices, donate_argnums=(0,))
        self._eval = jax.pmap(make_eval_step(config, axis_name=AXIS), axis_name=AXIS, devices=self.devices)

    def put_state(self, state):
        """Replicate an unreplicated state onto the devices, laid out exactly as the step returns it.

        (A different layout, e.g. flax.jax_utils.replicate's, would make the second step compile again.)
        """
        sharding = NamedSharding(Mesh(np.array(self.devices), (AXIS,)), P(AXIS))

        def replicate(x):
            shards = [jax.device_put(x[None], d) for d in self.devices]
            return jax.make_array_from_single_device_arrays((self.n,) + x.shape, sharding, shards)
        return jax.tree_util.tree_map(replicate, state)

    def get_state(self, state):
        """The unreplicated state (device 0's copy), e.g. for saving."""
        return jax.tree_util.tree_map(lambda x: x[0], state)

    def put_batch(self, x: np.ndarray):
        """This process's rows [b, T] -> [devices, b / devices, T]."""
        return x.reshape(self.n, x.shape[0] // self.n, *x.shape[1:])

    def step(self, state, x, y):
        return self._step(state, self.put_batch(x), self.put_batch(y))

    def eval(self, state, x, y):
        return self._eval(state.params, self.put_batch(x), self.put_batch(y))

    def to_host(self, tree):
        """Metrics (identical on every device after pmean) as host scalars."""
        return jax.device_get(jax.tree_util.tree_map(lambda a: a[0], tree))


class MeshRunner:
    """The same step under `jax.jit` over a 1-D device Mesh: batch sharded over `data`, state replicated."""

    name = "mesh"

    def __init__(self, config: GPTConfig, optimizer, grad_accum: int = 1, schedule=None, devices=None):
        self.mesh = Mesh(np.array(devices or jax.devices()), (AXIS,))
        self.n = self.mesh.size
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P(AXIS))
        step = make_train_step(config, optimizer, grad_accum, axis_name=None, schedule=schedule)
        self._step = jax.jit(step, out_shardings=(self.replicated, self.replicated), donate_argnums=(0,))
        self._eval = jax.jit(make_eval_step(config), out_shardings=self.replicated)

    def state_shardings(self, state):
        return jax.tree_util.tree_map(lambda _: self.replicated, state)

    def put_state(self, state):
        return jax.device_put(state, self.state_shardings(state))

    def get_state(self, state):
        return state

    def put_batch(self, x: np.ndarray):
        """This process's rows -> one global array sharded over the data axis."""
        global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
        return jax.make_array_from_process_local_data(self.batch_sharding, x, global_shape)

    def step(self, state, x, y):
        return self._step(state, self.put_batch(x), self.put_batch(y))

    def eval(self, state, x, y):
        return self._eval(state.params, self.put_batch(x), self.put_batch(y))

    def to_host(self, tree):
        return jax.device_get(tree)


def make_runner(kind: str, config: GPTConfig, optimizer, grad_accum: int = 1, schedule=None):
    """A PmapRunner or MeshRunner by name ('pmap' | 'mesh')."""
    runners = {"pmap": PmapRunner, "mesh": MeshRunner}
    if kind not in runners:
        raise ValueError(f"train.parallel must be one of {sorted(runners)}, got {kind!r}")
    return runners[kind](config, optimizer, grad_accum, schedule)
