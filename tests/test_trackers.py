"""Trackers (train.trackers, jaxgpt/training/trackers.py): names checked in one line; a W&B run, offline, holds
the config, the git commit, the losses and the task scores metrics.jsonl holds, and init_from=resume continues
the same W&B run."""

import glob
import json
import os
import struct
import subprocess
import time

import pytest

from jaxgpt.training import trackers
from tests.helpers import tiny_config


def _wandb_records(path):
    """The protobuf Records of a .wandb file: a 7-byte header (":W&B", magic, version), then LevelDB's log
    format (32 KiB blocks of records: crc32, length, type; FULL or FIRST..LAST pieces)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    block, pos, out, pieces = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(pieces)
            out.append(record)
            pieces = b""
    return out


def _read_run(path):
    """(run id, config {key: value}, history rows [{key: value}]) of one offline run's .wandb file."""
    run_id, config, rows = None, {}, []
    for r in _wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run_id = r.run.run_id
            config = {i.key: json.loads(i.value_json) for i in r.run.config.update}
        elif kind == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return run_id, config, rows


def _task(tmp_path, text):
    words = text.split()[:40]
    path = tmp_path / "pick.jsonl"
    with open(path, "w") as f:
        for i in range(4):
            f.write(json.dumps({"context": " ".join(words[i:i + 3]), "choices": [" " + w for w in words[i + 3:i + 6]],
                                "label": i % 3}) + "\n")
    return str(path)


def test_an_offline_wandb_run_holds_the_config_losses_and_scores_and_resumes(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="W&B is the wandb extra")
    from jaxgpt.training import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    c = tiny_config(tmp_path, max_steps=10, eval_interval=5, checkpoint_interval=5, trackers="jsonl,wandb",
                    wandb_name="tiny")
    c.train.eval_tasks = _task(tmp_path, open(c.data.path).read())
    train(c)
    c.init_from, c.train.max_steps = "resume", 15
    train(c)
    run_id = open(os.path.join(c.out_dir, "wandb_run_id")).read().strip()
    paths = sorted(glob.glob(os.path.join(c.out_dir, "wandb", "offline-run-*", "*.wandb")))
    assert len(paths) == 2  # the first run and its resumption, both inside the run folder
    runs = [_read_run(p) for p in paths]
    for _ in range(120):  # (wandb's service process may still be writing a file out after finish() returned)
        if all(r[0] is not None for r in runs):
            break
        time.sleep(0.5)
        runs = [_read_run(p) for p in paths]
    assert [r[0] for r in runs] == [run_id, run_id]  # one W&B run, continued
    config = runs[0][1]
    assert config["train"]["max_steps"] == 10 and config["train"]["trackers"] == "jsonl,wandb"
    assert runs[1][1]["train"]["max_steps"] == 15
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.dirname(__file__)),
                          capture_output=True, text=True).stdout.strip()
    assert config["git_commit"] == (head or None)
    metrics = [json.loads(line) for line in open(os.path.join(c.out_dir, "metrics.jsonl"))]
    rows = runs[0][2] + runs[1][2]
    for key in ("loss", "val_loss", "pick/acc", "pick/acc_norm"):
        want = [(m["step"], m[key]) for m in metrics if key in m]
        assert want and [(r["step"], r[key]) for r in rows if key in r] == want, key
    assert {r["step"] for r in runs[1][2]} == {15}  # the resumed run logged its own steps


def test_tracker_names_are_checked_in_one_line(monkeypatch):
    with pytest.raises(ValueError, match=r"config.train.trackers: unknown tracker\(s\) \['mlflow'\]"):
        trackers.parse_trackers("jsonl,mlflow")
    monkeypatch.setattr(trackers, "_installed", lambda module: module != "wandb")
    with pytest.raises(ValueError, match=r"'wandb' needs the wandb package: pip install 'jaxgpt\[wandb\]'"):
        trackers.parse_trackers("wandb")
    monkeypatch.setattr(trackers, "_installed", lambda module: module != "tensorboardX")
    assert trackers.parse_trackers("auto") == ("jsonl",)
    with pytest.raises(ValueError, match=r"'tensorboard' needs the tensorboardX package: pip install 'jaxgpt\[tensorboard\]'"):
        trackers.parse_trackers("tensorboard")
    monkeypatch.setattr(trackers, "_installed", lambda module: True)
    assert trackers.parse_trackers("auto") == ("jsonl", "tensorboard")
    assert trackers.parse_trackers("wandb,jsonl,wandb") == ("jsonl", "wandb")
    assert trackers.parse_trackers(["tensorboard"]) == ("jsonl", "tensorboard")


def test_a_bad_wandb_mode_is_refused_naming_the_key(tmp_path):
    from jaxgpt.training.config import validate_config

    c = tiny_config(tmp_path, wandb_mode="sometimes")
    with pytest.raises(ValueError, match="config.train.wandb_mode: must be one of"):
        validate_config(c)
