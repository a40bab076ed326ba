"""The targets jaxgpt-aot compiles for: the hardware catalogue (TPU generations, NVIDIA GPUs), parsing a
--target, the compile-only devices of one (libtpu's or the CUDA plugin's) and the environment they need.
Nothing here compiles a program."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Optional

GIB = 2 ** 30

# Per-chip HBM (datasheets), how many chips one host of that generation holds in a slice, and the largest
# slice Cloud TPU offers (its docs' tables, checked 2026-12: v4 a 4096-chip pod of 16x16x16, v5p 16x16x24
# = 6144 chips, v5e and v6e 2-D pods of 16x16 = 256). libtpu describes larger topologies but aborts the
# process when it compiles for some of them (v5e: "Check failed: chip_bounds().x <= 16").
TPU_CHIPS = {
    "v4": {"memory_bytes": 32 * GIB, "host_chips": (2, 2, 1), "megacore": True, "max_shape": (16, 16, 16)},
    "v5e": {"memory_bytes": 16 * GIB, "host_chips": (2, 4, 1), "megacore": False, "max_shape": (16, 16, 1)},
    "v5p": {"memory_bytes": 95 * 10 ** 9, "host_chips": (2, 2, 1), "megacore": True, "max_shape": (16, 16, 24)},
    "v6e": {"memory_bytes": 32 * GIB, "host_chips": (2, 4, 1), "megacore": False, "max_shape": (16, 16, 1)},
}
TPU_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e"}

# NVIDIA datasheet figures (SXM parts): SMs, boost clock, HBM (the bytes the driver reports), bandwidth,
# L2. Hopper's per-SM limits are shared by both.
GPU_SPECS = {
    "h100": {"name": "NVIDIA H100 80GB HBM3", "sms": 132, "clock_ghz": 1.98, "memory_bytes": 81559 * 2 ** 20,
             "bandwidth": 3.35e12, "l2_bytes": 50 * 2 ** 20},
    "h200": {"name": "NVIDIA H200", "sms": 132, "clock_ghz": 1.98, "memory_bytes": 143771 * 2 ** 20,
             "bandwidth": 4.8e12, "l2_bytes": 50 * 2 ** 20},
}
# JAX's GPU client preallocates this share of device memory for XLA's buffers (XLA_PYTHON_CLIENT_MEM_FRACTION)
GPU_MEM_FRACTION = 0.75

class AotError(ValueError):
    """A target, config or environment that cannot be compiled for; the message is one line."""



@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed --target: platform 'tpu' or 'gpu', the chip or GPU kind, its shape, and slices/hosts."""

    spec: str
    platform: str
    kind: str
    shape: tuple[int, ...]
    slices: int = 1

    @property
    def chips(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.slices

    def __str__(self) -> str:
        return self.spec + (f" x {self.slices} slices" if self.slices > 1 else "")


def parse_target(text: str, slices: int = 1) -> Target:
    """'tpu:v5e:2x4', 'tpu:v4:2x2x1', 'gpu:h100:8', ... -> Target; AotError naming what is wrong."""
    usage = "use tpu:GEN:TOPOLOGY (e.g. tpu:v5e:2x4, tpu:v4:2x2x1, tpu:v5p:2x2x1, tpu:v6e:2x2) or gpu:KIND:COUNT " \
            f"(KIND one of {sorted(GPU_SPECS)}, e.g. gpu:h100:8)"
    if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
        raise AotError(f"--slices must be an integer >= 1, got {slices!r}")
    parts = (text or "").strip().lower().split(":")
    if len(parts) != 3 or not all(parts):
        raise AotError(f"bad --target {text!r}: {usage}")
    platform, kind, shape = parts
    if platform == "tpu":
        kind = TPU_ALIASES.get(kind, kind)
        if kind not in TPU_CHIPS:
            raise AotError(f"bad --target {text!r}: unknown TPU generation {kind!r}; known are {sorted(TPU_CHIPS)}")
        dims = shape.split("x")
        if not 2 <= len(dims) <= 3 or not all(_COUNT_RE.match(d) and int(d) > 0 for d in dims):
            raise AotError(f"bad --target {text!r}: the topology {shape!r} must be chip counts per axis like "
                           "2x4 or 2x2x1")
        dims = tuple(int(d) for d in dims) + (1,) * (3 - len(dims))
        target = Target(text, "tpu", kind, dims, slices)
        tpu_host_bounds(target)  # refuses a slice larger than the generation's, or not made of whole hosts
        return target
    if platform in ("gpu", "cuda"):
        if kind not in GPU_SPECS:
            raise AotError(f"bad --target {text!r}: unknown GPU {kind!r}; known are {sorted(GPU_SPECS)}")
        if not _COUNT_RE.match(shape) or int(shape) < 1:
            raise AotError(f"bad --target {text!r}: the GPU count {shape!r} must be a positive integer")
        return Target(text, "gpu", kind, (int(shape),), slices)
    raise AotError(f"bad --target {text!r}: unknown platform {platform!r}; {usage}")


_COUNT_RE = re.compile(r"[0-9]+\Z")  # ASCII digits only: str.isdigit also takes "²", which int() refuses


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape if len(shape) < 3 or shape[2] > 1 else shape[:2]))


