"""Decode benchmark: jaxgpt.generate on the GPT-2 124M shape with random weights.

python bench/decode.py [--batch 1 8] [--dtypes float32 bfloat16] [--reps 3]

16-token prompt, 128 new tokens, top-k 50 sampling. Reports tokens/s (median of reps, compile excluded),
compile time (first call minus a warm call), and the achieved bytes/s of weights plus KV cache read per
decode step over the machine's measured read bandwidth.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxgpt  # noqa: E402
from bench.common import ceilings, machine, median_time, write_results  # noqa: E402


def gpt2_config(dtype: str) -> jaxgpt.GPTConfig:
    return jaxgpt.GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768,
                            dtype=dtype, param_dtype=dtype)


def run(batch: int, dtype: str, prompt_len: int, new_tokens: int, reps: int, bandwidth: float) -> dict:
    cfg = gpt2_config(dtype)
    params = jaxgpt.init_params(cfg, jax.random.key(0))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt_len))

    def call():
        out = jaxgpt.generate(params, cfg, prompts, new_tokens, jax.random.key(1), temperature=1.0, top_k=50)
        out.tokens.block_until_ready()

    t0 = time.perf_counter()
    call()
    first = time.perf_counter() - t0
    t, times = median_time(call, reps)
    n_params = jaxgpt.count_params(params)
    itemsize = np.dtype(cfg.dtype).itemsize
    # per decode step: every weight once (wpe: one row, ignored) plus the whole allocated cache
    cache = jaxgpt.cache_bytes(cfg, batch, prompt_len + new_tokens)
    bytes_per_step = (n_params - cfg.block_size * cfg.n_embd) * itemsize + cache
    steps_per_s = new_tokens / t
    return {"batch": batch, "dtype": dtype, "tokens_per_s": batch * new_tokens / t, "seconds": t,
            "all_seconds": times, "compile_s": first - t, "kv_cache_bytes": cache,
            "bytes_per_step": bytes_per_step, "achieved_read_bytes_per_s": bytes_per_step * steps_per_s,
            "fraction_of_read_bandwidth": bytes_per_step * steps_per_s / bandwidth}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    ceil = ceilings()
    rows = [run(b, d, args.prompt_len, args.new_tokens, args.reps, ceil["read_bytes_per_s"])
            for d in args.dtypes for b in args.batch]
    path = write_results("decode", {"machine": machine(), "ceilings": ceil, "settings": vars(args), "runs": rows})
    print(f"read bandwidth {ceil['read_bytes_per_s'] / 1e9:.1f} GB/s, fp32 matmul "
          f"{ceil['matmul_fp32_flops'] / 1e9:.0f} GFLOP/s, bf16 {ceil['matmul_bf16_flops'] / 1e9:.0f} GFLOP/s")
    print(f"{'dtype':>9} {'batch':>5} {'tok/s':>8} {'compile s':>9} {'cache MB':>8} {'% read bw':>9}")
    for r in rows:
        print(f"{r['dtype']:>9} {r['batch']:>5} {r['tokens_per_s']:8.1f} {r['compile_s']:9.2f} "
              f"{r['kv_cache_bytes'] / 2**20:8.1f} {100 * r['fraction_of_read_bandwidth']:8.1f}%")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
