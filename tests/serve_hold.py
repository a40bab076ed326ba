"""Imported into a `jaxgpt-serve` subprocess by tests/test_serve.py (`--import=tests.serve_hold`): while the
file that JAXGPT_TEST_HOLD names exists, the engine takes no step. The test holds it to fill the queue and
drop streams without racing the engine (a tiny model generates a whole answer in milliseconds)."""

import os
import time

from jaxgpt.engine import Engine
from jaxgpt.engine.paged import PagedEngine


def _held(step):
    def held_step(self):
        path = os.environ.get("JAXGPT_TEST_HOLD")
        while path and os.path.exists(path):
            time.sleep(0.005)
        return step(self)
    return held_step


Engine.step = _held(Engine.step)
PagedEngine.step = _held(PagedEngine.step)
