"""int8 weights' and the int8 KV cache's accuracy on trained models: validation loss and top-1
agreement against float32.

python bench/quantize_accuracy.py RUN_DIR [RUN_DIR ...] [--windows 64] [--no-kv]

For each training run (a folder `train.py` wrote), the same validation windows (`--windows` of the
model's block_size, drawn with a fixed seed from the run's own validation split) go through the float
model and through `quantize.dequantized` (the float model that int8 decoding computes: tests/
test_quantize.py holds int8 decoding equal to it). Reports both mean losses, the relative change, and
how often the two models' most likely next token agrees. The "w8a8" column rounds every dense kernel's
input rows to int8 as well, at every position (quantize="w8a8" decodes so; its prefill runs the
dequantized float model, so this column bounds what it changes).

The KV cache columns decode each window teacher-forced, one token at a time, through a KV cache
(`KVCache.create(..., dtype=...)`), every position's logits from its decode step: "kv_float" through a
cache in the compute dtype (equal to the full forward to that dtype's rounding: the check that the
decode path is right, and the noise floor of the others), "kv_int8" through an int8 cache (keys and
values rounded to int8 with a scale per position and kv head), "int8_kv_int8" int8 weights and an int8
cache together, "w8a8_kv_int8" w8a8 weights and an int8 cache (what `jaxgpt-serve --quantize=w8a8
--kv_dtype=int8` decodes). Each is compared with the float full forward. Everything computes in the run's own
dtype, or `--dtype`'s (float32 separates the int8 effects from bfloat16's rounding). Results: bench/results/quantize_accuracy.json (quantize_accuracy_DTYPE.json with
`--dtype`).
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

import jaxgpt  # noqa: E402
from bench.common import machine, write_results  # noqa: E402


def val_windows(meta: dict, block_size: int, n: int, seed: int = 0) -> np.ndarray:
    """n windows of block_size + 1 tokens from the run's validation split."""
    from jaxgpt.data import prepare_dataset

    d = meta["config"]["data"]
    ds = prepare_dataset(corpus=d["corpus"], path=d.get("path"), tokenizer=d["tokenizer"],
                         vocab_size=d.get("vocab_size"), val_fraction=d["val_fraction"], cache_dir=d.get("cache_dir"),
                         progress=False)
    starts = np.random.default_rng(seed).integers(0, len(ds.val) - block_size - 1, n)
    return np.stack([np.asarray(ds.val[s:s + block_size + 1], np.int32) for s in starts])


def cached_logits(model: jaxgpt.GPT, params, tokens_BxT: jax.Array, kv_dtype: str, prepared=None) -> jax.Array:
    """Teacher-forced decoding: tokens [B, T] fed one at a time (a lax.scan of one-token steps) through
    a KV cache of `kv_dtype` (None: the compute dtype); the logits [B, T, V] each step gave. `prepared`:
    the model's backend's prepared weights (w8a8's int8 kernels)."""
    b, t = tokens_BxT.shape
    backend = model.backend if model.backend is not None else jaxgpt.resolve(model.config)
    cache = jaxgpt.KVCache.create(model.config, b, t, dtype=kv_dtype, layout=backend.cache_layout)
    variables = {"params": params} if prepared is None else {"params": params, "prepared": prepared}

    def step(cache, tokens_B):
        logits, cache = model.apply(variables, tokens_B[:, None], cache)
        return cache, logits[:, 0]

    _, logits_TxBxV = jax.lax.scan(step, cache, tokens_BxT.T)
    return logits_TxBxV.swapaxes(0, 1)


