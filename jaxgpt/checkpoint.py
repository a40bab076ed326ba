"""Orbax checkpoints: the train state plus a JSON `meta` item (config, tokenizer, sampler state, ...), and
the SHA-256 of every file they wrote (checked at restore). Loading a model from them for sampling, serving
or init_from is jaxgpt.loading's."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import sys
import time
import warnings
from typing import Any, Callable, Optional, TypeVar

import jax
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from orbax.checkpoint.checkpoint_managers import AnyPreservationPolicy, BestN, LatestN

from jaxgpt.report import one_line

CHECKPOINT_SUBDIR = "checkpoints"
DAMAGED_SUBDIR = "damaged-checkpoints"
CHECKSUMS = "checksums.sha256"  # in each step folder, in sha256sum's format: `sha256sum -c` checks it too
_ITEMS = ("state", "meta")  # the step folder's items (orbax rewrites the files beside them, e.g. its metadata)
T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not fit the current model."""


class ChecksumMismatch(Exception):
    """A checkpoint file whose bytes are not those that were saved."""


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint folder that orbax cannot read back (damaged, truncated or half-written)."""

    def __init__(self, step: int, directory: str, error: BaseException):
        self.step = step
        self.reason = one_line(error, limit=160)
        super().__init__(f"checkpoint {step} in {directory} does not restore ({self.reason})")


def checkpoint_dir(out_dir: str) -> str:
    return os.path.abspath(os.path.join(os.path.expanduser(out_dir), CHECKPOINT_SUBDIR))


def existing_steps(out_dir: str) -> list[int]:
    """Steps of the finished checkpoints under out_dir (unfinished temporaries are not counted)."""
    d = checkpoint_dir(out_dir)
    if not os.path.isdir(d):
        return []
    return sorted(int(name) for name in os.listdir(d) if name.isdigit() and os.path.isdir(os.path.join(d, name)))


class Checkpointer:
    """Keeps the last `keep` checkpoints plus the one with the best val loss; saves are asynchronous."""

    def __init__(self, out_dir: str, keep: int = 2, read_only: bool = False):
        self.directory = checkpoint_dir(out_dir)
        policy = AnyPreservationPolicy([
            LatestN(n=keep),
            BestN(get_metric_fn=lambda m: -m["val_loss"], n=1, keep_checkpoints_without_metrics=False),
        ])
        # the checksums are written in orbax's background thread once every file is, before the rename that
        # publishes the step: the save stays asynchronous and no finished step lacks them
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy, create=not read_only, enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_checksums))
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        self._saving: Optional[int] = None  # the step of the save in flight
        self._hashing: Optional[int] = None  # the step whose checksums the callback writes
        self.last_checksums: Optional[tuple[int, float]] = None  # (bytes hashed, seconds) of the latest save
        self._out_of_space = False  # a save ran out of disk space (and was reported)
        _install_failure_filter()

    def save(self, step: int, state: Any, meta: dict, val_loss: Optional[float] = None) -> None:
        """Start saving `state` (unreplicated arrays) and `meta` (JSON) as checkpoint `step`.

        On several processes every process calls this with the same step (orbax saves collectively: each
        process writes the shards it holds, process 0 the metadata), and every leaf must be a global
        array spanning all processes (replicated or sharded, e.g. a runner's get_state).
        """
        _check_global(state)
        self.wait()  # (orbax's save waits for the previous one too: this tells whose failure it is)
        metrics = None if val_loss is None else {"val_loss": float(val_loss)}
        self._hashing = step  # (before save: a small save may finish before it returns)
        with self._reporting_full_disk(step):
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                            meta=ocp.args.JsonSave(meta)),
                              metrics=metrics, force=True)
        self._saving = step

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def restore_meta(self, step: Optional[int] = None) -> dict:
        step = self._step(step)
        try:
            self._verify(step, ("meta",))
            return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax raises many kinds for a damaged folder
            raise self._unreadable(step, e) from e

    def restore(self, abstract_state: Any, step: Optional[int] = None) -> tuple[Any, dict]:
        """Restore checkpoint `step` (default: latest) into the shapes and shardings of `abstract_state`."""
        step = self._step(step)
        try:
            self._verify(step, _ITEMS)
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        except Exception as e:  # a damaged folder, or (past the meta checks) a model of another shape
            raise self._unreadable(step, e) from e
        return out["state"], out["meta"]

    def restore_params(self, abstract_params: Any, step: Optional[int] = None) -> Any:
        """Only the parameters of checkpoint `step` (default: latest), e.g. for sampling on one device."""
        step = self._step(step)
        target = {"params": abstract_params}
        try:
            self._verify(step, ("state",))  # (the params share their files with the optimizer state)
            out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True)))
        except Exception as e:
            raise self._unreadable(step, e) from e
        return out["state"]["params"]

    def restore_newest(self, attempt: Callable[[int], T]) -> tuple[int, T, list]:
        """(step, attempt(step), skipped) for the newest step whose `attempt` does not hit an unreadable
        checkpoint; `skipped` lists the UnreadableCheckpoint of each newer step passed over.

        Other errors from `attempt` (a model that does not fit, say) stop the search: an older step
        would not fit either. Nothing is deleted; CheckpointError when no step restores.
        """
        skipped = []
        self.manager.reload()
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                return step, attempt(step), skipped
            except UnreadableCheckpoint as e:
                skipped.append(e)
        if not skipped:
            raise CheckpointError(f"no checkpoint found in {self.directory}")
        raise CheckpointError(f"no checkpoint in {self.directory} restores: " +
                              "; ".join(f"step {e.step}: {e.reason}" for e in skipped) +
                              ". The folders are left as they are; start again with --config.overwrite=True")

    def move_aside(self, step: int, out_dir: str) -> str:
        """Move an unreadable step's folder to out_dir/damaged-checkpoints/ (kept for inspection), so that
        training can write that step again; returns where it went. Call reload() afterwards."""
        dest_dir = os.path.join(os.path.expanduser(out_dir), DAMAGED_SUBDIR)
        os.makedirs(dest_dir, exist_ok=True)
        dest = os.path.join(dest_dir, str(step))
        if os.path.exists(dest):
            dest += time.strftime("-%Y%m%d-%H%M%S")
        os.rename(os.path.join(self.directory, str(step)), dest)
        return dest

    def reload(self) -> None:
        """Read the list of steps from disk again (after folders were moved)."""
        self.manager.reload()

    def _step(self, step: Optional[int]) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no checkpoint found in {self.directory}")
        return step

    def _write_checksums(self) -> None:
        """orbax's post-finalization callback: on process 0, in its background thread, once every process's
        files are written and before the step's folder is renamed into place."""
        step = self._hashing
        folder = os.path.join(self.directory, f"{step}{ocp.path.atomicity.TMP_DIR_SUFFIX}")
        if not os.path.isdir(folder):  # (a storage that orbax publishes in place)
            folder = os.path.join(self.directory, str(step))
        if step is not None and os.path.isdir(folder):
            t0 = time.perf_counter()
            self.last_checksums = (write_checksums(folder), time.perf_counter() - t0)

    def _verify(self, step: int, items: tuple) -> None:
        """ChecksumMismatch when a file of `items` differs from what the save wrote (a step saved before
        checksums existed has none: it restores unchecked)."""
        verify_checksums(os.path.join(self.directory, str(step)), items)

    def _unreadable(self, step: int, error: BaseException) -> UnreadableCheckpoint:
        _hide_closed_loop_callbacks()
        return UnreadableCheckpoint(step, self.directory, error)

    def wait(self) -> None:
        """Until the save in flight is on disk; a full disk raises CheckpointError in one line."""
        with self._reporting_full_disk(self._saving):
            self.manager.wait_until_finished()
        if self._saving is not None:  # a save finished: a full disk's aftermath, if any, is over
            _FAILURE_FILTER.failed = False
        self._saving = None

    def close(self) -> None:
        reported = self._out_of_space  # (a full disk already reported may surface again here: said once)
        try:
            self.wait()
        except CheckpointError:
            if not reported:
                raise
        finally:
            try:
                self.manager.close()
            except Exception:
                if not self._out_of_space:  # after a save the disk had no room for, closing fails alike
                    raise

    @contextlib.contextmanager
    def _reporting_full_disk(self, step: Optional[int]):
        """A save that ran out of disk space as one CheckpointError saying what to do, and orbax's reports
        of it (hundreds of lines of tracebacks from its threads) silenced."""
        try:
            yield
        except Exception as e:
            if not _disk_full(e):
                raise
            _FAILURE_FILTER.failed = self._out_of_space = True
            _hide_closed_loop_callbacks()
            warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
            self._saving = None
            which = "a checkpoint" if step is None else f"checkpoint {step}"
            raise CheckpointError(
                f"no space left on the device for {which} in {self.directory}; the earlier checkpoints are "
                "whole: free some space (or lower train.keep_checkpoints), then continue with "
                "--config.init_from=resume") from None


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        h = hashlib.sha256()
        for block in iter(lambda: f.read(1 << 22), b""):  # (hashlib drops the GIL while it hashes a block)
            h.update(block)
        return h.hexdigest()


def _item_files(step_dir: str) -> list[str]:
    """The files of a step folder's items, as sorted paths relative to it."""
    found = []
    for item in _ITEMS:
        for root, _, files in os.walk(os.path.join(step_dir, item)):
            found += [os.path.relpath(os.path.join(root, name), step_dir) for name in files]
    return sorted(found)


def write_checksums(step_dir: str) -> int:
    """Write step_dir/checksums.sha256: the SHA-256 of each file of its items; returns the bytes hashed."""
    lines, total = [], 0
    for rel in _item_files(step_dir):
        path = os.path.join(step_dir, rel)
        lines.append(f"{_sha256(path)}  {rel}\n")
        total += os.path.getsize(path)
    with open(os.path.join(step_dir, CHECKSUMS), "w", encoding="utf-8") as f:
        f.writelines(lines)
    return total


def verify_checksums(step_dir: str, items: tuple = _ITEMS) -> Optional[int]:
    """Check the files of `items` in step_dir against its checksums.sha256: the bytes checked, None when it
    has no checksums (saved before they were written); ChecksumMismatch names the first file that differs
    or is gone."""
    path = os.path.join(step_dir, CHECKSUMS)
    if not os.path.isfile(path):
        return None
    total = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        listed = f.read().splitlines()
    for n, line in enumerate(listed, 1):
        digest, _, rel = line.partition("  ")
        if len(digest) != 64 or not rel or os.path.isabs(rel) or ".." in rel.split("/"):
            raise ChecksumMismatch(f"{CHECKSUMS} line {n} is not '<sha256>  <file in the step folder>'")
        if rel.split("/")[0] not in items:
            continue
        file = os.path.join(step_dir, rel)
        if not os.path.isfile(file):
            raise ChecksumMismatch(f"{rel} is gone (listed in {CHECKSUMS})")
        if _sha256(file) != digest:
            raise ChecksumMismatch(f"{rel} does not match its SHA-256 in {CHECKSUMS}: changed since it was saved")
        total += os.path.getsize(file)
    return total


def _disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error it arose from, says the disk (or the quota) is full; TensorStore's
    errors carry the OS's words, not an errno."""
    seen = []
    while error is not None and not any(error is e for e in seen):
        seen.append(error)
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(words in str(error) for words in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))):
            return True
        error = error.__cause__ or error.__context__
    return False


