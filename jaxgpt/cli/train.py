"""jaxgpt-train: train a GPT from a config file, e.g. --config=configs/shakespeare_char_cpu.py --config.train.max_steps=100.

On several processes (hosts) every process runs this same command; see docs/multihost.md.
Libraries' INFO logs (orbax, JAX) are off unless --verbosity=0 (absl's flag) asks for them.
Exit status: 0 done, 2 a usage or config error, 128 + the signal's number when stopped by one
(143 for SIGTERM, 130 for SIGINT).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

from jaxgpt.cli import cpu_unless_accelerated

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "a configs/*.py file defining get_config(); override keys with --config.KEY=VALUE",
    lock_config=True)

EXIT_ERROR = 2
PROG = "jaxgpt-train"  # the name error lines start with (jaxgpt-aot shares this flag parsing)


def _fail(message) -> None:
    from jaxgpt.report import one_line
    print(f"{PROG}: error: {one_line(str(message))}", file=sys.stderr, flush=True)
    sys.exit(EXIT_ERROR)


def _config_path(argv) -> str | None:
    """The file named by the last --config=PATH (or --config PATH), without a ':ARG' suffix."""
    path = None
    for i, a in enumerate(argv):
        if a.startswith(("--config=", "-config=")):
            path = a.split("=", 1)[1]
        elif a in ("--config", "-config") and i + 1 < len(argv):
            path = argv[i + 1]
    return None if path is None else path.split(":", 1)[0]


def _unknown_overrides(argv) -> list[str]:
    """Messages for --config.KEY overrides that name no key of the training schema."""
    from ml_collections import config_dict

    from jaxgpt.training.config import default_config

    schema = default_config()
    bad = []
    for a in argv:
        m = re.match(r"^--?(?:no)?config\.([^=]+)", a)
        if not m:
            continue
        node, parts = schema, m.group(1).split(".")
        for i, key in enumerate(parts):
            if not isinstance(node, config_dict.ConfigDict) or key not in node:
                section = ".".join(parts[:i])
                where = f"under '{section}'" if section else "at the top level"
                valid = sorted(node.keys()) if isinstance(node, config_dict.ConfigDict) else []
                bad.append(f"unknown config key '{m.group(1)}' in {a.split('=', 1)[0]}; valid keys {where} "
                           f"are {valid}")
                break
            node = node[key]
    return bad


def _load_error(path, error: BaseException) -> str:
    """One line for a config file that cannot be loaded: what went wrong and where."""
    chain = []
    e = error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    syntax = next((x for x in chain if isinstance(x, SyntaxError)), None)
    if syntax is not None:
        return f"config file {path} has a syntax error at line {syntax.lineno}: {syntax.msg}"
    if path and not os.path.isfile(path):
        return f"config file {path} does not exist; pass a file like configs/shakespeare_char_cpu.py"
    root = chain[-1]
    if isinstance(root, AttributeError) and "get_config" in str(root):
        return f"config file {path} defines no get_config(); it must return an ml_collections ConfigDict"
    here = [f.lineno for f in traceback.extract_tb(root.__traceback__)
            if path and os.path.abspath(f.filename) == os.path.abspath(path)]
    where = f" at line {here[-1]}" if here else ""
    return f"config file {path} failed{where}: {type(root).__name__}: {root}"


def _parse_flags(argv):
    """absl's flag parsing, with config mistakes as one line and exit status 2 instead of a traceback."""
    bad = _unknown_overrides(argv)
    if bad:
        _fail(bad[0])
    # config_flags warns while loading (e.g. "get_config() returned None"); our own error says it in one line
    logging.set_verbosity(logging.ERROR)
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _fail(f"{e}; pass --helpfull to see the flags")
    except Exception as e:  # the config file itself: syntax errors, exceptions in get_config, ...
        _fail(_load_error(_config_path(argv), e))


