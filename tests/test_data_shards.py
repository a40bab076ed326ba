"""llm.c's token shards as a dataset (jaxgpt/data/shards.py): headers checked and bad files refused naming
them, one virtual token array over many files, the tokenizer by version or by the file beside the shards,
training, exact resume, changed data refused, and every process reading only its own rows.

The shards here are written by `_shard`, from the format's description (a header of 256 little-endian
int32: magic, version, token count; then the tokens), not by jaxgpt's writer."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxgpt.data import BatchSampler
from jaxgpt.data.shards import ShardArray, ShardError, open_shards, read_header, shard_files
from tests.helpers import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V1, V7 = (20240520, 1, "<u2"), (20240801, 7, "<u4")


def _shard(path, ids, fmt=V1, count=None, magic=None, version=None):
    """One shard as llm.c's format describes it; count/magic/version override the header's fields."""
    header = np.zeros(256, dtype="<i4")
    header[0] = fmt[0] if magic is None else magic
    header[1] = fmt[1] if version is None else version
    header[2] = len(ids) if count is None else count
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header.tobytes() + np.asarray(ids).astype(fmt[2]).tobytes())
    return path


def _documents(rng, n_tokens, sep=0, vocab=256):
    """A token stream of documents, each starting with the separator `sep`, `n_tokens` long."""
    out = []
    while len(out) < n_tokens:
        out.append(sep)
        out.extend(rng.integers(1, vocab, size=int(rng.integers(3, 40))).tolist())
    return np.array(out[:n_tokens])


def _folder(tmp_path, n_train=3, tokens=600, seed=0, name="data"):
    rng = np.random.default_rng(seed)
    folder = tmp_path / name
    _shard(folder / "tiny_val_000000.bin", _documents(rng, tokens))
    for i in range(1, n_train + 1):
        _shard(folder / f"tiny_train_{i:06d}.bin", _documents(rng, tokens))
    return folder


def _config(tmp_path, path, **train):
    c = tiny_config(tmp_path, **train)
    c.data.corpus, c.data.path, c.data.tokenizer = "shards", str(path), "byte"
    return c


def _losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


# --- the format: headers checked, each fault refused naming the file ------------------------------


def _bad(folder, fault):
    """Writes a shard with `fault` into folder; returns its path."""
    ids = np.arange(100) % 200
    p = folder / "tiny_train_000009.bin"
    if fault == "truncated":
        _shard(p, ids)
        p.write_bytes(p.read_bytes()[:-7])
    elif fault == "short header":
        p.write_bytes(b"\0" * 100)
    elif fault == "magic":
        _shard(p, ids, magic=12345)
    elif fault == "count":
        _shard(p, ids, count=101)
    elif fault == "v7 over uint16":
        _shard(p, ids, fmt=(20240801, 7, "<u2"))
    elif fault == "vocab":
        _shard(p, np.where(ids == 50, 300, ids))  # one id past the byte tokenizer's 256
    return p


@pytest.mark.parametrize("fault,words", [("truncated", "truncated"), ("short header", "shorter than the 1024-byte"),
                                         ("magic", "magic number is 12345"), ("count", "says 101 tokens"),
                                         ("v7 over uint16", "version 7 (4-byte tokens)"),
                                         ("vocab", "token id 300 at token 50")])
def test_a_bad_shard_is_refused_naming_the_file_and_the_fault(tmp_path, fault, words):
    folder = _folder(tmp_path)
    bad = _bad(folder, fault)
    with pytest.raises(ShardError) as e:
        open_shards(str(folder), tokenizer="byte")
    assert str(bad) in str(e.value) and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_ids_past_the_vocabulary_are_refused_at_read_time_when_not_scanned(tmp_path):
    folder = _folder(tmp_path, n_train=1)
    bad = _bad(folder, "vocab")
    ds = open_shards(str(folder), tokenizer="byte", scan=False)  # (big data is not scanned at open)
    ds.train[:10]  # tokens before the bad one read
    with pytest.raises(ShardError, match="tiny_train_000009.bin holds token id 300"):
        ds.train[int(ds.train.starts[1]) : int(ds.train.starts[1]) + 60]
    assert str(bad) in ds.train.shards[1].path


def test_a_bad_shard_stops_jaxgpt_train_with_one_line_and_status_2(tmp_path):
    folder = _folder(tmp_path)
    bad = _bad(folder, "count")
    r = subprocess.run([sys.executable, "train.py", "--config=configs/shakespeare_char_cpu.py",
                        "--config.data.corpus=shards", f"--config.data.path={folder}", "--config.data.tokenizer=auto",
                        f"--config.out_dir={tmp_path / 'out'}"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("jaxgpt-train: error: shard "), r.stderr
    assert str(bad) in r.stderr and "Traceback" not in r.stderr


def test_splits_by_name_or_val_path_and_missing_splits_are_refused(tmp_path):
    folder = _folder(tmp_path, n_train=2)
    ds = open_shards(str(folder), tokenizer="byte")
    assert [os.path.basename(s.path) for s in ds.val.shards] == ["tiny_val_000000.bin"]
    assert [os.path.basename(s.path) for s in ds.train.shards] == ["tiny_train_000001.bin", "tiny_train_000002.bin"]
    glob = str(folder / "tiny_train_*.bin")
    ds = open_shards(glob, val_path=str(folder / "tiny_train_000002.bin"), tokenizer="byte")
    assert [os.path.basename(s.path) for s in ds.train.shards] == ["tiny_train_000001.bin"]
    with pytest.raises(ShardError, match="no validation shard"):
        open_shards(glob, tokenizer="byte")
    with pytest.raises(ShardError, match="names no shard files"):
        open_shards(str(tmp_path / "nothing_*.bin"))
    (folder / ".tiny_train_000003.bin.tmp").write_bytes(b"half")  # an unfinished write is never read
    (folder / "shards.json").write_text("{}")
    assert len(shard_files(folder)) == len(shard_files(str(folder / "*"))) == 3


# --- the tokenizer: by version, or the file beside the shards ---------------------------------------


def test_auto_tokenizer_by_version_needs_no_bpe_files(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXGPT_OFFLINE", "1")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.delenv("JAXGPT_GPT2_BPE_DIR", raising=False)
    ids = np.array([50256, 1, 2, 50256, 3])
    _shard(tmp_path / "g/x_val_000000.bin", ids)
    _shard(tmp_path / "g/x_train_000001.bin", ids)
    ds = open_shards(str(tmp_path / "g"))
    assert (ds.tokenizer.vocab_size, ds.separator_id, ds.tokenizer.to_dict()["type"]) == (50257, 50256, "gpt2")
    with pytest.raises(ValueError, match="GPT-2's BPE files"):  # only text needs them, and says so
        ds.tokenizer.decode([1, 2])
    ids7 = np.array([128000, 5, 128255])
    _shard(tmp_path / "l/x_val_000000.bin", ids7, fmt=V7)
    _shard(tmp_path / "l/x_train_000001.bin", ids7, fmt=V7)
    ds = open_shards(str(tmp_path / "l"))
    assert (ds.tokenizer.vocab_size, ds.separator_id, ds.train.dtype.itemsize) == (128256, 128000, 4)
    assert ds.train[:3].tolist() == ids7.tolist()
    with pytest.raises(ValueError, match="vocabulary size .128256. is known"):
        ds.tokenizer.encode("hi")
    with pytest.raises(ShardError, match="version 7"):
        open_shards(str(tmp_path / "l"), tokenizer="gpt2")


def test_the_tokenizer_file_beside_the_shards_wins_and_a_contradicting_name_is_refused(tmp_path):
    folder = _folder(tmp_path, n_train=1)
    (folder / "shards.json").write_text(json.dumps({"format": "jaxgpt-shards", "tokenizer": {"type": "byte"},
                                                    "vocab_size": 256, "eos_id": None, "separator_id": 0,
                                                    "bytes_per_token": {"val": 1.0}}))
    ds = open_shards(str(folder))
    assert ds.tokenizer.encode("ab") == [97, 98] and ds.separator_id == 0 and ds.bytes_per_token("val") == 1.0
    with pytest.raises(ShardError, match="written with a byte tokenizer"):
        open_shards(str(folder), tokenizer="gpt2")


# --- one virtual array over many files --------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(0, 30), min_size=1, max_size=8), data=st.data())
def test_the_shard_array_is_the_concatenation_of_its_files(tmp_path_factory, counts, data):
    folder = tmp_path_factory.mktemp("cat")
    rng = np.random.default_rng(len(counts))
    parts = [rng.integers(0, 65535, size=n) for n in counts]
    shards = [read_header(_shard(folder / f"s_{i:06d}.bin", p)) for i, p in enumerate(parts)]
    whole = np.concatenate(parts)
    if whole.size == 0:
        return
    arr = ShardArray(shards, max_open=data.draw(st.integers(1, 3)))
    lo = data.draw(st.integers(0, whole.size))
    hi = data.draw(st.integers(lo, whole.size))
    assert arr[lo:hi].tolist() == whole[lo:hi].tolist()
    i = data.draw(st.integers(-whole.size, whole.size - 1))
    assert arr[i] == whole[i] and len(arr) == whole.size and arr.open_files() <= arr.max_open


def test_reading_a_window_touches_only_its_bytes(tmp_path, monkeypatch):
    folder = _folder(tmp_path, n_train=4, tokens=1000)
    ds = open_shards(str(folder), tokenizer="byte", max_open=2)
    reads = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: reads.append((n, off)) or real(fd, n, off))
    sampler = BatchSampler(ds.train, batch_size=8, block_size=16, seed=3)
    for _ in range(5):
        sampler.next()
    assert sum(n for n, _ in reads) == 5 * 8 * 17 * 2  # the windows' bytes, no more (uint16)
    assert all(off >= 1024 for _, off in reads) and ds.train.open_files() <= 2


def test_each_process_reads_its_own_rows_and_resumes_on_another_process_count(tmp_path):
    folder = _folder(tmp_path, n_train=3, tokens=300)  # windows span shard boundaries
    ds = open_shards(str(folder), tokenizer="byte")
    one = BatchSampler(ds.train, 8, 16, seed=5)
    two = [BatchSampler(ds.train, 8, 16, seed=5, process_index=i, process_count=2) for i in range(2)]
    four = [BatchSampler(ds.train, 8, 16, seed=5, process_index=i, process_count=4) for i in range(4)]
    for _ in range(3):
        x, y = one.next()
        for group in (two, four):
            parts = [s.next() for s in group]
            assert np.array_equal(np.concatenate([p[0] for p in parts]), x)
            assert np.array_equal(np.concatenate([p[1] for p in parts]), y)
    later = BatchSampler(ds.train, 8, 16, seed=5, process_index=1, process_count=2)
    later.load_state_dict(one.state_dict())  # saved on one process, resumed on two
    assert np.array_equal(later.next()[0], one.next()[0][4:])


# --- training ---------------------------------------------------------------------------------------


def test_a_folder_and_a_glob_of_shards_train_and_resume_exactly(tmp_path):
    from jaxgpt.training import train

    folder = _folder(tmp_path)
    whole = train(_config(tmp_path / "whole", folder, max_steps=6, log_interval=1, eval_interval=3,
                          checkpoint_interval=3))
    assert whole["steps"] == 6
    half = _config(tmp_path / "half", folder, max_steps=3, log_interval=1, eval_interval=3, checkpoint_interval=3)
    train(half)
    half.train.max_steps, half.init_from = 6, "resume"
    train(half)
    assert _losses(half.out_dir) == _losses(whole["out_dir"])  # exact: the same batches, the same updates
    c = _config(tmp_path / "glob", str(folder / "tiny_*.bin"), max_steps=2, eval_interval=2, checkpoint_interval=2)
    assert train(c)["steps"] == 2


def test_resuming_on_changed_shards_is_refused(tmp_path):
    from jaxgpt.checkpoint import CheckpointError
    from jaxgpt.training import train

    folder = _folder(tmp_path, n_train=2)
    c = _config(tmp_path, folder, max_steps=2, eval_interval=2, checkpoint_interval=2)
    train(c)
    _shard(folder / "tiny_train_000003.bin", np.arange(50))
    c.train.max_steps, c.init_from = 4, "resume"
    with pytest.raises(CheckpointError, match="train shard tiny_train_000003.bin is new"):
        train(c)


def test_a_run_over_a_thousand_shard_files_starts_and_trains(tmp_path):
    from jaxgpt.training import train

    rng = np.random.default_rng(1)
    folder = tmp_path / "many"
    _shard(folder / "many_val_000000.bin", _documents(rng, 400))
    for i in range(1, 1001):
        _shard(folder / f"many_train_{i:06d}.bin", _documents(rng, 20))
    ds = open_shards(str(folder), tokenizer="byte")
    assert len(ds.train.shards) == 1000 and len(ds.train) == 20_000
    s = BatchSampler(ds.train, 64, 16, seed=0)
    for _ in range(4):
        s.next()
    assert ds.train.open_files() <= 64
    ds.close()
    c = _config(tmp_path, folder, max_steps=2, eval_interval=2, checkpoint_interval=2)
    before = len(os.listdir("/proc/self/fd"))
    assert train(c)["steps"] == 2
    assert len(os.listdir("/proc/self/fd")) < before + 8  # the run closed its shards (up to 64 a split) itself


# --- jaxgpt-prepare --shards ------------------------------------------------------------------------

_WORDS = "the king is dead long live queen my lord what say you of this night and day".split()


def _docs(n=150, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(_WORDS, size=int(rng.integers(3, 50)))) + ("\n" if i % 3 else "") for i in range(n)]


def _jsonl(folder, docs, parts=3):
    folder.mkdir(parents=True, exist_ok=True)
    for p in range(parts):
        with open(folder / f"part{p}.jsonl", "w") as f:
            for d in docs[p * len(docs) // parts : (p + 1) * len(docs) // parts]:
                f.write(json.dumps({"id": 1, "body": d}) + "\n")
    return folder


def _read_shards(folder):
    """(names, token arrays) of every .bin in `folder`, read as the format describes: each header's magic and
    version, its count equal to the file's size."""
    names, arrays = sorted(f for f in os.listdir(folder) if f.endswith(".bin")), []
    for n in names:
        raw = (folder / n).read_bytes()
        magic, version, count = np.frombuffer(raw[:12], dtype="<i4")
        assert (magic, version) == (20240520, 1) and len(raw) == 1024 + 2 * count, n
        arrays.append(np.frombuffer(raw[1024:], dtype="<u2"))
    return names, arrays


