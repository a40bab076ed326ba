"""jaxgpt-prepare --shards: a corpus tokenized by every core into llm.c's shard format, resumably.

Output, in DIR: `<name>_val_000000.bin` (the validation split: the corpus's first `val_tokens` tokens),
then `<name>_train_000001.bin`, ... of `shard_tokens` tokens each (the last one shorter), and `shards.json`
(the tokenizer, the separator, statistics; llm.c's readers ignore it). The token stream is the corpus's
documents in order, each preceded by the tokenizer's end-of-text token; shards cut it at exact token
counts, as llm.c does, so a document may continue in the next shard (and one document may straddle the
val/train boundary, as in llm.c).

Resumable: each shard is written to a hidden temporary name, fsynced and renamed, then `<name>_progress.json`
records the shards done and where the corpus stands (the pieces of text consumed, the tokens of the next
piece already written). A killed preparation run again with the same settings continues after its last
complete shard and writes the same bytes an uninterrupted one would. The progress file goes when done.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from tqdm.auto import tqdm

from jaxgpt.data.corpora import Corpus, get_corpus
from jaxgpt.data.shards import DTYPES, HEADER_INTS, MAGIC, SIDECAR, SIDECAR_FORMAT
from jaxgpt.data.tokenizer import Tokenizer, tokenizer_fingerprint, tokenizer_from_dict

DEFAULT_SHARD_TOKENS = 100_000_000  # llm.c's
_CHUNK_CHARS = 1 << 20  # text sent to a worker at a time
_CHUNK_UNITS = 512  # at most this many pieces of text in one such chunk
KILL_ENV = "JAXGPT_PREPARE_KILL_AFTER"  # tests: die (as if killed) after this many shards, mid-write of the next


# --- the work each process does -----------------------------------------------------------------------

_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tok_dict: dict) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer_from_dict(tok_dict)


def encode_chunk(chunk: list[tuple[str, bool]], sep: int, dtype: str,
                 tok: Tokenizer | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids of a chunk of (text, starts a document) pieces, the separator before each document's first
    piece: (ids concatenated in `dtype`, each piece's token count, each piece's UTF-8 bytes)."""
    tok = tok if tok is not None else _WORKER_TOKENIZER
    parts, lengths, nbytes = [], np.empty(len(chunk), dtype=np.int64), np.empty(len(chunk), dtype=np.int64)
    for i, (text, starts) in enumerate(chunk):
        ids = tok.encode_array(text) if text else np.empty(0, np.int64)
        if starts:
            ids = np.concatenate([np.array([sep], np.int64), ids])
        parts.append(ids)
        lengths[i] = ids.size
        nbytes[i] = len(text.encode("utf-8", "surrogatepass"))
    ids = np.concatenate(parts).astype(dtype) if parts else np.empty(0, dtype)
    return ids, lengths, nbytes


def _chunks(pieces: Iterator[tuple[str, bool]]) -> Iterator[list[tuple[str, bool]]]:
    chunk, size = [], 0
    for p in pieces:
        chunk.append(p)
        size += len(p[0])
        if size >= _CHUNK_CHARS or len(chunk) >= _CHUNK_UNITS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _start_method() -> str:
    """fork (the workers start at once) unless this process has started JAX's runtime, whose threads a forked
    child may find holding a lock (a deadlock): then forkserver (jaxgpt-prepare itself never starts it)."""
    methods = multiprocessing.get_all_start_methods()
    try:
        from jax._src import xla_bridge
        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # (a JAX without it: the safe choice)
        started = True
    if "fork" in methods and not started:
        return "fork"
    return "forkserver" if "forkserver" in methods else "spawn"


def _encoded(chunks: Iterator[list], tok: Tokenizer, sep: int, dtype: str, workers: int) -> Iterator[tuple]:
    """encode_chunk over `chunks`, in order: in this process (workers=1) or a pool of `workers` processes
    with at most 2 * workers chunks in flight (Pool.imap would read the whole corpus ahead)."""
    if workers <= 1:
        for c in chunks:
            yield c, encode_chunk(c, sep, dtype, tok)
        return
    ctx = multiprocessing.get_context(_start_method())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # (HF tokenizers in forked workers: no warning)
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tok.to_dict(),)) as pool:
        pending: deque = deque()
        for c in chunks:
            pending.append((c, pool.apply_async(encode_chunk, (c, sep, dtype))))
            if len(pending) >= 2 * workers:
                c0, r = pending.popleft()
                yield c0, r.get()
        while pending:
            c0, r = pending.popleft()
            yield c0, r.get()


