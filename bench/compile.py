"""Compile-time benchmark: the train step and `generate` against depth (unrolled and with scan_layers), and
`generate` against max_new_tokens; also checks that `generate` compiles once per shape and setting.

python bench/compile.py [--depths 2 8 16] [--new-tokens 16 64 256] [--kernels auto portable]

Times `jit(...).lower(...).compile()` wall clock (tracing + XLA), one run each, with the persistent
compilation cache off. Training: width 256, 4 heads, context 128, batch 8. generate: width 256, 4 heads,
GPT-2's vocabulary, a 16-token prompt; 32 new tokens for the depth sweep, 4 layers for the length sweep.
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

from bench.common import machine, write_results  # noqa: E402
from jaxgpt import GPTConfig, init_params, sampling  # noqa: E402
from jaxgpt.backends import resolve_name  # noqa: E402
from jaxgpt.training.config import default_config  # noqa: E402
from jaxgpt.training import create_train_state, make_optimizer, make_schedule  # noqa: E402
from jaxgpt.training.step import make_train_step  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)


def train_compile_s(n_layer: int, scan: bool, kernels: str) -> float:
    cfg = GPTConfig(vocab_size=65, block_size=128, n_layer=n_layer, n_head=4, n_embd=256, scan_layers=scan,
                    kernels=kernels)
    tc = default_config().train
    opt = make_optimizer(tc)
    state = jax.eval_shape(lambda: create_train_state(init_params(cfg, jax.random.key(0)), opt, jax.random.key(1)))
    x = jax.ShapeDtypeStruct((8, 128), jnp.int32)
    step = jax.jit(make_train_step(cfg, opt, schedule=make_schedule(tc)), donate_argnums=(0,))
    t0 = time.perf_counter()
    step.lower(state, x, x).compile()
    return time.perf_counter() - t0


def generate_compile_s(n_layer: int, new_tokens: int, scan: bool, kernels: str) -> float:
    cfg = GPTConfig(vocab_size=50257, block_size=512, n_layer=n_layer, n_head=4, n_embd=256, scan_layers=scan,
                    kernels=kernels)
    t0 = time.perf_counter()
    sampling.lower_generate(cfg, 1, 16, new_tokens, sampler=sampling.Sampler(1.0, 50, None, None, 0)).compile()
    return time.perf_counter() - t0


def traces_for_two_prompts(kernels: str) -> int:
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, kernels=kernels)
    params = init_params(cfg, jax.random.key(0))
    before = sampling.TRACE_COUNT
    for prompt in (np.zeros((1, 16), np.int32), np.full((1, 16), 7, np.int32)):
        jax.block_until_ready(sampling.generate(params, cfg, prompt, 8, jax.random.key(1), top_k=50).tokens)
    return sampling.TRACE_COUNT - before


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", nargs="+", type=int, default=[2, 8, 16])
    p.add_argument("--new-tokens", nargs="+", type=int, default=[16, 64, 256])
    p.add_argument("--kernels", nargs="+", default=["auto"], choices=["auto", "portable", "cpu"])
    args = p.parse_args()
    rows = []
    for kernels in args.kernels:
        name = f"{kernels} ({resolve_name(kernels)})"
        for depth in args.depths:
            row = {"kernels": kernels, "n_layer": depth,
                   "train_unrolled_s": train_compile_s(depth, False, kernels),
                   "train_scan_s": train_compile_s(depth, True, kernels),
                   "generate_unrolled_s": generate_compile_s(depth, 32, False, kernels),
                   "generate_scan_s": generate_compile_s(depth, 32, True, kernels)}
            rows.append(row)
            print(f"{name}, {depth:2d} layers: train step unrolled {row['train_unrolled_s']:5.1f}s, scan_layers "
                  f"{row['train_scan_s']:5.1f}s | generate unrolled {row['generate_unrolled_s']:5.1f}s, "
                  f"scan_layers {row['generate_scan_s']:5.1f}s", flush=True)
        for n in args.new_tokens:
            s = generate_compile_s(4, n, False, kernels)
            rows.append({"kernels": kernels, "max_new_tokens": n, "generate_s": s})
            print(f"{name}, generate with max_new_tokens {n:4d}: {s:5.1f}s", flush=True)
        traces = traces_for_two_prompts(kernels)
        rows.append({"kernels": kernels, "generate_traces_for_two_prompts": traces})
        print(f"{name}: generate traced {traces}x for two prompts of one shape", flush=True)
    path = write_results("compile", {"machine": machine(), "settings": vars(args), "runs": rows})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