def _sha256s(folder):
    import hashlib
    return {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in sorted(os.listdir(folder))}


def test_prepared_shards_hold_each_document_after_the_end_token_and_train(tmp_path):
    from jaxgpt.data.shard_writer import prepare_shards
    from jaxgpt.data.tokenizer import tokenizer_from_dict
    from jaxgpt.training import train

    docs = _docs()
    out = tmp_path / "shards"
    d = prepare_shards(out, corpus="jsonl", path=_jsonl(tmp_path / "docs", docs), tokenizer="bpe", vocab_size=300,
                       shard_tokens=700, val_tokens=500, workers=1, progress=False, text_field="body")
    names, arrays = _read_shards(out)
    assert names[-1] == "docs_val_000000.bin" and names[0] == "docs_train_000001.bin"
    val, train_parts = arrays[-1], arrays[:-1]
    assert len(val) == 500 and all(len(a) == 700 for a in train_parts[:-1]) and 0 < len(train_parts[-1]) <= 700
    side = json.loads((out / "shards.json").read_text())
    tok = tokenizer_from_dict(side["tokenizer"])
    eos = side["separator_id"]
    assert eos == tok.eos_id == d["eos_id"]
    want = np.concatenate([np.concatenate([[eos], tok.encode(doc)]) for doc in docs])
    assert np.array_equal(np.concatenate([val] + train_parts), want)  # the end token before every document
    c = _config(tmp_path / "run", out, max_steps=2, eval_interval=2, checkpoint_interval=2)
    c.data.tokenizer = "auto"  # the bpe of shards.json, vocab 300
    summary = train(c)
    assert summary["steps"] == 2 and summary["state"].params["wte"]["embedding"].shape[0] == 300


