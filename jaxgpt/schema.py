"""What each parameter is, as the layer that creates it declares it: the one place the optimizer, LoRA,
decode packing, int8 quantization, the FLOP count and the weight export learn it from.

A layer says, where it creates a parameter, `declare(self, name, info)` (or `param(...)`, which also
creates it) with a `ParamInfo`: its role, one logical axis name per dimension, the LoRA target names it
answers to, whether its output feeds only its block's output, and its Hugging Face name. `param_schema(
config)` is a tree shaped like the params with a `ParamInfo` at every leaf: the declarations recorded
while `jax.eval_shape` traces the model's init (no weights are made), once per config. Nothing outside
the layers reads a parameter's name to find out what it is.

Logical axes: `layers` (the stacked blocks of scan_layers), `vocab`, `position`, `embed`, `heads` and
`kv_heads` (a flattened [heads, head_dim] dimension is named by its heads), `qkv` (attention's fused
[q | k | v] output), `head_dim`, `mlp` (the MLP's hidden width), `mix` (a handful of mixing weights).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Optional

from flax import traverse_util

from jaxgpt.config import GPTConfig
from jaxgpt.layers import stack_layers

ROLES = ("matrix", "embedding", "vector", "mixing")
AXES = ("layers", "vocab", "position", "embed", "heads", "kv_heads", "qkv", "head_dim", "mlp", "mix")
UNNAMED = "unnamed"  # the axis name of a parameter no layer declared
HEAD = ("head",)  # where the decode form of a tied head's table sits in the "prepared" collection


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One parameter, as its layer declares it.

    - `role`: "matrix" (a dense kernel [in, out]), "embedding" (a table [rows, width], looked up),
      "vector" (a bias, a norm's scale) or "mixing" (a few learned mixing weights).
    - `axes`: a logical axis name per dimension ("layers" first for the stacked blocks).
    - `muon`: Muon trains it (the blocks' matrices); AdamW trains the rest.
    - `decay`: weight decay applies to it.
    - `decode`: decoding keeps it in a backend's decode form and int8 quantizes it: a matrix as [in, out];
      an embedding as the tied head's [out, in] table (when the config ties it).
    - `targets`: LoRA target names it answers to, each with the output columns it adapts ((lo, hi), or
      None for all of them): jaxgpt's fused c_attn answers to q, k and v with a third of its columns each.
    - `output_only`: its output feeds only its block's output (remat="block" does not recompute it).
    - `block`: it belongs to a block (h_i, or the stacked h).
    - `hf_name`: its name(s) in Hugging Face's Llama layout, relative to the decoder layer for a block's
      parameter; several for a fused parameter stored split along its last axis; () where it has none.
    """

    role: str
    axes: tuple
    muon: bool = False
    decay: bool = False
    decode: bool = False
    targets: tuple = ()
    output_only: bool = False
    block: bool = False
    hf_name: tuple = ()

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"ParamInfo.role must be one of {ROLES}, got {self.role!r}")
        if isinstance(self.axes, str) or not all(isinstance(a, str) for a in self.axes):
            raise ValueError(f"ParamInfo.axes must be a tuple of axis names, got {self.axes!r}")
        object.__setattr__(self, "axes", tuple(self.axes))
        object.__setattr__(self, "hf_name", (self.hf_name,) if isinstance(self.hf_name, str) else tuple(self.hf_name))

    @property
    def w_out_in(self) -> bool:
        """Whether its decode form multiplies it as [out, in] (a table used as the head)."""
        return self.role == "embedding"

    def replace(self, **changes) -> "ParamInfo":
        return dataclasses.replace(self, **changes)


def matrix(in_axis: str, out_axis: str, *, muon: bool = True, targets: tuple = (), output_only: bool = False,
           hf_name=()) -> ParamInfo:
    """A dense kernel [in, out]: decayed, packed and quantized for decoding, trained by Muon unless `muon`
    is False (the output head)."""
    return ParamInfo("matrix", (in_axis, out_axis), muon=muon, decay=True, decode=True, targets=tuple(targets),
                     output_only=output_only, hf_name=hf_name)


