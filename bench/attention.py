"""Causal self-attention alone, forward and forward+backward, against PyTorch's fused kernel.

python bench/attention.py [--configs baby 6l] [--reps 9] [--no-peer]

For each config of bench/train.py (its batch, context, heads and head size), in float32: jaxgpt's
attention under the CPU backend, native (backends/attention.cc, where it can be built) and in XLA
(`cpu.blocked_causal_attention`: query blocks of 64 that skip the masked keys), and under the portable core (the registered "dot_product", `jax.nn.dot_product_attention`), each jitted as its own
program, against `torch.nn.functional.scaled_dot_product_attention(is_causal=True)` on the same values
(the kernel nanoGPT's model calls). Reports the median ms and the rate of the causal work: 4*B*N*T*T*H/2
FLOPs forward (two matmuls over the lower triangle), three times that forward+backward, and the largest
difference of each one's output and input gradients from the portable core's (so a fast wrong kernel shows).

The in-step share of attention (how much of a training step it costs, and so the most any attention
kernel can save) is `bench/dtype_ab.py --attention-standin`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import machine, median_time, write_results  # noqa: E402
from bench.train import CONFIGS  # noqa: E402
from jaxgpt.attention import get_attention  # noqa: E402
from jaxgpt.backends import cpu, native  # noqa: E402


def shapes(name: str) -> tuple[int, int, int, int]:
    """(batch, context, heads, head size) of a bench/train.py config."""
    _, n_head, n_embd, block, batch, _ = CONFIGS[name]
    return batch, block, n_head, n_embd // n_head


def causal_flops(b: int, t: int, n: int, h: int) -> float:
    """Forward FLOPs of causal attention: q @ k.T and p @ v over the lower triangle of the score matrix."""
    return 2 * (2 * b * n * t * t * h) / 2


def time_jax(fn, q, k, v, dout, reps: int) -> tuple[dict, tuple]:
    """Timings of fn's forward and forward+backward, and the values (output, dq, dk, dv)."""
    fwd = jax.jit(fn)
    fwd_bwd = jax.jit(lambda q, k, v: jax.vjp(fn, q, k, v)[1](dout))
    out = {}
    for name, f in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        jax.block_until_ready(f(q, k, v))  # compile
        out[f"{name}_s"], _ = median_time(lambda: jax.block_until_ready(f(q, k, v)), reps)
    return out, (fwd(q, k, v),) + tuple(fwd_bwd(q, k, v))


def time_torch(q, k, v, dout, reps: int) -> tuple[dict, tuple]:
    import torch

    # torch's layout is [B, N, T, H]
    tq, tk, tv, tdo = (torch.from_numpy(np.array(a)).transpose(1, 2).contiguous() for a in (q, k, v, dout))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fwd():
        with torch.no_grad():
            sdpa(tq, tk, tv, is_causal=True)

    leaves = [a.clone().requires_grad_(True) for a in (tq, tk, tv)]

    def fwd_bwd():
        sdpa(*leaves, is_causal=True).backward(tdo)

    out = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    for name, f in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        f()
        out[f"{name}_s"], _ = median_time(f, reps)
    with torch.no_grad():
        y = sdpa(tq, tk, tv, is_causal=True)
    leaves = [a.clone().requires_grad_(True) for a in (tq, tk, tv)]
    sdpa(*leaves, is_causal=True).backward(tdo)
    values = (y,) + tuple(a.grad for a in leaves)
    return out, tuple(np.asarray(a.transpose(1, 2)) for a in values)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["baby", "6l"], choices=sorted(CONFIGS))
    p.add_argument("--reps", type=int, default=9, help="timed calls per measurement (median)")
    p.add_argument("--no-peer", action="store_true", help="skip torch's scaled_dot_product_attention")
    args = p.parse_args(argv)
    head_major = lambda a: a.swapaxes(1, 2)  # noqa: E731  [B, T, K, H] -> the registry's [B, K, T, H]
    impls = {"cpu native": native.causal_attention,
             "cpu xla": lambda q, k, v: cpu.blocked_causal_attention(q, head_major(k), head_major(v)),
             "portable": lambda q, k, v: get_attention("dot_product")(q, head_major(k), head_major(v), None, None)}
    if not native.available():
        del impls["cpu native"]
    rows = []
    for name in args.configs:
        b, t, n, h = shapes(name)
        rng = np.random.default_rng(0)
        q, k, v, dout = (jnp.asarray(rng.standard_normal((b, t, n, h), np.float32)) for _ in range(4))
        runs = {impl: time_jax(fn, q, k, v, dout, args.reps) for impl, fn in impls.items()}
        if not args.no_peer:
            runs["torch sdpa"] = time_torch(q, k, v, dout, args.reps)
        flops = causal_flops(b, t, n, h)
        reference = runs["portable"][1]
        for impl, (r, values) in runs.items():
            # the output and the three input gradients against the portable core's
            diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(ref)))) for a, ref in zip(values, reference))
            rows.append({"config": name, "shape": [b, t, n, h], "impl": impl, **r, "max_abs_diff": diff,
                         "fwd_flops_per_s": flops / r["fwd_s"], "fwd_bwd_flops_per_s": 3 * flops / r["fwd_bwd_s"]})
    print(f"{'config':>6} {'[B, T, N, H]':>16} {'impl':>12} {'fwd ms':>8} {'GFLOP/s':>8} {'fwd+bwd ms':>10} "
          f"{'GFLOP/s':>8} {'max diff':>9}")
    for r in rows:
        print(f"{r['config']:>6} {str(r['shape']):>16} {r['impl']:>12} {r['fwd_s'] * 1e3:8.2f} "
              f"{r['fwd_flops_per_s'] / 1e9:8.1f} {r['fwd_bwd_s'] * 1e3:10.2f} {r['fwd_bwd_flops_per_s'] / 1e9:8.1f} "
              f"{r['max_abs_diff']:9.1e}")
    results = {"machine": machine(), "settings": vars(args), "runs": rows}
    print(f"results: {write_results('attention', results)}")
    return results


if __name__ == "__main__":
    main()