# --- files --------------------------------------------------------------------------------------------


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, parts: list[bytes], kill: bool = False) -> None:
    """`parts` written to `path` through a hidden temporary name, fsynced, renamed into place."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        if kill:  # the test hook: half a file on disk, then gone as if killed
            f.write(parts[0][: len(parts[0]) // 2])
            f.flush()
            os._exit(137)
        for p in parts:
            f.write(p)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _write_json(path: Path, obj: dict) -> None:
    _write_atomic(path, [json.dumps(obj, indent=1, ensure_ascii=False).encode("utf-8")])


def shard_name(name: str, index: int) -> str:
    return f"{name}_{'val' if index == 0 else 'train'}_{index:06d}.bin"


class _ShardStream:
    """Token ids appended and cut into shards at exact counts; each written shard is recorded in the
    progress file with where the corpus stands at its end."""

    def __init__(self, out: Path, name: str, version: int, sizes: tuple[int, int], progress: dict):
        self.out, self.name, self.version, self.sizes, self.progress = out, name, version, sizes, progress
        self.dtype = DTYPES[version]
        self.index = len(progress["shards"])
        self.buf = np.empty(self._target(), dtype=self.dtype)
        self.fill, self.bytes = 0, 0
        self.kill_after = int(os.environ.get(KILL_ENV, "0") or 0)

    def _target(self) -> int:
        return self.sizes[0] if self.index == 0 else self.sizes[1]

    def put(self, ids: np.ndarray, unit: int, before: bool, after: bool, nbytes: int, pos: int = 0) -> None:
        """Append piece number `unit`'s ids from `pos` on (before/after: whether a document is open before and
        after this piece; nbytes: its text's bytes, counted in the shard where it starts)."""
        self.bytes += nbytes
        while pos < ids.size:
            take = min(ids.size - pos, self.buf.size - self.fill)
            self.buf[self.fill : self.fill + take] = ids[pos : pos + take]
            self.fill, pos = self.fill + take, pos + take
            if self.fill == self.buf.size:
                done = pos == ids.size  # the piece ends with the shard: the next shard starts at the next piece
                self.flush(unit + 1 if done else unit, 0 if done else pos, after if done else before)

    def flush(self, units: int, carry: int, in_doc: bool) -> None:
        """Write the buffer as the next shard; the corpus stands at piece `units`, `carry` tokens into it."""
        if self.fill == 0:
            return
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[:3] = MAGIC[self.version], self.version, self.fill
        data = self.buf[: self.fill].tobytes()
        path = self.out / shard_name(self.name, self.index)
        kill = bool(self.kill_after) and self.index == self.kill_after
        _write_atomic(path, [header.tobytes(), data], kill=kill)
        self.progress["shards"].append({"file": path.name, "tokens": int(self.fill), "bytes": self.bytes,
                                        "sha256": hashlib.sha256(header.tobytes() + data).hexdigest()})
        self.progress.update(units=units, carry=carry, in_doc=in_doc)
        _save_progress(self.out, self.name, self.progress)
        self.index += 1
        self.buf = np.empty(self._target(), dtype=self.dtype) if self.buf.size != self._target() else self.buf
        self.fill, self.bytes = 0, 0


# --- the preparation ------------------------------------------------------------------------------------


def _pieces(src: Corpus, start: int, in_doc: bool) -> Iterator[tuple[int, str, bool, bool, bool]]:
    """(index, text, starts a document, document open before, after) of every piece of text from `start` on;
    the end-of-text token goes before the first non-empty piece of each document."""
    for i, (_, text, end) in enumerate(src.pieces(0.0)):  # (val_fraction 0: one stream, split by position)
        before = in_doc
        if text:
            in_doc = True
        if end:
            in_doc = False
        if i >= start:
            yield i, text, bool(text) and not before, before, in_doc


MAX_SHARD_TOKENS = 2 ** 31 - 1  # the header's count is an int32


