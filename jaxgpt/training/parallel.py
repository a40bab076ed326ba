"""The two ways to run the step on many devices, each in one place: pmap, and jit over a Mesh.

Both work unchanged on one process or on several (JAX's multi-controller runtime, `jax.distributed`):
each process hands its runner only its own rows of the global batch, and the state that comes out of
`get_state` (what checkpoints hold) is made of global arrays that span every process's devices.

- `PmapRunner`: data parallel with `jax.pmap` over this process's devices; the axis spans all
  processes' devices, so `pmean` averages over the whole global batch. State is replicated with a
  leading local-device axis. Its `jitted_step` is the same per-device step under `jax.shard_map` (one
  jitted program, which can be lowered for compile-only devices: what jaxgpt.aot compiles).
- `MeshRunner`: `jax.jit` over a `Mesh` of all global devices with axes dcn, data, fsdp and tensor
  (jaxgpt.training.mesh; `train.mesh`), laid out by the rules table (jaxgpt.sharding;
  `train.logical_axis_rules`): by default the batch sharded over dcn, data and fsdp; the state
  replicated over dcn and data, sharded over fsdp (each leaf along one dimension the fsdp size divides,
  the largest) and over tensor (heads, the MLP's hidden width, the vocabulary). XLA (GSPMD) gathers the
  parameters for the forward and backward passes, reduce-scatters the gradients and all-reduces the
  tensor-parallel matmuls' partial sums; the update is the same as replicated training. Without
  `train.mesh` the mesh is 1-D: 'data=-1' (replicated), or 'fsdp=-1' with `fsdp=True`.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxgpt.backends import Backend, resolve
from jaxgpt.config import GPTConfig
from jaxgpt.sharding import RulesLike, UNNAMED, batch_axes, logical_spec, rules, sequence_axes, tree_shardings
from jaxgpt.training.mesh import build_mesh, mesh_text
from jaxgpt.training.step import make_eval_step, make_train_step, map_batches, repeat_steps

AXIS = "data"  # pmap's axis, and the mesh's replicated batch axis
FSDP = "fsdp"  # the mesh axis that shards the state

tree_map = jax.tree_util.tree_map


def fsdp_spec(shape: tuple[int, ...], n: int, axis: str = FSDP) -> P:
    """The PartitionSpec that shards the largest dimension divisible by `n` over `axis` (of size n; the
    first such dimension on ties); P() (replicated) when no dimension divides, or when n == 1: the rules
    table's spec of a leaf with no logical axes (jaxgpt.sharding.logical_spec) on a mesh of `axis` alone."""
    return logical_spec((UNNAMED,) * len(shape), shape, {axis: n}, {UNNAMED: (axis,)})


