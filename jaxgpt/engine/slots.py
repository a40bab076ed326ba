"""The engine: many requests at once over one KV cache of fixed slots (continuous batching).

Requests (token ids and their own settings) are admitted into free slots as they come. Each `step` runs
at most `prefill_budget` prompt tokens through the model, in calls of at most `prefill_chunk` (a long
prompt enters over several steps, so the rows already decoding keep their pace) and then one compiled
decode step over every slot, each slot's sampler settings passed as arrays (`sampling.RowSettings`): no
setting is part of a program's key. A finished slot is free at the next step. A request's randomness is
its own key folded with its token index, so its tokens depend only on its prompt, settings and seed,
never on its neighbours.

Programs: a decode step per power-of-two count of leading slots (up to all of them; with speculative
decoding a k + 1 wide step per count too, with `decode_steps=k` a k-step one), one prefill per chunk
length and window of the slot's positions that fits it (`prefill_programs`; twice: with and without
per-position logprobs), with `packed_prefill` one packed
prefill per packed length (`packed_lengths`), one slot copy, for one (slots, max_len). `warmup()` compiles
them all.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import sys
import time
from typing import Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.backends import Backend, DecodeWeights, resolve
from jaxgpt.backends.base import cast_floats
from jaxgpt.cache import KVCache, PackedCache
from jaxgpt.checks import SEED_MAX, SEED_MIN, is_int
from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT
from jaxgpt.quantize import check_kv_dtype, check_quantize
from jaxgpt.sampling import (RowSettings, _check_rng, _dequantized_jit, argmax_last, on_params_mesh, params_mesh,
                             sample_rows, token_logprobs, validate_sampler)
from jaxgpt.speculative import Speculative, ngram_lookup

# Traces of the engine's programs, by kind; `Engine.programs_compiled` reads it.
TRACES: collections.Counter = collections.Counter()


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: prompt token ids and its own settings. `logprobs`: None, or how many most likely
    alternatives to return with each token (0: the token's own logprob only). `prompt_logprobs`: also the
    logprob of each prompt token from index `score_from` on, given the tokens before it (echo, scoring).
    `seed` (an int in [-2**63, 2**63 - 1]) or `rng` (a PRNG key) makes its draws; `stop_token_ids` end it
    (the token is kept). A top_k above the vocabulary is the vocabulary (no filter), as in `generate`."""

    prompt: tuple
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 0
    rng: Optional[jax.Array] = None
    stop_token_ids: tuple = ()
    logprobs: Optional[int] = None
    prompt_logprobs: bool = False
    score_from: int = 1


@dataclasses.dataclass
class Token:
    """A generated token, its logprob under the model (float32 log-softmax, before temperature and
    filters) and the `logprobs` most likely alternatives as (id, logprob) pairs."""

    id: int
    logprob: float
    top: list


@dataclasses.dataclass
class Completion:
    """What a request produced: its tokens, why it ended ("length", "stop" or "cancelled"), and the prompt
    tokens' logprobs (index i: token i given tokens < i; None before `score_from`) with their alternatives
    and whether each was the most likely token."""

    request_id: int
    prompt: tuple
    tokens: list = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    prompt_logprobs: Optional[list] = None
    prompt_top: Optional[list] = None
    prompt_greedy: Optional[list] = None
    # wall-clock times (time.perf_counter): submitted, first token out, finished; seconds in its prefill
    submitted: float = 0.0
    first_token: Optional[float] = None
    finished: Optional[float] = None
    prefill_s: float = 0.0

    @property
    def token_ids(self) -> list:
        return [t.id for t in self.tokens]


@dataclasses.dataclass
class Event:
    """One step's news for one request: a new token, and the finish reason when it ended (then also the
    request's `Completion`, with its prompt logprobs and times, for a caller that only sees events)."""

    request_id: int
    token: Optional[Token]
    finish_reason: Optional[str] = None
    completion: Optional[Completion] = None


@dataclasses.dataclass
class _Live:
    """A request in a slot: where its prompt has got to and what it has produced."""

    rid: int
    req: Request
    key_data: np.ndarray
    out: Completion
    callback: Optional[Callable]
    cursor: int = 0                   # prompt tokens whose keys and values are in the cache
    wait_for: Optional[tuple] = None  # (slot, request id, n): copy n positions from that request's slot
    last: int = 0                     # the latest generated token (fed at the next decode step)


# ---------------------------------------------------------------------------------------------------
# The programs

def _count(kind: str) -> None:
    TRACES[kind] += 1


@functools.partial(jax.jit, static_argnames=("config", "backend", "prompt_logprobs", "n_logprobs", "window"),
                   donate_argnums=(1,))
def _prefill(params, cache: KVCache, slot, start, tokens_1xC, n, targets_C, rows: RowSettings, *,
             config: GPTConfig, backend: Backend, prompt_logprobs: bool, n_logprobs: int,
             window: Optional[int] = None):
    """The first `n` of tokens [1, C] into slot `slot` from position `start`, then a draw of the token
    after them (used when they end the prompt) with its logprobs; with `prompt_logprobs` also each
    position's logprob of `targets` (the next prompt token), its alternatives and whether it was argmax.
    `window` (at least start + C; default max_len): the slot's positions the chunk reads and writes.
    `params` may also be `DecodeWeights` whose "prepared" kernels take any row count (int8 `Int8Kernel`s
    multiplied with XLA, as `lower_engine` passes for the accelerators): the chunk then runs on them."""
    _count("prefill")
    model = GPT(config, backend)
    variables = params.variables() if isinstance(params, DecodeWeights) else {"params": params}
    one = cache.slot(slot, window=window).replace(lengths=start[None])
    extra = {}
    if prompt_logprobs:
        logits_1xCxV, one = model.apply(variables, tokens_1xC, one, token_lengths=n[None])
        lp_C, top_ids, top_lps = token_logprobs(logits_1xCxV[0], targets_C, n_logprobs)
        extra = dict(prompt_lp=lp_C, prompt_top_ids=top_ids, prompt_top_lps=top_lps,
                     prompt_greedy=argmax_last(logits_1xCxV[0]) == targets_C)
        last_1xV = jax.lax.dynamic_slice_in_dim(logits_1xCxV[0], n - 1, 1, axis=0)
    else:
        logits_1x1xV, one = model.apply(variables, tokens_1xC, one, token_lengths=n[None],
                                        logits_index=(n - 1)[None])
        last_1xV = logits_1x1xV[:, 0]
    tok = sample_rows(last_1xV, rows)
    lp, ids, lps = token_logprobs(last_1xV, tok, n_logprobs)
    cache = cache.put_positions(slot, one, start, tokens_1xC.shape[1])
    return cache, dict(token=tok[0], logprob=lp[0], top_ids=ids[0], top_lps=lps[0], **extra)


@functools.partial(jax.jit, static_argnames=("config", "backend", "n_logprobs", "window"), donate_argnums=(1,))
def _prefill_packed(params, cache: KVCache, tokens_N, segments_N, positions_N, offsets_G, last_G, slots_G, lengths_G,
                    rows: RowSettings, *, config: GPTConfig, backend: Backend, n_logprobs: int, window: int):
    """Whole prompts of several slots packed into one forward of N tokens: token n is prompt
    `segments[n]`'s token at `positions[n]`; prompt g starts at `offsets[g]`, ends at `last[g]` and is
    `lengths[g]` tokens long (none longer than `window`). Each prompt attends within itself
    (`PackedCache`); `window` packed positions from its start then go to slot `slots[g]`
    (`PackedCache.write_into`), whose length becomes `lengths[g]`, and its next token is drawn from
    position `last[g]` with its logprobs. A padding prompt repeats prompt 0 (the same write again)."""
    _count("prefill_packed")
    model = GPT(config, backend)
    variables = params.variables() if isinstance(params, DecodeWeights) else {"params": params}
    stored = (cache.k[0] if isinstance(cache.k, tuple) else cache.k).dtype  # (the prompts attend to keys so kept)
    packed = PackedCache.pack(config, segments_N, positions_N, stored, window)
    h_1xNxD, packed = model.apply(variables, tokens_N[None, :], packed, hidden=True)
    last_GxV = model.apply(variables, h_1xNxD[:, last_G], method=GPT.head)[0]
    cache = packed.write_into(cache, offsets_G, slots_G, min(window, cache.max_len))
    cache = cache.replace(lengths=cache.lengths.at[slots_G].set(lengths_G))
    tok = sample_rows(last_GxV, rows)
    lp, ids, lps = token_logprobs(last_GxV, tok, n_logprobs, rows.top_wanted)
    return cache, dict(token=tok, logprob=lp, top_ids=ids, top_lps=lps)


