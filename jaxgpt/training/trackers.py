"""Where a run's metrics go besides the console (train.trackers): metrics.jsonl (always: jaxgpt-plot and resume
read it), TensorBoard (tensorboardX, the `tensorboard` extra) and Weights & Biases (the `wandb` extra), from
process 0 only (the loop makes no tracker elsewhere)."""

from __future__ import annotations

import importlib.util
import os
import secrets
import subprocess
from typing import Any, Optional

TRACKERS = ("jsonl", "tensorboard", "wandb")
WANDB_MODES = ("online", "offline", "disabled")
_WANDB_ID = "wandb_run_id"  # the run folder's file holding the W&B run's id: a resumed run continues it


def parse_trackers(spec: Any) -> tuple[str, ...]:
    """The trackers `spec` names (a comma-separated string or a list), jsonl always among them. "auto" (the
    default): jsonl, and tensorboard when tensorboardX is installed, as runs did before train.trackers.
    ValueError naming the key for an unknown one or one whose package is missing."""
    if spec == "auto":
        return ("jsonl",) + (("tensorboard",) if _installed("tensorboardX") else ())
    names = spec.split(",") if isinstance(spec, str) else spec
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"config.train.trackers: must be 'auto' or any of {TRACKERS}, comma-separated or a list, "
                         f"got {spec!r}")
    names = [n.strip() for n in names if n.strip()]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"config.train.trackers: unknown tracker(s) {unknown}; choose any of {TRACKERS}")
    for name, module in (("tensorboard", "tensorboardX"), ("wandb", "wandb")):
        if name in names and not _installed(module):
            raise ValueError(f"config.train.trackers: '{name}' needs the {module} package: pip install "
                             f"'jaxgpt[{name}]' (or leave '{name}' out)")
    return ("jsonl",) + tuple(dict.fromkeys(n for n in names if n != "jsonl"))


def check_config(t) -> None:
    """train.trackers and the wandb_* keys: ValueError naming the key for a value that cannot work."""
    parse_trackers(t.get("trackers", "auto"))
    mode = t.get("wandb_mode")
    if mode is not None and mode not in WANDB_MODES:
        raise ValueError(f"config.train.wandb_mode: must be one of {WANDB_MODES} (None: wandb's own, e.g. "
                         f"$WANDB_MODE), got {mode!r}")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoard:
    """TensorBoard events in out_dir/tb, a scalar per number of each record, at its step."""

    def __init__(self, out_dir: str):
        from tensorboardX import SummaryWriter
        self._writer = SummaryWriter(os.path.join(out_dir, "tb"))

    def write(self, record: dict) -> None:
        for k, v in _numbers(record).items():
            if k != "step":
                self._writer.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self._writer.close()


def git_commit(folder: Optional[str] = None) -> Optional[str]:
    """The commit checked out where jaxgpt's code is (None outside a git checkout)."""
    folder = folder or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", folder, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


class Wandb:
    """A Weights & Biases run whose files live in out_dir/wandb, its id kept in out_dir/wandb_run_id so
    that init_from=resume continues it. Every record's numbers are logged against the run's own "step"
    (a metric wandb's charts use as their x axis), so a resumed run may log steps again."""

    def __init__(self, out_dir: str, config: Optional[dict], resume: bool, *, project: Optional[str] = None,
                 name: Optional[str] = None, entity: Optional[str] = None, mode: Optional[str] = None):
        import wandb

        id_path = os.path.join(out_dir, _WANDB_ID)
        run_id = None
        if resume and os.path.isfile(id_path):
            with open(id_path) as f:
                run_id = f.read().strip() or None
        if run_id is None:
            run_id = secrets.token_hex(6)  # (W&B ids: letters and digits)
            tmp = f"{id_path}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(run_id + "\n")
            os.replace(tmp, id_path)
        self.run_id = run_id
        config = {**(config or {}), "git_commit": git_commit()}
        self.run = wandb.init(project=project or "jaxgpt", name=name, entity=entity, mode=mode, id=run_id,
                              resume="allow", dir=out_dir, config=config)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, record: dict) -> None:
        self.run.log(_numbers(record))

    def close(self) -> None:
        self.run.finish()


def make_trackers(names: tuple[str, ...], out_dir: str, config=None, resume: bool = False) -> list:
    """The trackers beyond jsonl (which MetricsLog writes itself) that `names` lists, for a run's process 0;
    `config` is the run's ConfigDict (train.wandb_* read from it, all of it logged)."""
    out = []
    if "tensorboard" in names:
        out.append(TensorBoard(out_dir))
    if "wandb" in names:
        t = config.train if config is not None else {}
        get = (lambda k: t.get(k)) if config is not None else (lambda k: None)
        out.append(Wandb(out_dir, None if config is None else config.to_dict(), resume,
                         project=get("wandb_project"), name=get("wandb_name"), entity=get("wandb_entity"),
                         mode=get("wandb_mode")))
    return out
