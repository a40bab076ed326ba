"""Test setup, before JAX is first imported: four fake CPU devices (for pmap and mesh tests) and a
persistent compilation cache shared by this session's tests and the training processes they start."""

import gc
import os
import shutil
import sys
import tempfile

import pytest

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


# With pytest-xdist (the README's `-n 2`) each test file runs whole on one worker (`--dist loadfile`): a
# file's tests share its module fixtures and the programs they compile, which `--dist load` built in both
# workers (user CPU 495 -> 480 s, tests' summed time 543 -> 518 s). The files go out heaviest first, so
# the last ones to run are short and neither worker waits long for the other at the end. In order of
# seconds per file in a whole run (2026-12-02, --durations=0); a file not listed runs after them, in
# collection order.
_HEAVY_FIRST = ("test_backends.py", "test_distributed.py", "test_training.py", "test_checkpoint.py",
                "test_lora.py", "test_recipe.py", "test_model_scan.py", "test_chunked_loss.py",
                "test_sampling.py", "test_aot.py", "test_extension.py", "test_data_shards.py", "test_cli_errors.py",
                "test_cache.py",
                "test_attention.py", "test_llama.py", "test_bench.py", "test_mesh2d.py", "test_model.py")


# The tests' own processes never write to the persistent cache (they still read it); the processes they
# start (training runs, the CLIs) write and read it as before. Added after workers crashed in
# executable.serialize() (put_executable_and_time) three times on 2026-12-04; those crashes, and the ones in
# backend_compile_and_load, turned out to be the memory-mapping limit that `pytest_runtest_teardown` below
# now keeps the workers from: this guard stays, as the runs that measured the fix had it.
@pytest.fixture(autouse=True)
def _no_cache_writes_in_test_processes():
    import jax

    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def _mappings() -> int:
    """How many memory mappings this process holds (Linux; 0 elsewhere). About 1 ms per 1,000."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


# Every program XLA:CPU compiles holds three or four memory mappings of its own (its code, constants and
# data) for as long as anything keeps it, and jit's caches keep every program that a module-level function
# compiled (one per shape and static argument) for the life of the process. Whole runs compile so many that
# a worker reached 64,063 mappings on 2026-12-04 against Linux's default limit of 65,530
# (vm.max_map_count), past which LLVM's next mapping fails inside XLA: the SIGSEGVs and SIGABRTs in
# backend_compile_and_load and in the persistent cache's serialize in that day's whole runs, in whichever
# test came next, never in a test run alone. So after the last test of each file (its module fixtures torn
# down) the jit caches are emptied and unreachable programs collected, and within a file the same happens
# when a count taken every 4 tests passes 32,000 (tests/test_engine.py alone reached 43,907 from 900).
# JAXGPT_TEST_MAPPINGS=1 prints the counts.
_MAPPINGS_CHECK_EVERY, _MAPPINGS_HIGH = 4, 32_000
_tests_since_check = 0


def _release_compiled_programs(why: str) -> None:
    import jax

    before = _mappings() if os.environ.get("JAXGPT_TEST_MAPPINGS") else 0
    jax.clear_caches()
    gc.collect()
    if before:
        sys.stderr.write(f"\n[mappings] {why}: {before} -> {_mappings()}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    global _tests_since_check
    yield
    if nextitem is None or nextitem.path != item.path:
        _tests_since_check = 0
        _release_compiled_programs(f"after {item.path.name}")
        return
    _tests_since_check += 1
    if _tests_since_check >= _MAPPINGS_CHECK_EVERY:
        _tests_since_check = 0
        if _mappings() > _MAPPINGS_HIGH:
            _release_compiled_programs(f"within {item.path.name}")


def pytest_configure(config):
    # -n without --dist (or with --dist load, which looks the same here): one file per worker at a time
    if getattr(config.option, "dist", None) == "load":
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False  # (xdist would order the files by their number of tests)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: the rest keep their order)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)  # (after every other plugin's unconfigure)
def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # The controller has this worker's results (its session has finished) and ignores how it ends.
        # Left to run on, the worker frees everything its tests built, with JAX's callback on each of
        # Python's collections: over 5 s after a whole run, which the controller waited out and then
        # interrupted (a "KeyboardInterrupt in _xla_gc_callback" warning). The OS frees it all at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
