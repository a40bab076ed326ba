"""Evaluation in the training loop: the mean loss over fixed windows of both splits (train and val loss,
perplexity, bits per byte) and, beside it, the multiple-choice tasks of train.eval_tasks (task_eval.py)."""

from __future__ import annotations

import math

import numpy as np

from jaxgpt.data import BatchSampler, document_ids
from jaxgpt.training import task_eval
from jaxgpt.training.config import doc_masked


class Evaluator:
    """The run's fixed eval windows (both splits stacked [2 * eval_steps, b, T]: one call evaluates all) and
    its tasks (None when train.eval_tasks names none), evaluated through `runner`."""

    def __init__(self, config, ds, sampler, gcfg, backend, runner, process_index: int, process_count: int):
        cfg_t = config.train
        self.runner, self.eval_steps = runner, cfg_t.eval_steps
        samplers = [BatchSampler(split, cfg_t.batch_size, gcfg.block_size, config.seed + seed, process_index,
                                 process_count) for split, seed in ((ds.train, 2), (ds.val, 1))]
        self.x, self.y = (np.stack(a) for a in zip(*[s.batch(i) for s in samplers for i in range(cfg_t.eval_steps)]))
        # document-masked training evaluates masked too: the fixed windows' document ids, from their tokens
        self.segments = document_ids(self.x.reshape(-1, gcfg.block_size), sampler.separator).reshape(
            self.x.shape) if doc_masked(config) else None
        self.bytes_per_token = ds.bytes_per_token("val")
        self.tasks = task_eval.from_config(cfg_t, ds.tokenizer, gcfg, backend, runner)

    def losses(self, state, step: int) -> dict:
        """{step, train_loss, val_loss, val_ppl, val_bpb} of `state` (the runner's) over the fixed windows."""
        losses = self.runner.eval(state, self.x, self.y, self.segments)
        losses = np.asarray(self.runner.to_host(losses), np.float64)
        n = self.eval_steps
        out = {"step": step, "train_loss": float(losses[:n].mean()), "val_loss": float(losses[n:].mean())}
        out["val_ppl"] = math.exp(min(out["val_loss"], 50.0))
        # (None for shards whose tokenizer file does not record the bytes of text per token)
        out["val_bpb"] = None if not self.bytes_per_token else out["val_loss"] / math.log(2) / self.bytes_per_token
        return out

    def run(self, state, step: int, best_val: float) -> dict:
        """The eval row of `step`: the losses, `best_val` (the best val loss so far, this one included) and,
        on the steps they fall on, the tasks' scores."""
        ev = self.losses(state, step)
        ev["best_val_loss"] = best_val = min(best_val, ev["val_loss"])
        if self.tasks is not None and self.tasks.due(step):
            ev.update(self.tasks.run(self.runner.get_state(state), step))
        return ev

    def task_scores(self) -> dict:
        """The latest task scores, {task: {acc, acc_norm, n, step}} (the checkpoint's meta), {} before any."""
        return {} if self.tasks is None else self.tasks.last

    @staticmethod
    def line(ev: dict) -> str:
        """The log line of an eval row."""
        return (f"eval {ev['step']:6d} | train {ev['train_loss']:.4f} | val {ev['val_loss']:.4f} | val ppl "
                f"{ev['val_ppl']:.2f} | " + ("" if ev["val_bpb"] is None else f"val bits/byte {ev['val_bpb']:.3f} | ")
                + f"best val {ev['best_val_loss']:.4f}" + task_eval.LoopTasks.line(ev))
