"""How XLA:CPU flags change compile time: a one-op program and a tiny model's train step, each compiled
anew many times, in a fresh process per flag set (XLA reads its flags once, at start-up).

    python bench/compile_flags.py                      # the suite's flags (tests/xla_flags.py) vs XLA's defaults
    python bench/compile_flags.py --flags "" "--xla_cpu_use_fusion_emitters=false"

Prints the median milliseconds of each (backend compile only: tracing and lowering are not flag-dependent)
and writes bench/results/compile_flags.json. This is what chose tests/xla_flags.py: the suite's programs
are tiny and many, so compile time is most of its time.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# runs in a fresh process: XLA_FLAGS is set before JAX starts; prints one JSON line
CHILD = r"""
import json, os, statistics, sys, time
os.environ["XLA_FLAGS"] = sys.argv[1]
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp
jax.config.update("jax_enable_compilation_cache", False)
from jaxgpt import GPT, GPTConfig, init_params
from jaxgpt.training.step import cross_entropy
reps = int(sys.argv[2])

def compile_ms(f, *args):
    lowered = jax.jit(f).lower(*args)
    t0 = time.perf_counter()
    lowered.compile()
    return 1e3 * (time.perf_counter() - t0)

x = jnp.ones((7, 5))
compile_ms(lambda a: a * -1.0, x)  # warm-up: first-compile costs
one_op = [compile_ms(lambda a, c=float(i): a * c + 1.0, x) for i in range(reps)]  # a new constant: a new program
cfg = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)
params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
idx = jax.ShapeDtypeStruct((8, 16), jnp.int32)

def step_with(lr):
    def step(p, x):
        loss = lambda q: cross_entropy(GPT(cfg).apply({"params": q}, x[:, :-1]), x[:, 1:])
        return jax.tree.map(lambda a, g: a - lr * g, p, jax.grad(loss)(p))
    return step

train_step = [compile_ms(step_with(0.1 * (i + 1)), params, idx) for i in range(max(3, reps // 8))]
print(json.dumps({"one_op_ms": statistics.median(one_op), "train_step_ms": statistics.median(train_step)}))
"""


def main(argv=None):
    from tests.xla_flags import COMPILE_FAST

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flags", nargs="+", default=["--xla_backend_optimization_level=0", COMPILE_FAST, ""],
                   help="XLA_FLAGS values to compare, each in its own process ('' = XLA's defaults)")
    p.add_argument("--reps", type=int, default=40, help="one-op programs compiled per flag set (train steps: 1/8)")
    args = p.parse_args(argv)
    rows = []
    for flags in args.flags:
        out = subprocess.run([sys.executable, "-c", CHILD, flags, str(args.reps)], cwd=REPO, capture_output=True,
                             text=True, check=True)
        row = {"xla_flags": flags, **json.loads(out.stdout.strip().splitlines()[-1])}
        rows.append(row)
        print(f"{row['one_op_ms']:7.1f} ms one op  {row['train_step_ms']:7.1f} ms train step  XLA_FLAGS={flags!r}",
              flush=True)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "compile_flags.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
