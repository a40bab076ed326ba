"""Backend kernels behind one switch, `GPTConfig.kernels`.

`"portable"` is the core as written in attention.py, ops.py, cache.py and model.py: JAX's standard
primitives, right on GPU, TPU and CPU. `"cpu"` swaps in kernels/cpu.py, implementations of the same
functions that XLA's CPU backend runs faster (and, for the float32 decode step's matmul, one native kernel
called through XLA's FFI: native.py, rows.cc). `"auto"` (the default) picks `"cpu"` when JAX's default
backend is the CPU and `"portable"` everywhere else; the environment variable JAXGPT_KERNELS=portable
(or cpu) makes "auto" pick that set instead, e.g. to run the whole test suite on the portable core.
Both give the same results (tests compare them).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

KERNEL_SETS = ("auto", "portable", "cpu")
# The registered attention implementations the CPU kernels compute too (the same function, faster on
# XLA:CPU); any other attention keeps its own code on every backend.
CPU_ATTENTION = ("dot_product",)


def resolve(kernels: str) -> str:
    """The kernel set `kernels` stands for on this process's default backend: "portable" or "cpu"."""
    if kernels not in KERNEL_SETS:
        raise ValueError(f"kernels must be one of {KERNEL_SETS}, got {kernels!r}")
    if kernels != "auto":
        return kernels
    forced = os.environ.get("JAXGPT_KERNELS", "")
    if forced:
        if forced not in KERNEL_SETS[1:]:
            raise ValueError(f"JAXGPT_KERNELS must be one of {KERNEL_SETS[1:]}, got {forced!r}")
        return forced
    return "cpu" if jax.default_backend() == "cpu" else "portable"


def cpu_attention(config) -> bool:
    """Whether a GPTConfig runs the CPU kernels' attention (kernels/cpu.py) rather than the registry's."""
    return resolve(config.kernels) == "cpu" and config.attention in CPU_ATTENTION


def activation_dtype(config):
    """The dtype a GPTConfig's activations travel in between its matmuls: the compute dtype, except under
    the CPU kernels, where they stay float32 and only the matmuls' operands take the compute dtype.

    XLA:CPU has no bf16 arithmetic outside its matmuls: a LayerNorm, GELU or residual add on bf16 converts
    to float32 and back, and those converts cost about what bf16 matmuls save (bench/README.md).
    """
    return jnp.dtype(jnp.float32) if resolve(config.kernels) == "cpu" else config.compute_dtype


def run_once_options(config) -> dict:
    """XLA compiler options (`jax.jit(..., compiler_options=)`) for a program that runs once, such as the
    parameter init: under the CPU kernels no LLVM optimisation, which halves its compile time (the baby
    model's init with its optimizer state: 1.6 -> 0.8 s) and costs nothing in a program run once."""
    return {"xla_backend_optimization_level": 0} if resolve(config.kernels) == "cpu" else {}


def inline_cpu_dispatch() -> bool:
    """Have JAX's CPU client run each computation on the thread that calls it (JAX's
    `jax_cpu_enable_async_dispatch=False`), unless JAXGPT_CPU_ASYNC=1. Takes effect only before JAX's
    first computation (the CLIs call it first thing); returns whether it did.

    With the default asynchronous dispatch, a computation runs on one of the CPU client's own threads, whose
    glibc arena serves any block above 64 MiB with fresh mmap pages and unmaps it on free: a program with
    large temporaries faults them in again at every call (the 6L train step: 127,000 page faults and ~100 ms
    of a 925 ms step; bench/README.md). On the calling thread they come from the main heap, which
    `cpu.tune_allocator` keeps. Only single-device computations change; on GPU/TPU only the host client is
    affected.
    """
    if os.environ.get("JAXGPT_CPU_ASYNC", "0") == "1":
        return False
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return False
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True


def cpu_dispatch() -> str:
    """"inline" where JAX's CPU client was set to run computations on the calling thread (by
    `inline_cpu_dispatch` or by hand), else "async" (JAX's default)."""
    return "async" if jax.config.values["jax_cpu_enable_async_dispatch"] else "inline"