@functools.partial(jax.jit, static_argnames=("config", "backend", "n_logprobs"), donate_argnums=(1,))
def _decode(weights: DecodeWeights, cache: KVCache, tokens_S, active_S, rows: RowSettings, *,
            config: GPTConfig, backend: Backend, n_logprobs: int):
    """The first S slots' latest tokens through the model (S = tokens' length, up to every slot; inactive
    slots' lengths stay), then each active slot's next token drawn with its own settings, with logprobs."""
    _count("decode")
    s = tokens_S.shape[0]
    if s == cache.batch_size:
        cache, out = _decode_rows(weights, cache, tokens_S, active_S, rows, config, backend, n_logprobs)
        return cache, out
    first, out = _decode_rows(weights, _first(cache, s, backend), tokens_S, active_S, rows, config, backend,
                              n_logprobs)
    return _merge_first(cache, first, backend), out


@functools.partial(jax.jit, static_argnames=("config", "backend", "n_logprobs", "steps"), donate_argnums=(1,))
def _decode_steps(weights: DecodeWeights, cache: KVCache, tokens_S, active_S, rows: RowSettings, n_steps, *,
                  config: GPTConfig, backend: Backend, n_logprobs: int, steps: int):
    """The first `n_steps` (traced, 1 to `steps`) of `steps` decode steps over the first S slots in one
    program, each step's draw fed to the next (the call's i-th token drawn with the row's key folded with
    rows.index + i, as single steps draw it). Outputs [steps, S, ...], the first n_steps filled. Every row
    runs all the steps: the engine keeps a row's tokens up to its stop token, and what it wrote past them
    lies beyond the prefix it keeps for reuse. (n_steps traced: one program for a request's last few tokens
    too, instead of a call each.)"""
    _count("decode")
    s = tokens_S.shape[0]
    whole = s == cache.batch_size
    first = cache if whole else _first(cache, s, backend)
    n = n_logprobs
    outs = dict(token=jnp.zeros((steps, s), jnp.int32), logprob=jnp.zeros((steps, s), jnp.float32),
                top_ids=jnp.zeros((steps, s, n), jnp.int32), top_lps=jnp.zeros((steps, s, n), jnp.float32))

    def body(i, carry):
        c, tok, outs = carry
        c, out = _decode_rows(weights, c, tok, active_S, rows._replace(index=rows.index + i), config, backend,
                              n_logprobs)
        outs = {k: jax.lax.dynamic_update_index_in_dim(outs[k], out[k].astype(outs[k].dtype), i, 0) for k in outs}
        return c, out["token"], outs

    first, _, outs = jax.lax.fori_loop(0, jnp.clip(n_steps, 1, steps), body, (first, tokens_S, outs))
    return (first if whole else _merge_first(cache, first, backend)), outs


def _first(cache: KVCache, s: int, backend: Backend) -> KVCache:
    """The first s slots as a cache: a view of the buffers where the backend attends over a cache as
    stored (no copy), else a copy of those rows (reading a view through XLA copies the whole buffers)."""
    return cache.view_first(s) if backend.cache_attention is not None else cache.first(s)


def _merge_first(cache: KVCache, first: KVCache, backend: Backend) -> KVCache:
    return cache.merge_view(first) if backend.cache_attention is not None else cache.merge_first(first)


def _decode_rows(weights, cache, tokens_S, active_S, rows, config, backend, n_logprobs):
    model = GPT(config, backend)
    variables = weights.variables()
    # an idle slot's step writes at its length, which a slot whose cache is full would take past the end:
    # its write goes to the last position instead (never part of a prefix kept for reuse)
    lengths = cache.lengths
    cache = cache.replace(lengths=jnp.where(active_S, lengths, jnp.minimum(lengths, cache.max_len - 1)))
    logits_Sx1xV, cache = model.apply(variables, tokens_S[:, None], cache, token_lengths=active_S.astype(jnp.int32))
    cache = cache.replace(lengths=jnp.where(active_S, cache.lengths, lengths))
    tok = sample_rows(logits_Sx1xV[:, 0], rows)
    lp, ids, lps = token_logprobs(logits_Sx1xV[:, 0], tok, n_logprobs, rows.top_wanted)
    return cache, dict(token=tok, logprob=lp, top_ids=ids, top_lps=lps)


@functools.partial(jax.jit, static_argnames=("config", "backend", "n_logprobs"), donate_argnums=(1,))
def _verify(weights: DecodeWeights, cache: KVCache, tokens_SxW, n_prop_S, active_S, rows: RowSettings, *,
            config: GPTConfig, backend: Backend, n_logprobs: int):
    """Speculative decoding's step over the first S slots: each row's latest token and its proposals
    ([S, W], W = k + 1; row s's first n_prop[s] proposals count) through the model at once, the token the
    row's own sampler draws at each of the W positions (its key folded with that token's index, as a plain
    step would), and how many proposals match those draws. Row s emits draws 0 .. n_acc[s]: the tokens a
    plain step per token would have drawn, so greedy and seeded output are unchanged (for an n-gram
    proposal, a point mass, accepting exactly when the draw equals it is the standard accept/resample
    rule). The cache keeps the accepted positions; active rows must have W free positions."""
    _count("verify")
    s = tokens_SxW.shape[0]
    if s == cache.batch_size:
        return _verify_rows(weights, cache, tokens_SxW, n_prop_S, active_S, rows, config, backend, n_logprobs)
    first, out = _verify_rows(weights, _first(cache, s, backend), tokens_SxW, n_prop_S, active_S, rows, config,
                              backend, n_logprobs)
    return _merge_first(cache, first, backend), out


def _verify_rows(weights, cache, tokens_SxW, n_prop_S, active_S, rows, config, backend, n_logprobs):
    s, w = tokens_SxW.shape
    model = GPT(config, backend)
    lengths = cache.lengths
    # idle rows write their W positions where they fit (the engine drops those from a slot's reusable prefix)
    cache = cache.replace(lengths=jnp.where(active_S, lengths, jnp.minimum(lengths, cache.max_len - w)))
    logits_SxWxV, cache = model.apply(weights.variables(), tokens_SxW, cache,
                                      token_lengths=jnp.where(active_S, w, 0).astype(jnp.int32))
    flat = logits_SxWxV.reshape(s * w, -1)
    each = functools.partial(jnp.repeat, repeats=w, axis=0, total_repeat_length=s * w)
    at = RowSettings(each(rows.temperature), each(rows.top_k), each(rows.top_p), each(rows.key_data),
                     (rows.index[:, None] + jnp.arange(w, dtype=rows.index.dtype)[None, :]).reshape(-1))
    tok = sample_rows(flat, at)
    lp, ids, lps = token_logprobs(flat, tok, n_logprobs, rows.top_wanted)
    tok_SxW = tok.reshape(s, w)
    match = (tokens_SxW[:, 1:] == tok_SxW[:, :-1]) & (jnp.arange(w - 1)[None, :] < n_prop_S[:, None])
    n_acc = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    cache = cache.replace(lengths=jnp.where(active_S, lengths + n_acc + 1, lengths))
    return cache, dict(token=tok_SxW, n_acc=n_acc, logprob=lp.reshape(s, w), top_ids=ids.reshape(s, w, -1),
                       top_lps=lps.reshape(s, w, -1))


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy(cache: KVCache, src, dst) -> KVCache:
    _count("copy")
    return cache.copy_slot(src, dst)


