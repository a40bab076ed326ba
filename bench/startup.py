"""How long a new Python process takes to import JAX and jaxgpt, each measured in a fresh process (a
jaxgpt command, and every training process the tests start, pays it before any work).

    python bench/startup.py [--reps 7]

Prints the median seconds of `import numpy`, `import ml_dtypes` (after numpy), `import jax` and
`import jaxgpt.training` (after jax), with the installed numpy / ml_dtypes / jax versions, and writes
bench/results/startup.json. Found with it: ml_dtypes 0.7.0's import takes ~0.5 s (its ufunc loops,
registered one by one, each checked against the ones before), where 0.6.0's takes ~5 ms.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# runs in a fresh process; prints one JSON line of seconds per step, in order
CHILD = r"""
import json, time
out = {}
t = time.perf_counter()
import numpy
out["numpy"] = time.perf_counter() - t
t = time.perf_counter()
import ml_dtypes
out["ml_dtypes"] = time.perf_counter() - t
t = time.perf_counter()
import jax
out["jax"] = time.perf_counter() - t
t = time.perf_counter()
import jaxgpt.training
out["jaxgpt.training"] = time.perf_counter() - t
out["versions"] = {"numpy": numpy.__version__, "ml_dtypes": ml_dtypes.__version__, "jax": jax.__version__}
print(json.dumps(out))
"""

STEPS = ("numpy", "ml_dtypes", "jax", "jaxgpt.training")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=7, help="fresh processes to take the median over")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    runs = []
    for _ in range(args.reps):
        out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                             check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = {"versions": runs[0]["versions"], "reps": args.reps,
              "median_s": {k: statistics.median(r[k] for r in runs) for k in STEPS}}
    print("versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()))
    for k in STEPS:
        print(f"{1e3 * result['median_s'][k]:8.1f} ms  import {k}")
    print(f"{1e3 * sum(result['median_s'].values()):8.1f} ms  in all (median of {args.reps} processes)")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "startup.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
