"""Attention over a paged KV cache: the native kernel (paged_attention.cc) against the plain-JAX form
(jaxgpt.paged.paged_attention) and the dense-cache kernel (cached_attention.cc) on the same keys and values.

python bench/paged_attention.py [--pages 16 32 64 128] [--dtypes float32 int8] [--reps 20]

Two cases at GPT-2 124M's attention shape (--heads 12 --kv-heads 12 --head-dim 64): decode, one token for
each of --rows rows whose lengths are drawn around --length; and a prompt chunk, --chunk tokens of one row at
its last positions of --prompt (each token sees the positions up to its own). The dense kernel reads the
same values from a [rows K, S, H] cache (the CPU backend's layout), the paged forms from a pool whose pages
are handed out in a random order. Median milliseconds of one jitted call. Results:
bench/results/paged_attention.json.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import machine, median_time, write_results  # noqa: E402
from jaxgpt import paged  # noqa: E402
from jaxgpt.backends import native  # noqa: E402


def dense_cache(rng, rows, kv_heads, max_len, head_dim, int8):
    """Keys and values [rows K, S, H] (and scales [rows K, S] for int8)."""
    shape = (rows * kv_heads, max_len, head_dim)
    if int8:
        kv = [rng.integers(-127, 128, shape).astype(np.int8) for _ in range(2)]
        return kv + [rng.uniform(0.005, 0.03, shape[:-1]).astype(np.float32) for _ in range(2)]
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(2)] + [None, None]


def to_pages(rng, dense, rows, kv_heads, lengths, page):
    """The dense cache's filled positions copied into a pool of shuffled pages, and the block tables."""
    per_row = [-(-int(n) // page) for n in lengths]
    num_pages = sum(per_row) + 1
    order = iter(rng.permutation(np.arange(1, num_pages)))
    tables = np.zeros((rows, max(per_row)), np.int32)
    pools = [None if a is None else np.zeros((num_pages, kv_heads, page) + a.shape[2:], a.dtype) for a in dense]
    for r, n in enumerate(per_row):
        for i in range(n):
            p = tables[r, i] = next(order)
            span = slice(i * page, min((i + 1) * page, dense[0].shape[1]))
            for pool, a in zip(pools, dense):
                if pool is not None:
                    part = a[r * kv_heads:(r + 1) * kv_heads, span]
                    pool[p, :, :part.shape[1]] = part
    return pools, tables


def case(name, args, page, dtype, rows, t_per_row, lengths, max_len):
    """Median ms of the three forms for one case; tokens [rows, t_per_row] at each row's last positions."""
    rng = np.random.default_rng(0)
    n, kh, h = args.heads, args.kv_heads, args.head_dim
    int8 = dtype == "int8"
    dense = dense_cache(rng, rows, kh, max_len, h, int8)
    (k, v, ks, vs), tables = to_pages(rng, dense, rows, kh, lengths, page)
    positions = np.stack([np.arange(L - t_per_row, L) for L in lengths]).astype(np.int32)  # [rows, t]
    q = jnp.asarray(rng.standard_normal((rows, t_per_row, n, h)).astype(np.float32))
    token_rows = jnp.asarray(np.repeat(np.arange(rows), t_per_row).astype(np.int32))
    limits = jnp.asarray(positions.reshape(-1) + 1)
    qf = q.reshape(rows * t_per_row, n, h)
    scales = [None if a is None else jnp.asarray(a) for a in (ks, vs)]
    k, v, tables = jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables)
    paged_args = (qf, k, v, token_rows, limits, tables, *scales)
    forms = {"paged kernel": (jax.jit(native.paged_attention), paged_args),
             "plain JAX": (jax.jit(paged.paged_attention), paged_args)}
    dense_args = (q, *(jnp.asarray(a) for a in dense if a is not None), jnp.asarray(positions),
                  jnp.asarray(np.asarray(lengths, np.int32)))
    dense_fn = native.cached_attention_int8 if int8 else native.cached_attention
    forms["dense kernel"] = (jax.jit(lambda *a: dense_fn(*a, kv_heads=kh).reshape(qf.shape)), dense_args)
    outs = {f: np.asarray(fn(*a)) for f, (fn, a) in forms.items()}
    err = max(float(np.abs(o - outs["plain JAX"]).max()) for o in outs.values())
    ms = {f: 1e3 * median_time(lambda: fn(*a).block_until_ready(), args.reps)[0] for f, (fn, a) in forms.items()}
    return {"case": name, "page": page, "dtype": dtype, "ms": ms, "max_abs_diff": err}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 32, 64, 128], help="page sizes")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "int8"], choices=["float32", "int8"])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rows", type=int, default=32, help="decode rows")
    ap.add_argument("--length", type=int, default=300, help="decode rows' mean length (drawn +-32)")
    ap.add_argument("--chunk", type=int, default=256, help="prompt chunk tokens")
    ap.add_argument("--prompt", type=int, default=1024, help="the chunk's row ends at this position")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if not native.available():
        sys.exit(f"the native kernels are unavailable: {native._state.get('why')}")
    lengths = np.random.default_rng(1).integers(args.length - 32, args.length + 33, args.rows)
    results = []
    print(f"{'case':<28} {'page':>4} {'dtype':>7} {'paged kernel':>13} {'plain JAX':>10} {'dense kernel':>13}"
          f" {'max diff':>9}   (ms)")
    for dtype in args.dtypes:
        for page in args.pages:
            for r in (case(f"decode {args.rows} x ~{args.length}", args, page, dtype, args.rows, 1, lengths,
                           int(lengths.max())),
                      case(f"chunk {args.chunk} at {args.prompt - args.chunk}..{args.prompt - 1}", args, page,
                           dtype, 1, args.chunk, [args.prompt], args.prompt)):
                ms = r["ms"]
                print(f"{r['case']:<28} {page:>4} {dtype:>7} {ms['paged kernel']:>13.3f} {ms['plain JAX']:>10.3f} "
                      f"{ms['dense kernel']:>13.3f} {r['max_abs_diff']:>9.1e}", flush=True)
                results.append(r)
    path = write_results("paged_attention", {"machine": machine(), "args": vars(args), "results": results})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
