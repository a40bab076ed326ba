"""Backends: one `Backend` value (base.py) chosen once by `resolve`, handed to the model, step and decoder.

- `portable`: JAX's standard primitives as attention.py, ops.py and cache.py write them; right everywhere,
  the reference the others are tested against.
- `cpu`: XLA:CPU's faster forms and, on CPUs where they measured faster, native kernels (cpu.py, native.py).
- `tpu`: Pallas splash attention for self-attention (tpu.py, tpu_attention.py).
- `gpu`: the Pallas GPU flash-attention kernel for self-attention (gpu.py, gpu_attention.py).

`GPTConfig.kernels` names one, or "auto" (the default): JAXGPT_KERNELS if set, else by platform (cpu on a
CPU, tpu on a TPU, gpu on an NVIDIA GPU, portable elsewhere). The tpu and gpu backends run their Pallas
kernels in the interpreter off their platform. JAXGPT_NATIVE=0 turns the native CPU kernels off.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

from jaxgpt.backends import cpu, gpu, tpu
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
    return _BY_PLATFORM.get(platform or jax.default_backend(), "portable")


_BY_PLATFORM = {"cpu": "cpu", "tpu": "tpu", "gpu": "gpu", "cuda": "gpu"}


def cpu_backend(flags: Optional[frozenset] = None) -> Backend:
    """The CPU backend for a CPU with these feature flags (default: this one's)."""
    flags = cpu.cpu_flags() if flags is None else flags
    enabled = os.environ.get("JAXGPT_NATIVE", "1") != "0"
    native_ok = enabled and cpu.native_kernels_pay(flags)
    return cpu.make_backend(native_decode=native_ok, native_attention=native_ok,
                            fast_bf16=cpu.has_bf16_matmul(flags),
                            native_serving=enabled and cpu.native_serving_kernels_pay(flags),
                            float_rows=cpu.native_float_rows(flags) if enabled else 0)


def resolve(config, platform: Optional[str] = None) -> Backend:
    """The Backend for a GPTConfig (its `kernels` field) or a backend name, for programs that run on
    `platform` (default: JAX's default backend; `jaxgpt-aot` passes its target's)."""
    if not isinstance(config, str) and not isinstance(getattr(config, "kernels", None), str):
        raise TypeError(f"resolve takes a GPTConfig or a backend name (one of {BACKEND_NAMES}), got {config!r}")
    name = resolve_name(config if isinstance(config, str) else config.kernels, platform)
    if name == "cpu":
        return cpu_backend()
    if name in ("tpu", "gpu"):
        on = platform or jax.default_backend()
        native_platform = (on == "tpu") if name == "tpu" else on in ("gpu", "cuda")
        return (tpu if name == "tpu" else gpu).make_backend(interpret=not native_platform)
    return PORTABLE
