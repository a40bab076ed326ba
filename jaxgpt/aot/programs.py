"""The programs jaxgpt-aot compiles, one lowering each through the public lowering the library runs:
the train step (the loop's runner's `jitted_step`), generate (`sampling.lower_generate`) and the engine's
programs (`engine.lower_engine`); the config translated for the target, and `compile_for_target`, which
compiles the chosen programs and gathers their reports."""

from __future__ import annotations

import contextlib
import functools
import math
import re
import sys
import time
from typing import Any, Callable, Optional

from jaxgpt.aot.report import DoesNotFit, ProgramReport, _oom_figures, analyze, memory_dict
from jaxgpt.aot.targets import AotError, Devices, Target, _first_line, target_devices


# Vocabulary sizes of the tokenizers whose size is fixed (the others come from the corpus or the config)
TOKENIZER_VOCAB = {"gpt2": 50257, "byte": 256}


def vocab_size_for(config, vocab_size: Optional[int] = None) -> int:
    """The vocabulary size training would use, from the config alone (no corpus is read)."""
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise AotError(f"--vocab_size must be an integer >= 2, got {vocab_size!r}")
        return vocab_size
    tok = config.data.tokenizer
    if tok in TOKENIZER_VOCAB:
        return TOKENIZER_VOCAB[tok]
    if tok == "bpe":
        return int(config.data.vocab_size)
    raise AotError(f"data.tokenizer={tok!r} takes its vocabulary from the corpus, which jaxgpt-aot does not "
                   "read: pass --vocab_size=N (e.g. 65 for Tiny Shakespeare's characters)")


def model_config(config, vocab_size: int, platform: str):
    """(GPTConfig, Backend) that jaxgpt-train would build for `config` on the target's platform: the
    backend is the target's ('auto' resolves by the target, not by this process's CPU)."""
    from jaxgpt.backends import resolve
    from jaxgpt.training.config import model_config_from

    gcfg = model_config_from(config, vocab_size)
    if config.init_from not in ("scratch", "resume"):  # the architecture of GPT-2 weights, not model.*
        from jaxgpt.pretrained import GPT2_SIZES
        if config.init_from in GPT2_SIZES:
            layers, heads, width = GPT2_SIZES[config.init_from]
            # (mlp_hidden None: GPT-2's 4 * n_embd, as its config.json gives, not the model.* width's)
            gcfg = gcfg.replace(n_layer=layers, n_head=heads, n_embd=width, n_kv_head=None, vocab_size=50257,
                                bias=True, tie_embeddings=True, mlp="gelu", mlp_hidden=None)
    if gcfg.kernels == "cpu":
        raise AotError("model.kernels='cpu' is XLA:CPU's backend and does not compile for accelerators; use "
                       "'auto' (the target's), 'portable', 'tpu' or 'gpu'")
    if gcfg.kernels in ("tpu", "gpu") and gcfg.kernels != platform:
        # (off its platform a backend runs its Pallas kernels in the interpreter: a program, but not the one
        # the target would run)
        raise AotError(f"model.kernels={gcfg.kernels!r} is the {gcfg.kernels.upper()} backend and does not compile "
                       f"for a {platform.upper()} target; use 'auto' (the target's, here {platform!r}) or "
                       "'portable'")
    return gcfg, resolve(gcfg, platform=platform)


def _progress(progress, what: str):
    if callable(progress):
        return progress(what)
    if progress:
        print(f"jaxgpt-aot: compiling {what} ...", file=sys.stderr, flush=True)
    return contextlib.nullcontext()


