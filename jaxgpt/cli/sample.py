"""jaxgpt-sample: generate text from a training run's checkpoint (or GPT-2 weights)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxgpt-sample", description=__doc__)
    p.add_argument("--out_dir", default="out", help="training run folder holding checkpoints/ (default: out)")
    p.add_argument("--init_from", default=None,
                   help="instead of --out_dir: a GPT-2 name (gpt2, gpt2-medium, ...) or a Hugging Face folder")
    p.add_argument("--step", type=int, default=None, help="checkpoint step to load (default: the latest)")
    p.add_argument("--prompt", default="\n", help="prompt text; 'FILE:path' reads it from a file (default: newline)")
    p.add_argument("--prompt_file", default=None, help="read the prompt from this file")
    p.add_argument("--num_samples", type=int, default=3, help="how many samples, generated as one batch")
    p.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; higher = more random")
    p.add_argument("--top_k", type=int, default=200, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top_p", type=float, default=None, help="nucleus sampling threshold in (0, 1]")
    p.add_argument("--seed", type=int, default=1, help="random seed: the same seed gives the same samples")
    p.add_argument("--stop", action="append", default=[],
                   help="cut a sample at this string (repeatable; e.g. --stop=$'\\n\\n' for a blank line)")
    p.add_argument("--tokenizer", default=None, help="with --init_from: tokenizer name (default gpt2)")
    p.add_argument("--save_settings", default=None, help="write the settings and samples to this JSON file")
    return p


def _load(args):
    if args.init_from:
        from jaxgpt.data import get_tokenizer
        from jaxgpt.pretrained import from_pretrained
        config, params = from_pretrained(args.init_from)
        return config, params, get_tokenizer(args.tokenizer or "gpt2"), {"source": args.init_from}
    from jaxgpt.checkpoint import load_model
    config, params, tok, meta = load_model(args.out_dir, args.step)
    return config, params, tok, {"source": args.out_dir, "step": meta.get("step")}


def _generate_long(params, config, tok, ids, args, top_k) -> list:
    """New token ids per sample. Past the model's block_size, continue in chunks from the most recent
    context (nanoGPT crops the context the same way); at most a few distinct shapes, so few compiles."""
    import jax
    import numpy as np

    from jaxgpt.sampling import generate

    seqs = [list(ids) for _ in range(args.num_samples)]
    new = [[] for _ in range(args.num_samples)]
    done = [False] * args.num_samples
    chunk_cap = max(1, config.block_size // 2) if len(ids) + args.max_new_tokens > config.block_size else \
        args.max_new_tokens
    rng, remaining = jax.random.key(args.seed), args.max_new_tokens
    while remaining > 0 and not all(done):
        n = min(remaining, chunk_cap)
        ctx = [s[-(config.block_size - n):] for s in seqs]
        plen = np.array([len(c) for c in ctx], np.int32)
        prompts = np.zeros((len(ctx), plen.max()), np.int32)
        for r, c in enumerate(ctx):
            prompts[r, :len(c)] = c
        rng, key = jax.random.split(rng)
        out = generate(params, config, prompts, n, key, prompt_lengths=plen, temperature=args.temperature,
                       top_k=top_k, top_p=args.top_p, eos_id=tok.eos_id)
        tokens, lengths = jax.device_get((out.tokens, out.lengths))
        for r in range(len(seqs)):
            if done[r]:
                continue
            got = [int(t) for t in tokens[r, plen[r]:lengths[r]]]
            seqs[r] += got
            new[r] += got
            done[r] = tok.eos_id is not None and tok.eos_id in got
        remaining -= n
    return new


def _read_prompt(path: str) -> str:
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at "
                         f"position {e.start}); pass a text file") from None
    except OSError as e:
        raise ValueError(f"cannot read prompt file {path}: {e.strerror}") from None


def _check_writable(path: str) -> None:
    """Fail before generating, not after, when --save_settings could not be written."""
    path = os.path.abspath(os.path.expanduser(path))
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise ValueError(f"--save_settings={path} is a folder; give a file path such as {path}/samples.json")
    if not os.path.isdir(folder):
        raise ValueError(f"--save_settings: folder {folder} does not exist; create it first or choose another "
                         "path")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--save_settings: folder {folder} is not writable; choose another path")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from jaxgpt.checkpoint import CheckpointError
    from jaxgpt.report import one_line

    def fail(e) -> int:
        print(f"jaxgpt-sample: {one_line(str(e))}", file=sys.stderr)
        return 2

    if args.num_samples < 1:
        return fail("--num_samples must be >= 1")
    try:
        prompt = args.prompt
        if args.prompt_file or prompt.startswith("FILE:"):
            prompt = _read_prompt(args.prompt_file or prompt[len("FILE:"):])
        if args.save_settings:
            _check_writable(args.save_settings)
        config, params, tok, source = _load(args)
        ids = tok.encode(prompt)
        if not ids:
            raise ValueError("the prompt encodes to no tokens; give a non-empty --prompt")
        top_k = args.top_k if args.top_k else None
        t0 = time.time()
        new_tokens = _generate_long(params, config, tok, ids, args, top_k)
        dt = time.time() - t0
    except (ValueError, CheckpointError, OSError, ImportError) as e:  # OSError: a download that failed
        return fail(e)

    settings = {**source, "prompt": prompt, "tokenizer": tok.to_dict().get("type", type(tok).__name__),
                "temperature": args.temperature, "top_k": top_k, "top_p": args.top_p, "seed": args.seed,
                "max_new_tokens": args.max_new_tokens, "num_samples": args.num_samples, "stop": args.stop}
    print("# settings: " + json.dumps(settings))
    samples = []
    for new_ids in new_tokens:
        text = tok.decode([t for t in new_ids if t != tok.eos_id])
        cuts = [text.find(s) for s in args.stop if s and s in text]
        if cuts:
            text = text[: min(cuts)]
        samples.append(prompt + text)
        print(prompt + text)
        print("---------------")
    n_new = sum(len(t) for t in new_tokens)
    print(f"# {n_new} tokens in {dt:.2f}s (compile included)", file=sys.stderr)
    if args.save_settings:
        with open(args.save_settings, "w", encoding="utf-8") as f:
            json.dump({"settings": settings, "samples": samples}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