@functools.partial(jax.jit, static_argnames=("config", "backend", "batch_size", "quantize"))
def _prepare(params, *, config: GPTConfig, backend: Backend, batch_size: int, quantize=None):
    return backend.prepare_decode(params, batch_size, config.compute_dtype, config.tie_embeddings, quantize,
                                  config=config)


def chunk_lengths(prefill_chunk: int) -> tuple:
    """The prefill programs' chunk lengths: powers of two up to 64, then multiples of max(32,
    prefill_chunk / 8) (a chunk's cost grows with its length past ~64 tokens: finer steps there pad less;
    bench/README.md), and `prefill_chunk` itself. 256 gives 1, 2, ..., 64, 96, 128, ..., 224, 256."""
    step = max(32, prefill_chunk // 8)
    powers = {1 << i for i in range(7) if 1 << i < prefill_chunk}
    return tuple(sorted(powers | {m for m in range(step, prefill_chunk, step) if m > 64} | {prefill_chunk}))


MAX_PACKED_PROMPTS = 8  # prompts per packed prefill call (each costs a row of the head's matmul)
MAX_PACKED_TOKENS = 1024  # tokens per packed prefill call (its attention: N x (64 + prefill_chunk) scores)


def check_sizes(config: GPTConfig, slots, max_len=None, prefill_chunk=256, prefill_budget=None,
                max_logprobs=20) -> tuple[int, int]:
    """The engine's sizes checked, as `Engine` and `lower_engine` take them (a ValueError naming the first
    that is wrong): (max_len, prefill chunk) as the engine uses them, max_len by default the context and
    the chunk at most max_len."""
    max_len = config.block_size if max_len is None else max_len
    prefill_budget = prefill_chunk if prefill_budget is None else prefill_budget
    for name, value, lo in (("slots", slots, 1), ("max_len", max_len, 2), ("prefill_chunk", prefill_chunk, 1),
                            ("prefill_budget", prefill_budget, 1),
                            ("max_logprobs", max_logprobs, 1)):
        if not is_int(value) or value < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    if max_len > config.block_size:
        raise ValueError(f"max_len ({max_len}) exceeds the model's block_size ({config.block_size})")
    if max_logprobs > config.vocab_size:
        raise ValueError(f"max_logprobs ({max_logprobs}) exceeds the vocabulary ({config.vocab_size})")
    return int(max_len), min(int(prefill_chunk), int(max_len))


def check_packed(config: GPTConfig, slots: int, tokens) -> int:
    """`lower_engine`'s `packed`, the tokens of a packed prefill call, checked: it packs two or more
    prompts (slots >= 2) of 2 to min(MAX_PACKED_TOKENS, block_size) tokens; a ValueError otherwise."""
    most = min(MAX_PACKED_TOKENS, config.block_size)
    if slots < 2 or not is_int(tokens) or not 2 <= tokens <= most:
        raise ValueError(f"the packed prefill needs slots >= 2 and 2 <= tokens <= {most} (at most "
                         f"{MAX_PACKED_TOKENS} and the context); got slots {slots}, tokens {tokens}")
    return int(tokens)


def packed_lengths(budget: int) -> tuple:
    """The packed prefill programs' lengths: `chunk_lengths` of min(budget, 1024) from 64 on (two or more
    whole prompts in one call; a prompt alone takes the single-prompt programs)."""
    cap = min(budget, MAX_PACKED_TOKENS)
    return tuple(c for c in chunk_lengths(cap) if c >= min(64, cap))


def prefill_windows(prefill_chunk: int, max_len: int) -> tuple:
    """The positions of its slot a prefill program reads and writes: `prefill_chunk` times powers of 4
    below `max_len`, and `max_len`; a chunk takes the smallest that holds its end. XLA's attention over a
    chunk, and the copy of its slot out and back, cost by the window's positions, not by the filled ones
    (bench/README.md, "Prefill windows")."""
    windows, w = {max_len}, prefill_chunk
    while w < max_len:
        windows.add(w)
        w *= 4
    return tuple(sorted(windows))


def prefill_programs(prefill_chunk: int, max_len: int) -> list:
    """(chunk length, window) of every prefill program (each twice: with and without prompt logprobs)."""
    return [(c, w) for w in prefill_windows(prefill_chunk, max_len) for c in chunk_lengths(prefill_chunk) if c <= w]


def decode_sizes(slots: int) -> tuple:
    """The decode programs' row counts: a step decodes the first n slots, n the smallest of these (powers of
    two below `slots`, and `slots`) that covers every generating slot (a lone request does not pay for idle
    slots' rows)."""
    return tuple(sorted({1 << i for i in range(slots.bit_length()) if 1 << i < slots} | {slots}))


def steps_by_rows(decode_steps, slots: int) -> dict:
    """Decode steps a call for each decode row count (`decode_sizes(slots)`): `decode_steps` an int (every
    count), or a dict {rows: steps} (each count takes the entry of the largest key at most it; key 1 needed),
    e.g. {1: 16, 2: 8, 4: 4}: a call's fixed cost is a larger share of a step over few rows, and the steps
    an arriving request may wait for are shorter there (bench/README.md)."""
    table = decode_steps if isinstance(decode_steps, dict) else {1: decode_steps}
    valid = all(is_int(r) and r >= 1 and is_int(k) and k >= 1 for r, k in table.items())
    if not valid or 1 not in table:
        raise ValueError(f"decode_steps must be an integer >= 1 or a dict {{rows: steps}} of integers >= 1 with "
                         f"the key 1, got {decode_steps!r}")
    return {n: int(table[max(r for r in table if r <= n)]) for n in decode_sizes(slots)}


def _check_speculative(speculative):
    if speculative is None:
        return None
    if not isinstance(speculative, Speculative):
        raise ValueError(f"speculative must be a jaxgpt.Speculative, got {type(speculative).__name__}")
    if speculative.uses_model:
        raise ValueError("the engine drafts by n-gram lookup (Speculative(draft='ngram')); a draft model runs in "
                         "Decoder(..., speculative=Speculative(draft=(params, config)))")
    return speculative


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------------------------
# The engine


def seed_key(seed: int) -> jax.Array:
    """A request's key from its 64-bit seed: jax.random.key(seed) within 32 bits (what it always was); past
    them (jax.random.key keeps only the low 32 bits without x64) the high half folded in, so that seeds 0
    and 2**32 draw differently, as vLLM's do."""
    seed = int(seed)
    if -2 ** 31 <= seed < 2 ** 32:
        return jax.random.key(seed)
    return jax.random.fold_in(jax.random.key(seed & 0xFFFFFFFF), (seed >> 32) & 0xFFFFFFFF)


def decode_weights(params, config: GPTConfig, backend: Backend, quantize, row_counts: Sequence[int]) -> dict:
    """The backend's decode forms of `params` for each step's row count, made once: {rows: DecodeWeights};
    counts whose forms are alike share one copy (the CPU backend: packed kernels for up to 16 rows, its
    matmul's above)."""
    by_rows, made = {}, {}
    for n in sorted(set(row_counts)):
        def prepare(p, n=n):
            return _prepare.__wrapped__(p, config=config, backend=backend, batch_size=n, quantize=quantize)
        shape = jax.eval_shape(prepare, params)
        key = (jax.tree.structure(shape), tuple((x.shape, x.dtype) for x in jax.tree.leaves(shape)))
        if key not in made:
            made[key] = DecodeWeights(params, _prepare(params, config=config, backend=backend, batch_size=n,
                                                       quantize=quantize))
        by_rows[n] = made[key]
    return by_rows


def new_request(prompt: Sequence[int], settings: dict) -> Request:
    """A `Request` from `submit`'s arguments (not yet checked against an engine: `check_request`)."""
    unknown = set(settings) - {f.name for f in dataclasses.fields(Request)}
    if unknown:
        raise TypeError(f"unknown request setting(s) {sorted(unknown)}; known: "
                        f"{[f.name for f in dataclasses.fields(Request)]}")
    tokens = np.asarray(prompt)
    if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
        raise ValueError(f"prompt must be a sequence of token ids (integers), got {prompt!r:.80}")
    return Request(tuple(tokens.tolist()), **settings)


def request_start(rid: int, req: Request) -> tuple:
    """(its PRNG key's data, uint32 [2], and its empty Completion) for a request just submitted."""
    key = seed_key(req.seed) if req.rng is None else req.rng
    if not jax.dtypes.issubdtype(getattr(key, "dtype", np.float32), jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))  # a raw uint32 [2] key
    out = Completion(rid, req.prompt, submitted=time.perf_counter())
    if req.prompt_logprobs:
        out.prompt_logprobs, out.prompt_top, out.prompt_greedy = ([None] * len(req.prompt) for _ in range(3))
    return np.asarray(jax.random.key_data(key), np.uint32), out


