"""Checkpoint benchmark: time spent in an async orbax save (blocking part and until finished), and its
effect on training steps/s when saving every K steps; with --checksums, what the checkpoints' SHA-256
checksums cost on save and on restore (default: a GPT-2 124M-shaped state, params + AdamW moments).

python bench/checkpoint.py [--config 6l] [--every 10] [--steps 40]
python bench/checkpoint.py --checksums [--config 124m] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from bench.common import machine, write_results  # noqa: E402
from bench.train import CONFIGS, batches  # noqa: E402
from jaxgpt import GPTConfig, count_params, init_params  # noqa: E402
from jaxgpt.checkpoint import Checkpointer, abstract_like, verify_checksums  # noqa: E402
from jaxgpt.training.config import default_config  # noqa: E402
from jaxgpt.training import create_train_state, make_optimizer, make_runner  # noqa: E402


SHAPES = {**CONFIGS, "124m": (12, 12, 768, 1024, 1, 50257)}  # (124m: --checksums only, no training)


def checksum_cost(cfg: GPTConfig, repeats: int) -> dict:
    """Save, verify and restore a step-0 TrainState `repeats` times: the checksums' seconds (written in
    the save's background thread, checked before each restore) against the bytes they cover."""
    opt = make_optimizer(default_config().train)
    state = create_train_state(init_params(cfg, jax.random.key(0)), opt, jax.random.key(1))
    # AdamW's moments as after training: zeros would compress to nothing on disk (orbax writes zstd)
    noise = lambda x: jax.random.normal(jax.random.key(x.size), x.shape, x.dtype) * 1e-3 if x.ndim else x
    state = state.replace(opt_state=jax.tree.map(noise, state.opt_state))
    saves, hashes, verifies, restores = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        ck = Checkpointer(tmp, keep=repeats)
        for step in range(repeats):
            t0 = time.perf_counter()
            ck.save(step, state, {"step": step})
            ck.wait()
            saves.append(time.perf_counter() - t0)
            hashed, seconds = ck.last_checksums
            hashes.append(seconds)
            t0 = time.perf_counter()
            checked = verify_checksums(os.path.join(ck.directory, str(step)))
            verifies.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            jax.block_until_ready(ck.restore(abstract_like(state), step)[0])  # (checks them again, as resume does)
            restores.append(time.perf_counter() - t0)
        ck.close()
    med = statistics.median
    return {"params": count_params(state.params), "state_bytes": sum(x.nbytes for x in jax.tree.leaves(state)),
            "bytes_hashed": hashed, "bytes_checked": checked, "save_until_finished_s": med(saves),
            "checksums_at_save_s": med(hashes), "verify_at_restore_s": med(verifies), "restore_s": med(restores),
            "hash_GB_per_s": hashed / med(hashes) / 1e9, "verify_GB_per_s": checked / med(verifies) / 1e9,
            "runs": {"save": saves, "checksums": hashes, "verify": verifies, "restore": restores}}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default=None, choices=sorted(SHAPES), help="default: 6l, 124m with --checksums")
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--checksums", action="store_true", help="the checksums' cost on save and restore instead")
    p.add_argument("--repeats", type=int, default=3, help="with --checksums: saves and restores (medians)")
    args = p.parse_args()
    args.config = args.config or ("124m" if args.checksums else "6l")
    L, H, D, T, B, V = SHAPES[args.config]
    if args.checksums:
        res = checksum_cost(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=D), args.repeats)
        path = write_results("checkpoint_checksums", {"machine": machine(), "settings": vars(args), "result": res})
        print(f"{args.config}: state {res['state_bytes'] / 2**30:.2f} GiB; checksums at save "
              f"{res['checksums_at_save_s']:.2f}s ({res['hash_GB_per_s']:.2f} GB/s, in the save's background "
              f"thread; the save finishes in {res['save_until_finished_s']:.2f}s), check at restore "
              f"{res['verify_at_restore_s']:.2f}s ({res['verify_GB_per_s']:.2f} GB/s; the restore, check "
              f"included, {res['restore_s']:.2f}s); medians of {args.repeats}")
        print(f"results: {path}")
        return
    if args.config == "124m":
        p.error("--config 124m is for --checksums (no training benchmark at that size here)")
    cfg = GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=D)
    opt = make_optimizer(default_config().train)
    runner = make_runner("pmap", cfg, opt)
    state = runner.put_state(create_train_state(init_params(cfg, jax.random.key(0)), opt, jax.random.key(1)))
    data = batches(4, B, T, V)
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(runner.get_state(state)))

    def run(save_every, ckpt):
        nonlocal state
        blocking, t0 = [], time.perf_counter()
        for i in range(args.steps):
            d = data[i % len(data)]
            state, m = runner.step(state, d[:, :-1], d[:, 1:])
            if save_every and (i + 1) % save_every == 0:
                jax.block_until_ready(m)
                s0 = time.perf_counter()
                ckpt.save(i + 1, runner.get_state(state), {"step": i + 1})
                blocking.append(time.perf_counter() - s0)
        jax.block_until_ready(m)
        if ckpt is not None:
            ckpt.wait()
        return (time.perf_counter() - t0) / args.steps, blocking

    d = data[0]
    state, m = runner.step(state, d[:, :-1], d[:, 1:])  # compile
    jax.block_until_ready(m)
    base, _ = run(0, None)
    with tempfile.TemporaryDirectory() as tmp:
        ck = Checkpointer(tmp, keep=2)
        with_saves, blocking = run(args.every, ck)
        s0 = time.perf_counter()
        ck.save(10**6, runner.get_state(state), {"step": 0})
        ck.wait()
        full_save = time.perf_counter() - s0
        ck.close()
    res = {"config": args.config, "params": count_params(runner.get_state(state).params), "state_bytes": nbytes,
           "ms_per_step_no_saves": 1e3 * base, "ms_per_step_saving_every": 1e3 * with_saves,
           "every": args.every, "save_blocking_s_median": statistics.median(blocking),
           "save_until_finished_s": full_save, "slowdown": with_saves / base - 1}
    path = write_results("checkpoint", {"machine": machine(), "settings": vars(args), "result": res})
    print(f"{args.config}: state {nbytes / 2**20:.1f} MiB; save blocks the loop {1e3 * res['save_blocking_s_median']:.0f} ms "
          f"(median), finishes in {full_save:.2f}s; {1e3 * base:.1f} ms/step without saves, "
          f"{1e3 * with_saves:.1f} ms/step saving every {args.every} steps ({100 * res['slowdown']:+.1f}%)")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
