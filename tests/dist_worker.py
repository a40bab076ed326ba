"""One process of a multi-process training run started by tests/test_distributed.py.

Run as `python tests/dist_worker.py --config=tests/dist_worker.py [--config.KEY=VALUE ...]`: this file is
both the launcher (it runs jaxgpt-train's main, exactly as a user would) and the config file, whose
get_config() reads the flattened config that the test wrote to $JAXGPT_TEST_CONFIG. Each process has
two fake CPU devices. With $JAXGPT_TEST_FAIL_AT=PROCESS:STEP that process raises inside the training
loop right before running that step, to test how the others are taken down.
"""

import json
import os

if __name__ == "__main__":  # before JAX is first imported: two fake CPU devices per process
    from xla_flags import with_devices  # tests/xla_flags.py (this script's folder is on sys.path)

    os.environ["XLA_FLAGS"] = with_devices(2)
    os.environ["JAX_PLATFORMS"] = "cpu"


def get_config():
    from jaxgpt.training.config import default_config

    c = default_config()
    with open(os.environ["JAXGPT_TEST_CONFIG"]) as f:
        for key, value in json.load(f).items():  # {"train.max_steps": 3, "out_dir": "...", ...}
            *sections, name = key.split(".")
            target = c
            for s in sections:
                target = target[s]
            target[name] = value
    return c


def _inject_failure(process_id: int, step: int) -> None:
    """Make process `process_id` raise when it is about to run training step `step` (1-based)."""
    from jaxgpt.training import parallel

    for cls in (parallel.PmapRunner, parallel.MeshRunner):
        original = cls.step
        calls = {"n": 0}

        def failing_step(self, state, x, y, _original=original, _calls=calls):
            import jax
            _calls["n"] += 1
            if jax.process_index() == process_id and _calls["n"] == step:
                raise RuntimeError(f"injected failure in process {process_id} at step {step}")
            return _original(self, state, x, y)

        cls.step = failing_step


if __name__ == "__main__":
    fail = os.environ.get("JAXGPT_TEST_FAIL_AT")
    if fail:
        pid, step = map(int, fail.split(":"))
        _inject_failure(pid, step)
    from jaxgpt.cli.train import main

    main()