def _check_numbers(shard_tokens: Any, val_tokens: Any, workers: Any) -> None:
    for key, v in (("shard_tokens", shard_tokens), ("val_tokens", val_tokens), ("workers", workers)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"--{key} must be a positive integer, got {v!r}")
    for key, v in (("shard_tokens", shard_tokens), ("val_tokens", val_tokens)):
        if v > MAX_SHARD_TOKENS:
            raise ValueError(f"--{key} must be at most {MAX_SHARD_TOKENS:,} (a shard header's count is an int32), "
                             f"got {v:,}")


def _check_name(name: str) -> None:
    """A shard name: letters, digits, '-' and '_', without the split markers the reader goes by."""
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(f"--shard_name must be letters, digits, '-' and '_' only, got {name!r}")
    if "_val_" in f"_{name}_" or "_train_" in f"_{name}_":
        raise ValueError(f"--shard_name {name!r} contains 'val' or 'train' as a part, which the reader takes for "
                         "the split (files named *_val_* are the validation split); choose another name")


def _temporaries(out: Path, name: str) -> list[Path]:
    """Half-written shards of `name` (a killed run's): never read, removed when a preparation starts."""
    return [f for split in ("val", "train") for f in out.glob(f".{name}_{split}_*.tmp-*")]


def _other_preparation(out: Path, name: str) -> str | None:
    """The name of another preparation whose shards.json `out` holds (one preparation a folder), else None."""
    f = out / SIDECAR
    try:
        other = json.loads(f.read_text(encoding="utf-8")).get("name") if f.is_file() else None
    except ValueError:
        return None
    return other if other not in (None, name) else None


def _default_name(corpus: str, path: Any) -> str:
    if path is None or corpus in ("shakespeare", "tinyshakespeare"):
        return corpus
    stem = Path(str(path).rstrip("/")).name.split("*")[0].split(".")[0].strip("_-")
    return "".join(c if c.isalnum() or c in "-" else "-" for c in stem) or corpus


def _existing(out: Path, name: str) -> list[Path]:
    return sorted(out.glob(f"{name}_val_*.bin")) + sorted(out.glob(f"{name}_train_*.bin"))


def _remove_outputs(out: Path, name: str) -> None:
    for f in _existing(out, name) + _temporaries(out, name) + [out / f"{name}_progress.json"]:
        f.unlink(missing_ok=True)


def _resume_state(out: Path, name: str, settings: dict, force: bool) -> dict | None:
    """The progress of an unfinished preparation with these settings (its shards checked), else None when
    there is nothing to resume; ValueError when the folder holds another preparation's shards."""
    prog_file = out / f"{name}_progress.json"
    for tmp in _temporaries(out, name):  # half-written shards of a killed run: never read, removed
        tmp.unlink(missing_ok=True)
    if force:
        _remove_outputs(out, name)
        return None
    if prog_file.is_file():
        prog = _load_progress(out, name)
        if prog.get("settings") != settings:
            raise ValueError(f"{out} holds an unfinished preparation of {name!r} with other settings (corpus, "
                             "tokenizer or shard sizes); run it again as it was to resume, or pass --force to "
                             "start over")
        for rec in prog["shards"]:
            f = out / rec["file"]
            size = 4 * HEADER_INTS + rec["tokens"] * DTYPES[prog["version"]].itemsize
            if not f.is_file() or f.stat().st_size != size:
                raise ValueError(f"shard {f}, recorded as complete in {prog_file.name}, is missing or changed; pass "
                                 "--force to prepare again from the start")
        return prog
    if _existing(out, name):
        raise ValueError(f"{out} already holds {name!r} shards of a finished or another preparation; pass --force "
                         "to replace them, or choose another folder")
    return None


