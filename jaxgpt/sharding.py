"""Logical axes -> mesh axes: the one table that lays parameters, optimizer state and batches out on a
device mesh.

Every parameter's dimensions have logical names (jaxgpt/schema.py: `embed`, `heads`, `mlp`, `vocab`, ...);
the rules table says which mesh axes (`dcn`, `data`, `fsdp`, `tensor`) each name may be split over, and
`batch` names the mesh axes that carry the batch's rows. The default (`DEFAULT_RULES`):

- the batch over dcn, data and fsdp (never tensor: every tensor device sees the same rows);
- tensor splits `heads` (attention's c_proj input), `kv_heads`, `mlp` (the MLP's hidden width: c_fc's
  columns, c_proj's rows) and `vocab`: Megatron's column- then row-parallel pairs, whose partial sums
  GSPMD adds with one all-reduce per pair;
- fsdp splits any named dimension but `layers` (the scanned axis) and `mix`;
- `qkv` (attention's fused [q | k | v] c_attn output) is not split over tensor: its columns in tensor-many
  contiguous blocks would not fall on head boundaries (with two devices, one would hold q and half of k).
  The kernel is stored whole on each tensor device, and the model regroups its columns by kv head and
  multiplies each device's own heads (model.Dense's `parts`, Backend.shard_heads): q, k and v, attention
  and c_proj's rows split by heads, one all-reduce per block.
- `length` (activations' sequence axis, no parameter's) over tensor: sequence parallelism (Megatron-SP) in
  training. The residual stream between the blocks' matmuls (each block's input, which remat saves, its
  norms, dropout and residual adds) is split along the sequence over the tensor devices instead of held
  whole on each: GSPMD all-gathers each norm's output before the column-parallel matmuls (c_attn, the
  MLP's c_fc) and each device keeps the row-parallel ones' sums (c_proj) for its own positions (a
  reduce-scatter in principle; libtpu 0.0.42 compiles the forward's as the all-reduce and a slice). The
  same arithmetic, a tensor-th of the residual stream's memory a device, more collectives (the gathers).
  Applied by a training runner on a mesh (`MeshRunner`, Backend.on_mesh's `sequence_axes`) where the mesh
  axes named have more than one device, carry no batch and divide the sequence; decoding and a single
  device are not touched. Off by default, as Megatron-LM's `--sequence-parallel` and MaxText's tensor-sequence
  parallelism are: "length=tensor" turns it on (its time on hardware is not measured yet; the memory it
  saves is: bench/README.md, issue 59).
- a dimension no layer named (`unnamed`: optimizer state that mirrors no parameter, an undeclared
  parameter; also a name of a custom layer's own that the table lacks) may be split over fsdp.

How a parameter's spec is made (`logical_spec`): the mesh axes are placed one at a time, innermost
first (tensor, then fsdp, data, dcn), each on one dimension whose rule lists it and whose size (what the
axes already on it leave) it divides: of those, one not split yet when there is one, the largest (the
first on ties). A mesh axis of size 1 is dropped, and one that divides no candidate dimension leaves the
parameter whole along it. On a mesh of fsdp alone this is FSDP's old guess (the largest dimension the
fsdp size divides); with tensor, fsdp takes the dimension tensor left whole (c_fc: [embed/fsdp, mlp/tensor]).

Overrides (`train.logical_axis_rules`, or `rules(...)` in Python): "LOGICAL=AXIS+AXIS,..." or pairs
(logical, mesh axes); each replaces that name's entry ("qkv=tensor+fsdp", "embed=" for unsplit).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxgpt.config import GPTConfig
from jaxgpt.schema import AXES as LOGICAL_AXES, UNNAMED, param_schema

MESH_AXES = ("dcn", "data", "fsdp", "tensor")  # every mesh axis, outermost first
BATCH = "batch"  # the logical axis of a batch's rows
LENGTH = "length"  # the logical axis of activations' sequence positions (sequence parallelism)
KEY = "config.train.logical_axis_rules"

DEFAULT_RULES = (
    (BATCH, ("dcn", "data", "fsdp")),
    (LENGTH, ()),  # sequence parallelism off ("length=tensor" turns it on): see the module's docstring
    ("embed", ("fsdp",)),
    ("position", ("fsdp",)),
    ("vocab", ("tensor", "fsdp")),
    ("heads", ("tensor", "fsdp")),
    ("kv_heads", ("tensor", "fsdp")),
    ("mlp", ("tensor", "fsdp")),
    ("qkv", ("fsdp",)),  # not tensor (split by heads inside the model): see the module's docstring
    ("head_dim", ("fsdp",)),
    ("layers", ()),
    ("mix", ()),
    (UNNAMED, ("fsdp",)),
)

Rules = dict  # logical axis -> tuple of mesh axes
RulesLike = Union[None, str, Sequence, dict]


def _fail(problem: str):
    raise ValueError(f"{KEY}: {problem}")


def _parse(text: str) -> list:
    """'qkv=tensor+fsdp,embed=' -> [('qkv', ('tensor', 'fsdp')), ('embed', ())]."""
    pairs = []
    for part in text.split(","):
        if not part.strip():
            continue
        name, eq, value = (s.strip() for s in part.partition("="))
        if not eq or not name:
            _fail(f"{part.strip()!r} is not LOGICAL=MESH_AXES (e.g. 'qkv=tensor+fsdp,embed='), in {text!r}")
        pairs.append((name, tuple(a.strip() for a in value.split("+") if a.strip())))
    return pairs


def rules(overrides: RulesLike = None) -> Rules:
    """The rules table: DEFAULT_RULES with `overrides` ("LOGICAL=AXIS+AXIS,..." or (logical, mesh axes)
    pairs, mesh axes a name, a sequence of names or None) replacing their names' entries; ValueError naming
    train.logical_axis_rules for an unknown or repeated name."""
    table = dict(DEFAULT_RULES)
    if not overrides:
        return table
    if isinstance(overrides, dict):
        pairs = list(overrides.items())
    elif isinstance(overrides, str):
        pairs = _parse(overrides)
    else:
        pairs = list(overrides)
    known, seen = (BATCH, LENGTH) + LOGICAL_AXES + (UNNAMED,), set()
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            _fail(f"each rule is a pair (logical axis, mesh axes), got {pair!r}")
        name, axes = pair
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        if name not in known:
            _fail(f"unknown logical axis {name!r}; the logical axes are {', '.join(known)}")
        if name in seen:
            _fail(f"logical axis {name!r} appears twice")
        bad = [a for a in axes if a not in MESH_AXES]
        if bad or len(set(axes)) != len(axes):
            _fail(f"{name!r} maps to {axes!r}: each mesh axis once, from {', '.join(MESH_AXES)}")
        seen.add(name)
        table[name] = axes
    return table


def batch_axes(mesh_axes: Sequence[str], table: Optional[Rules] = None) -> tuple:
    """The axes of a mesh (names, in its order) that carry the batch's rows, by the `batch` rule."""
    wanted = (table or rules())[BATCH]
    return tuple(a for a in wanted if a in mesh_axes)