class _FailureFilter(logging.Filter):
    """Drops orbax's log reports of a write the disk had no room for (each a traceback of tens of lines,
    from its background threads), and once a save failed so, all of its error reports that follow (the
    writes still queued behind it): the run reports the failure itself, in one line. Also asyncio's
    "exception was never retrieved" reports of such writes: TensorStore's writes still in flight when
    orbax gives up are never awaited, and asyncio reports each failed one when it is collected, often
    after the run's own line. With --verbosity=0 (absl's INFO) every record passes."""

    failed = False

    def filter(self, record: logging.LogRecord) -> bool:
        from_asyncio = record.name == "asyncio"
        if not (from_asyncio or "orbax" in record.pathname) or absl_logging.get_verbosity() >= absl_logging.INFO:
            return True
        if self.failed and record.levelno >= logging.ERROR:
            if not from_asyncio or "exception was never retrieved" in record.getMessage():  # (not asyncio's others)
                return False
        error = record.exc_info[1] if record.exc_info else None
        return not ((error is not None and _disk_full(error)) or _disk_full(Exception(record.getMessage())))


_FAILURE_FILTER = _FailureFilter()


def _install_failure_filter() -> None:
    """Before any save: a write that fails reports from orbax's and TensorStore's threads at once, before
    the run hears of it."""
    for logger in (absl_logging.get_absl_logger(), logging.getLogger("asyncio")):
        if _FAILURE_FILTER not in logger.filters:
            logger.addFilter(_FAILURE_FILTER)
    _hide_closed_loop_callbacks()


