"""Multiple-choice tasks in the training loop (train.eval_tasks): read once at the start, scored on the
eval steps train.eval_tasks_interval falls on, over the devices the step runs on (jaxgpt/evals.py)."""

from __future__ import annotations

import os
import time
from typing import Optional

from jaxgpt import evals
from jaxgpt.training.step import model_variables


def check_config(t) -> None:
    """train.eval_tasks and its settings: ValueError naming the key for a value that cannot work."""
    try:
        paths = evals.parse_task_list(t.get("eval_tasks"))
    except ValueError as e:
        raise ValueError(f"config.train.eval_tasks: {e}") from None
    for p in paths:
        if not os.path.isfile(os.path.expanduser(p)):
            raise ValueError(f"config.train.eval_tasks: task file {p} does not exist; give local JSON Lines files "
                             f"or llm.c's hellaswag_val.bin (--config.train.eval_tasks=PATH[,PATH]), or "
                             f"--config.train.eval_tasks='' for none")
    style, limit, every = t.get("eval_tasks_style", "llmc"), t.get("eval_tasks_limit"), t.get("eval_tasks_interval")
    if style not in evals.STYLES:
        raise ValueError(f"config.train.eval_tasks_style: must be one of {evals.STYLES}, got {style!r}")
    bins = [p for p in paths if p.endswith(".bin")]
    if bins and style != "llmc":
        raise ValueError(f"config.train.eval_tasks_style: {bins[0]} is llm.c's .bin file (GPT-2 token ids), scored "
                         f"in style llmc only, got {style!r}")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"config.train.eval_tasks_limit: must be an integer >= 1 (None: every item), got {limit!r}")
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1
                              or every % t.eval_interval):
        raise ValueError(f"config.train.eval_tasks_interval: must be a multiple of train.eval_interval "
                         f"({t.eval_interval}) (the tasks are scored on eval steps; None: every eval), got {every!r}")


class LoopTasks:
    """The run's tasks and a scorer over the runner's mesh (rows split over its batch axes)."""

    def __init__(self, cfg_t, tokenizer, gcfg, backend, runner):
        self.style = cfg_t.get("eval_tasks_style", "llmc")
        self.tasks = evals.read_tasks(evals.parse_task_list(cfg_t.eval_tasks), self.style, cfg_t.get("eval_tasks_limit"))
        evals.check_vocab(self.tasks, gcfg.vocab_size)
        self.interval = cfg_t.get("eval_tasks_interval") or cfg_t.eval_interval
        self.max_steps, self.tokenizer = cfg_t.max_steps, tokenizer
        # tokenized once, here, before anything compiles: a tokenizer that cannot encode them (GPT-2's BPE files
        # missing offline, a vocabulary-only tokenizer) stops the run now, not at its first task eval hours in
        self.encoded = {name: evals.encode_items(items, tokenizer, self.style) for name, items in self.tasks.items()}
        self.scorer = evals.Scorer(None, gcfg, backend=getattr(runner, "backend", backend), mesh=runner.mesh,
                                   axes=runner.batch_axes)
        self.last: dict = {}  # the latest scores, {task: {acc, acc_norm, n, step}}: the checkpoint's meta

    def describe(self) -> str:
        return ", ".join(f"{name} ({len(items)} items)" for name, items in self.tasks.items())

    def due(self, step: int) -> bool:
        """Whether the eval at `step` scores the tasks too (every interval, and at the last step)."""
        return step % self.interval == 0 or step == self.max_steps

    def run(self, state, step: int) -> dict:
        """The flat record {"<task>/acc", "<task>/acc_norm", "tasks_s"} for a state as runner.get_state
        returns it (its params as the runner lays them out)."""
        t0 = time.perf_counter()
        self.scorer.variables = model_variables(state.params, state.frozen)
        scores = evals.evaluate(self.scorer, self.tokenizer, self.tasks, self.style, self.encoded)
        self.scorer.variables = None  # (holds no state between evals)
        self.last = {name: {"acc": s["acc"], "acc_norm": s["acc_norm"], "n": s["n"], "step": step}
                     for name, s in scores.items()}
        record = {f"{name}/{m}": s[m] for name, s in scores.items() for m in ("acc", "acc_norm")}
        return {**record, "tasks_s": time.perf_counter() - t0}

    @staticmethod
    def line(record: dict) -> str:
        """The scores for the log line: ' | hellaswag acc 0.2500 acc_norm 0.3000'."""
        names = [k[:-len("/acc")] for k in record if k.endswith("/acc")]
        return "".join(f" | {n} acc {record[n + '/acc']:.4f} acc_norm {record[n + '/acc_norm']:.4f}" for n in names)


def from_config(cfg_t, tokenizer, gcfg, backend, runner) -> Optional[LoopTasks]:
    """LoopTasks for train.eval_tasks, None when it names none."""
    if not evals.parse_task_list(cfg_t.get("eval_tasks")):
        return None
    return LoopTasks(cfg_t, tokenizer, gcfg, backend, runner)
