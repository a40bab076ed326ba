"""float32 against bfloat16 training steps in one process, alternating, as train.py runs them.

python bench/dtype_ab.py [--config baby|6l] [--per-call K] [--rounds 5] [--kernels auto]
                         [--attention-standin] [--attention-xla]

Both variants are compiled first; then each round times one call of K scanned steps (`runner.steps`, the
path train.py takes with train.steps_per_call = K) of float32, then of bfloat16, so that both see the same
state of the machine. Prints the median ms per step of each and their ratio (the issue-16 target: bf16 at
least 1.5x float32 on a CPU with AVX512_BF16 or AMX). Nothing else should run meanwhile.

`--attention-standin` is an ablation, not a model: both variants (and a third and fourth, the real ones)
are built, and the stand-in pair replaces the CPU kernels' causal attention by (q + k + v) / 3, which
keeps the q/k/v projection and its gradients but does no attention. The difference is attention's cost
inside the step, and the stand-in's time a floor no attention kernel can go below. `--attention-xla`
likewise adds both dtypes with the CPU backend's attention in XLA (`cpu.blocked_causal_attention`), the
A/B of the native attention kernel (backends/attention.cc) inside the step. Each variant is a Backend
value handed to the runner (jaxgpt/backends/).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxgpt.backends import cpu, resolve, resolve_name  # noqa: E402

from bench.common import ceilings, machine, write_results  # noqa: E402
from bench.train import CONFIGS  # noqa: E402
from jaxgpt import GPTConfig, init_params  # noqa: E402
from jaxgpt.training.config import default_config  # noqa: E402
from jaxgpt.training import create_train_state, make_optimizer, make_runner, make_schedule  # noqa: E402


def standin_attention(q_BxTxNxH, k_BxKxTxH, v_BxKxTxH, q_positions=None, kv_lengths=None):
    """Not attention: the ablation's stand-in, as cheap as a function of q, k and v can be."""
    g = q_BxTxNxH.shape[2] // k_BxKxTxH.shape[1]
    k, v = (jnp.repeat(a.swapaxes(1, 2), g, axis=2) for a in (k_BxKxTxH, v_BxKxTxH))
    return (q_BxTxNxH + k + v) * (1.0 / 3.0)


def backend_variant(name: str, kernels: str):
    """The backend as it is ("real"), with its attention in XLA only ("xla"), or with the stand-in."""
    backend = resolve(kernels)
    if name == "stand-in":
        return dataclasses.replace(backend, attention_kernels=(("dot_product", standin_attention),))
    if name == "xla":
        return dataclasses.replace(backend, attention_kernels=cpu.make_backend(False, False).attention_kernels)
    return backend


def build(name: str, dtype: str, kernels: str, attention: str = "real"):
    n_layer, n_head, n_embd, block, _, vocab = CONFIGS[name]
    cfg = GPTConfig(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                    dtype=dtype, kernels=kernels)
    train = default_config().train
    opt = make_optimizer(train)
    runner = make_runner("pmap", cfg, opt, 1, make_schedule(train), backend=backend_variant(attention, kernels))
    return runner, runner.init_state(lambda: create_train_state(init_params(cfg, jax.random.key(0)), opt,
                                                                 jax.random.key(1)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="6l", choices=sorted(CONFIGS))
    p.add_argument("--per-call", type=int, default=None, help="steps per call (default: 10 baby, 2 6l)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kernels", default="auto", choices=["auto", "portable", "cpu"])
    p.add_argument("--attention-standin", action="store_true",
                   help="also time both dtypes with attention replaced by a stand-in (CPU kernels only)")
    p.add_argument("--attention-xla", action="store_true",
                   help="also time both dtypes with the CPU kernels' attention in XLA, not native (CPU kernels only)")
    args = p.parse_args()
    for flag in ("standin", "xla"):
        if getattr(args, f"attention_{flag}") and resolve_name(args.kernels) != "cpu":
            p.error(f"--attention-{flag} replaces the CPU kernels' attention; it needs --kernels cpu (or auto on a CPU)")
    k = args.per_call or (10 if args.config == "baby" else 2)
    _, _, _, block, batch, vocab = CONFIGS[args.config]
    data = np.random.default_rng(0).integers(0, vocab, (k, batch, block + 1)).astype(np.int32)
    xs, ys = data[..., :-1], data[..., 1:]
    variants = {}
    chosen = ["real"] + ["stand-in"] * args.attention_standin + ["xla"] * args.attention_xla
    for attention in chosen:
        for dtype in ("float32", "bfloat16"):
            runner, state = build(args.config, dtype, args.kernels, attention)
            state, metrics = runner.steps(state, xs, ys)  # compile
            jax.block_until_ready(metrics)
            key = dtype if attention == "real" else f"{dtype}, attention {attention}"
            variants[key] = {"runner": runner, "state": state, "ms": []}
    for _ in range(args.rounds):
        for v in variants.values():
            t0 = time.perf_counter()
            v["state"], metrics = v["runner"].steps(v["state"], xs, ys)
            jax.block_until_ready(metrics)
            v["ms"].append((time.perf_counter() - t0) / k * 1e3)
    ms = {key: statistics.median(v["ms"]) for key, v in variants.items()}
    ratio = ms["float32"] / ms["bfloat16"]
    print(f"{args.config}, {k} steps per call, median of {args.rounds}: float32 {ms['float32']:.1f} ms/step, "
          f"bfloat16 {ms['bfloat16']:.1f} ms/step: bf16 is {ratio:.2f}x float32 (target >= 1.5x)")
    for dtype in ("float32", "bfloat16") if args.attention_standin else ():
        standin = ms[f"{dtype}, attention stand-in"]
        print(f"  {dtype} with the attention stand-in: {standin:.1f} ms/step; attention costs "
              f"{ms[dtype] - standin:.1f} ms/step ({100 * (ms[dtype] - standin) / ms[dtype]:.0f}% of the step)")
    if args.attention_xla:
        xla = {d: ms[f"{d}, attention xla"] for d in ("float32", "bfloat16")}
        print(f"  attention in XLA instead: float32 {xla['float32']:.1f} ms/step, bfloat16 {xla['bfloat16']:.1f} "
              f"ms/step: bf16 {xla['float32'] / xla['bfloat16']:.2f}x float32")
    results = {"machine": machine(), "ceilings": ceilings(), "settings": {**vars(args), "per_call": k},
               "ms_per_step": ms, "all_ms": {d: v["ms"] for d, v in variants.items()}, "bf16_speedup": ratio}
    name = f"dtype_ab_{args.config}" + "".join(f"_attention_{a.replace('-', '')}" for a in chosen[1:])
    print(f"results: {write_results(name, results)}")


if __name__ == "__main__":
    main()
