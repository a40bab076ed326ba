import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxgpt import GPTConfig, init_params
from jaxgpt.checkpoint import CheckpointError, Checkpointer, abstract_like, existing_steps
from jaxgpt.loading import load_model
from jaxgpt.training import MeshRunner, PmapRunner, create_train_state, make_optimizer, make_train_step, train
from jaxgpt.training.config import default_config
from tests.helpers import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_resume_gives_the_same_losses_as_never_stopping(tmp_path):
    full = tiny_config(tmp_path / "a", max_steps=20, decay_steps=20, log_interval=1, checkpoint_interval=5)
    train(full)
    half = tiny_config(tmp_path / "b", max_steps=10, decay_steps=20, log_interval=1, checkpoint_interval=5)
    train(half)
    half.train.max_steps = 20
    half.init_from = "resume"
    s = train(half)
    assert s["start_step"] == 10
    a, b = _losses(full.out_dir), _losses(half.out_dir)
    assert sorted(a) == sorted(b) == list(range(1, 21))
    assert [a[k] for k in sorted(a)] == [b[k] for k in sorted(b)]


def test_fresh_start_over_checkpoints_is_refused_and_resume_needs_one(tmp_path):
    c = tiny_config(tmp_path, max_steps=5, checkpoint_interval=5, eval_interval=5)
    c.init_from = "resume"
    with pytest.raises(CheckpointError, match="no checkpoint"):
        train(c)
    c.init_from = "scratch"
    train(c)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(c)
    c.overwrite = True
    assert train(c)["steps"] == 5


def test_resume_with_a_different_model_shape_fails_clearly(tmp_path):
    c = tiny_config(tmp_path, max_steps=5, checkpoint_interval=5, eval_interval=5)
    train(c)
    c.init_from = "resume"
    c.train.max_steps = 10
    c.model.n_embd = 64
    with pytest.raises(CheckpointError, match="n_embd"):
        train(c)


def test_damaged_checkpoint_fails_clearly(tmp_path):
    c = tiny_config(tmp_path, max_steps=5, checkpoint_interval=5, eval_interval=5)
    train(c)
    state_dir = os.path.join(c.out_dir, "checkpoints", "5", "state")
    for root, _, files in os.walk(state_dir):
        for name in files:
            if name != "_METADATA":
                with open(os.path.join(root, name), "r+b") as f:
                    f.truncate(3)
    c.init_from = "resume"
    c.train.max_steps = 10
    with pytest.raises(CheckpointError):
        train(c)


def test_unwritable_out_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    c = tiny_config(tmp_path, max_steps=5)
    c.out_dir = str(blocker / "out")
    with pytest.raises(ValueError, match="not writable"):
        train(c)


def test_a_full_disk_is_told_apart_from_other_failures_whatever_raised_it():
    import errno

    from jaxgpt.checkpoint import _disk_full

    assert _disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert _disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    # TensorStore's: the OS's words in the text, the errno not kept; and an error raised from one
    tensorstore = ValueError("UNKNOWN: Error writing local file \"/x/d/1\": [OS error 28: No space left on device]")
    assert _disk_full(tensorstore)
    try:
        try:
            raise tensorstore
        except ValueError as e:
            raise RuntimeError("save failed") from e
    except RuntimeError as wrapped:
        assert _disk_full(wrapped)
    assert not _disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not _disk_full(ValueError("a model of another shape"))


