"""Test setup, before JAX is first imported: four fake CPU devices (for pmap and mesh tests) and a
persistent compilation cache shared by this session's tests and the training processes they start."""

import gc
import os
import shutil
import tempfile

from tests.xla_flags import with_devices

# flags that make compiling the tests' many tiny programs cheaper (tests/xla_flags.py)
os.environ.setdefault("XLA_FLAGS", with_devices(4))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# many tests train the same tiny model; each train() builds new jitted functions, whose XLA programs are
# identical, so a per-session disk cache saves most of the compile time. The process that makes the folder
# (pytest's, or with -n its controller: the workers inherit the variable) removes it at the end.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxgpt-test-xla-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

# Tracing and lowering JAX programs allocate many short-lived objects, and every collection also runs
# JAX's own garbage-collection callback: collect less often, and never rescan what exists once the tests
# are collected (modules, fixtures' code). -19% on tests/test_sampling.py + test_cache.py, serially.
gc.set_threshold(50_000, 50, 100)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
