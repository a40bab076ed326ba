"""XLA's compiled programs kept on disk between runs: JAX's persistent compilation cache, on by default.

A second run of the same config then skips the train step's compilation (seconds on a CPU, minutes for a
large model on an accelerator), as MaxText's `jax_cache_dir` does. bench/README.md ("The CPU speedrun")
has the figures, cold and warm.
"""

from __future__ import annotations

import os
from typing import Optional

MIN_COMPILE_SECONDS = 0.25  # programs that compile faster are not worth a file (JAX's own default: 1 s)


def cache_folder(setting: str) -> Optional[str]:
    """The folder a `compile_cache` setting names: "auto" -> $JAXGPT_CACHE/xla (default ~/.cache/jaxgpt/xla),
    "off" or "" -> None, anything else -> that folder."""
    if not isinstance(setting, str):
        raise ValueError(f"config.compile_cache must be 'auto', 'off' or a folder, got {setting!r}")
    if setting.strip().lower() in ("", "off", "none", "false"):
        return None
    if setting == "auto":
        from jaxgpt.data.corpora import default_cache_dir
        return str(default_cache_dir() / "xla")
    return os.path.abspath(os.path.expanduser(setting))


def enable(setting: str = "auto") -> Optional[str]:
    """Turn on JAX's persistent compilation cache in the folder `setting` names; returns the folder in use
    (None: off). A folder the user already gave JAX (JAX_COMPILATION_CACHE_DIR) wins. JAX reads the setting
    at the process's first compilation, so call this before that (a later call changes nothing)."""
    import jax

    given = jax.config.jax_compilation_cache_dir
    if given:
        return given
    folder = cache_folder(setting)
    if folder is None:
        return None
    why = _unwritable(folder)
    if why:  # (JAX would warn at every read and write of the cache instead, twice a program)
        from jaxgpt.report import warn
        warn(f"the compile cache is off: cannot write to {folder!r} ({why}); set compile_cache to a folder "
             "that can be written, or 'off'")
        return None
    jax.config.update("jax_compilation_cache_dir", folder)
    if jax.config.jax_persistent_cache_min_compile_time_secs == 1.0:  # JAX's default: not set by the user
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    # (no size bound: JAX's eviction fails on entries written without it, "...-atime" FileNotFoundError)
    return folder


def _unwritable(folder: str) -> Optional[str]:
    """Why a file cannot be written in `folder` (made if missing), or None if one can."""
    import tempfile

    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None
