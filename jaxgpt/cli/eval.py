"""jaxgpt-eval: multiple-choice scores (HellaSwag and the like) of a training run's checkpoint, a Hugging Face
folder or GPT-2 weights, on local JSON Lines task files (jaxgpt/evals.py)."""

from __future__ import annotations

import argparse
import json
import sys

from jaxgpt.cli import cpu_unless_accelerated


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxgpt-eval", description=__doc__)
    p.add_argument("--out_dir", default="out", help="training run folder holding checkpoints/ (default: out)")
    p.add_argument("--init_from", default=None,
                   help="instead of --out_dir: a GPT-2 name (gpt2, gpt2-medium, ...) or a Hugging Face folder")
    p.add_argument("--step", type=int, default=None, help="checkpoint step to load (default: the latest)")
    p.add_argument("--tasks", required=True,
                   help="comma-separated JSON Lines task files: HellaSwag's form (ctx, endings, label) or "
                        '{"context", "choices", "label"}, or llm.c\'s hellaswag_val.bin (GPT-2 token ids, style llmc); '
                        "scores go under each file's stem")
    p.add_argument("--limit", type=int, default=None, help="score only the first N items of each task")
    p.add_argument("--style", default="llmc", choices=["llmc", "lm_eval"],
                   help="llmc: llm.c's scoring (default); lm_eval: lm-evaluation-harness's HellaSwag "
                        "preprocessing and its acc_norm (loss per character of the choice)")
    p.add_argument("--rows", type=int, default=32, help="choices scored per compiled call (default 32)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on the last line: {task: {acc, acc_norm, n}}")
    p.add_argument("--tokenizer", default=None,
                   help="with --init_from, when the folder has no tokenizer.json: a tokenizer name (default gpt2)")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import this module first: one that registers the run's block or attention (repeatable)")
    p.add_argument("--compile_cache", default="auto",
                   help="compiled programs kept on disk: 'auto' ($JAXGPT_CACHE/xla), 'off', or a folder")
    return p


def _load(args):
    from jaxgpt import loading
    if args.init_from:
        loaded = loading.load(args.init_from, step=args.step, tokenizer=args.tokenizer or "gpt2", imports=args.imports)
        return loaded.config, loaded.params, loaded.tokenizer, args.init_from
    loaded = loading.load_run(args.out_dir, args.step, imports=args.imports)
    return loaded.config, loaded.params, loaded.tokenizer, f"{args.out_dir} (step {loaded.meta.get('step')})"


def table(scores: dict) -> str:
    """The scores as an aligned text table, a row per task."""
    width = max([4] + [len(name) for name in scores])
    lines = [f"{'task':<{width}}  {'n':>6}  {'acc':>7}  {'acc_norm':>8}  {'items/s':>8}"]
    for name, s in scores.items():
        rate = s["n"] / s["seconds"] if s.get("seconds") else float("nan")
        lines.append(f"{name:<{width}}  {s['n']:>6}  {s['acc']:>7.4f}  {s['acc_norm']:>8.4f}  {rate:>8.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cpu_unless_accelerated()  # before JAX picks its backends
    from jaxgpt import compile_cache, evals
    from jaxgpt.checkpoint import CheckpointError
    from jaxgpt.report import one_line

    def fail(e) -> int:
        print(f"jaxgpt-eval: {one_line(str(e))}", file=sys.stderr)
        return 2

    if args.limit is not None and args.limit < 1:
        return fail(f"--limit must be >= 1, got {args.limit}")
    if args.rows < 1:
        return fail(f"--rows must be >= 1, got {args.rows}")
    compile_cache.enable(args.compile_cache)
    try:
        paths = evals.parse_task_list(args.tasks)
        if not paths:
            raise ValueError("--tasks names no task file")
        tasks = evals.read_tasks(paths, args.style, args.limit)  # (before the model: a bad file fails fast)
        config, params, tok, source = _load(args)
        evals.check_vocab(tasks, config.vocab_size)
        scorer = evals.Scorer({"params": params}, config, rows=args.rows)
        scores = evals.evaluate(scorer, tok, tasks, args.style)
    except (ValueError, CheckpointError, OSError, ImportError) as e:
        return fail(e)
    print(f"# {source}, style {args.style}")
    print(table(scores), flush=True)
    if args.json:
        print(json.dumps({k: {m: s[m] for m in ("acc", "acc_norm", "n")} for k, s in scores.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