def tpu_host_bounds(target: Target) -> tuple[int, int, int]:
    """The chips per host (x, y, z) of a TPU target's slice, for libtpu's `chips_per_host_bounds`; AotError
    for a slice the generation does not have: an axis beyond its largest slice (in any order of the
    axes), a third axis on a 2-D generation, or a slice of several hosts that whole hosts do not tile."""
    chip, shape = TPU_CHIPS[target.kind], target.shape
    largest = chip["max_shape"]
    where = f"bad --target {target.spec!r}: "
    if largest[2] == 1 and shape[2] > 1:
        raise AotError(where + f"{target.kind} slices are 2-D (AxB, at most {_shape_text(largest)}); got "
                       f"{_shape_text(shape)}")
    if any(a > b for a, b in zip(sorted(shape), sorted(largest))):
        n = largest[0] * largest[1] * largest[2]
        raise AotError(where + f"the largest {target.kind} slice is {_shape_text(largest)} ({n} chips); got "
                       f"{_shape_text(shape)}: for more chips add slices (--slices=N)")
    host = tuple(min(a, b) for a, b in zip(chip["host_chips"], shape))
    if all(t % h == 0 for t, h in zip(shape, host)):
        return host
    per_host = chip["host_chips"][0] * chip["host_chips"][1] * chip["host_chips"][2]
    if target.chips // target.slices <= per_host:  # a slice within one host
        return shape
    raise AotError(where + f"a {target.kind} slice of more than one host ({per_host} chips) is whole hosts of "
                   f"{_shape_text(chip['host_chips'])} chips; {_shape_text(shape)} is not (e.g. "
                   f"{'2x2x2, 2x4x4, 4x4x4' if largest[2] > 1 else '4x4, 4x8, 8x16, 16x16'})")


def gpu_target_config(kind: str) -> str:
    """A GpuTargetConfigProto in text form for a GPU of GPU_SPECS, from its datasheet figures."""
    s = GPU_SPECS[kind]
    fields = {
        "threads_per_block_limit": 1024, "threads_per_warp": 32,
        "shared_memory_per_block": 48 * 1024, "shared_memory_per_core": 228 * 1024,
        "shared_memory_per_block_optin": 227 * 1024, "threads_per_core_limit": 2048,
        "core_count": s["sms"], "fpus_per_core": 128,
        "block_dim_limit_x": 2 ** 31 - 1, "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
        "memory_bandwidth": int(s["bandwidth"]), "l2_cache_size": s["l2_bytes"], "clock_rate_ghz": s["clock_ghz"],
        "device_memory_size": s["memory_bytes"],
        "registers_per_core_limit": 65536, "registers_per_block_limit": 65536,
    }
    body = "\n".join(f"  {k}: {v}" for k, v in fields.items())
    return (f"gpu_device_info {{\n{body}\n  cuda_compute_capability {{ major: 9 minor: 0 }}\n}}\n"
            f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 8 }}\ndevice_description_str: "{s["name"]}"\n')


