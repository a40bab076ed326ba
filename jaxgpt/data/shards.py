"""llm.c's token shards as a dataset: a folder or glob of `.bin` files, each split read as one token array.

The format (llm.c's, also modded-nanogpt's): a header of 256 little-endian int32 (1024 bytes) -- header[0]
the magic, header[1] the version, header[2] the token count -- then the tokens. Version 1 (magic 20240520)
holds uint16 tokens (GPT-2's, the end-of-text token 50256 before every document); version 7 (magic
20240801) uint32 tokens (Llama-3's, the begin-of-text token 128000 before every document). A file's size is
exactly 1024 + itemsize * count. Files whose names contain `_val_` are the validation split, the others the
training split (`<name>_val_000000.bin`, `<name>_train_000001.bin`, ...). `jaxgpt-prepare --shards` writes
this format, and beside the shards a small `shards.json` (the tokenizer and a few statistics) that llm.c's
readers ignore.

Opening checks every file's header (magic, version, token width, count against size) before anything
compiles, and the token ids against the vocabulary: all of them at open when the data is at most 1 GiB,
and in every window read in any case. A bad shard raises ShardError (a ValueError) naming the file.
Files are opened lazily and read with pread: a split over a thousand shards holds at most 64 open, and
reading a window touches only that window's pages.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.data.tokenizer import ByteTokenizer, LazyTokenizer, Tokenizer, VocabTokenizer

HEADER_INTS = 256
HEADER_BYTES = 4 * HEADER_INTS
MAGIC = {1: 20240520, 7: 20240801}  # version -> magic
DTYPES = {1: np.dtype("<u2"), 7: np.dtype("<u4")}  # version -> token dtype
SIDECAR = "shards.json"  # the tokenizer file beside the shards (jaxgpt-prepare --shards writes it)
SIDECAR_FORMAT = "jaxgpt-shards"
# the vocabulary a version implies when no tokenizer file says otherwise: (tokenizer dict, vocab, eos, separator)
DEFAULT_VOCAB = {
    1: ({"type": "gpt2", "bpe_dir": None}, 50257, 50256, 50256),                           # GPT-2
    7: ({"type": "vocab", "vocab_size": 128256, "eos_id": 128001, "label": "Llama-3"}, 128256, 128001, 128000),
}
MAX_OPEN = 64  # files a split keeps open at once (least recently read closed first)
SCAN_BYTES = 1 << 30  # token bytes up to which every id is checked when the dataset opens
_SCAN_CHUNK = 1 << 23  # tokens read at a time by that scan


class ShardError(ValueError):
    """A shard file that is not what llm.c's format says, or does not fit the vocabulary."""


@dataclass(frozen=True)
class Shard:
    """One checked shard file: where it is, its header version, its token count and its size."""

    path: str
    version: int
    count: int
    size: int

    @property
    def dtype(self) -> np.dtype:
        return DTYPES[self.version]


