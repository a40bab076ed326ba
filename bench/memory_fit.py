"""What fits where, by compiling: the largest per-device batch of a train step that fits a TPU or GPU target.

Each row runs `jaxgpt-aot` (a fresh process per compile, at the lowest CPU priority) on configs/gpt2_124m.py
with the model, parallelism and remat of the row, batch = per-device rows x devices, grad_accum 1,
scan_layers on (compile time flat in depth; the layers' memory is the same), the portable backend (XLA's
attention), and finds the largest
per-device batch that fits: doubling from 4 until a compile does not fit (halving while 4 does not), then
bisecting to within a quarter. Results go to
bench/results/memory_fit.json (merged with earlier runs) and, with --write-readme, as a table into
bench/README.md between the memory-fit markers.

    python bench/memory_fit.py [--rows headline|fast|all|NAME...] [--budget-min 25] [--write-readme]

Rows named with a fifth part "fast" compile as a user's config runs on the target by default: its
attention kernels (splash on TPUs, Pallas flash on GPUs) and train.loss_chunk=256.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results", "memory_fit.json")
README = os.path.join(REPO, "bench", "README.md")
BEGIN, END = "<!-- memory-fit table: bench/memory_fit.py --write-readme -->", "<!-- end memory-fit table -->"

# --config.model.* overrides of configs/gpt2_124m.py for each model (T = 1024; the Llama-style one at 2048)
MODELS = {
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "n_embd": 768},
    "gpt2-350m": {"n_layer": 24, "n_head": 16, "n_embd": 1024},
    "gpt2-774m": {"n_layer": 36, "n_head": 20, "n_embd": 1280},
    "gpt2-1.5b": {"n_layer": 48, "n_head": 25, "n_embd": 1600},
    "llama-1b": {"n_layer": 16, "n_head": 32, "n_kv_head": 8, "n_embd": 2048, "mlp_hidden": 8192, "block_size": 2048,
                 "position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "tie_embeddings": False},
}
TARGETS = {"v5e-8": "tpu:v5e:2x4", "v4-8": "tpu:v4:2x2x1", "v5p-8": "tpu:v5p:2x2x1", "h100x8": "gpu:h100:8",
           "h200x8": "gpu:h200:8", "v5e-256": "tpu:v5e:16x16"}
PARALLEL = {"fsdp": ["--config.train.parallel=mesh", "--config.train.fsdp=True"],
            "replicated": ["--config.train.parallel=mesh", "--config.train.fsdp=False"]}

# (model, target, parallel, remat), in the order the budget allows: "what fits where" first
HEADLINE = [("gpt2-124m", "v5e-8", "fsdp", "block"), ("gpt2-1.5b", "v5e-8", "fsdp", "block"),
            ("gpt2-124m", "h100x8", "fsdp", "block"), ("gpt2-1.5b", "h100x8", "fsdp", "block"),
            ("gpt2-124m", "v5e-8", "replicated", "none"), ("gpt2-350m", "v5e-8", "fsdp", "block"),
            ("gpt2-774m", "v5e-8", "fsdp", "block"), ("gpt2-1.5b", "v5e-8", "fsdp", "none"),
            ("gpt2-1.5b", "h200x8", "fsdp", "block"), ("llama-1b", "v5e-8", "fsdp", "block")]
# the same rows compiled as a user's config runs by default on the target: the target's attention kernels
# (kernels=auto: splash on TPUs, the Pallas flash kernel on GPUs) and the loss over chunks of 256 positions
VARIANTS = {"portable": ["--config.model.kernels=portable"],
            "fast": ["--config.model.kernels=auto", "--config.train.loss_chunk=256"]}
FAST = [row + ("fast",) for row in HEADLINE if row[3] == "block"]
ALL = HEADLINE + [(m, t, p, r) for m in MODELS for t in ("v5e-8", "h100x8", "v4-8", "v5p-8", "h200x8")
                  for p in PARALLEL for r in ("none", "block")]


def row_name(row) -> str:
    return "/".join(row)


def compile_once(row, per_device: int, timeout: int) -> dict:
    """One jaxgpt-aot run of the row's train step at `per_device` rows per device; its JSON (or an error)."""
    model, target, parallel, remat, variant = (*row, "portable")[:5]
    spec = TARGETS[target]
    devices = _device_count(spec)
    args = [f"--config.model.{k}={v}" for k, v in MODELS[model].items()]
    # "portable" (XLA's attention, whole logits: how the first table was compiled) or "fast" (VARIANTS)
    args += PARALLEL[parallel] + [f"--config.model.remat={remat}", "--config.model.scan_layers=True",
                                  *VARIANTS[variant],
                                  f"--config.train.batch_size={per_device * devices}", "--config.train.grad_accum=1"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = ["nice", "-n", "19", sys.executable, "-m", "jaxgpt.cli.aot", "--config=configs/gpt2_124m.py",
               f"--target={spec}", "--programs=train", f"--json={out}", *args]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"compile took over {timeout}s", "wall_s": time.time() - t0}
        wall = time.time() - t0
        if os.path.exists(out):
            with open(out) as f:
                r = json.load(f)
            train = r["programs"]["train"]
            return {"fits": bool(train["fits"]), "train": train, "wall_s": wall, "device_kind": r["device_kind"],
                    "n_params": r["model"]["n_params"]}
        return {"error": (p.stderr.strip().splitlines() or ["no output"])[-1], "wall_s": wall}