def check_request(req: Request, cfg: GPTConfig, max_len: int, max_logprobs: int) -> Request:
    """`req` validated against an engine's model, length and logprobs (ValueError naming the field),
    with its integers made Python ints and top_k bounded by the vocabulary."""
    p = req.prompt
    if not p:
        raise ValueError("prompt must hold at least one token id")
    if not all(is_int(t) and 0 <= t < cfg.vocab_size for t in p):
        bad = next(t for t in p if not (is_int(t) and 0 <= t < cfg.vocab_size))
        raise ValueError(f"prompt token {bad!r} is outside the vocabulary [0, {cfg.vocab_size})")
    if not is_int(req.max_tokens) or req.max_tokens < 0:
        raise ValueError(f"max_tokens must be an integer >= 0, got {req.max_tokens!r}")
    if len(p) + req.max_tokens > max_len:
        raise ValueError(f"prompt ({len(p)} tokens) + max_tokens ({req.max_tokens}) exceeds the engine's "
                         f"max_len ({max_len}); shorten the prompt or ask for fewer tokens")
    validate_sampler(req.temperature, req.top_k, req.top_p)
    if not is_int(req.seed) or not SEED_MIN <= req.seed <= SEED_MAX:
        raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1], got {req.seed!r}")
    if req.rng is not None:
        _check_rng(req.rng)
    for t in req.stop_token_ids:
        if not is_int(t) or not 0 <= t < cfg.vocab_size:
            raise ValueError(f"stop token {t!r} is outside the vocabulary [0, {cfg.vocab_size})")
    if req.logprobs is not None and (not is_int(req.logprobs) or not 0 <= req.logprobs <= max_logprobs):
        raise ValueError(f"logprobs must be an integer in [0, {max_logprobs}] or None, got {req.logprobs!r}")
    if not is_int(req.score_from) or not 1 <= req.score_from <= max(1, len(p)):
        raise ValueError(f"score_from must be in [1, {len(p)}], got {req.score_from!r}")
    # every integer that goes into the step's int32 arrays is bounded here (top_k by the vocabulary, as
    # generate does), so no request can overflow a step that its neighbours share
    top_k = None if req.top_k is None else min(int(req.top_k), cfg.vocab_size)
    return dataclasses.replace(req, max_tokens=int(req.max_tokens), seed=int(req.seed), top_k=top_k,
                               stop_token_ids=tuple(int(t) for t in req.stop_token_ids))


