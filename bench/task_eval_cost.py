"""The in-loop task evaluation's share of a training run (train.eval_tasks), on the CPU baby run.

python bench/task_eval_cost.py --corpus-path PATH/tinyshakespeare.txt [--items 200] [--steps 2000]
                               [--interval 250] [--jaxgpt-args ...]

Writes a generic multiple-choice task file of `--items` items cut from the corpus (a 40-character context,
its true next 12 characters and three 12-character spans from elsewhere), then runs
`python train.py --config=configs/shakespeare_char_cpu.py` on the corpus with that file as train.eval_tasks,
`train.eval_tasks_limit` the items, scored every `--interval` steps (eval_interval; tasks at every eval). The
run is one fresh process timed from its start to its exit; the task evaluation's seconds are the `tasks_s`
of metrics.jsonl's eval rows. Prints both and the fraction (issue 57: under 5% of the run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_tasks(corpus_path: str, path: str, items: int, seed: int = 0) -> None:
    """`items` generic items cut from the corpus: a context, its true continuation and three decoys."""
    text = open(corpus_path, encoding="utf-8").read()
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(items):
            at = int(rng.integers(0, len(text) - 60))
            decoys = [int(rng.integers(0, len(text) - 12)) for _ in range(3)]
            choices = [text[at + 40:at + 52]] + [text[d:d + 12] for d in decoys]
            label = int(rng.integers(4))
            choices[0], choices[label] = choices[label], choices[0]
            f.write(json.dumps({"context": text[at:at + 40], "choices": choices, "label": label}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus-path", required=True, help="Tiny Shakespeare's input.txt")
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--interval", type=int, default=250, help="train.eval_interval (the tasks at every eval)")
    p.add_argument("--jaxgpt-args", nargs=argparse.REMAINDER, default=[],
                   help="extra --config.KEY=VALUE flags for train.py (last on the command line)")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    from jaxgpt.data import prepare_dataset

    prepare_dataset(corpus="tinyshakespeare", path=args.corpus_path, tokenizer="char", progress=False)  # off the clock
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as work:
        tasks = os.path.join(work, "mc.jsonl")
        write_tasks(args.corpus_path, tasks, args.items)
        out = os.path.join(work, "run")
        cmd = [sys.executable, "train.py", "--config=configs/shakespeare_char_cpu.py", f"--config.out_dir={out}",
               "--config.data.corpus=tinyshakespeare", f"--config.data.path={os.path.abspath(args.corpus_path)}",
               f"--config.train.max_steps={args.steps}", f"--config.train.decay_steps={args.steps}",
               f"--config.train.eval_interval={args.interval}", f"--config.train.eval_tasks={tasks}",
               f"--config.train.eval_tasks_limit={args.items}", *args.jaxgpt_args]
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    secs = [r["tasks_s"] for r in rows if "tasks_s" in r]
    print(f"1-min load at the start {load:.2f}; run {wall:.1f} s; task evals {len(secs)} "
          f"({', '.join(f'{s:.2f}' for s in secs)} s), {sum(secs):.2f} s in all: {100 * sum(secs) / wall:.2f}% "
          f"of the run; without the first (compiling) {100 * sum(secs[1:]) / wall:.2f}%")


if __name__ == "__main__":
    main()
