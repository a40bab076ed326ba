"""The paged engine's runner: the compiled ragged step, and a `Plan` turned into its arrays.

One program runs a step: a flat list of T tokens (the decoding requests' latest tokens and prompt chunks,
`paged.PagedCache`), then a draw for each of its R requests from the logits after its last token. T and R
are padded to a few shapes (`step_shapes`: powers of two), so `warmup()` compiles every program a step can
need and no mix of requests compiles another. Prompt logprobs come from the step's hidden states through a
program of the head alone (`token_scores`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.backends import Backend, DecodeWeights
from jaxgpt.config import GPTConfig
from jaxgpt.engine.plan import Plan
from jaxgpt.engine.slots import TRACES
from jaxgpt.model import GPT
from jaxgpt.paged import PagedCache, pool_layout
from jaxgpt.sampling import RowSettings, argmax_last, sample_rows, token_logprobs


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def step_shapes(token_budget: int, max_requests: int, min_tokens: int = 1) -> tuple:
    """(tokens, requests) of every step program: tokens a power of two from `min_tokens`'s up to the
    budget's, requests as many (each request feeds at least one token) up to `max_requests`'s power of two.
    (A larger `min_tokens` pads small steps more and compiles fewer programs.)"""
    top_t, top_r = _pow2(token_budget), _pow2(max_requests)
    low = min(_pow2(min_tokens), top_t)
    return tuple((t, min(t, top_r)) for t in (1 << i for i in range(top_t.bit_length())) if t >= low)


def shape_steps(shapes: Sequence[tuple], steps_by_rows: dict) -> dict:
    """The decode steps each decode shape's several-steps program runs at most: the most that any request
    count it serves takes (`steps_by_rows`, keyed by powers of two: a shape of t tokens serves the counts
    above the next smaller shape's, up to t). Only shapes whose programs run more than one step."""
    out, below = {}, 0
    for t, r in shapes:
        if t != r:
            continue
        k = max(steps_by_rows.get(_pow2(n), 1) for n in range(below + 1, t + 1))
        if k > 1:
            out[(t, r)] = k
        below = t
    return out


def programs(shapes: Sequence[tuple], steps: dict, prompt_logprobs: bool = True) -> list:
    """Every program a paged engine runs, as (shape, kind): the one list `PagedEngine.warmup` compiles and
    `jaxgpt-aot --programs=paged` compiles for a target. Kinds: "step" (`ragged_step`), "scores"
    (`token_scores` of a step's tokens: prompt logprobs), "steps" (`ragged_decode_steps`, for the decode
    shapes in `steps`, `shape_steps`'s)."""
    kinds = ("step", "scores") if prompt_logprobs else ("step",)
    return [(shape, kind) for shape in shapes for kind in kinds] + [(shape, "steps") for shape in steps]


def shape_for(plan: Plan, shapes: Sequence[tuple]) -> tuple:
    """The smallest step shape that holds the plan's tokens and requests."""
    for t, r in shapes:
        if t >= plan.num_tokens and r >= plan.num_requests:
            return t, r
    raise ValueError(f"a plan of {plan.num_tokens} tokens and {plan.num_requests} requests fits no step program "
                     f"(largest {shapes[-1]})")


@dataclasses.dataclass
class StepArrays:
    """A plan as the step program's inputs (numpy, padded to a step shape)."""

    tokens: np.ndarray      # [T] token ids (padding 0)
    rows: np.ndarray        # [T] each token's request row (padding 0)
    positions: np.ndarray   # [T] each token's position in its request
    slots: np.ndarray       # [T] flat write index page * page_size + offset (padding: page 0)
    limits: np.ndarray      # [T] positions each token sees (position + 1; padding 0)
    tables: np.ndarray      # [R, M] block tables (padding 0)
    last: np.ndarray        # [R] index of each request's last token in the step
    targets: np.ndarray     # [T] the token after each one (prompt logprobs; 0 where none)
    feed: np.ndarray        # [T] -1, or the row of the previous step whose draw is this token (on the device)


def step_arrays(plan: Plan, shape: tuple, page_size: int, table_width: int,
                next_tokens: Optional[dict] = None) -> StepArrays:
    """The plan's tokens laid out flat in its work's order. `next_tokens`: request id -> its sequence (for
    `targets`; None: zeros)."""
    t, r = shape
    a = warm_arrays(shape, table_width)
    at = 0
    for j, w in enumerate(plan.work):
        n = len(w.tokens)
        pos = np.arange(w.start, w.end, dtype=np.int32)
        pages = np.asarray(w.pages, np.int32)
        sl = slice(at, at + n)
        a.tokens[sl], a.rows[sl], a.positions[sl], a.limits[sl] = w.tokens, j, pos, pos + 1
        a.slots[sl] = pages[pos // page_size] * page_size + pos % page_size
        a.tables[j, :len(pages)] = pages
        a.last[j] = at + n - 1
        if next_tokens is not None:
            seq = next_tokens[w.request_id]
            nxt = seq[w.start + 1:w.end + 1]
            a.targets[at:at + len(nxt)] = nxt
        at += n
    return a


def _count(kind: str) -> None:
    TRACES[kind] += 1


@functools.partial(jax.jit, static_argnames=("config", "backend", "n_logprobs"), donate_argnums=(1,))
def ragged_step(params, pool: PagedCache, a: StepArrays, rows: RowSettings, prev, *, config: GPTConfig,
                backend: Backend, n_logprobs: int):
    """One step: the tokens of `a` through the model over the page pool (their keys and values written to
    their slots), then each request row's next token drawn from the logits after its last token, with its
    logprob and the n most likely. A token whose `a.feed` is a row r >= 0 is the previous step's draw
    `prev[r]` (its "next" output, still on the device: asynchronous scheduling plans a step before the
    last one's draws are read). Returns (the pool, outputs); outputs' "next" are the draws padded to
    prev's length (the next step's `prev`), "hidden" [T, D] the final hidden states, which `token_scores`
    turns into prompt logprobs (left on the device otherwise)."""
    _count("ragged_step")
    pool, out, h_TxD = _step(params, pool, _fed(a, prev), rows, config, backend, n_logprobs)
    return pool, dict(out, hidden=h_TxD, next=jnp.zeros_like(prev).at[:out["token"].shape[0]].set(out["token"]))


def _fed(a: StepArrays, prev) -> StepArrays:
    """`a` with each token that the previous step drew (feed >= 0) taken from its draws on the device."""
    return dataclasses.replace(a, tokens=jnp.where(a.feed >= 0, prev[jnp.maximum(a.feed, 0)], a.tokens))


@functools.partial(jax.jit, static_argnames=("config", "backend", "n_logprobs"))
def token_scores(params, h_TxD, targets_T, *, config: GPTConfig, backend: Backend, n_logprobs: int):
    """Each token's logprob of the token after it (`targets`: prompt logprobs), its n most likely
    alternatives and whether it was the argmax, from a step's hidden states: the model's head alone, a
    program that compiles in a fraction of a step's time (so warmup compiles one per shape, not a second
    copy of every step)."""
    _count("token_scores")
    variables = params.variables() if isinstance(params, DecodeWeights) else {"params": params}
    logits_TxV = GPT(config, backend).apply(variables, h_TxD[None], method=GPT.head)[0]
    lp_T, top_ids, top_lps = token_logprobs(logits_TxV, targets_T, n_logprobs)
    return dict(prompt_lp=lp_T, prompt_top_ids=top_ids, prompt_top_lps=top_lps,
                prompt_greedy=argmax_last(logits_TxV) == targets_T)


def _step(params, pool: PagedCache, a: StepArrays, rows: RowSettings, config, backend, n_logprobs):
    model = GPT(config, backend)
    variables = params.variables() if isinstance(params, DecodeWeights) else {"params": params}
    cache = pool.step(a.rows, a.positions, a.slots, a.limits, a.tables)
    h_1xTxD, cache = model.apply(variables, a.tokens[None], cache, hidden=True)
    last_RxV = model.apply(variables, h_1xTxD[:, a.last], method=GPT.head)[0]
    tok = sample_rows(last_RxV, rows)
    lp, ids, lps = token_logprobs(last_RxV, tok, n_logprobs, rows.top_wanted)
    return cache.pool(), dict(token=tok, logprob=lp, top_ids=ids, top_lps=lps), h_1xTxD[0]


@functools.partial(jax.jit, static_argnames=("config", "backend", "n_logprobs", "steps"), donate_argnums=(1,))
def ragged_decode_steps(params, pool: PagedCache, a: StepArrays, rows: RowSettings, n_steps, prev, *,
                        config: GPTConfig, backend: Backend, n_logprobs: int, steps: int):
    """The first `n_steps` (traced, 1 to `steps`) of `steps` decode steps in one program, for a step of
    decoding requests only (token t is row t's): each step's draws fed to the next, its positions one
    further, written through the block tables (which must already hold the pages those positions need),
    the i-th draw keyed with rows.index + i as single steps key it. Outputs [steps, R, ...], the first
    n_steps filled; padding tokens (limit 0) stay on page 0 and see nothing. `prev` as `ragged_step`'s."""
    _count("ragged_decode_steps")
    a = _fed(a, prev)
    ps, r = pool.page_size, a.tables.shape[0]
    valid = a.limits > 0
    outs = dict(token=jnp.zeros((steps, r), jnp.int32), logprob=jnp.zeros((steps, r), jnp.float32),
                top_ids=jnp.zeros((steps, r, n_logprobs), jnp.int32),
                top_lps=jnp.zeros((steps, r, n_logprobs), jnp.float32))

    def body(i, carry):
        pool, tokens, outs = carry
        pos = a.positions + i
        page = jnp.take_along_axis(a.tables[a.rows], jnp.minimum(pos // ps, a.tables.shape[1] - 1)[:, None], 1)[:, 0]
        sub = dataclasses.replace(a, tokens=tokens, positions=pos, slots=jnp.where(valid, page * ps + pos % ps, 0),
                                  limits=jnp.where(valid, pos + 1, 0))
        pool, out, _ = _step(params, pool, sub, rows._replace(index=rows.index + i), config, backend, n_logprobs)
        outs = {k: jax.lax.dynamic_update_index_in_dim(outs[k], out[k].astype(outs[k].dtype), i, 0) for k in outs}
        return pool, out["token"][a.rows], outs

    pool, _, outs = jax.lax.fori_loop(0, jnp.clip(n_steps, 1, steps), body, (pool, a.tokens, outs))
    return pool, outs


def idle_rows(n: int) -> RowSettings:
    """Greedy settings for n padding rows."""
    return RowSettings(np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32),
                       np.zeros((n, 2), np.uint32), np.zeros(n, np.int32), np.array(False))


def warm_arrays(shape: tuple, table_width: int) -> StepArrays:
    """A step of padding only (every token on page 0, seeing nothing): what warmup runs."""
    t, r = shape
    return StepArrays(*(np.zeros(t, np.int32) for _ in range(5)), np.zeros((r, table_width), np.int32),
                      np.zeros(r, np.int32), np.zeros(t, np.int32), np.full(t, -1, np.int32))


jax.tree_util.register_dataclass(StepArrays, data_fields=[f.name for f in dataclasses.fields(StepArrays)],
                                 meta_fields=[])


def lower_programs(config: GPTConfig, calls: Sequence[tuple], *, num_pages: int, page_size: int, table_width: int,
                   steps: dict, backend: Optional[Backend] = None, sharding=None, max_logprobs: int = 20,
                   quantize: Optional[str] = None, kv_dtype: Optional[str] = None, params=None) -> dict:
    """The programs `calls` ((shape, kind) from `programs`) lowered for abstract inputs placed on `sharding`
    (nothing allocated): {(shape, kind): lowered}, and "pool" (the abstract page pool) and "weights" (the
    largest shape's abstract weights). `.compile()` them to check them for another platform's devices."""
    from jaxgpt.backends import resolve

    backend = backend or resolve(config)
    config = config.replace(remat="none")

    def place(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)

    layout = pool_layout(config, backend, kv_dtype)  # (the backend's)
    pool = place(jax.eval_shape(lambda: PagedCache.create_pool(config, num_pages, page_size, kv_dtype, layout)))
    static = dict(config=config, backend=backend, n_logprobs=max_logprobs)
    prev = place(jax.ShapeDtypeStruct((max(r for (_, r), _ in calls),), jnp.int32))
    # (Pallas' TPU lowering asks the device kind of the abstract mesh in context, else of this process's
    # default device: a CPU compiling for a TPU target names the target's)
    mesh = getattr(sharding, "mesh", None)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None else contextlib.nullcontext():
        out, weights = _lower_each(calls, config, backend, quantize, params, place, pool, table_width, steps,
                                   static, prev)
    out["pool"], out["weights"] = pool, weights
    return out


def _lower_each(calls, config, backend, quantize, params, place, pool, table_width, steps, static, prev) -> tuple:
    from jaxgpt.engine.slots import _abstract_weights

    out, weights = {}, None
    for (t, r), kind in calls:
        p, prepared, _ = _abstract_weights(config, backend, t, quantize, params)
        weights = place(DecodeWeights(p, prepared))
        a = place(jax.eval_shape(lambda t=t, r=r: jax.tree.map(jnp.asarray, warm_arrays((t, r), table_width))))
        rows = place(jax.eval_shape(lambda r=r: jax.tree.map(jnp.asarray, idle_rows(r))))
        if kind == "steps":
            n = place(jax.ShapeDtypeStruct((), jnp.int32))
            out[((t, r), kind)] = ragged_decode_steps.lower(weights, pool, a, rows, n, prev, steps=steps[(t, r)],
                                                            **static)
        elif kind == "scores":
            h = place(jax.ShapeDtypeStruct((t, config.n_embd), jnp.dtype(config.compute_dtype)))
            out[((t, r), kind)] = token_scores.lower(weights, h, a.targets, **static)
        else:
            out[((t, r), kind)] = ragged_step.lower(weights, pool, a, rows, prev, **static)
    return out, weights