def _compile(program: str, lowered_fn: Callable[[], Any], devs: Devices, progress) -> tuple[Any, float]:
    """Lower and compile; (executable, seconds). TPU's out-of-memory refusal becomes DoesNotFit, the
    compiler's other refusals AotError. `progress`: False, True (a line on stderr) or a callable taking what
    compiles and giving a context manager around the compile (jaxgpt-aot's ticking line, jaxgpt.cli.aot)."""
    import jax

    what = f"the {program} for {devs.target} ({len(devs.devices)} x {devs.device_kind})"
    t0 = time.perf_counter()
    with _progress(progress, what):
        try:
            compiled = lowered_fn().compile()
        except Exception as e:
            text = str(e)
            if "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text:
                peak, limit = _oom_figures(text)
                said = re.search(r"memory required for ([\w ]+?) \(", text)
                detail = f"the compiler's refusal: {said.group(1)} alone need that" if said else "the compiler's refusal"
                raise DoesNotFit(program, str(devs.target), peak, limit or devs.limit_bytes, detail) from None
            if "cannot be automatically partitioned" in text:
                raise AotError(f"the {program} for {devs.target}: its Pallas (Mosaic) kernels cannot be partitioned "
                               "by XLA; under jit over a mesh they must run inside shard_map (the backend's "
                               "attention), or compile with --config.model.kernels=portable") from None
            if "cuDNN" in text or "cudnn" in text:
                raise AotError(f"compiling the {program} for {devs.target} needs cuDNN ({_first_line(e)}); "
                               "model.attention='cudnn' compiles only where the cuDNN libraries are "
                               "installed") from None
            if isinstance(e, jax.errors.JaxRuntimeError):  # the compiler's refusal, in its own words
                raise AotError(f"the compiler refused the {program} for {devs.target}: {_first_line(e)}") from None
            raise
    return compiled, time.perf_counter() - t0


def compile_train_step(config, devs: Devices, vocab_size: int, progress: bool = True) -> ProgramReport:
    """Compile the step jaxgpt-train runs for `config` on the target's devices; its figures.

    The runner is the one the loop makes (jaxgpt.training.parallel.make_runner, over the target's
    devices), and the state the one it starts from (jaxgpt.training.step.init_train_state, as shapes).
    With train.parallel=mesh the step is MeshRunner's (jit over train.mesh's mesh, by default a 1-D mesh,
    FSDP when train.fsdp; the tpu backend's splash kernel runs in it per batch shard); with
    train.steps_per_call=K the K-step program that the loop calls. pmap has no compile-only path: a pmap
    config compiles PmapRunner's per-device step under shard_map over its devices (PmapRunner.jitted_step:
    replicated state, batch rows over the devices, gradients averaged with pmean).
    """
    import jax
    import numpy as np

    from jaxgpt.lora import LoraSpec
    from jaxgpt.model import flops_per_token, recompute_flops_per_token
    from jaxgpt.training.config import doc_masked, parallel_mode, validate_config
    from jaxgpt.training.parallel import PmapRunner, make_runner
    from jaxgpt.training.step import init_train_state, make_optimizer, make_schedule

    n = len(devs.devices)
    try:
        validate_config(config, n)
    except ValueError as e:
        raise AotError(f"{e} (on {n} devices of {devs.target})") from None
    t = config.train
    gcfg, backend = model_config(config, vocab_size, devs.target.platform)
    optimizer, schedule = make_optimizer(t, gcfg), make_schedule(t)
    loss_chunk = t.get("loss_chunk", 0)
    runner = make_runner(parallel_mode(t), gcfg, optimizer, t.grad_accum, schedule, fsdp=t.fsdp, backend=backend,
                         mesh=t.mesh, loss_chunk=loss_chunk, rules=t.get("logical_axis_rules", ""),
                         devices=devs.devices)
    state = runner.abstract_state(functools.partial(init_train_state, gcfg, optimizer, config.seed,
                                                    LoraSpec.from_config(t.lora)))
    k = t.steps_per_call
    rows, block = t.batch_size, gcfg.block_size
    if k > 1:
        batch = jax.ShapeDtypeStruct((k, rows, block), np.int32, sharding=runner.stack_sharding)
    else:
        batch = jax.ShapeDtypeStruct((rows, block), np.int32, sharding=runner.batch_sharding)
    segments = doc_masked(config)  # (the rows' document ids, laid out as the tokens)
    step = runner.jitted_step(state, many=k > 1, segments=segments)
    batches = (batch,) * (3 if segments else 2)
    compiled, seconds = _compile("train step", lambda: step.lower(state, *batches), devs, progress)
    # the formula's work plus what remat recomputes (the compiler counts the recomputed forward too)
    formula = (flops_per_token(gcfg, block) + recompute_flops_per_token(gcfg, block)) * rows * block * k / n
    pmap = isinstance(runner, PmapRunner)
    extra = {"parallel": "pmap (compiled as its per-device step under shard_map)" if pmap else runner.name,
             "batch_size": rows, "seq_len": block, "grad_accum": t.grad_accum, "steps_per_call": k,
             "per_device_batch": rows // _batch_split(runner), "remat": gcfg.remat, "scan_layers": gcfg.scan_layers,
             "dtype": gcfg.dtype, "kernels": backend.name, "attention": gcfg.attention, "loss_chunk": loss_chunk,
             "doc_mask": segments}
    return analyze("train step", compiled, seconds, devs, formula, extra, loop_trips=t.grad_accum * k,
                   layer_loop=gcfg.scan_layers, loss_loop=bool(loss_chunk))