class Conveniences:
    """What both engines offer on top of `submit` and `step` (`run`, `stream`, `score`); an engine gives
    `_completions(ids)`: the Completion of each request just submitted, by id."""

    def run(self, requests: Sequence[dict] = ()) -> list[Completion]:
        """Submit `requests` (each a dict of `submit`'s arguments, with "prompt") and step until every
        request is done (those submitted before too); the given requests' completions, in order."""
        ids = [self.submit(**r) for r in requests]
        outs = self._completions(ids)
        while self.has_work():
            self.step()
        return [outs[rid] for rid in ids]

    def stream(self, prompt: Sequence[int], **settings) -> Iterator[Token]:
        """One request's tokens as they are decoded (stepping the engine, others' requests included)."""
        queue: collections.deque = collections.deque()
        self.submit(prompt, callback=queue.append, **settings)
        while True:
            while queue:
                event = queue.popleft()
                if event.token is not None:
                    yield event.token
                if event.finish_reason is not None:
                    return
            self.step()

    def score(self, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> list[tuple]:
        """Each (context, continuation) pair's summed logprob of the continuation given the context, and
        whether every continuation token is the most likely one: [(logprob, is_greedy)]. Pairs that share a
        context compute it once."""
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
        reqs = []
        for ctx, cont in zip(contexts, continuations):
            ctx, cont = [int(t) for t in ctx], [int(t) for t in cont]
            if not ctx or not cont:
                raise ValueError("each context and each continuation must hold at least one token")
            reqs.append(dict(prompt=ctx + cont, max_tokens=0, prompt_logprobs=True, score_from=len(ctx)))
        results = []
        for out, ctx in zip(self.run(reqs), contexts):
            lps = out.prompt_logprobs[len(ctx):]
            results.append((float(np.sum(np.asarray(lps, np.float64))), all(out.prompt_greedy[len(ctx):])))
        return results


class Engine(Conveniences):
    """A pool of `slots` rows over one KV cache of `max_len` positions each, serving requests as they come.

    `submit` queues a request and returns its id; each `step` admits waiting requests into free slots,
    prefills at most `prefill_budget` prompt tokens (default `prefill_chunk`; one call takes at most
    `prefill_chunk` of one prompt), decodes one token for every generating slot, and
    returns the step's `Event`s (a request's `callback`, if given, gets its own as they happen). `run`
    steps until every request is done; `stream` yields one request's tokens; `score` returns
    log-likelihoods. A prompt that begins with tokens already in some slot's cache (a free slot's, or a
    running request's) starts from a copy of them instead of computing them again.

    `quantize="int8"` decodes with int8 weights, as `sampling.Decoder` does: the engine's model is then
    `quantize.dequantized(params)` (prefill, scoring and prompt logprobs run it in float); with "w8a8" the
    int8 kernels with rounded rows, prompts included (`DecodeWeights.prefill_variables`). `kv_dtype="int8"`
    keeps the slots' keys and values as int8 with scales (a quarter of float32's cache bytes).
    `speculative=Speculative(k, draft="ngram")` decodes speculatively: each generating slot proposes up to
    k tokens by n-gram lookup in its own text, one step checks them all, and the slot emits every draw
    that matched and one more (`_verify`). Its tokens are the plain engine's, greedy and seeded alike;
    `stats` counts the proposed and accepted tokens.
    `packed_prefill=True` prefills the whole prompts of several newly admitted requests (each at most
    `prefill_chunk` tokens, without prompt logprobs) in one call: packed into one row up to the step's
    budget (at most 1024 tokens and 8 prompts), each attending within itself (`cache.PackedCache`), their
    keys and values then written into their slots; the tokens are those of one prompt a call (tests). Off
    by default: on a 2-core CPU it measured slower than one prompt a call with the native attention kernel
    (bench/README.md); it is for devices where a call's fixed cost dominates.
    `decode_steps=k` runs up to k decode steps in one compiled call while every request in a slot is
    generating (as many as the nearest to its end has to go, so a request's last tokens take one call too):
    the same tokens, without a call's fixed cost for each token (bench/README.md); a request that arrives
    meanwhile waits up to k steps, and tokens stream k at a time. A dict {rows: steps} sets k by the decode's
    rows (`steps_by_rows`; jaxgpt-serve's default {1: 16, 2: 8, 4: 4}). Not with `speculative`.
    Params placed on a mesh by `jaxgpt.shard_params` (say tensor=8) decode there (`mesh` says which), attention
    split by heads over `tensor`; with `split_cache` (default: on wherever `tensor` > 1) the KV cache lies
    split by kv head over `tensor` where the backend's layout allows (`KVCache.on_mesh`): a tensor-th of its
    bytes per device, each device writing and reading its own heads.
    """

    def __init__(self, params, config: GPTConfig, *, slots: int = 8, max_len: Optional[int] = None,
                 prefill_chunk: int = 256, max_logprobs: int = 20, backend: Optional[Backend] = None,
                 quantize: Optional[str] = None, kv_dtype: Optional[str] = None, speculative=None,
                 decode_steps=1, split_cache: Optional[bool] = None, prefill_budget: Optional[int] = None,
                 packed_prefill: bool = False):
        self.quantize = check_quantize(quantize)
        self.speculative = _check_speculative(speculative)
        self.kv_dtype = check_kv_dtype(kv_dtype)
        max_len, _ = check_sizes(config, slots, max_len, prefill_chunk, prefill_budget, max_logprobs)
        prefill_budget = prefill_chunk if prefill_budget is None else prefill_budget
        self.config = config.replace(remat="none")
        # params placed on a mesh: attention split by heads there, and the cache by kv head (split_cache)
        self.backend, cache_mesh = on_params_mesh(backend or resolve(config), params, split_cache)
        self.backend.setup()
        self.slots, self.max_len = int(slots), int(max_len)
        self.prefill_chunk, self.max_logprobs = min(int(prefill_chunk), self.max_len), int(max_logprobs)
        self.prefill_budget = int(prefill_budget)
        # decode steps a call by the decode's row count (decode_sizes); decode_steps: the most of them
        self._steps = steps_by_rows(1 if self.speculative is not None else decode_steps, self.slots)
        self.decode_steps = max(self._steps.values())
        # the params in the compute dtype (leaves already in it are kept, not copied) and the backend's
        # decode forms, made once per engine, not per step
        if self.quantize is not None:  # the float model the int8 weights stand for (int8's prefill runs it)
            params = _dequantized_jit(params, config=self.config)
        self.params = cast_floats(params, self.config.compute_dtype)
        # rows of a decode step -> DecodeWeights (a speculative step's rows: slots x (k + 1))
        sizes = decode_sizes(self.slots)
        self.weights = self._decode_weights(sizes + tuple(n * self.width for n in sizes))
        # what prompts run through: the params, or with w8a8 its int8 kernels (every matmul's rows rounded,
        # a prompt's as a decode step's; forms made for any row count)
        self._prefill_weights = self.weights[1] if self.quantize == "w8a8" else self.params
        self.cache = KVCache.create(self.config, self.slots, self.max_len, dtype=self.kv_dtype,
                                    layout=self.backend.cache_layout)
        self.mesh = params_mesh(params)
        if cache_mesh is not None:
            self.cache = self.cache.on_mesh(cache_mesh)
        self._static = dict(config=self.config, backend=self.backend)
        # whole prompts of several slots in one prefill call (`_prefill_packed`): lengths of the packed
        # programs, and prompts per call. Not on a mesh, nor for a registered attention other than the
        # built-in (the packed forward attends with its own segment mask)
        packable = packed_prefill and self.mesh is None and self.config.attention == "dot_product"
        budget = min(self.prefill_budget, self.config.block_size)  # (a forward's length is at most block_size)
        self._packed_lengths = packed_lengths(budget) if packable and self.slots > 1 else ()
        self._max_segments = min(self.slots, MAX_PACKED_PROMPTS)
        self._live: list[Optional[_Live]] = [None] * self.slots
        self._cached: list[list] = [[] for _ in range(self.slots)]  # token ids whose k, v each slot holds
        self._waiting: collections.deque = collections.deque()
        self._ids = itertools.count()
        self._traces_at_start = sum(TRACES.values())
        # prefill_tokens/_calls/_padding/_seconds, reused_tokens, copies; decode_steps/_calls/_seconds,
        # decode_rows (requests generating, summed over steps) and decode_width (rows computed, the same)
        self.stats = collections.Counter()

    @property
    def width(self) -> int:
        """Positions per row in a decode step: 1, or k + 1 when decoding speculatively."""
        return 1 if self.speculative is None else self.speculative.k + 1

    def _decode_weights(self, row_counts: Sequence[int]) -> dict:
        return decode_weights(self.params, self.config, self.backend, self.quantize, row_counts)

    # -- sizes and programs -------------------------------------------------------------------------

    @property
    def cache_bytes(self) -> int:
        """Bytes of the KV cache's keys and values (all slots)."""
        return self.cache.nbytes

    @property
    def programs_compiled(self) -> int:
        """Engine programs traced (compiled) since this engine was made (shared with engines of the same
        config and backend, which reuse them)."""
        return sum(TRACES.values()) - self._traces_at_start

    def warmup(self, prompt_logprobs: bool = True, progress: bool = False) -> int:
        """Compile every program this engine can run (each chunk length, the decode step, the slot copy);
        returns how many were compiled now. Before any request: it runs them on slot 0 and resets the cache.
        `progress`: a bar on stderr while they compile (when stderr is a terminal)."""
        if self.has_work():
            raise RuntimeError("warmup() runs the programs on the cache: call it before submitting requests")
        from tqdm import tqdm

        before = sum(TRACES.values())
        calls = self._warmup_calls(prompt_logprobs)
        with tqdm(total=len(calls), desc="compiling", unit="program", dynamic_ncols=True,
                  disable=not (progress and sys.stderr.isatty())) as bar:
            for call in calls:
                self.cache = call(self.cache)
                bar.update()
        self._cached = [[] for _ in range(self.slots)]
        self.cache = self.cache.replace(lengths=jnp.zeros_like(self.cache.lengths))
        return sum(TRACES.values()) - before

    def warmup_programs(self, prompt_logprobs: bool = True) -> int:
        """How many programs `warmup` runs (compiling those not compiled yet)."""
        return len(self._warmup_calls(prompt_logprobs))

    def _warmup_calls(self, prompt_logprobs: bool) -> list:
        """One call of each program, on slot 0: functions from the cache to the cache they leave."""
        calls, st = [], dict(n_logprobs=self.max_logprobs, **self._static)
        rows = self._rows([None])
        for c, w in prefill_programs(self.prefill_chunk, self.max_len):
            for lp in (False, True) if prompt_logprobs else (False,):
                calls.append(lambda cache, c=c, w=w, lp=lp: _prefill(
                    self._prefill_weights, cache, np.int32(0), np.int32(0), np.zeros((1, c), np.int32), np.int32(1),
                    np.zeros((c,), np.int32), rows, prompt_logprobs=lp, window=w, **st)[0])
        g = self._max_segments
        for c in self._packed_lengths:  # (into slot 0, reset after)
            calls.append(lambda cache, c=c: _prefill_packed(
                self._prefill_weights, cache, *[np.zeros(c, np.int32)] * 3, *[np.zeros(g, np.int32)] * 3,
                np.ones(g, np.int32), self._rows([None] * g), window=self.prefill_chunk, **st)[0])
        for n in decode_sizes(self.slots):
            def args(cache, n=n):
                return self.weights[n], cache, np.zeros(n, np.int32), np.zeros(n, bool), self._rows([None] * n)
            calls.append(lambda cache, args=args: _decode(*args(cache), **st)[0])
            if self._steps[n] > 1:
                calls.append(lambda cache, args=args, k=self._steps[n]: _decode_steps(
                    *args(cache), np.int32(1), steps=k, **st)[0])
            if self.speculative is not None:
                calls.append(lambda cache, n=n: _verify(
                    self.weights[n * self.width], cache, np.zeros((n, self.width), np.int32), np.zeros(n, np.int32),
                    np.zeros(n, bool), self._rows([None] * n), **st)[0])
        calls.append(lambda cache: _copy(cache, np.int32(0), np.int32(0)))
        return calls

    # -- requests -----------------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], *, callback: Optional[Callable[[Event], None]] = None,
               **settings) -> int:
        """Queue a request (prompt token ids; settings as `Request`'s fields); returns its id."""
        req = self._check(new_request(prompt, settings))
        rid = next(self._ids)
        key_data, out = request_start(rid, req)
        self._waiting.append(_Live(rid, req, key_data, out, callback))
        return rid

    def _check(self, req: Request) -> Request:
        return check_request(req, self.config, self.max_len, self.max_logprobs)

    def cancel(self, request_id: int) -> bool:
        """Drop a request (waiting or running); its slot is free at the next step. False if unknown/done."""
        for live in list(self._waiting):
            if live.rid == request_id:
                self._waiting.remove(live)
                self._finish(live, "cancelled", [])
                return True
        for s, live in enumerate(self._live):
            if live is not None and live.rid == request_id:
                self._live[s] = None
                self._finish(live, "cancelled", [])
                return True
        return False

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return sum(live is not None for live in self._live)

    def has_work(self) -> bool:
        return bool(self._waiting) or self.num_running > 0

    # -- one step -----------------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """Admit, prefill up to `prefill_budget` prompt tokens, decode one token per generating slot."""
        events: list[Event] = []
        self._admit()
        budget = self.prefill_budget
        if self._packed_lengths:
            budget -= self._prefill_packed(budget, events)
        for s in sorted(range(self.slots), key=lambda s: -1 if self._live[s] is None else self._live[s].rid):
            live = self._live[s]
            if live is None or live.cursor >= len(live.req.prompt) or budget <= 0:
                continue
            if live.wait_for is not None and not self._copy_prefix(s, live):
                continue
            while budget > 0 and self._live[s] is live and live.cursor < len(live.req.prompt):
                budget -= self._prefill_chunk(s, live, budget, events)  # (twice where the slot's end cut a chunk)
        self._decode_step(events, arrivals=budget < self.prefill_budget)
        return events

    def _admit(self) -> None:
        while self._waiting and None in self._live:
            live = self._waiting.popleft()
            prompt, cap = live.req.prompt, self._reusable(live.req)
            free = [s for s in range(self.slots) if self._live[s] is None]
            # decode steps cover the first slots up to the highest busy one (a power of two of them): a free
            # slot among those costs no extra rows; among them the one holding the longest part of the
            # prompt, else the lowest. (Preferring any slot with a longer common prefix spread 8 requests
            # over 32 slots and made every step decode all 32 rows.)
            busy = [s for s in range(self.slots) if self._live[s] is not None]
            covered = next(n for n in decode_sizes(self.slots) if n > max(busy, default=0))
            near = [s for s in free if s < covered] or free
            held = {s: min(_common_prefix(self._cached[s], prompt), cap) for s in free}
            s = max(near, key=lambda s: (held[s], -s))
            far = max(free, key=lambda t: (held[t], -t))
            if held[far] > held[s]:  # a free slot past them holds more of it: copied into the near one now
                self.cache = _copy(self.cache, np.int32(far), np.int32(s))
                self._cached[s] = list(self._cached[far])
                self.stats["copies"] += 1
            own = min(_common_prefix(self._cached[s], prompt), cap)
            best, src = own, None
            for t, other in enumerate(self._live):  # a running request's prompt, cached or on its way in
                if other is not None:
                    m = min(_common_prefix(other.req.prompt, prompt), cap)
                    if m > best:
                        best, src = m, t
            self._live[s] = live
            live.cursor = own
            self._cached[s] = self._cached[s][:own]
            if src is not None:
                live.wait_for = (src, self._live[src].rid, best)
            self.stats["reused_tokens"] += own

    def _reusable(self, req: Request) -> int:
        """How many leading prompt tokens may come from a cache: not the last (its logits are needed), not
        those whose logprobs are asked for, never the slot's last position."""
        cap = len(req.prompt) - 1
        if req.prompt_logprobs:
            cap = min(cap, req.score_from - 1)
        return min(cap, self.max_len - 1)

    def _copy_prefix(self, s: int, live: _Live) -> bool:
        """Copy the first n positions of the source slot once they are there; False while they are not. A
        request waits only on one admitted before it, still in its slot: the waits cannot form a cycle."""
        src, rid, n = live.wait_for
        if _common_prefix(self._cached[src], live.req.prompt) < n:
            other = self._live[src]
            if other is not None and other.rid == rid and other.cursor < len(other.req.prompt):
                return False  # still on its way in
            live.wait_for = None  # the source went away: compute them
            return True
        self.cache = _copy(self.cache, np.int32(src), np.int32(s))
        self._cached[s] = list(self._cached[src][:n])
        self.stats["reused_tokens"] += n - live.cursor
        self.stats["copies"] += 1
        live.cursor, live.wait_for = n, None
        return True

    def _chunk(self, start: int, remaining: int, budget: int) -> tuple[int, int]:
        """(tokens, program length) of the next chunk: the shortest of `chunk_lengths` that holds them,
        fitting the slot's remaining positions without padding past them. (Splitting a chunk to pad less
        measured no faster on a CPU: bench/README.md.)"""
        n = min(remaining, budget, self.prefill_chunk)
        lengths = chunk_lengths(self.prefill_chunk)
        c = next(c for c in lengths if c >= n)
        if start + c > self.max_len:  # the padding would not fit: a shorter chunk with none
            c = max(c for c in lengths if c <= min(n, self.max_len - start))
            n = c
        return n, c

    def _window(self, end: int) -> int:
        """The prefill window of a chunk whose padded tokens end at position `end`."""
        return next(w for w in prefill_windows(self.prefill_chunk, self.max_len) if w >= end)

    def _prefill_chunk(self, s: int, live: _Live, budget: int, events: list) -> int:
        req, start = live.req, live.cursor
        n, c = self._chunk(start, len(req.prompt) - start, budget)
        chunk = np.zeros((1, c), np.int32)
        chunk[0, :n] = req.prompt[start:start + n]
        targets = np.zeros((c,), np.int32)
        nxt = req.prompt[start + 1:start + n + 1]
        targets[:len(nxt)] = nxt
        t0 = time.perf_counter()
        self.cache, out = _prefill(self._prefill_weights, self.cache, np.int32(s), np.int32(start), chunk,
                                   np.int32(n), targets, self._rows([live]), prompt_logprobs=req.prompt_logprobs,
                                   n_logprobs=self.max_logprobs, window=self._window(start + c), **self._static)
        out = jax.device_get(out)
        elapsed = time.perf_counter() - t0
        live.out.prefill_s += elapsed
        self.stats["prefill_seconds"] += elapsed
        live.cursor += n
        self._cached[s].extend(req.prompt[start:start + n])
        self.stats["prefill_tokens"] += n
        self.stats["prefill_calls"] += 1
        self.stats["prefill_padding"] += c - n
        if req.prompt_logprobs:
            self._record_prompt(live, start, len(nxt), out)
        if live.cursor == len(req.prompt):
            self._emit(s, live, out["token"], out["logprob"], out["top_ids"], out["top_lps"], events)
        return n

    def _prefill_packed(self, budget: int, events: list) -> int:
        """Whole prompts of admitted requests (none of their tokens in the cache yet, no prompt logprobs
        asked for, at most `prefill_chunk` tokens) packed into one call, oldest first, as many as fit
        `budget` (and 1024 tokens, 8 prompts); returns the tokens it took. Fewer than two: none (the
        single-prompt path takes it). `packed_prefill=True` only."""
        cap, picked, total = min(budget, self._packed_lengths[-1]), [], 0
        for s in sorted(range(self.slots), key=lambda s: -1 if self._live[s] is None else self._live[s].rid):
            live = self._live[s]
            if (live is None or live.cursor != 0 or live.wait_for is not None or live.req.prompt_logprobs
                    or len(live.req.prompt) > self.prefill_chunk or total + len(live.req.prompt) > cap):
                continue
            picked.append((s, live))
            total += len(live.req.prompt)
            if len(picked) == self._max_segments:
                break
        if len(picked) < 2:
            return 0
        c = next(c for c in self._packed_lengths if c >= total)
        g = self._max_segments
        tokens, segments, positions = np.zeros(c, np.int32), np.full(c, -1, np.int32), np.zeros(c, np.int32)
        # padding prompts: prompt 0 again (its write repeated, its draw unused)
        first = len(picked[0][1].req.prompt)
        offsets, last = np.zeros(g, np.int32), np.full(g, first - 1, np.int32)
        slots_g, lengths = np.full(g, picked[0][0], np.int32), np.full(g, first, np.int32)
        at = 0
        for j, (s, live) in enumerate(picked):
            n = len(live.req.prompt)
            tokens[at:at + n], segments[at:at + n], positions[at:at + n] = live.req.prompt, j, np.arange(n)
            offsets[j], last[j], slots_g[j], lengths[j] = at, at + n - 1, s, n
            at += n
        rows = self._rows([live for _, live in picked] + [None] * (g - len(picked)))
        t0 = time.perf_counter()
        self.cache, out = _prefill_packed(self._prefill_weights, self.cache, tokens, segments, positions, offsets,
                                          last, slots_g, lengths, rows, n_logprobs=self.max_logprobs,
                                          window=self.prefill_chunk, **self._static)
        out = jax.device_get(out)
        elapsed = time.perf_counter() - t0
        self.stats["prefill_seconds"] += elapsed
        self.stats["prefill_calls"] += 1
        self.stats["prefill_packed_calls"] += 1
        self.stats["prefill_padding"] += c - total
        for j, (s, live) in enumerate(picked):
            live.out.prefill_s += elapsed
            live.cursor = len(live.req.prompt)
            self._cached[s].extend(live.req.prompt)
            self.stats["prefill_tokens"] += len(live.req.prompt)
            self._emit(s, live, out["token"][j], out["logprob"][j], out["top_ids"][j], out["top_lps"][j], events)
        return total

    def _record_prompt(self, live: _Live, start: int, m: int, out: dict) -> None:
        """Prompt token i + 1's logprob comes from position i (targets of this chunk's first m positions)."""
        res = live.out
        k = 0 if live.req.logprobs is None else live.req.logprobs
        for j in range(m):
            i = start + j + 1
            if i >= live.req.score_from:
                res.prompt_logprobs[i] = float(out["prompt_lp"][j])
                res.prompt_greedy[i] = bool(out["prompt_greedy"][j])
                res.prompt_top[i] = [(int(a), float(b)) for a, b in
                                     zip(out["prompt_top_ids"][j][:k], out["prompt_top_lps"][j][:k])]

    def _decode_step(self, events: list, arrivals: bool = False) -> None:
        gen = [live is not None and live.cursor == len(live.req.prompt) and live.wait_for is None
               for live in self._live]
        if not any(gen):
            return
        n = next(n for n in decode_sizes(self.slots) if n > max(s for s, g in enumerate(gen) if g))
        gen = gen[:n]
        if self.speculative is not None and self._speculative_step(n, gen, events):
            return
        m = 1 if arrivals else self._several_steps_now(n, gen)
        if m > 1:
            self._several_steps(n, gen, m, events)
            return
        tokens = np.array([live.last if g else 0 for live, g in zip(self._live, gen)], np.int32)
        rows = self._rows([live if g else None for live, g in zip(self._live, gen)])
        t0 = time.perf_counter()
        self.cache, out = _decode(self.weights[n], self.cache, tokens, np.asarray(gen), rows,
                                  n_logprobs=self.max_logprobs, **self._static)
        out = jax.device_get(out)
        self._count_decode(t0, 1, sum(gen), n)
        for s, g in enumerate(gen):
            if g:
                live = self._live[s]
                self._cached[s].append(live.last)
                self._emit(s, live, out["token"][s], out["logprob"][s], out["top_ids"][s], out["top_lps"][s],
                           events)

    def _count_decode(self, t0: float, steps: int, generating: int, width: int) -> None:
        """Count a decode call that began at t0: `steps` steps over `width` rows, `generating` of them
        requests' (a row that ends within a call of several steps counts for all of them)."""
        st = self.stats
        st["decode_seconds"] += time.perf_counter() - t0
        st["decode_calls"] += 1
        st["decode_steps"] += steps
        st["decode_rows"] += steps * generating
        st["decode_width"] += steps * width

    def _several_steps_now(self, n: int, gen: list) -> int:
        """How many decode steps this step over the first n slots may run in one call (up to its row
        count's `decode_steps`; 1: a plain step):
        while every request in a slot is generating (no prompt left to prefill, none waiting for a copy),
        as many as the nearest of them to its max_tokens has to go, so a request's last tokens take one call
        too. A request that arrives meanwhile waits for the call, so a step that prefilled one (arrivals come
        in bursts) decodes a single step."""
        k = self._steps[n]
        if k == 1 or sum(gen) != self.num_running:
            return 1
        return min(k, min(live.req.max_tokens - len(live.out.tokens) for live, g in zip(self._live, gen) if g))

    def _several_steps(self, n: int, gen: list, m: int, events: list) -> None:
        """m (2 to n rows' `decode_steps`) decode steps over the first n slots in one call (`_decode_steps`), then
        each row's tokens emitted in order up to its end (a stop token): the tokens single steps would have
        given, a call's worth at once."""
        lives = [live if g else None for live, g in zip(self._live, gen)]
        tokens = np.array([live.last if live is not None else 0 for live in lives], np.int32)
        t0 = time.perf_counter()
        self.cache, out = _decode_steps(self.weights[n], self.cache, tokens, np.asarray(gen), self._rows(lives),
                                        np.int32(m), n_logprobs=self.max_logprobs, steps=self._steps[n],
                                        **self._static)
        out = jax.device_get(out)
        self._count_decode(t0, m, sum(gen), n)
        for j in range(m):
            for s, live in enumerate(lives):
                if live is not None and self._live[s] is live:  # (not once it has ended)
                    self._cached[s].append(live.last)
                    self._emit(s, live, out["token"][j, s], out["logprob"][j, s], out["top_ids"][j, s],
                               out["top_lps"][j, s], events)

    def _speculative_step(self, n: int, gen: list, events: list) -> bool:
        """One speculative step over the first n slots (n-gram proposals from each generating slot's own
        text); False, having done nothing, when no slot has a proposal or one lacks room for k + 1 positions
        (a plain step is then as good)."""
        spec, w = self.speculative, self.width
        tokens, n_prop = np.zeros((n, w), np.int32), np.zeros(n, np.int32)
        for s, g in enumerate(gen):
            if not g:
                continue
            live = self._live[s]
            if len(self._cached[s]) + w > self.max_len:
                return False
            left = live.req.max_tokens - len(live.out.tokens)  # tokens still to emit, this step's draw included
            props = ngram_lookup(self._cached[s] + [live.last], spec.ngram, min(spec.k, left - 1))
            tokens[s, 0], n_prop[s] = live.last, len(props)
            tokens[s, 1:1 + len(props)] = props
        if not n_prop.any():
            return False
        rows = self._rows([live if g else None for live, g in zip(self._live, gen)])
        t0 = time.perf_counter()
        self.cache, out = _verify(self.weights[n * w], self.cache, tokens, n_prop, np.asarray(gen), rows,
                                  n_logprobs=self.max_logprobs, **self._static)
        out = jax.device_get(out)
        self._count_decode(t0, 1, sum(gen), n)
        self.stats["proposed"] += int(n_prop.sum())
        for s, g in enumerate(gen):
            if not g:
                if len(self._cached[s]) > self.max_len - w:  # its tail was written over
                    self._cached[s] = self._cached[s][:self.max_len - w]
                continue
            live, m = self._live[s], int(out["n_acc"][s])
            self.stats["accepted"] += m
            self._cached[s].extend(int(t) for t in tokens[s, :m + 1])  # the positions the cache keeps
            for j in range(m + 1):
                self._emit(s, live, out["token"][s, j], out["logprob"][s, j], out["top_ids"][s, j],
                           out["top_lps"][s, j], events)
                if self._live[s] is not live:  # it ended (its length, or a stop token)
                    break
        return True

    def _rows(self, lives: Sequence[Optional[_Live]]) -> RowSettings:
        """The sampler settings of these slots as arrays (greedy zeros for empty ones)."""
        def col(fn, dtype):
            return np.array([fn(x) if x is not None else 0 for x in lives], dtype)
        return RowSettings(
            temperature=col(lambda x: x.req.temperature, np.float32),
            top_k=col(lambda x: x.req.top_k or 0, np.int32),
            top_p=np.array([1.0 if x is None or x.req.top_p is None else x.req.top_p for x in lives], np.float32),
            key_data=np.stack([x.key_data if x is not None else np.zeros(2, np.uint32) for x in lives]),
            index=col(lambda x: len(x.out.tokens), np.int32),
            top_wanted=np.array(any(x is not None and bool(x.req.logprobs) for x in lives)))

    def _emit(self, s: int, live: _Live, tok, lp, top_ids, top_lps, events: list) -> None:
        """Record one generated token (if the request wants one) and end the request when it is done."""
        req = live.req
        if req.max_tokens == 0:
            self._live[s] = None
            self._finish(live, "length", events)
            return
        k = 0 if req.logprobs is None else req.logprobs
        token = Token(int(tok), float(lp), [(int(a), float(b)) for a, b in zip(top_ids[:k], top_lps[:k])])
        if not live.out.tokens:
            live.out.first_token = time.perf_counter()
        live.out.tokens.append(token)
        live.last = token.id
        reason = ("stop" if token.id in req.stop_token_ids else
                  "length" if len(live.out.tokens) >= req.max_tokens else None)
        event = Event(live.rid, token, reason, live.out if reason is not None else None)
        events.append(event)
        if live.callback is not None:
            live.callback(event)
        if reason is not None:
            self._live[s] = None
            live.out.finish_reason, live.out.finished = reason, time.perf_counter()

    def _finish(self, live: _Live, reason: str, events: list) -> None:
        live.out.finish_reason, live.out.finished = reason, time.perf_counter()
        event = Event(live.rid, None, reason, live.out)
        events.append(event)
        if live.callback is not None:
            live.callback(event)

    # -- conveniences -------------------------------------------------------------------------------

    def _completions(self, ids) -> dict:
        wanted = set(ids)
        return {live.rid: live.out for live in self._waiting if live.rid in wanted}


