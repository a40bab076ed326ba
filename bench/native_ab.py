"""Two builds of the native CPU kernels against each other, interleaved: python bench/native_ab.py OLD.so NEW.so
[--rounds 3] [--decode].

Each round runs one child process per library, in turns (old, new, old, new, ...), so a shared machine's
noise falls on both alike; each child loads its library in place of native.py's cached build and times
(a) the float32 decode matmul (native.rows_matmul) at GPT-2 124M's shapes for 1, 8 and 32 rows (32 rows as
two calls of 16, the kernel's most), (b) the dense cached_attention kernel on a decode step (32 rows x ~300
positions, 12 heads, head size 64, float32), and with --decode (c) bench/decode.py's float32 batch 1 and 8
(16-token prompt, 32 new tokens, --reps 3, no peer). Prints each figure's median over rounds per library and
new / old. Build a library with native.py's own command (its docstring), e.g. from `git show REV:...` copies.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MATMULS = ((768, 2304), (768, 3072), (3072, 768), (768, 50257))


def _use(lib: str) -> None:
    from jaxgpt.backends import native

    native._build = lambda: lib  # noqa: SLF001 (the library under test instead of the cached build)
    assert native.available(), native._state.get("why")


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def child_kernels(lib: str) -> dict:
    _use(lib)
    import jax
    import jax.numpy as jnp
    from jaxgpt.backends import native

    out = {}
    key = jax.random.PRNGKey(0)
    for n_in, n_out in MATMULS:
        panels = native.pack(jax.random.normal(key, (n_in, n_out), jnp.float32))
        f = jax.jit(lambda x, p, n_out=n_out: jnp.concatenate(
            [native.rows_matmul(c, p, n_out) for c in jnp.split(x, max(1, x.shape[0] // 16))]))
        for rows in (1, 8, 32):
            x = jax.random.normal(key, (rows, n_in), jnp.float32)
            out[f"matmul {n_in}->{n_out} x{rows}"] = _median_ms(lambda: f(x, panels).block_until_ready(), 30)
    b, n, h, s = 32, 12, 64, 320
    k = jax.random.normal(key, (b, n, s, h), jnp.float32)
    v = jax.random.normal(jax.random.PRNGKey(1), (b, n, s, h), jnp.float32)
    q = jax.random.normal(jax.random.PRNGKey(2), (b, 1, n, h), jnp.float32)
    lengths = 280 + jnp.arange(b, dtype=jnp.int32)  # ~300 positions filled
    att = jax.jit(lambda q, k, v, l: native.cached_attention(q, k, v, (l - 1)[:, None], l))
    out["cached_attention decode 32x~300 f32"] = _median_ms(lambda: att(q, k, v, lengths).block_until_ready(), 50)
    return out


def child_decode(lib: str) -> dict:
    _use(lib)
    import runpy

    sys.argv = ["decode.py", "--batch", "1", "8", "--dtypes", "float32", "--kernels", "auto", "--new_tokens", "32",
                "--reps", "3", "--no-peer", "--out", "native_ab_decode"]
    runpy.run_path(os.path.join(HERE, "decode.py"), run_name="__main__")
    return {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("libs", nargs="*")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("LIB", "WHAT"))
    a = ap.parse_args()
    if a.child:
        lib, what = a.child
        print("RESULT " + json.dumps(child_kernels(lib) if what == "kernels" else child_decode(lib)), flush=True)
        return
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    got = {lib: {} for lib in a.libs}
    whats = ["kernels"] + (["decode"] if a.decode else [])
    for rnd in range(a.rounds):
        for what in whats:
            for lib in a.libs:
                done = subprocess.run([sys.executable, __file__, "--child", lib, what], env=env, cwd=ROOT,
                                      capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"{lib} {what} failed:\n{done.stderr[-3000:]}")
                res = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
                for line in done.stdout.splitlines():  # decode.py's table: "auto float32 none none B tok/s ..."
                    m = re.match(r"\s*(\w+)\s+float32\s+none\s+none\s+(\d+)\s+([\d.]+)", line)
                    if m:
                        res[f"decode {m.group(1)} float32 batch {m.group(2)} tok/s"] = float(m.group(3))
                for name, val in res.items():
                    got[lib].setdefault(name, []).append(val)
                print(f"round {rnd} {what} {os.path.basename(lib)}: {json.dumps(res)}", flush=True)
    old, new = a.libs[0], a.libs[-1]
    print(f"\n{'case':>44} {'old':>9} {'new':>9} {'new/old':>8}   (medians of {a.rounds}; ms, or tok/s)")
    for name in got[old]:
        o, n = statistics.median(got[old][name]), statistics.median(got[new][name])
        print(f"{name:>44} {o:9.3f} {n:9.3f} {n / o:8.3f}")


if __name__ == "__main__":
    main()
