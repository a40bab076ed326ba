"""The training loop: data, model, step, evaluation, logging, checkpoints and preemption."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from typing import Optional

import jax
import numpy as np
from tqdm import tqdm

from jaxgpt import checkpoint as ckpt_lib
from jaxgpt import kernels
from jaxgpt.kernels import cpu as cpu_kernels
from jaxgpt.config import model_config_from, validate_config
from jaxgpt.data import BatchSampler, Prefetcher, prepare_dataset, tokenizer_difference, tokenizer_fingerprint
from jaxgpt.lora import LoraSpec, init_adapters
from jaxgpt.model import convert_layers, init_params
from jaxgpt.report import warn
from jaxgpt.training import run_dir
from jaxgpt.training.metrics import MetricsLog, peak_flops
from jaxgpt.training.parallel import make_runner
from jaxgpt.training.step import create_train_state, make_optimizer, make_schedule


class TrainingDiverged(FloatingPointError):
    """The loss became NaN or infinite."""


class StopNow(KeyboardInterrupt):
    """A second SIGTERM/SIGINT during training: stop at once, without the checkpoint the first asked for."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _load_data(config, process_index: int, process_count: int):
    d = config.data
    # every process prepares (or finds) the bins itself: the cache is built under a temporary name and
    # renamed into place, so processes sharing a filesystem do not clash
    ds = prepare_dataset(corpus=d.corpus, path=d.path, tokenizer=d.tokenizer, vocab_size=d.vocab_size,
                         val_fraction=d.val_fraction, cache_dir=d.cache_dir,
                         progress=config.train.progress and process_index == 0)
    t = config.train
    train = BatchSampler(ds.train, t.batch_size, config.model.block_size, config.seed, process_index, process_count)
    return ds, train


class _Preemption:
    """Turns SIGTERM/SIGINT into a flag the loop checks after each step (main thread only).

    On several processes the signal may reach them at different steps, yet all must stop (and save
    collectively) at the same one: there SIGTERM is left to JAX's preemption notifier, and `stop(step)`
    asks JAX's preemption sync point, which answers True on every process at the same step. SIGINT
    keeps its default there (KeyboardInterrupt: the process stops at once).
    """

    def __init__(self, multiprocess: bool = False):
        self.signal: Optional[int] = None
        self.multiprocess = multiprocess
        self._old = {}

    def stop(self, step: int) -> bool:
        """Whether to write a checkpoint and stop after `step`; call it once per step on every process."""
        if self.multiprocess and self.signal is None:
            from jax.experimental import multihost_utils
            if multihost_utils.reached_preemption_sync_point(step):
                self.signal = signal.SIGTERM
        return self.signal is not None

    def __enter__(self):
        if threading_is_main() and not self.multiprocess:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:  # a second signal: stop now
            raise StopNow(signum)
        self.signal = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def threading_is_main() -> bool:
    return threading.current_thread() is threading.main_thread()


def train(config) -> dict:
    """Run training as `config` describes; returns a summary (final losses, steps, times, final state).

    On several processes every process calls this with the same config: it connects them first through
    `jaxgpt.distributed.initialize` (unless that already ran), each process then feeds its own rows of
    every global batch, only process 0 prints and writes metrics, and checkpoints are saved by all.
    One run at a time uses an out_dir: process 0 locks it, and a second run stops with OutDirInUse.
    """
    t0 = time.time()
    cfg_t = config.train
    validate_config(config)  # the device-independent checks, before the first JAX call
    from jaxgpt import distributed
    distributed.initialize(config)  # jax.distributed as config.distributed says (a no-op if it already ran)
    n_devices = jax.device_count() if cfg_t.parallel == "mesh" else jax.local_device_count() * jax.process_count()
    validate_config(config, n_devices)
    is_main = jax.process_index() == 0
    out_dir = run_dir.resolve_out_dir(config.out_dir)
    with run_dir.RunLock(out_dir, enabled=is_main):  # before anything in out_dir is read or written
        try:
            return _train(config, out_dir, n_devices, t0)
        finally:
            # old checkpoints set aside by overwrite=True: deleted if this run wrote one, else put back
            settled = run_dir.settle_overwrite(out_dir) if is_main else None
            if settled:
                print(f"jaxgpt: {settled}", file=sys.stderr, flush=True)


