"""The XLA flags of every JAX process the tests run: this one (tests/conftest.py) and the training
processes they start. No imports here: it is read before JAX is.

The tests' programs are tiny and many, so compile time is most of the suite's time and run time almost
none of it. Each flag trades run time for compile time (bench/README.md, "The test suite's time"):
- --xla_backend_optimization_level=0: no LLVM optimisation passes;
- --xla_cpu_use_fusion_emitters=false: XLA:CPU's older elemental emitters for fusions, which compile a
  one-op program in half the time of the MLIR fusion emitters;
- --xla_cpu_parallel_codegen_split_count=1: one LLVM module per program instead of several.
"""

COMPILE_FAST = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_parallel_codegen_split_count=1")


def with_devices(n: int) -> str:
    """XLA_FLAGS for a process with `n` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={n} {COMPILE_FAST}"

# compiler_options for a test that reads a compiled program (its HLO, memory or cost analysis): compiled
# with the emitters users' programs get, since the flags above change how XLA:CPU wraps fusions
AS_USERS_COMPILE = {"xla_cpu_use_fusion_emitters": True}
