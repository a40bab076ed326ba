"""jaxgpt-train: train a GPT from a config file, e.g. --config=configs/shakespeare_char_cpu.py --config.train.max_steps=100.

On several processes (hosts) every process runs this same command; see the README's "Several hosts".
"""

from __future__ import annotations

import sys

from absl import app
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "a configs/*.py file defining get_config(); override keys with --config.KEY=VALUE",
    lock_config=True)


def _run(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from jaxgpt import distributed
    from jaxgpt.checkpoint import CheckpointError
    from jaxgpt.config import default_config, validate_config
    from jaxgpt.training import TrainingDiverged, train

    config = _CONFIG.value if _CONFIG.value is not None else default_config()
    try:
        validate_config(config)  # mistakes in the config stop here, before any process connects
        # first of all JAX calls: connect to the other processes (if the config or the cluster says so)
        distributed.initialize(config)
    except (ValueError, RuntimeError) as e:
        print(f"jaxgpt-train: error: {e}", file=sys.stderr)
        sys.exit(2)
    import jax
    if jax.process_index() != 0:  # only process 0 prints: the others keep warnings and errors only
        from absl import logging
        logging.set_verbosity(logging.WARNING)
    # from here on a failing process exits at once, so that the others stop rather than wait for it
    with distributed.exit_on_failure():
        try:
            summary = train(config)
        except (ValueError, CheckpointError, TrainingDiverged, FileNotFoundError) as e:
            print(f"jaxgpt-train: error: {e}", file=sys.stderr)
            sys.exit(2)
        if jax.process_index() == 0:
            print(f"jaxgpt-train: done at step {summary['steps']}; best val loss {summary['best_val_loss']:.4f}; "
                  f"{summary['wall_time_s']:.1f}s; checkpoints in {summary['out_dir']}/checkpoints")


def main() -> None:
    app.run(_run)


if __name__ == "__main__":
    main()
