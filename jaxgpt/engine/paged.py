"""PagedEngine: many requests over a paged KV cache, one ragged step a call.

The three parts, each in its own file: the scheduler (scheduler.py, with the page pool and prefix cache of
pages.py) decides on the host which tokens of which requests run next and on which pages, as a plain
`Plan`; the runner (runner.py) runs a plan as one compiled step over the page pool; this file holds the
requests (their settings, checked once at `submit`, their outputs and events) and turns each step's draws
into tokens. A request's randomness is its own key folded with its token index, so its tokens depend only
on its prompt, settings and seed: never on its neighbours, on how its prompt was chunked, on a prefix
found in the cache, or on having been preempted and recomputed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.backends import Backend, resolve
from jaxgpt.backends.base import cast_floats
from jaxgpt.checks import is_int
from jaxgpt.config import GPTConfig
from jaxgpt.engine import runner
from jaxgpt.engine.plan import Plan, Work
from jaxgpt.engine.programs import Programs
from jaxgpt.engine.scheduler import PENDING, Scheduler
from jaxgpt.engine.slots import (TRACES, Completion, Conveniences, Event, Request, Token, check_request,
                                 decode_weights, new_request, request_start, steps_by_rows)
from jaxgpt.paged import PagedCache, pool_bytes, pool_layout
from jaxgpt.quantize import check_kv_dtype, check_quantize
from jaxgpt.sampling import RowSettings, _dequantized_jit, on_params_mesh


# Tokens a step by default (decode tokens and prompt chunks together): under a burst of prompts, larger steps
# share each step's fixed cost among more prompt tokens (lower TTFT) but hold decoding rows longer (higher
# ITL); 512 measured best for TTFT on a CPU (bench/README.md).
DEFAULT_TOKEN_BUDGET = 512


@dataclasses.dataclass
class EngineStats:
    """What the engine has done, by attribute (the server's /metrics reads these). Tokens, calls and
    seconds of its steps; prefix-cache queries and hits in tokens (vLLM's prefix_cache_queries /
    prefix_cache_hits); preemptions; the most pages held at once."""

    steps: int = 0
    calls: int = 0                 # compiled calls (a call may run several decode steps)
    step_seconds: float = 0.0      # the device's time in steps (overlapping dispatches counted once)
    host_seconds: float = 0.0      # the engine's thread outside compiled calls (planning, arrays, events)
    prompt_tokens: int = 0         # prompt (and recomputed) tokens run
    decode_tokens: int = 0         # decoding requests' tokens run
    padding_tokens: int = 0
    generated_tokens: int = 0
    fed_tokens: int = 0            # tokens taken on the device from the step before (asynchronous scheduling)
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    peak_pages: int = 0

    def get(self, key: str, default=0):
        """A counter by name (the dense engine's `stats` is a Counter: readers of either use this)."""
        return getattr(self, key, default)

    def __getitem__(self, key: str):
        return self.get(key)


@dataclasses.dataclass
class _Live:
    rid: int
    req: Request
    key_data: np.ndarray
    out: Completion
    callback: Optional[Callable]
    pending: int = 0  # draws dispatched but not read back yet (asynchronous scheduling)

    @property
    def sequence(self) -> list:
        return list(self.req.prompt) + [t.id for t in self.out.tokens] + [PENDING] * self.pending


@dataclasses.dataclass
class _Step:
    """A dispatched step: its plan and requests, its outputs (on the device until read), its arrays and
    shape, whether it scored prompt tokens, the row of each request that draws, and when it began."""

    plan: Plan
    lives: list
    out: dict
    a: runner.StepArrays
    shape: tuple
    want_all: bool
    rows_of: dict
    t0: float
    t1: float


class PagedEngine(Conveniences):
    """Requests served over a pool of `num_pages` pages of `page_size` positions (default: as many
    positions as `max_requests` rows of `max_len`, plus the null page), at most `max_requests` running at
    once and `token_budget` tokens a step (decode tokens first, then prompt chunks of at most `max_chunk`).

    The interface is `Engine`'s: `submit`, `step`, `run`, `stream`, `score`, `cancel`, `warmup`. Prefixes:
    with `prefix_caching`, full pages are kept by the hash of their tokens and those before them, and a
    request whose sequence begins with cached pages reuses them without computing them (`stats`
    counts queries and hits in tokens). When pages run out, the newest running request is preempted and
    later recomputed from its prompt and the tokens it had produced: its output is unchanged.
    `kv_dtype="int8"`: pages of int8 keys and values with scales. `quantize`: "int8" or "w8a8" weights
    (the step runs the backend's decode forms of them). Params placed on a mesh by `jaxgpt.shard_params`
    (say tensor=2) run there, attention split by heads over `tensor`, and with `split_cache` (default: on
    wherever `tensor` > 1) the page pool split by kv head: each device holds and reads its own heads.
    `decode_steps`: as `Engine`'s, several decode steps a call while every running request decodes and none
    waits. `async_scheduling`: each step is planned while the one before runs (default: on an accelerator;
    off where the pool is on CPUs, where the host's work between steps is small and a step planned ahead
    misses the requests that arrive meanwhile: bench/README.md). Steps are padded
    to at least `min_step_tokens` tokens (fewer programs to compile; on a CPU a few rows cost about one)."""

    def __init__(self, params, config: GPTConfig, *, max_requests: int = 32, max_len: Optional[int] = None,
                 page_size: int = 16, num_pages: Optional[int] = None, token_budget: int = DEFAULT_TOKEN_BUDGET,
                 max_chunk: Optional[int] = None, max_logprobs: int = 20, backend: Optional[Backend] = None,
                 quantize: Optional[str] = None, kv_dtype: Optional[str] = None, prefix_caching: bool = True,
                 decode_steps=1, split_cache: Optional[bool] = None, async_scheduling: Optional[bool] = None,
                 min_step_tokens: int = 1):
        self.quantize, self.kv_dtype = check_quantize(quantize), check_kv_dtype(kv_dtype)
        max_len = config.block_size if max_len is None else max_len
        _check_sizes(config, max_requests, max_len, page_size, num_pages, token_budget, max_logprobs)
        self.config = config.replace(remat="none")
        # params placed on a mesh: attention split by heads over its tensor axis, the pool by kv head
        self.backend, cache_mesh = on_params_mesh(backend or resolve(config), params, split_cache)
        self.backend.setup()
        self.max_requests, self.max_len, self.page_size = int(max_requests), int(max_len), int(page_size)
        self.table_width = math.ceil(self.max_len / self.page_size)
        self.num_pages = int(num_pages) if num_pages is not None else self.max_requests * self.table_width + 1
        self.token_budget, self.max_logprobs = int(token_budget), int(max_logprobs)
        if self.quantize is not None:
            params = _dequantized_jit(params, config=self.config)
        self.params = cast_floats(params, self.config.compute_dtype)
        self.shapes = runner.step_shapes(self.token_budget, self.max_requests, min_step_tokens)
        # decode steps a call by the step's rows (steps_by_rows), when every running request is decoding and
        # none waits
        self._steps = steps_by_rows(decode_steps, runner._pow2(self.max_requests))
        self._shape_steps = runner.shape_steps(self.shapes, self._steps)  # (each program's most)
        self.weights = decode_weights(self.params, self.config, self.backend, self.quantize,
                                      [t for t, _ in self.shapes])
        self.cache = PagedCache.create_pool(self.config, self.num_pages, self.page_size, dtype=self.kv_dtype,
                                            layout=pool_layout(self.config, self.backend, self.kv_dtype))
        if cache_mesh is not None:
            self.cache = self.cache.on_mesh(cache_mesh)
        self.scheduler = Scheduler(num_pages=self.num_pages, page_size=self.page_size, max_len=self.max_len,
                                   token_budget=self.token_budget, max_requests=self.max_requests,
                                   prefix_caching=prefix_caching, max_chunk=max_chunk)
        self._static = dict(config=self.config, backend=self.backend, n_logprobs=self.max_logprobs)
        if async_scheduling is None:
            async_scheduling = any(d.platform != "cpu" for d in jax.tree.leaves(self.cache)[0].sharding.device_set)
        self.async_scheduling = bool(async_scheduling)
        self._pending: Optional[_Step] = None  # a step dispatched whose draws are not read yet
        self._read_until = 0.0  # when the last step's outputs were read (the device done with it)
        self._live: dict = {}
        self._ids = itertools.count()
        self._traces_at_start = sum(TRACES.values())
        self.stats = EngineStats()
        # the pool as the steps see it (committed to its devices), for compiling without running
        self.cache = jax.device_put(self.cache, jax.tree.map(lambda x: x.sharding, self.cache))
        self._pool_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                       self.cache)
        # where the draws a step feeds the next and the hidden states prompt logprobs read are kept: one
        # placement for every call, as for the compiled programs (else the first call of each compiles again)
        self._here = _replicated(jax.tree.leaves(self.cache)[0].sharding)
        self.programs = Programs(runner.programs(self.shapes, self._shape_steps), self._compile_program)

    # -- sizes and programs -------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        """Requests running at once (the dense engine's name for it)."""
        return self.max_requests

    @property
    def cache_bytes(self) -> int:
        return pool_bytes(self.config, self.num_pages, self.page_size, self.kv_dtype)

    @property
    def programs_compiled(self) -> int:
        return sum(TRACES.values()) - self._traces_at_start

    def warmup(self, prompt_logprobs: bool = True, progress: bool = False, background: bool = False) -> int:
        """Compile every step program (each shape of `runner.step_shapes`, with and without prompt
        logprobs, and the several-decode-steps ones); returns how many were compiled now. With `background`:
        those of the largest shape (which hold any step) before it returns, the rest on a thread while the
        engine serves, its steps padded meanwhile to shapes whose programs are ready (`programs.pending`:
        how many are left; `programs.join()` waits for them). The step programs compiled before it returns
        are then run once on a step of padding only (it writes page 0, which no request reads): a program's
        first run costs more than its later ones, and would otherwise fall on the first request."""
        before = sum(TRACES.values())
        calls = self._warmup_calls(prompt_logprobs)
        self.programs.warm(calls, progress=progress, background=background)
        compiled = sum(TRACES.values()) - before
        self._first_runs([c for c in calls if c in self.programs.ready
                          and (not background or c in self.programs.first)])
        return compiled

    def _first_runs(self, calls: Sequence[tuple]) -> None:
        """Run each "step" and "steps" program of `calls` once, every token padding (on page 0, seeing
        nothing); nothing is counted in `stats`."""
        for shape, kind in calls:
            a, rows = runner.warm_arrays(shape, self.table_width), runner.idle_rows(shape[1])
            w = self.weights[shape[0]]
            if kind == "step":
                self.cache, out = runner.ragged_step(w, self.cache, a, rows, self._prev(), **self._static)
            elif kind == "steps":
                self.cache, out = runner.ragged_decode_steps(w, self.cache, a, rows, np.int32(1), self._prev(),
                                                             steps=self._shape_steps[shape], **self._static)
            else:
                continue
            jax.block_until_ready(out)

    def _compile_program(self, shape: tuple, kind: str) -> None:
        """Lower and compile one program for the arguments the engine's steps give it (the call then finds it
        compiled)."""
        a, rows = runner.warm_arrays(shape, self.table_width), runner.idle_rows(shape[1])
        w = self.weights[shape[0]]
        prev = jax.ShapeDtypeStruct((runner._pow2(self.max_requests),), jnp.int32, sharding=self._here)
        if kind == "steps":
            lowered = runner.ragged_decode_steps.lower(w, self._pool_spec, a, rows, np.int32(1), prev,
                                                       steps=self._shape_steps[shape], **self._static)
        elif kind == "scores":
            h = jax.ShapeDtypeStruct((shape[0], self.config.n_embd), jnp.dtype(self.config.compute_dtype),
                                     sharding=self._here)
            lowered = runner.token_scores.lower(w, h, a.targets, **self._static)
        else:
            lowered = runner.ragged_step.lower(w, self._pool_spec, a, rows, prev, **self._static)
        lowered.compile()

    def warmup_programs(self, prompt_logprobs: bool = True) -> int:
        return len(self._warmup_calls(prompt_logprobs))

    def _warmup_calls(self, prompt_logprobs: bool) -> list:
        return runner.programs(self.shapes, self._shape_steps, prompt_logprobs)

    # -- requests -----------------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], *, callback: Optional[Callable[[Event], None]] = None,
               **settings) -> int:
        """Queue a request (prompt token ids; settings as `Request`'s fields); returns its id."""
        req = check_request(new_request(prompt, settings), self.config, self.max_len, self.max_logprobs)
        rid = next(self._ids)
        cacheable = len(req.prompt) - 1
        if req.prompt_logprobs:
            cacheable = min(cacheable, req.score_from - 1)
        self.scheduler.add(rid, req.prompt, req.max_tokens, cacheable=cacheable)
        key_data, out = request_start(rid, req)
        self._live[rid] = _Live(rid, req, key_data, out, callback)
        return rid

    def cancel(self, request_id: int) -> bool:
        """Drop a request (waiting or running); its pages are free at the next step. False if unknown/done."""
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        self.scheduler.finish(request_id)
        self._finish(live, "cancelled", [])
        return True

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def has_work(self) -> bool:
        return bool(self._live)

    # -- one step -----------------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """Plan a step and run it; the events of the draws read back by now. With `async_scheduling` a step is
        planned and dispatched before the previous one's draws are read (its decoding requests' next tokens
        taken from them on the device), and that previous step's events are returned: the device runs one
        step while the host turns the last one into events and plans the next."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        events: list[Event] = []
        if not plan:
            if self._pending is not None:
                self._process(self._pending, events)
                self._pending = None
                return events
            if self.has_work():
                raise RuntimeError("the scheduler planned nothing while requests wait: the page pool is too "
                                   "small for one request")
            return events
        lives = [self._live[w.request_id] for w in plan.work]
        want_all = any(lv.req.prompt_logprobs and w.start + 1 < len(lv.req.prompt) for lv, w in zip(lives, plan.work))
        shape = runner.shape_for(plan, [s for s in self.shapes if self.programs.usable(s, "step")
                                        and (not want_all or self.programs.usable(s, "scores"))])
        m = self._several_steps_now(plan, lives, shape)
        if m > 1:
            return self._several_steps(plan, lives, shape, m, t0)
        step = self._dispatch(plan, lives, shape, want_all, t0)
        before, self._pending = self._pending, step
        if before is not None:
            self._process(before, events)  # (the device runs `step` meanwhile)
        if not self.async_scheduling:
            self._process(step, events)
            self._pending = None
        return events

    def _dispatch(self, plan: Plan, lives: list, shape: tuple, want_all: bool, t0: float) -> "_Step":
        """Run a plan's step (asynchronously: its outputs stay on the device) and tell the scheduler its
        tokens are computed, each draw PENDING until `_process` reads it; `want_all`: with prompt logprobs."""
        a = runner.step_arrays(plan, shape, self.page_size, self.table_width,
                               {lv.rid: lv.sequence for lv in lives} if want_all else None)
        self._feed(plan, a)
        rows = self._rows(lives, shape[1])
        t1 = time.perf_counter()
        self.cache, out = runner.ragged_step(self.weights[shape[0]], self.cache, a, rows, self._prev(), **self._static)
        hidden = out.pop("hidden")  # (stays on the device but for prompt logprobs)
        if want_all:
            hidden = jax.device_put(hidden, self._here)
            out.update(runner.token_scores(self.weights[shape[0]], hidden, a.targets, **self._static))
        sampling = {lv.rid: PENDING for lv, w in zip(lives, plan.work) if w.sample and lv.req.max_tokens > 0}
        self.scheduler.update(plan, sampling)
        for lv in lives:
            lv.pending += lv.rid in sampling
        rows_of = {w.request_id: j for j, w in enumerate(plan.work) if w.request_id in sampling}
        return _Step(plan, lives, out, a, shape, want_all, rows_of, t0, t1)

    def _feed(self, plan: Plan, a: runner.StepArrays) -> None:
        """Mark the plan's PENDING tokens (the last step's draws, not read yet) to be taken on the device
        from that step's rows."""
        if self._pending is None:
            return
        at = 0
        for w in plan.work:
            for i, tok in enumerate(w.tokens):
                if tok == PENDING:
                    a.feed[at + i] = self._pending.rows_of[w.request_id]
                    self.stats.fed_tokens += 1
            at += len(w.tokens)

    def _prev(self):
        """The last dispatched step's draws on the device (zeros before the first)."""
        if self._pending is None:
            return jax.device_put(np.zeros(runner._pow2(self.max_requests), np.int32), self._here)
        draws = self._pending.out["next"]
        return draws if draws.sharding == self._here else jax.device_put(draws, self._here)  # (on a mesh)

    def _process(self, step: "_Step", events: list) -> None:
        """Read a dispatched step's outputs (waiting for them), put its draws in the scheduler's sequences
        and emit them; requests that ended since it was planned are skipped."""
        out = jax.device_get({k: v for k, v in step.out.items() if k != "next"})
        t2 = time.perf_counter()
        span = self._span(step.t1, t2)
        plan, a = step.plan, step.a
        for j, (live, w) in enumerate(zip(step.lives, plan.work)):
            if w.request_id not in self._live:
                continue
            if w.start < len(live.req.prompt):  # (its prompt's steps: "prefill" in a Completion's times)
                live.out.prefill_s += span
            if step.want_all and live.req.prompt_logprobs:
                self._record_prompt(live, w, int(a.last[j]) - len(w.tokens) + 1, out)
            if w.request_id in step.rows_of:
                live.pending -= 1
                self.scheduler.fill(live.rid, w.end, int(out["token"][j]))
                self._emit(live, out["token"][j], out["logprob"][j], out["top_ids"][j], out["top_lps"][j], events)
            elif w.sample:  # (a scoring request: its prompt is done)
                self._end(live, "length", events)
        decode = sum(1 for live, w in zip(step.lives, plan.work) if w.start >= len(live.req.prompt))
        self._count(plan, step.shape, decode, step.t0, step.t1, t2, span)

    def _span(self, t1: float, t2: float) -> float:
        """Seconds a step dispatched at t1 and read at t2 held the device: from t1, or from when the step
        before it was read if later (with asynchronous scheduling a step is dispatched while the one before
        runs, so the two spans dispatch-to-read overlap; counted whole they summed past the run's time)."""
        start, self._read_until = max(t1, self._read_until), max(self._read_until, t2)
        return max(0.0, t2 - start)

    def _several_steps_now(self, plan: Plan, lives: Sequence[_Live], shape: tuple) -> int:
        """How many decode steps this step may run in one call (1: a plain step): up to its rows'
        `decode_steps` while every running request decodes and none waits, as many as the nearest to its
        max_tokens has left, with pages for them all given now (else 1)."""
        several = shape in self._shape_steps and self.programs.usable(shape, "steps")
        k = self._steps.get(runner._pow2(plan.num_requests), 1) if several else 1
        # (every work one token drawn after: a preempted request's recomputation may start past its prompt
        # with a chunk of several)
        if (k == 1 or self.scheduler.num_waiting or plan.num_requests != self.scheduler.num_running
                or plan.num_tokens != plan.num_requests or not all(w.sample for w in plan.work)
                or any(w.start < len(lv.req.prompt) for lv, w in zip(lives, plan.work))):
            return 1
        m = min(k, min(lv.req.max_tokens - len(lv.out.tokens) - lv.pending for lv in lives))
        if m > 1 and not self.scheduler.extend({w.request_id: w.start + m for w in plan.work}):
            return 1
        return m

    def _several_steps(self, plan: Plan, lives: list, shape: tuple, m: int, t0: float) -> list:
        """m decode steps in one call (`runner.ragged_decode_steps`), then each step's draws handed to the
        scheduler and emitted in order, a request's up to its end: the tokens m plain steps give."""
        assert plan.num_tokens == plan.num_requests, "several decode steps take one token a request"
        a = runner.step_arrays(plan, shape, self.page_size, self.table_width)
        a.tables[:len(lives)] = [self._table(w.request_id) for w in plan.work]
        self._feed(plan, a)
        t1 = time.perf_counter()
        self.cache, out = runner.ragged_decode_steps(self.weights[shape[0]], self.cache, a, self._rows(lives, shape[1]),
                                                     np.int32(m), self._prev(), steps=self._shape_steps[shape],
                                                     **self._static)
        events: list[Event] = []
        if self._pending is not None:  # the step before: its draws are this call's first tokens
            self._process(self._pending, events)
            self._pending = None
        out = jax.device_get(out)
        t2 = time.perf_counter()
        alive = list(zip(lives, plan.work, range(len(lives))))
        for i in range(m):
            alive = [(lv, w, j) for lv, w, j in alive if lv.rid in self._live]
            step = Plan(work=tuple(Work(w.request_id, w.start + i, (lv.sequence[w.start + i],), w.pages, True)
                                   for lv, w, _ in alive))
            self.scheduler.update(step, {lv.rid: int(out["token"][i, j]) for lv, _, j in alive})
            for lv, _, j in alive:
                self._emit(lv, out["token"][i, j], out["logprob"][i, j], out["top_ids"][i, j], out["top_lps"][i, j],
                           events)
            self._count(step, shape, len(alive), t0, t1, t2 if i == 0 else t1)
            t0 = t1 = t2 = time.perf_counter()
        self.stats.calls -= m - 1
        return events

    def _table(self, request_id: int) -> np.ndarray:
        pages = self.scheduler.pages(request_id)
        return np.pad(np.asarray(pages, np.int32), (0, self.table_width - len(pages)))

    def _count(self, plan: Plan, shape: tuple, decode: int, t0: float, t1: float, t2: float,
               span: Optional[float] = None) -> None:
        st, now = self.stats, time.perf_counter()
        st.steps += 1
        st.calls += 1
        st.step_seconds += self._span(t1, t2) if span is None else span
        st.host_seconds += (t1 - t0) + (now - t2)
        st.decode_tokens += decode
        st.prompt_tokens += plan.num_tokens - decode
        st.padding_tokens += shape[0] - plan.num_tokens
        sched = self.scheduler.stats
        st.prefix_queries, st.prefix_hits = sched.prefix_queries, sched.prefix_hits
        st.preemptions, st.peak_pages = sched.preemptions, sched.peak_pages

    def _rows(self, lives: Sequence[_Live], n: int) -> RowSettings:
        """The sampler settings of the step's requests as arrays over n rows (padding: greedy zeros)."""
        pad = [None] * (n - len(lives))
        both = list(lives) + pad

        def col(fn, dtype, empty=0):
            return np.array([fn(x) if x is not None else empty for x in both], dtype)
        return RowSettings(
            temperature=col(lambda x: x.req.temperature, np.float32),
            top_k=col(lambda x: x.req.top_k or 0, np.int32),
            top_p=col(lambda x: 1.0 if x.req.top_p is None else x.req.top_p, np.float32, 1.0),
            key_data=np.stack([x.key_data if x is not None else np.zeros(2, np.uint32) for x in both]),
            index=col(lambda x: len(x.out.tokens) + x.pending, np.int32),
            top_wanted=np.array(any(bool(x.req.logprobs) for x in lives)))

    def _record_prompt(self, live: _Live, w, first: int, out: dict) -> None:
        """Prompt token i's logprob comes from position i - 1 (this work's tokens start at flat index
        `first`); each recorded once (a recomputed request's are already there)."""
        res, req = live.out, live.req
        k = 0 if req.logprobs is None else req.logprobs
        for j in range(len(w.tokens)):
            i = w.start + j + 1
            if req.score_from <= i < len(req.prompt) and res.prompt_logprobs[i] is None:
                f = first + j
                res.prompt_logprobs[i] = float(out["prompt_lp"][f])
                res.prompt_greedy[i] = bool(out["prompt_greedy"][f])
                res.prompt_top[i] = [(int(a), float(b)) for a, b in
                                     zip(out["prompt_top_ids"][f][:k], out["prompt_top_lps"][f][:k])]

    def _emit(self, live: _Live, tok, lp, top_ids, top_lps, events: list) -> None:
        """Record one drawn token (if the request wants one) and end the request when it is done."""
        req = live.req
        if req.max_tokens == 0:
            self._end(live, "length", events)
            return
        k = 0 if req.logprobs is None else req.logprobs
        token = Token(int(tok), float(lp), [(int(a), float(b)) for a, b in zip(top_ids[:k], top_lps[:k])])
        if not live.out.tokens:
            live.out.first_token = time.perf_counter()
        live.out.tokens.append(token)
        self.stats.generated_tokens += 1
        reason = ("stop" if token.id in req.stop_token_ids else
                  "length" if len(live.out.tokens) >= req.max_tokens else None)
        if reason is None:
            event = Event(live.rid, token)
            events.append(event)
            if live.callback is not None:
                live.callback(event)
            return
        self._end(live, reason, events, token)

    def _end(self, live: _Live, reason: str, events: list, token: Optional[Token] = None) -> None:
        self._live.pop(live.rid, None)
        self.scheduler.finish(live.rid)
        live.out.finish_reason, live.out.finished = reason, time.perf_counter()
        event = Event(live.rid, token, reason, live.out)
        events.append(event)
        if live.callback is not None:
            live.callback(event)

    def _finish(self, live: _Live, reason: str, events: list) -> None:
        live.out.finish_reason, live.out.finished = reason, time.perf_counter()
        event = Event(live.rid, None, reason, live.out)
        events.append(event)
        if live.callback is not None:
            live.callback(event)

    def _completions(self, ids) -> dict:
        return {rid: self._live[rid].out for rid in ids}


def _replicated(sharding):
    """One sharding for small arrays beside a pool placed on `sharding`: its device, or its mesh whole."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))


def _check_sizes(config: GPTConfig, max_requests, max_len, page_size, num_pages, token_budget, max_logprobs) -> None:
    """One clear ValueError for each setting out of range, before anything is allocated."""
    for name, value in (("max_requests", max_requests), ("page_size", page_size), ("token_budget", token_budget)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not is_int(max_len) or not 1 <= max_len <= config.block_size:
        raise ValueError(f"max_len must be an integer in [1, block_size={config.block_size}], got {max_len!r}")
    if num_pages is not None and (not is_int(num_pages) or num_pages < 2):
        raise ValueError(f"num_pages must be an integer >= 2 (page 0 is kept for padding), got {num_pages!r}")
    if not is_int(max_logprobs) or not 0 <= max_logprobs <= config.vocab_size:
        raise ValueError(f"max_logprobs must be an integer in [0, vocab_size], got {max_logprobs!r}")
