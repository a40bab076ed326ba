"""The run folder: its path, the run lock, overwrite without losing the old run, metrics.jsonl, stop signals."""

import importlib.util
import json
import os
import shutil
import signal

import pytest

from jaxgpt.checkpoint import existing_steps
from jaxgpt.training.config import validate_config
from jaxgpt.training import loop, run_dir, throughput, train
from jaxgpt.training.metrics import MetricsLog, read_records
from tests.helpers import tiny_config


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
    """A finished tiny run (checkpoint at step 5) that the tests copy and then try to damage."""
    c = tiny_config(tmp_path_factory.mktemp("old"), max_steps=5, checkpoint_interval=5, eval_interval=5)
    train(c)
    return c


def _copy(old_run, tmp_path):
    c = tiny_config(tmp_path, max_steps=5, checkpoint_interval=5, eval_interval=5)
    shutil.copytree(old_run.out_dir, c.out_dir)
    return c


def _snapshot(out_dir):
    """The old run as a user would check it: its checkpoint steps and its metrics file."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return existing_steps(out_dir), f.read()


def test_out_dir_empty_is_refused_and_tilde_is_expanded(tmp_path, monkeypatch):
    c = tiny_config(tmp_path)
    c.out_dir = ""
    with pytest.raises(ValueError, match="out_dir must name a folder"):
        validate_config(c)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert run_dir.resolve_out_dir("~/runs/x") == str(tmp_path / "home" / "runs" / "x")
    assert os.path.isdir(tmp_path / "home" / "runs" / "x") and not os.path.exists("~")


def test_a_second_run_on_the_same_out_dir_is_refused_naming_the_holder(tmp_path):
    c = tiny_config(tmp_path)
    os.makedirs(c.out_dir)
    (tmp_path / "out" / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    with run_dir.RunLock(c.out_dir):
        with pytest.raises(run_dir.OutDirInUse, match=f"in use by another training run \\(pid {os.getpid()} on"):
            train(c)
        with pytest.raises(run_dir.OutDirInUse, match=f"pid {os.getpid()}"):
            run_dir.RunLock(c.out_dir).__enter__()
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == '{"step": 1, "loss": 3.0}\n'  # untouched
    with run_dir.RunLock(c.out_dir):  # released on exit
        pass


@pytest.mark.parametrize("failure", ["bad data.path", "Ctrl-C while compiling"])
def test_overwrite_that_fails_early_leaves_the_old_checkpoints(old_run, tmp_path, monkeypatch, failure):
    c = _copy(old_run, tmp_path)
    before = _snapshot(c.out_dir)
    c.overwrite = True
    if failure == "bad data.path":
        c.data.path = str(tmp_path / "typo.txt")
        error = FileNotFoundError
    else:
        def interrupted(*a, **k):
            raise KeyboardInterrupt
        monkeypatch.setattr(loop, "make_runner", interrupted)
        error = KeyboardInterrupt
    with pytest.raises(error):
        train(c)
    assert _snapshot(c.out_dir) == before
    assert not run_dir.held_runs(c.out_dir)


def test_after_a_kill_during_an_overwrite_start_resume_finds_the_old_checkpoints(old_run, tmp_path, capsys):
    c = _copy(old_run, tmp_path)
    before = _snapshot(c.out_dir)
    run_dir.set_aside(c.out_dir)  # what an overwrite=True start does first; then SIGKILL
    os.makedirs(os.path.join(c.out_dir, "checkpoints", "5.orbax-checkpoint-tmp"))  # its save, unfinished
    c.init_from = "resume"
    s = train(c)  # max_steps 5: the checkpoint is there already
    assert s["nothing_to_do"] and s["steps"] == 5
    assert _snapshot(c.out_dir) == before and not run_dir.held_runs(c.out_dir)
    out = capsys.readouterr().out
    assert "the previous run's checkpoints are back" in out
    assert "checkpoint is at step 5 and train.max_steps is 5: nothing to train" in out


def test_stop_signals_and_overwrite(old_run, tmp_path, monkeypatch, capsys):
    """A stop before an overwrite=True run's first checkpoint saves nothing and puts the old run back;
    its first checkpoint deletes the old one; a SIGTERM later saves and says how to resume."""
    c = _copy(old_run, tmp_path)
    before = _snapshot(c.out_dir)
    stop_at = {"step": 1, "signal": signal.SIGINT}

    def stop(self, step):
        if step == stop_at["step"]:
            self.signal = stop_at["signal"]
        return self.signal is not None

    monkeypatch.setattr(loop._Preemption, "stop", stop)
    monkeypatch.setattr(throughput, "peak_flops",
                        lambda *a, **kw: (None, "device kind 'Some GPU' is not in jaxgpt's table"))
    c.overwrite = True
    s = train(c)
    assert s["stopped_by"] == "SIGINT" and s["signal"] == signal.SIGINT and s["saved_step"] is None
    assert _snapshot(c.out_dir) == before and not run_dir.held_runs(c.out_dir)
    captured = capsys.readouterr()
    assert ("stopped by SIGINT at step 1, before this overwrite=True run's first checkpoint: nothing saved"
            in captured.out)
    assert "MFU unknown" in captured.out and "the previous run's checkpoints are back" in captured.err

    c.train.max_steps, stop_at["step"] = 10, None  # no signal: the first checkpoint (step 5) replaces the old run
    train(c)
    assert existing_steps(c.out_dir) == [5, 10] and not run_dir.held_runs(c.out_dir)
    records = read_records(os.path.join(c.out_dir, "metrics.jsonl"))
    assert records[0]["step"] == 5 and all(r.get("mfu", None) is None for r in records)  # no guessed MFU
    assert "deleted the previous run's checkpoints" in capsys.readouterr().out

    c.init_from, c.train.max_steps = "resume", 20
    stop_at.update(step=12, signal=signal.SIGTERM)
    s = train(c)
    assert s["signal"] == signal.SIGTERM and s["saved_step"] == 12 and 12 in existing_steps(c.out_dir)
    out = capsys.readouterr().out
    assert "stopped by SIGTERM at step 12, checkpoint saved; resume with --config.init_from=resume" in out


def test_a_torn_metrics_line_is_dropped_and_truncation_is_atomic(tmp_path, monkeypatch, capsys):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 4.0 - s}) for s in (1, 2, 3, 4)] + ['{"step": 5, "lo']
    path.write_text("\n".join(lines))  # a crash cut the last line short

    def crash(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        MetricsLog(str(tmp_path), truncate_after_step=3)
    assert path.read_text() == "\n".join(lines)  # written aside first: the original is whole
    monkeypatch.undo()
    for leftover in tmp_path.glob("metrics.jsonl.tmp-*"):
        leftover.unlink()
    capsys.readouterr()
    MetricsLog(str(tmp_path), truncate_after_step=3).close()
    assert [r["step"] for r in read_records(str(path))] == [1, 2, 3]
    assert "line 5 is not a JSON metrics record (cut off, as by a crash mid-write)" in capsys.readouterr().err
    # nothing left aside; with the tensorboard extra installed, MetricsLog writes TensorBoard events to tb/
    tensorboard = importlib.util.find_spec("tensorboardX") is not None
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"] + (["tb"] if tensorboard else [])


def test_plot_skips_bad_lines_naming_them(tmp_path, capsys):
    from jaxgpt.cli import plot
    lines = ['{"step": 1, "loss": 3.0}', "not json", '{"step": 2, "val_loss": 2.5}', '{"st']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert plot.read_metrics(str(tmp_path)) == ([(1, 3.0)], [(2, 2.5)])
    err = capsys.readouterr().err
    assert "line 2 is not a JSON metrics record" in err and "line 4" in err
