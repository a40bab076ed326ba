"""The training loop: data, model, step, evaluation, logging, checkpoints and preemption."""

from __future__ import annotations

import functools
import math
import os
import signal
import sys
import threading
import time
from typing import Any, NamedTuple, Optional

import jax
import numpy as np
from tqdm import tqdm

from jaxgpt import checkpoint as ckpt_lib
from jaxgpt import compile_cache
from jaxgpt.backends import resolve
from jaxgpt.backends.cpu import cpu_dispatch
from jaxgpt.data import (BatchSampler, DocumentSampler, Prefetcher, document_starts, prepare_dataset,
                         tokenizer_fingerprint)
from jaxgpt.data.shards import open_shards
from jaxgpt.lora import LoraSpec
from jaxgpt.model import num_params
from jaxgpt.report import warn
from jaxgpt.training import profiling, restore, run_dir
from jaxgpt.training.config import doc_masked, parallel_mode, validate_config
from jaxgpt.training.evaluation import Evaluator
from jaxgpt.training.metrics import MetricsLog
from jaxgpt.training.parallel import make_runner
from jaxgpt.training.step import init_train_state, make_optimizer, make_schedule
from jaxgpt.training.throughput import Throughput
from jaxgpt.user_modules import recorded_imports


class TrainingDiverged(FloatingPointError):
    """The loss became NaN or infinite."""


