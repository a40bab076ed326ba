"""The data path's speed: preparing llm.c shards (jaxgpt-prepare --shards) against llm.c's recipe, the loader's
tokens/s per host, and the time to the first step over 1,000 shards against 4.

    python bench/data.py --text ../shared/data/tinyshakespeare.txt [--docs 4000] [--reps 3] [--smoke]

1. Preparation. The text, cut into documents of about 2,000 characters and repeated to --docs documents, is
   written as JSON Lines. A byte-level BPE of --vocab tokens is trained on it once (GPT-2's own BPE files
   cannot be downloaded here; GPT-2's is the same algorithm, through the same tiktoken). Then, in turns,
   --reps times: jaxgpt's `prepare_shards` with 1 worker and with every core, and llm.c's recipe written
   here from its description (documents read into a list, a multiprocessing Pool mapping tiktoken's
   `encode_ordinary` over them with the end-of-text token prepended, uint16 arrays cut into shards with a
   256-int32 header) with 1 process and with every core. Both write the same shards: the bench checks
   that their bytes agree. Medians of tokens/s (the tokenizer's training and the corpus's fingerprint not
   counted).
2. Loader: a split of --loader_tokens random ids over 8 shards, read by the BatchSampler (batch 64 x 1024,
   one host's rows of a GPT-2 124M step on 8 GPUs at batch 512) with and without the Prefetcher's thread.
3. Start-up: `jaxgpt-train` (a one-layer model, one step) over the same tokens in 1,000 shard files and in
   4, each run twice in turns (the first fills the compile cache); the second runs' wall times.

Writes bench/results/data.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))


def write_documents(text: str, n_docs: int, folder: Path, doc_chars: int = 2000) -> int:
    """`text` cut at line breaks into documents of about doc_chars, repeated to n_docs, as JSON Lines."""
    docs, i = [], 0
    while i < len(text):
        j = text.find("\n", i + doc_chars)
        j = len(text) if j == -1 else j + 1
        docs.append(text[i:j])
        i = j
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "docs.jsonl", "w") as f:
        for k in range(n_docs):
            f.write(json.dumps({"text": docs[k % len(docs)]}) + "\n")
    return n_docs


# --- llm.c's recipe, written from its description ----------------------------------------------------

_ENC = None
_EOT = None


def _init(tokenizer_json: str) -> None:
    global _ENC, _EOT
    from jaxgpt.data.tokenizer import BPETokenizer

    tok = BPETokenizer(tokenizer_json)
    _ENC, _EOT = tok._enc, tok.eos_id


def _tokenize(doc: dict) -> np.ndarray:
    ids = [_EOT]
    ids.extend(_ENC.encode_ordinary(doc["text"]))
    return np.array(ids, dtype=np.uint16)


def _write(path: Path, tokens: np.ndarray) -> None:
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())


def llmc_recipe(jsonl: Path, out: Path, tokenizer_json: str, procs: int, shard_tokens: int,
                val_tokens: int) -> int:
    """Tokenize every document in a Pool of `procs`, shards of exact sizes (shard 0 the val split)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(jsonl) as f:
        docs = [json.loads(line) for line in f]
    index, fill, total = 0, 0, 0
    buf = np.empty(val_tokens, dtype=np.uint16)
    with Pool(procs, initializer=_init, initargs=(tokenizer_json,)) as pool:
        for ids in pool.imap(_tokenize, docs, chunksize=16):
            total += len(ids)
            while len(ids):
                take = min(len(ids), len(buf) - fill)
                buf[fill : fill + take] = ids[:take]
                fill, ids = fill + take, ids[take:]
                if fill == len(buf):
                    _write(out / f"docs_{'val' if index == 0 else 'train'}_{index:06d}.bin", buf)
                    index, fill, buf = index + 1, 0, np.empty(shard_tokens, dtype=np.uint16)
    if fill:
        _write(out / f"docs_{'val' if index == 0 else 'train'}_{index:06d}.bin", buf[:fill])
    return total


# --- the parts -----------------------------------------------------------------------------------------