def _load_config():
    """The parsed --config (default_config() when none is given), checked to be a ConfigDict."""
    from ml_collections import config_dict

    from jaxgpt.training.config import default_config

    if not flags.FLAGS["config"].present:
        return default_config()
    path = config_flags.get_config_filename(flags.FLAGS["config"])
    config = _CONFIG.value
    if isinstance(config, config_dict.ConfigDict):
        return config
    if type(config).__name__ == "_ErrorConfig":  # config_flags keeps a failed load (a missing file) for later
        try:
            config.keys()  # raises the loading error
        except Exception as e:
            _fail(_load_error(path, e))
    _fail(f"config file {path}: get_config() returned {type(config).__name__}, not an ml_collections "
          "ConfigDict; start from jaxgpt.config.default_config() and return it")


def _summary_line(summary: dict) -> str:
    """The last line of a run that finished: where it ended, and the best val loss if one was measured."""
    import math
    best = summary.get("best_val_loss", math.inf)
    best = f"best val loss {best:.4f}" if math.isfinite(best) else "no evaluation ran"
    return (f"jaxgpt-train: done at step {summary['steps']}; {best}; {summary['wall_time_s']:.1f}s; "
            f"checkpoints in {summary['out_dir']}/checkpoints")


class _Signalled(KeyboardInterrupt):
    """SIGTERM before the training loop takes signals over (or after it gives them back)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_at_once(signum, frame):
    raise _Signalled(signum)


def _stopped(e: KeyboardInterrupt) -> None:
    """The one line of a run stopped by a signal where no checkpoint could be saved first; exit 128 + N."""
    signum = getattr(e, "signum", signal.SIGINT)
    print(f"jaxgpt-train: stopped at once by {signal.Signals(signum).name}; checkpoints already "
          "written are whole (--config.init_from=resume continues from the latest)", file=sys.stderr, flush=True)
    sys.exit(128 + signum)


def _run(argv) -> None:
    # SIGTERM's default would end the process without a word while it starts (data, weights, restore);
    # the training loop handles signals itself, saving a checkpoint first
    previous = signal.signal(signal.SIGTERM, _stop_at_once)
    try:
        _run_command(argv)
    except KeyboardInterrupt as e:
        _stopped(e)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_command(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # quiet unless asked: orbax logs ~100 INFO lines a run
        logging.set_verbosity(logging.WARNING)
    config = _load_config()
    from jaxgpt import distributed
    from jaxgpt.checkpoint import CheckpointError
    from jaxgpt.training.config import validate_config
    from jaxgpt.backends.cpu import inline_cpu_dispatch
    from jaxgpt.training import TrainingDiverged, train

    inline_cpu_dispatch()  # before any computation: see its docstring
    try:
        validate_config(config)  # mistakes in the config stop here, before any process connects
        if distributed.wanted(distributed._section(config)):  # several processes: SIGTERM is JAX's preemption notice
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # first of all JAX calls: connect to the other processes (if the config or the cluster says so)
        distributed.initialize(config)
    except (ValueError, RuntimeError) as e:
        _fail(e)
    import jax
    if jax.process_index() != 0:  # only process 0 prints: the others keep warnings and errors only
        logging.set_verbosity(logging.WARNING)
    # from here on a failing process exits at once, so that the others stop rather than wait for it
    with distributed.exit_on_failure():
        try:
            summary = train(config)
        except (ValueError, CheckpointError, TrainingDiverged, OSError) as e:
            _fail(e)
        except KeyboardInterrupt as e:  # a signal outside the loop, or a second signal inside it
            _stopped(e)
    if jax.process_index() == 0 and not summary.get("nothing_to_do") and "signal" not in summary:
        print(_summary_line(summary), flush=True)
    if "signal" in summary:  # stopped by SIGTERM/SIGINT (the loop said where): not a finished run
        sys.exit(128 + summary["signal"])  # (outside exit_on_failure: every process stopped on purpose)


def main() -> None:
    cpu_unless_accelerated()  # before JAX picks its backends: no plugin tracebacks on a CPU-only machine
    app.run(_run, flags_parser=_parse_flags)


if __name__ == "__main__":
    main()
