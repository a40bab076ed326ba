"""The commands a user runs: mistakes end in one line (no traceback), stops exit with a documented status,
libraries' INFO logs stay off unless asked for, and a 5-step run of a shipped config just works."""

import math
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.xla_flags import COMPILE_FAST

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INFO_LINE = re.compile(r"^I\d{4} ", re.M)  # absl's INFO prefix (orbax and JAX log through absl)


def _fresh_cache(tmp_path) -> str:
    """A JAXGPT_CACHE of its own (data bins made afresh) that shares the session's built native kernels,
    so that each training process does not compile them again (~15 s)."""
    from jaxgpt.backends import native

    root = tmp_path / "cache"
    root.mkdir()
    os.makedirs(native._cache_dir(), exist_ok=True)
    os.symlink(native._cache_dir(), root / "kernels")
    return str(root)


def _run_all(cases, **kw):
    """Start every command at once (they are mostly imports), then collect (returncode, output) of each."""
    procs = [subprocess.Popen(c, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
             for c in cases]
    return [(p.wait(timeout=180), p.stdout.read()) for p in procs]


def test_train_config_mistakes_are_one_line(tmp_path):
    (tmp_path / "broken.py").write_text("def get_config(:\n")
    (tmp_path / "none.py").write_text("def get_config():\n    pass\n")
    train = [sys.executable, "train.py"]
    cases = {
        "unknown config key 'model.nonexistent'": ["--config=configs/shakespeare_char_cpu.py",
                                                   "--config.model.nonexistent=1"],
        "config file configs/nope.py does not exist": ["--config=configs/nope.py"],
        "has a syntax error at line 1": [f"--config={tmp_path / 'broken.py'}"],
        "get_config() returned NoneType, not an ml_collections ConfigDict": [f"--config={tmp_path / 'none.py'}"],
    }
    for (rc, out), expected in zip(_run_all([train + args for args in cases.values()]), cases):
        assert rc == 2 and out.count("\n") == 1 and out.startswith("jaxgpt-train: error: "), out
        assert expected in out, out


def _cli_run(monkeypatch, outcome):
    """jaxgpt-train's body with train() replaced by `outcome` (a summary, or an exception to raise)."""
    import jaxgpt.training
    from jaxgpt.cli import train as cli

    def fake_train(config):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(jaxgpt.training, "train", fake_train)
    with pytest.raises(SystemExit) as e:
        cli._run(["jaxgpt-train"])
        raise SystemExit(0)
    return e.value.code


def test_train_exits_quietly_with_a_documented_status(monkeypatch, capsys):
    from jaxgpt.training.loop import StopNow
    assert _cli_run(monkeypatch, StopNow(signal.SIGTERM)) == 143  # a second SIGTERM: no KeyboardInterrupt dump
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stopped at once by SIGTERM" in err and "Traceback" not in err
    assert _cli_run(monkeypatch, KeyboardInterrupt()) == 130
    capsys.readouterr()
    done = {"steps": 7, "out_dir": "/r", "wall_time_s": 1.0, "best_val_loss": math.inf}
    assert _cli_run(monkeypatch, dict(done, signal=signal.SIGTERM, stopped_by="SIGTERM")) == 143
    assert "done" not in capsys.readouterr().out  # the loop said where it stopped
    assert _cli_run(monkeypatch, done) == 0
    out = capsys.readouterr().out
    assert "done at step 7; no evaluation ran" in out and "inf" not in out
    assert _cli_run(monkeypatch, dict(done, nothing_to_do=True)) == 0
    assert capsys.readouterr().out == ""  # the loop said why there was nothing to do
    assert _cli_run(monkeypatch, OSError("could not download 'gpt2': Got: ConnectError\nAn error happened\n")) == 2
    assert capsys.readouterr().err == ("jaxgpt-train: error: could not download 'gpt2': Got: ConnectError An "
                                       "error happened\n")


def test_sample_mistakes_are_one_line_and_found_before_generating(tmp_path, monkeypatch, capsys):
    from jaxgpt.cli.sample import main
    (tmp_path / "binary").write_bytes(b"\x7fELF\x02\x01\x01\0\xd0\xff")
    missing_run = f"--out_dir={tmp_path / 'no-run'}"
    cases = {
        f"cannot read prompt file {tmp_path / 'nope.txt'}: No such file or directory": [
            f"--prompt_file={tmp_path / 'nope.txt'}"],
        "is not UTF-8 text (byte b'\\xd0' at position 8)": [f"--prompt_file={tmp_path / 'binary'}"],
        f"--save_settings: folder {tmp_path / 'nodir'} does not exist": [
            f"--save_settings={tmp_path / 'nodir' / 's.json'}"],  # before looking for the (missing) run
    }
    for expected, args in cases.items():
        assert main([missing_run, *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err
    for bad, expected in (("--temperature=-1", "--temperature must be a finite number >= 0"),
                          ("--top_k=-3", "--top_k must be >= 0 (0 = off)"),
                          ("--top_p=1.5", "--top_p must be a number in (0, 1]")):
        assert main([missing_run, bad]) == 2  # checked before the (missing) run is looked for
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and expected in err, err
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert main(["--init_from=gpt2", "--max_new_tokens=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not download 'gpt2'" in err


@pytest.mark.slow
def test_a_short_run_of_the_cpu_config_just_works_is_quiet_and_times_each_call(tmp_path):
    """The README's config for 8 steps, as a user runs it: one device, JAX_PLATFORMS unset (with the `aot`
    extra installed, JAX would otherwise probe the TPU and CUDA plugins and print their failed start-ups:
    jaxgpt.cli.cpu_unless_accelerated). Its output is a few known lines, no INFO logs. train.py dispatches
    CPU computations inline, so a call has finished when it returns: each logged tokens/s must time the
    steps it covers, not the gap between two reads (which an eval can shrink to nothing). Two steps per
    call, a log line per call, an eval forcing an early read at step 4."""
    import json

    out = tmp_path / "out"
    # one device, as a user's run has (the suite's four fake devices make pmap calls, which JAX dispatches
    # asynchronously whatever the setting)
    env = dict(os.environ, JAXGPT_CACHE=_fresh_cache(tmp_path), XLA_FLAGS=COMPILE_FAST)
    env.pop("JAX_PLATFORMS", None)
    run = [sys.executable, "train.py", "--config=configs/shakespeare_char_cpu.py", f"--config.out_dir={out}",
           "--config.train.max_steps=8", "--config.train.steps_per_call=2", "--config.train.log_interval=2",
           "--config.train.eval_interval=4", "--config.train.eval_steps=2"]
    r = subprocess.run(run, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "warmup_steps (100) > train.max_steps (8): the learning rate never reaches its peak" in r.stderr
    assert "jaxgpt-train: done at step 8; best val loss" in r.stdout
    assert "1 device(s)" in r.stdout and "; CPU dispatch inline" in r.stdout  # backends.cpu.inline_cpu_dispatch
    assert not INFO_LINE.search(r.stdout + r.stderr)  # orbax's and JAX's INFO logs are off by default
    # (a CPU without AVX512_BF16 or AMX adds the line that says this bf16 config computes in float32 there)
    kinds = ("jaxgpt: warning: train.warmup_steps", "jaxgpt: 0.81M parameters", "step ", "eval ", "jaxgpt-train: done")
    maybe = ("jaxgpt: model.dtype=bfloat16, but this CPU",
             "jaxgpt: MFU now against")  # the peak was timed while the test worker beside held the cores
    lines = (r.stdout + r.stderr).splitlines()
    # (nine lines always: the two notes, four step lines, two evals, done; each of `maybe` at most once; on
    # an AVX2 CPU both came, 11 lines, which a bound of 10 failed)
    assert all(line.startswith(kinds + maybe) for line in lines), lines
    assert len([line for line in lines if line.startswith(kinds)]) == 9, lines
    assert all(sum(line.startswith(m) for line in lines) <= 1 for m in maybe), lines
    assert [line.split()[0] for line in r.stdout.splitlines() if line.startswith(("step ", "eval "))] == \
        ["step", "step", "eval", "step", "step", "eval"]  # a line per call of two steps, an eval every 4
    logged = [rec for rec in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if "tokens_per_s" in rec]
    assert [rec["step"] for rec in logged] == [2, 4, 6, 8]
    for rec in logged:  # an honest MFU is at most 100%; a near-zero interval gives millions of percent
        assert 0 < rec["mfu"] <= 1, rec
    seconds = [rec["elapsed_s"] for rec in logged]
    assert seconds == sorted(seconds)
    resume = run + ["--config.init_from=resume"]  # at max_steps already: restores, says so, exits
    quiet, verbose = (_run_all([cmd], env=env)[0] for cmd in (resume, resume + ["--verbosity=0"]))  # (one lock)
    assert quiet[0] == verbose[0] == 0
    assert "nothing to train" in quiet[1] and not INFO_LINE.search(quiet[1])
    assert INFO_LINE.search(verbose[1])  # --verbosity=0 shows them


def _train_with(tmp_path, patch: str, *args):
    """jaxgpt-train on a tiny model in a new process, after running the Python statements `patch` there."""
    from tests.helpers import write_corpus

    corpus = write_corpus(tmp_path / "corpus.txt")
    argv = ["jaxgpt-train", "--config=configs/shakespeare_char_cpu.py", f"--config.out_dir={tmp_path / 'out'}",
            "--config.data.corpus=file", f"--config.data.path={corpus}", f"--config.data.cache_dir={tmp_path}",
            "--config.model.n_layer=1", "--config.model.n_head=2", "--config.model.n_embd=32",
            "--config.model.block_size=16", "--config.train.batch_size=4", "--config.train.warmup_steps=0",
            "--config.train.eval_steps=1", *args]
    code = f"{patch}\nimport sys\nsys.argv = {argv!r}\nfrom jaxgpt.cli.train import main\nmain()\n"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_a_sigterm_while_starting_ends_with_one_line_and_status_143(tmp_path):
    """Before the training loop takes signals over (here: while the data is prepared), SIGTERM's default
    ended the process with status 143 and nothing said."""
    patch = ("import os, signal, time\nimport jaxgpt.training.loop as loop\n"
             "def prepare(**kw):\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(60)\n"
             "loop.prepare_dataset = prepare")
    r = _train_with(tmp_path, patch)
    assert r.returncode == 143 and r.stdout == "", (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("jaxgpt-train: stopped at once by SIGTERM"), r.stderr


# A full disk at checkpoint 4, as orbax meets it: writing a metadata file (an OSError), or writing the arrays
# through TensorStore (its error carries the OS's words), where the writes still in flight when orbax gives
# up are never awaited and asyncio reports each as "Task exception was never retrieved" with its traceback.
FULL_DISK = {
    "metadata": ("import errno, os\nfrom etils import epath\nwrite_text = epath.Path.write_text\n"
                 "def full(self, *a, **kw):\n"
                 "    if '/checkpoints/4.' in str(self):\n"
                 "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))\n"
                 "    return write_text(self, *a, **kw)\n"
                 "epath.Path.write_text = full"),
    "arrays": ("import asyncio\nfrom orbax.checkpoint._src.serialization import serialization\n"
               "serialize = serialization.async_serialize_from_host\n"
               "async def full(value, spec, **kw):\n"
               "    if '/checkpoints/4.' not in str(spec):\n"
               "        return await serialize(value, spec, **kw)\n"
               "    async def write():\n"
               "        raise ValueError('RESOURCE_EXHAUSTED: Error writing local file: Failed to write 64460 bytes '\n"
               "                         'to file 7: No space left on device [os_error_code=28]')\n"
               "    asyncio.ensure_future(write())  # a write in flight that no one awaits\n"
               "    await asyncio.sleep(0)\n"
               "    await write()\n"
               "serialization.async_serialize_from_host = full"),
}


@pytest.mark.parametrize("where", sorted(FULL_DISK))
def test_a_full_disk_while_checkpointing_is_one_line_and_the_earlier_checkpoints_stay(tmp_path, where):
    """The disk full at checkpoint 4 (checkpoint 2 written): exit 2 with one line naming the folder and what
    to do, where orbax's threads printed about 350 lines of tracebacks first, and asyncio's reports of the
    writes no one awaited a traceback after it."""
    from jaxgpt.checkpoint import existing_steps

    r = _train_with(tmp_path, FULL_DISK[where], "--config.train.max_steps=6", "--config.train.checkpoint_interval=2",
                    "--config.train.eval_interval=2")
    folder = tmp_path / "out" / "checkpoints"
    assert "Traceback" not in r.stderr and "never retrieved" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert r.stderr.startswith(f"jaxgpt-train: error: no space left on the device for checkpoint 4 in {folder}; "
                               "the earlier checkpoints are whole"), r.stderr
    assert "--config.init_from=resume" in r.stderr
    assert existing_steps(str(tmp_path / "out")) == [2]


@pytest.mark.parametrize("environ, present, platform, want", [
    ({}, (), "linux", "cpu"),                                 # no accelerator: the CPU alone, plugins unprobed
    ({"JAX_PLATFORMS": "cuda"}, (), "linux", None),           # the user's choice stands
    ({}, ("/dev/nvidiactl",), "linux", None),                 # an NVIDIA GPU: JAX picks it
    ({}, ("/dev/accel0",), "linux", None),                    # a TPU (v4, v5e)
    ({}, ("/dev/vfio",), "linux", None),                      # a TPU (v5p, v6e)
    ({}, ("/dev/kfd",), "linux", None),                       # an AMD GPU (ROCm)
    ({}, (), "darwin", None),                                 # macOS (Metal): left to JAX
])
def test_the_cpu_is_chosen_only_where_no_accelerator_can_be(environ, present, platform, want, monkeypatch):
    import jax
    from jaxgpt import cli
    monkeypatch.setattr(cli, "_installed", lambda name: True)  # as with the aot extra
    updates = []
    monkeypatch.setattr(jax.config, "update", lambda k, v: updates.append((k, v)))
    assert cli.cpu_unless_accelerated(dict(environ), exists=lambda p: p in present, platform=platform) == want
    assert updates == ([("jax_platforms", "cpu")] if want else [])
    monkeypatch.setattr(cli, "_installed", lambda name: False)  # neither plugin: nothing to silence
    assert cli.cpu_unless_accelerated({}, exists=lambda p: False, platform="linux") is None


def test_serve_decode_steps_flag(capsys):
    """--decode_steps: N for every batch, or ROWS:N,... by the decode's rows (the engine's dict); anything
    else is a usage error that says what it expected."""
    from jaxgpt.cli import serve

    parse = serve.build_parser().parse_args
    assert parse([]).decode_steps == {1: 16, 2: 8, 4: 4} == serve.DEFAULT_DECODE_STEPS
    from jaxgpt.engine.paged import DEFAULT_TOKEN_BUDGET  # (serve keeps its own copy: --help imports no JAX)

    assert parse([]).token_budget == serve.DEFAULT_TOKEN_BUDGET == DEFAULT_TOKEN_BUDGET
    assert parse(["--decode_steps=4"]).decode_steps == 4
    assert parse(["--decode_steps=1:8,8:2"]).decode_steps == {1: 8, 8: 2}
    for bad in ("0", "2:4", "1:0", "x", "1:2,3", "1:4,0:2"):
        with pytest.raises(SystemExit):
            parse([f"--decode_steps={bad}"])
        assert "expected N or ROWS:N" in capsys.readouterr().err
