"""jaxgpt-plot OUT_DIR: write OUT_DIR/loss.png, train and val loss against step (needs matplotlib)."""

from __future__ import annotations

import argparse
import os
import sys


def read_metrics(out_dir: str) -> tuple[list, list]:
    """(train [(step, loss)], val [(step, val_loss)]) from out_dir/metrics.jsonl; lines that are not
    records (a crash mid-write) are skipped with a warning naming them."""
    from jaxgpt.training.metrics import read_records

    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics.jsonl in {out_dir}; is it a training run's out_dir?")
    train, val = [], []
    for r in read_records(path):
        if isinstance(r.get("loss"), (int, float)):
            train.append((r["step"], r["loss"]))
        if isinstance(r.get("val_loss"), (int, float)):
            val.append((r["step"], r["val_loss"]))
    return train, val


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxgpt-plot", description=__doc__)
    p.add_argument("out_dir")
    p.add_argument("--output", default=None, help="PNG path (default OUT_DIR/loss.png)")
    args = p.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("jaxgpt-plot needs matplotlib: pip install 'jaxgpt[plot]'", file=sys.stderr)
        return 2
    try:
        train, val = read_metrics(args.out_dir)
    except FileNotFoundError as e:
        print(f"jaxgpt-plot: {e}", file=sys.stderr)
        return 2
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    out = args.output or os.path.join(args.out_dir, "loss.png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