def _train(config, out_dir: str, n_devices: int, t0: float) -> dict:
    cfg_t = config.train
    from jaxgpt import distributed
    process_index, process_count = jax.process_index(), jax.process_count()
    is_main = process_index == 0
    multiprocess = process_count > 1

    def note(msg):  # process 0's lines before the progress bar exists
        if is_main:
            print(f"jaxgpt: {msg}", flush=True)

    if is_main:
        settled = run_dir.settle_overwrite(out_dir)  # left by an overwrite=True start that was killed
        if settled:
            note(settled)
        if cfg_t.warmup_steps > cfg_t.max_steps:
            end = float(make_schedule(cfg_t)(cfg_t.max_steps - 1))
            warn(f"train.warmup_steps ({cfg_t.warmup_steps}) > train.max_steps ({cfg_t.max_steps}): the "
                 f"learning rate never reaches its peak train.lr={cfg_t.lr:g} (it ends at {end:.3g})")
    if multiprocess:
        distributed.barrier("jaxgpt-out-dir-settled")
    resume = config.init_from == "resume"
    existing = ckpt_lib.existing_steps(out_dir)
    if resume and not existing:
        raise ckpt_lib.CheckpointError(f"init_from='resume' but there is no checkpoint in "
                                       f"{ckpt_lib.checkpoint_dir(out_dir)}; train with init_from='scratch' first")
    if not resume and existing and not config.overwrite:
        raise ValueError(f"{ckpt_lib.checkpoint_dir(out_dir)} already holds checkpoints (steps {existing}); "
                         "use --config.init_from=resume to continue, or --config.overwrite=True to start over")
    # the old checkpoints survive until this run has written its first one (jaxgpt/training/run_dir.py)
    awaiting_first = not resume and bool(config.overwrite)  # a config fact: the same on every process
    if awaiting_first and existing and is_main:
        note(f"overwrite=True: the previous checkpoints wait in {run_dir.set_aside(out_dir)} until this run "
             "writes its first checkpoint")
    if multiprocess:  # nobody opens the checkpoint folder while process 0 may still be moving it
        distributed.barrier("jaxgpt-out-dir")

    ds, sampler = _load_data(config, process_index, process_count)
    tokenizer = ds.tokenizer
    lora_spec = LoraSpec.from_config(cfg_t.lora)  # None: every parameter trains
    params, base_ref = None, None  # pretrained or base weights, and where they came from
    if config.init_from not in ("scratch", "resume"):
        gcfg, params, base_ref = _load_init(config, tokenizer)
    else:
        gcfg = model_config_from(config, tokenizer.vocab_size)
        if resume and lora_spec is not None:  # the base model a LoRA run adapts is not in its checkpoints
            base_ref = _saved_lora_base(out_dir)
            gcfg, params = ckpt_lib.load_base(base_ref, gcfg)

    if gcfg.dtype == "bfloat16" and kernels.resolve(gcfg.kernels) == "cpu" and not cpu_kernels.has_bf16_matmul():
        note("model.dtype=bfloat16, but this CPU has neither AVX512_BF16 nor AMX: computing in float32, "
             "which is faster here (parameters and checkpoints are float32 either way)")
        gcfg = gcfg.replace(dtype="float32")
    optimizer, schedule = make_optimizer(cfg_t), make_schedule(cfg_t)
    runner = make_runner(cfg_t.parallel, gcfg, optimizer, cfg_t.grad_accum, schedule, fsdp=cfg_t.fsdp)
    seed = config.seed

    def make_state(*pretrained):
        p = pretrained[0] if pretrained else init_params(gcfg, jax.random.key(seed))
        if lora_spec is not None:  # adapters train; the base rides along frozen
            adapters = init_adapters(p, gcfg, lora_spec, jax.random.key(seed + 2))
            return create_train_state(adapters, optimizer, jax.random.key(seed + 1), frozen=p)
        return create_train_state(p, optimizer, jax.random.key(seed + 1))

    args = () if params is None else (params,)
    del params

    checkpointer = ckpt_lib.Checkpointer(out_dir, keep=cfg_t.keep_checkpoints)
    start_step, best_val = 0, math.inf
    try:
        if resume:
            saved_layers = {}  # step -> whether that checkpoint stores the blocks stacked (scan_layers)

            def attempt(step):
                meta = checkpointer.restore_meta(step)
                _check_resume_meta(meta, gcfg, tokenizer)  # clear words before orbax's
                # restored in the layer layout it was saved in, straight into the runner's sharding (on any
                # device count), then converted to this config's layout below
                saved = gcfg.replace(scan_layers=bool(meta.get("model", {}).get("scan_layers", False)))
                saved_layers[step] = saved.scan_layers
                abstract = runner.abstract_state(lambda *a: convert_layers(make_state(*a), saved), *args)
                return checkpointer.restore(abstract.replace(frozen=None), step)  # (LoRA: no base in it)

            # the newest checkpoint that restores; damaged newer ones are moved aside, never deleted
            start_step, (state, meta), skipped = checkpointer.restore_newest(attempt)
            if skipped:
                if multiprocess:
                    distributed.barrier("jaxgpt-restored")
                for e in skipped:
                    if is_main:
                        warn(f"{e}; moved it to {checkpointer.move_aside(e.step, out_dir)} and resuming from "
                             f"checkpoint {start_step}")
                if multiprocess:
                    distributed.barrier("jaxgpt-moved-aside")
                checkpointer.reload()
            sampler.load_state_dict(meta["sampler"])
            start_step = int(state.step)  # replicated: readable on every process
            best_val = meta.get("best_val_loss", math.inf)
            if saved_layers[start_step] != gcfg.scan_layers:
                state = jax.jit(lambda s: convert_layers(s, gcfg))(state)
            if lora_spec is not None:
                state = state.replace(frozen=args[0])
            state = runner.put_state(state)
            if start_step >= cfg_t.max_steps:
                note(f"the checkpoint is at step {start_step} and train.max_steps is {cfg_t.max_steps}: nothing "
                     "to train; raise --config.train.max_steps to continue")
                checkpointer.close()
                return {"start_step": start_step, "out_dir": out_dir, "steps": start_step, "nothing_to_do": True,
                        "best_val_loss": best_val, "saved_step": start_step, "wall_time_s": time.time() - t0,
                        "state": runner.get_state(state)}
        else:
            state = runner.init_state(make_state, *args)
    except BaseException:
        if not multiprocess:  # (closing is collective on several processes; see the end of the loop)
            checkpointer.close()
        raise
    del args

    log = MetricsLog(out_dir, enabled=is_main, truncate_after_step=start_step if resume else None)
    val_sampler = BatchSampler(ds.val, cfg_t.batch_size, gcfg.block_size, config.seed + 1, process_index,
                               process_count)
    eval_train = BatchSampler(ds.train, cfg_t.batch_size, gcfg.block_size, config.seed + 2, process_index,
                              process_count)
    # the same batches at every evaluation, both splits stacked [2 * eval_steps, b, T]: one call evaluates all
    eval_x, eval_y = (np.stack(a) for a in zip(*[s.batch(i) for s in (eval_train, val_sampler)
                                                  for i in range(cfg_t.eval_steps)]))
    bytes_per_token = ds.bytes_per_token("val")

    tokens_per_step = cfg_t.batch_size * gcfg.block_size
    flops_per_token = gcfg.flops_per_token(gcfg.block_size)
    rows = cfg_t.batch_size // (cfg_t.grad_accum * n_devices) * gcfg.block_size  # one device's matmul rows
    peak, peak_source = peak_flops(gcfg.dtype, cfg_t.peak_flops, matmul_shape=(rows, gcfg.n_embd, gcfg.mlp_hidden))
    if peak is not None:
        peak *= process_count  # peak_flops counts this process's devices; tokens/s counts the global batch

    def say(msg):
        if is_main:
            (bar.write if bar is not None else print)(msg)

    if is_main:
        print(f"jaxgpt: {gcfg.num_params(non_embedding=False) / 1e6:.2f}M parameters, "
              f"{n_devices} device(s) via {runner.name}"
              f"{f' on {process_count} processes' if multiprocess else ''}, tokens/step {tokens_per_step}, "
              f"vocab {gcfg.vocab_size} ({config.data.tokenizer}), dtype {gcfg.dtype}; "
              + (f"MFU against {peak / 1e9:.0f} GFLOP/s ({peak_source})" if peak is not None
                 else f"MFU unknown: {peak_source}")
              + f", {flops_per_token / 1e6:.2f} MFLOP/token (6N + 12*L*T*D, attention not halved)"
              + (f"; CPU dispatch {kernels.cpu_dispatch()}" if jax.default_backend() == "cpu" else ""), flush=True)
        if resume:
            print(f"jaxgpt: resumed from step {start_step} in {checkpointer.directory}", flush=True)

    bar = None
    if is_main and cfg_t.progress:
        bar = tqdm(total=cfg_t.max_steps, initial=start_step, dynamic_ncols=True, desc="train",
                   disable=not sys.stderr.isatty())
        if bar.disable:
            bar = None

    def evaluate(state, step):
        losses = np.asarray(runner.to_host(runner.eval(state, eval_x, eval_y)), np.float64)
        out = {"step": step, "train_loss": float(losses[:cfg_t.eval_steps].mean()),
               "val_loss": float(losses[cfg_t.eval_steps:].mean())}
        out["val_ppl"] = math.exp(min(out["val_loss"], 50.0))
        out["val_bpb"] = out["val_loss"] / math.log(2) / bytes_per_token
        return out

    def meta_for(step, best):
        meta = {"step": step, "config": config.to_dict(), "model": gcfg.to_dict(), "tokenizer": tokenizer.to_dict(),
                "tokenizer_sha256": tokenizer_fingerprint(tokenizer.to_dict()),
                "sampler": {**sampler.state_dict(), "step": step}, "best_val_loss": best,
                "dataset": {k: ds.meta[k] for k in ds.meta if k != "tokenizer"}}
        if lora_spec is not None:  # the checkpoint holds the adapters; this says which base they adapt
            meta["lora"] = {**lora_spec.to_dict(), "base": base_ref}
        return meta

    per_call = cfg_t.steps_per_call
    prefetch = Prefetcher(sampler, size=max(2, per_call))
    summary = {"start_step": start_step, "out_dir": out_dir}
    # (first step, number of steps, metrics on device, when the call was seen finished or None) of the call
    # whose metrics are unread: read after the next call is dispatched, so that an asynchronous dispatch
    # keeps the device busy meanwhile. With inline dispatch (kernels.inline_cpu_dispatch) a call has finished
    # when it returns, and the next one too by the time this is read: its finish time is taken at return.
    pending = None
    last_log_time, last_log_step = time.time(), start_step
    last_val = None
    step = start_step
    saved_step = start_step if resume else None
    failed = False

    def read(pending):
        first, count, metrics, finished = pending
        host = {k: np.asarray(v).reshape(count) for k, v in runner.to_host(metrics).items()}
        finished = time.time() if finished is None else finished
        for i in range(count):
            read_step(first + i, {k: float(v[i]) for k, v in host.items()}, finished)

    def read_step(s, m, now):
        nonlocal last_log_time, last_log_step
        if not math.isfinite(m["loss"]):
            raise TrainingDiverged(f"loss is {m['loss']} at step {s}; stopping. Checkpoints already saved are "
                                   f"untouched (try a lower train.lr or train.grad_clip).")
        summary["last_loss"] = m["loss"]
        if s % cfg_t.log_interval == 0 or s == cfg_t.max_steps:
            dt = max(now - last_log_time, 1e-9)
            tok_s = tokens_per_step * (s - last_log_step) / dt
            mfu = None if peak is None else flops_per_token * tok_s / peak
            last_log_time, last_log_step = now, s
            rec = {"step": s, **m, "tokens_per_s": tok_s, "mfu": mfu, "elapsed_s": now - t0}
            log.write(rec)
            say(f"step {s:6d} | loss {m['loss']:.4f} | lr {m.get('lr', 0):.2e} | grad norm {m['grad_norm']:.3f} | "
                f"{tok_s:,.0f} tok/s | MFU {'unknown' if mfu is None else f'{100 * mfu:.1f}%'} | {now - t0:.1f}s")

    try:
        with _Preemption(multiprocess) as preempt:
            while step < cfg_t.max_steps:
                count = _steps_to_run(step, cfg_t)
                if count == 1:
                    x, y = next(prefetch)
                    state, metrics = runner.step(state, x, y)
                else:  # one program call for `count` steps, ending at the next eval, checkpoint or the end
                    xs, ys = zip(*(next(prefetch) for _ in range(count)))
                    state, metrics = runner.steps(state, np.stack(xs), np.stack(ys))
                finished = time.time() if _is_ready(metrics) else None
                first, step = step + 1, step + count
                if pending is not None:
                    if pending[3] is None and finished is not None:  # it finished no later than this one
                        pending = pending[:3] + (finished,)
                    read(pending)  # the previous call's metrics, read after dispatching this one
                pending = (first, count, metrics, finished)
                if bar is not None:
                    bar.update(count)
                last = step == cfg_t.max_steps
                stop = preempt.stop(step)
                do_eval = step % cfg_t.eval_interval == 0 or last
                # a stop before an overwrite=True run's first checkpoint saves nothing: the old ones come back
                do_save = step % cfg_t.checkpoint_interval == 0 or last or (stop and not awaiting_first)
                if do_eval or do_save:
                    read(pending)
                    pending = None
                if do_eval:
                    ev = evaluate(state, step)
                    last_val = ev["val_loss"]
                    best_val = min(best_val, last_val)
                    ev["best_val_loss"] = best_val
                    log.write(ev)
                    say(f"eval {step:6d} | train {ev['train_loss']:.4f} | val {ev['val_loss']:.4f} | "
                        f"val ppl {ev['val_ppl']:.2f} | val bits/byte {ev['val_bpb']:.3f} | best val {best_val:.4f}")
                    summary.update(ev)
                if do_save:
                    checkpointer.save(step, runner.get_state(state).replace(frozen=None), meta_for(step, best_val),
                                      val_loss=last_val if do_eval else None)
                    saved_step = step
                    if awaiting_first:  # the previous run's checkpoints go once this one is on disk
                        checkpointer.wait()
                        awaiting_first = False
                        settled = run_dir.settle_overwrite(out_dir) if is_main else None
                        if settled:
                            say(f"jaxgpt: {settled}")
                if stop:
                    name = signal.Signals(preempt.signal).name
                    summary.update(preempted=True, stopped_by=name, signal=int(preempt.signal))
                    say(f"jaxgpt: stopped by {name} at step {step}, " +
                        ("checkpoint saved; resume with --config.init_from=resume" if do_save else
                         "before this overwrite=True run's first checkpoint: nothing saved"))
                    break
            if pending is not None:
                read(pending)
    except BaseException:
        failed = True
        raise
    finally:
        prefetch.close()
        if bar is not None:
            bar.close()
        # async saves always finish, on errors too; but on several processes finishing is collective, and
        # after an error the others may never join: leave the save unfinished (earlier ones are whole)
        if not (failed and multiprocess):
            checkpointer.close()
        log.close()
    summary.update({"steps": step, "best_val_loss": best_val, "saved_step": saved_step,
                    "wall_time_s": time.time() - t0, "state": runner.get_state(state)})
    return summary


