"""Tokenizers: round trips, errors, to_dict/from_dict, and GPT-2's BPE from local files (offline)."""

import hashlib
import json
import os

import numpy as np
import pytest

from jaxgpt.data import get_tokenizer, tokenizer_from_dict
from jaxgpt.data import tokenizer as tokmod
from jaxgpt.data.tokenizer import ENDOFTEXT

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
ODD = "naïve café — 日本語 🙂\ttabs  and\r\nCRLF, <|endoftext|> as text\n\n\n  trailing  "


def _bpe(vocab_size=300):
    return get_tokenizer("bpe", texts=[TEXT * 5, ODD], vocab_size=vocab_size)


def test_char_round_trip_and_nanogpt_ids():
    tok = get_tokenizer("char", texts=[TEXT])
    chars = sorted(set(TEXT))
    assert tok.vocab_size == len(chars) and tok.eos_id is None
    ids = tok.encode(TEXT)
    assert ids == [chars.index(c) for c in TEXT]  # nanoGPT's stoi: index in the sorted characters
    assert tok.decode(ids) == TEXT
    assert tok.decode(np.asarray(ids, dtype=np.uint16)) == TEXT


def test_char_unknown_character_names_it_and_suggests_byte():
    tok = get_tokenizer("char", chars="abc ")
    with pytest.raises(ValueError, match=r"'é'.*U\+00E9.*byte"):
        tok.encode("a cab é")


@pytest.mark.parametrize("name", ["byte", "bpe"])
def test_any_text_round_trips(name):
    tok = get_tokenizer("byte") if name == "byte" else _bpe()
    for text in (TEXT, ODD, "", " ", "\n"):
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text


def test_byte_tokenizer_is_utf8():
    tok = get_tokenizer("byte")
    assert tok.vocab_size == 256 and tok.eos_id is None
    assert tok.encode("é") == list("é".encode())
    assert tok.decode([0xC3]) == "\ufffd"  # a cut multi-byte character decodes, replaced


def test_bpe_vocab_size_eos_and_compression():
    tok = _bpe(300)
    assert tok.vocab_size == 300
    assert tok.decode([tok.eos_id]) == ENDOFTEXT
    assert ENDOFTEXT in ODD and tok.eos_id not in tok.encode(ODD)  # literal text is not the eos token
    assert len(tok.encode(TEXT)) < len(TEXT.encode())
    with pytest.raises(ValueError, match="vocab_size"):
        get_tokenizer("bpe", texts=[TEXT], vocab_size=100)


def test_bpe_fast_encoder_agrees_with_tokenizers_library():
    tok = _bpe(320)
    assert tok._enc is not None  # tiktoken over the learned merges
    for text in (TEXT, ODD, TEXT.upper() + ODD[::-1]):
        assert tok.encode(text) == tok._tk.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("name", ["char", "byte", "bpe"])
def test_to_dict_rebuilds_the_same_tokenizer(name):
    tok = {
        "char": lambda: get_tokenizer("char", texts=[TEXT]),
        "byte": lambda: get_tokenizer("byte"),
        "bpe": _bpe,
    }[name]()
    d = json.loads(json.dumps(tok.to_dict()))  # JSON-able
    tok2 = tokenizer_from_dict(d)
    assert type(tok2) is type(tok) and tok2.vocab_size == tok.vocab_size and tok2.eos_id == tok.eos_id
    assert tok2.encode(TEXT) == tok.encode(TEXT)


def test_unknown_names_and_bad_input():
    with pytest.raises(ValueError, match="char, byte, bpe, gpt2"):
        get_tokenizer("wordpiece")
    with pytest.raises(ValueError, match="char, byte, bpe, gpt2"):
        tokenizer_from_dict({"type": "wordpiece"})
    with pytest.raises(ValueError, match="vocabulary"):
        get_tokenizer("char")
    with pytest.raises(ValueError, match="does not take"):
        get_tokenizer("byte", vocab_size=3)
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        get_tokenizer("byte").decode([256])


# --- GPT-2 through tiktoken, with small stand-in BPE files in GPT-2's published format -------------


def _byte_encoder():
    return {b: c for c, b in tokmod._gpt2_byte_decoder().items()}