def _check_global(state: Any) -> None:
    if jax.process_count() == 1:
        return
    local = [jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_leaves_with_path(state)
             if not isinstance(x, jax.Array) or x.is_fully_addressable]
    if local:
        raise CheckpointError(
            f"on {jax.process_count()} processes every saved leaf must be a global jax.Array spanning all of "
            f"them (replicated or sharded), but {local[:5]}{' ...' if len(local) > 5 else ''} "
            "are process-local; save runner.get_state(state)")


def _hide_closed_loop_callbacks() -> None:
    """After a failed restore or save, TensorStore completes the reads or writes still in flight and hands
    each result to the asyncio loop that orbax already closed; every one prints a "RuntimeError: Event loop
    is closed" traceback through sys.unraisablehook. Drop exactly those (once installed, other reports pass)."""
    previous = sys.unraisablehook
    if getattr(previous, "_jaxgpt_filter", False):
        return

    def hook(report):
        e = report.exc_value
        if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
            return
        previous(report)

    hook._jaxgpt_filter = True
    sys.unraisablehook = hook


def abstract_like(tree: Any, sharding=None) -> Any:
    """ShapeDtypeStructs of `tree` placed with `sharding` (default: the first local device)."""
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def is_run_folder(path) -> bool:
    """Whether `path` is a jaxgpt training run's folder (it holds checkpoints/)."""
    return isinstance(path, str) and os.path.isdir(checkpoint_dir(os.path.expanduser(path)))


_MOVED = ("load_model", "load_base")


def __getattr__(name: str):
    """Loading a model moved to jaxgpt.loading (this module saves and restores); code that imports it from
    here keeps working, with a DeprecationWarning."""
    if name not in _MOVED:
        raise AttributeError(f"module 'jaxgpt.checkpoint' has no attribute {name!r}")
    import importlib

    warnings.warn(f"jaxgpt.checkpoint.{name} moved to jaxgpt.loading.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("jaxgpt.loading"), name)
