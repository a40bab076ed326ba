"""jaxgpt-sample: generate text from a training run's checkpoint (or GPT-2 weights)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from jaxgpt.cli import cpu_unless_accelerated


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxgpt-sample", description=__doc__)
    p.add_argument("--out_dir", default="out", help="training run folder holding checkpoints/ (default: out)")
    p.add_argument("--init_from", default=None,
                   help="instead of --out_dir: a GPT-2 name (gpt2, gpt2-medium, ...) or a Hugging Face folder")
    p.add_argument("--step", type=int, default=None, help="checkpoint step to load (default: the latest)")
    p.add_argument("--prompt", default="\n", help="prompt text; 'FILE:path' reads it from a file (default: newline)")
    p.add_argument("--prompt_file", default=None, help="read the prompt from this file")
    p.add_argument("--num_samples", type=int, default=3, help="how many samples, generated as one batch")
    p.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate per sample (>= 1)")
    p.add_argument("--chunk_size", type=int, default=16,
                   help="tokens decoded per compiled step; the first sample is printed chunk by chunk (default 16)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; higher = more random")
    p.add_argument("--top_k", type=int, default=200, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top_p", type=float, default=None, help="nucleus sampling threshold in (0, 1]")
    p.add_argument("--seed", type=int, default=1, help="random seed: the same seed gives the same samples")
    p.add_argument("--stop", action="append", default=[],
                   help="cut a sample at this string (repeatable; e.g. --stop=$'\\n\\n' for a blank line)")
    p.add_argument("--tokenizer", default=None,
                   help="with --init_from, when the folder has no tokenizer.json: a tokenizer name (default gpt2)")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import this module first: one that registers the run's block or attention (repeatable; "
                        "the modules a run recorded are imported without it)")
    p.add_argument("--save_settings", default=None, help="write the settings and samples to this JSON file")
    p.add_argument("--compile_cache", default="auto",
                   help="compiled programs kept on disk, so that the next start skips compiling them: 'auto' "
                        "($JAXGPT_CACHE/xla, where jaxgpt-train keeps them), 'off', or a folder")
    p.add_argument("--quantize", default="none", choices=["none", "int8", "w8a8"],
                   help="decode with int8 weights (a scale per output channel, made at load; default none); w8a8: "
                        "the activations rounded to int8 per row too, prompts' included (faster at 8+ rows and in "
                        "prefill on a CPU with AVX512-VNNI)")
    p.add_argument("--kv_dtype", default="none", choices=["none", "int8", "bfloat16", "float32"],
                   help="the KV cache's dtype (none: the model's compute dtype; int8: a scale per position and head)")
    p.add_argument("--speculative", default="none", metavar="DRAFT",
                   help="decode speculatively: 'ngram' (proposals looked up in the text so far: no second model), "
                        "or a draft model (a run folder, a Hugging Face folder or a GPT-2 name) with the same "
                        "tokenizer; greedy output equals plain decoding's within the first context window (windows "
                        "past it end k tokens early, so the text may then differ). The text is printed per window, "
                        "not per chunk (default none)")
    p.add_argument("--speculative_k", type=int, default=4, help="tokens proposed per speculative round (default 4)")
    p.add_argument("--ngram", type=int, default=3, help="with --speculative=ngram: tokens matched (default 3)")
    return p


def _load(args):
    from jaxgpt import loading
    if args.init_from:
        config, params, tok, _, _ = loading.load(args.init_from, step=args.step, tokenizer=args.tokenizer or "gpt2",
                                                 imports=args.imports)
        return config, params, tok, {"source": args.init_from}
    config, params, tok, meta, _ = loading.load_run(args.out_dir, args.step, imports=args.imports)
    return config, params, tok, {"source": args.out_dir, "step": meta.get("step")}


def _speculative(args, config):
    """The Speculative of --speculative (None for none), its draft model loaded."""
    if args.speculative == "none":
        return None
    from jaxgpt import loading
    from jaxgpt.speculative import Speculative
    if args.speculative == "ngram":
        return Speculative(k=args.speculative_k, ngram=args.ngram)
    d_config, d_params, _, _, _ = loading.load(args.speculative, tokenizer=None, imports=args.imports)
    if d_config.vocab_size != config.vocab_size:
        raise ValueError(f"--speculative={args.speculative}: the draft's vocab_size ({d_config.vocab_size}) differs "
                         f"from the model's ({config.vocab_size}); a draft must share the model's tokenizer")
    return Speculative(k=args.speculative_k, draft=(d_params, d_config), ngram=args.ngram)


def _stream(params, config, tok, ids, args, top_k):
    """Yield (row, that sample's new ids so far) after each decoded chunk, until every sample has
    max_new_tokens, its end token or a stop string. Past the model's block_size the samples go on from
    their most recent block_size // 2 tokens (nanoGPT crops the context the same way): one prefill shape
    after the first, one decode program per chunk size, so few compiles whatever max_new_tokens."""
    import jax
    import numpy as np

    from jaxgpt.sampling import Decoder

    n = args.num_samples
    seqs, new, done = [list(ids) for _ in range(n)], [[] for _ in range(n)], [False] * n
    rng, remaining = jax.random.key(args.seed), args.max_new_tokens
    keep = max(1, config.block_size // 2)
    # its decode weights are made once, for every window
    spec = _speculative(args, config)
    decoder = Decoder(params, config, quantize=None if args.quantize == "none" else args.quantize,
                      kv_dtype=None if args.kv_dtype == "none" else args.kv_dtype, speculative=spec)
    room = 0 if spec is None else spec.k  # speculative rounds may write k positions past the last token
    if room and config.block_size - room < 2:
        raise ValueError(f"--speculative_k={room} leaves no room in block_size ({config.block_size}); lower it")
    limit, keep = config.block_size - room, min(keep, config.block_size - room - 1)
    while remaining > 0 and not all(done):
        ctx = [s if len(s) < limit else s[-keep:] for s in seqs]
        plen = np.array([len(c) for c in ctx], np.int32)
        prompts = np.zeros((n, plen.max()), np.int32)
        for r, c in enumerate(ctx):
            prompts[r, :len(c)] = c
        count = min(remaining, limit - prompts.shape[1])
        rng, key = jax.random.split(rng)
        settings = dict(prompt_lengths=plen, temperature=args.temperature, top_k=top_k, top_p=args.top_p,
                        eos_id=tok.eos_id)
        if spec is None:
            chunks = decoder.stream(prompts, count, key, chunk_size=args.chunk_size, **settings)
        else:  # one compiled loop per window
            toks = np.asarray(decoder.generate(prompts, count, key, **settings).tokens)
            chunks = [np.stack([toks[r, plen[r]:plen[r] + count] for r in range(n)])]
        for chunk in chunks:
            for r in range(n):
                if done[r]:
                    continue
                got = [int(t) for t in chunk[r]]
                if tok.eos_id is not None and tok.eos_id in got:
                    got, done[r] = got[:got.index(tok.eos_id)], True
                seqs[r] += got
                new[r] += got
                text = tok.decode(new[r])
                if any(stop and stop in text for stop in args.stop):
                    done[r] = True
                yield r, new[r]
            if all(done):
                return
        remaining -= count


def _cut(text: str, stops: list) -> str:
    cuts = [text.find(s) for s in stops if s and s in text]
    return text[:min(cuts)] if cuts else text


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
    cpu_unless_accelerated()  # before JAX picks its backends: no plugin tracebacks on a CPU-only machine
    from jaxgpt import compile_cache
    from jaxgpt.checkpoint import CheckpointError
    from jaxgpt.backends.cpu import inline_cpu_dispatch
    from jaxgpt.report import one_line

    compile_cache.enable(args.compile_cache)  # before the first compilation
    inline_cpu_dispatch()  # as jaxgpt-train and the benchmarks run (before any computation; backends/cpu.py)

    def fail(e) -> int:
        print(f"jaxgpt-sample: {one_line(str(e))}", file=sys.stderr)
        return 2

    if args.num_samples < 1:
        return fail("--num_samples must be >= 1")
    if args.max_new_tokens < 1:
        return fail(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.chunk_size < 1:
        return fail(f"--chunk_size must be >= 1, got {args.chunk_size}")
    if args.top_k < 0:
        return fail(f"--top_k must be >= 0 (0 = off), got {args.top_k}")
    from jaxgpt.sampling import validate_sampler
    try:  # before anything is loaded or printed
        validate_sampler(args.temperature, args.top_k or None, args.top_p)
    except ValueError as e:
        return fail(f"--{e}")
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
        settings = {**source, "prompt": prompt, "tokenizer": tok.to_dict().get("type", type(tok).__name__),
                    "temperature": args.temperature, "top_k": top_k, "top_p": args.top_p, "seed": args.seed,
                    "max_new_tokens": args.max_new_tokens, "num_samples": args.num_samples, "stop": args.stop,
                    "quantize": args.quantize, "kv_dtype": args.kv_dtype, "speculative": args.speculative}
        print("# settings: " + json.dumps(settings), flush=True)
        t0 = time.time()
        new = [[] for _ in range(args.num_samples)]
        shown = ""  # what of the first sample is on the screen: it streams as it is decoded
        sys.stdout.write(prompt)
        for row, ids_so_far in _stream(params, config, tok, ids, args, top_k):
            new[row] = ids_so_far
            if row == 0:
                text = _cut(tok.decode(ids_so_far), args.stop)
                if text.startswith(shown):  # (a multi-byte character may decode differently once complete)
                    sys.stdout.write(text[len(shown):])
                    sys.stdout.flush()
                    shown = text
        dt = time.time() - t0
    except (ValueError, CheckpointError, OSError, ImportError) as e:  # OSError: a download that failed
        return fail(e)

    samples = [prompt + _cut(tok.decode(ids_), args.stop) for ids_ in new]
    sys.stdout.write(samples[0][len(prompt) + len(shown):] + "\n---------------\n")
    for sample in samples[1:]:
        print(sample)
        print("---------------")
    n_new = sum(len(t) for t in new)
    print(f"# {n_new} tokens in {dt:.2f}s (compile included)", file=sys.stderr)
    if args.save_settings:
        with open(args.save_settings, "w", encoding="utf-8") as f:
            json.dump({"settings": settings, "samples": samples}, f, indent=2)
    return 0

if __name__ == "__main__":
    sys.exit(main())
