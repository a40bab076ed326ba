"""nanoGPT's CPU baby run, whole run against the clock: jaxgpt's train.py against a PyTorch peer.

python bench/baby_run.py --corpus-path PATH/tinyshakespeare.txt [--steps 2000] [--no-peer]

Both sides train 4 layers / 4 heads / 128 wide, context 64, batch 12, on character-level Tiny Shakespeare
with nanoGPT's baby-run schedule (lr 1e-3 -> 1e-4 cosine after 100 warmup steps, AdamW betas (0.9, 0.99),
weight decay 0.1 on matrices, gradient clip 1.0, no dropout) and evaluate 20 batches of each split every
250 steps. Each side runs in a fresh process timed from its start, so imports, data loading, compilation,
evaluation and checkpoints all count:

- jaxgpt: `python train.py --config=configs/shakespeare_char_cpu.py` on the same corpus;
- peer: transformers' `GPT2LMHeadModel` (PyTorch, eager) in a nanoGPT-style loop written here (random
  windows of the train split, the same schedule and evaluation), not nanoGPT's own code. Needs the `bench`
  extra.

The target (PERFORMANCE.md): val loss at most 1.88 in at most half the peer's wall-clock time.
The corpus is tokenized once (jaxgpt's data cache) before either side is timed.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

B, T, L, H, D = 12, 64, 4, 4, 128
LR, MIN_LR, WARMUP, BETA2, WD, CLIP = 1e-3, 1e-4, 100, 0.99, 0.1, 1.0
EVAL_INTERVAL, EVAL_BATCHES = 250, 20


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / (WARMUP + 1)
    frac = min(1.0, (step - WARMUP) / max(1, steps - WARMUP))
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * frac)) * (LR - MIN_LR)


def peer_worker(corpus_path: str, steps: int) -> None:
    """The PyTorch side; run in its own process by main(). Prints 'best_val X' and 'final_step N'."""
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from jaxgpt.data import prepare_dataset

    ds = prepare_dataset(corpus="tinyshakespeare", path=corpus_path, tokenizer="char", progress=False)
    splits = {s: torch.from_numpy(np.asarray(ds.tokens(s), dtype=np.int64)) for s in ("train", "val")}
    vocab = int(ds.meta["vocab_size"])
    torch.manual_seed(1337)
    gen = torch.Generator().manual_seed(1337)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=T, n_embd=D, n_layer=L, n_head=H,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, BETA2))

    def batch(split):
        data = splits[split]
        starts = torch.randint(len(data) - T - 1, (B,), generator=gen)
        x = torch.stack([data[i:i + T] for i in starts.tolist()])
        y = torch.stack([data[i + 1:i + 1 + T] for i in starts.tolist()])
        return x, y

    def loss_of(x, y):
        logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))

    best = float("inf")
    for step in range(steps + 1):
        if step % EVAL_INTERVAL == 0 or step == steps:
            model.eval()
            with torch.no_grad():
                losses = {s: float(np.mean([loss_of(*batch(s)).item() for _ in range(EVAL_BATCHES)]))
                          for s in ("train", "val")}
            model.train()
            best = min(best, losses["val"])
            print(f"peer step {step}: train {losses['train']:.4f} val {losses['val']:.4f}", flush=True)
        if step == steps:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        loss = loss_of(*batch("train"))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    print(f"best_val {best:.4f}", flush=True)


def timed(cmd: list[str], cwd: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-4000:])
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed with exit code {proc.returncode}")
    return seconds, proc.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus-path", required=True, help="nanoGPT's tinyshakespeare input.txt")
    p.add_argument("--steps", type=int, default=2000, help="training steps on each side (nanoGPT: 2000)")
    p.add_argument("--no-peer", action="store_true", help="time jaxgpt only")
    p.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peer_worker:
        return peer_worker(args.corpus_path, args.steps)

    from bench.common import ceilings, machine, write_results
    from jaxgpt.data import prepare_dataset

    prepare_dataset(corpus="tinyshakespeare", path=args.corpus_path, tokenizer="char", progress=False)
    ceil = ceilings()
    results = {"machine": machine(), "ceilings": ceil, "settings": vars(args)}
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "train.py", "--config=configs/shakespeare_char_cpu.py",
               f"--config.out_dir={out}/run", "--config.data.corpus=tinyshakespeare",
               f"--config.data.path={os.path.abspath(args.corpus_path)}", f"--config.train.max_steps={args.steps}",
               f"--config.train.decay_steps={args.steps}"]
        seconds, log = timed(cmd, ROOT)
    best = [float(v) for v in re.findall(r"best val (\d+\.\d+)", log)]
    results["jaxgpt"] = {"seconds": seconds, "best_val_loss": min(best) if best else None}
    print(f"jaxgpt: best val loss {results['jaxgpt']['best_val_loss']} in {seconds:.1f} s", flush=True)
    if not args.no_peer:
        cmd = [sys.executable, os.path.abspath(__file__), "--peer-worker", f"--corpus-path={args.corpus_path}",
               f"--steps={args.steps}"]
        seconds, log = timed(cmd, ROOT)
        best = re.findall(r"best_val (\d+\.\d+)", log)
        results["peer"] = {"seconds": seconds, "best_val_loss": float(best[-1]) if best else None}
        results["time_ratio_jaxgpt_over_peer"] = results["jaxgpt"]["seconds"] / seconds
        print(f"peer (HF GPT2LMHeadModel, eager): best val loss {results['peer']['best_val_loss']} in "
              f"{seconds:.1f} s; jaxgpt takes {results['time_ratio_jaxgpt_over_peer']:.2f}x the peer's time "
              "(target: at most 0.5x)", flush=True)
    print(f"results: {write_results('baby_run', results)}")


if __name__ == "__main__":
    main()
