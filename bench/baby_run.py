"""nanoGPT's CPU baby run, whole processes against the clock: jaxgpt's train.py against nanoGPT's own train.py.

python bench/baby_run.py --corpus-path PATH/tinyshakespeare.txt [--nanogpt ../shared/peers/nanogpt]
                         [--steps 2000] [--runs 1] [--no-peer] [--jaxgpt-args ...]

Both sides train 4 layers / 4 heads / 128 wide, context 64, batch 12, no dropout, on character-level Tiny
Shakespeare with nanoGPT's schedule (lr 1e-3 -> 1e-4 cosine after 100 warmup steps, AdamW betas (0.9, 0.99),
weight decay 0.1, gradient clip 1.0) and evaluate 20 batches of each split every 250 steps:

- jaxgpt: `python train.py --config=configs/shakespeare_char_cpu.py` on the same text file (that config
  multiplies in bf16 where the CPU has AVX512_BF16 or AMX, float32 elsewhere; `--jaxgpt-args
  --config.model.dtype=float32` times float32 everywhere, like nanoGPT's CPU run);
- peer: nanoGPT's unmodified train.py, run on a copy of its folder exactly as its README's CPU command
  (`--device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12
  --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`) after its
  own data/shakespeare_char/prepare.py. Needs torch (the `bench` extra) and requests.

Each side is a fresh process timed from its start to its exit, so imports, data loading, compilation,
evaluation and checkpoints all count; each side's data preparation runs before its clock starts. With
--runs N the sides alternate N times and the medians are reported. Target (issue 16): jaxgpt's wall-clock
at most 0.6x nanoGPT's, best val loss at most nanoGPT's + 0.01.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

NANOGPT_ARGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                "--n_embd=128", "--dropout=0.0"]


def timed(cmd: list[str], cwd: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-4000:])
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed with exit code {proc.returncode}")
    return seconds, proc.stdout


def prepare_nanogpt(nanogpt: str, corpus_path: str, work: str) -> str:
    """A copy of nanoGPT's folder with the corpus prepared by its own prepare.py; returns the copy."""
    copy = os.path.join(work, "nanogpt")
    shutil.copytree(nanogpt, copy, ignore=shutil.ignore_patterns("out*", "*.bin", "*.pkl"))
    data = os.path.join(copy, "data", "shakespeare_char")
    shutil.copy(corpus_path, os.path.join(data, "input.txt"))
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, stdout=subprocess.DEVNULL)
    return copy


def run_nanogpt(copy: str, steps: int) -> dict:
    out = os.path.join(copy, f"out-{time.time_ns()}")
    seconds, log = timed([sys.executable, "train.py", *NANOGPT_ARGS, f"--max_iters={steps}",
                          f"--lr_decay_iters={steps}", f"--out_dir={out}"], copy)
    vals = [float(v) for v in re.findall(r"val loss (\d+\.\d+)", log)]
    return {"seconds": seconds, "best_val_loss": min(vals) if vals else None, "evals": len(vals)}


def run_jaxgpt(corpus_path: str, steps: int, work: str, extra: list[str]) -> dict:
    out = os.path.join(work, f"jaxgpt-{time.time_ns()}")
    cmd = [sys.executable, "train.py", "--config=configs/shakespeare_char_cpu.py", f"--config.out_dir={out}",
           "--config.data.corpus=tinyshakespeare", f"--config.data.path={os.path.abspath(corpus_path)}",
           f"--config.train.max_steps={steps}", f"--config.train.decay_steps={steps}", *extra]
    seconds, log = timed(cmd, ROOT)
    vals = [float(v) for v in re.findall(r"\| val (\d+\.\d+)", log)]
    return {"seconds": seconds, "best_val_loss": min(vals) if vals else None, "evals": len(vals)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus-path", required=True, help="nanoGPT's tinyshakespeare input.txt")
    p.add_argument("--nanogpt", default=os.path.join(ROOT, "..", "shared", "peers", "nanogpt"),
                   help="nanoGPT's folder (copied, never modified)")
    p.add_argument("--steps", type=int, default=2000, help="training steps on each side (nanoGPT: 2000)")
    p.add_argument("--runs", type=int, default=1, help="alternate the two sides this many times")
    p.add_argument("--no-peer", action="store_true", help="time jaxgpt only")
    p.add_argument("--jaxgpt-args", nargs=argparse.REMAINDER, default=[],
                   help="extra --config.KEY=VALUE flags for jaxgpt's train.py (last on the command line)")
    args = p.parse_args()

    from bench.common import ceilings, machine, write_results
    from jaxgpt.data import prepare_dataset

    prepare_dataset(corpus="tinyshakespeare", path=args.corpus_path, tokenizer="char", progress=False)
    results = {"machine": machine(), "ceilings": ceilings(), "settings": vars(args), "jaxgpt_runs": [],
               "nanogpt_runs": []}
    with tempfile.TemporaryDirectory() as work:
        copy = None if args.no_peer else prepare_nanogpt(args.nanogpt, args.corpus_path, work)
        for i in range(args.runs):
            r = run_jaxgpt(args.corpus_path, args.steps, work, args.jaxgpt_args)
            results["jaxgpt_runs"].append(r)
            print(f"run {i + 1}: jaxgpt {r['seconds']:.1f} s, best val {r['best_val_loss']}", flush=True)
            if copy:
                r = run_nanogpt(copy, args.steps)
                results["nanogpt_runs"].append(r)
                print(f"run {i + 1}: nanoGPT {r['seconds']:.1f} s, best val {r['best_val_loss']}", flush=True)
    for side in ("jaxgpt", "nanogpt"):
        runs = results[f"{side}_runs"]
        if runs:
            results[side] = {"seconds": statistics.median(r["seconds"] for r in runs),
                             "best_val_loss": statistics.median(r["best_val_loss"] for r in runs)}
    if "nanogpt" in results:
        ratio = results["jaxgpt"]["seconds"] / results["nanogpt"]["seconds"]
        results["time_ratio_jaxgpt_over_nanogpt"] = ratio
        print(f"median of {args.runs}: jaxgpt {results['jaxgpt']['seconds']:.1f} s (best val "
              f"{results['jaxgpt']['best_val_loss']:.4f}), nanoGPT {results['nanogpt']['seconds']:.1f} s (best val "
              f"{results['nanogpt']['best_val_loss']:.4f}): jaxgpt takes {ratio:.2f}x nanoGPT's time (target <= 0.6x)")
    print(f"results: {write_results('baby_run', results)}")


if __name__ == "__main__":
    main()
