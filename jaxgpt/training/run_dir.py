"""The run folder (out_dir): its path, one run at a time in it, and overwrite=True without losing the old run.

- `resolve_out_dir` expands `~` and checks that the folder can be written.
- `RunLock` holds an exclusive `fcntl.flock` on `out_dir/.lock` while a run uses the folder; the OS
  drops it when the process ends however it ends, so a crash never leaves a stale lock behind.
- `set_aside` / `settle_overwrite`: a fresh start with overwrite=True first moves the old run's
  `checkpoints/` and `metrics.jsonl` into `out_dir/previous-run-<time>/`. Once the new run has written
  its first checkpoint they are deleted; if it ends before that (a bad data.path, Ctrl-C during
  compile, a crash) they are moved back, by the run itself or, after a kill, by the next run in that
  folder, so `--config.init_from=resume` continues the old run.
"""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import socket
import time
from typing import Optional

from jaxgpt.checkpoint import CHECKPOINT_SUBDIR, existing_steps
from jaxgpt.report import warn

LOCK_NAME = ".lock"
METRICS_NAME = "metrics.jsonl"
HELD_PREFIX = "previous-run-"


class OutDirInUse(ValueError):
    """Another training run holds the run folder's lock."""


def resolve_out_dir(out_dir: str) -> str:
    """The absolute run folder for config.out_dir (`~` expanded), created and checked to be writable."""
    if not isinstance(out_dir, str) or not out_dir.strip():
        raise ValueError(f"config.out_dir must name a folder, got {out_dir!r}; e.g. --config.out_dir=out")
    path = os.path.abspath(os.path.expanduser(out_dir))
    try:
        os.makedirs(path, exist_ok=True)
        # one probe per process: several processes may share the folder (one host, or a shared filesystem)
        probe = os.path.join(path, f".write_test-{socket.gethostname()}-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"out_dir {path!r} is not writable ({e.strerror}); choose another "
                         "--config.out_dir") from None
    return path


class RunLock:
    """Context manager: exclusive use of a run folder, or OutDirInUse naming the process that has it."""

    def __init__(self, out_dir: str, enabled: bool = True):
        self.path = os.path.join(out_dir, LOCK_NAME)
        self.out_dir = out_dir
        self.enabled = enabled
        self._fd: Optional[int] = None

    def __enter__(self) -> "RunLock":
        if not self.enabled:
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "pid not written yet"
            os.close(fd)
            raise OutDirInUse(f"out_dir {self.out_dir} is in use by another training run ({holder}, per "
                              f"{self.path}); wait for it to end or stop it, or choose another "
                              "--config.out_dir") from None
        except OSError as e:  # a filesystem without locks (ENOLCK): run, but say it is unguarded
            os.close(fd)
            warn(f"could not lock {self.path} ({e.strerror}); make sure no other run uses {self.out_dir}")
            return self
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # no stale pid for the next reader
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def held_runs(out_dir: str) -> list[str]:
    """Folders holding a previous run's checkpoints set aside by overwrite=True, newest first."""
    return sorted(glob.glob(os.path.join(out_dir, HELD_PREFIX + "*")), reverse=True)


def set_aside(out_dir: str) -> str:
    """Move checkpoints/ and metrics.jsonl into a new out_dir/previous-run-<time>/; returns that folder."""
    held = os.path.join(out_dir, f"{HELD_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    os.makedirs(held)
    for name in (CHECKPOINT_SUBDIR, METRICS_NAME):
        if os.path.exists(os.path.join(out_dir, name)):
            os.rename(os.path.join(out_dir, name), os.path.join(held, name))
    return held


def settle_overwrite(out_dir: str) -> Optional[str]:
    """Resolve checkpoints set aside by an overwrite=True start; returns what it did, or None.

    If out_dir/checkpoints holds a finished checkpoint, the new run has committed one and the held
    ones are deleted; otherwise the new run wrote none and the held ones are moved back into place
    (replacing its unfinished temporaries and its metrics.jsonl).
    """
    done = []
    for held in held_runs(out_dir):
        if existing_steps(out_dir):
            shutil.rmtree(held, ignore_errors=True)
            done.append(f"deleted the previous run's checkpoints ({held}): this run has written its own")
            continue
        ckpts, metrics = os.path.join(out_dir, CHECKPOINT_SUBDIR), os.path.join(out_dir, METRICS_NAME)
        if os.path.isdir(os.path.join(held, CHECKPOINT_SUBDIR)):
            shutil.rmtree(ckpts, ignore_errors=True)  # only unfinished saves: existing_steps found none
            os.rename(os.path.join(held, CHECKPOINT_SUBDIR), ckpts)
        if os.path.exists(os.path.join(held, METRICS_NAME)):
            os.replace(os.path.join(held, METRICS_NAME), metrics)
        elif os.path.exists(metrics):
            os.remove(metrics)  # the new run's lines would pass for the old run's history on resume
        try:
            os.rmdir(held)
        except OSError:
            pass  # something else was put there: leave it
        done.append(f"the previous run's checkpoints are back in {ckpts} (an overwrite=True start set them "
                    f"aside in {held} and ended before writing its first checkpoint)")
    return "; ".join(done) or None
