"""The float32 decode matmul: the native kernel (rows.cc, `native.rows_matmul` over packed panels) against
XLA's float32 dot, at the row counts of decode steps and small prompt steps.

python bench/float_rows.py [--rows 1 8 16 32 64 128] [--reps 7] [--out float_rows]

GPT-2 124M's kernels: 768 -> 2304 (qkv), 3072 -> 768 (the MLP's projection), 768 -> 3072 (the MLP's first)
and the head, 768 -> 50257. Each case multiplies 12 distinct random kernels in one jitted call (1 for the
head), so that the weights come from memory as in a decode step; the time of one kernel is the call's over
12, the minimum of --reps calls. For each, G multiply-adds a second and native / XLA. Rows past the native
kernel's limit (native.MAX_FLOAT_ROWS) are XLA's alone. The CPU backend multiplies float32 decode steps of
up to `cpu.native_float_rows` rows with the native kernel (16 with AVX-512, 64 with AVX2 + FMA).
Results: bench/results/float_rows.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import machine, write_results  # noqa: E402
from jaxgpt.backends import cpu, native  # noqa: E402

SHAPES = ((768, 2304), (3072, 768), (768, 3072), (768, 50257))


def best_seconds(f, args, reps: int, per_call: int) -> float:
    jax.block_until_ready(f(*args))  # compile
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append((time.perf_counter() - t) / per_call)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128], help="rows of x")
    ap.add_argument("--reps", type=int, default=7, help="timed calls per case (the minimum is reported)")
    ap.add_argument("--out", default="float_rows", help="results file name in bench/results/")
    args = ap.parse_args()
    if not native.available():
        sys.exit(f"the native kernels cannot be built here: {native._state.get('why')}")
    rng = np.random.default_rng(0)
    flags = sorted(f for f in cpu.cpu_flags() if f.startswith(("avx", "fma", "amx")))
    print(f"CPU flags: {' '.join(flags)}; the backend's native float32 rows: {cpu.native_float_rows(cpu.cpu_flags())}")
    rows_out = []
    for n_in, n_out in SHAPES:
        count = 1 if n_out > 10000 else 12
        ws = [jax.device_put(rng.standard_normal((n_in, n_out)).astype(np.float32)) for _ in range(count)]
        panels = [native.pack(w) for w in ws]
        xla = jax.jit(lambda x, ws: [x @ w for w in ws])
        mine = jax.jit(lambda x, ps, n=n_out: [native.rows_matmul(x, p, n) for p in ps])
        for m in args.rows:
            x = jax.device_put(rng.standard_normal((m, n_in)).astype(np.float32))  # (on the device: no copies timed)
            row = {"shape": [n_in, n_out], "rows": m, "xla_s": best_seconds(xla, (x, ws), args.reps, count)}
            if m <= native.MAX_FLOAT_ROWS:
                row["native_s"] = best_seconds(mine, (x, panels), args.reps, count)
            macs = m * n_in * n_out
            line = f"{n_in:5d} -> {n_out:5d}  rows {m:4d}: XLA {row['xla_s'] * 1e3:8.3f} ms"
            line += f" ({macs / row['xla_s'] / 1e9:5.1f} G)"
            if "native_s" in row:
                line += (f"  native {row['native_s'] * 1e3:8.3f} ms ({macs / row['native_s'] / 1e9:5.1f} G)"
                         f"  native / XLA {row['native_s'] / row['xla_s']:.2f}")
            print(line, flush=True)
            rows_out.append(row)
    path = write_results(args.out, {"machine": machine(), "cpu_flags": flags, "reps": args.reps,
                                    "native_float_rows": cpu.native_float_rows(cpu.cpu_flags()), "runs": rows_out})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
