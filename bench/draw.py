"""The sampler's draw alone: Gumbel-max (`jax.random.categorical`'s method) against `sampling.categorical`.

python bench/draw.py [--rows 1 8 32] [--vocab 50257] [--reps 40] [--out NAME]

Each row of [rows, vocab] float32 logits drawn with its own key, as the engine draws a step's rows: the
Gumbel-max draw (noise for every token from the row's key, then the first maximum of logits + noise; what
the sampler did before 2026-12-05) and the inverse-CDF draw that replaced it (`sampling.categorical_rows`);
then `sample_rows` over the same logits with every row at temperature 1 and no filter (a draw over the
vocabulary: what an OpenAI-style request without top_k asks for), with top-k 50, and greedy. Every
function compiled first, the repetitions in turns (medians, ms a call); bench/results/draw.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxgpt  # noqa: E402
from bench.common import machine, write_results  # noqa: E402
from jaxgpt import sampling  # noqa: E402
from jaxgpt.backends.cpu import tune_allocator  # noqa: E402


def gumbel_rows(keys_S, logits_SxV):
    """The Gumbel-max draw per row (jax.random.categorical's method, with the sampler's argmax)."""
    noise = jax.vmap(lambda k: jax.random.gumbel(k, logits_SxV.shape[1:], jnp.float32))(keys_S)
    return sampling.argmax_last(logits_SxV + noise)


def rows_settings(s: int, temperature: float, top_k: int) -> sampling.RowSettings:
    keys = jax.random.key_data(jax.random.split(jax.random.key(1), s))
    return sampling.RowSettings(jnp.full((s,), temperature, jnp.float32), jnp.full((s,), top_k, jnp.int32),
                                jnp.ones((s,), jnp.float32), keys, jnp.zeros((s,), jnp.int32))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default=None, help="results file name (default draw.json)")
    args = ap.parse_args(argv)
    tune_allocator()  # as every backend's setup does: freed temporaries kept, not faulted in at each call
    results = {"machine": machine(), "cpu_flags": sorted(f for f in jaxgpt.backends.cpu.cpu_flags()
                                                         if f.startswith(("avx512", "amx", "avx2"))),
               "vocab": args.vocab, "ms": {}}
    sample = jax.jit(sampling.sample_rows)
    for s in args.rows:
        logits = jax.random.normal(jax.random.key(0), (s, args.vocab), jnp.float32) * 3
        keys = jax.random.split(jax.random.key(1), s)
        fns = {"gumbel_max": (jax.jit(gumbel_rows), (keys, logits)),
               "inverse_cdf": (jax.jit(sampling.categorical_rows), (keys, logits)),
               "sample_rows_vocab": (sample, (logits, rows_settings(s, 1.0, 0))),
               "sample_rows_top_k_50": (sample, (logits, rows_settings(s, 1.0, 50))),
               "sample_rows_greedy": (sample, (logits, rows_settings(s, 0.0, 0)))}
        for fn, a in fns.values():
            jax.block_until_ready(fn(*a))
        times = {name: [] for name in fns}
        for _ in range(args.reps):  # in turns: the machine's drift falls on all alike
            for name, (fn, a) in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*a))
                times[name].append(time.perf_counter() - t0)
        results["ms"][str(s)] = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
        print(f"rows {s:3d}: " + "  ".join(f"{name} {ms:.3f}" for name, ms in results["ms"][str(s)].items())
              + " (ms)", flush=True)
    print("wrote", write_results(args.out or "draw", results))
    return results


if __name__ == "__main__":
    main()