def _batch_split(runner) -> int:
    """How many devices a runner splits the batch's rows over (its mesh's batch axes: not tensor)."""
    return math.prod(runner.mesh.shape[a] for a in runner.batch_axes)


def compile_generate(config, devs: Devices, vocab_size: int, batch_size: Optional[int] = None,
                     prompt_len: Optional[int] = None, max_new_tokens: Optional[int] = None,
                     progress: bool = True, mesh: str = "", weights: str = "float32") -> ProgramReport:
    """Compile `jaxgpt.generate`'s program (prefill + lax.scan decode) for the target; its figures (a ProgramReport).

    Without `mesh` the parameters are replicated on every device and the prompt rows split over the
    devices when their count divides (default: one row per device). With `mesh` (a train.mesh string such
    as "tensor=8") the parameters are placed by the rules table (train.logical_axis_rules; tensor splits
    heads, the MLP and the vocabulary) and the rows split over its batch axes when their count divides
    (default: one row per batch device). Defaults: a prompt of half the context, the rest new.
    `weights`: "float32" (training's params, cast to the compute dtype inside the program) or "compute"
    (given in the compute dtype, as a model kept for serving: the program casts nothing).
    """
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxgpt import sampling

    gcfg, backend = model_config(config, vocab_size, devs.target.platform)
    if weights not in ("float32", "compute"):
        raise AotError(f"generate's weights are 'float32' or 'compute', got {weights!r}")
    params = None
    if weights == "compute":
        import jax

        from jaxgpt.backends.base import cast_floats
        from jaxgpt.model import abstract_params
        params = jax.eval_shape(lambda p: cast_floats(p, gcfg.compute_dtype), abstract_params(gcfg))
    if mesh:
        return _compile_generate_on_mesh(config, gcfg, backend, devs, mesh, batch_size, prompt_len, max_new_tokens,
                                         progress, params)
    n = len(devs.devices)
    b, p, new = _generate_sizes(gcfg, n, batch_size, prompt_len, max_new_tokens)
    mesh = Mesh(np.array(devs.devices), ("data",))
    replicated = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P("data")) if b % n == 0 else replicated

    def lower():
        return sampling.lower_generate(gcfg, b, p, new, backend=backend, sharding=replicated, row_sharding=rows,
                                       params=params)

    compiled, seconds = _compile("generate program", lower, devs, progress)
    extra = {"batch_size": b, "prompt_len": p, "max_new_tokens": new, "dtype": gcfg.dtype, "kernels": backend.name,
             "attention": gcfg.attention, "weights": weights}
    return analyze("generate program", compiled, seconds, devs, None, extra)


