"""Checkpoint benchmark: time spent in an async orbax save (blocking part and until finished), and its
effect on training steps/s when saving every K steps.

python bench/checkpoint.py [--config 6l] [--every 10] [--steps 40]
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
from jaxgpt.checkpoint import Checkpointer  # noqa: E402
from jaxgpt.training.config import default_config  # noqa: E402
from jaxgpt.training import create_train_state, make_optimizer, make_runner  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="6l", choices=sorted(CONFIGS))
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    L, H, D, T, B, V = CONFIGS[args.config]
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
