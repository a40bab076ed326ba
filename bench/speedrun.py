"""The CPU speedrun: nanoGPT's baby-run loss in as little wall time as possible, whole processes, against
nanoGPT's own train.py on the same machine.

python bench/speedrun.py --corpus-path PATH/tinyshakespeare.txt [--runs 2] [--cache cold|warm|both]
                         [--no-peer] [--target 1.886] [--config configs/speedrun_char_cpu.py]
                         [--ablate all | PIECE ...] [--jaxgpt-args ...]

- jaxgpt: `python train.py --config=configs/speedrun_char_cpu.py --config.data.corpus=file
  --config.data.path=PATH --config.train.target_val_loss=TARGET`, a fresh process timed from its start to
  its exit (imports, data, compilation, evaluation and the checkpoint all count); it stops at the first
  evaluation whose val loss is at or below the target. Its evaluation reads more val tokens than nanoGPT's
  (8 x 32 x 64 against 20 x 12 x 64); its val split is the corpus's last 10%, cut at a line break, as
  nanoGPT's prepare.py cuts at 90%. jaxgpt keeps compiled programs on disk (config.compile_cache): "cold"
  gives each run an empty cache (the first run on a machine), "warm" one that an untimed run filled (every
  later run of the same config).
- peer: nanoGPT's unmodified train.py, its README's CPU baby run (bench/baby_run.py's command, 2000
  steps), whose best val loss (1.886 on the machine of PERFORMANCE.md) is the target's default.

With --runs N the sides alternate N times and the medians are compared (goal: jaxgpt at most 0.25x).
--ablate toggles one piece of the recipe per run (removed where the config uses it, added where it does
not; warm cache), for the ablation table of bench/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.baby_run import prepare_nanogpt, run_nanogpt, timed  # noqa: E402

# piece -> (the overrides that remove it: the GPT-2 / nanoGPT choice in its place, the overrides that add it)
PIECES = {
    "muon": ({"train.optimizer": "adamw"}, {"train.optimizer": "muon"}),
    "wsd": ({"train.schedule": "cosine"}, {"train.schedule": "wsd"}),
    "qk_norm": ({"model.qk_norm": False}, {"model.qk_norm": True}),
    "relu2": ({"model.mlp": "gelu"}, {"model.mlp": "relu2"}),
    "zero_init_proj": ({"model.zero_init_proj": False}, {"model.zero_init_proj": True}),
    "logit_softcap": ({"model.logit_softcap": 0.0}, {"model.logit_softcap": 15.0}),
    "embed_skip": ({"model.embed_skip": False}, {"model.embed_skip": True}),
    "value_embeds": ({"model.value_embeds": 0}, {"model.value_embeds": 1}),
    "rope": ({"model.position": "learned"}, {"model.position": "rope"}),
    "rmsnorm": ({"model.norm": "layernorm"}, {"model.norm": "rmsnorm"}),
    "untied_head": ({"model.tie_embeddings": True}, {"model.tie_embeddings": False}),
    "bfloat16": ({"model.dtype": "float32"}, {"model.dtype": "bfloat16"}),
}


def load_config(path: str):
    spec = importlib.util.spec_from_file_location("speedrun_config", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def toggles(config, pieces: list[str]) -> dict[str, tuple[str, dict]]:
    """For each piece, ('without' or 'with', overrides): remove it if `config` uses it, else add it."""
    def uses(overrides):
        return all(config[k.split(".")[0]][k.split(".")[1]] == v for k, v in overrides.items())
    return {name: ("without", PIECES[name][0]) if uses(PIECES[name][1]) else ("with", PIECES[name][1])
            for name in pieces}


def run_jaxgpt(config: str, corpus_path: str, target: float, cache: str, work: str, extra: list[str]) -> dict:
    out = os.path.join(work, f"jaxgpt-{time.time_ns()}")
    cmd = [sys.executable, "train.py", f"--config={config}", f"--config.out_dir={out}", "--config.data.corpus=file",
           f"--config.data.path={os.path.abspath(corpus_path)}", f"--config.train.target_val_loss={target}",
           f"--config.compile_cache={cache}", *extra]
    seconds, log = timed(cmd, ROOT)
    vals = [float(v) for v in re.findall(r"\| val (\d+\.\d+)", log)]
    steps = re.findall(r"done at step (\d+)", log)
    return {"seconds": seconds, "best_val_loss": min(vals) if vals else None, "evals": len(vals),
            "steps": int(steps[-1]) if steps else None, "reached": "train.target_val_loss" in log}


def describe(r: dict) -> str:
    reached = "reached" if r["reached"] else "NOT reached"
    return f"{r['seconds']:.1f} s, {r['steps']} steps, best val {r['best_val_loss']:.4f} ({reached})"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus-path", required=True, help="nanoGPT's tinyshakespeare input.txt")
    p.add_argument("--nanogpt", default=os.path.join(ROOT, "..", "shared", "peers", "nanogpt"),
                   help="nanoGPT's folder (copied, never modified)")
    p.add_argument("--config", default="configs/speedrun_char_cpu.py", help="jaxgpt's speedrun config")
    p.add_argument("--target", type=float, default=1.886, help="the val loss to reach (nanoGPT's baby run: 1.886)")
    p.add_argument("--runs", type=int, default=1, help="alternate the sides this many times")
    p.add_argument("--cache", choices=("cold", "warm", "both"), default="both",
                   help="jaxgpt's compile cache: cold (an empty one each run: compilation counted), warm (one "
                        "filled by an untimed run first: a repeated run), both (each run both ways)")
    p.add_argument("--no-peer", action="store_true", help="time jaxgpt only")
    p.add_argument("--ablate", nargs="*", default=[], metavar="PIECE",
                   help=f"also run once with each piece toggled (removed if the config uses it, else added), "
                        f"compile cache warm: 'all' or some of {sorted(PIECES)}")
    p.add_argument("--jaxgpt-args", nargs=argparse.REMAINDER, default=[],
                   help="extra --config.KEY=VALUE flags for jaxgpt's train.py (last on the command line)")
    args = p.parse_args()
    args.pieces = sorted(PIECES) if args.ablate == ["all"] else args.ablate
    unknown = sorted(set(args.pieces) - set(PIECES))
    if unknown:
        p.error(f"unknown --ablate piece(s) {unknown}; choose from {sorted(PIECES)} or 'all'")
    return args


def main():
    args = parse_args()
    from bench.common import ceilings, machine, write_results
    from jaxgpt.data import prepare_dataset

    prepare_dataset(corpus="file", path=args.corpus_path, tokenizer="char", progress=False)
    modes = ("cold", "warm") if args.cache == "both" else (args.cache,)
    results = {"machine": machine(), "ceilings": ceilings(), "settings": vars(args), "nanogpt_runs": [],
               **{f"jaxgpt_{m}_runs": [] for m in modes}, "ablations": {}}
    with tempfile.TemporaryDirectory() as work:
        warm = os.path.join(work, "xla-warm")
        run = lambda cache, extra=(): run_jaxgpt(args.config, args.corpus_path, args.target, cache, work,  # noqa: E731
                                                 [*extra, *args.jaxgpt_args])
        if "warm" in modes or args.pieces:
            run(warm)  # untimed: fills the warm cache
        copy = None if args.no_peer else prepare_nanogpt(args.nanogpt, args.corpus_path, work)
        for i in range(args.runs):
            for mode in modes:
                r = run(warm if mode == "warm" else os.path.join(work, f"xla-cold-{i}"))
                results[f"jaxgpt_{mode}_runs"].append(r)
                print(f"run {i + 1}: jaxgpt, compile cache {mode}: {describe(r)}", flush=True)
            if copy:
                r = run_nanogpt(copy, 2000)
                results["nanogpt_runs"].append(r)
                print(f"run {i + 1}: nanoGPT {r['seconds']:.1f} s, best val {r['best_val_loss']:.4f}", flush=True)
        config = load_config(args.config)
        for name, (how, overrides) in toggles(config, args.pieces).items():
            flags = [f"--config.{k}={v}" for k, v in overrides.items()]
            run(warm, flags)  # untimed: compiles this variant into the warm cache
            r = run(warm, flags)
            results["ablations"][f"{how} {name}"] = {**r, "overrides": overrides}
            print(f"{how} {name} ({' '.join(flags)}): {describe(r)}", flush=True)
    summarise(results, args, modes)
    print(f"results: {write_results('speedrun_ablation' if args.pieces else 'speedrun', results)}")


def summarise(results: dict, args, modes) -> None:
    for side in ("nanogpt", *(f"jaxgpt_{m}" for m in modes)):
        runs = results[f"{side}_runs"]
        if runs:
            results[side] = {"seconds": statistics.median(r["seconds"] for r in runs),
                             "best_val_loss": statistics.median(r["best_val_loss"] for r in runs)}
    for mode in modes:
        j = results[f"jaxgpt_{mode}"]
        line = f"median of {args.runs}: jaxgpt (compile cache {mode}) {j['seconds']:.1f} s to best val " \
               f"{j['best_val_loss']:.4f} (target {args.target})"
        if "nanogpt" in results:
            n = results["nanogpt"]
            ratio = results[f"time_ratio_{mode}"] = j["seconds"] / n["seconds"]
            line += f"; nanoGPT {n['seconds']:.1f} s to best val {n['best_val_loss']:.4f}: {ratio:.3f}x its time " \
                    f"(goal <= 0.25x)"
        print(line)


if __name__ == "__main__":
    main()