def _compile_generate_on_mesh(config, gcfg, backend, devs: Devices, mesh: str, batch_size, prompt_len, new,
                              progress, params=None) -> ProgramReport:
    """compile_generate over `mesh` (a train.mesh string), the weights placed by the rules table."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxgpt import sampling
    from jaxgpt.sharding import batch_axes, rules, tree_shardings
    from jaxgpt.training.mesh import build_mesh

    try:
        table = rules(config.train.get("logical_axis_rules", ""))
        grid = build_mesh(mesh, devs.devices)
    except ValueError as e:
        raise AotError(f"--gen_mesh: {e}") from None
    rows_over = batch_axes(grid.axis_names, table)
    n_rows = math.prod(grid.shape[a] for a in rows_over)
    b, p, new = _generate_sizes(gcfg, n_rows, batch_size, prompt_len, new)
    replicated = NamedSharding(grid, P())
    rows = NamedSharding(grid, P(rows_over)) if rows_over and b % n_rows == 0 else replicated
    cfg = gcfg.replace(remat="none")
    # as Decoder does for params on a mesh: attention split by heads over tensor, and the cache by kv head
    # (split_cache's default: wherever tensor > 1)
    heads = grid if dict(grid.shape).get("tensor", 1) > 1 else None

    def lower():
        return sampling.lower_generate(gcfg, b, p, new, backend=backend, sharding=replicated, row_sharding=rows,
                                       weight_shardings=lambda w: tree_shardings(w, cfg, grid, table), mesh=heads,
                                       params=params)

    compiled, seconds = _compile("generate program", lower, devs, progress)
    extra = {"batch_size": b, "prompt_len": p, "max_new_tokens": new, "dtype": gcfg.dtype, "kernels": backend.name,
             "attention": gcfg.attention, "mesh": ", ".join(f"{a}={s}" for a, s in grid.shape.items()),
             "heads_split": heads is not None, "weights": "float32" if params is None else "compute"}
    return analyze("generate program", compiled, seconds, devs, None, extra)


def _generate_sizes(gcfg, n_rows: int, batch_size, prompt_len, new) -> tuple[int, int, int]:
    """(rows, prompt length, new tokens) of a generate program, by default a row per `n_rows` device, a
    prompt of half the context and the rest new; AotError for sizes the context does not hold."""
    b = n_rows if batch_size is None else batch_size
    p = max(1, gcfg.block_size // 2) if prompt_len is None else prompt_len
    new = gcfg.block_size - p if new is None else new
    if b < 1 or p < 1 or new < 1 or p + new > gcfg.block_size:
        raise AotError(f"generate needs batch >= 1, prompt >= 1, new tokens >= 1 and prompt + new <= block_size "
                       f"({gcfg.block_size}); got {b}, {p}, {new}")
    return b, p, new


def _chip_bytes(tree) -> int:
    """What one device holds of placed abstract arrays."""
    import jax

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _engine_placement(config, gcfg, devs: Devices, mesh: str, packed: Optional[int]) -> tuple:
    """(the mesh or None, the weights' shardings by the rules table or None, the replicated sharding) of the
    engine's programs: `mesh` a train.mesh string ("tensor=4"), "" for one engine per device."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    grid, weight_shardings = None, None
    if mesh:
        from jaxgpt.sharding import rules, tree_shardings
        from jaxgpt.training.mesh import build_mesh

        if packed is not None:
            raise AotError("the engine: the packed prefill (--engine_packed) is not run on a mesh "
                           "(Engine(packed_prefill=True) packs only on one device); drop --engine_packed or --engine_mesh")
        try:
            table = rules(config.train.get("logical_axis_rules", ""))
            grid = build_mesh(mesh, devs.devices)
        except ValueError as e:
            raise AotError(f"--engine_mesh: {e}") from None
        cfg = gcfg.replace(remat="none")
        weight_shardings = lambda w: tree_shardings(w, cfg, grid, table)  # noqa: E731
    return grid, weight_shardings, NamedSharding(grid or Mesh(np.array(devs.devices), ("data",)), P())


def compile_engine(config, devs: Devices, vocab_size: int, slots: int = 8, max_len: Optional[int] = None,
                   chunk: int = 256, progress: bool = True, quantize: Optional[str] = None,
                   kv_dtype: Optional[str] = None, packed: Optional[int] = None, mesh: str = "") -> ProgramReport:
    """Compile the engine's decode step (every slot) and a prefill chunk for the target, weights and cache
    replicated on each device (one engine per device); its figures (a ProgramReport), with how many slots of `max_len`
    positions fit beside the weights. A slot's bytes are measured, not assumed: the decode step compiled
    again for twice the slots gives the peak's growth per slot (its cache, and any temporaries that grow
    with it: a compiler may copy the cache into another layout). `quantize="int8"`: int8 weights (the
    programs hold the int8 kernels and not the float ones they replace); `kv_dtype="int8"`: an int8 cache
    (its float32 scales counted); `packed`: also the packed prefill of that many tokens
    (`Engine(packed_prefill=True)`'s longest call, whole prompts of several requests in one forward), its
    memory counted in what fits.

    `mesh` (a train.mesh string such as "tensor=4"): the engine over params placed on that mesh by the rules
    table (train.logical_axis_rules), as `Engine` runs them: attention split by heads over tensor and the
    cache by kv head; the slot figures are then per chip (`cache_bytes_per_chip`)."""
    import jax

    from jaxgpt import engine
    from jaxgpt.cache import cache_bytes
    from jaxgpt.quantize import check_kv_dtype, check_quantize

    quantize, kv_dtype = check_quantize(quantize), check_kv_dtype(kv_dtype)
    gcfg, backend = model_config(config, vocab_size, devs.target.platform)
    try:  # the engine's own checks, before minutes of compiling
        max_len, chunk = engine.check_sizes(gcfg, slots, max_len, chunk)
        if packed is not None:
            engine.check_packed(gcfg, slots, packed)
    except ValueError as e:
        raise AotError(f"the engine: {e}") from None
    grid, weight_shardings, replicated = _engine_placement(config, gcfg, devs, mesh, packed)

    lowered = {}

    def lower(name, n=slots):
        def run():
            lowered[n] = lowered.get(n) or engine.lower_engine(gcfg, n, max_len, chunk, backend=backend,
                                                               sharding=replicated, quantize=quantize,
                                                               kv_dtype=kv_dtype, packed=packed, mesh=grid,
                                                               weight_shardings=weight_shardings)
            return lowered[n][name]
        return run

    decode, decode_s = _compile("engine decode step", lower("decode"), devs, progress)
    prefill, prefill_s = _compile("engine prefill", lower("prefill"), devs, progress)
    twice, _ = _compile(f"engine decode step for {2 * slots} slots", lower("decode", 2 * slots), devs, progress)
    per_slot = cache_bytes(gcfg, 1, max_len, dtype=kv_dtype)
    weights = lowered[slots]["weights"]
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731

    c = lowered[slots]["cache"]
    cache_chip = _chip_bytes((c.k, c.v, c.k_scale, c.v_scale))
    per_slot_chip = cache_chip // slots
    extra = {"slots": slots, "max_len": max_len, "chunk": chunk, "dtype": gcfg.dtype, "kernels": backend.name,
             "quantize": quantize, "kv_dtype": kv_dtype or gcfg.dtype,
             # what the programs take as weights: float params (with int8, those int8 does not replace) and
             # the backend's prepared forms (the int8 kernels and their scales)
             "weight_bytes": nbytes(weights), "float_weight_bytes": nbytes(weights.params),
             "cache_bytes": per_slot * slots, "cache_bytes_per_slot": per_slot,
             # per device: the cache split by kv head on a tensor mesh, the weights by the rules table
             "cache_bytes_per_chip": cache_chip, "weight_bytes_per_chip": _chip_bytes(weights)}
    if grid is not None:
        extra["mesh"] = ", ".join(f"{a}={s}" for a, s in grid.shape.items())
    out = analyze("engine decode step", decode, decode_s, devs, None, extra)
    pre = memory_dict(prefill)
    out.more["prefill"] = {"compile_s": round(prefill_s, 2), **pre}
    grown = memory_dict(twice).get("peak_bytes", 0) - (out.peak_bytes or 0)
    peaks = [out.peak_bytes or 0, pre.get("peak_bytes", 0)]
    if packed is not None:
        compiled, seconds = _compile(f"engine packed prefill of {packed} tokens", lower("prefill_packed"), devs,
                                     progress)
        out.more["prefill_packed"] = {"tokens": packed, "compile_s": round(seconds, 2), **memory_dict(compiled)}
        peaks.append(out.more["prefill_packed"].get("peak_bytes", 0))
    bytes_per_slot = out.more["bytes_per_slot"] = max(per_slot_chip, grown // slots)
    # what does not grow with the slots (weights, the rest of the temporaries); the largest program's
    fixed = max(peaks) - bytes_per_slot * slots
    out.more["slots_that_fit"] = max(0, (devs.limit_bytes - fixed) // bytes_per_slot)
    out.fits = out.fits and max(peaks[1:]) <= devs.limit_bytes
    return out


def compile_paged(config, devs: Devices, vocab_size: int, slots: int = 32, max_len: Optional[int] = None,
                  page_size: int = 16, token_budget: Optional[int] = None, progress: bool = True,
                  quantize: Optional[str] = None, kv_dtype: Optional[str] = None,
                  largest_only: bool = False) -> ProgramReport:
    """Compile every program of the paged engine (`runner.programs`, the list its warmup() runs: each step
    shape, with and without prompt logprobs, and the several-decode-steps ones of jaxgpt-serve's default)
    for the target, weights and page pool replicated on each device (one engine per device); the figures of
    the largest step, each program's, and how many tokens of cache fit beside the weights. A page's bytes
    are measured, not assumed: the largest step compiled again over a pool of more pages gives the peak's
    growth per page (its keys and values, and anything a compiler adds with them). `largest_only`: only the
    step of the most tokens (a model whose every compile takes minutes; its figures then say so)."""
    from jaxgpt.cli.serve import DEFAULT_DECODE_STEPS
    from jaxgpt.engine import paged, runner, slots as slots_mod
    from jaxgpt.paged import pool_bytes
    from jaxgpt.quantize import check_kv_dtype, check_quantize

    quantize, kv_dtype = check_quantize(quantize), check_kv_dtype(kv_dtype)
    gcfg, backend = model_config(config, vocab_size, devs.target.platform)
    max_len = gcfg.block_size if max_len is None else max_len
    token_budget = paged.DEFAULT_TOKEN_BUDGET if token_budget is None else token_budget
    try:
        paged._check_sizes(gcfg, slots, max_len, page_size, None, token_budget, 20)
    except ValueError as e:
        raise AotError(f"the paged engine: {e}") from None
    _, _, replicated = _engine_placement(config, gcfg, devs, "", None)
    width, shapes = -(-max_len // page_size), runner.step_shapes(token_budget, slots)
    steps = runner.shape_steps(shapes, slots_mod.steps_by_rows(DEFAULT_DECODE_STEPS, runner._pow2(slots)))
    calls = runner.programs(shapes, steps)
    if largest_only:
        calls = [(shapes[-1], "step")]
    small, big = 2, 2 + 8 * width  # pool sizes: the growth between them is what a page costs
    kw = dict(page_size=page_size, table_width=width, steps=steps, backend=backend, sharding=replicated,
              quantize=quantize, kv_dtype=kv_dtype)
    lowered = runner.lower_programs(gcfg, calls, num_pages=small, **kw)
    table, largest = [], None
    for shape, kind in calls:
        compiled, seconds = _compile(f"paged engine {kind} of {shape[0]} tokens, {shape[1]} requests",
                                     lambda k=(shape, kind): lowered[k], devs, progress)
        table.append({"tokens": shape[0], "requests": shape[1], "kind": kind, "compile_s": round(seconds, 2),
                      **memory_dict(compiled)})
        if largest is None or table[-1].get("peak_bytes", 0) > largest[2].get("peak_bytes", 0):
            largest = (compiled, seconds, table[-1], shape, kind)
    compiled, seconds, mem, shape, kind = largest
    grown_lowered = runner.lower_programs(gcfg, [(shape, kind)], num_pages=big, **kw)[(shape, kind)]
    grown, _ = _compile(f"paged engine {kind} over {big} pages", lambda: grown_lowered, devs, progress)
    per_page = pool_bytes(gcfg, 1, page_size, kv_dtype)
    bytes_per_page = max(per_page, (memory_dict(grown).get("peak_bytes", 0) - mem.get("peak_bytes", 0)) // (big - small))
    fixed = max(t.get("peak_bytes", 0) for t in table) - small * bytes_per_page
    pages_fit = max(0, (devs.limit_bytes - fixed) // bytes_per_page)
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax_leaves(tree))  # noqa: E731
    extra = {"max_requests": slots, "max_len": max_len, "page_size": page_size, "token_budget": token_budget,
             "dtype": gcfg.dtype, "kernels": backend.name, "quantize": quantize, "kv_dtype": kv_dtype or gcfg.dtype,
             "largest": f"{kind} of {shape[0]} tokens", "weight_bytes": nbytes(lowered["weights"]),
             "page_bytes": per_page, "bytes_per_page": bytes_per_page, "pages_that_fit": pages_fit,
             "tokens_that_fit": pages_fit * page_size, "programs": len(table), "largest_only": largest_only}
    out = analyze("paged engine step", compiled, seconds, devs, None, extra)
    out.more["steps"] = table
    return out


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


PROGRAMS = ("train", "generate", "engine", "paged")


def check_programs(programs) -> tuple[str, ...]:
    """The programs to compile, each once in the order given; AotError for none or an unknown name."""
    names = tuple(dict.fromkeys(p.strip() for p in programs if p.strip()))
    unknown = [p for p in names if p not in PROGRAMS]
    if unknown:
        raise AotError(f"unknown program {unknown[0]!r} in --programs; choose from {', '.join(PROGRAMS)}")
    if not names:
        raise AotError(f"--programs names no program; choose one or more of {', '.join(PROGRAMS)} "
                       "(e.g. --programs=train)")
    return names


def compile_for_target(config, target: Target, vocab_size: Optional[int] = None,
                       programs: tuple[str, ...] = ("train", "generate"), progress=True,
                       generate_args: Optional[dict] = None, engine_args: Optional[dict] = None) -> dict:
    """Compile the chosen programs of `config` for `target`: the figures in the --json form
    (docs/accelerators.md, "On a TPU"), each program's its ProgramReport.as_dict(). Raises DoesNotFit
    (with the figures so far) when a program does not fit. `progress`: False, True (a line on stderr per
    compile) or a callable giving a context manager around each (jaxgpt-aot's ticking line)."""
    programs = check_programs(programs)
    vocab = vocab_size_for(config, vocab_size)
    from jaxgpt.model import num_params

    devs = target_devices(target)
    gcfg, _ = model_config(config, vocab, target.platform)
    result = {"target": str(target), "platform": target.platform, "device_kind": devs.device_kind,
              "device_count": len(devs.devices), "memory_bytes": devs.memory_bytes, "limit_bytes": devs.limit_bytes,
              "model": {"n_params": num_params(gcfg, non_embedding=False), "vocab_size": vocab,
                        "n_layer": gcfg.n_layer, "n_head": gcfg.n_head, "n_kv_head": gcfg.n_kv_head,
                        "n_embd": gcfg.n_embd, "block_size": gcfg.block_size},
              "programs": {}}
    for name in programs:
        try:
            if name == "train":
                out = compile_train_step(config, devs, vocab, progress)
            elif name == "engine":
                out = compile_engine(config, devs, vocab, progress=progress,
                                     **{k: v for k, v in (engine_args or {}).items()
                                        if v is not None and k not in ("page_size", "token_budget", "largest_only")})
            elif name == "paged":
                out = compile_paged(config, devs, vocab, progress=progress,
                                    **{k: v for k, v in (engine_args or {}).items()
                                       if v is not None and k in ("slots", "max_len", "page_size", "token_budget",
                                                                   "quantize", "kv_dtype", "largest_only")})
            else:
                out = compile_generate(config, devs, vocab, progress=progress, **(generate_args or {}))
        except DoesNotFit as e:
            result["programs"][name] = {"program": e.program, "fits": False, "peak_bytes": e.peak_bytes,
                                        "limit_bytes": e.limit_bytes}
            result["fits"] = False
            e.result = result
            raise
        result["programs"][name] = out.as_dict()
        if not out.fits:
            e = DoesNotFit(out.program, str(target), out.peak_bytes, devs.limit_bytes,
                           "compiled; device memory exceeded" if target.platform == "gpu" else "")
            result["fits"] = False
            e.result = result
            raise e
    result["fits"] = True
    return result
