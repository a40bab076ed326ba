"""Shared benchmark helpers: the machine's own ceilings, timing with medians, JSON results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from jaxgpt.backends.cpu import inline_cpu_dispatch

# as the CLIs run (jaxgpt-train, jaxgpt-sample): computations on the calling thread; JAXGPT_CPU_ASYNC=1 for
# JAX's default asynchronous CPU dispatch
INLINE_CPU_DISPATCH = inline_cpu_dispatch()


def median_time(fn, reps: int = 5) -> tuple[float, list]:
    """Median wall time of fn() (which must block until done) over `reps` runs, and all times."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def matmul_flops(dtype=jnp.float32, n: int = 2048, reps: int = 5) -> float:
    """Measured FLOP/s of an n^3 matmul with float32 accumulation and output."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()
    t, _ = median_time(lambda: f(a, a).block_until_ready(), reps)
    return 2 * n**3 / t


def read_bandwidth(mbytes: int = 512, reps: int = 5) -> float:
    """Measured bytes/s of a jitted sum over an fp32 array of `mbytes` MB."""
    x = jnp.ones((mbytes * 2**20 // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()
    t, _ = median_time(lambda: f(x).block_until_ready(), reps)
    return x.nbytes / t


def ceilings() -> dict:
    return {"matmul_fp32_flops": matmul_flops(jnp.float32), "matmul_bf16_flops": matmul_flops(jnp.bfloat16),
            "read_bytes_per_s": read_bandwidth()}


def machine() -> dict:
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
            "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "cpu_dispatch": "inline" if INLINE_CPU_DISPATCH else "async"}


def write_results(name: str, results: dict) -> str:
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    return path
