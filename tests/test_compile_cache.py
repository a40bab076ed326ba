"""config.compile_cache: JAX's persistent compilation cache, on by default in a folder of jaxgpt's cache."""

import os
import subprocess
import sys

import pytest

from jaxgpt.compile_cache import cache_folder
from jaxgpt.training.config import default_config, validate_config


def test_the_setting_names_a_folder_or_none(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path))
    assert cache_folder("auto") == str(tmp_path / "xla")
    assert cache_folder("off") is None and cache_folder("") is None
    assert cache_folder(str(tmp_path / "mine")) == str(tmp_path / "mine")
    with pytest.raises(ValueError, match="compile_cache"):
        cache_folder(3)
    validate_config(default_config())  # "auto", the default, is valid


def _enable_and_compile(tmp_path, setting, **env):
    """In a fresh process: compile_cache.enable(setting), compile one program; the folder's files."""
    code = ("import jax, jax.numpy as jnp; from jaxgpt import compile_cache; "
            f"print(compile_cache.enable({setting!r})); print(jax.config.jax_compilation_cache_max_size); jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8)))"
            ".block_until_ready()")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    clean.update(JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **env)
    out = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, check=True)
    folder, max_size = out.stdout.split()
    return folder, int(max_size)


def test_a_folder_that_cannot_be_written_turns_the_cache_off_in_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    code = ("import jax, jax.numpy as jnp; from jaxgpt import compile_cache; "
            f"print(compile_cache.enable({str(tmp_path / 'a_file' / 'xla')!r})); "
            "jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    clean.update(JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    out = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None"]
    # (JAX warned at each read and write of every program: "Error reading persistent compilation cache")
    assert out.stderr.count("\n") == 1 and "UserWarning" not in out.stderr, out.stderr
    assert out.stderr.startswith("jaxgpt: warning: the compile cache is off: cannot write to ") and \
        "Not a directory" in out.stderr, out.stderr


def test_compiled_programs_land_in_the_folder_and_a_folder_given_to_jax_wins(tmp_path):
    folder = tmp_path / "xla"
    assert _enable_and_compile(tmp_path, str(folder))[0] == str(folder)
    assert any(name.startswith("jit_") for name in os.listdir(folder))
    theirs = tmp_path / "theirs"
    assert _enable_and_compile(tmp_path, str(folder), JAX_COMPILATION_CACHE_DIR=str(theirs))[0] == str(theirs)
    assert _enable_and_compile(tmp_path, "off")[0] == "None"


def test_the_test_suite_removes_the_compile_cache_folder_it_made(tmp_path):
    """tests/conftest.py makes a folder for the session's compile cache (the controller with -n, whose
    workers share it) and removes it at the end: each run used to leave one, and an empty one per worker."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "PYTEST_XDIST_WORKER",
                                                           "PYTEST_ADDOPTS")}
    env["TMPDIR"] = str(tmp_path)
    test = "tests/test_structure.py::test_the_checker_finds_a_cycle"  # (imports no JAX: a second or two)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider", test],
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("jaxgpt-test-xla-")]


def test_a_failure_still_fails_the_run_when_the_test_workers_end_early(tmp_path):
    """tests/conftest.py ends each pytest-xdist worker with os._exit once its session is over (freeing a
    whole run's programs took the worker 5-7 s): the controller must still report a failure and exit 1."""
    (tmp_path / "test_one.py").write_text("def test_fails():\n    assert 1 == 2\n\n\ndef test_passes():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "tests.conftest", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), str(tmp_path / "test_one.py")],
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "1 failed, 1 passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "FAILED" in r.stdout and "assert 1 == 2" in r.stdout


@pytest.mark.parametrize("cli", ["sample", "serve"])
def test_sample_and_serve_keep_their_programs_in_the_folder_given(tmp_path, cli):
    """jaxgpt-sample and jaxgpt-serve turn the cache on before their first compilation: --compile_cache=DIR
    fills DIR ('off' leaves $JAXGPT_CACHE without an xla folder). The command stops right after (a missing
    run folder), so the programs cached are its loading's; the engine's warm-up goes the same way."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    clean.update(JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAXGPT_CACHE=str(tmp_path))
    code = ("import sys, jax, jax.numpy as jnp; from jaxgpt.cli import {cli}; "
            "status = {cli}.main(sys.argv[1:]); "
            "print(status, jax.config.jax_compilation_cache_dir or 'none'); "
            "jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()").format(cli=cli)
    for setting, want in ((str(tmp_path / "mine"), str(tmp_path / "mine")), ("off", "none")):
        out = subprocess.run([sys.executable, "-c", code, f"--compile_cache={setting}",
                              f"--out_dir={tmp_path / 'no_run'}"], env=clean, capture_output=True, text=True)
        status, folder = out.stdout.split()
        assert status == "2" and folder == want, out.stdout + out.stderr
    assert os.listdir(tmp_path / "mine") and not (tmp_path / "xla").exists()