def vector(axis: str, *, output_only: bool = False, hf_name=()) -> ParamInfo:
    """A bias or a norm's scale [n]: not decayed."""
    return ParamInfo("vector", (axis,), output_only=output_only, hf_name=hf_name)


def embedding(rows: str, width: str, *, head: bool = False, hf_name=()) -> ParamInfo:
    """A lookup table [rows, width]: decayed; `head`: also the (tied) output head, kept in decode form."""
    return ParamInfo("embedding", (rows, width), decay=True, decode=head, hf_name=hf_name)


# ---------------------------------------------------------------------------------------------------
# Declaring (the layers)

_LOCAL = threading.local()  # the recording open while param_schema traces an init, per thread


def _recording() -> Optional[dict]:
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def declare(module, name, info: ParamInfo) -> None:
    """Say that `module`'s parameter `name` (or a child's: a tuple path like ("ln_1", "scale")) is `info`.
    Called where the parameter is created; does nothing unless `param_schema` is tracing the model."""
    rec = _recording()
    if rec is not None:
        rec["params"][tuple(module.path) + ((name,) if isinstance(name, str) else tuple(name))] = info


def declare_block(module) -> None:
    """Say that `module` is one of the model's blocks: every parameter under it has `block=True`."""
    rec = _recording()
    if rec is not None:
        rec["blocks"].add(tuple(module.path))


def param(module, name: str, init, shape: tuple, dtype, info: ParamInfo):
    """`module.param(name, init, shape, dtype)`, declared as `info`."""
    declare(module, name, info)
    return module.param(name, init, shape, dtype)


# ---------------------------------------------------------------------------------------------------
# The schema of a config (computed once) and of a params tree

def _flat(tree) -> dict:
    return traverse_util.flatten_dict(tree) if isinstance(tree, dict) else {}


def _shape(leaf) -> Optional[tuple]:
    shape = getattr(leaf, "shape", None)
    return None if shape is None else tuple(shape)


# model.py imports this module, so it hands over at its import what only it can do (`install`): trace a
# config's init, and read a parameter that no layer declared by the names its layers give theirs
_MODEL: dict = {}


def install(trace, undeclared) -> None:
    """Called once by jaxgpt.model: `trace(config) -> abstract params` of the unrolled model (under
    `recording`), `undeclared(path, shape) -> ParamInfo` for a leaf without a declaration."""
    _MODEL.update(trace=trace, undeclared=undeclared)


def _undeclared(path: tuple, leaf) -> ParamInfo:
    return _MODEL["undeclared"](path, _shape(leaf) or ())


_KNOWN: dict = {}  # frozenset of paths -> [(shapes, flat infos)] of every schema computed in this process
_LOCK = threading.Lock()


@functools.lru_cache(maxsize=64)
def _unrolled(config: GPTConfig) -> tuple:
    """(flat infos, flat shapes) of `config`'s unrolled layout (h_0 ... h_{L-1}): the declarations made
    while its init is traced, once."""
    rec = {"params": {}, "blocks": set()}
    stack = _LOCAL.__dict__.setdefault("stack", [])
    stack.append(rec)
    try:
        abstract = _MODEL["trace"](config)
    finally:
        stack.pop()
    infos, shapes = {}, {}
    for path, leaf in _flat(abstract).items():
        info = rec["params"].get(path) or _undeclared(path, leaf)
        if any(path[:len(b)] == b for b in rec["blocks"]):
            info = info.replace(block=True)
        if len(info.axes) != leaf.ndim:
            raise ValueError(f"parameter {'/'.join(path)} has {leaf.ndim} dimensions {tuple(leaf.shape)} but was "
                             f"declared with the logical axes {info.axes}: declare one name per dimension")
        infos[path], shapes[path] = info, tuple(leaf.shape)
    return infos, shapes


@dataclasses.dataclass(frozen=True)
class _Shape:
    shape: tuple  # (a tuple would be a pytree to stack_layers, not a leaf)


