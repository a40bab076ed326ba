"""jaxgpt-prepare: tokenize a corpus into cached train/val token bins and print their statistics.

jaxgpt-prepare                                   # Shakespeare's plays, char tokenizer
jaxgpt-prepare --tokenizer=bpe --vocab_size=1024
jaxgpt-prepare --corpus=file --path=my_texts/ --tokenizer=byte
jaxgpt-prepare --corpus=tinyshakespeare --path=input.txt
jaxgpt-prepare --corpus=hf --path=openwebtext --tokenizer=gpt2 --val_fraction=0.0005
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
    p.add_argument("--tokenizer", default="char", help=f"one of {', '.join(TOKENIZERS)} (default char)")
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
    p.add_argument("--text_field", default="text", help="Hugging Face dataset text column (default text)")
    p.add_argument("--force", action="store_true", help="prepare again even if a current cache exists")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the metadata as JSON instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    """Prepare the dataset the flags describe and print its statistics; returns the exit code."""
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        ds = prepare_dataset(
            corpus=args.corpus,
            path=args.path,
            tokenizer=args.tokenizer,
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
    except (ValueError, OSError) as e:
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


if __name__ == "__main__":
    sys.exit(main())