def write_shard(path: str | os.PathLike, tokens: np.ndarray, version: int = 1) -> None:
    """Write `tokens` as one shard (header, then the ids in the version's width) to `path` as it is."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = MAGIC[version], version, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens).astype(DTYPES[version]).tobytes())


def read_header(path: str | os.PathLike) -> Shard:
    """The checked header of shard `path`; ShardError naming the file and what is wrong otherwise."""
    p = str(path)
    try:
        size = os.stat(p).st_size
        with open(p, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as e:
        raise ShardError(f"shard {p} cannot be read: {e.strerror or e}") from None
    if len(head) < HEADER_BYTES:
        raise ShardError(f"shard {p} is truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, count = (int(x) for x in np.frombuffer(head, dtype="<i4")[:3])
    versions = {m: v for v, m in MAGIC.items()}
    if magic not in versions:
        raise ShardError(f"shard {p} is not an llm.c token shard: its magic number is {magic}, not 20240520 "
                         "(version 1, uint16 tokens) or 20240801 (version 7, uint32 tokens)")
    if version != versions[magic]:
        raise ShardError(f"shard {p} has magic {magic} but version {version}; llm.c's format pairs that magic "
                         f"with version {versions[magic]}")
    if count < 0:
        raise ShardError(f"shard {p} has a negative token count ({count}) in its header")
    data, width = size - HEADER_BYTES, DTYPES[version].itemsize
    if data == count * width:
        return Shard(p, version, count, size)
    other = 2 if width == 4 else 4
    if data == count * other:
        raise ShardError(f"shard {p}: its header says version {version} ({width}-byte tokens) but its size fits "
                         f"{count} {other}-byte tokens: the header does not match the data")
    raise ShardError(f"shard {p}: its header says {count} tokens, {HEADER_BYTES} + {count * width} bytes, but the "
                     f"file has {size} bytes ({'truncated' if data < count * width else 'bytes past the tokens'})")


def shard_files(spec: str | os.PathLike, key: str = "data.path") -> list[Path]:
    """The shard files `spec` names (a folder's .bin files, a glob's, or one file), sorted by path."""
    p = Path(spec).expanduser()
    if p.is_dir():
        files = [f for f in p.iterdir() if f.suffix == ".bin" and not f.name.startswith(".") and f.is_file()]
    elif p.is_file():
        files = [p]
    else:
        files = [Path(f) for f in glob.glob(str(p)) if f.endswith(".bin") and os.path.isfile(f)]  # not shards.json
    if not files:
        raise ShardError(f"{key}={str(spec)!r} names no shard files: give a folder of .bin shards or a glob such "
                         "as 'fineweb10B/fineweb_*.bin'")
    return sorted(files, key=str)


class ShardArray:
    """A split's shards as one read-only 1-D token array, their concatenation in order.

    Indexing (an int or a slice) reads the tokens it covers with pread from at most MAX_OPEN open files
    (an LRU), checking each id against `vocab_size` (ShardError naming the file past it); a window may
    span the boundary between two shards. Thread-safe (a prefetch thread and the loop may share one).
    """

    ndim = 1

    def __init__(self, shards: list[Shard], vocab_size: int | None = None, max_open: int = MAX_OPEN):
        if not shards:
            raise ValueError("a ShardArray needs at least one shard")
        self.shards = list(shards)
        self.dtype = shards[0].dtype
        counts = np.array([s.count for s in shards], dtype=np.int64)
        self.ends = np.cumsum(counts)
        self.starts = self.ends - counts  # the index of each shard's first token in the array
        self.shape = (int(self.ends[-1]),)
        self.size = self.shape[0]
        self.vocab_size = vocab_size
        self.max_open = max(1, int(max_open))
        self._open: OrderedDict[int, int] = OrderedDict()  # shard index -> file descriptor
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> np.ndarray | np.integer:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.shape[0])
            out = self.read(start, max(start, stop))
            return out if step == 1 else out[::step]
        i = int(key)
        if i < 0:
            i += self.shape[0]
        if not 0 <= i < self.shape[0]:
            raise IndexError(f"token index {key} is out of range for {self.shape[0]} tokens")
        return self.read(i, i + 1)[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.read(0, self.shape[0])
        return out if dtype is None else out.astype(dtype)

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) of the split, in the shards' dtype."""
        out = np.empty(hi - lo, dtype=self.dtype)
        k = int(np.searchsorted(self.ends, lo, side="right"))
        pos, width = lo, self.dtype.itemsize
        with self._lock:
            while pos < hi:
                shard, first = self.shards[k], int(self.starts[k])
                a, b = pos - first, min(hi, int(self.ends[k])) - first
                buf = os.pread(self._fd(k), (b - a) * width, HEADER_BYTES + a * width)
                if len(buf) != (b - a) * width:
                    raise ShardError(f"shard {shard.path} is shorter than when it was opened: it changed on disk")
                chunk = np.frombuffer(buf, dtype=self.dtype)
                self._check_ids(chunk, shard, a)
                out[pos - lo : pos - lo + len(chunk)] = chunk
                pos += b - a
                k += 1
        return out

    def _check_ids(self, chunk: np.ndarray, shard: Shard, offset: int) -> None:
        if self.vocab_size is not None and chunk.size and int(chunk.max()) >= self.vocab_size:
            raise vocab_error(shard, chunk, offset, self.vocab_size)

    def _fd(self, k: int) -> int:
        fd = self._open.get(k)
        if fd is not None:
            self._open.move_to_end(k)
            return fd
        while len(self._open) >= self.max_open:
            os.close(self._open.popitem(last=False)[1])
        try:
            fd = os.open(self.shards[k].path, os.O_RDONLY)
        except OSError as e:
            raise ShardError(f"shard {self.shards[k].path} cannot be opened: {e.strerror or e}") from None
        self._open[k] = fd
        return fd

    def open_files(self) -> int:
        """How many of the shards' files are open now (at most max_open)."""
        return len(self._open)

    def close(self) -> None:
        with self._lock:
            while self._open:
                os.close(self._open.popitem()[1])

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def vocab_error(shard: Shard, chunk: np.ndarray, offset: int, vocab_size: int) -> ShardError:
    """The error for ids past the vocabulary in `chunk`, which starts at token `offset` of `shard`."""
    i = int(np.argmax(chunk >= vocab_size))
    return ShardError(f"shard {shard.path} holds token id {int(chunk[i])} at token {offset + i}, past the "
                      f"vocabulary's {vocab_size} ids: the shards were written with another tokenizer "
                      "(check data.tokenizer and the shards.json beside them)")