def prepare_environment() -> None:
    """Set up for compile-only devices, before JAX's first computation: the CPU stays the default
    backend (no TPU or GPU runtime starts), libtpu is told it is on no TPU VM, and the CUDA plugin skips
    its check for CUDA libraries (none are needed to compile). Only jaxgpt-aot and its tests call this."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: several processes may load libtpu at once
    import jax
    from jax._src import xla_bridge

    if not jax.config.jax_platforms and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


def missing_extra() -> Optional[str]:
    """Why compiling for accelerators cannot work here (a missing package), or None."""
    import importlib.util
    need = [("libtpu", "libtpu"), ("jax_plugins.xla_cuda12", "jax-cuda12-plugin"),
            ("jax_cuda12_plugin", "jax-cuda12-pjrt")]
    missing = []
    for module, package in need:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(package)
    if missing:
        return f"{', '.join(missing)} not installed; pip install -e \".[aot]\" installs the compile-only stacks"
    return None


@dataclasses.dataclass
class Devices:
    """Compile-only devices of a target, in the order a 1-D mesh over them should use."""

    target: Target
    devices: list
    device_kind: str
    memory_bytes: int
    limit_bytes: int  # what the compiled program may use per device


def target_devices(target: Target) -> Devices:
    """The target's compile-only devices (libtpu's or the CUDA plugin's); AotError if they cannot be made."""
    from jax.experimental import mesh_utils, topologies

    reason = missing_extra()
    if reason:
        raise AotError(f"cannot compile for {target}: {reason}")
    if target.platform == "tpu":
        chip = TPU_CHIPS[target.kind]
        host = tpu_host_bounds(target)
        name = f"{target.kind}:{_shape_text(target.shape)}"
        try:
            topo = topologies.get_topology_desc(
                topology_name=name, platform="tpu", chip_config_name="megacore" if chip["megacore"] else "default",
                chips_per_host_bounds=host, num_slices=target.slices, wrap=(False,) * 3)
        except Exception as e:  # libtpu's own words for a topology it does not know
            raise AotError(f"libtpu cannot describe the topology {name} ({_first_line(e)})") from None
        memory = limit = chip["memory_bytes"]  # (the compiler enforces its own limit, slightly less)
    else:
        spec = GPU_SPECS[target.kind]
        fraction = gpu_mem_fraction()  # (before the CUDA plugin starts: it reads the variable too)
        try:
            topo = topologies.get_topology_desc(
                "", platform="cuda", topology=f"1x{target.slices}x{target.shape[0]}",
                target_config=gpu_target_config(target.kind))
        except Exception as e:
            raise AotError(f"the CUDA plugin cannot describe {target} ({_first_line(e)})") from None
        memory = spec["memory_bytes"]
        limit = int(memory * fraction)
    devices = list(topo.devices)
    try:  # the order that puts mesh neighbours on physical neighbours (rings over ICI)
        devices = list(mesh_utils.create_device_mesh((len(devices),), devices).flat)
    except Exception:
        pass
    return Devices(target, devices, devices[0].device_kind, memory, limit)


def gpu_mem_fraction() -> float:
    """XLA_PYTHON_CLIENT_MEM_FRACTION, the share of GPU memory JAX's client gives XLA (default 0.75);
    AotError unless it is a number in (0, 1]."""
    text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if text is None:
        return GPU_MEM_FRACTION
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise AotError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} must be a number in (0, 1] (the share of each "
                       f"GPU's memory JAX gives XLA; unset: {GPU_MEM_FRACTION})")
    return value


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines() or [type(e).__name__])[0][:300]
