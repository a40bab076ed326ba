"""Resume and sampling when checkpoints are damaged or do not match the data: fall back, or refuse in one line."""

import json
import math
import os
import shutil

import pytest

from jaxgpt.checkpoint import CHECKSUMS, ChecksumMismatch, CheckpointError, existing_steps, verify_checksums
from jaxgpt.loading import load_model
from jaxgpt.data import CharTokenizer, tokenizer_difference, tokenizer_fingerprint
from jaxgpt.training import train
from jaxgpt.training.restore import check_meta as _check_resume_meta
from tests.helpers import tiny_config


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A tiny run with checkpoints at steps 5 and 10, which each test copies."""
    c = tiny_config(tmp_path_factory.mktemp("run"), max_steps=10, checkpoint_interval=5, eval_interval=5)
    train(c)
    return c


def _copy(run, tmp_path, **train_kw):
    c = tiny_config(tmp_path, max_steps=10, checkpoint_interval=5, eval_interval=5, **train_kw)
    shutil.copytree(run.out_dir, c.out_dir)
    c.init_from = "resume"
    return c


def _truncate_data(out_dir, step):
    state = os.path.join(out_dir, "checkpoints", str(step), "state")
    for root, _, files in os.walk(state):
        for name in files:
            if os.path.basename(root) == "d":  # the arrays' data files
                with open(os.path.join(root, name), "r+b") as f:
                    f.truncate(3)


def _stored_chunks(step_dir, prefix):
    """(data file, offset, length) of each array chunk under `prefix` ('params.', 'opt_state.') that
    orbax's OCDBT store keeps in a data file (small values sit inline in its b-tree)."""
    import tensorstore as ts
    kv = ts.KvStore.open(f"file://{step_dir}/state/").result()
    version = ts.ocdbt.dump(kv).result()["versions"][-1]
    assert version["root_height"] == 0  # a tiny state: one leaf node holds every key
    found = []
    for entry in ts.ocdbt.dump(kv, version["root"]["location"]).result()["entries"]:
        ref = entry.get("indirect_value")  # "value:ocdbt.process_0/:d/<file>:<offset>:<length>"
        if entry["key"].startswith(prefix.encode()) and ref:
            _, folder, file, offset, length = ref.split(":")
            found.append((os.path.join(step_dir, "state", folder, file), int(offset), int(length)))
    return found