def bench_prepare(args, work: Path) -> dict:
    from jaxgpt.data.shard_writer import prepare_shards

    text = Path(args.text).read_text(encoding="utf-8")
    docs = work / "docs"
    write_documents(text, args.docs, docs)
    kw = dict(corpus="jsonl", path=docs, tokenizer="bpe", vocab_size=args.vocab, shard_tokens=args.shard_tokens,
              val_tokens=args.shard_tokens // 2, progress=False, name="docs", cache_dir=work / "cache")
    first = prepare_shards(work / "ours-1", workers=1, **kw)  # trains the BPE once; its tokenizer is reused below
    tokenizer_json = first["tokenizer"]["tokenizer_json"]
    cores = os.cpu_count() or 1
    rates: dict[str, list[float]] = {"jaxgpt_1": [], f"jaxgpt_{cores}": [], "llmc_1": [], f"llmc_{cores}": []}
    same = True
    for _ in range(args.reps):
        for workers in (1, cores):
            d = prepare_shards(work / f"ours-{workers}", workers=workers, force=True, **kw)
            rates[f"jaxgpt_{workers}"].append(d["tokens_per_second"])
            t0 = time.perf_counter()
            n = llmc_recipe(docs / "docs.jsonl", work / f"llmc-{workers}", tokenizer_json, workers, args.shard_tokens,
                            args.shard_tokens // 2)
            rates[f"llmc_{workers}"].append(n / (time.perf_counter() - t0))
            same &= _same_bins(work / f"ours-{workers}", work / f"llmc-{workers}")
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"documents": args.docs, "tokens": n, "vocab": args.vocab, "cores": cores, "reps": args.reps,
            "tokens_per_s": med, "all": rates, "same_shards_as_llmc_recipe": bool(same),
            "jaxgpt_over_llmc": {w: med[f"jaxgpt_{w}"] / med[f"llmc_{w}"] for w in (1, cores)}}


def _same_bins(a: Path, b: Path) -> bool:
    names = sorted(f.name for f in a.glob("*.bin"))
    return names == sorted(f.name for f in b.glob("*.bin")) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def _random_shards(folder: Path, n_files: int, tokens: int, vocab: int = 256) -> Path:
    from jaxgpt.data.shards import write_shard

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per = max(1, tokens // n_files)
    write_shard(folder / "r_val_000000.bin", rng.integers(0, vocab, size=max(per, 4096)))
    for i in range(1, n_files + 1):
        write_shard(folder / f"r_train_{i:06d}.bin", rng.integers(0, vocab, size=per))
    return folder


def bench_loader(args, work: Path) -> dict:
    from jaxgpt.data import BatchSampler, Prefetcher
    from jaxgpt.data.shards import open_shards

    folder = _random_shards(work / "loader", 8, args.loader_tokens, vocab=50257)
    ds = open_shards(str(folder), tokenizer="auto", scan=False)
    batch, block = (8, 128) if args.smoke else (64, 1024)
    out = {"batch": batch, "block": block, "shards": 8}
    for name, prefetch in (("sampler", False), ("prefetcher", True)):
        sampler = BatchSampler(ds.train, batch, block, seed=0)
        n = 4 if args.smoke else 200
        src = Prefetcher(sampler, size=4) if prefetch else sampler
        next(src)
        t0 = time.perf_counter()
        for _ in range(n):
            next(src)
        out[f"{name}_tokens_per_s"] = n * batch * block / (time.perf_counter() - t0)
        if prefetch:
            src.close()
    out["target_tokens_per_s"] = 10 * 0.6e6  # 10x one host's share of an 8 x H100 GPT-2 run
    return out


def _train_once(path: Path, out: Path) -> float:
    cmd = [sys.executable, str(REPO / "train.py"), "--config=configs/shakespeare_char_cpu.py",
           "--config.data.corpus=shards", f"--config.data.path={path}", "--config.data.tokenizer=byte",
           "--config.model.n_layer=1", "--config.model.n_head=2", "--config.model.n_embd=32",
           "--config.model.block_size=64", "--config.train.batch_size=8", "--config.train.max_steps=1",
           "--config.train.eval_steps=1", "--config.train.warmup_steps=0", "--config.train.progress=False",
           f"--config.out_dir={out}", "--config.overwrite=True"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return time.perf_counter() - t0


def bench_startup(args, work: Path) -> dict:
    tokens = 40_000 if args.smoke else 4_000_000
    folders = {n: _random_shards(work / f"start-{n}", n, tokens) for n in (4, 1000)}
    times: dict[int, list[float]] = {4: [], 1000: []}
    for _ in range(2):
        for n, folder in folders.items():
            times[n].append(_train_once(folder, work / f"run-{n}"))
    return {"tokens": tokens, "seconds_4_shards": times[4][-1], "seconds_1000_shards": times[1000][-1],
            "extra_seconds_1000": times[1000][-1] - times[4][-1], "all": times}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", required=True, help="a UTF-8 text file (e.g. Tiny Shakespeare)")
    p.add_argument("--docs", type=int, default=4000, help="documents to prepare")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary trained on the text")
    p.add_argument("--shard_tokens", type=int, default=1_000_000)
    p.add_argument("--loader_tokens", type=int, default=80_000_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no_startup", action="store_true", help="skip the time-to-first-step part")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs")
    p.add_argument("--out", default=None, help="results file (default bench/results/data.json)")
    args = p.parse_args(argv)
    if args.smoke:
        args.docs, args.vocab, args.shard_tokens, args.loader_tokens, args.reps = 60, 300, 3000, 200_000, 1
    with tempfile.TemporaryDirectory(prefix="jaxgpt-bench-data-") as tmp:
        work = Path(tmp)
        results = {"machine": _machine(), "smoke": args.smoke, "prepare": bench_prepare(args, work),
                   "loader": bench_loader(args, work)}
        if not args.no_startup:
            results["startup"] = bench_startup(args, work)
    out = Path(args.out) if args.out else HERE / "results" / "data.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=1))
    return results


def _machine() -> dict:
    import platform

    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1] for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "cpu_flags": [w for w in wanted if w in flags.split()]}


if __name__ == "__main__":
    main()
