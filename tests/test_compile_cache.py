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


def test_compiled_programs_land_in_the_folder_and_a_folder_given_to_jax_wins(tmp_path):
    folder = tmp_path / "xla"
    assert _enable_and_compile(tmp_path, str(folder))[0] == str(folder)
    assert any(name.startswith("jit_") for name in os.listdir(folder))
    theirs = tmp_path / "theirs"
    assert _enable_and_compile(tmp_path, str(folder), JAX_COMPILATION_CACHE_DIR=str(theirs))[0] == str(theirs)
    assert _enable_and_compile(tmp_path, "off")[0] == "None"
