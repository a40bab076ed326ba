"""Two builds of the native CPU kernels against each other, interleaved: python bench/native_ab.py OLD.so NEW.so
[--rounds 3] [--serving] [--decode].

Each round runs one child process per library, in turns (old, new, old, new, ...), so a shared machine's
noise falls on both alike; each child loads its library in place of native.py's cached build and times
(a) the float32 decode matmul (native.rows_matmul) at GPT-2 124M's shapes for 1, 8 and 32 rows (32 rows as
two calls of 16, the kernel's most), (b) the dense cached_attention kernel on a decode step (32 rows x ~300
positions, 12 heads, head size 64, float32), with --serving (c) the serving step's kernels (child_serving),
and with --decode (d) bench/decode.py's float32 batch 1 and 8
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


def child_serving(lib: str) -> dict:
    """The serving step's kernels: the w8a8 matmul over twelve GPT-2 124M blocks' distinct weights (85 MB of
    int8 panels, read from memory as in a step) at 8, 32, 64, 256 and 512 rows, and paged attention of a decode
    step (32 rows x ~200 positions, pages of 16 handed out in a random order, float32 and int8 pools)."""
    _use(lib)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxgpt.backends import native

    rng = np.random.default_rng(0)
    out, blocks = {}, []
    for _ in range(12):
        mats = []
        for n_in, n_out in ((768, 2304), (768, 768), (768, 3072), (3072, 768)):
            q = jnp.asarray(rng.integers(-127, 128, (n_in, n_out)), jnp.int8)
            mats.append(native.pack_w8a8(q, jnp.full((n_out,), 1e-3, jnp.float32)))
        blocks.append(mats)

    def blocks_w8a8(x, blocks):
        for (qkv, proj, fc, down) in blocks:
            h = native.rows_matmul_w8a8(native.rows_matmul_w8a8(x, *qkv, 2304)[:, :768], *proj, 768)
            x = 1e-3 * native.rows_matmul_w8a8(native.rows_matmul_w8a8(h, *fc, 3072), *down, 768)
        return x

    f = jax.jit(blocks_w8a8)
    for rows in (8, 32, 64, 256, 512):
        x = jnp.asarray(rng.standard_normal((rows, 768)), jnp.float32)
        out[f"w8a8 12 blocks x{rows}"] = _median_ms(lambda: f(x, blocks).block_until_ready(), 20)
    rows, heads, h, page = 32, 12, 64, 16
    lengths = rng.integers(168, 233, rows).astype(np.int32)
    per_row = -(-lengths // page)
    order = rng.permutation(int(per_row.sum())) + 1  # page 0: the null page
    tables = np.zeros((rows, int(per_row.max())), np.int32)
    at = 0
    for r in range(rows):
        tables[r, :per_row[r]] = order[at:at + per_row[r]]
        at += per_row[r]
    pages = int(order.max()) + 1
    q = jnp.asarray(rng.standard_normal((rows, heads, h)), jnp.float32)
    args = (jnp.arange(rows, dtype=jnp.int32), jnp.asarray(lengths), jnp.asarray(tables))
    for int8 in (False, True):
        shape = (pages, heads, page, h)
        if int8:
            kv = [jnp.asarray(rng.integers(-127, 128, shape), jnp.int8) for _ in range(2)]
            scales = [jnp.asarray(rng.uniform(0.005, 0.03, shape[:-1]), jnp.float32) for _ in range(2)]
        else:
            kv, scales = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2)], [None, None]
        att = jax.jit(native.paged_attention)
        out[f"paged_attention decode 32x~200 {'int8' if int8 else 'f32'}"] = _median_ms(
            lambda: att(q, *kv, *args, *scales).block_until_ready(), 50)
    out.update(_prompt_attention(rng, heads, h, page))
    return out


def _prompt_attention(rng, heads: int, h: int, page: int) -> dict:
    """Paged attention of a prompt step: 512 tokens, three new prompts of 221, 169 and 122 (each token at
    its position, seeing its prompt up to itself), pages in a random order; float32 and int8 pools."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxgpt.backends import native

    lengths = (221, 169, 122)
    per_row = [-(-n // page) for n in lengths]
    order = rng.permutation(sum(per_row)) + 1  # page 0: the null page
    tables = np.zeros((len(lengths), max(per_row)), np.int32)
    at = 0
    for r, n in enumerate(per_row):
        tables[r, :n] = order[at:at + n]
        at += n
    args = (jnp.asarray(np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)),
            jnp.asarray(np.concatenate([np.arange(1, n + 1) for n in lengths]).astype(np.int32)), jnp.asarray(tables))
    q = jnp.asarray(rng.standard_normal((sum(lengths), heads, h)), jnp.float32)
    shape, out = (int(order.max()) + 1, heads, page, h), {}
    att = jax.jit(native.paged_attention)
    for int8 in (False, True):
        if int8:
            kv = [jnp.asarray(rng.integers(-127, 128, shape), jnp.int8) for _ in range(2)]
            scales = [jnp.asarray(rng.uniform(0.005, 0.03, shape[:-1]), jnp.float32) for _ in range(2)]
        else:
            kv, scales = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2)], [None, None]
        out[f"paged_attention prompts 512 {'int8' if int8 else 'f32'}"] = _median_ms(
            lambda: att(q, *kv, *args, *scales).block_until_ready(), 30)
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
    ap.add_argument("--serving", action="store_true", help="also the serving step's kernels: the w8a8 matmul over "
                    "twelve blocks' weights at 8-512 rows and paged attention of a decode step and of a 512-token "
                    "prompt step")
    ap.add_argument("--child", nargs=2, metavar=("LIB", "WHAT"))
    a = ap.parse_args()
    if a.child:
        lib, what = a.child
        child = {"kernels": child_kernels, "serving": child_serving, "decode": child_decode}[what]
        print("RESULT " + json.dumps(child(lib)), flush=True)
        return
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    got = {lib: {} for lib in a.libs}
    whats = ["kernels"] + (["serving"] if a.serving else []) + (["decode"] if a.decode else [])
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
