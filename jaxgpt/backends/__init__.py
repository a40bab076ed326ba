"""Backends: one `Backend` value (base.py) chosen once by `resolve`, handed to the model, step and decoder.

- `portable`: JAX's standard primitives as attention.py, ops.py and cache.py write them; right everywhere,
  the reference the others are tested against.
- `cpu`: XLA:CPU's faster forms and, on CPUs where they measured faster, native kernels (cpu.py, native.py).

`GPTConfig.kernels` names one, or "auto" (the default): JAXGPT_KERNELS if set, else by platform (the CPU
backend on a CPU, portable elsewhere). JAXGPT_NATIVE=0 turns the native CPU kernels off.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

from jaxgpt.backends import cpu
from jaxgpt.backends.base import PORTABLE, Backend, DecodeWeights, decode_weights
from jaxgpt.registry import BACKEND_NAMES

__all__ = ["Backend", "DecodeWeights", "decode_weights", "resolve", "resolve_name", "BACKEND_NAMES"]


def resolve_name(kernels: str, platform: Optional[str] = None) -> str:
    """The backend that `kernels` ("auto" or a name) stands for on `platform` (default: JAX's)."""
    if kernels not in BACKEND_NAMES:
        raise ValueError(f"kernels must be one of {BACKEND_NAMES}, got {kernels!r}")
    if kernels != "auto":
        return kernels
    forced = os.environ.get("JAXGPT_KERNELS", "")
    if forced:
        if forced not in BACKEND_NAMES[1:]:
            raise ValueError(f"JAXGPT_KERNELS must be one of {BACKEND_NAMES[1:]}, got {forced!r}")
        return forced
    platform = platform or jax.default_backend()
    return "cpu" if platform == "cpu" else "portable"


def cpu_backend(flags: Optional[frozenset] = None) -> Backend:
    """The CPU backend for a CPU with these feature flags (default: this one's)."""
    flags = cpu.cpu_flags() if flags is None else flags
    native_ok = os.environ.get("JAXGPT_NATIVE", "1") != "0" and cpu.native_kernels_pay(flags)
    return cpu.make_backend(native_decode=native_ok, native_attention=native_ok)


def resolve(config, platform: Optional[str] = None) -> Backend:
    """The Backend for a GPTConfig (its `kernels` field) or a backend name, on `platform`."""
    name = resolve_name(config if isinstance(config, str) else config.kernels, platform)
    if name == "cpu":
        return cpu_backend()
    return PORTABLE
