"""Command-line entry points (train, sample, prepare, plot, aot, serve, eval)."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Callable, Optional

# device files through which Linux exposes an accelerator: NVIDIA, AMD (ROCm), TPU (v2-v5e; v5p/v6e: vfio)
ACCELERATOR_DEVICES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/accel0", "/dev/vfio")
# the plugins the `aot` extra installs for compiling, whose start-ups fail loudly where their hardware is not
COMPILE_ONLY_PLUGINS = ("jax_plugins.xla_cuda12", "libtpu")


def cpu_unless_accelerated(environ=os.environ, exists: Callable[[str], bool] = os.path.exists,
                           platform: str = sys.platform) -> Optional[str]:
    """Make JAX use the CPU alone on a Linux machine with no accelerator that has the TPU or CUDA plugins
    installed (the `aot` extra): probing them there prints tracebacks ("cuDNN not found", libtpu's
    hostname errors) before every run. Returns "cpu" when it did so; None (nothing changed) where the user
    chose JAX_PLATFORMS, off Linux, where an accelerator's device file exists, or with neither plugin."""
    if environ.get("JAX_PLATFORMS") or platform != "linux" or any(exists(p) for p in ACCELERATOR_DEVICES):
        return None
    if not any(_installed(name) for name in COMPILE_ONLY_PLUGINS):
        return None
    import jax
    jax.config.update("jax_platforms", "cpu")
    return "cpu"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