# ---------------------------------------------------------------------------------------------------
# Ahead of time (jaxgpt-aot): the engine's programs lowered for abstract inputs

def _abstract_weights(config: GPTConfig, backend: Backend, slots: int, quantize, params) -> tuple:
    """(abstract params, the backend's prepared forms, whether its int8 kernels take any row count) for
    lower_engine: with such kernels the float leaves they replace are left out, as a device holds them."""
    from flax import traverse_util

    from jaxgpt.model import abstract_params
    from jaxgpt.quantize import Int8Kernel, quantized_paths

    params = abstract_params(config) if params is None else params
    params = jax.eval_shape(lambda p: cast_floats(p, config.compute_dtype), params)
    prepared = jax.eval_shape(lambda p: _prepare.__wrapped__(p, config=config, backend=backend, batch_size=slots,
                                                             quantize=quantize), params)
    is_kernel = lambda x: isinstance(x, Int8Kernel)  # noqa: E731
    int8_any_rows = bool(quantize) and all(is_kernel(x) for x in jax.tree.leaves(prepared, is_leaf=is_kernel))
    if int8_any_rows:
        flat = traverse_util.flatten_dict(params)
        for path in quantized_paths(params, config):
            # with scan_layers the stacked layers' float kernels stay: the model's scan checks the stacked
            # params' shapes against their initializer's
            if path != ("wte", "embedding") and not (config.scan_layers and path[0] == "h"):
                del flat[path]
        params = traverse_util.unflatten_dict(flat)
    return params, prepared, int8_any_rows


