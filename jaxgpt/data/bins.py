"""Token bins: a corpus tokenized once into train/val files of uint16/uint32 ids, cached, memory-mapped.

Layout of a prepared dataset (a folder under <cache>/datasets/):
  train.bin, val.bin   raw token ids, native-endian uint16 if the vocabulary fits, else uint32
  tokenizer.json       Tokenizer.to_dict()
  meta.json            tokenizer spec, counts, source and its hash, each bin's size and SHA-256, timings
                       (written last)
The folder is built under a temporary name and renamed into place, so a cache folder is always whole.
Opening checks each bin against its size and SHA-256 (about 5 ms per 10 MB), so a bin changed since it
was prepared is never trained on: a cached one is prepared again, a folder given by the user refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from tqdm.auto import tqdm

from jaxgpt.data.corpora import Corpus, Piece, default_cache_dir, get_corpus, iter_texts
from jaxgpt.data.tokenizer import (
    TOKENIZERS,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    load_tokenizer,
    save_tokenizer,
)
from jaxgpt.report import warn

FORMAT = 2  # bump when the bin layout or the metadata changes incompatibly (2: bin checksums)
SPLITS = ("train", "val")
_BATCH_CHARS = 1 << 22  # text encoded per encode_batch call
_HASH_BLOCK = 1 << 24  # bytes of a bin hashed at a time


@dataclass
class Dataset:
    """A prepared dataset: memory-mapped train/val token ids, its tokenizer and metadata."""

    path: Path
    train: np.ndarray  # np.memmap [n_train] uint16/uint32
    val: np.ndarray  # np.memmap [n_val]
    tokenizer: Tokenizer
    meta: dict
    reused: bool = False  # True when an existing cache was opened instead of preparing

    def bytes_per_token(self, split: str = "val") -> float:
        """UTF-8 bytes of original text per token in `split` (bits per byte = loss / ln 2 / this)."""
        _check_split(split)
        return float(self.meta[split]["bytes_per_token"])

    def tokens(self, split: str) -> np.ndarray:
        """The memory-mapped ids of 'train' or 'val'."""
        _check_split(split)
        return self.train if split == "train" else self.val

    def summary(self) -> str:
        """A few lines of statistics for people."""
        m = self.meta
        lines = [
            f"dataset     {self.path}" + (" (cached)" if self.reused else ""),
            f"source      {m['source']}  sha256 {m['source_hash'][:16]}",
            f"tokenizer   {m['tokenizer']['type']}  vocab_size {m['vocab_size']}  eos_id "
            f"{m['tokenizer']['eos_id']}  dtype {m['dtype']}",
        ]
        for s in SPLITS:
            d = m[s]
            lines.append(
                f"{s:<11} {d['tokens']:>12,} tokens  {d['chars']:>12,} chars  {d['bytes']:>12,} bytes  "
                f"{d['bytes_per_token']:.3f} bytes/token  {self.path / d['file']}"
            )
        lines.append(f"prepared in {m['prepare_seconds']:.2f} s  ({m['tokens_per_second']:,.0f} tokens/s)")
        return "\n".join(lines)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose 'train' or 'val'")


def prepare_dataset(
    corpus: str = "shakespeare",
    path: str | os.PathLike | None = None,
    tokenizer: str = "char",
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    *,
    bpe_dir: str | os.PathLike | None = None,
    hf_config: str | None = None,
    hf_split: str = "train",
    text_field: str = "text",
    force: bool = False,
    hf_kwargs: dict | None = None,
) -> Dataset:
    """Tokenize a corpus into cached train/val bins (or reuse the cache when source and settings match).

    corpus: 'shakespeare' | 'tinyshakespeare' | 'file' (path= file or folder) | 'hf' (path= dataset
    name, with hf_config, hf_split, text_field and hf_kwargs for datasets.load_dataset).
    tokenizer: 'char' | 'byte' | 'bpe' (vocab_size=) | 'gpt2' (bpe_dir= for offline BPE files).
    Documents of a multi-document corpus (a folder, a Hugging Face dataset) end with the eos token
    when the tokenizer has one. The cache is keyed by these settings and checked against a hash of
    the source; force=True prepares again regardless.
    """
    vocab_size, val_fraction = _check_arguments(tokenizer, vocab_size, val_fraction, bpe_dir)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    src = get_corpus(
        corpus,
        path,
        cache,
        hf_config=hf_config,
        hf_split=hf_split,
        text_field=text_field,
        hf_kwargs=hf_kwargs,
    )
    settings = {
        "format": FORMAT,
        "corpus": src.spec,
        "tokenizer": {"type": tokenizer, "vocab_size": vocab_size},
        "val_fraction": val_fraction,
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    label = f"{corpus}-{tokenizer}" + (f"{vocab_size}" if vocab_size else "")
    target = cache / "datasets" / f"{label}-{key}"
    source_hash = src.fingerprint()

    if not force:
        ds = _open_if_current(target, source_hash)
        if ds is not None:
            return _warn_if_short(ds, tokenizer, vocab_size)

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(target)
    tmp = target.parent / f".tmp-{target.name}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        meta = _build(src, tmp, tokenizer, vocab_size, val_fraction, bpe_dir, progress)
        meta.update(settings=settings, source_hash=source_hash)
        _write_json(tmp / "meta.json", meta)  # last: a folder with meta.json is complete
        _move_into_place(tmp, target, source_hash, replace=force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ds = load_prepared(target)
    return _warn_if_short(ds, tokenizer, vocab_size)


def _warn_if_short(ds: Dataset, tokenizer: str, vocab_size: int | None) -> Dataset:
    """`ds`, after one warning line when BPE training stopped short of the vocab_size asked for (a corpus
    allows only so many merges): the model's vocabulary is the tokenizer's, not the setting's."""
    if tokenizer == "bpe" and ds.tokenizer.vocab_size < vocab_size:
        warn(f"vocab_size={vocab_size} asked for more BPE tokens than this corpus yields: the tokenizer has "
             f"{ds.tokenizer.vocab_size} (every merge the text allows), and so has the model")
    return ds


