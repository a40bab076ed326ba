"""Peak memory (RSS) of training and of decoding, each in a fresh process, with the bytes that explain it.

python bench/memory.py [--train baby 6l] [--decode-batch 1 8]

Training: the real train step (bench/train.py's runner) for a few steps; decode: `generate` at GPT-2 124M
shape, 16-token prompt, 128 new tokens. Reports the process's peak RSS (ru_maxrss) and the bytes of
parameters, optimizer state and KV cache (2 x n_layer x batch x n_kv_head x max_len x head_dim x itemsize).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HERE = os.path.abspath(__file__)


def child_train(name: str) -> dict:
    import jax
    from bench.train import CONFIGS, bench_jax
    cfg, t, _ = bench_jax(name, "float32", 3, "dot_product")
    params = cfg.vocab_size * cfg.n_embd + cfg.block_size * cfg.n_embd + cfg.n_layer * 12 * cfg.n_embd ** 2
    return {"what": f"train {name}", "approx_params_bytes": 4 * params, "approx_adam_state_bytes": 8 * params,
            "batch_tokens": CONFIGS[name][3] * CONFIGS[name][4], "jax": jax.__version__}


def child_decode(batch: int) -> dict:
    import jax
    import numpy as np
    from jaxgpt import GPTConfig, count_params, init_params, sampling
    from jaxgpt.cache import cache_bytes
    cfg = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    params = init_params(cfg, jax.random.key(0))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, 16)).astype(np.int32)
    jax.block_until_ready(sampling.generate(params, cfg, prompts, 128, jax.random.key(1), top_k=50).tokens)
    return {"what": f"decode batch {batch}", "params_bytes": 4 * count_params(params),
            "kv_cache_bytes": cache_bytes(cfg, batch, 16 + 128)}


def run_child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, HERE, "--child", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--train", nargs="*", default=["baby", "6l"])
    p.add_argument("--decode-batch", nargs="*", type=int, default=[1, 8])
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, arg = args.child
        rec = child_train(arg) if kind == "train" else child_decode(int(arg))
        rec["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        print(json.dumps(rec))
        return
    from bench.common import machine, write_results
    rows = [run_child(["train", n]) for n in args.train] + [run_child(["decode", str(b)]) for b in args.decode_batch]
    for r in rows:
        extra = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in r.items()
                          if k.endswith("bytes") and k != "peak_rss_bytes")
        print(f"{r['what']:>16}: peak RSS {r['peak_rss_bytes'] / 2**20:7.0f} MiB ({extra})")
    path = write_results("memory", {"machine": machine(), "settings": vars(args), "runs": rows})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
