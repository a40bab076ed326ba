"""The device mesh that `train.mesh` names: its axes, their sizes, and the devices laid out on them.

`train.mesh` is a string such as "data=-1,fsdp=2", "dcn=2,data=-1,fsdp=4" (MaxText's DCN/ICI split) or
"fsdp=-1,tensor=4":

- `dcn`: across slices (the data-center network between TPU slices, or between hosts); carries batch.
- `data`: within a slice; carries batch, the state replicated along it.
- `fsdp`: within a slice; carries batch, and parameters and optimizer state are sharded along it.
- `tensor`: within a slice; does not carry batch: it splits attention's heads, the MLP's hidden width and
  the vocabulary (tensor parallelism), as the rules table says (jaxgpt/sharding.py).

Which axes carry the batch and what each splits is the rules table's (`train.logical_axis_rules`); the
above is its default. -1 stands for the devices the other axes leave (at most one -1). The axes are
always laid out in the order dcn, data, fsdp, tensor (whatever order the string names them in), so that
dcn is the outermost and tensor the innermost (its all-reduces, one per block and pass, run between the
closest chips; then fsdp's all-gathers and reduce-scatters). On several TPU slices (or, without slices,
several processes) the outermost axis whose size their count divides spans them: dcn when the mesh has
one (jax.experimental.mesh_utils' hybrid mesh).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from jaxgpt.sharding import MESH_AXES as AXES  # the only axis names, in the order the mesh lays them out

KEY = "config.train.mesh"


def _fail(problem: str):
    raise ValueError(f"{KEY}: {problem}")


def _size(name: str, text: str) -> int:
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size != -1 and size < 1:
        _fail(f"the size of axis {name!r} must be a positive integer or -1 (the rest of the devices), got {text!r}")
    return size


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
    """'data=-1,fsdp=2' -> (('data', -1), ('fsdp', 2)), in the order dcn, data, fsdp, tensor; ValueError naming
    train.mesh when it is malformed, names an unknown or repeated axis, or has more than one -1."""
    if not isinstance(text, str) or not text.strip():
        _fail(f"must name axes and sizes such as 'data=-1,fsdp=2', got {text!r}")
    sizes = {}
    for part in text.split(","):
        name, eq, value = (s.strip() for s in part.partition("="))
        if not eq or not name or not value:
            _fail(f"{part.strip()!r} is not AXIS=SIZE (the form is e.g. 'dcn=2,data=-1,fsdp=4,tensor=2'), in {text!r}")
        if name not in AXES:
            _fail(f"unknown axis {name!r} in {text!r}; the axes are {', '.join(AXES)}")
        if name in sizes:
            _fail(f"axis {name!r} appears twice in {text!r}")
        sizes[name] = _size(name, value)
    if list(sizes.values()).count(-1) > 1:
        _fail(f"at most one axis may be -1 (the rest of the devices), got {text!r}")
    return tuple((name, sizes[name]) for name in AXES if name in sizes)


def mesh_sizes(text: str, device_count: int) -> tuple[tuple[str, int], ...]:
    """The axes of `text` with -1 resolved for `device_count` devices; ValueError when the sizes do not
    multiply to the device count."""
    axes = parse_mesh(text)
    known = math.prod(size for _, size in axes if size != -1)
    if any(size == -1 for _, size in axes):
        if device_count % known:
            _fail(f"{text!r}: the other axes ({known} devices) do not divide the {device_count} devices")
        return tuple((name, device_count // known if size == -1 else size) for name, size in axes)
    if known != device_count:
        _fail(f"{text!r} is a mesh of {known} devices, but there are {device_count}; make the sizes multiply "
              f"to {device_count}, or let one axis be -1")
    return axes


def mesh_text(mesh: str, fsdp: bool) -> str:
    """The mesh a runner uses: `train.mesh`, or the shorthands 'fsdp=-1' (train.fsdp) and 'data=-1'."""
    return mesh or ("fsdp=-1" if fsdp else "data=-1")


def _granules(devices: Sequence) -> tuple[bool, int]:
    """What the outer axis should span: (True if processes rather than TPU slices, how many there are)."""
    slices = {getattr(d, "slice_index", None) for d in devices}
    if None not in slices and len(slices) > 1:
        return False, len(slices)
    return True, len({d.process_index for d in devices})


def _over_granules(shape: tuple[int, ...], granules: int):
    """(within, across) shapes for create_hybrid_device_mesh: the granules (slices or processes) along the
    first, outermost, axis that their count divides (dcn when there is one); None if none does."""
    for i, size in enumerate(shape):
        if size % granules == 0:
            across = tuple(granules if j == i else 1 for j in range(len(shape)))
            return tuple(s // a for s, a in zip(shape, across)), across
    return None


def device_grid(shape: tuple[int, ...], devices: Sequence):
    """`devices` as an array of `shape`: CPU devices in their order (process by process); accelerators
    through mesh_utils, so that neighbours on the mesh are neighbours on the chips' network, with the
    slices (or processes) along the outermost axis their count divides, dcn when there is one."""
    import numpy as np
    from jax.experimental import mesh_utils

    devices = list(devices)
    if devices[0].platform == "cpu":
        return np.array(devices).reshape(shape)
    by_process, granules = _granules(devices)
    split = _over_granules(shape, granules) if granules > 1 else None
    try:
        if split is not None:
            return mesh_utils.create_hybrid_device_mesh(*split, devices, process_is_granule=by_process)
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):  # a topology mesh_utils has no layout for
        key = (lambda d: d.process_index) if by_process else (lambda d: d.slice_index)
        return np.array(sorted(devices, key=key)).reshape(shape)  # (a stable sort: each granule's order kept)


def build_mesh(text: str, devices: Optional[Sequence] = None):
    """The jax.sharding.Mesh that `text` names over `devices` (default: every process's devices)."""
    import jax
    from jax.sharding import Mesh

    devices = list(devices if devices is not None else jax.devices())
    axes = mesh_sizes(text, len(devices))
    names = tuple(name for name, _ in axes)
    return Mesh(device_grid(tuple(size for _, size in axes), devices), names)
