"""Prefix-heavy load: every request begins with the same system prompt (a chat server's case).

python bench/prefix.py [--concurrency 32] [--requests 96] [--system 512] [--min-tail 16] [--max-tail 64]
                       [--new-tokens 32] [--page-size 16] [--token-budget 256] [--no-dense] [--tiny]

GPT-2 124M shape, random float32 weights. c requests in flight (a closed loop, as bench/engine.py's), each
prompt the shared system prompt followed by a tail of its own, top-k 50 sampling. Replayed through the paged
engine with prefix caching (full pages found by block hash, not computed again), without it, and through
the dense-slot engine (its prefix reuse copies a slot's row). Reports tokens/s, p50 and p99 time to first
token, the prefix cache's hit rate in tokens and the pages held at most.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxgpt  # noqa: E402
from bench.common import machine, write_results  # noqa: E402
from bench.engine import config, percentile, replay_engine  # noqa: E402
from jaxgpt.engine import Engine  # noqa: E402
from jaxgpt.engine.paged import PagedEngine  # noqa: E402


def prompts_with_system(cfg, n: int, system: int, lo: int, hi: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, cfg.vocab_size, system).tolist()
    return [shared + rng.integers(0, cfg.vocab_size, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def one(name: str, engine, prompts, new_tokens: int, stagger: float) -> dict:
    engine.warmup(prompt_logprobs=False)
    run = replay_engine(engine, prompts, [new_tokens] * len(prompts), stagger)
    out = {"tokens_per_s": run["tokens_per_s"], "ttft_p50_s": percentile(run["ttft_s"], 50),
           "ttft_p99_s": percentile(run["ttft_s"], 99), "seconds": run["seconds"]}
    st = engine.stats
    if isinstance(engine, PagedEngine):
        out.update(prefix_queries=st.prefix_queries, prefix_hits=st.prefix_hits, peak_pages=st.peak_pages,
                   hit_rate=st.prefix_hits / max(1, st.prefix_queries), prompt_tokens_run=st.prompt_tokens)
    else:
        out.update(reused_tokens=st["reused_tokens"], prompt_tokens_run=st["prefill_tokens"])
    print(f"{name:22s} {out['tokens_per_s']:7.1f} tok/s  TTFT p50 {out['ttft_p50_s']:.3f} s  p99 "
          f"{out['ttft_p99_s']:.3f} s  prompt tokens run {out['prompt_tokens_run']}"
          + (f"  hits {out['hit_rate']:.1%}, peak pages {out['peak_pages']}" if "hit_rate" in out else ""), flush=True)
    jax.clear_caches()
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--system", type=int, default=512, help="tokens of the shared system prompt")
    ap.add_argument("--min-tail", type=int, default=16)
    ap.add_argument("--max-tail", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--no-dense", dest="dense", action="store_false", help="skip the dense-slot engine")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and a short run (the smoke test)")
    ap.add_argument("--out", default=None, help="results file name (default prefix.json; tiny: not written)")
    args = ap.parse_args(argv)
    cfg = config(args.tiny)
    if args.tiny:
        args.system, args.min_tail, args.max_tail, args.new_tokens, args.requests = 24, 2, 8, 4, 8
    params = jaxgpt.init_params(cfg, jax.random.key(0))
    prompts = prompts_with_system(cfg, args.requests, args.system, args.min_tail, args.max_tail)
    max_len = args.system + args.max_tail + args.new_tokens
    c = args.concurrency
    results = {"machine": machine(), "cpu_flags": sorted(f for f in jaxgpt.backends.cpu.cpu_flags()
                                                         if f.startswith(("avx512", "amx", "avx2"))),
               "config": "tiny" if args.tiny else "gpt2-124m", "args": vars(args)}

    def paged(caching):
        return PagedEngine(params, cfg, max_requests=c, max_len=max_len, page_size=args.page_size,
                           token_budget=args.token_budget, prefix_caching=caching)

    results["paged_cached"] = one("paged, prefix cache", paged(True), prompts, args.new_tokens, 0.0)
    results["paged_uncached"] = one("paged, no prefix cache", paged(False), prompts, args.new_tokens, 0.0)
    if args.dense:
        dense = Engine(params, cfg, slots=c, max_len=max_len, prefill_chunk=args.token_budget)
        results["dense"] = one("dense slots (row copies)", dense, prompts, args.new_tokens, 0.0)
    ratio = results["paged_uncached"]["ttft_p50_s"] / results["paged_cached"]["ttft_p50_s"]
    results["ttft_p50_uncached_over_cached"] = ratio
    print(f"p50 TTFT without the prefix cache over with it: {ratio:.2f}x", flush=True)
    if args.out or not args.tiny:
        print("wrote", write_results(args.out or "prefix", results))
    return results


if __name__ == "__main__":
    main()