def _new_progress(tok: Tokenizer, settings: dict) -> dict:
    version = 1 if tok.vocab_size <= 1 << 16 else 7
    return {"settings": settings, "tokenizer": tok.to_dict(), "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "version": version, "shards": [], "units": 0, "carry": 0, "in_doc": False}


def _save_progress(out: Path, name: str, prog: dict) -> None:
    """The progress file, without the tokenizer (shards.json holds it; its SHA-256 here ties the two)."""
    tok = prog["tokenizer"]
    _write_json(out / f"{name}_progress.json", dict({k: v for k, v in prog.items() if k != "tokenizer"},
                                                    tokenizer_sha256=tokenizer_fingerprint(tok)))


def _load_progress(out: Path, name: str) -> dict:
    """The progress file with its tokenizer from shards.json (ValueError when they do not belong together)."""
    prog = json.loads((out / f"{name}_progress.json").read_text(encoding="utf-8"))
    side = out / SIDECAR
    tok = json.loads(side.read_text(encoding="utf-8")).get("tokenizer") if side.is_file() else None
    if not isinstance(tok, dict) or tokenizer_fingerprint(tok) != prog.get("tokenizer_sha256"):
        raise ValueError(f"{side} does not hold the tokenizer of the unfinished preparation of {name!r} in {out}; "
                         "pass --force to prepare again from the start")
    prog["tokenizer"] = tok
    return prog


def _sidecar(prog: dict, name: str, complete: bool) -> dict:
    d = {"format": SIDECAR_FORMAT, "name": name, "tokenizer": prog["tokenizer"], "vocab_size": prog["vocab_size"],
         "eos_id": prog["eos_id"], "separator_id": prog["eos_id"], "header_version": prog["version"],
         "complete": complete}
    if complete:
        shards = prog["shards"]
        tokens = {"val": shards[0]["tokens"], "train": sum(r["tokens"] for r in shards[1:])}
        nbytes = {"val": shards[0]["bytes"], "train": sum(r["bytes"] for r in shards[1:])}
        d.update(shards=[{k: r[k] for k in ("file", "tokens", "sha256")} for r in shards], tokens=tokens,
                 bytes_per_token={s: nbytes[s] / max(tokens[s], 1) for s in tokens}, settings=prog["settings"])
    return d


def _make_tok(src: Corpus, tokenizer: str, vocab_size: int | None, bpe_dir: Any, progress: bool) -> Tokenizer:
    """The tokenizer (a BPE learnt from the corpus first); one without an end-of-text token is refused."""
    from jaxgpt.data.bins import _check_arguments, _make_tokenizer

    if tokenizer in ("char", "byte"):
        raise ValueError(f"the {tokenizer} tokenizer has no end-of-text token to put before each document; shards "
                         "need one: use --tokenizer=gpt2, or bpe with --vocab_size")
    vocab_size, _ = _check_arguments(tokenizer, vocab_size, 0.5, bpe_dir)

    def pieces(desc: str):
        with tqdm(desc=desc, unit="piece", disable=None if progress else True) as bar:
            for p in src.pieces(0.0):
                yield p
                bar.update()

    tok = _make_tokenizer(tokenizer, vocab_size, bpe_dir, pieces)
    if tok.eos_id is None:
        raise ValueError(f"the {tokenizer} tokenizer has no end-of-text token to put before each document")
    return tok


def _bar(src: Corpus, progress: bool, done_units: int) -> tqdm:
    n_docs = getattr(src, "n_documents", None)
    total = n_docs() if callable(n_docs) else None
    return tqdm(total=total, initial=done_units if total else 0, unit="doc" if total or callable(n_docs) else "piece",
                desc="tokenizing", dynamic_ncols=True, disable=None if progress else True)


def _run(src: Corpus, out: Path, name: str, prog: dict, sizes: tuple[int, int], workers: int,
         progress: bool) -> int:
    """Tokenize from where `prog` stands to the end of the corpus, writing shards; returns tokens written."""
    tok = tokenizer_from_dict(prog["tokenizer"])
    stream = _ShardStream(out, name, prog["version"], sizes, prog)
    sep, dtype, start, carry = prog["eos_id"], stream.dtype.str, prog["units"], prog["carry"]
    metas: deque = deque()

    t0, written, last_unit = time.perf_counter(), 0, start - 1
    pieces = _project(_pieces(src, start, prog["in_doc"]), metas)
    with _bar(src, progress, start) as bar:
        for chunk, (ids, lengths, nbytes) in _encoded(pieces, tok, sep, dtype, workers):
            pos = 0
            for k in range(len(chunk)):
                i, before, after = metas.popleft()
                piece = ids[pos : pos + lengths[k]]
                pos += int(lengths[k])
                skip = carry if i == start else 0  # resumed inside this piece: its first tokens are written
                stream.put(piece, i, before, after, 0 if skip else int(nbytes[k]), skip)
                written += piece.size - skip
                last_unit = i
            bar.update(len(chunk))
            bar.set_postfix_str(f"{written / max(time.perf_counter() - t0, 1e-9):,.0f} tokens/s", refresh=False)
    stream.flush(last_unit + 1, 0, False)
    return written


def _project(pieces: Iterator[tuple], metas: deque) -> Iterator[list[tuple[str, bool]]]:
    """Chunks of (text, starts) for the workers; each piece's (index, before, after) queued in `metas`."""
    def texts():
        for i, text, starts, before, after in pieces:
            metas.append((i, before, after))
            yield text, starts
    return _chunks(texts())


def prepare_shards(out_dir: str | os.PathLike, corpus: str = "file", path: Any = None, tokenizer: str = "gpt2",
                   vocab_size: int | None = None, name: str | None = None,
                   shard_tokens: int = DEFAULT_SHARD_TOKENS, val_tokens: int | None = None,
                   workers: int | None = None, progress: bool = True, force: bool = False, *, bpe_dir: Any = None,
                   text_field: str = "text", hf_config: str | None = None, hf_split: str = "train",
                   hf_kwargs: dict | None = None, cache_dir: Any = None) -> dict:
    """Tokenize a corpus into llm.c shards in `out_dir` (see the module's docstring); returns shards.json's
    contents. Resumes an unfinished preparation with the same settings; a finished one is left as it is
    (force=True prepares again). workers: processes that tokenize (None: every core)."""
    from jaxgpt.data.corpora import default_cache_dir

    val_tokens = shard_tokens if val_tokens is None else val_tokens
    workers = (os.cpu_count() or 1) if workers is None else workers
    _check_numbers(shard_tokens, val_tokens, workers)
    if corpus == "hf":  # streamed: a corpus of any size starts at once, nothing is downloaded whole first
        hf_kwargs = {"streaming": True, **(hf_kwargs or {})}
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    src = get_corpus(corpus, path, cache, hf_config=hf_config, hf_split=hf_split, text_field=text_field,
                     hf_kwargs=hf_kwargs)
    name = name or _default_name(corpus, path)
    _check_name(name)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    other = _other_preparation(out, name)
    if other is not None:  # shards.json describes one preparation: a second would take its place
        raise ValueError(f"{out} holds the shards of another preparation ({other!r}, {out / SIDECAR}); a folder holds "
                         "one: choose another folder")
    settings = {"corpus": src.spec, "source": src.fingerprint(), "tokenizer": tokenizer, "vocab_size": vocab_size,
                "shard_tokens": int(shard_tokens), "val_tokens": int(val_tokens)}
    done = _finished(out, name, settings)
    if done is not None and not force:
        return dict(done, path=str(out), reused=True)
    prog = _resume_state(out, name, settings, force or done is not None)
    resumed = prog is not None
    if prog is None:
        prog = _new_progress(_make_tok(src, tokenizer, vocab_size, bpe_dir, progress), settings)
    _write_json(out / SIDECAR, _sidecar(prog, name, complete=False))  # the tokenizer, for what is written so far
    t0 = time.perf_counter()
    written = _run(src, out, name, prog, (int(val_tokens), int(shard_tokens)), int(workers), progress)
    if len(prog["shards"]) < 2:
        _remove_outputs(out, name)
        (out / SIDECAR).unlink(missing_ok=True)
        raise ValueError(f"the corpus gave {sum(r['tokens'] for r in prog['shards'])} tokens, not more than the "
                         f"validation shard's {val_tokens} (--val_tokens): nothing is left to train on; lower "
                         "--val_tokens (and --shard_tokens)")
    side = _sidecar(prog, name, complete=True)
    _write_json(out / SIDECAR, side)
    (out / f"{name}_progress.json").unlink(missing_ok=True)
    seconds = time.perf_counter() - t0
    return dict(side, path=str(out), reused=False, seconds=seconds, tokens_written=written,
                tokens_per_second=written / max(seconds, 1e-9), resumed=resumed)


def _finished(out: Path, name: str, settings: dict) -> dict | None:
    """shards.json of a finished preparation of `name` with these settings in `out`, else None."""
    f = out / SIDECAR
    if (out / f"{name}_progress.json").exists() or not f.is_file():
        return None
    try:
        d = json.loads(f.read_text(encoding="utf-8"))
    except ValueError:
        return None
    if d.get("complete") and d.get("name") == name and d.get("settings") == settings:
        return d
    return None
