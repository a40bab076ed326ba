"""Ahead-of-time compilation for TPU and NVIDIA targets on a machine without them (`jaxgpt-aot`).

JAX compiles for devices that are described rather than attached: libtpu gives compile-only TPU devices
for any topology name (`jax.experimental.topologies.get_topology_desc`), and the CUDA plugin gives
compile-only GPUs from a `GpuTargetConfigProto` (written here from datasheet figures). The programs
compiled are the ones `jaxgpt-train` and `jaxgpt.generate` run: the same GPTConfig, optimizer, schedule, initial
state and runner step, lowered with ShapeDtypeStructs, so the memory and collectives reported are the vendor
compilers' own. Nothing here touches a device or reads a corpus.

In parts: `targets` (the hardware catalogue, --target parsing, compile-only devices, their environment),
`programs` (one lowering per program through the library's own, and `compile_for_target`), `report` (the
typed analysis and its text); the command's terminal output is jaxgpt/cli/aot.py's. This module
re-exports their public names.

Needs the `aot` extra (libtpu and the CUDA plugin, no CUDA libraries): `pip install -e ".[aot]"`.
"""

from jaxgpt.aot.programs import (PROGRAMS, TOKENIZER_VOCAB, check_programs, compile_engine,  # noqa: F401
                                 compile_for_target, compile_generate, compile_train_step, model_config,
                                 vocab_size_for)
from jaxgpt.aot.report import (COLLECTIVES, DoesNotFit, Memory, ProgramReport, analyze,  # noqa: F401
                               count_collectives, count_custom_calls, format_result)
from jaxgpt.aot.targets import (GIB, GPU_MEM_FRACTION, GPU_SPECS, TPU_ALIASES, TPU_CHIPS, AotError, Devices,  # noqa: F401
                                Target, gpu_mem_fraction, gpu_target_config, missing_extra, parse_target,
                                prepare_environment, target_devices, tpu_host_bounds)