def _fake_gpt2_files(folder):
    """A tiny encoder.json/vocab.bpe pair: the 256 bytes, three merges, then <|endoftext|>."""
    enc = _byte_encoder()
    tokens = [enc[b] for b in range(256)]
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    tokens += [a + b for a, b in merges]
    encoder = {t: i for i, t in enumerate(tokens)}
    encoder[ENDOFTEXT] = len(tokens)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "encoder.json").write_text(json.dumps(encoder))
    (folder / "vocab.bpe").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return {
        n: (str(folder / n), hashlib.sha256((folder / n).read_bytes()).hexdigest())
        for n in ("vocab.bpe", "encoder.json")
    }


@pytest.fixture
def fake_gpt2(tmp_path, monkeypatch):
    """GPT2_FILES pointed at local stand-ins (their 'URLs' are paths, which tiktoken reads directly)."""
    files = _fake_gpt2_files(tmp_path / "remote")
    monkeypatch.setattr(tokmod, "GPT2_FILES", files)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))
    monkeypatch.delenv("JAXGPT_OFFLINE", raising=False)
    monkeypatch.delenv("JAXGPT_GPT2_BPE_DIR", raising=False)
    return tmp_path / "remote"


def test_gpt2_from_a_folder_of_bpe_files(fake_gpt2, monkeypatch):
    tok = get_tokenizer("gpt2", bpe_dir=fake_gpt2)
    assert tok.vocab_size == 260 and tok.eos_id == 259
    ids = tok.encode("hi the end")
    assert 258 in ids  # " the" merged into one token
    assert tok.decode(ids) == "hi the end"
    for text in (TEXT, ODD):
        assert tok.decode(tok.encode(text)) == text
    tok2 = tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))
    assert tok2.encode(ODD) == tok.encode(ODD)
    monkeypatch.setenv("JAXGPT_GPT2_BPE_DIR", str(fake_gpt2))  # the folder may come from the environment
    assert tokenizer_from_dict({"type": "gpt2", "bpe_dir": "/moved/away"}).encode(ODD) == tok.encode(ODD)


def test_gpt2_download_is_cached_then_works_offline(fake_gpt2, tmp_path, monkeypatch):
    tok = get_tokenizer("gpt2")  # no local copy: "downloads" through tiktoken into TIKTOKEN_CACHE_DIR
    assert len(os.listdir(tmp_path / "tiktoken-cache")) == 2
    for f in fake_gpt2.iterdir():
        f.unlink()  # the source is gone
    monkeypatch.setenv("JAXGPT_OFFLINE", "1")
    assert get_tokenizer("gpt2").encode(TEXT) == tok.encode(TEXT)


def test_gpt2_without_files_says_how_to_supply_them(fake_gpt2, monkeypatch):
    monkeypatch.setenv("JAXGPT_OFFLINE", "1")
    with pytest.raises(ValueError, match="bpe_dir"):
        get_tokenizer("gpt2")
    for f in fake_gpt2.iterdir():
        f.unlink()
    monkeypatch.delenv("JAXGPT_OFFLINE")
    with pytest.raises(ValueError, match="TIKTOKEN_CACHE_DIR"):
        get_tokenizer("gpt2")  # the "download" fails


def test_gpt2_rejects_files_that_are_not_gpt2s(fake_gpt2, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "encoder.json").write_text("{}")
    (other / "vocab.bpe").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match="is not GPT-2's"):
        get_tokenizer("gpt2", bpe_dir=other)
    with pytest.raises(FileNotFoundError):
        get_tokenizer("gpt2", bpe_dir=tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no GPT-2 BPE files"):
        get_tokenizer("gpt2", bpe_dir=tmp_path / "empty")


def test_real_gpt2_ids_when_the_files_are_here():
    if tokmod._find_gpt2_files(None) is None:
        pytest.skip(
            "GPT-2's BPE files are not available offline (set JAXGPT_GPT2_BPE_DIR or TIKTOKEN_CACHE_DIR)"
        )
    tok = get_tokenizer("gpt2")
    assert tok.vocab_size == 50257 and tok.eos_id == 50256
    assert tok.encode("Hello world") == [15496, 995]