def scan_ids(shard: Shard, vocab_size: int) -> None:
    """Check every id of `shard` against the vocabulary, a few MB at a time (ShardError naming it)."""
    with open(shard.path, "rb") as f:
        f.seek(HEADER_BYTES)
        offset = 0
        while offset < shard.count:
            chunk = np.fromfile(f, dtype=shard.dtype, count=min(_SCAN_CHUNK, shard.count - offset))
            if chunk.size and int(chunk.max()) >= vocab_size:
                raise vocab_error(shard, chunk, offset, vocab_size)
            offset += chunk.size
            if not chunk.size:
                break


@dataclass
class ShardDataset:
    """llm.c shards opened as a dataset: `train` and `val` ShardArrays, the tokenizer (built only when text
    is encoded or decoded), `separator_id` (the token before every document: GPT-2's end-of-text 50256,
    Llama-3's begin-of-text 128000, or the tokenizer file's) and `meta` (files, headers, fingerprint)."""

    path: str
    train: ShardArray
    val: ShardArray
    tokenizer: Tokenizer
    separator_id: int | None
    meta: dict = field(default_factory=dict)
    reused: bool = True

    def tokens(self, split: str) -> ShardArray:
        """The split ('train' or 'val') as one 1-D token array."""
        if split not in ("train", "val"):
            raise ValueError(f"unknown split {split!r}; choose 'train' or 'val'")
        return self.train if split == "train" else self.val

    def bytes_per_token(self, split: str = "val") -> float | None:
        """UTF-8 bytes of text per token of `split` when the tokenizer file records it, else None."""
        return (self.meta.get("bytes_per_token") or {}).get(split)

    def summary(self) -> str:
        m = self.meta
        lines = [f"shards      {self.path}  version {m['version']} ({m['dtype']})  tokenizer "
                 f"{m['tokenizer']['type']}  vocab_size {self.tokenizer.vocab_size}  separator {self.separator_id}"]
        for s in ("train", "val"):
            lines.append(f"{s:<11} {m[s]['tokens']:>14,} tokens in {m[s]['files']} file(s)")
        return "\n".join(lines)

    def close(self) -> None:
        self.train.close()
        self.val.close()


def _split_files(path: str, val_path: str | None) -> tuple[list[Path], list[Path]]:
    """(train files, val files): `_val_` in a name means val, unless data.val_path names the val files."""
    files = shard_files(path, "data.path")
    val = shard_files(val_path, "data.val_path") if val_path else [f for f in files if "_val_" in f.name]
    chosen = {str(f.resolve()) for f in val}
    train = [f for f in files if "_val_" not in f.name and str(f.resolve()) not in chosen]
    if not train:
        raise ShardError(f"data.path={path!r} has no training shards: every file there is a validation shard "
                         "(named *_val_*) or one of data.val_path's")
    if not val:
        raise ShardError(f"data.path={path!r} has no validation shard: none of its {len(files)} files has '_val_' "
                         "in its name (llm.c's naming: <name>_val_000000.bin); name one so or set data.val_path")
    return train, val


def read_sidecar(folder: Path) -> dict | None:
    """The shards.json in `folder` (checked), or None when there is none."""
    f = folder / SIDECAR
    if not f.is_file():
        return None
    try:
        d = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ShardError(f"{f} is not a readable tokenizer file: {e}") from None
    if not isinstance(d, dict) or d.get("format") != SIDECAR_FORMAT or not isinstance(d.get("tokenizer"), dict):
        raise ShardError(f"{f} is not a jaxgpt shards file (format {SIDECAR_FORMAT!r} with a tokenizer)")
    vocab = d.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ShardError(f"{f} has no vocabulary size (vocab_size: {vocab!r}); prepare the shards again")
    if d.get("complete") is False:  # jaxgpt-prepare writes it first, and complete once every shard is in
        raise ShardError(f"{folder} holds an unfinished preparation ({f} says it is not complete; a killed or "
                         "running jaxgpt-prepare --shards): run the same command again to finish it")
    d["file"] = str(f)
    return d