def _flip_bytes(step_dir, prefix, count=400):
    """Invert `count` bytes in the middle of the largest stored chunk under `prefix`."""
    path, offset, length = max(_stored_chunks(step_dir, prefix), key=lambda c: c[2])
    start = offset + length // 3
    count = min(count, length // 2)
    with open(path, "r+b") as f:
        f.seek(start)
        flipped = bytes(b ^ 0xFF for b in f.read(count))
        f.seek(start)
        f.write(flipped)


@pytest.mark.parametrize("part", ["opt_state.", "params."])
def test_flipped_bytes_fail_the_checksum_and_resume_falls_back(two_checkpoints, tmp_path, capsys, part):
    c = _copy(two_checkpoints, tmp_path)
    _flip_bytes(os.path.join(c.out_dir, "checkpoints", "10"), part)
    c.train.max_steps = 15  # trains on from 5 and writes step 10 again
    s = train(c)
    assert s["start_step"] == 5 and s["steps"] == 15 and math.isfinite(s["best_val_loss"])
    assert existing_steps(c.out_dir) == [10, 15]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "checkpoint 10 in" in err and "does not match its SHA-256" in err and "resuming from checkpoint 5" in err
    assert os.path.isdir(os.path.join(c.out_dir, "damaged-checkpoints", "10", "state"))  # kept, not deleted


def test_sampling_skips_flipped_bytes_and_checksums_check_each_file(two_checkpoints, tmp_path, capsys):
    c = _copy(two_checkpoints, tmp_path)
    step_dir = os.path.join(c.out_dir, "checkpoints", "10")
    files = [line.split("  ")[1] for line in open(os.path.join(step_dir, CHECKSUMS)).read().splitlines()]
    assert {f.split("/")[0] for f in files} == {"state", "meta"} and "meta/metadata" in files
    assert verify_checksums(step_dir) == sum(os.path.getsize(os.path.join(step_dir, f)) for f in files)
    _flip_bytes(step_dir, "params.", count=1)
    with pytest.raises(ChecksumMismatch, match=r"state/ocdbt\.process_0/d/\w+ does not match"):
        verify_checksums(step_dir)
    assert verify_checksums(step_dir, ("meta",)) > 0  # the items are checked apart
    _, _, _, meta = load_model(c.out_dir)
    assert meta["step"] == 5 and "does not match its SHA-256" in capsys.readouterr().err
    os.remove(os.path.join(step_dir, "meta", "metadata"))
    with pytest.raises(ChecksumMismatch, match="meta/metadata is gone"):
        verify_checksums(step_dir, ("meta",))


def test_checkpoints_without_checksums_restore_unchecked(two_checkpoints, tmp_path, capsys):
    c = _copy(two_checkpoints, tmp_path)
    for step in (5, 10):  # as saved before checksums were written
        os.remove(os.path.join(c.out_dir, "checkpoints", str(step), CHECKSUMS))
    assert verify_checksums(os.path.join(c.out_dir, "checkpoints", "10")) is None
    c.train.max_steps = 15
    s = train(c)
    assert s["start_step"] == 10 and s["steps"] == 15
    assert capsys.readouterr().err == ""
    assert os.path.isfile(os.path.join(c.out_dir, "checkpoints", "15", CHECKSUMS))  # new saves write them


@pytest.mark.parametrize("damage", ["truncated data files", "no _METADATA"])
def test_resume_falls_back_past_a_damaged_latest_checkpoint(two_checkpoints, tmp_path, capsys, damage):
    c = _copy(two_checkpoints, tmp_path)
    if damage == "truncated data files":
        _truncate_data(c.out_dir, 10)
        c.train.max_steps = 15  # trains on and writes step 10 again
    else:
        os.remove(os.path.join(c.out_dir, "checkpoints", "10", "state", "_METADATA"))
        c.train.max_steps = 5
    s = train(c)
    assert s["start_step"] == 5 and s["steps"] == c.train.max_steps
    assert existing_steps(c.out_dir) == ([10, 15] if c.train.max_steps == 15 else [5])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err  # one line, no TensorStore dump
    assert "checkpoint 10 in" in err and "does not restore" in err and "resuming from checkpoint 5" in err
    assert os.path.isdir(os.path.join(c.out_dir, "damaged-checkpoints", "10", "state"))  # kept, not deleted


def test_sampling_falls_back_too_and_lists_the_steps_there_are(two_checkpoints, tmp_path, capsys):
    from jaxgpt.cli.sample import main
    c = _copy(two_checkpoints, tmp_path)
    _truncate_data(c.out_dir, 10)
    _, _, _, meta = load_model(c.out_dir)
    assert meta["step"] == 5
    assert "checkpoint 10 in" in capsys.readouterr().err
    assert main([f"--out_dir={c.out_dir}", "--step=7", "--max_new_tokens=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint 7" in err and "its steps are [5, 10]" in err


def test_no_checkpoint_that_restores_is_one_line_and_deletes_nothing(two_checkpoints, tmp_path):
    c = _copy(two_checkpoints, tmp_path)
    for step in (5, 10):
        _truncate_data(c.out_dir, step)
    with pytest.raises(CheckpointError) as e:
        train(c)
    message = str(e.value)
    assert "\n" not in message and "step 10:" in message and "step 5:" in message and len(message) < 800
    assert existing_steps(c.out_dir) == [5, 10]


def test_resume_refuses_a_tokenizer_with_the_same_size_but_other_characters(two_checkpoints, tmp_path):
    c = _copy(two_checkpoints, tmp_path)
    text = open(two_checkpoints.data.path).read()
    assert "w" in text and "X" not in text
    (tmp_path / "other.txt").write_text(text.replace("w", "X"))  # same vocab size, ids shift
    c.data.path = str(tmp_path / "other.txt")
    c.train.max_steps = 15
    with pytest.raises(CheckpointError, match=r"tokenizer is not the checkpoint's: char vocabularies differ: the "
                                              r"same vocab size \(\d+\) but other characters "
                                              r"\('w' only before; 'X' only now\)"):
        train(c)


@pytest.mark.parametrize("key, now, saved_is, now_is", [("optimizer", "muon", "'adamw'", "'muon'"),
                                                       ("grad_clip", 0.0, "1.0 (clipping on)", "0.0 (clipping off)")])
def test_resume_with_another_optimizer_names_the_setting_and_how_to_continue(two_checkpoints, tmp_path, key, now,
                                                                             saved_is, now_is):
    # orbax's words were "tree structures do not match: opt_state[1]... start again with --config.overwrite=True"
    c = _copy(two_checkpoints, tmp_path)
    c.train.max_steps, c.train[key] = 15, now
    with pytest.raises(CheckpointError) as e:
        train(c)
    back = {"optimizer": "adamw", "grad_clip": "1.0"}[key]
    assert str(e.value) == (
        f"checkpoint 10's optimizer state does not fit this config's optimizer: train.{key} was {saved_is} when it "
        f"was saved and is {now_is} now. To continue the run, put it back (--config.train.{key}={back}); to train "
        "with the new setting, start a new run (another --config.out_dir, or --config.overwrite=True)")


def test_resume_with_other_optimizer_values_of_the_same_layout_goes_on(two_checkpoints, tmp_path):
    c = _copy(two_checkpoints, tmp_path, grad_clip=0.5, lr=1e-3, beta2=0.95)  # clipping stays on
    c.train.max_steps = 11
    assert train(c)["start_step"] == 10


def test_tokenizer_comparison_and_checkpoints_without_a_fingerprint():
    a, b = CharTokenizer("abc"), CharTokenizer("abd")
    assert tokenizer_fingerprint(a.to_dict()) == tokenizer_fingerprint(CharTokenizer("cba").to_dict())
    assert tokenizer_difference(a.to_dict(), a.to_dict()) is None
    assert "'c' only before; 'd' only now" in tokenizer_difference(a.to_dict(), b.to_dict())
    more = CharTokenizer("abcd").to_dict()
    assert "3 characters before, 4 now ('d' only now)" in tokenizer_difference(a.to_dict(), more)
    assert tokenizer_difference({"type": "gpt2", "bpe_dir": "/a"}, {"type": "gpt2", "bpe_dir": None}) is None
    assert "byte tokenizer now" in tokenizer_difference(a.to_dict(), {"type": "byte"})
    from jaxgpt.config import GPTConfig
    gcfg = GPTConfig(vocab_size=3, block_size=8, n_layer=1, n_head=1, n_embd=8)
    old_meta = {"tokenizer": a.to_dict(), "model": gcfg.to_dict()}  # saved before fingerprints existed
    _check_resume_meta(old_meta, gcfg, a)
    with pytest.raises(CheckpointError, match="'c' only before"):
        _check_resume_meta(old_meta, gcfg, b)


def test_bpe_tokenizers_that_differ_say_how():
    from jaxgpt.data import BPETokenizer
    texts = ["the king is dead long live the queen " * 20]
    a = BPETokenizer.train(texts, 280).to_dict()
    b = json.loads(a["tokenizer_json"])
    vocab = b["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    diff = tokenizer_difference(a, {"type": "bpe", "tokenizer_json": json.dumps(b)})
    assert "the same bpe vocab size (280) but 2 tokens have other ids" in diff


def test_resume_at_or_past_max_steps_says_so(two_checkpoints, tmp_path, capsys):
    c = _copy(two_checkpoints, tmp_path)
    metrics = open(os.path.join(c.out_dir, "metrics.jsonl")).read()
    c.train.max_steps = 8
    s = train(c)
    assert s["nothing_to_do"] and s["steps"] == 10 and existing_steps(c.out_dir) == [5, 10]
    assert "the checkpoint is at step 10 and train.max_steps is 8: nothing to train" in capsys.readouterr().out
    assert open(os.path.join(c.out_dir, "metrics.jsonl")).read() == metrics