def _device_count(spec: str) -> int:
    platform, _, shape = spec.split(":")
    n = 1
    for d in shape.split("x"):
        n *= int(d)
    return n


def largest_batch(row, deadline: float, timeout: int, log, start: int = 4) -> dict:
    """Double the per-device batch from `start` until it does not fit (halve while it does not), then bisect
    to within a quarter: the largest batch found to fit, the smallest found not to, and the figures."""
    tried = {}

    def attempt(b):
        if time.time() > deadline:
            raise TimeoutError
        r = compile_once(row, b, timeout)
        tried[b] = r
        state = "error: " + r["error"] if "error" in r else ("fits" if r["fits"] else "does not fit")
        peak = r.get("train", {}).get("peak_bytes")
        log(f"  {row_name(row)} batch {b}/device: {state}" + (f", peak {peak / 2 ** 30:.2f} GiB" if peak else "")
            + f" ({r['wall_s']:.0f}s)")
        return None if "error" in r else r["fits"]

    good, bad = 0, None
    b = start
    try:
        while True:  # doubling up from `start` (or halving down when it does not fit)
            ok = attempt(b)
            if ok is None:
                return {"row": row_name(row), "error": tried[b]["error"], "tried": _summary(tried)}
            if ok:
                good = b
                if bad is not None or b >= 512:
                    break
                b *= 2
            else:
                bad = b
                if good or b == 1:
                    break
                b //= 2
        while bad is not None and good and bad - good > max(1, good // 4):  # to within a quarter
            mid = (good + bad) // 2
            if attempt(mid):
                good = mid
            else:
                bad = mid
    except TimeoutError:
        return {"row": row_name(row), "partial": True, "largest_fitting": good, "smallest_failing": bad,
                "best": _best(tried, good), "tried": _summary(tried)}
    return {"row": row_name(row), "largest_fitting": good, "smallest_failing": bad, "best": _best(tried, good),
            "tried": _summary(tried)}


def _best(tried, good):
    if not good:
        return None
    t = tried[good]["train"]
    keys = ("peak_bytes", "limit_bytes", "memory_bytes", "temp_bytes", "argument_bytes", "flops_ratio", "compile_s",
            "collectives", "custom_calls")
    return {k: t.get(k) for k in keys} | {"device_kind": tried[good]["device_kind"], "n_params": tried[good]["n_params"]}


def _summary(tried):
    return {str(b): ({"fits": r["fits"], "peak_bytes": r["train"].get("peak_bytes"), "wall_s": round(r["wall_s"], 1)}
                     if "train" in r else {"error": r.get("error"), "wall_s": round(r["wall_s"], 1)})
            for b, r in sorted(tried.items())}


def table(results: dict) -> str:
    """The markdown table of the results (one line per row)."""
    lines = ["| model | target | params/state | remat | attention, loss | largest batch per device (T) | peak at it / "
             "limit per device | first batch that failed (its peak) | collectives in the HLO (all-gather, "
             "reduce-scatter, all-reduce) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        model, target, parallel, remat, variant = (*name.split("/"), "portable")[:5]
        kernels = "XLA, whole logits" if variant == "portable" else \
            ("splash" if target.startswith("v") else "Pallas flash") + ", chunks of 256"
        t = MODELS[model].get("block_size", 1024)
        if "error" in r and not r.get("best"):
            lines.append(f"| {model} | {target} | {parallel} | {remat} | {kernels} | error: {r['error']} | | | |")
            continue
        b = r.get("best") or {}
        fit = r.get("largest_fitting", 0)
        batch = f"{fit} x {t}" + (" (search cut short)" if r.get("partial") else "")
        if not fit:
            batch = "none (1 does not fit)"
        peak = f"{b['peak_bytes'] / 2 ** 30:.2f} / {b['limit_bytes'] / 2 ** 30:.2f} GiB" if b.get("peak_bytes") else ""
        coll = b.get("collectives") or {}
        coll = f"{coll.get('all-gather', 0)}, {coll.get('reduce-scatter', 0)}, {coll.get('all-reduce', 0)}" if coll else ""
        failed = r.get("smallest_failing") or (0 if not fit else None)
        failed = "not reached" if failed is None else f"{failed or 1}" + _peak_of(r, failed or 1)
        lines.append(f"| {model} | {target} | {parallel} | {remat} | {kernels} | {batch} | {peak} | {failed} | {coll} |")
    return "\n".join(lines)


def _peak_of(r: dict, batch: int) -> str:
    peak = r.get("tried", {}).get(str(batch), {}).get("peak_bytes")
    return f" ({peak / 2 ** 30:.2f} GiB)" if peak else ""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", default=["headline"],
                    help="headline, fast (the headline's remat rows with the target's kernels and a chunked loss), all, "
                         "or MODEL/TARGET/PARALLEL/REMAT[/fast]")
    ap.add_argument("--budget-min", type=float, default=25.0, help="stop starting compiles after this many minutes")
    ap.add_argument("--timeout", type=int, default=900, help="seconds one compile may take")
    ap.add_argument("--write-readme", action="store_true", help="put the table into bench/README.md")
    ap.add_argument("--table-only", action="store_true", help="compile nothing: print (and write) the saved table")
    args = ap.parse_args(argv)
    rows = []
    for r in args.rows:
        rows += HEADLINE if r == "headline" else FAST if r == "fast" else ALL if r == "all" else [tuple(r.split("/"))]
    rows = list(dict.fromkeys(rows))
    results = {}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            results = json.load(f)
    deadline = time.time() + 60 * args.budget_min

    def log(msg):
        print(msg, flush=True)

    for row in [] if args.table_only else rows:
        if time.time() > deadline:
            log(f"budget spent: {row_name(row)} not run")
            continue
        log(f"{row_name(row)}:")
        results[row_name(row)] = largest_batch(row, deadline, args.timeout, log)
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "w") as f:
            json.dump(results, f, indent=2)
    print(table(results))
    if args.write_readme:
        with open(README) as f:
            text = f.read()
        block = f"{BEGIN}\n{table(results)}\n{END}"
        if BEGIN in text:
            text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
        else:
            text += "\n" + block + "\n"
        with open(README, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
