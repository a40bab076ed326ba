"""Token bins are checked against their recorded size and SHA-256; corpora that cannot train are refused."""

import sys
import types

import numpy as np
import pytest

from jaxgpt.cli.prepare import main as prepare_main
from jaxgpt.data import load_prepared, prepare_dataset

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\n\n" * 50


def _prep(tmp_path, text=TEXT, tokenizer="char"):
    f = tmp_path / "corpus.txt"
    f.write_bytes(text.encode() if isinstance(text, str) else text)
    return prepare_dataset("file", path=f, tokenizer=tokenizer, cache_dir=tmp_path / "cache", progress=False)


def test_bins_record_their_size_and_checksum(tmp_path):
    ds = _prep(tmp_path)
    for split in ("train", "val"):
        m = ds.meta[split]
        assert m["file_bytes"] == (ds.path / m["file"]).stat().st_size == m["tokens"] * 2
        assert len(m["sha256"]) == 64


def test_a_cached_bin_that_changed_is_prepared_again(tmp_path, capsys):
    ds = _prep(tmp_path)
    good = np.array(ds.train)
    bad = np.full_like(good, 60000)  # ids far outside the 26-character vocabulary, same size
    bad.tofile(ds.path / "train.bin")
    again = _prep(tmp_path)
    assert not again.reused and np.array_equal(np.array(again.train), good)
    err = capsys.readouterr().err
    assert "train.bin does not match the SHA-256 in meta.json" in err
    assert "preparing the cached dataset again" in err


def test_a_user_supplied_bin_that_changed_is_refused_in_one_line(tmp_path):
    ds = _prep(tmp_path)
    with open(ds.path / "val.bin", "r+b") as f:
        f.write(b"\xff\xff")
    with pytest.raises(ValueError, match=r"val\.bin does not match the SHA-256 in meta\.json.*prepare --force"):
        load_prepared(ds.path)
    with open(ds.path / "val.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match=r"val\.bin has \d+ bytes, but meta\.json records \d+"):
        load_prepared(ds.path)


@pytest.mark.parametrize("tokenizer", ["char", "byte"])
def test_a_corpus_with_a_single_distinct_token_is_refused(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"single distinct token \('\\x00', id 0\).*nothing to learn"):
        _prep(tmp_path, b"\0" * 5000, tokenizer)
    assert not [p for p in (tmp_path / "cache" / "datasets").iterdir()]  # nothing half-made left behind


def test_hf_dataset_that_cannot_be_loaded_is_one_line(tmp_path, monkeypatch, capsys):
    def offline(path, name=None, split=None, **kw):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)\n"
                              "An error happened while trying to locate the file on the Hub\nand more")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    assert prepare_main(["--corpus=hf", "--path=openwebtext", "--tokenizer=byte", f"--cache_dir={tmp_path}",
                         "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not load the Hugging Face dataset 'openwebtext'" in err
    assert "ConnectionError: Couldn't reach 'openwebtext'" in err and "corpus='file'" in err

