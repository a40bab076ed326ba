"""Several processes, one program: JAX's multi-controller runtime (`jax.distributed`) set up from the config.

Every process runs the same program on its own devices; `jax.distributed.initialize` connects them
(process 0 hosts the coordinator) before any other JAX call, after which `jax.devices()` lists every
process's devices and collectives span them all. `initialize(config)` does this as the config's
`distributed` section says:

- `enabled=None` (auto): initialise when `coordinator_address`, `num_processes` or `process_id` is set
  (or `$JAX_COORDINATOR_ADDRESS`), or when JAX recognises a cluster with more than one process in the
  environment (Slurm, Open MPI, a Cloud TPU pod slice); otherwise run as one process.
- `enabled=True`: always call `jax.distributed.initialize`, the values left unset coming from JAX's
  own detection (this includes its Kubernetes and mpi4py methods, which auto mode never tries).
- `enabled=False`: never.

A process that fails must not leave the others waiting in a collective: `exit_on_failure()` ends it at
once, and JAX's coordination service then stops the others (after `heartbeat_timeout_s`) with an error
naming the process that stopped sending heartbeats.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import Iterator, Optional

from jaxgpt.checks import is_int

# JAX's own cluster detectors that auto mode consults; the Kubernetes one calls the cluster's API and
# mpi4py's is opt-in, so those run only with enabled=True (inside jax.distributed.initialize itself).
_AUTO_SKIP = ("K8sCluster", "Mpi4pyCluster")


def default_section():
    """The training config's `distributed` section with its defaults (None: auto)."""
    from ml_collections import config_dict

    placeholder = config_dict.placeholder
    d = config_dict.ConfigDict()
    d.enabled = placeholder(bool)             # None: auto (the keys below, or a detected cluster)
    d.coordinator_address = placeholder(str)  # "HOST:PORT" of process 0
    d.num_processes = placeholder(int)
    d.process_id = placeholder(int)
    d.initialization_timeout_s = 300          # how long processes wait for each other at start
    d.heartbeat_timeout_s = 100               # a silent process is dead after this; the rest stop
    return d


def check_config(dist) -> None:
    """Raise ValueError naming the key for an impossible `distributed` section."""
    def need(ok, key, msg):
        if not ok:
            raise ValueError(f"config.distributed.{key}: {msg}")

    need(dist.enabled in (None, True, False), "enabled", f"must be None (auto), True or False, got {dist.enabled!r}")
    addr = dist.coordinator_address
    need(addr is None or (isinstance(addr, str) and addr.rpartition(":")[0] != ""
                          and addr.rpartition(":")[2].isdigit()),
         "coordinator_address", f"must be 'HOST:PORT' (process 0's address), got {addr!r}")
    n, i = dist.num_processes, dist.process_id
    need(n is None or (is_int(n) and n >= 1), "num_processes", f"must be a positive integer, got {n!r}")
    need(i is None or (is_int(i) and i >= 0), "process_id", f"must be a non-negative integer, got {i!r}")
    need(n is None or i is None or i < n, "process_id", f"must be in [0, num_processes={n}), got {i}")
    for key in ("initialization_timeout_s", "heartbeat_timeout_s"):
        v = dist[key]
        need(is_int(v) and v >= 1, key, f"must be a positive number of seconds, got {v!r}")


def detect_cluster() -> Optional[tuple[str, int]]:
    """(name, process count) of the cluster environment JAX's auto-detection would use, or None."""
    try:
        from jax._src.clusters import ClusterEnv  # the detectors jax.distributed.initialize() runs
        envs = list(ClusterEnv._cluster_types)
    except Exception:  # a JAX without them: only explicit settings start a multi-process run
        return None
    for env in envs:
        if env.__name__ in _AUTO_SKIP or getattr(env, "opt_in_only_method", False):
            continue
        try:
            if env.is_env_present():
                return env.__name__, int(env.get_process_count())
        except Exception:
            continue
    return None


def wanted(dist) -> bool:
    """Whether `initialize` would start jax.distributed for this `distributed` section."""
    if dist.enabled is not None:
        return bool(dist.enabled)
    if dist.coordinator_address or dist.num_processes is not None or dist.process_id is not None:
        return True
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    found = detect_cluster()
    return found is not None and found[1] > 1


def _section(config):
    """The config's `distributed` section (the defaults for a config built without one)."""
    return config.distributed if "distributed" in config else default_section()


def initialize(config) -> bool:
    """Start jax.distributed as `config.distributed` says; True when this is a multi-process run.

    Call it before any other JAX call (`jax.devices()` included). Calling it again, or after
    jax.distributed was initialised some other way, does nothing.
    """
    import jax

    dist = _section(config)
    check_config(dist)
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    if not wanted(dist):
        return False
    try:
        jax.distributed.initialize(coordinator_address=dist.coordinator_address, num_processes=dist.num_processes,
                                   process_id=dist.process_id,
                                   initialization_timeout=dist.initialization_timeout_s,
                                   heartbeat_timeout_seconds=dist.heartbeat_timeout_s)
    except RuntimeError as e:
        raise RuntimeError(
            f"jax.distributed.initialize failed: {e}. It must run before any other JAX call: call "
            "jaxgpt.distributed.initialize(config) first thing (jaxgpt-train does)") from e
    except ValueError as e:  # JAX found no cluster to fill in the values left unset
        raise ValueError(f"config.distributed: {e} Set coordinator_address ('HOST:PORT' of process 0), "
                         "num_processes and process_id, or run under Slurm / Open MPI / a TPU pod slice") from e
    return jax.process_count() > 1


def is_multiprocess() -> bool:
    """True when jax.distributed runs with more than one process (never starts JAX's backends itself)."""
    import jax

    return jax.distributed.is_initialized() and jax.process_count() > 1


def barrier(name: str) -> None:
    """Wait until every process gets here (a tiny collective over all devices)."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


@contextlib.contextmanager
def exit_on_failure() -> Iterator[None]:
    """On several processes, end this process at once when the body raises.

    A normal exit would wait in jax.distributed's shutdown barrier for processes that are themselves
    waiting for this one in a collective: everybody would hang until a timeout. `os._exit` stops this
    process's heartbeats instead, so the coordination service stops the others with an error naming it
    (after `distributed.heartbeat_timeout_s`). On one process the exception propagates as usual.
    """
    try:
        yield
    except BaseException as e:
        if isinstance(e, SystemExit) and e.code in (None, 0):
            raise
        if not is_multiprocess():
            raise
        import jax

        code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
        if not isinstance(e, SystemExit):
            traceback.print_exc()
        print(f"jaxgpt: process {jax.process_index()} of {jax.process_count()} failed ({type(e).__name__}); "
              "exiting now so that the other processes stop too", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
