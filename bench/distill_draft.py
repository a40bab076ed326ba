"""Distil a speculative-decoding draft from its target: the target's own greedy continuations of corpus
windows become the draft's training text, so the draft learns to propose what the target would say.

python bench/distill_draft.py TARGET_RUN DRAFT_RUN OUT [--prompts 1024] [--prompt-len 16] [--steps 300]
                              [--batch 16] [--lr 1e-3]

TARGET_RUN and DRAFT_RUN are training runs with the same tokenizer (DRAFT_RUN: a small model trained on the
same corpus, the starting point). OUT becomes a run folder holding the distilled draft (its config and
tokenizer are DRAFT_RUN's), for `bench/decode.py --speculative TARGET_RUN OUT`. The prompts are windows of
the corpus's first 90% (the training split); a window's continuation fills the smaller model's context.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxgpt  # noqa: E402
from jaxgpt.checkpoint import Checkpointer  # noqa: E402
from jaxgpt.loading import load_model  # noqa: E402
from jaxgpt.training.step import create_train_state, make_train_step  # noqa: E402


def corpus_ids(meta: dict, tok) -> np.ndarray:
    from jaxgpt.data.corpora import default_cache_dir, shakespeare_text_file, tinyshakespeare_file
    data = meta["config"]["data"]
    cache = default_cache_dir() if data.get("cache_dir") is None else data["cache_dir"]
    if data["corpus"] == "shakespeare":
        path = shakespeare_text_file(cache)
    elif data["corpus"] == "tinyshakespeare":
        path = tinyshakespeare_file(cache, data.get("path"))
    else:
        path = data["path"]
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return np.asarray(tok.encode(text[: int(len(text) * 0.9)]), np.int32)


def continuations(params, cfg, ids: np.ndarray, n: int, prompt_len: int, length: int, seed: int) -> np.ndarray:
    """[n, length]: a corpus window of prompt_len tokens and the target's greedy continuation of it."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(ids) - prompt_len, n)
    prompts = np.stack([ids[s:s + prompt_len] for s in starts])
    decoder, out, batch, t0 = jaxgpt.Decoder(params, cfg), [], 64, time.perf_counter()
    for i in range(0, n, batch):
        got = decoder.generate(prompts[i:i + batch], length - prompt_len, jax.random.key(i), temperature=0.0)
        out.append(np.asarray(got.tokens))
        print(f"\r  target continuations {min(i + batch, n)}/{n} ({time.perf_counter() - t0:.0f} s)", end="",
              flush=True)
    print()
    return np.concatenate(out)


def train(params, cfg, seqs: np.ndarray, steps: int, batch: int, lr: float, seed: int):
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(20, steps // 10 + 1), steps, lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.99, weight_decay=0.1))
    state = create_train_state(params, optimizer, jax.random.key(seed))
    step = jax.jit(make_train_step(cfg, optimizer))
    rng, t0 = np.random.default_rng(seed), time.perf_counter()
    for i in range(steps):
        rows = seqs[rng.integers(0, len(seqs), batch)]
        state, metrics = step(state, rows[:, :-1], rows[:, 1:])
        if (i + 1) % 50 == 0 or i + 1 == steps:
            print(f"  step {i + 1}/{steps} loss {float(metrics['loss']):.4f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    return state


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=1024, help="corpus windows the target continues")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300, help="training steps of the draft")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if os.path.exists(args.out):
        raise SystemExit(f"{args.out} exists; give a new folder")
    cfg, params, tok, meta = load_model(args.target)
    d_cfg, d_params, d_tok, d_meta = load_model(args.draft)
    if tok.to_dict() != d_tok.to_dict():
        raise SystemExit("the target and the draft use different tokenizers")
    length = min(cfg.block_size, d_cfg.block_size)
    if not 0 < args.prompt_len < length:
        raise SystemExit(f"--prompt-len must be in [1, {length - 1}]")
    ids = corpus_ids(meta, tok)
    seqs = continuations(params, cfg, ids, args.prompts, args.prompt_len, length, args.seed)
    state = train(d_params, d_cfg, seqs, args.steps, args.batch, args.lr, args.seed)
    ckpt = Checkpointer(args.out)
    ckpt.save(args.steps, state, dict(d_meta, step=args.steps, distilled=dict(
        target=os.path.abspath(args.target), draft=os.path.abspath(args.draft), **{
            k: v for k, v in vars(args).items() if k not in ("target", "draft", "out")})))
    ckpt.close()
    print(f"distilled draft in {args.out}")


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        out = sys.argv[3] if len(sys.argv) > 3 else None
        if out and os.path.isdir(out) and not os.listdir(out):
            shutil.rmtree(out)
        raise
