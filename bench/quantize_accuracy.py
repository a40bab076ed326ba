"""int8 weights' accuracy on trained models: validation loss and top-1 agreement against float32.

python bench/quantize_accuracy.py RUN_DIR [RUN_DIR ...] [--windows 64]

For each training run (a folder `train.py` wrote), the same validation windows (`--windows` of the
model's block_size, drawn with a fixed seed from the run's own validation split) go through the float
model and through `quantize.dequantized` (the float model that int8 decoding computes: tests/
test_quantize.py holds int8 decoding equal to it). Reports both mean losses, the relative change, and
how often the two models' most likely next token agrees. Results: bench/results/quantize_accuracy.json.
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


def measure(run_dir: str, windows: int, batch: int = 8) -> dict:
    from jaxgpt.checkpoint import load_model
    from jaxgpt.quantize import dequantized, int8_bytes

    config, params, _, meta = load_model(run_dir)
    data = val_windows(meta, config.block_size, windows)
    model = jaxgpt.GPT(config)
    forward = jax.jit(lambda p, x: model.apply({"params": p}, x))
    q_params = jax.jit(lambda p: dequantized(p, config))(params)
    losses = {"float32": [], "int8": []}
    agree = total = 0
    for i in range(0, windows, batch):
        x, y = jnp.asarray(data[i:i + batch, :-1]), data[i:i + batch, 1:]
        top = {}
        for name, p in (("float32", params), ("int8", q_params)):
            logits = np.asarray(forward(p, x), np.float64)
            lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
            losses[name].append(float(np.mean(lse - np.take_along_axis(logits, y[..., None], -1)[..., 0])))
            top[name] = logits.argmax(-1)
        agree += int((top["float32"] == top["int8"]).sum())
        total += top["float32"].size
    f, q = float(np.mean(losses["float32"])), float(np.mean(losses["int8"]))
    sizes = int8_bytes(params, config)
    return {"run": run_dir, "params": jaxgpt.count_params(params), "layers": config.n_layer, "width": config.n_embd,
            "vocab": config.vocab_size, "step": meta.get("step"), "windows": windows, "tokens": total,
            "val_loss_float32": f, "val_loss_int8": q, "relative_change": (q - f) / f,
            "top1_agreement": agree / total, "kernel_bytes_float": sizes["float"], "kernel_bytes_int8": sizes["int8"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="training run folders (out_dir of train.py)")
    p.add_argument("--windows", type=int, default=64, help="validation windows of block_size tokens per run")
    args = p.parse_args()
    rows = [measure(r, args.windows) for r in args.runs]
    path = write_results("quantize_accuracy", {"machine": machine(), "settings": vars(args), "runs": rows})
    print(f"{'run':>32} {'params':>10} {'val float32':>11} {'val int8':>9} {'change':>8} {'top-1 agree':>11}")
    for r in rows:
        print(f"{r['run'][-32:]:>32} {r['params']:>10,} {r['val_loss_float32']:11.4f} {r['val_loss_int8']:9.4f} "
              f"{100 * r['relative_change']:7.3f}% {100 * r['top1_agreement']:10.2f}%")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
