"""jaxgpt-aot: compile the train step and generate program for a TPU or NVIDIA target, on a machine without one.

    jaxgpt-aot --config=configs/gpt2_124m.py --target=tpu:v5e:2x4 [--slices=2] [--json=out.json] \\
        [--config.train.parallel=mesh --config.train.fsdp=True --config.model.remat=block ...]

Prints the per-device memory (arguments, outputs, temporaries, peak against the device's memory), the
flops per device beside the 6N + 12LTD formula, the collectives in the compiled HLO and the compile time.
Exit status: 0 everything fits, 2 a usage error or a program that does not fit (one line naming the
peak and the limit). Needs the `aot` extra: pip install -e ".[aot]".
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from absl import app, flags, logging

from jaxgpt.cli import train as train_cli  # its --config flag and config loading, shared

flags.DEFINE_string("target", None, "tpu:GEN:TOPOLOGY (tpu:v5e:2x4, tpu:v4:2x2x1, tpu:v5p:2x2x1, tpu:v6e:2x2) "
                    "or gpu:KIND:COUNT (gpu:h100:8, gpu:h200:8)")
flags.DEFINE_integer("slices", 1, "TPU slices (multislice over DCN), or GPU hosts of COUNT GPUs each")
flags.DEFINE_string("json", None, "also write the figures to this JSON file")
flags.DEFINE_integer("vocab_size", None, "the vocabulary size (needed for data.tokenizer=char, whose vocabulary "
                     "comes from the corpus; overrides the tokenizer's size otherwise)")
flags.DEFINE_list("programs", ["train", "generate"], "which programs to compile: train, generate, engine (the "
                  "dense-slot engine's), paged (every program of the paged engine, jaxgpt.engine.PagedEngine)")
flags.DEFINE_integer("engine_slots", None, "engine: slots (default 8); the report says how many fit; paged: "
                     "requests at once (default 32)")
flags.DEFINE_integer("engine_page_size", None, "paged: positions a page (default 16)")
flags.DEFINE_integer("engine_token_budget", None, "paged: tokens a step (default the engine's, 512)")
flags.DEFINE_bool("engine_largest_only", None, "paged: compile only the step of the most tokens (not every "
                  "program: a large model's compiles take minutes each)")
flags.DEFINE_integer("engine_max_len", None, "engine: positions per slot (default the context)")
flags.DEFINE_integer("engine_chunk", None, "engine: prefill chunk (default 256)")
flags.DEFINE_integer("engine_packed", None, "engine: also compile the packed prefill (Engine(packed_prefill=True)) "
                     "of this many tokens, its longest call (at most 1024 and the context); default not compiled")
flags.DEFINE_string("quantize", None, "engine: int8 to compile it with int8 weights (every dense kernel and the "
                    "head; the programs hold them instead of the float kernels), w8a8 with int8 activations too "
                    "(XLA's int8 x int8 -> int32 dot); default float weights")
flags.DEFINE_string("kv_dtype", None, "engine: the KV cache's dtype: int8 (a float32 scale per position and "
                    "head), bfloat16 or float32; default the model's compute dtype")
flags.DEFINE_integer("gen_batch", None, "generate: prompt rows (default one per device)")
flags.DEFINE_integer("gen_prompt_len", None, "generate: prompt length (default half the context)")
flags.DEFINE_integer("gen_new_tokens", None, "generate: new tokens (default the rest of the context)")
flags.DEFINE_enum("gen_weights", "float32", ["float32", "compute"], "generate: the weights it is given: float32 "
                  "(training's params; generate casts them to the compute dtype inside its program, a copy among "
                  "its temporaries) or compute (already in the compute dtype, as a model kept for serving: "
                  "nothing cast)")
flags.DEFINE_string("engine_mesh", None, "engine: a mesh to serve over, e.g. tensor=4 (the parameters placed by the "
                    "rules table, train.logical_axis_rules; attention split by heads over tensor and the cache by kv "
                    "head, as Engine does for params on a mesh); default the weights and cache whole on each device")
flags.DEFINE_string("gen_mesh", None, "generate: a mesh to decode over, e.g. tensor=8 (the parameters placed by the "
                    "rules table, train.logical_axis_rules; the rows over its batch axes); default the rows over "
                    "every device, the parameters replicated")

FLAGS = flags.FLAGS
EXIT_ERROR = 2

# Lines the TPU and CUDA runtimes print to stderr while they are probed for on a machine without them
_NOISE = ("cudart_stub.cc", "All log messages before absl::InitializeLog", "Logging before InitGoogle",
          "could not determine TPU", "TPU_WORKER_HOSTNAMES", "Source Location Trace", "libtpu_init_utils",
          "Failed to find host bounds", "GPU will not be used")


def _fail(message) -> None:
    from jaxgpt.report import one_line
    print(f"jaxgpt-aot: error: {one_line(str(message))}", file=sys.stderr, flush=True)
    sys.exit(EXIT_ERROR)


def _check_writable(path: str) -> None:
    """Fail now, in one line, if the --json file cannot be written (a folder, a missing or read-only folder)."""
    if os.path.isdir(path):
        _fail(f"--json={path!r} is a folder; give a file path, e.g. {os.path.join(path, 'aot.json')}")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):  # (appends nothing: an existing file is kept until the figures replace it)
            pass
    except OSError as e:
        _fail(f"cannot write --json={path!r}: {e.strerror or e}")
    if not existed:
        os.remove(path)


class _FilteredStderr:
    """File descriptor 2 through a pipe whose lines are passed on unless they are runtime start-up noise
    (native code writes there directly, past Python's sys.stderr)."""

    def __enter__(self):
        sys.stderr.flush()
        self._saved = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self._out = os.fdopen(os.dup(self._saved), "w", buffering=1)
        self._thread = threading.Thread(target=self._pump, args=(os.fdopen(read, "r", errors="replace"),),
                                        daemon=True)
        self._thread.start()
        self._stderr = sys.stderr
        sys.stderr = self._out  # Python's own writes skip the pipe (and keep a terminal's \r progress line)
        return self

    def _pump(self, pipe):
        skip_next = False
        for line in pipe:
            noise = any(n in line for n in _NOISE)
            if not noise and not (skip_next and line.startswith(("learning/", "="))):
                self._out.write(line)
            skip_next = noise

    def __exit__(self, *exc):
        sys.stderr = self._stderr
        sys.stderr.flush()
        os.dup2(self._saved, 2)  # closes the pipe's write end: the pump sees EOF
        self._thread.join(timeout=2)
        os.close(self._saved)
        self._out.flush()
        return False


class Progress:
    """A line that says what is compiling and for how long (updated each second on a terminal): the
    `progress` jaxgpt.aot's compilers take (`Progress(what)` around each compile)."""

    def __init__(self, what: str, stream=None):
        self.what, self.stream = what, stream or sys.stderr
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        self.t0 = time.perf_counter()
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        if tty:
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
        else:
            print(f"jaxgpt-aot: compiling {self.what} ...", file=self.stream, flush=True)
        return self

    def _tick(self):
        while not self._stop.wait(1.0):
            print(f"\rjaxgpt-aot: compiling {self.what} ... {time.perf_counter() - self.t0:.0f}s",
                  end="", file=self.stream, flush=True)

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            print("\r\033[K", end="", file=self.stream, flush=True)
        return False


def _run(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    from jaxgpt import aot
    from jaxgpt.training.config import import_user_modules

    if not FLAGS.target:
        _fail("--target is required, e.g. --target=tpu:v5e:2x4 or --target=gpu:h100:8")
    try:
        target = aot.parse_target(FLAGS.target, FLAGS.slices)
        programs = aot.check_programs(FLAGS.programs)
    except aot.AotError as e:
        _fail(e)
    # which programs take each engine flag: the dense engine's, the paged engine's, or both
    takers = {**{n: ("engine",) for n in ("engine_chunk", "engine_packed", "engine_mesh")},
              **{n: ("paged",) for n in ("engine_page_size", "engine_token_budget", "engine_largest_only")},
              **{n: ("engine", "paged") for n in ("quantize", "kv_dtype", "engine_slots", "engine_max_len")}}
    for name, wanted in takers.items():
        if FLAGS[name].value is not None and not set(wanted) & set(programs):
            _fail(f"--{name} applies to the engine's programs: add {' or '.join(wanted)} to --programs (e.g. "
                  f"--programs={wanted[0]})")
    try:
        from jaxgpt.quantize import check_kv_dtype, check_quantize
        check_quantize(FLAGS.quantize)
        check_kv_dtype(FLAGS.kv_dtype)
    except ValueError as e:
        _fail(f"--quantize/--kv_dtype: {e}")
    if FLAGS.json:
        _check_writable(FLAGS.json)  # before the compile, which may take minutes
    config = train_cli._load_config()
    try:
        import_user_modules(config)  # (the model is built before the config is validated for the target)
    except ValueError as e:
        _fail(e)
    aot.prepare_environment()
    gen = {"batch_size": FLAGS.gen_batch, "prompt_len": FLAGS.gen_prompt_len, "max_new_tokens": FLAGS.gen_new_tokens,
           "mesh": FLAGS.gen_mesh or "", "weights": FLAGS.gen_weights}
    result, error = None, None
    with _FilteredStderr():
        try:
            engine = {"slots": FLAGS.engine_slots, "max_len": FLAGS.engine_max_len, "chunk": FLAGS.engine_chunk,
                      "quantize": FLAGS.quantize, "kv_dtype": FLAGS.kv_dtype, "packed": FLAGS.engine_packed,
                      "mesh": FLAGS.engine_mesh, "page_size": FLAGS.engine_page_size,
                      "token_budget": FLAGS.engine_token_budget, "largest_only": FLAGS.engine_largest_only}
            result = aot.compile_for_target(config, target, FLAGS.vocab_size, tuple(FLAGS.programs),
                                            progress=Progress, generate_args=gen, engine_args=engine)
        except aot.DoesNotFit as e:
            result, error = e.result, e
        except (aot.AotError, ValueError) as e:
            _fail(e)
    if result is not None:
        print(aot.format_result(result), flush=True)
        if FLAGS.json:
            try:
                with open(FLAGS.json, "w") as f:
                    json.dump(result, f, indent=2)
                    f.write("\n")
            except OSError as e:
                _fail(f"cannot write --json={FLAGS.json!r}: {e.strerror or e}")
    if error is not None:
        _fail(error)


def main() -> None:
    train_cli.PROG = "jaxgpt-aot"  # the shared flag parsing's errors name this command
    app.run(_run, flags_parser=train_cli._parse_flags)


if __name__ == "__main__":
    main()
