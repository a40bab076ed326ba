"""Tokenizers behind one interface: char, byte, byte-level BPE (`tokenizers`), GPT-2 BPE (`tiktoken`).

Every tokenizer can be written out with `to_dict()` (JSON-able) and rebuilt by `tokenizer_from_dict`
with no corpus and no network, which is how datasets and checkpoints carry their tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

TOKENIZERS = ("char", "byte", "bpe", "gpt2")
ENDOFTEXT = "<|endoftext|>"

Ids = Sequence[int] | np.ndarray


def _as_ids(ids: Ids, vocab_size: int) -> np.ndarray:
    a = np.asarray(ids)
    if a.ndim != 1:
        raise ValueError(f"decode takes a 1-D sequence of token ids, got shape {a.shape}")
    if a.size and (not np.issubdtype(a.dtype, np.integer) or a.min() < 0 or a.max() >= vocab_size):
        raise ValueError(f"token ids must be integers in [0, {vocab_size}); got {a.min()}..{a.max()}")
    return a.astype(np.int64, copy=False)


class Tokenizer:
    """Interface: encode(str) -> list[int], decode(ids) -> str, vocab_size, eos_id, to_dict()."""

    name: str = ""
    vocab_size: int = 0
    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of `text` as a 1-D int64 array (the fast path used to write bins)."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """encode_array over several texts (in parallel where the backend can)."""
        return [self.encode_array(t) for t in texts]

    def decode(self, ids: Ids) -> str:
        """Text of a 1-D sequence of token ids."""
        raise NotImplementedError

    def to_dict(self) -> dict:
        """JSON-able dict that tokenizer_from_dict turns back into this tokenizer."""
        raise NotImplementedError

    def spec(self) -> dict:
        """Short JSON-able summary (type, vocab size, eos) for metadata and logs."""
        return {"type": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class CharTokenizer(Tokenizer):
    """One token per Unicode character of a fixed vocabulary (nanoGPT's shakespeare_char: sorted chars)."""

    name = "char"

    def __init__(self, chars: str | Iterable[str]):
        chars = "".join(sorted(set(chars)))
        if not chars:
            raise ValueError("a char tokenizer needs at least one character in its vocabulary")
        self.chars = chars
        self.vocab_size = len(chars)
        self._codes = np.frombuffer(chars.encode("utf-32-le"), dtype="<u4")  # sorted code points

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> "CharTokenizer":
        """The vocabulary of every character in `texts`."""
        seen: set[str] = set()
        for t in texts:
            seen.update(t)
        if not seen:
            raise ValueError("cannot build a char vocabulary from an empty corpus")
        return cls(seen)

    def encode_array(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        ids = np.searchsorted(self._codes, codes)
        bad = np.nonzero(self._codes[np.minimum(ids, self.vocab_size - 1)] != codes)[0]
        if bad.size:
            ch = text[bad[0]]
            others = sorted(set(text[i] for i in bad[:1000]) - {ch})[:5]
            also = f" (also {', '.join(map(repr, others))})" if others else ""
            raise ValueError(
                f"character {ch!r} (U+{ord(ch):04X} {unicodedata.name(ch, 'no name')}) at position "
                f"{bad[0]} is not in this char tokenizer's vocabulary of {self.vocab_size} characters"
                f"{also}; remove it, or use the 'byte' tokenizer (or 'bpe'/'gpt2'), which encodes any text"
            )
        return ids.astype(np.int64)

    def decode(self, ids: Ids) -> str:
        a = _as_ids(ids, self.vocab_size)
        return self._codes[a].tobytes().decode("utf-32-le", "surrogatepass")

    def to_dict(self) -> dict:
        return {"type": "char", "chars": self.chars}


class ByteTokenizer(Tokenizer):
    """The 256 byte values of UTF-8: any text encodes; decoding replaces invalid byte sequences."""

    name = "byte"
    vocab_size = 256

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Ids) -> str:
        a = _as_ids(ids, 256)
        return a.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return {"type": "byte"}


# GPT-2's pre-tokenizer: contractions, letters, digits, other symbols, whitespace.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's files spell each byte as a printable character: itself if printable, else chr(256 + n)."""
    printable = [b for b in range(256) if chr(b).isprintable() and b != ord(" ")]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style) trained on a corpus with Hugging Face `tokenizers`; <|endoftext|> is eos.

    Text is encoded by tiktoken over the learned merges (GPT-2's rule: merge the adjacent pair whose
    union ranks first), several times faster than `tokenizers` and the same on the corpora we tried;
    any split decodes to the same bytes.
    """

    name = "bpe"

    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tk = HFTokenizer.from_str(tokenizer_json)
        except Exception as e:
            raise ValueError(f"not a Hugging Face tokenizer JSON: {e}") from None
        self._tk.encode_special_tokens = True  # "<|endoftext|>" in the text is text, not the eos token
        self._json = tokenizer_json
        self.vocab_size = self._tk.get_vocab_size()
        self.eos_id = self._tk.token_to_id(ENDOFTEXT)
        self._enc = _tiktoken_from_hf(tokenizer_json)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, progress: bool = False) -> "BPETokenizer":
        """Train a byte-level BPE of `vocab_size` tokens (256 bytes + merges + <|endoftext|>) on `texts`."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size is None or int(vocab_size) < 257:
            raise ValueError(
                f"the bpe tokenizer needs vocab_size >= 257 (256 bytes + <|endoftext|>), got {vocab_size}"
            )
        tk = HFTokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=int(vocab_size),
            special_tokens=[ENDOFTEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=progress,
        )
        tk.train_from_iterator(texts, trainer=trainer)
        return cls(tk.to_str())

    def encode(self, text: str) -> list[int]:
        if self._enc is not None:
            return self._enc.encode_ordinary(text)
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        if self._enc is not None:
            out = self._enc.encode_ordinary_batch(list(texts), num_threads=os.cpu_count() or 1)
            return [np.asarray(ids, dtype=np.int64) for ids in out]
        encs = self._tk.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Ids) -> str:
        a = _as_ids(ids, self.vocab_size)
        return self._tk.decode(a.tolist(), skip_special_tokens=False)

    def to_dict(self) -> dict:
        return {"type": "bpe", "tokenizer_json": self._json}


