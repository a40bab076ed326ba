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


def engine_summary(before: dict, after: dict, requests: int, seconds: float) -> dict:
    """How a run's load became the engine's compiled calls, from Engine.stats (or jaxgpt-serve's
    jaxgpt_engine_*_total counters) taken before and after it, over `seconds` of wall time: decode steps a
    call, the mean batch (requests generating a step) against the rows computed, milliseconds a step,
    prefill calls a request, and the share of the run spent inside compiled calls (the rest: the engine idle
    or in Python between calls)."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    if d.get("steps") and not d.get("decode_steps"):  # the paged engine's counters (EngineStats)
        return paged_summary(d, requests, seconds)
    steps, calls = int(d.get("decode_steps", 0)), int(d.get("decode_calls", 0))
    busy = d.get("decode_seconds", 0.0) + d.get("prefill_seconds", 0.0)
    return {"decode_steps": steps, "decode_calls": calls, "steps_per_call": steps / max(1, calls),
            "mean_batch": d.get("decode_rows", 0) / max(1, steps),
            "mean_width": d.get("decode_width", 0) / max(1, steps),
            "decode_ms_per_step": 1e3 * d.get("decode_seconds", 0.0) / max(1, steps),
            "prefill_calls": int(d.get("prefill_calls", 0)),
            "prefill_calls_per_request": d.get("prefill_calls", 0) / max(1, requests),
            "prefill_seconds": d.get("prefill_seconds", 0.0), "decode_seconds": d.get("decode_seconds", 0.0),
            "busy_share": busy / seconds if seconds > 0 else 0.0,
            "prefill_share": d.get("prefill_seconds", 0.0) / seconds if seconds > 0 else 0.0}


def paged_summary(d: dict, requests: int, seconds: float) -> dict:
    """engine_summary for the paged engine: its ragged steps and calls, tokens a step (decode and prompt),
    padding, milliseconds a step, the share of the run in compiled calls and on its thread outside them."""
    steps, calls = int(d.get("steps", 0)), int(d.get("calls", 0))
    return {"paged": True, "steps": steps, "calls": calls, "steps_per_call": steps / max(1, calls),
            "decode_tokens_per_step": d.get("decode_tokens", 0) / max(1, steps),
            "prompt_tokens_per_step": d.get("prompt_tokens", 0) / max(1, steps),
            "padding_share": d.get("padding_tokens", 0) / max(1, d.get("padding_tokens", 0) + d.get("decode_tokens", 0)
                                                           + d.get("prompt_tokens", 0)),
            "ms_per_step": 1e3 * d.get("step_seconds", 0.0) / max(1, steps),
            "busy_share": d.get("step_seconds", 0.0) / seconds if seconds > 0 else 0.0,
            "host_share": d.get("host_seconds", 0.0) / seconds if seconds > 0 else 0.0,
            "prefix_hits": int(d.get("prefix_hits", 0)), "preemptions": int(d.get("preemptions", 0))}


def format_engine_summary(s: dict) -> str:
    if s.get("paged"):
        return (f"paged engine: {s['steps']} steps in {s['calls']} calls ({s['steps_per_call']:.2f} a call), "
                f"{s['decode_tokens_per_step']:.1f} decode + {s['prompt_tokens_per_step']:.1f} prompt tokens a step "
                f"({100 * s['padding_share']:.0f}% padding), {s['ms_per_step']:.1f} ms a step; in compiled calls "
                f"{100 * s['busy_share']:.0f}% of the run, its thread outside them {100 * s['host_share']:.1f}%; "
                f"{s['prefix_hits']} prefix-cache tokens, {s['preemptions']} preemptions")
    return (f"engine: {s['decode_steps']} steps in {s['decode_calls']} calls ({s['steps_per_call']:.2f} a call), "
            f"mean batch {s['mean_batch']:.1f} of {s['mean_width']:.1f} rows, {s['decode_ms_per_step']:.1f} ms a step; "
            f"{s['prefill_calls']} prefill calls ({s['prefill_calls_per_request']:.2f} a request); in compiled calls "
            f"{100 * s['busy_share']:.0f}% of the run (prefill {100 * s['prefill_share']:.0f}%)")