def _local_value(a) -> np.ndarray:
    """The host value of a replicated (or fully addressable) array, read from a local device only."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        if not a.is_fully_replicated:
            raise ValueError(f"array of shape {a.shape} is sharded across processes; it has no local value")
        return np.asarray(a.addressable_data(0))
    return np.asarray(a)


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_global(x, sharding: NamedSharding):
    """`x` (a host value, or a jax.Array with the same value on every process) laid out as `sharding`."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    if sharding.is_fully_addressable:  # one process: a plain device_put
        return jax.device_put(x, sharding)
    if _is_key(x):  # typed PRNG keys travel as their raw key data
        impl = jax.random.key_impl(x)
        data = _to_global(jax.random.key_data(x), NamedSharding(sharding.mesh, P()))
        return jax.device_put(jax.random.wrap_key_data(data, impl=impl), sharding)
    host = _local_value(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _key_impls(tree) -> tuple:
    """The PRNG key implementation of each leaf of `tree` (None for leaves that are not typed keys)."""
    return tuple(jax.random.key_impl(x) if _is_key(x) else None for x in jax.tree_util.tree_leaves(tree))


def _split_keys(tree):
    """`tree` with its typed PRNG keys replaced by their raw key data."""
    return tree_map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _join_keys(tree, impls):
    """The inverse of _split_keys."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef.unflatten([x if impl is None else jax.random.wrap_key_data(x, impl=impl)
                              for x, impl in zip(leaves, impls)])


@jax.jit
def _add_lead_axis(arrays: list) -> list:  # (typed PRNG keys become their raw data)
    return [(jax.random.key_data(a) if _is_key(a) else a)[None] for a in arrays]


@jax.jit
def _drop_lead_axis(arrays: list) -> list:
    return [a.reshape(a.shape[1:]) for a in arrays]


def _per_device(fn: Callable, arrays: list[list]) -> list[list]:
    """`fn` applied to each leaf's single-device arrays (`arrays[leaf][copy]`), in one call per device
    for all the leaves it holds: one program per device and state, where array by array would compile
    one per device and leaf shape."""
    by_device: dict = {}
    for i, copies in enumerate(arrays):
        for j, a in enumerate(copies):
            by_device.setdefault(a.device, []).append((i, j, a))
    out = [[None] * len(copies) for copies in arrays]
    for held in by_device.values():
        for (i, j, _), b in zip(held, fn([a for _, _, a in held])):
            out[i][j] = b
    return out


def _jit_step(fn: Callable, state_shardings, batch_sharding: NamedSharding, replicated: NamedSharding,
              segments: bool = False):
    """`fn(state, x, y[, segment_ids]) -> (state, metrics)` jitted as both runners' jitted_step lay it out:
    the state in and out in `state_shardings` (donated), x, y (and the segment ids) in `batch_sharding`,
    the metrics `replicated`."""
    return jax.jit(fn, in_shardings=(state_shardings,) + (batch_sharding,) * (3 if segments else 2),
                   out_shardings=(state_shardings, replicated), donate_argnums=(0,))


def _abstract(state, shardings):
    return tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


class PmapRunner:
    """Data parallel over this process's devices with `jax.pmap`; state replicated with a leading
    device axis. Across processes the pmap axis spans every process's devices.

    Between put_state and get_state typed PRNG keys are held as raw key data: on several processes
    pmap copies typed-key arguments through the host on every call, which would make each step wait
    for the one before it.
    """

    name = "pmap"

    def __init__(self, config: GPTConfig, optimizer, grad_accum: int = 1, schedule=None, devices=None,
                 backend: Optional[Backend] = None, loss_chunk: int = 0):
        # Without explicit devices pmap maps over the local devices (on several processes its axis, and
        # so pmean, still spans all of them); explicit devices are for single-process subsets.
        self.devices = list(devices) if devices is not None else jax.local_devices()
        self.n = len(self.devices)
        all_devices = self.devices if devices is not None else jax.devices()
        # the devices the pmap axis spans, as a 1-D mesh: the saved layout's, and the shard_map form's
        self.mesh = Mesh(np.array(all_devices), (AXIS,))
        self.batch_axes = (AXIS,)
        # the saved ("unreplicated") layout: one value replicated on every device of every process
        self.replicated = NamedSharding(self.mesh, P())
        # the shard_map form's batches (jitted_step): rows [b, T] or [K, b, T] split over the devices
        self.batch_sharding = NamedSharding(self.mesh, P(AXIS))
        self.stack_sharding = NamedSharding(self.mesh, P(None, AXIS))
        # the layout pmap returns: one copy per local device along the leading axis
        self._layout = NamedSharding(Mesh(np.array(self.devices), (AXIS,)), P(AXIS))
        kw = {} if devices is None else {"devices": self.devices}
        backend = backend or resolve(config)
        # the per-device step, built once: pmap maps it (step, steps), shard_map wraps it (jitted_step)
        self._train_step = make_train_step(config, optimizer, grad_accum, axis_name=AXIS, schedule=schedule,
                                           backend=backend, loss_chunk=loss_chunk)
        self._train_steps = repeat_steps(self._train_step)
        self._once = backend.compile_once_options()  # for init_state
        self._impls = None  # the key implementation of each state leaf (None: not a key), from put_state

        def raw(fn):
            def run(raw_state, *batch):  # x, y (and segment ids)
                state, metrics = fn(_join_keys(raw_state, self._impls), *batch)
                return _split_keys(state), metrics
            return run

        # (jax.pmap only wraps here: nothing touches a device until the first call, so a runner over
        # compile-only devices, jaxgpt.aot's, can be built and lowered through jitted_step)
        self._step = jax.pmap(raw(self._train_step), axis_name=AXIS, donate_argnums=(0,), **kw)
        self._steps = jax.pmap(raw(self._train_steps), axis_name=AXIS, donate_argnums=(0,), **kw)
        evals = map_batches(make_eval_step(config, axis_name=AXIS, backend=backend, loss_chunk=loss_chunk))
        self._eval = jax.pmap(evals, axis_name=AXIS, **kw)

    def state_shardings(self, state):
        """Shardings of the state as get_state returns it (and checkpoints hold it): replicated."""
        return tree_map(lambda _: self.replicated, state)

    def abstract_state(self, make_state: Callable, *args):
        """ShapeDtypeStructs of `make_state(*args)` in the saved layout: a restore target."""
        shapes = jax.eval_shape(make_state, *args)
        return _abstract(shapes, self.state_shardings(shapes))

    def init_state(self, make_state: Callable, *args):
        """`make_state(*args)` computed once here, replicated onto the local devices."""
        return self.put_state(jax.jit(make_state, compiler_options=self._once)(*args))

    def put_state(self, state):
        """Replicate a state (on one device, or replicated as get_state returns it) onto the local devices,
        laid out exactly as the step returns it (any other layout would make the second step compile again)."""
        impls = _key_impls(state)
        if self._impls is not None and impls != self._impls:
            raise ValueError("put_state got a state whose PRNG keys differ from the earlier one's")
        self._impls = impls
        leaves, treedef = jax.tree_util.tree_flatten(state)
        shards = _per_device(_add_lead_axis, [self._copies(x) for x in leaves])
        return treedef.unflatten([jax.make_array_from_single_device_arrays((self.n, *s[0].shape[1:]), self._layout, s)
                                  for s in shards])

    def _copies(self, x) -> list:
        """x's whole value on each local device, reusing the copies x already has there."""
        if not isinstance(x, jax.Array):
            return [jax.device_put(x, d) for d in self.devices]
        have = {s.device: s.data for s in x.addressable_shards if s.data.shape == x.shape}
        if not have and not x.is_fully_addressable:
            raise ValueError(f"cannot replicate an array of shape {x.shape} that is sharded across processes")
        src = next(iter(have.values())) if have else x
        return [have[d] if d in have else jax.device_put(src, d) for d in self.devices]

    def get_state(self, state):
        """The unreplicated state as global arrays replicated over all devices (of all processes), built
        from the copies the local devices already hold: what orbax saves, on one process or several."""
        def unreplicate(local, impl):
            if impl is not None:
                local = [jax.random.wrap_key_data(c, impl=impl) for c in local]
            return jax.make_array_from_single_device_arrays(local[0].shape, self.replicated, local)

        leaves, treedef = jax.tree_util.tree_flatten(state)
        local = _per_device(_drop_lead_axis, [[s.data for s in x.addressable_shards] for x in leaves])
        return treedef.unflatten([unreplicate(c, impl) for c, impl in zip(local, self._impls)])

    def put_batch(self, x: np.ndarray):
        """This process's rows [b, T] -> [local devices, b / local devices, T]."""
        return x.reshape(self.n, x.shape[0] // self.n, *x.shape[1:])

    def step(self, state, x, y, segment_ids=None):
        """One step on this process's rows x, y [b, T] (and their document segment ids, data.doc_mask)."""
        return self._step(state, *(self.put_batch(a) for a in _batch(x, y, segment_ids)))

    def jitted_step(self, state, many: bool = False, segments: bool = False):
        """The per-device step that `step` (with `many`: `steps`) pmaps, as one jitted program over `mesh`:
        under jax.shard_map, state in the saved layout (replicated, as get_state returns it; arrays or
        ShapeDtypeStructs), x, y [b, T] global arrays in `batch_sharding` (with `many` [K, b, T] in
        `stack_sharding`), each device its rows; the pmean inside averages as under pmap. pmap has no
        compile-only path: this is what jaxgpt.aot lowers for a pmap config. `segments`: the step also takes
        the rows' document segment ids, laid out as x."""
        rows = P(None, AXIS) if many else P(AXIS)
        # check_vma=False: pmap's semantics, the step's own pmean makes the outputs the same on every device
        mapped = jax.shard_map(self._train_steps if many else self._train_step, mesh=self.mesh,
                               in_specs=(P(),) + (rows,) * (3 if segments else 2), out_specs=(P(), P()),
                               check_vma=False)
        return _jit_step(mapped, self.state_shardings(state), self.stack_sharding if many else self.batch_sharding,
                         self.replicated, segments)

    def _put_stack(self, a: np.ndarray):
        """[K, b, T] -> [local devices, K, b / local devices, T]."""
        k, b = a.shape[:2]
        return a.reshape(k, self.n, b // self.n, *a.shape[2:]).swapaxes(0, 1)

    def steps(self, state, xs, ys, ss=None):
        """K steps in one call: xs, ys (and segment ids ss) [K, b, T] (this process's rows of K batches);
        metrics [K]."""
        return self._steps(state, *(self._put_stack(a) for a in _batch(xs, ys, ss)))

    def eval(self, state, xs, ys, ss=None):
        """The mean loss of each of E batches xs, ys (and segment ids ss) [E, b, T] (this process's rows), in
        one call: [E]."""
        segments = () if ss is None else (self._put_stack(ss),)
        return self._eval(state.params, self._put_stack(xs), self._put_stack(ys), state.frozen, *segments)

    def to_host(self, tree):
        """Metrics (identical on every device after pmean) as host values, read from a local device."""
        return tree_map(lambda a: np.asarray(a.addressable_data(0))[0], tree)


class MeshRunner:
    """The same step under `jax.jit` over a Mesh of all devices (`mesh`, a train.mesh string; default
    'data=-1', or 'fsdp=-1' with `fsdp=True`), laid out by the rules table (`rules`: overrides of
    jaxgpt.sharding's defaults, train.logical_axis_rules): by default the batch over dcn, data and fsdp,
    the state over fsdp and tensor."""

    name = "mesh"

    def __init__(self, config: GPTConfig, optimizer, grad_accum: int = 1, schedule=None, devices=None,
                 fsdp: bool = False, backend: Optional[Backend] = None, mesh: str = "", loss_chunk: int = 0,
                 rules: RulesLike = None):
        self.mesh = build_mesh(mesh_text(mesh, fsdp), devices)
        self.config, self.rules = config, _rules(rules)
        self.n = self.mesh.size
        self.fsdp_size = self.mesh.shape[FSDP] if FSDP in self.mesh.axis_names else 0  # 0: no fsdp axis
        self.fsdp = self.fsdp_size > 0
        if mesh:
            self.name = f"mesh ({', '.join(f'{a}={s}' for a, s in self.mesh.shape.items())})"
        elif self.fsdp:
            self.name = "mesh (fsdp)"
        axes = batch_axes(self.mesh.axis_names, self.rules)  # (by default all but tensor)
        self.batch_axes = axes
        rows = None if not axes else axes[0] if len(axes) == 1 else axes
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P(rows))
        self.stack_sharding = NamedSharding(self.mesh, P(None, rows))  # [K, rows, T]: rows over the batch axes
        _check_rows_per_process(self.batch_sharding, math.prod(self.mesh.shape[a] for a in axes))
        # (splash runs per batch shard; the residual stream split along the sequence by the `length` rule)
        sequence = sequence_axes(dict(self.mesh.shape), self.rules)
        backend = (backend or resolve(config)).on_mesh(self.mesh, axes, sequence)
        self.backend = backend
        self._train_step = make_train_step(config, optimizer, grad_accum, axis_name=None, schedule=schedule,
                                           backend=backend, batch_sharding=self.batch_sharding, loss_chunk=loss_chunk)
        self._once = backend.compile_once_options()  # for init_state
        self._eval_step = make_eval_step(config, backend=backend, loss_chunk=loss_chunk)
        self._jitted = {}  # (many, segments) -> the jitted step, on first use, when the state's structure is known
        self._eval = {}  # segments -> the jitted evaluation

    def state_shardings(self, state):
        """Per leaf, by the rules table: each parameter (and each optimizer leaf that mirrors one) by its
        logical axes; any other leaf split over fsdp along its largest dimension the fsdp size divides."""
        return tree_shardings(state, self.config, self.mesh, self.rules)

    def abstract_state(self, make_state: Callable, *args):
        """ShapeDtypeStructs of `make_state(*args)` laid out as this runner keeps it: a restore target."""
        shapes = jax.eval_shape(make_state, *args)
        return _abstract(shapes, self.state_shardings(shapes))

    def init_state(self, make_state: Callable, *args):
        """`make_state(*args)` computed straight into its shardings (no device ever holds it all with fsdp)."""
        shapes = jax.eval_shape(make_state, *args)
        if jax.process_count() > 1:  # jit over every process's devices takes host values or global arrays
            args = jax.device_get(args)
        return jax.jit(make_state, out_shardings=self.state_shardings(shapes), compiler_options=self._once)(*args)

    def put_state(self, state):
        """Lay out a state (one device, host values, or global arrays) as this runner keeps it."""
        return tree_map(_to_global, state, self.state_shardings(state))

    def get_state(self, state):
        return state

    def put_batch(self, x: np.ndarray):
        """This process's rows -> one global array, rows sharded over the batch axes."""
        global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
        return jax.make_array_from_process_local_data(self.batch_sharding, x, global_shape)

    def jitted_step(self, state, many: bool = False, segments: bool = False):
        """The jitted step for states shaped like `state` (arrays or ShapeDtypeStructs): x, y [b, T], or
        with `many` the K-step program over xs, ys [K, b, T]; with `segments` the rows' document segment
        ids after them, laid out as x. What `step`/`steps` call, and what jaxgpt.aot lowers for a target's
        devices."""
        fn = repeat_steps(self._train_step) if many else self._train_step
        return _jit_step(fn, self.state_shardings(state), self.stack_sharding if many else self.batch_sharding,
                         self.replicated, segments)

    def _program(self, state, many: bool, segments: bool):
        key = (many, segments)
        if key not in self._jitted:
            self._jitted[key] = self.jitted_step(state, many=many, segments=segments)
        return self._jitted[key]

    def step(self, state, x, y, segment_ids=None):
        """One step on this process's rows x, y [b, T] (and their document segment ids, data.doc_mask)."""
        batch = _batch(x, y, segment_ids)
        return self._program(state, False, len(batch) == 3)(state, *(self.put_batch(a) for a in batch))

    def steps(self, state, xs, ys, ss=None):
        """K steps in one call: xs, ys (and segment ids ss) [K, b, T] (this process's rows of K batches);
        metrics [K]."""
        batch = _batch(xs, ys, ss)
        return self._program(state, True, len(batch) == 3)(state, *(self._put_stack(a) for a in batch))

    def _put_stack(self, a: np.ndarray):
        """This process's rows of K batches [K, b, T] -> one global array, rows sharded over the batch axes."""
        shape = (a.shape[0], a.shape[1] * jax.process_count()) + a.shape[2:]
        return jax.make_array_from_process_local_data(self.stack_sharding, a, shape)

    def eval(self, state, xs, ys, ss=None):
        """The mean loss of each of E batches xs, ys (and segment ids ss) [E, b, T] (this process's rows), in
        one call: [E]."""
        segments = () if ss is None else (self._put_stack(ss),)
        if bool(segments) not in self._eval:
            shardings = (self.state_shardings(state.params), self.stack_sharding, self.stack_sharding,
                         self.state_shardings(state.frozen)) + (self.stack_sharding,) * len(segments)
            self._eval[bool(segments)] = jax.jit(map_batches(self._eval_step), in_shardings=shardings,
                                                 out_shardings=self.replicated)
        return self._eval[bool(segments)](state.params, self._put_stack(xs), self._put_stack(ys), state.frozen,
                                          *segments)

    def to_host(self, tree):
        """Replicated outputs (metrics) as host values, read from a local device."""
        return tree_map(_local_value, tree)


def _batch(x, y, segment_ids=None) -> tuple:
    """A batch's arrays as the steps take them: (x, y), or (x, y, segment_ids) with document masking."""
    return (x, y) if segment_ids is None else (x, y, segment_ids)


def _check_rows_per_process(batch_sharding: NamedSharding, shards: int) -> None:
    """ValueError when two processes would hold the same rows of a batch (an axis that carries no batch,
    such as tensor, spanning processes): each process feeds only its own rows of every batch."""
    owners: dict = {}
    for device, index in batch_sharding.devices_indices_map((shards,)).items():
        owners.setdefault(index[0].start or 0, set()).add(device.process_index)
    if any(len(p) > 1 for p in owners.values()):
        axes = ", ".join(f"{a}={s}" for a, s in batch_sharding.mesh.shape.items())
        raise ValueError(f"config.train.mesh: the mesh ({axes}) puts the same batch rows on several processes (an "
                         f"axis that carries no batch spans them); make the batch axes (dcn, data, fsdp) span the "
                         f"processes, e.g. with dcn or data as large as the process count, tensor within a host")


def _rules(table: RulesLike):
    return table if isinstance(table, dict) else rules(table)


def make_runner(kind: str, config: GPTConfig, optimizer, grad_accum: int = 1, schedule=None, fsdp: bool = False,
                backend: Optional[Backend] = None, mesh: str = "", loss_chunk: int = 0, rules: RulesLike = None,
                devices=None):
    """A PmapRunner or MeshRunner by name ('pmap' | 'mesh'); `fsdp`, `mesh` (a train.mesh string, which
    means 'mesh' whatever `kind` says) and `rules` (train.logical_axis_rules) apply to the mesh only;
    `loss_chunk` (train.loss_chunk) to both. The backend (default `resolve(config)`) is chosen here, once,
    for every program the runner compiles. `devices`: all of JAX's by default; jaxgpt.aot passes a
    target's compile-only devices."""
    backend = backend or resolve(config)
    backend.setup()
    if mesh:
        if fsdp:
            raise ValueError("train.fsdp and train.mesh both set: put an fsdp axis in train.mesh instead")
        return MeshRunner(config, optimizer, grad_accum, schedule, devices=devices, backend=backend, mesh=mesh,
                          loss_chunk=loss_chunk, rules=rules)
    if kind == "pmap":
        if fsdp:
            raise ValueError("train.fsdp needs train.parallel='mesh' (pmap keeps a full copy per device)")
        if (jax.device_count() if devices is None else len(devices)) == 1:
            # nothing to map over: plain jit skips pmap's per-call overhead
            runner = MeshRunner(config, optimizer, grad_accum, schedule, devices=devices, backend=backend,
                                loss_chunk=loss_chunk)
            runner.name = "pmap (one device: jit)"
            return runner
        return PmapRunner(config, optimizer, grad_accum, schedule, devices=devices, backend=backend,
                          loss_chunk=loss_chunk)
    if kind == "mesh":
        return MeshRunner(config, optimizer, grad_accum, schedule, devices=devices, fsdp=fsdp, backend=backend,
                          loss_chunk=loss_chunk, rules=rules)
    raise ValueError(f"train.parallel must be one of ['mesh', 'pmap'], got {kind!r}")