class StopNow(KeyboardInterrupt):
    """A second SIGTERM/SIGINT during training: stop at once, without the checkpoint the first asked for."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _load_data(config, process_index: int, process_count: int):
    d = config.data
    t = config.train
    if d.corpus == "shards":  # llm.c's shards: every header checked here, before anything compiles
        ds = open_shards(d.path, d.get("val_path"), d.tokenizer)
    else:
        # every process prepares (or finds) the bins itself: the cache is built under a temporary name and
        # renamed into place, so processes sharing a filesystem do not clash
        ds = prepare_dataset(corpus=d.corpus, path=d.path, tokenizer=d.tokenizer, vocab_size=d.vocab_size,
                             val_fraction=d.val_fraction, cache_dir=d.cache_dir,
                             progress=config.train.progress and process_index == 0)
    if d.get("align", "random") == "document":
        return ds, _document_sampler(config, ds, process_index, process_count)
    train = BatchSampler(ds.train, t.batch_size, config.model.block_size, config.seed, process_index, process_count)
    return ds, train


def separator_id(config, tokenizer) -> int:
    """The token that separates documents (the tokenizer's end-of-text token), for data.align='document';
    a ValueError in one line when the tokenizer has none."""
    if tokenizer.eos_id is None:
        raise ValueError(f"config.data.align: 'document' needs a tokenizer with an end-of-text token to find "
                         f"documents by; data.tokenizer={config.data.tokenizer!r} has none (use 'bpe' or 'gpt2', "
                         f"or data.align='random')")
    return int(tokenizer.eos_id)


def _document_sampler(config, ds, process_index: int, process_count: int) -> DocumentSampler:
    """Windows at document starts over the training split (the starts cached beside its bin when the
    dataset has a folder)."""
    sep = getattr(ds, "separator_id", None)  # llm.c shards: the token before each document (Llama-3's is BOS)
    if sep is None:
        sep = separator_id(config, ds.tokenizer)
    cache, key = _starts_cache(ds)
    starts = document_starts(ds.train, sep, cache=cache, key=key)
    try:
        return DocumentSampler(ds.train, sep, config.train.batch_size, config.model.block_size, config.seed,
                               process_index, process_count, segments=doc_masked(config), starts=starts)
    except ValueError as e:
        raise ValueError(f"config.data.align='document': the training split: {e}") from None


def _starts_cache(ds) -> tuple[Optional[str], str]:
    """(where the training split's document starts are cached, the dataset's fingerprint they are keyed by):
    beside the bins, or beside the first training shard (data.path may be a glob)."""
    meta = getattr(ds, "meta", None) or {}
    key = meta.get("fingerprint") or (meta.get("train") or {}).get("sha256") or meta.get("source_hash") or ""
    shards = getattr(ds.train, "shards", None)
    folder = os.path.dirname(shards[0].path) if shards else getattr(ds, "path", None)
    if folder is None or not os.path.isdir(folder):
        return None, key
    return os.path.join(folder, "document_starts_train.npy"), str(key)


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
    compile_cache.enable(config.get("compile_cache", "auto"))  # before the first compilation
    n_devices = jax.device_count() if parallel_mode(cfg_t) == "mesh" else jax.local_device_count() * jax.process_count()
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
    run = _Run(config, out_dir, n_devices, t0)
    try:
        done = run.setup()
        return done if done is not None else run.train()
    finally:  # llm.c shards hold open files (up to 64 a split): closed with the run, not by the collector
        close = getattr(getattr(run, "ds", None), "close", None)
        if close is not None:
            close()


class _Run:
    """One training run in the order of things: `setup` (settle the out_dir, build data/model/runner, restore or
    initialise the state, the clocks and the evaluator: the run's state, set there), then `train` (the loop's
    log, prefetcher and profiler opened and closed there; evaluating, logging and checkpointing)."""

    def __init__(self, config, out_dir: str, n_devices: int, t0: float):
        self.config, self.cfg_t, self.out_dir, self.n_devices, self.t0 = config, config.train, out_dir, n_devices, t0
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        self.is_main = self.process_index == 0
        self.multiprocess = self.process_count > 1
        self.resume = config.init_from == "resume"
        self.bar = None  # the progress bar (train(): process 0's, on a terminal)

    def note(self, msg: str) -> None:
        """A line from process 0 (above the progress bar once there is one)."""
        if self.is_main:
            (self.bar.write if self.bar is not None else functools.partial(print, flush=True))(msg)

    def barrier(self, name: str) -> None:
        if self.multiprocess:
            from jaxgpt import distributed
            distributed.barrier(name)

    def setup(self) -> Optional[dict]:
        """The run's state, in order: settle the out_dir, build, restore or initialise the state, then the
        clocks, the start-up lines and the evaluator; a summary instead when there is nothing to train."""
        self.awaiting_first = self.settle_out_dir()  # the same on every process
        self.build()
        self.checkpointer = ckpt_lib.Checkpointer(self.out_dir, keep=self.cfg_t.keep_checkpoints)
        try:
            self.state, self.start_step, self.best_val = self._start_state()
        except BaseException:
            if not self.multiprocess:  # (closing is collective on several processes; see train())
                self.checkpointer.close()
            raise
        self.init_args = ()
        if self.resume and self.start_step >= self.cfg_t.max_steps:
            self.note(f"jaxgpt: the checkpoint is at step {self.start_step} and train.max_steps is "
                      f"{self.cfg_t.max_steps}: nothing to train; raise --config.train.max_steps to continue")
            self.checkpointer.close()
            return {"start_step": self.start_step, "out_dir": self.out_dir, "steps": self.start_step,
                    "nothing_to_do": True, "best_val_loss": self.best_val, "saved_step": self.start_step,
                    "wall_time_s": time.time() - self.t0, "state": self.runner.get_state(self.state)}
        self.clock = Throughput(self.cfg_t, self.gcfg, self.n_devices, self.process_count,
                                self.sampler.local_batch_size, self.note)
        self._startup_lines()
        self.evaluator = Evaluator(self.config, self.ds, self.sampler, self.gcfg, self.backend, self.runner,
                                   self.process_index, self.process_count)
        if self.evaluator.tasks is not None:
            self.note(f"jaxgpt: eval tasks {self.evaluator.tasks.describe()}, every {self.evaluator.tasks.interval} "
                      "steps")
        return None

    def settle_out_dir(self) -> bool:
        """Refuse a start that would clobber or miss checkpoints; set aside the old ones of an overwrite.
        Whether this run waits for its first checkpoint before the old ones go."""
        cfg_t, out_dir = self.cfg_t, self.out_dir
        if self.is_main:
            settled = run_dir.settle_overwrite(out_dir)  # left by an overwrite=True start that was killed
            if settled:
                self.note(f"jaxgpt: {settled}")
            if cfg_t.warmup_steps > cfg_t.max_steps:
                end = float(make_schedule(cfg_t)(cfg_t.max_steps - 1))
                warn(f"train.warmup_steps ({cfg_t.warmup_steps}) > train.max_steps ({cfg_t.max_steps}): the "
                     f"learning rate never reaches its peak train.lr={cfg_t.lr:g} (it ends at {end:.3g})")
        self.barrier("jaxgpt-out-dir-settled")
        existing = ckpt_lib.existing_steps(out_dir)
        if self.resume and not existing:
            raise ckpt_lib.CheckpointError(f"init_from='resume' but there is no checkpoint in "
                                           f"{ckpt_lib.checkpoint_dir(out_dir)}; train with init_from='scratch' first")
        if not self.resume and existing and not self.config.overwrite:
            raise ValueError(f"{ckpt_lib.checkpoint_dir(out_dir)} already holds checkpoints (steps {existing}); "
                             "use --config.init_from=resume to continue, or --config.overwrite=True to start over")
        # the old checkpoints survive until this run has written its first one (jaxgpt/training/run_dir.py)
        awaiting_first = not self.resume and bool(self.config.overwrite)
        if awaiting_first and existing and self.is_main:
            self.note(f"jaxgpt: overwrite=True: the previous checkpoints wait in {run_dir.set_aside(out_dir)} until "
                      "this run writes its first checkpoint")
        self.barrier("jaxgpt-out-dir")  # nobody opens the checkpoint folder while process 0 may move it
        return awaiting_first

    def build(self) -> None:
        """The data, the model's GPTConfig and backend, the optimizer and the runner."""
        config, cfg_t = self.config, self.cfg_t
        self.ds, self.sampler = _load_data(config, self.process_index, self.process_count)
        self.tokenizer = self.ds.tokenizer
        self.lora_spec = LoraSpec.from_config(cfg_t.lora)  # None: every parameter trains
        # pretrained or base weights (None: none), and where they came from
        gcfg, params, self.base_ref = restore.init_weights(config, self.tokenizer, self.out_dir, self.lora_spec)
        self.backend = resolve(gcfg)
        if gcfg.dtype == "bfloat16" and not self.backend.fast_bf16:
            self.note("jaxgpt: model.dtype=bfloat16, but this CPU has neither AVX512_BF16 nor AMX: computing in "
                      "float32, which is faster here (parameters and checkpoints are float32 either way)")
            gcfg = gcfg.replace(dtype="float32")
        self.gcfg = gcfg
        self.optimizer, self.schedule = make_optimizer(cfg_t, gcfg), make_schedule(cfg_t)
        self.runner = make_runner(parallel_mode(cfg_t), gcfg, self.optimizer, cfg_t.grad_accum, self.schedule,
                                  fsdp=cfg_t.fsdp, backend=self.backend, mesh=cfg_t.mesh,
                                  loss_chunk=cfg_t.get("loss_chunk", 0), rules=cfg_t.get("logical_axis_rules", ""))
        self.init_args = () if params is None else (params,)

    def make_state(self, *pretrained):
        """A step-0 TrainState: fresh or given params, or LoRA adapters over them (the base frozen)."""
        return init_train_state(self.gcfg, self.optimizer, self.config.seed, self.lora_spec, *pretrained)

    def _start_state(self) -> tuple:
        """(state, step, best val loss) the run starts from: restored from the newest readable checkpoint into
        the runner's layout (restore.py), the sampler where it was; or initialised."""
        if not self.resume:
            return self.runner.init_state(self.make_state, *self.init_args), 0, math.inf
        r = restore.restore_newest(self.checkpointer, self.runner, self.gcfg, self.make_state, self.init_args,
                                   tokenizer=self.tokenizer, data_meta=self.ds.meta, cfg_t=self.cfg_t,
                                   out_dir=self.out_dir, barrier=self.barrier, lora=self.lora_spec is not None)
        self.sampler.load_state_dict(r.meta["sampler"])
        return r.state, r.step, r.best_val

    def _startup_lines(self) -> None:
        """Process 0's start-up lines: the model and its devices, the MFU's peak, the data's alignment."""
        gcfg, config = self.gcfg, self.config
        procs = f" on {self.process_count} processes" if self.multiprocess else ""
        self.note(f"jaxgpt: {num_params(gcfg, non_embedding=False) / 1e6:.2f}M parameters, {self.n_devices} "
                  f"device(s) via {self.runner.name}{procs}, tokens/step {self.clock.tokens_per_step}, vocab "
                  f"{gcfg.vocab_size} ({config.data.tokenizer}), dtype {gcfg.dtype}, backend {self.backend.name}; "
                  + self.clock.describe()
                  + (f"; CPU dispatch {cpu_dispatch()}" if jax.default_backend() == "cpu" else ""))
        if isinstance(self.sampler, DocumentSampler):
            s = self.sampler
            self.note(f"jaxgpt: data.align=document: windows start at {len(s.doc_starts):,} documents (separator "
                      f"id {s.separator}), which hold {100 * s.coverage():.1f}% of the training tokens; attention "
                      + ("within each document (data.doc_mask)" if s.segments else "across documents (doc_mask off)"))
        if self.resume:
            self.note(f"jaxgpt: resumed from step {self.start_step} in {self.checkpointer.directory}")

    def meta_for(self, step: int) -> dict:
        tok = self.tokenizer.to_dict()
        meta = {"step": step, "config": self.config.to_dict(), "model": self.gcfg.to_dict(), "tokenizer": tok,
                "tokenizer_sha256": tokenizer_fingerprint(tok), "sampler": {**self.sampler.state_dict(), "step": step},
                "best_val_loss": self.best_val, "dataset": {k: v for k, v in self.ds.meta.items() if k != "tokenizer"},
                # the user's modules that register its parts: imported again where the run is loaded
                "imports": recorded_imports(self.config.get("imports"), self.gcfg)}
        if self.evaluator.task_scores():
            meta["tasks"] = self.evaluator.task_scores()
        if self.lora_spec is not None:  # the checkpoint holds the adapters; this says which base they adapt
            meta["lora"] = {**self.lora_spec.to_dict(), "base": self.base_ref}
        return meta

    def train(self) -> dict:
        """Steps until max_steps or a stop signal; the checkpointer and logs are closed whatever happens."""
        self.log = MetricsLog(self.out_dir, enabled=self.is_main,
                              truncate_after_step=self.start_step if self.resume else None,
                              trackers=self.cfg_t.get("trackers", "auto"), config=self.config)
        if self.is_main and self.cfg_t.progress:
            bar = tqdm(total=self.cfg_t.max_steps, initial=self.start_step, dynamic_ncols=True, desc="train",
                       disable=not sys.stderr.isatty())
            self.bar = None if bar.disable else bar
        self.prefetch = Prefetcher(self.sampler, size=max(2, self.cfg_t.steps_per_call))
        self.summary = {"start_step": self.start_step, "out_dir": self.out_dir}
        self.clock.restart(self.start_step)
        self.step, self.saved_step = self.start_step, self.start_step if self.resume else None
        self.profiler = profiling.StepProfiler(profiling.parse_window(self.cfg_t.get("profile")),
                                               os.path.join(self.out_dir, "profile"))
        failed = False
        try:
            with _Preemption(self.multiprocess) as preempt:
                self._steps(preempt)
        except BaseException:
            failed = True
            raise
        finally:
            self.profiler.close()
            self.prefetch.close()
            if self.bar is not None:
                self.bar.close()
            # async saves always finish, on errors too; but on several processes finishing is collective,
            # and after an error the others may never join: leave that save unfinished (earlier ones are whole)
            if not (failed and self.multiprocess):
                self.checkpointer.close()
            self.log.close()
        self.summary.update({"steps": self.step, "best_val_loss": self.best_val, "saved_step": self.saved_step,
                             "wall_time_s": time.time() - self.t0, "state": self.runner.get_state(self.state)})
        return self.summary

    def _steps(self, preempt: "_Preemption") -> None:
        """The loop proper. A call's metrics are read after the next call is dispatched, so that an
        asynchronous dispatch keeps the device busy meanwhile; with inline dispatch a call has finished
        when it returns, and its finish time is taken then."""
        cfg_t, pending, last_val = self.cfg_t, None, None
        while self.step < cfg_t.max_steps:
            count = _steps_to_run(self.step, cfg_t)
            if self.profiler.start(self.step, self.state):
                self.note(f"jaxgpt: profiling steps {self.step} to {self.profiler.window[1] - 1} into "
                          f"{self.profiler.folder}")
            with self.profiler.annotate(self.step):
                if count == 1:
                    self.state, metrics = self.runner.step(self.state, *self.clock.next_batch(self.prefetch))
                else:  # one program call for `count` steps, ending at the next eval, checkpoint or the end
                    # x, y (and segment ids)
                    batches = zip(*(self.clock.next_batch(self.prefetch) for _ in range(count)))
                    self.state, metrics = self.runner.steps(self.state, *(np.stack(a) for a in batches))
            finished = time.time() if _is_ready(metrics) else None
            first, self.step = self.step + 1, self.step + count
            self.profiler.stop(self.step, self.state)
            if pending is not None:
                if pending.finished is None and finished is not None:
                    # both calls ended by `finished`, the earlier one at an unknown time before
                    pending = pending._replace(finished=self.clock.finish_share(pending.count, count, finished))
                self._read(pending)
            pending = PendingCall(first, count, metrics, finished)
            if self.bar is not None:
                self.bar.update(count)
            last, stop = self.step == cfg_t.max_steps, preempt.stop(self.step)
            do_eval = self.step % cfg_t.eval_interval == 0 or last
            # a stop before an overwrite=True run's first checkpoint saves nothing: the old ones come back
            do_save = self.step % cfg_t.checkpoint_interval == 0 or last or (stop and not self.awaiting_first)
            if do_eval or do_save:
                self._read(pending)
                pending = None
            if do_eval:
                last_val = self._eval_and_log()
            reached = do_eval and self._reached_target(last_val)
            if do_save or reached:
                self._save(last_val if do_eval else None)
            if do_eval or do_save:  # the next call's time, and rate, start now: not with the eval's or save's
                self.clock.restart(self.step)
            if reached:
                break
            if stop:
                self._stopped(preempt, do_save)
                break
        if pending is not None:
            self._read(pending)

    def _eval_and_log(self) -> float:
        ev = self.evaluator.run(self.state, self.step, self.best_val)
        self.best_val = ev["best_val_loss"]
        self.log.write(ev)
        self.note(Evaluator.line(ev))
        self.summary.update(ev)
        return ev["val_loss"]

    def _reached_target(self, val_loss: float) -> bool:
        """Whether train.target_val_loss is set and `val_loss` reaches it (the run then saves and stops)."""
        target = self.cfg_t.get("target_val_loss")
        if target is None or val_loss > target:
            return False
        self.summary.update(reached_target=True, target_step=self.step, target_s=time.time() - self.t0)
        self.note(f"jaxgpt: val loss {val_loss:.4f} <= train.target_val_loss {target:g} at step {self.step} "
                  f"({self.summary['target_s']:.1f}s from the start): stopping with a checkpoint")
        return True

    def _save(self, val_loss: Optional[float]) -> None:
        state = self.runner.get_state(self.state).replace(frozen=None)
        self.checkpointer.save(self.step, state, self.meta_for(self.step), val_loss=val_loss)
        self.saved_step = self.step
        if self.awaiting_first:  # the previous run's checkpoints go once this one is on disk
            self.checkpointer.wait()
            self.awaiting_first = False
            settled = run_dir.settle_overwrite(self.out_dir) if self.is_main else None
            if settled:
                self.note(f"jaxgpt: {settled}")

    def _stopped(self, preempt: "_Preemption", saved: bool) -> None:
        name = signal.Signals(preempt.signal).name
        self.summary.update(preempted=True, stopped_by=name, signal=int(preempt.signal))
        self.note(f"jaxgpt: stopped by {name} at step {self.step}, " +
                  ("checkpoint saved; resume with --config.init_from=resume" if saved else
                   "before this overwrite=True run's first checkpoint: nothing saved"))

    def _read(self, pending: "PendingCall") -> None:
        """Reads a call's metrics, each of its steps timed at an even share of the call's time."""
        host = {k: np.asarray(v).reshape(pending.count) for k, v in self.runner.to_host(pending.metrics).items()}
        times = self.clock.step_times(pending.count, pending.finished)
        for i in range(pending.count):
            self._read_step(pending.first + i, {k: float(v[i]) for k, v in host.items()}, times[i])

    def _read_step(self, s: int, m: dict, now: float) -> None:
        if not math.isfinite(m["loss"]):
            raise TrainingDiverged(f"loss is {m['loss']} at step {s}; stopping. Checkpoints already saved are "
                                   f"untouched (try a lower train.lr or train.grad_clip).")
        self.summary["last_loss"] = m["loss"]
        if s % self.cfg_t.log_interval == 0 or s == self.cfg_t.max_steps:
            r = self.clock.rates(s, now, self.prefetch)
            self.log.write({"step": s, **m, "tokens_per_s": r.tokens_per_s, "mfu": r.mfu,
                            "elapsed_s": now - self.t0, "data_wait_s": r.data_wait_s,
                            "loader_tokens_per_s": r.loader_tokens_per_s})
            self.note(f"step {s:6d} | loss {m['loss']:.4f} | lr {m.get('lr', 0):.2e} | grad norm "
                      f"{m['grad_norm']:.3f} | {r.tokens_per_s:,.0f} tok/s | MFU "
                      f"{'unknown' if r.mfu is None else f'{100 * r.mfu:.1f}%'} | {now - self.t0:.1f}s"
                      + r.data_note())


class PendingCall(NamedTuple):
    """A program call dispatched but not yet read: its steps first..first+count-1, their metrics (on the
    device), and when it finished (None: not seen, its metrics not yet ready when it returned)."""
    first: int
    count: int
    metrics: Any
    finished: Optional[float]


def _is_ready(tree) -> bool:
    """Whether every array of `tree` is computed (a computation dispatched inline is, once it returns)."""
    return all(x.is_ready() for x in jax.tree.leaves(tree) if hasattr(x, "is_ready"))


def _steps_to_run(step: int, cfg_t) -> int:
    """How many steps the next program call runs: train.steps_per_call, cut short so that every eval,
    checkpoint and the last step falls at the end of a call (the same boundaries whenever a run resumes)."""
    count = min(cfg_t.steps_per_call, cfg_t.max_steps - step)
    for interval in (cfg_t.eval_interval, cfg_t.checkpoint_interval):
        count = min(count, interval - step % interval)
    for bound in profiling.bounds(cfg_t.get("profile")):  # a profiled window holds whole calls
        count = min(count, bound - step) if step < bound else count
    return count
