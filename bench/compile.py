"""Compile-time benchmark: the train step against depth (unrolled and with scan_layers), and `generate`
against max_new_tokens. Also checks that `generate` compiles once per shape and setting.

python bench/compile.py [--depths 2 4 8 16] [--new-tokens 16 64 256]

Times `jit(...).lower(...).compile()` wall clock (tracing + XLA), one run each, with the persistent
compilation cache off. Width 256, 4 heads, context 128, batch 8 for training; for generate a 4-layer
GPT-2-vocabulary model with a 16-token prompt.
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
from jaxgpt.config import default_config  # noqa: E402
from jaxgpt.training import create_train_state, make_optimizer, make_schedule  # noqa: E402
from jaxgpt.training.step import make_train_step  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)


def train_compile_s(n_layer: int, scan: bool) -> float:
    cfg = GPTConfig(vocab_size=65, block_size=128, n_layer=n_layer, n_head=4, n_embd=256, scan_layers=scan)
    tc = default_config().train
    opt = make_optimizer(tc)
    state = create_train_state(init_params(cfg, jax.random.key(0)), opt, jax.random.key(1))
    x = jnp.zeros((8, 128), jnp.int32)
    step = jax.jit(make_train_step(cfg, opt, schedule=make_schedule(tc)), donate_argnums=(0,))
    t0 = time.perf_counter()
    step.lower(state, x, x).compile()
    return time.perf_counter() - t0


def generate_compile_s(new_tokens: int) -> tuple[float, int]:
    cfg = GPTConfig(vocab_size=50257, block_size=1024, n_layer=4, n_head=12, n_embd=768)
    params = init_params(cfg, jax.random.key(0))
    prompts = np.zeros((1, 16), np.int32)
    before = sampling.TRACE_COUNT
    t0 = time.perf_counter()
    out = sampling.generate(params, cfg, prompts, new_tokens, jax.random.key(1), top_k=50)
    jax.block_until_ready(out.tokens)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = sampling.generate(params, cfg, prompts + 7, new_tokens, jax.random.key(2), top_k=50)
    jax.block_until_ready(out.tokens)
    second = time.perf_counter() - t0
    return first - second, sampling.TRACE_COUNT - before  # compile ~ first call minus a warm call


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--depths", nargs="+", type=int, default=[2, 4, 8, 16])
    p.add_argument("--new-tokens", nargs="+", type=int, default=[16, 64, 256])
    args = p.parse_args()
    train_rows, gen_rows = [], []
    for depth in args.depths:
        row = {"n_layer": depth, "unrolled_s": train_compile_s(depth, False), "scan_s": train_compile_s(depth, True)}
        train_rows.append(row)
        print(f"train step compile, {depth:2d} layers: unrolled {row['unrolled_s']:6.1f}s | "
              f"scan_layers {row['scan_s']:6.1f}s", flush=True)
    for n in args.new_tokens:
        s, traces = generate_compile_s(n)
        gen_rows.append({"max_new_tokens": n, "compile_s": s, "traces_for_two_prompts": traces})
        print(f"generate compile, max_new_tokens {n:4d}: {s:5.1f}s, traced {traces}x for two prompts", flush=True)
    path = write_results("compile", {"machine": machine(), "settings": vars(args), "train_step": train_rows,
                                     "generate": gen_rows})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
