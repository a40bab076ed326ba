"""How long jaxgpt-serve takes to answer from its start with an empty compile cache (issue 58's target: 60 s
on a 2-core CPU for the GPT-2 124M shape), and until every program is compiled.

    python bench/cold_start.py [--model-dir DIR] [--runs 2] [--out cold_start] -- [jaxgpt-serve flags]

Each run starts `jaxgpt-serve --init_from=DIR --compile_cache=<a new empty folder>` (the model folder made
as bench/serve.py makes it: GPT-2 124M's shape, random float32 weights), and times: the ready line on
stdout (/health answers 200 from then), a first completion (8 tokens), and, for the paged engine, the
moment /metrics' `jaxgpt_engine_programs_pending` reaches 0. Results in bench/results/NAME.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve import make_model_folder, programs_pending  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def one_run(folder: str, flags: list, timeout: float) -> dict:
    """Start a server on an empty compile cache; the seconds to each milestone."""
    with tempfile.TemporaryDirectory(prefix="jaxgpt-cold-") as cache:
        cmd = [sys.executable, "-m", "jaxgpt.cli.serve", f"--init_from={folder}", "--host=127.0.0.1", "--port=0",
               f"--compile_cache={cache}", *flags]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                start_new_session=True)
        try:
            line = proc.stdout.readline()  # (the ready line: the first on stdout)
            ready = time.perf_counter() - t0
            if "ready at " not in line:
                raise RuntimeError(f"no ready line (exit {proc.poll()}): {line!r}")
            base = line.split("ready at ")[1].split()[0]  # http://127.0.0.1:PORT/v1
            port = int(base.rsplit(":", 1)[1].split("/")[0])
            t1 = time.perf_counter()
            _post(base + "/completions", {"model": "jaxgpt-bench", "prompt": "hello", "max_tokens": 8})
            first = time.perf_counter() - t1
            deadline = t0 + timeout
            while programs_pending(port) > 0 and time.perf_counter() < deadline:
                time.sleep(0.25)
            return {"ready_s": ready, "first_completion_s": first, "all_compiled_s": time.perf_counter() - t0,
                    "ready_line": line.strip()}
        finally:
            proc.terminate()
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None, help="the model folder (made if absent; default: a temp dir)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--smoke", action="store_true", help="a tiny model (tests)")
    ap.add_argument("--out", default=None, help="results name under bench/results (default: not written)")
    args = ap.parse_args(ours)
    with tempfile.TemporaryDirectory(prefix="jaxgpt-cold-model-") as tmp:
        folder = args.model_dir or os.path.join(tmp, "model")
        if not os.path.exists(os.path.join(folder, "config.json")):
            make_model_folder(folder, args.smoke)
        runs = []
        for i in range(args.runs):
            r = one_run(folder, ["--served_model_name=jaxgpt-bench", *flags], args.timeout)
            print(f"run {i + 1}: ready in {r['ready_s']:.1f} s, a first completion {r['first_completion_s']:.2f} s "
                  f"later, every program compiled at {r['all_compiled_s']:.1f} s", flush=True)
            runs.append(r)
    out = {"flags": flags, "runs": runs, "cpu": _cpu()}
    if args.out:
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, args.out + ".json"), "w") as f:
            json.dump(out, f, indent=1)
    return out


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
        return " ".join(sorted(x for x in flags if x.startswith(("avx512", "amx"))))
    except (OSError, StopIteration):
        return ""


if __name__ == "__main__":
    main()
