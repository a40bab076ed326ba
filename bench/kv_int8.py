"""The int8 KV cache's bytes and one decode step's time against float caches, at a model shape.

python bench/kv_int8.py [--batch 1 8] [--max-len 1024] [--fill 1000] [--layers 12 --width 768 --heads 12]

For each batch and cache dtype (float32, bfloat16, int8): a cache of `--max-len` positions per row with
`--fill` of them written, then the median time of one jitted decode step (one token per row, the cache
donated, the backend's decode weights as the engine uses them) and the cache's bytes. Random weights: the
time does not depend on them. Results: bench/results/kv_int8.json.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxgpt  # noqa: E402
from bench.common import machine, median_time, write_results  # noqa: E402
from jaxgpt.backends.base import decode_weights  # noqa: E402


def measure(config: jaxgpt.GPTConfig, batch: int, max_len: int, fill: int, kv_dtype: str, reps: int) -> dict:
    backend = jaxgpt.resolve(config)
    backend.setup()
    params = jaxgpt.init_params(config, jax.random.key(0))
    weights = decode_weights(backend, params, batch, config.compute_dtype, config.tie_embeddings)
    model = jaxgpt.GPT(config, backend)
    cache = jaxgpt.KVCache.create(config, batch, max_len, dtype=kv_dtype, layout=backend.cache_layout)
    nbytes = cache.nbytes
    prefill = jax.jit(lambda c, x: model.apply({"params": params}, x, c)[1], donate_argnums=(0,))
    cache = prefill(cache, jnp.ones((batch, fill), jnp.int32))
    step = jax.jit(lambda w, c, x: model.apply(w.variables(), x, c), donate_argnums=(1,))
    tokens = jnp.ones((batch, 1), jnp.int32)
    state = {"cache": cache}

    def one():  # a step at the same fill each time (the cache's lengths put back)
        logits, c = step(weights, state["cache"], tokens)
        state["cache"] = c.replace(lengths=c.lengths - 1)
        logits.block_until_ready()

    one()
    t, _ = median_time(one, reps)
    return {"batch": batch, "kv_dtype": kv_dtype, "max_len": max_len, "fill": fill, "cache_bytes": nbytes,
            "step_ms": 1e3 * t, "tokens_per_s": batch / t}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--fill", type=int, default=1000)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    config = jaxgpt.GPTConfig(vocab_size=args.vocab, block_size=args.max_len, n_layer=args.layers,
                              n_head=args.heads, n_embd=args.width)
    rows = []
    print(f"{'batch':>5} {'kv dtype':>9} {'cache MiB':>10} {'step ms':>8} {'tok/s':>8}")
    for b in args.batch:
        for d in args.dtypes:
            r = measure(config, b, args.max_len, args.fill, d, args.reps)
            rows.append(r)
            print(f"{b:>5} {d:>9} {r['cache_bytes'] / 2**20:10.1f} {r['step_ms']:8.2f} {r['tokens_per_s']:8.1f}")
    path = write_results("kv_int8", {"machine": machine(), "settings": vars(args), "rows": rows})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