def _is_ready(tree) -> bool:
    """Whether every array of `tree` is computed (a computation dispatched inline is, once it returns)."""
    return all(x.is_ready() for x in jax.tree.leaves(tree) if hasattr(x, "is_ready"))


def _steps_to_run(step: int, cfg_t) -> int:
    """How many steps the next program call runs: train.steps_per_call, cut short so that every eval,
    checkpoint and the last step falls at the end of a call (the same boundaries whenever a run resumes)."""
    count = min(cfg_t.steps_per_call, cfg_t.max_steps - step)
    for interval in (cfg_t.eval_interval, cfg_t.checkpoint_interval):
        count = min(count, interval - step % interval)
    return count


def _check_resume_meta(meta: dict, gcfg, tokenizer) -> None:
    """Refuse, in one line, a checkpoint whose tokenizer or model shape differs from the config's."""
    saved_tok, now_tok = meta.get("tokenizer"), tokenizer.to_dict()
    same = meta.get("tokenizer_sha256") == tokenizer_fingerprint(now_tok)  # older checkpoints: compare the dicts
    diff = None if same or not isinstance(saved_tok, dict) else tokenizer_difference(saved_tok, now_tok)
    if diff:
        raise ckpt_lib.CheckpointError(
            f"the data's tokenizer is not the checkpoint's: {diff}. Resuming would feed the model ids that "
            "mean other text; resume with the data settings the run was trained on (config.data), or start "
            "a new run")
    saved = meta.get("model", {})
    now = gcfg.to_dict()
    diff = {k: (saved.get(k), now[k]) for k in now if k in saved and saved[k] != now[k]
            and k not in ("dropout", "attention", "kernels", "dtype", "scan_layers", "remat")}  # same params either way
    if diff:
        raise ckpt_lib.CheckpointError(
            "the checkpoint's model differs from the config: " +
            ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items()))


