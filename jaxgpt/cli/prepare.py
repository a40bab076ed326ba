"""jaxgpt-prepare: tokenize a corpus into cached train/val token bins and print their statistics.

jaxgpt-prepare                                   # Shakespeare's plays, char tokenizer
jaxgpt-prepare --tokenizer=bpe --vocab_size=1024
jaxgpt-prepare --corpus=file --path=my_texts/ --tokenizer=byte
jaxgpt-prepare --corpus=tinyshakespeare --path=input.txt
jaxgpt-prepare --corpus=hf --path=openwebtext --tokenizer=gpt2 --val_fraction=0.0005
jaxgpt-prepare --corpus=parquet --path=fineweb/ --tokenizer=gpt2 --shards=fineweb10B   # llm.c's shards
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from jaxgpt.data import CORPORA, TOKENIZERS, prepare_dataset


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    p = argparse.ArgumentParser(
        prog="jaxgpt-prepare",
        description="Tokenize a corpus into cached train/val token bins and print their statistics.",
    )
    p.add_argument(
        "--corpus", default="shakespeare", help=f"one of {', '.join(CORPORA)} (default shakespeare)"
    )
    p.add_argument(
        "--path",
        default=None,
        help="file or folder for 'file', local copy for 'tinyshakespeare', dataset name for 'hf'",
    )
    p.add_argument("--tokenizer", default=None,
                   help=f"one of {', '.join(TOKENIZERS)} (default char; gpt2 with --shards)")
    p.add_argument("--vocab_size", type=int, default=None, help="vocabulary size of the bpe tokenizer")
    p.add_argument(
        "--val_fraction", type=float, default=0.1, help="fraction of the corpus held out (default 0.1)"
    )
    p.add_argument(
        "--cache_dir", default=None, help="cache folder (default $JAXGPT_CACHE or ~/.cache/jaxgpt)"
    )
    p.add_argument(
        "--bpe_dir",
        default=None,
        help="folder with GPT-2's vocab.bpe and encoder.json (gpt2 tokenizer, offline)",
    )
    p.add_argument("--hf_config", default=None, help="Hugging Face dataset configuration name")
    p.add_argument("--hf_split", default="train", help="Hugging Face dataset split to read (default train)")
    p.add_argument("--text_field", default="text", help="the text field of Hugging Face, JSON Lines and Parquet rows (default text)")
    p.add_argument("--shards", default=None, metavar="DIR",
                   help="write llm.c's token shards into DIR (<name>_val_000000.bin, <name>_train_000001.bin, ... "
                        "and shards.json) instead of cached bins; resumes an unfinished preparation")
    p.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard (default 100M, llm.c's)")
    p.add_argument("--val_tokens", type=int, default=None,
                   help="tokens of the validation shard, the corpus's first (default --shard_tokens, llm.c's)")
    p.add_argument("--shard_name", default=None, help="the shards' name prefix (default from the corpus or path)")
    p.add_argument("--workers", type=int, default=None, help="processes that tokenize (default every core)")
    p.add_argument("--force", action="store_true", help="prepare again even if a current cache exists")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the metadata as JSON instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    """Prepare the dataset the flags describe and print its statistics; returns the exit code."""
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    if args.shards is not None:
        return _shards(args)
    try:
        ds = prepare_dataset(
            corpus=args.corpus,
            path=args.path,
            tokenizer=args.tokenizer or "char",
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
            cache_dir=args.cache_dir,
            progress=not args.quiet,
            bpe_dir=args.bpe_dir,
            hf_config=args.hf_config,
            hf_split=args.hf_split,
            text_field=args.text_field,
            force=args.force,
        )
    except (ValueError, OSError, ImportError) as e:
        from jaxgpt.report import one_line

        print(f"jaxgpt-prepare: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps(dict(ds.meta, path=str(ds.path), reused=ds.reused, seconds=elapsed), indent=1))
    else:
        print(ds.summary())
        print(f"this run    {elapsed:.2f} s" + (" (opened the cache)" if ds.reused else ""))
    return 0


def _shards(args) -> int:
    """jaxgpt-prepare --shards=DIR: llm.c's shards written (or resumed); a summary line, or one error line."""
    from jaxgpt.data.shard_writer import prepare_shards
    from jaxgpt.report import one_line

    tokenizer = args.tokenizer or "gpt2"
    try:
        d = prepare_shards(args.shards, corpus=args.corpus, path=args.path, tokenizer=tokenizer,
                           vocab_size=args.vocab_size, name=args.shard_name, shard_tokens=args.shard_tokens,
                           val_tokens=args.val_tokens, workers=args.workers, progress=not args.quiet,
                           force=args.force, bpe_dir=args.bpe_dir, text_field=args.text_field,
                           hf_config=args.hf_config, hf_split=args.hf_split, cache_dir=args.cache_dir)
    except (ValueError, OSError, ImportError) as e:
        print(f"jaxgpt-prepare: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(d, indent=1))
        return 0
    what = "already prepared" if d["reused"] else (f"{d['tokens_per_second']:,.0f} tokens/s, {d['seconds']:.1f} s"
                                                   + (", resumed" if d["resumed"] else ""))
    print(f"{d['path']}: {len(d['shards'])} shards, {d['tokens']['val']:,} val + {d['tokens']['train']:,} train "
          f"tokens, tokenizer {d['tokenizer']['type']} (vocab {d['vocab_size']}, end token {d['eos_id']}); {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