def test_sample_loads_checkpoint_on_one_device(tmp_path, capsys):
    from jaxgpt.cli.sample import main
    c = tiny_config(tmp_path, max_steps=5, checkpoint_interval=5, eval_interval=5)
    train(c)
    config, params, tok, meta = load_model(c.out_dir)
    assert meta["step"] == 5 and config.n_embd == 32
    assert all(len(x.sharding.device_set) == 1 for x in jax.tree_util.tree_leaves(params))
    settings = tmp_path / "s.json"
    rc = main([f"--out_dir={c.out_dir}", "--prompt=KING:", "--num_samples=2", "--max_new_tokens=8",
               "--seed=3", f"--save_settings={settings}"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("---------------") == 2 and out.count("\nKING:") >= 2
    saved = json.loads(settings.read_text())
    assert saved["settings"]["seed"] == 3 and len(saved["samples"]) == 2
    # longer than block_size (16): continues in chunks from the most recent context
    assert main([f"--out_dir={c.out_dir}", "--prompt=KING:", "--num_samples=2", "--max_new_tokens=40",
                 f"--save_settings={settings}"]) == 0
    capsys.readouterr()
    assert all(len(s) == len("KING:") + 40 for s in json.loads(settings.read_text())["samples"])
    assert main([f"--out_dir={c.out_dir}", "--prompt=KING{", "--max_new_tokens=4"]) == 2  # unknown char
    assert "byte" in capsys.readouterr().err


def test_restore_on_other_device_counts():
    """Saved from pmap on 4 devices; restored on 1 device and on a 2-device mesh: same next loss."""
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32)
    t = default_config().train
    t.warmup_steps, t.max_steps = 2, 10
    opt = make_optimizer(t)
    r = np.random.default_rng(0)
    batches = [r.integers(0, 50, (8, 17)).astype(np.int32) for _ in range(4)]
    xy = [(b[:, :-1], b[:, 1:]) for b in batches]
    pm = PmapRunner(cfg, opt)
    state = pm.put_state(create_train_state(init_params(cfg, jax.random.key(0)), opt, jax.random.key(1)))
    for x, y in xy[:3]:
        state, _ = pm.step(state, x, y)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        ck = Checkpointer(d)
        ck.save(3, pm.get_state(state), {"step": 3})
        ck.wait()
        _, m_pmap = pm.step(state, *xy[3])
        expected = float(pm.to_host(m_pmap)["loss"])
        template = jax.eval_shape(lambda: create_train_state(init_params(cfg, jax.random.key(0)), opt,
                                                             jax.random.key(1)))
        one, _ = ck.restore(abstract_like(template))
        _, m1 = jax.jit(make_train_step(cfg, opt))(one, *xy[3])
        mesh = MeshRunner(cfg, opt, devices=jax.devices()[:2])
        two, _ = ck.restore(abstract_like(template, mesh.replicated))
        assert len(two.params["wte"]["embedding"].sharding.device_set) == 2
        _, m2 = mesh.step(two, *xy[3])
        ck.close()
    assert int(one.step) == 3
    np.testing.assert_allclose(float(m1["loss"]), expected, atol=1e-5)
    np.testing.assert_allclose(float(mesh.to_host(m2)["loss"]), expected, atol=1e-5)


def _write_config(tmp_path, **train_kw):
    body = ", ".join(f"{k}={v!r}" for k, v in train_kw.items())
    path = tmp_path / "cfg.py"
    path.write_text(
        "import pathlib, sys\n"
        f"sys.path.insert(0, {REPO!r})\n"
        "from tests.helpers import tiny_config\n"
        f"def get_config():\n    return tiny_config(pathlib.Path({str(tmp_path)!r}), {body})\n")
    return path


def _resume_here(tmp_path, max_steps, **train_kw):
    """Resume _write_config(tmp_path, **train_kw)'s run in this process up to `max_steps`: the summary."""
    c = tiny_config(tmp_path, **{**train_kw, "max_steps": max_steps})
    c.init_from = "resume"
    return train(c)


def _run_until(cmd, out_dir, min_step, timeout=180):
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = os.path.join(out_dir, "metrics.jsonl")
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"training exited early:\n{proc.stdout.read()}")
            if os.path.exists(metrics) and _losses(out_dir) and max(_losses(out_dir)) >= min_step:
                return proc
            time.sleep(0.2)
        raise AssertionError("training did not reach the step in time")
    except BaseException:
        proc.kill()
        proc.wait()
        raise


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_resume_finishes(tmp_path):
    kw = dict(decay_steps=1000, log_interval=1, checkpoint_interval=100000, eval_interval=100000)
    cfg = _write_config(tmp_path, max_steps=100000, **kw)
    out = str(tmp_path / "out")
    proc = _run_until([sys.executable, "train.py", f"--config={cfg}"], out, 3)
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, log  # documented: stopped, not done
    steps = existing_steps(out)
    assert len(steps) == 1 and steps[0] >= 3 and steps[0] == max(_losses(out))
    assert (f"stopped by SIGTERM at step {steps[0]}, checkpoint saved; resume with --config.init_from=resume"
            in log) and "done" not in log and "Traceback" not in log
    assert _resume_here(tmp_path, steps[0] + 3, **kw)["start_step"] == steps[0]  # (here: no second start-up)
    assert max(_losses(out)) == steps[0] + 3


def _saves_in_flight(ckpt_dir):
    return [n for n in os.listdir(ckpt_dir) if ".orbax-checkpoint-tmp" in n] if os.path.isdir(ckpt_dir) else []


def _stop(proc):
    """SIGSTOP `proc` and wait until every one of its threads is stopped: nothing in it moves after this."""
    proc.send_signal(signal.SIGSTOP)
    tasks = f"/proc/{proc.pid}/task"
    while any(open(os.path.join(tasks, t, "stat")).read().rsplit(")", 1)[1].split()[0] not in "Tt"
              for t in os.listdir(tasks)):
        time.sleep(0.001)


@pytest.mark.slow
def test_sigkill_during_a_save_keeps_the_finished_checkpoints(tmp_path):
    kw = dict(decay_steps=1000, log_interval=1, checkpoint_interval=1, eval_interval=100000, keep_checkpoints=2)
    cfg = _write_config(tmp_path, max_steps=100000, **kw)
    out = str(tmp_path / "out")
    ckpt_dir = os.path.join(out, "checkpoints")
    proc = _run_until([sys.executable, "train.py", f"--config={cfg}"], out, 3)
    in_flight = None
    try:  # freeze the run whenever a save is under way; kill it if the save is still unfinished when frozen
        deadline = time.time() + 120
        while in_flight is None and time.time() < deadline:
            if _saves_in_flight(ckpt_dir):
                _stop(proc)
                unfinished = _saves_in_flight(ckpt_dir)
                if unfinished:
                    in_flight = int(unfinished[0].split(".")[0])
                    proc.send_signal(signal.SIGKILL)
                else:
                    proc.send_signal(signal.SIGCONT)
            time.sleep(0.002)
    finally:
        proc.kill()
        proc.wait()
    assert in_flight is not None, "no save was caught in flight"
    steps = existing_steps(out)
    assert steps and max(steps) < in_flight, (steps, in_flight)  # the cut save does not count; earlier ones do
    assert _resume_here(tmp_path, in_flight + 1, **kw)["start_step"] == max(steps)
    assert in_flight + 1 in existing_steps(out)  # the step whose save was cut is written again on the way