def _load_init(config, tokenizer):
    """(GPTConfig, params, reference) of the weights `init_from` names: a jaxgpt run folder (its latest
    checkpoint), a Hugging Face folder or a GPT-2 name. The architecture comes from the weights, how to
    compute it from config.model; a smaller model.block_size keeps the first position embeddings."""
    m = config.model
    compute = dict(dtype=m.dtype, attention=m.attention, kernels=m.kernels, dropout=m.dropout,
                   scan_layers=m.scan_layers, remat=m.remat)
    source = config.init_from
    if ckpt_lib.is_run_folder(source):
        folder = os.path.abspath(os.path.expanduser(source))
        base_cfg, params, base_tokenizer, meta = ckpt_lib.load_model(folder)
        saved, now = base_tokenizer.to_dict(), tokenizer.to_dict()
        if tokenizer_fingerprint(saved) != tokenizer_fingerprint(now):
            raise ckpt_lib.CheckpointError(
                f"init_from={source}: that run's tokenizer is not the data's: "
                f"{tokenizer_difference(saved, now) or 'they differ'}; use the data settings it was trained on")
        if m.block_size > base_cfg.block_size:
            raise ValueError(f"model.block_size={m.block_size} exceeds the block_size of {source} "
                             f"({base_cfg.block_size})")
        if "wpe" in params and m.block_size < base_cfg.block_size:  # keep the first position embeddings
            params = {**params, "wpe": {"embedding": params["wpe"]["embedding"][:m.block_size]}}
        gcfg = base_cfg.replace(block_size=m.block_size, **compute)
        return gcfg, convert_layers(params, gcfg), {"init_from": folder, "step": int(meta["step"])}
    from jaxgpt.pretrained import from_pretrained

    # crops the position table when block_size is smaller, as nanoGPT's fine-tuning does
    gcfg, params = from_pretrained(source, block_size=m.block_size, **compute)
    if tokenizer.vocab_size > gcfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but {source} has a "
                         f"vocabulary of {gcfg.vocab_size}; use data.tokenizer='gpt2' with GPT-2 weights")
    folder = os.path.expanduser(source)
    return gcfg, params, {"init_from": os.path.abspath(folder) if os.path.isdir(folder) else source}


def _saved_lora_base(out_dir: str) -> dict:
    """The base-model reference that a LoRA run's newest readable checkpoint records."""
    ckpt = ckpt_lib.Checkpointer(out_dir, read_only=True)
    try:
        for step in sorted(ckpt_lib.existing_steps(out_dir), reverse=True):
            try:
                meta = ckpt.restore_meta(step)
            except ckpt_lib.CheckpointError:
                continue
            if "lora" not in meta:
                raise ckpt_lib.CheckpointError(f"checkpoint {step} in {out_dir} is not a LoRA run's; resume it "
                                               "with train.lora.rank=0")
            return meta["lora"]["base"]
    finally:
        ckpt.close()
    raise ckpt_lib.CheckpointError(f"no readable checkpoint in {ckpt_lib.checkpoint_dir(out_dir)}")