def _stacked_info(*layers: ParamInfo) -> ParamInfo:
    if any(x != layers[0] for x in layers[1:]):
        raise ValueError(f"the blocks declare a parameter differently: {layers[0]} vs {layers[1:]}")
    return layers[0].replace(axes=("layers",) + layers[0].axes)


def _stack(infos: dict, shapes: dict, n_layer: int) -> tuple:
    """The unrolled (flat infos, shapes) in the stacked layout of scan_layers."""
    tree = stack_layers(traverse_util.unflatten_dict(infos), n_layer, stack=_stacked_info)
    sizes = stack_layers(traverse_util.unflatten_dict({p: _Shape(s) for p, s in shapes.items()}), n_layer,
                         stack=lambda *xs: _Shape((len(xs),) + xs[0].shape))
    return _flat(tree), {p: s.shape for p, s in _flat(sizes).items()}


def _layout(config: GPTConfig) -> tuple:
    base = config.replace(scan_layers=False, remat="none", attention="dot_product")
    infos, shapes = _unrolled(base)
    if config.scan_layers:
        infos, shapes = _stack(infos, shapes, config.n_layer)
    return infos, shapes


@functools.lru_cache(maxsize=64)
def _layouts(config: GPTConfig) -> tuple:
    """[(flat infos, flat shapes)] of `config`'s layout, then of the other one (none for blocks that
    differ from one another, which have no stacked layout); all remembered for `leaf_infos`."""
    own = _layout(config)
    layouts = [own]
    if config.scan_layers:
        layouts.append(_layout(config.replace(scan_layers=False)))
    else:
        try:
            layouts.append(_stack(*own, config.n_layer))
        except ValueError:
            pass
    with _LOCK:
        for infos, shapes in layouts:
            entries = _KNOWN.setdefault(frozenset(infos), [])
            if not any(s == shapes and i == infos for s, i in entries):
                entries.append((shapes, infos))
    return tuple(layouts)


def param_schema(config: GPTConfig) -> dict:
    """A tree shaped like `config`'s params (its layout) with the `ParamInfo` of every leaf; computed
    without making any weights, once per config."""
    return traverse_util.unflatten_dict(dict(_layouts(config)[0][0]))


def _matches(flat: dict, infos: dict, shapes: dict) -> bool:
    if set(flat) != set(infos):
        return False
    return all(_shape(leaf) is None or _shape(leaf) == shapes[path] for path, leaf in flat.items())


def leaf_infos(params, config: Optional[GPTConfig] = None) -> dict:
    """{path: ParamInfo} for every leaf of `params` (nested dicts; leaves may be arrays, tracers, shape
    structs or placeholders such as optax's MaskedNode). With `config`, its schema in whichever layout
    `params` has; without, the schema this process computed for a tree of these paths and shapes (every
    model that init_params, abstract_params or param_schema has seen). A tree that is no model's (a
    hand-made one) is read leaf by leaf by the names jaxgpt's own layers give theirs
    (model.undeclared_info)."""
    flat = _flat(params)
    if config is not None:
        entries = [(shapes, infos) for infos, shapes in _layouts(config)]
    else:
        with _LOCK:
            entries = list(_KNOWN.get(frozenset(flat), ()))
    found = [infos for shapes, infos in entries if _matches(flat, infos, shapes)]
    if found and any(f != found[0] for f in found[1:]):
        raise ValueError("two models seen in this process have parameters of these names and shapes but declare "
                         "them differently; pass the model's GPTConfig (config=) to say which")
    if found:
        return dict(found[0])
    return {path: _undeclared(path, leaf) for path, leaf in flat.items()}


def map_params(fn, params, config: Optional[GPTConfig] = None) -> dict:
    """`params` with every leaf replaced by fn(leaf, info); a leaf without a shape (optax's MaskedNode)
    is kept as it is."""
    infos = leaf_infos(params, config)
    flat = _flat(params)
    return traverse_util.unflatten_dict({p: leaf if _shape(leaf) is None else fn(leaf, infos[p])
                                         for p, leaf in flat.items()})