def lower_engine(config: GPTConfig, slots: int, max_len: int, chunk: int, *, backend: Optional[Backend] = None,
                 sharding=None, max_logprobs: int = 20, params=None, quantize: Optional[str] = None,
                 kv_dtype: Optional[str] = None, packed: Optional[int] = None, mesh=None,
                 weight_shardings=None) -> dict:
    """The engine's decode step (every slot) and its prefill of a `chunk`-token piece, lowered for
    abstract inputs placed on `sharding` (nothing allocated): {"decode": lowered, "prefill": lowered,
    "weights": the abstract DecodeWeights both take, "cache": the abstract KVCache}. `.compile()` them to
    check them for another platform's devices. With `packed` (a token count) also "prefill_packed":
    `packed_prefill`'s call of that many tokens (whole prompts of up to min(slots, 8) requests, none longer
    than `chunk`).

    `mesh` (with `sharding` replicated on it): as an Engine over params placed on that mesh, attention
    split by heads over its tensor axis (Backend.on_mesh) and the cache by kv head (KVCache.on_mesh,
    split_cache's default); `weight_shardings`: a function from the abstract DecodeWeights to their
    shardings (e.g. `sharding.tree_shardings` by a rules table), default `sharding`. The packed prefill is
    not on a mesh (the Engine does not pack there).

    With `quantize` and a backend whose int8 kernels take any row count (`Int8Kernel`s, multiplied with
    XLA: the portable, tpu and gpu backends) the weights are what a device would hold: the int8 kernels
    and the params without the float leaves they replace (a tied table stays: the embedding lookup reads
    it; a running engine's is the dequantized table), and the prefill runs on them too, which computes
    what the CPU Engine's prefill of the dequantized params does. Other backends keep the float params
    beside their forms."""
    check_sizes(config, slots, max_len, chunk, max_logprobs=max_logprobs)
    if packed:
        check_packed(config, slots, packed)
        if mesh is not None:
            raise ValueError("the packed prefill is not run on a mesh (Engine(packed_prefill=True) packs only "
                             "on one device)")
    backend = backend or resolve(config)
    tensor = mesh is not None and dict(mesh.shape).get("tensor", 1) > 1
    if tensor:
        backend = backend.on_mesh(mesh, ())
    config = config.replace(remat="none")
    quantize, kv_dtype = check_quantize(quantize), check_kv_dtype(kv_dtype)
    params, prepared, int8_any_rows = _abstract_weights(config, backend, slots, quantize, params)
    cache = jax.eval_shape(lambda: KVCache.create(config, slots, max_len, dtype=kv_dtype, layout=backend.cache_layout))

    def place(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)

    def arr(shape, dtype):
        return place(jax.ShapeDtypeStruct(shape, dtype))

    def rows(n):
        return RowSettings(arr((n,), jnp.float32), arr((n,), jnp.int32), arr((n,), jnp.float32),
                           arr((n, 2), jnp.uint32), arr((n,), jnp.int32), arr((), jnp.bool_))

    static = dict(config=config, backend=backend, n_logprobs=max_logprobs)
    weights = DecodeWeights(params, prepared)
    if weight_shardings is None:
        weights = place(weights)
    else:
        weights = jax.tree.map(lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), weights,
                               weight_shardings(weights))
    cache = cache.on_mesh(mesh, abstract=True) if tensor else place(cache)
    scalar = arr((), jnp.int32)
    packed_program = {}
    if packed:
        n, g = arr((packed,), jnp.int32), arr((min(slots, MAX_PACKED_PROMPTS),), jnp.int32)
        packed_program["prefill_packed"] = _prefill_packed.lower(
            weights if int8_any_rows else weights.params, cache, n, n, n, g, g, g, g,
            rows(min(slots, MAX_PACKED_PROMPTS)), window=min(chunk, max_len), **static)
    return {"decode": _decode.lower(weights, cache, arr((slots,), jnp.int32), arr((slots,), jnp.bool_), rows(slots),
                                    **static),
            "prefill": _prefill.lower(weights if int8_any_rows else weights.params, cache, scalar, scalar,
                                      arr((1, chunk), jnp.int32), scalar, arr((chunk,), jnp.int32), rows(1),
                                      prompt_logprobs=False, **static),
            "weights": weights, "cache": cache, **packed_program}