def sequence_axes(mesh_shape: dict, table: Optional[Rules] = None) -> tuple:
    """The axes of a mesh ({axis: size}) that split activations along the sequence in training, by the
    `length` rule: those of more than one device that carry no batch (sequence parallelism; see the
    module's docstring)."""
    table = table or rules()
    batch = batch_axes(tuple(mesh_shape), table)
    return tuple(a for a in table[LENGTH] if mesh_shape.get(a, 1) > 1 and a not in batch)


def logical_spec(axes: Sequence[str], shape: Sequence[int], mesh_shape: dict, table: Optional[Rules] = None) -> P:
    """The PartitionSpec of an array of `shape` whose dimensions are named `axes`, on a mesh of
    `mesh_shape` ({axis: size}, outermost first), by the rules `table` (see the module's docstring)."""
    table = table or rules()
    split = [[] for _ in shape]
    left = [int(d) for d in shape]
    for m in reversed(tuple(mesh_shape)):
        n = mesh_shape[m]
        if n == 1:
            continue
        fits = [i for i, a in enumerate(axes)
                if m in table.get(a, table[UNNAMED]) and left[i] >= n and left[i] % n == 0]
        pool = [i for i in fits if not split[i]] or fits
        if pool:
            best = max(pool, key=lambda i: (left[i], -i))
            split[best].append(m)
            left[best] //= n
    entries = [None if not s else s[0] if len(s) == 1 else tuple(s) for s in split]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _tail(path) -> tuple:
    """The trailing dict keys of a key path: a parameter's path inside params, or inside an optimizer
    state's tree that mirrors them (Adam's mu, Muon's momentum, ...)."""
    keys = []
    for k in reversed(path):
        if not isinstance(k, jax.tree_util.DictKey):
            break
        keys.append(k.key)
    return tuple(reversed(keys))


def _schema_axes(config: Optional[GPTConfig]) -> dict:
    """{param path: logical axes} of `config`'s params (empty without a config)."""
    if config is None:
        return {}
    from flax import traverse_util
    return {p: info.axes for p, info in traverse_util.flatten_dict(param_schema(config)).items()}


def leaf_axes(path, shape: Sequence[int], named: dict) -> tuple:
    """The logical axes of a state leaf: its parameter's (matched by the longest tail of its dict keys
    that names one of the same rank), else `unnamed` for each dimension."""
    tail = _tail(path)
    for i in range(len(tail)):
        axes = named.get(tail[i:])
        if axes is not None and len(axes) == len(shape):
            return axes
    return (UNNAMED,) * len(shape)


def tree_specs(tree, config: Optional[GPTConfig], mesh_shape: dict, table: Optional[Rules] = None):
    """A PartitionSpec for every leaf of `tree` (params, a TrainState, optimizer state; arrays or shape
    structs): each parameter, and each optimizer leaf that mirrors one, by its logical axes."""
    named, table = _schema_axes(config), table or rules()

    def spec(path, x):
        shape = tuple(getattr(x, "shape", ()))
        return logical_spec(leaf_axes(path, shape, named), shape, mesh_shape, table)

    return jax.tree_util.tree_map_with_path(spec, tree)


def tree_shardings(tree, config: Optional[GPTConfig], mesh, table: Optional[Rules] = None):
    """NamedShardings on `mesh` for every leaf of `tree`, by the rules (tree_specs)."""
    specs = tree_specs(tree, config, dict(mesh.shape), table)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def shard_params(params, config: GPTConfig, mesh, table: RulesLike = None):
    """`params` placed on `mesh` by the rules: e.g. for `generate` split over a tensor axis."""
    table = table if isinstance(table, dict) else rules(table)
    return jax.device_put(params, tree_shardings(params, config, mesh, table))
