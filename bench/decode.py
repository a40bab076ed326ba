"""Decode benchmark: jaxgpt.Decoder.generate (what generate runs) on the GPT-2 124M shape with random weights.

python bench/decode.py [--batch 1 8] [--dtypes float32 bfloat16] [--kernels auto portable] [--reps 3]

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


def gpt2_config(dtype: str, kernels: str = "auto") -> jaxgpt.GPTConfig:
    return jaxgpt.GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768,
                            dtype=dtype, param_dtype=dtype, kernels=kernels)


def run(batch: int, dtype: str, prompt_len: int, new_tokens: int, reps: int, bandwidth: float,
        kernels: str = "auto") -> dict:
    cfg = gpt2_config(dtype, kernels)
    params = jaxgpt.init_params(cfg, jax.random.key(0))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt_len))

    # one Decoder for every call, as a program that decodes repeatedly holds one: the backend's prepared
    # decode weights (the CPU backend's packed kernels) are made once, timed apart as prepare_s
    decoder = jaxgpt.Decoder(params, cfg)
    t0 = time.perf_counter()
    jax.block_until_ready(decoder.weights(batch))
    prepare = time.perf_counter() - t0

    def call():
        out = decoder.generate(prompts, new_tokens, jax.random.key(1), temperature=1.0, top_k=50)
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
    return {"batch": batch, "dtype": dtype, "kernels": kernels, "tokens_per_s": batch * new_tokens / t, "seconds": t,
            "all_seconds": times, "compile_s": first - t, "prepare_s": prepare, "kv_cache_bytes": cache,
            "bytes_per_step": bytes_per_step, "achieved_read_bytes_per_s": bytes_per_step * steps_per_s,
            "fraction_of_read_bandwidth": bytes_per_step * steps_per_s / bandwidth}


def run_peer(batch: int, prompt_len: int, new_tokens: int, reps: int) -> dict:
    """transformers' GPT2LMHeadModel.generate (PyTorch CPU, KV cache, top-k 50), same shapes."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    prompts = torch.from_numpy(np.random.default_rng(0).integers(0, 50257, (batch, prompt_len)))

    def call():
        with torch.no_grad():
            model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=50,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

    call()
    t, times = median_time(call, reps)
    return {"batch": batch, "tokens_per_s": batch * new_tokens / t, "seconds": t, "torch": torch.__version__}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--kernels", nargs="+", default=["auto"], choices=["auto", "portable", "cpu"])
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    args = p.parse_args()
    ceil = ceilings()
    rows = [run(b, d, args.prompt_len, args.new_tokens, args.reps, ceil["read_bytes_per_s"], k)
            for k in args.kernels for d in args.dtypes for b in args.batch]
    peers = {} if args.no_peer else {b: run_peer(b, args.prompt_len, args.new_tokens, args.reps) for b in args.batch}
    for r in rows:
        if r["batch"] in peers:
            r["peer_tokens_per_s"] = peers[r["batch"]]["tokens_per_s"]
            r["speedup_vs_peer"] = r["tokens_per_s"] / r["peer_tokens_per_s"]
    path = write_results("decode", {"machine": machine(), "ceilings": ceil, "settings": vars(args), "runs": rows,
                                    "peer": list(peers.values())})
    print(f"read bandwidth {ceil['read_bytes_per_s'] / 1e9:.1f} GB/s, fp32 matmul "
          f"{ceil['matmul_fp32_flops'] / 1e9:.0f} GFLOP/s, bf16 {ceil['matmul_bf16_flops'] / 1e9:.0f} GFLOP/s")
    print(f"{'kernels':>8} {'dtype':>9} {'batch':>5} {'tok/s':>8} {'compile s':>9} {'prepare s':>9} {'cache MB':>8} "
          f"{'% read bw':>9} {'peer tok/s':>10}")
    for r in rows:
        peer = f"{r['peer_tokens_per_s']:10.1f} ({r['speedup_vs_peer']:.2f}x)" if "peer_tokens_per_s" in r else ""
        print(f"{r['kernels']:>8} {r['dtype']:>9} {r['batch']:>5} {r['tokens_per_s']:8.1f} {r['compile_s']:9.2f} "
              f"{r['prepare_s']:9.2f} {r['kv_cache_bytes'] / 2**20:8.1f} {100 * r['fraction_of_read_bandwidth']:8.1f}% {peer}")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