def _check_arguments(tokenizer: str, vocab_size, val_fraction, bpe_dir) -> tuple[int | None, float]:
    """prepare_dataset's tokenizer settings checked: (vocab_size, val_fraction) as numbers."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
    if not isinstance(val_fraction, (int, float)) or not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction!r}")
    val_fraction = float(val_fraction)
    if tokenizer == "bpe":
        if vocab_size is None or int(vocab_size) < 257:
            raise ValueError(f"the bpe tokenizer needs vocab_size >= 257 (e.g. 1024), got {vocab_size}")
        vocab_size = int(vocab_size)
    elif vocab_size is not None:
        raise ValueError(
            f"vocab_size applies to the bpe tokenizer only; the {tokenizer} tokenizer's vocabulary is "
            f"fixed by {'the corpus' if tokenizer == 'char' else 'the tokenizer'}: leave vocab_size unset"
        )
    if bpe_dir is not None and tokenizer != "gpt2":
        raise ValueError("bpe_dir applies to the gpt2 tokenizer only")

    return vocab_size, val_fraction


def load_prepared(path: str | os.PathLike, verify: bool = True) -> Dataset:
    """Open a prepared dataset folder (the `path` of a Dataset) without re-reading its source.

    With `verify`, each bin must still have the size and SHA-256 recorded when it was prepared
    (ValueError otherwise): a bin changed on disk would train on ids it was never given.
    """
    path = Path(path).expanduser()
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a prepared dataset (no meta.json); run jaxgpt-prepare first")
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{path} was prepared by another version (format {meta.get('format')}); prepare it again"
        )
    tok = load_tokenizer(path / "tokenizer.json")
    dtype = np.dtype(meta["dtype"])
    if verify:
        for s in SPLITS:
            _check_bin(path / meta[s]["file"], meta[s])
    arrays = [np.memmap(path / meta[s]["file"], dtype=dtype, mode="r") for s in SPLITS]
    for s, a in zip(SPLITS, arrays):
        if a.shape[0] != meta[s]["tokens"]:
            raise ValueError(
                f"{path / meta[s]['file']} has {a.shape[0]} tokens, meta.json says {meta[s]['tokens']}"
            )
    return Dataset(path=path, train=arrays[0], val=arrays[1], tokenizer=tok, meta=meta)


def sha256_bin(path: Path) -> str:
    """Hex SHA-256 of a bin, read in blocks (about 1.8 GB/s here: big bins cost seconds, not memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_HASH_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


class BinChanged(ValueError):
    """A token bin whose size or SHA-256 is not what meta.json recorded when it was prepared."""

    def __init__(self, what: str):
        self.what = what
        super().__init__(f"{what}; prepare the dataset again (jaxgpt-prepare --force)")


def _check_bin(file: Path, split_meta: dict) -> None:
    want_size, want_hash = split_meta["file_bytes"], split_meta["sha256"]
    size = file.stat().st_size if file.is_file() else None
    if size != want_size:
        got = "is missing" if size is None else f"has {size} bytes"
        raise BinChanged(f"token bin {file} {got}, but meta.json records {want_size}: it changed after it "
                         "was prepared")
    if sha256_bin(file) != want_hash:
        raise BinChanged(f"token bin {file} does not match the SHA-256 in meta.json: it changed after it was "
                         "prepared")


def _open_if_current(target: Path, source_hash: str, warn_damaged: bool = True) -> Dataset | None:
    meta_file = target / "meta.json"
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT or meta.get("source_hash") != source_hash:
            return None  # the source or the format changed: prepare again
        ds = load_prepared(target)
    except BinChanged as e:
        if warn_damaged:
            warn(f"{e.what}; preparing the cached dataset again")
        return None
    except (OSError, ValueError, KeyError):
        return None  # unreadable cache: prepare again
    ds.reused = True
    return ds


def _make_tokenizer(tokenizer: str, vocab_size: int | None, bpe_dir: Any, pieces) -> Tokenizer:
    """The tokenizer, learnt from the corpus where it needs to be (`pieces(desc)` streams it)."""
    if tokenizer == "char":
        return CharTokenizer.from_texts(iter_texts(pieces("char vocabulary")))
    if tokenizer == "byte":
        return ByteTokenizer()
    if tokenizer == "bpe":
        return BPETokenizer.train(iter_texts(pieces("bpe training"), "train"), vocab_size)
    return GPT2Tokenizer(bpe_dir=bpe_dir)


class _BinWriter:
    """Token ids appended to train.bin / val.bin, counted and hashed as they are written; each document
    of a multi-document corpus closed by the tokenizer's eos token (when it has one)."""

    def __init__(self, out: Path, tok: Tokenizer):
        self.tok = tok
        self.dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
        self.counts = {s: {"file": f"{s}.bin", "tokens": 0, "chars": 0, "bytes": 0} for s in SPLITS}
        self.files = {s: open(out / f"{s}.bin", "wb") for s in SPLITS}
        self.hashes = {s: hashlib.sha256() for s in SPLITS}
        self.id_range = [None, None]  # smallest and largest id written: equal means a single distinct token
        self.eos = None if tok.eos_id is None else np.array([tok.eos_id], dtype=self.dtype)
        self.in_document = False  # the current document has tokens not yet closed by eos

    def put(self, split: str, ids: np.ndarray) -> None:
        data = ids.astype(self.dtype).tobytes()
        self.files[split].write(data)
        self.hashes[split].update(data)
        lo, hi = int(ids.min()), int(ids.max())
        self.id_range[0] = lo if self.id_range[0] is None else min(self.id_range[0], lo)
        self.id_range[1] = hi if self.id_range[1] is None else max(self.id_range[1], hi)
        self.counts[split]["tokens"] += int(ids.size)

    def write(self, batch: list[Piece]) -> None:
        """Encode a batch of pieces (split, text, ends a document) and append their ids."""
        for (split, text, end), ids in zip(batch, self.tok.encode_batch([p[1] for p in batch])):
            c = self.counts[split]
            if ids.size:
                self.put(split, ids)
                self.in_document = True
            c["chars"] += len(text)
            c["bytes"] += len(text.encode("utf-8", "surrogatepass"))
            if end and self.in_document:
                self.in_document = False
                if self.eos is not None:
                    self.put(split, self.eos)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _check_counts(src: Corpus, w: _BinWriter, val_fraction: float) -> None:
    """ValueError for a corpus that gives nothing to train or validate on."""
    chars = w.counts["train"]["chars"] + w.counts["val"]["chars"]
    if chars == 0:
        raise ValueError(f"corpus {src.describe()} is empty: it has no text to train on")
    for split, fix in (("train", "lower val_fraction"), ("val", "raise val_fraction")):
        if w.counts[split]["tokens"] == 0:
            raise ValueError(
                f"the {split} split is empty: the corpus ({chars} characters) is too small to split with "
                f"val_fraction={val_fraction} at a line break; {fix} or use a larger corpus"
            )
    if w.id_range[0] == w.id_range[1]:
        only = w.tok.decode([w.id_range[0]])
        raise ValueError(
            f"corpus {src.describe()} has a single distinct token ({only!r}, id {w.id_range[0]}): there is "
            f"nothing to learn from it; check the corpus (all NUL bytes? a wrong file?)"
        )


def _build(src: Corpus, out: Path, tokenizer: str, vocab_size: int | None, val_fraction: float, bpe_dir: Any,
           progress: bool) -> dict:
    """Tokenize `src` into out/train.bin, out/val.bin and out/tokenizer.json; returns their meta."""
    t0 = time.perf_counter()
    bar_total, bar_unit = _bar_size(src)

    def pieces(desc: str) -> Iterator[Piece]:
        with tqdm(total=bar_total, unit=bar_unit, unit_scale=True, desc=desc,
                  disable=None if progress else True) as b:
            for p in src.pieces(val_fraction):
                yield p
                b.update(len(p[1]) if bar_unit == "char" else int(p[2]))

    tok = _make_tokenizer(tokenizer, vocab_size, bpe_dir, pieces)
    t_tok = time.perf_counter() - t0
    w = _BinWriter(out, tok)
    try:
        batch, size = [], 0
        for p in pieces("tokenizing"):
            batch.append(p)
            size += len(p[1])
            if size >= _BATCH_CHARS:
                w.write(batch)
                batch, size = [], 0
        w.write(batch)
    finally:
        w.close()
    _check_counts(src, w, val_fraction)
    for s, c in w.counts.items():
        c["bytes_per_token"] = c["bytes"] / max(c["tokens"], 1)
        c["file_bytes"] = c["tokens"] * w.dtype.itemsize
        c["sha256"] = w.hashes[s].hexdigest()
    save_tokenizer(tok, out / "tokenizer.json")
    seconds = time.perf_counter() - t0
    n_tokens = sum(c["tokens"] for c in w.counts.values())
    return {
        "format": FORMAT, "source": src.describe(), "tokenizer": tok.spec(), "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id, "dtype": w.dtype.name, "val_fraction": val_fraction,
        "train": w.counts["train"], "val": w.counts["val"], "tokenizer_seconds": t_tok,
        "prepare_seconds": seconds, "tokens_per_second": n_tokens / max(seconds, 1e-9),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _bar_size(src: Corpus) -> tuple[int | None, str]:
    n_docs = getattr(src, "n_documents", None)
    if callable(n_docs):
        return n_docs(), "doc"
    total = src.total_bytes()
    return total, "char"  # chars approximate bytes well enough for a progress bar


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False), encoding="utf-8")


def _move_into_place(tmp: Path, target: Path, source_hash: str, replace: bool) -> None:
    """Rename the finished folder to `target`, replacing an outdated one (any one if `replace`); keep a
    current one that another process made meanwhile."""
    for _ in range(3):
        try:
            os.rename(tmp, target)
            return
        except OSError:
            if not target.exists():
                raise
        if not replace and _open_if_current(target, source_hash, warn_damaged=False) is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # another process prepared the same data first
            return
        trash = target.parent / f".old-{target.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(target, trash)
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
    raise OSError(f"could not move the prepared dataset into {target}")


def _remove_stale_temporaries(target: Path) -> None:
    """Delete temporary folders left by interrupted prepares of `target` on this host."""
    host = socket.gethostname()
    for p in target.parent.glob(f".tmp-{target.name}-{host}-*"):
        try:
            pid = int(p.name[len(f".tmp-{target.name}-{host}-") :].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, PermissionError, OSError):
            pass
    for p in target.parent.glob(f".old-{target.name}-*"):
        shutil.rmtree(p, ignore_errors=True)