def _tokenizer_for(choice: str, version: int, sidecar: dict | None) -> tuple[Tokenizer, int | None]:
    """(tokenizer, separator id) of shards of header `version` under data.tokenizer=`choice`."""
    if sidecar is not None:
        kind = sidecar["tokenizer"].get("type")
        if choice not in ("auto", kind):
            raise ShardError(f"data.tokenizer={choice!r} but the shards were written with a {kind} tokenizer "
                             f"({sidecar['file']}); use data.tokenizer='auto' (or {kind!r})")
        tok = LazyTokenizer(sidecar["tokenizer"], sidecar["vocab_size"], sidecar.get("eos_id"))
        return tok, sidecar.get("separator_id", sidecar.get("eos_id"))
    if choice == "auto" or (choice == "gpt2" and version == 1):
        d, vocab, eos, sep = DEFAULT_VOCAB[version]
        tok = VocabTokenizer(vocab, eos, d["label"]) if d["type"] == "vocab" else LazyTokenizer(d, vocab, eos)
        return tok, sep
    if choice == "byte":
        return ByteTokenizer(), None
    if choice == "gpt2":
        raise ShardError(f"data.tokenizer='gpt2' but the shards are version {version} (uint32 tokens, Llama-3's "
                         "layout); use data.tokenizer='auto'")
    raise ShardError(f"data.tokenizer={choice!r} needs its vocabulary from a tokenizer file ({SIDECAR}) beside the "
                     "shards, and there is none; use 'auto' (GPT-2's for version-1 shards, Llama-3's for version 7)")


def _headers(files: list[Path]) -> list[Shard]:
    shards = [read_header(f) for f in files]
    return shards


def open_shards(path: str, val_path: str | None = None, tokenizer: str = "auto", scan: bool | None = None,
                max_open: int = MAX_OPEN) -> ShardDataset:
    """Open llm.c shards (data.path a folder or glob; data.val_path optional) with every header checked.

    tokenizer: 'auto' (the shards.json beside the first training shard, else GPT-2's vocabulary for
    version-1 shards and Llama-3's for version 7) or a name checked against that file. scan: check every
    id against the vocabulary now (None: when the shards hold at most SCAN_BYTES of tokens); ids are
    checked in every read either way.
    """
    train_files, val_files = _split_files(str(path), val_path)
    train, val = _headers(train_files), _headers(val_files)
    versions = sorted({s.version for s in train + val})
    if len(versions) > 1:
        one = {v: next(s.path for s in train + val if s.version == v) for v in versions}
        raise ShardError("the shards mix header versions: " + ", ".join(f"{p} is version {v}" for v, p in one.items()))
    version = versions[0]
    sidecar = read_sidecar(train_files[0].parent)
    tok, separator = _tokenizer_for(tokenizer, version, sidecar)
    if tok.vocab_size > np.iinfo(DTYPES[version]).max + 1:
        raise ShardError(f"the tokenizer has {tok.vocab_size} ids but version-{version} shards hold "
                         f"{DTYPES[version].name} ids (at most {np.iinfo(DTYPES[version]).max + 1})")
    total = sum(s.size - HEADER_BYTES for s in train + val)
    if scan or (scan is None and total <= SCAN_BYTES):
        for s in train + val:
            scan_ids(s, tok.vocab_size)
    meta = _meta(str(path), val_path, version, tok, separator, sidecar, {"train": train, "val": val})
    return ShardDataset(path=str(path), train=ShardArray(train, tok.vocab_size, max_open),
                        val=ShardArray(val, tok.vocab_size, max_open), tokenizer=tok, separator_id=separator,
                        meta=meta)


def _meta(path, val_path, version, tok, separator, sidecar, splits: dict[str, list[Shard]]) -> dict:
    """What a checkpoint records of the shards: where, their headers, and a fingerprint of all of them."""
    files = {s: [[os.path.basename(x.path), x.count] for x in shards] for s, shards in splits.items()}
    fp = hashlib.sha256(json.dumps({"version": version, "files": files}, sort_keys=True).encode()).hexdigest()
    meta = {"corpus": "shards", "path": path, "val_path": val_path, "version": version,
            "dtype": DTYPES[version].name, "tokenizer": tok.to_dict(), "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id, "separator_id": separator, "tokenizer_file": sidecar and sidecar["file"],
            "fingerprint": fp, "files": files}
    for s, shards in splits.items():
        meta[s] = {"files": len(shards), "tokens": sum(x.count for x in shards)}
    if sidecar and isinstance(sidecar.get("bytes_per_token"), dict):
        meta["bytes_per_token"] = sidecar["bytes_per_token"]
    return meta


def shards_difference(old: dict, new: dict) -> str | None:
    """What changed between two ShardDataset.meta's files, in a few words; None when nothing did."""
    if old.get("fingerprint") == new.get("fingerprint"):
        return None
    if old.get("version") != new.get("version"):
        return f"version-{old.get('version')} shards before, version-{new.get('version')} now"
    for split in ("train", "val"):
        a = dict(map(tuple, (old.get("files") or {}).get(split, [])))
        b = dict(map(tuple, (new.get("files") or {}).get(split, [])))
        for name in sorted(set(a) | set(b)):
            if a.get(name) != b.get(name):
                if name not in b:
                    return f"{split} shard {name} is gone"
                if name not in a:
                    return f"{split} shard {name} is new"
                return f"{split} shard {name} has {b[name]} tokens now, {a[name]} before"
    return "the shards' files differ"