def _tiktoken_from_hf(tokenizer_json: str) -> Any:
    """A tiktoken Encoding with the ranks of a GPT-2-style byte-level BPE JSON, or None for other JSON."""
    import tiktoken

    d = json.loads(tokenizer_json)
    pre, model = d.get("pre_tokenizer") or {}, d.get("model") or {}
    if (
        d.get("normalizer") is not None
        or pre.get("type") != "ByteLevel"
        or pre.get("add_prefix_space")
        or not pre.get("use_regex", True)
        or model.get("type") != "BPE"
        or model.get("dropout") is not None
    ):
        return None
    decode = _gpt2_byte_decoder()
    special = {t["content"]: t["id"] for t in d.get("added_tokens", [])}
    try:
        ranks = {bytes(decode[c] for c in tok): i for tok, i in model["vocab"].items() if tok not in special}
    except KeyError:  # a token outside the byte alphabet
        return None
    return tiktoken.Encoding(
        name="jaxgpt-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=special
    )


# GPT-2's BPE files as published by OpenAI (tiktoken reads these same two files).
GPT2_FILES = {
    "vocab.bpe": (
        "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    ),
    "encoder.json": (
        "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    ),
}


def _tiktoken_cache_dir() -> Path:
    # The folder tiktoken itself caches downloads in, named by the SHA-1 of their URL.
    d = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    if d is None:
        import tempfile

        d = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return Path(d)


def _find_gpt2_files(bpe_dir: str | os.PathLike | None) -> tuple[Path, Path] | None:
    """Local (vocab.bpe, encoder.json) from bpe_dir, else $JAXGPT_GPT2_BPE_DIR, else tiktoken's cache; each
    folder may hold them by name or as tiktoken caches them (named by the SHA-1 of their URL)."""
    folders = [Path(d).expanduser() for d in (bpe_dir, os.environ.get("JAXGPT_GPT2_BPE_DIR")) if d]
    folders.append(_tiktoken_cache_dir())
    for d in folders:
        named = [d / "vocab.bpe", d / "encoder.json"]
        cached = [d / hashlib.sha1(GPT2_FILES[n][0].encode()).hexdigest() for n in GPT2_FILES]
        for pair in (named, cached):
            if all(p.is_file() for p in pair):
                return pair[0], pair[1]
    return None


def _gpt2_ranks(encoder_json: bytes) -> tuple[dict[bytes, int], int]:
    """tiktoken's mergeable ranks and the eos id from GPT-2's encoder.json (its ids are the merge ranks)."""
    decode = _gpt2_byte_decoder()
    encoder = json.loads(encoder_json)
    eos = encoder.pop(ENDOFTEXT, None)
    ranks = {bytes(decode[c] for c in token): rank for token, rank in encoder.items()}
    return ranks, len(ranks) if eos is None else int(eos)


class GPT2Tokenizer(Tokenizer):
    """GPT-2's BPE through tiktoken (50257 tokens, eos 50256), from local files when it can."""

    name = "gpt2"

    def __init__(self, bpe_dir: str | os.PathLike | None = None, download: bool = True):
        import tiktoken

        if bpe_dir is not None and not Path(bpe_dir).expanduser().is_dir():
            raise FileNotFoundError(f"GPT-2 BPE folder {bpe_dir} does not exist")
        self.bpe_dir = str(Path(bpe_dir).expanduser().resolve()) if bpe_dir else None
        found = _find_gpt2_files(bpe_dir)
        if found is not None:
            contents = [p.read_bytes() for p in found]
            for path, data, (fname, (url, digest)) in zip(found, contents, GPT2_FILES.items()):
                actual = hashlib.sha256(data).hexdigest()
                if actual != digest:
                    raise ValueError(
                        f"{path} is not GPT-2's {fname} (SHA-256 {actual}, expected {digest}); "
                        f"replace it with the file from {url}"
                    )
        elif bpe_dir is not None:
            raise ValueError(
                f"{bpe_dir} has no GPT-2 BPE files: put vocab.bpe and encoder.json there "
                f"(from {GPT2_FILES['vocab.bpe'][0].rsplit('/', 1)[0]}/)"
            )
        elif download and not os.environ.get("JAXGPT_OFFLINE"):
            from tiktoken.load import read_file_cached

            try:  # tiktoken downloads into its cache folder and checks the hashes
                contents = [read_file_cached(url, digest) for url, digest in GPT2_FILES.values()]
            except Exception as e:  # requests' connection errors, OSError, hash mismatch
                raise ValueError(self._missing_message(f"{type(e).__name__}: {e}")) from None
        else:
            raise ValueError(self._missing_message("downloads are off"))
        ranks, eos = _gpt2_ranks(contents[1])
        self.eos_id = eos
        self.vocab_size = max(len(ranks), eos) + 1
        self._enc = tiktoken.Encoding(
            name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={ENDOFTEXT: eos}
        )

    def _missing_message(self, why: str) -> str:
        names = " and ".join(f"{n} ({u})" for n, (u, _) in GPT2_FILES.items())
        return (
            f"the gpt2 tokenizer needs GPT-2's BPE files and could not get them ({why}). Download "
            f"{names} on a machine with network, then pass their folder (bpe_dir=... or --bpe_dir), "
            f"or put them in tiktoken's cache folder (TIKTOKEN_CACHE_DIR, now {_tiktoken_cache_dir()})."
        )

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        out = self._enc.encode_ordinary_batch(list(texts), num_threads=os.cpu_count() or 1)
        return [np.asarray(ids, dtype=np.int64) for ids in out]

    def decode(self, ids: Ids) -> str:
        a = _as_ids(ids, self.vocab_size)
        return self._enc.decode(a.tolist(), errors="replace")

    def to_dict(self) -> dict:
        return {"type": "gpt2", "bpe_dir": self.bpe_dir}


class VocabTokenizer(Tokenizer):
    """Only a vocabulary's size and end token, for token ids that came without their tokenizer (llm.c's
    Llama-3 shards with no tokenizer file beside them): enough to train on, not to encode or decode."""

    name = "vocab"

    def __init__(self, vocab_size: int, eos_id: int | None = None, label: str = ""):
        self.vocab_size, self.eos_id, self.label = int(vocab_size), eos_id, label

    def _unknown(self) -> ValueError:
        what = f"{self.label}'s" if self.label else "a"
        return ValueError(
            f"only {what} vocabulary size ({self.vocab_size}) is known for this data, not its tokenizer: "
            "text cannot be encoded or decoded; put the tokenizer file (shards.json, which jaxgpt-prepare "
            "--shards writes) beside the shards, or prepare them again with jaxgpt-prepare --shards")

    def encode_array(self, text: str) -> np.ndarray:
        raise self._unknown()

    def decode(self, ids: Ids) -> str:
        raise self._unknown()

    def to_dict(self) -> dict:
        return {"type": "vocab", "vocab_size": self.vocab_size, "eos_id": self.eos_id, "label": self.label}


class LazyTokenizer(Tokenizer):
    """A tokenizer known by its to_dict(), vocabulary size and end token, built only when text is encoded
    or decoded: training on token ids then needs no BPE files (GPT-2's), only sampling does."""

    def __init__(self, d: dict, vocab_size: int, eos_id: int | None):
        self._d, self.vocab_size, self.eos_id = d, int(vocab_size), eos_id
        self.name = d.get("type", "")
        self._tok: Tokenizer | None = None

    def built(self) -> Tokenizer:
        """The real tokenizer (ValueError saying what is missing, e.g. GPT-2's BPE files)."""
        if self._tok is None:
            self._tok = tokenizer_from_dict(self._d)
        return self._tok

    def encode_array(self, text: str) -> np.ndarray:
        return self.built().encode_array(text)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return self.built().encode_batch(texts)

    def decode(self, ids: Ids) -> str:
        return self.built().decode(ids)

    def to_dict(self) -> dict:
        return dict(self._d)


def get_tokenizer(name: str, **kwargs: Any) -> Tokenizer:
    """A tokenizer by name: 'char' (chars= or texts=), 'byte', 'bpe' (tokenizer_json=, or texts= and
    vocab_size=), 'gpt2' (bpe_dir=)."""
    if name == "byte":
        _no_extra(name, kwargs, ())
        return ByteTokenizer()
    if name == "char":
        _no_extra(name, kwargs, ("chars", "texts"))
        if kwargs.get("chars") is not None:
            return CharTokenizer(kwargs["chars"])
        if kwargs.get("texts") is not None:
            return CharTokenizer.from_texts(kwargs["texts"])
        raise ValueError("the char tokenizer needs its vocabulary: chars=... or texts=... to build it from")
    if name == "bpe":
        _no_extra(name, kwargs, ("tokenizer_json", "texts", "vocab_size", "progress"))
        if kwargs.get("tokenizer_json") is not None:
            return BPETokenizer(kwargs["tokenizer_json"])
        if kwargs.get("texts") is not None:
            return BPETokenizer.train(
                kwargs["texts"], kwargs.get("vocab_size"), kwargs.get("progress", False)
            )
        raise ValueError(
            "the bpe tokenizer needs tokenizer_json=... or texts=... and vocab_size=... to train"
        )
    if name == "gpt2":
        _no_extra(name, kwargs, ("bpe_dir", "download"))
        return GPT2Tokenizer(**kwargs)
    raise ValueError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}")


def _no_extra(name: str, kwargs: dict, allowed: tuple[str, ...]) -> None:
    extra = sorted(set(kwargs) - set(allowed))
    if extra:
        raise ValueError(
            f"the {name} tokenizer does not take {', '.join(extra)}"
            + (f"; it takes {', '.join(allowed)}" if allowed else "")
        )


def tokenizer_from_dict(d: dict) -> Tokenizer:
    """Rebuild a tokenizer from Tokenizer.to_dict()."""
    if not isinstance(d, dict) or "type" not in d:
        raise ValueError(f"not a tokenizer description (a dict with a 'type'): {str(d)[:80]!r}")
    kind = d["type"]
    if kind == "char":
        return CharTokenizer(d["chars"])
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer(d["tokenizer_json"])
    if kind == "gpt2":  # the files are known by their hashes: look elsewhere if the folder has gone
        bpe_dir = d.get("bpe_dir")
        return GPT2Tokenizer(bpe_dir=bpe_dir if bpe_dir and Path(bpe_dir).is_dir() else None)
    if kind == "vocab":
        return VocabTokenizer(d["vocab_size"], d.get("eos_id"), d.get("label", ""))
    raise ValueError(f"unknown tokenizer type {kind!r}; choose one of {', '.join(TOKENIZERS)}")


def _identity(d: dict) -> dict:
    """The part of a to_dict() that decides the ids: gpt2's folder does not (its files are pinned by hash)."""
    return {k: v for k, v in d.items() if not (d.get("type") == "gpt2" and k == "bpe_dir")}


def tokenizer_fingerprint(d: dict) -> str:
    """SHA-256 of a Tokenizer.to_dict() as canonical JSON: equal fingerprints, equal token ids."""
    text = json.dumps(_identity(d), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _chars(cs) -> str:
    cs = sorted(cs)
    return ", ".join(map(repr, cs[:5])) + (f" and {len(cs) - 5} more" if len(cs) > 5 else "")


def tokenizer_difference(old: dict, new: dict) -> str | None:
    """What differs between two Tokenizer.to_dict()s in a few words, or None for the same tokenizer."""
    if tokenizer_fingerprint(old) == tokenizer_fingerprint(new):
        return None
    if old.get("type") != new.get("type"):
        return f"a {old.get('type')} tokenizer before, a {new.get('type')} tokenizer now"
    kind = old.get("type")
    if kind == "char":
        a, b = old.get("chars", ""), new.get("chars", "")
        gone, added = set(a) - set(b), set(b) - set(a)
        parts = [f"{_chars(cs)} only {when}" for cs, when in ((gone, "before"), (added, "now")) if cs]
        if len(a) == len(b):
            return (f"char vocabularies differ: the same vocab size ({len(a)}) but other characters "
                    f"({'; '.join(parts)}), so ids name other characters")
        return f"char vocabularies differ: {len(a)} characters before, {len(b)} now ({'; '.join(parts)})"
    if kind == "bpe":
        try:
            ma = json.loads(old["tokenizer_json"]).get("model") or {}
            mb = json.loads(new["tokenizer_json"]).get("model") or {}
        except (KeyError, TypeError, ValueError):
            return "bpe tokenizers differ"
        va, vb = ma.get("vocab") or {}, mb.get("vocab") or {}
        if len(va) != len(vb):
            return f"bpe vocabularies of {len(va)} tokens before and {len(vb)} now"
        moved = sorted(t for t in va if vb.get(t) != va[t])
        if moved:
            t = moved[0]
            return (f"the same bpe vocab size ({len(va)}) but {len(moved)} tokens have other ids (e.g. {t!r}: "
                    f"{va[t]} before, {vb.get(t)} now)")
        if ma.get("merges") != mb.get("merges"):
            return f"the same bpe vocabulary ({len(va)} tokens) but other merge rules"
        return "bpe tokenizers with other settings (normalizer, pre-tokenizer or special tokens)"
    return f"{kind} tokenizers with other settings"


def save_tokenizer(tok: Tokenizer, path: str | os.PathLike) -> None:
    """Write tok.to_dict() as JSON."""
    Path(path).write_text(json.dumps(tok.to_dict(), ensure_ascii=False), encoding="utf-8")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Read a tokenizer written by save_tokenizer."""
    return tokenizer_from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