def test_a_parquet_folder_prepares_the_same_shards_as_json_lines(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet corpora need pyarrow (the hf or eval extra brings it)")
    import pyarrow.parquet as pq

    from jaxgpt.data.shard_writer import prepare_shards

    docs = _docs()
    out = tmp_path / "shards"
    prepare_shards(out, corpus="jsonl", path=_jsonl(tmp_path / "docs", docs), tokenizer="bpe", vocab_size=300,
                   shard_tokens=700, val_tokens=500, workers=1, progress=False, text_field="body")
    # a Parquet folder of the same documents gives the same bytes
    (tmp_path / "pq").mkdir()
    for p in range(2):
        pq.write_table(pa.table({"body": docs[p * 75 : (p + 1) * 75]}), tmp_path / "pq" / f"p{p}.parquet")
    prepare_shards(tmp_path / "from_pq", corpus="parquet", path=tmp_path / "pq", tokenizer="bpe", vocab_size=300,
                   shard_tokens=700, val_tokens=500, workers=1, progress=False, text_field="body", name="docs")
    bins = lambda folder: {k: v for k, v in _sha256s(folder).items() if k.endswith(".bin")}  # noqa: E731
    assert bins(tmp_path / "from_pq") == bins(out)


def test_a_tokenizer_without_an_end_token_is_refused(tmp_path):
    from jaxgpt.data.shard_writer import prepare_shards

    with pytest.raises(ValueError, match="byte tokenizer has no end-of-text token"):
        prepare_shards(tmp_path / "o", corpus="jsonl", path=_jsonl(tmp_path / "d", _docs(10)), tokenizer="byte",
                       text_field="body", progress=False, workers=1)


def test_a_killed_preparation_resumes_to_byte_identical_shards(tmp_path):
    from jaxgpt.data.shard_writer import KILL_ENV

    docs = _jsonl(tmp_path / "docs", _docs(300, seed=1))
    base = [sys.executable, "-m", "jaxgpt.cli.prepare", "--corpus=jsonl", f"--path={docs}", "--text_field=body",
            "--tokenizer=bpe", "--vocab_size=300", "--shard_tokens=900", "--val_tokens=600", "--quiet"]
    env = {k: v for k, v in os.environ.items() if k != KILL_ENV}

    def run(out, *extra, **more):
        return subprocess.run(base + [f"--shards={out}", *extra], cwd=REPO, capture_output=True, text=True,
                              env=dict(env, **more), timeout=120)

    whole = run(tmp_path / "whole", "--workers=2")
    assert whole.returncode == 0, whole.stderr
    killed = run(tmp_path / "part", "--workers=1", **{KILL_ENV: "3"})
    assert killed.returncode == 137
    left = os.listdir(tmp_path / "part")
    assert any(f.startswith(".docs_train_000003.bin.tmp") for f in left) and "docs_train_000003.bin" not in left
    with pytest.raises(ShardError, match="no validation shard|no shard"):  # (a reader never sees the half file)
        open_shards(str(tmp_path / "part" / "*train_000003*"))
    other = run(tmp_path / "part", "--workers=1", "--shard_tokens=800")
    assert other.returncode == 2 and "other settings" in other.stderr and other.stderr.count("\n") == 1
    resumed = run(tmp_path / "part", "--workers=2")
    assert resumed.returncode == 0 and "resumed" in resumed.stdout, resumed.stderr
    assert _sha256s(tmp_path / "part") == _sha256s(tmp_path / "whole")  # every shard and shards.json
    assert len(_sha256s(tmp_path / "whole")) > 6


def test_the_log_says_how_long_the_step_waited_for_data_and_the_loaders_speed(tmp_path, monkeypatch, capsys):
    import time

    from jaxgpt.training import train

    real = BatchSampler.batch
    monkeypatch.setattr(BatchSampler, "batch", lambda self, step: time.sleep(0.2) or real(self, step))
    c = _config(tmp_path, _folder(tmp_path), max_steps=6, log_interval=1, eval_interval=6, checkpoint_interval=6,
                warmup_steps=1)
    train(c)
    with open(os.path.join(c.out_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "loss" in r]
    assert len(rows) == 6 and all("data_wait_s" in r and "loader_tokens_per_s" in r for r in rows)
    starved = [r for r in rows[3:] if r["data_wait_s"] > 0.05]  # once the batches made ahead are used up
    assert starved and all(r["loader_tokens_per_s"] > 0 for r in starved)
    assert "waited for data" in capsys.readouterr().out  # (a loader 0.2 s a batch starves a ms step)


def test_document_aligned_windows_over_shards_start_at_the_shards_separator_and_train(tmp_path):
    from jaxgpt.data.shard_writer import prepare_shards
    from jaxgpt.training import train
    from jaxgpt.training.loop import _load_data

    out = tmp_path / "shards"
    prepare_shards(out, corpus="jsonl", path=_jsonl(tmp_path / "docs", _docs(n=300)), tokenizer="bpe",
                   vocab_size=300, shard_tokens=900, val_tokens=500, workers=1, progress=False, text_field="body")
    sep = json.loads((out / "shards.json").read_text())["separator_id"]
    c = _config(tmp_path / "run", out, max_steps=2, eval_interval=2, checkpoint_interval=2)
    c.data.tokenizer, c.data.align = "auto", "document"
    ds, sampler = _load_data(c, 0, 1)
    assert ds.separator_id == sep and sampler.align == "document"
    for step in range(5):
        x, y, ids = sampler.batch(step)
        assert (x[:, 0] == sep).all() and (ids[:, 0] == ids.min(axis=1)).all()  # every window starts a document
    assert train(c)["steps"] == 2


def test_prepare_twice_reuses_one_preparation_a_folder_and_refuses_bad_names_and_sizes(tmp_path, capsys):
    from jaxgpt.cli.prepare import main
    from jaxgpt.data.shard_writer import prepare_shards

    docs = _jsonl(tmp_path / "docs", _docs(n=60))
    argv = ["--corpus=jsonl", f"--path={docs}", "--text_field=body", "--tokenizer=bpe", "--vocab_size=300",
            "--shard_tokens=700", "--val_tokens=300", "--workers=1", f"--shards={tmp_path / 'out'}"]
    assert main(argv) == 0
    first = _sha256s(tmp_path / "out")
    capsys.readouterr()
    assert main(argv) == 0  # a finished folder: left as it is, its summary printed again
    assert str(tmp_path / "out") in capsys.readouterr().out and _sha256s(tmp_path / "out") == first
    kw = dict(corpus="jsonl", path=docs, tokenizer="bpe", vocab_size=300, workers=1, progress=False, text_field="body")
    with pytest.raises(ValueError, match="another preparation .'docs'.* a folder holds one"):
        prepare_shards(tmp_path / "out", name="other", shard_tokens=700, val_tokens=300, **kw)
    assert _sha256s(tmp_path / "out") == first  # the first preparation's shards.json untouched
    for name, words in (("my_val_set", "the split"), ("a/b", "letters, digits")):
        with pytest.raises(ValueError, match=words):
            prepare_shards(tmp_path / "n", name=name, shard_tokens=700, val_tokens=300, **kw)
    with pytest.raises(ValueError, match="shard_tokens must be at most 2,147,483,647"):
        prepare_shards(tmp_path / "n", shard_tokens=2 ** 31, val_tokens=300, **kw)


def test_an_unfinished_preparation_or_a_sidecar_without_a_vocabulary_is_refused(tmp_path):
    folder = _folder(tmp_path)
    side = {"format": "jaxgpt-shards", "tokenizer": {"type": "byte"}, "vocab_size": 256, "complete": False}
    (folder / "shards.json").write_text(json.dumps(side))
    with pytest.raises(ShardError, match="unfinished preparation"):
        open_shards(str(folder))
    del side["vocab_size"], side["complete"]
    (folder / "shards.json").write_text(json.dumps(side))
    with pytest.raises(ShardError, match="no vocabulary size"):
        open_shards(str(folder))


def test_a_glob_with_a_wildcard_folder_prepares(tmp_path):
    from jaxgpt.data.shard_writer import prepare_shards

    for part in ("a", "b"):
        _jsonl(tmp_path / "g" / part, _docs(n=40, seed=ord(part)), parts=1)
    d = prepare_shards(tmp_path / "out", corpus="jsonl", path=str(tmp_path / "g" / "*" / "*.jsonl"), tokenizer="bpe",
                       vocab_size=300, shard_tokens=700, val_tokens=300, workers=1, progress=False,
                       text_field="body", name="g")
    assert d["path"] == str(tmp_path / "out") and len(_read_shards(tmp_path / "out")[0]) >= 2