def _loss_and_top(logits, y) -> tuple[float, np.ndarray]:
    """Mean next-token loss of float logits [B, T, V] against targets y [B, T], and the argmax [B, T]."""
    logits = np.asarray(logits, np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return float(np.mean(lse - np.take_along_axis(logits, y[..., None], -1)[..., 0])), logits.argmax(-1)


def measure(run_dir: str, windows: int, batch: int = 8, kv: bool = True, dtype=None) -> dict:
    from jaxgpt.backends import resolve
    from jaxgpt.backends.base import int8_prepared
    from jaxgpt.loading import load_model
    from jaxgpt.quantize import dequantized, int8_bytes

    config, params, _, meta = load_model(run_dir)
    config = config if dtype is None else config.replace(dtype=dtype)
    data = val_windows(meta, config.block_size, windows)
    model = jaxgpt.GPT(config)
    forward = jax.jit(lambda p, x: model.apply({"params": p}, x))
    decode = jax.jit(lambda p, x, kv_dtype: cached_logits(model, p, x, kv_dtype), static_argnames="kv_dtype")
    q_params = jax.jit(lambda p: dequantized(p, config))(params)
    # w8a8: every dense kernel's input rows rounded to int8 too, at every position (the portable backend
    # multiplies the Int8Kernels with XLA's int8 dot)
    w8a8 = int8_prepared(params, config.tie_embeddings, config=config, quantize="w8a8")
    portable = jaxgpt.GPT(config, backend=resolve("portable"))
    forward_w8a8 = jax.jit(lambda p, w, x: portable.apply({"params": p, "prepared": w}, x))
    decode_w8a8 = jax.jit(lambda p, w, x: cached_logits(portable, p, x, "int8", prepared=w))
    # name -> logits of tokens [B, T]: the full forward, or teacher-forced decoding through a cache
    columns = {"float32": lambda x: forward(params, x), "int8": lambda x: forward(q_params, x),
               "w8a8": lambda x: forward_w8a8(params, w8a8, x)}
    if kv:
        columns.update({"kv_float": lambda x: decode(params, x, kv_dtype=None),
                        "kv_int8": lambda x: decode(params, x, kv_dtype="int8"),
                        "int8_kv_int8": lambda x: decode(q_params, x, kv_dtype="int8"),
                        # what jaxgpt-serve --quantize=w8a8 --kv_dtype=int8 decodes
                        "w8a8_kv_int8": lambda x: decode_w8a8(params, w8a8, x)})
    losses = {name: [] for name in columns}
    agree = {name: 0 for name in columns}
    total = 0
    for i in range(0, windows, batch):
        x, y = jnp.asarray(data[i:i + batch, :-1]), data[i:i + batch, 1:]
        top = {}
        for name, logits_of in columns.items():
            loss, top[name] = _loss_and_top(logits_of(x), y)
            losses[name].append(loss)
            agree[name] += int((top["float32"] == top[name]).sum())
        total += top["float32"].size
    loss = {name: float(np.mean(v)) for name, v in losses.items()}
    f, q = loss["float32"], loss["int8"]
    sizes = int8_bytes(params, config)
    row = {"run": run_dir, "params": jaxgpt.count_params(params), "layers": config.n_layer, "width": config.n_embd,
           "vocab": config.vocab_size, "step": meta.get("step"), "dtype": config.dtype, "windows": windows,
           "tokens": total, "val_loss_float32": f, "val_loss_int8": q, "relative_change": (q - f) / f,
           "top1_agreement": agree["int8"] / total, "kernel_bytes_float": sizes["float"],
           "kernel_bytes_int8": sizes["int8"]}
    for name in columns:
        if name.startswith(("kv_", "int8_kv_", "w8a8")):
            row.update({f"val_loss_{name}": loss[name], f"relative_change_{name}": (loss[name] - f) / f,
                        f"top1_agreement_{name}": agree[name] / total})
    if kv:
        for kv_dtype in ("float32", "bfloat16", "int8"):  # one row of block_size positions
            row[f"cache_bytes_{kv_dtype}"] = jaxgpt.cache_bytes(config, 1, config.block_size, kv_dtype)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="training run folders (out_dir of train.py)")
    p.add_argument("--windows", type=int, default=64, help="validation windows of block_size tokens per run")
    p.add_argument("--no-kv", dest="kv", action="store_false", help="leave out the KV cache columns")
    p.add_argument("--dtype", default=None, help="compute dtype for every column (default: each run's own)")
    args = p.parse_args()
    rows = [measure(r, args.windows, kv=args.kv, dtype=args.dtype) for r in args.runs]
    name = "quantize_accuracy" + (f"_{args.dtype}" if args.dtype else "")
    path = write_results(name, {"machine": machine(), "settings": vars(args), "runs": rows})
    print(f"{'run':>32} {'params':>10} {'val float32':>11} {'column':>13} {'val':>9} {'change':>8} {'top-1 agree':>11}")
    for r in rows:
        names = ["int8"] + [n for n in ("w8a8", "kv_float", "kv_int8", "int8_kv_int8", "w8a8_kv_int8")
                            if f"val_loss_{n}" in r]
        for n in names:
            change, agree = (r["relative_change"], r["top1_agreement"]) if n == "int8" else \
                (r[f"relative_change_{n}"], r[f"top1_agreement_{n}"])
            print(f"{r['run'][-32:]:>32} {r['params']:>10,} {r['val_loss_float32']:11.4f} {n:>13} "
                  f"{r[f'val_loss_{n}']:9.4f} {100 * change:7.3f}% {100 * agree:10.2f}%")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
