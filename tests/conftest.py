"""Test setup, before JAX is first imported: four fake CPU devices (for pmap and mesh tests) and a
persistent compilation cache shared by this session's tests and the training processes they start."""

import os
import tempfile

# --xla_backend_optimization_level=0: the tests' programs are tiny and many, so LLVM's optimisation passes
# cost more compile time than they save in run time (the whole suite: see bench/README.md, issue 14)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# many tests train the same tiny model; each train() builds new jitted functions, whose XLA programs are
# identical, so a per-session disk cache saves most of the compile time
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jaxgpt-test-xla-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
