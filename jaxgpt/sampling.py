"""Sampling: logit filters as pure functions, a batched prefill, and a lax.scan decode loop."""

from __future__ import annotations

import functools
from typing import Iterator, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxgpt.backends import Backend, DecodeWeights, resolve
from jaxgpt.backends.base import cast_floats
from jaxgpt.cache import KVCache
from jaxgpt.checks import is_int, is_real
from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT, abstract_params, heads_grouped
from jaxgpt.quantize import check_kv_dtype, check_quantize, dequantized

NEG_INF = -jnp.inf
# A temperature below float32's smallest normal number samples greedily: it is the limit as the temperature
# goes to 0, and a smaller divisor is subnormal (flushed to 0 on CPUs) or 0 once cast to float32.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)


def scale_logits(logits: jax.Array, temperature) -> jax.Array:
    """float32 (logits - each row's largest finite logit) / temperature, logits [..., V], temperature a
    number or an array that broadcasts (each >= MIN_TEMPERATURE). The largest logit becomes exactly 0
    however the division is compiled (a reciprocal, a fused multiply-add), the others <= 0: a tiny
    temperature sends them to -inf, never the largest to inf (inf - inf is NaN, and a draw from it index 0).
    Infinite and NaN logits stay what they were."""
    x = logits.astype(jnp.float32)
    finite = jnp.isfinite(x)
    top = jnp.max(jnp.where(finite, x, NEG_INF), axis=-1, keepdims=True)
    return jnp.where(finite, x - jnp.where(jnp.isfinite(top), top, 0.0), x) / temperature


def top_k_filter(logits: jax.Array, k: int) -> jax.Array:
    """Keep exactly the k largest logits of each row [..., V] (ties broken by index); others -> -inf."""
    if k >= logits.shape[-1]:
        return logits
    _, idx = jax.lax.top_k(logits, k)
    keep = jnp.zeros(logits.shape, bool)
    keep = jnp.put_along_axis(keep, idx, True, axis=-1, inplace=False)
    return jnp.where(keep, logits, NEG_INF)


def _top_p_keep(sorted_logits: jax.Array, p: float) -> jax.Array:
    """For logits sorted in descending order: keep each token whose preceding probability mass is < p."""
    probs = jax.nn.softmax(sorted_logits.astype(jnp.float32), axis=-1)
    first = jax.lax.broadcasted_iota(jnp.int32, probs.shape, probs.ndim - 1) == 0
    # the top token is always kept: its mass before it is 0, and a p that float32 flushes to 0 keeps none
    return (jnp.cumsum(probs, axis=-1) - probs < p) | first


def _ordered_uint(x: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order (-inf first, +inf last; -0.0 as 0.0, equal keys for equal values)."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    bits = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)  # negatives: larger magnitude, smaller
    return jax.lax.bitcast_convert_type(bits ^ jnp.int32(-2 ** 31), jnp.uint32)  # then the sign bit flipped


def top_p_mask(logits: jax.Array, p) -> jax.Array:
    """bool [..., V]: the smallest set of largest-probability tokens whose total reaches p (the crossing token
    too), ties in index order; p a number or an array of the leading shape (each row its own). Without a
    sort: the crossing token's logit c is the least logit whose tokens above it hold less than p, found by
    bisection over the logits' 32-bit order (32 masked sums); every token above c is kept, and of those at
    c the ones whose mass before them, in index order, is below p; the first largest logit always (however
    small p is: a p that float32 flushes to 0 would keep none). XLA:CPU's sort of [8, 50257] took 80 ms,
    this 5-6 ms (bench/README.md)."""
    x = logits.astype(jnp.float32)
    p = jnp.asarray(p, jnp.float32)[..., None]
    probs = jax.nn.softmax(x, axis=-1)
    key = _ordered_uint(x)

    def mass_above(t):
        return jnp.sum(jnp.where(key > t, probs, 0.0), axis=-1, keepdims=True)

    def halve(_, bounds):  # the least t with mass_above(t) < p lies in [lo, hi]
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        below = mass_above(mid) < p
        return jnp.where(below, lo, mid + 1), jnp.where(below, mid, hi)

    edge = x.shape[:-1] + (1,)
    c, _ = jax.lax.fori_loop(0, 32, halve, (jnp.zeros(edge, jnp.uint32), jnp.full(edge, 2 ** 32 - 1, jnp.uint32)))
    at_c = jnp.where(key == c, probs, 0.0)
    top = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) == argmax_last(x)[..., None]
    return (key > c) | ((key == c) & (mass_above(c) + jnp.cumsum(at_c, axis=-1) - at_c < p)) | top


def top_p_filter(logits: jax.Array, p: float) -> jax.Array:
    """Keep the smallest set of largest-probability tokens whose total reaches p (the crossing token too),
    `top_p_mask`'s; others -> -inf."""
    return jnp.where(top_p_mask(logits, p), logits, NEG_INF)


DRAW_BLOCK = 256  # the inverse-CDF draw's block of tokens (a power of two)


def _halving_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis (a power of two long) by adding its halves until one is left: the same
    additions, in the same order, whatever the leading shape, so a row's sum does not depend on its batch."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def _inclusive_prefix(x: jax.Array) -> jax.Array:
    """Running sums over the last axis by `lax.associative_scan`: element-wise additions whose order is
    fixed by the axis's length alone (never by the leading shape)."""
    return jax.lax.associative_scan(jnp.add, x, axis=x.ndim - 1)


def inverse_cdf(u: jax.Array, logits: jax.Array) -> jax.Array:
    """The token of each row of logits [..., n] at which softmax(logits)'s running mass passes u [...] (in
    [0, 1)) times the row's total: a draw from softmax(logits) when u is uniform. The mass is exp(logit -
    max), summed in blocks of DRAW_BLOCK tokens (a halving sum each); the blocks' running sums pick the block,
    the running sums within it the token. Every addition is element-wise, in an order fixed by n alone, so
    a row gives the same token in any batch. A row with a NaN, or whose largest logit is infinite, gives
    `argmax_last`'s answer (its first NaN, its first largest). int32 [...]."""
    x = logits.astype(jnp.float32)
    n, lead = x.shape[-1], x.shape[:-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    mass = jnp.exp(x - top)  # 1 at the largest, 0 for -inf; NaN for a NaN and in a row whose top is infinite
    block = min(DRAW_BLOCK, 1 << max(0, (n - 1).bit_length()))
    nb = -(-n // block)
    blocks = jnp.pad(mass, [(0, 0)] * len(lead) + [(0, nb * block - n)]).reshape(lead + (nb, block))
    sums = _halving_sum(blocks)
    ends = _inclusive_prefix(sums)
    target = u.astype(jnp.float32) * ends[..., -1]
    # (a clamp to the last block, and token, with mass: where rounding carries the target past the end)
    b = jnp.minimum(jnp.sum((ends <= target[..., None]).astype(jnp.int32), axis=-1), _last_positive(sums))
    start = jnp.where(b > 0, jnp.take_along_axis(ends, jnp.maximum(b - 1, 0)[..., None], axis=-1)[..., 0], 0.0)
    chosen = jnp.take_along_axis(blocks, b[..., None, None], axis=-2)[..., 0, :]
    within = start[..., None] + _inclusive_prefix(chosen)
    i = jnp.minimum(jnp.sum((within <= target[..., None]).astype(jnp.int32), axis=-1), _last_positive(chosen))
    token = b * block + i
    odd = jnp.isnan(ends[..., -1])  # (a NaN anywhere, or an infinite top, makes the total NaN)
    return jnp.where(odd, jax.lax.cond(odd.any(), lambda: argmax_last(x), lambda: token), token).astype(jnp.int32)


def _last_positive(x: jax.Array) -> jax.Array:
    """The index of each row's last positive entry along the last axis (0 for a row without one)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.max(jnp.where(x > 0, iota, 0), axis=-1)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """One token per row of logits [..., n] from softmax(logits): `inverse_cdf` of one uniform a row,
    `jax.random.uniform(key, logits.shape[:-1])` (so a batch of one row draws what its row draws alone
    with the same key). A Gumbel-max draw (`jax.random.categorical`) needs noise for every token, this one
    number a row (what each costs: bench/README.md, "Draws by inverse CDF"). Rows meant to draw alike must
    come with the same n (a candidate list padded with -inf to a common length: the block sums' order
    depends on n). int32 [...]."""
    return inverse_cdf(jax.random.uniform(key, logits.shape[:-1], jnp.float32), logits)


def categorical_rows(keys_S: jax.Array, logits_SxN: jax.Array) -> jax.Array:
    """`categorical` of each row of logits [S, n] with its own key [S]: what `categorical(keys[s],
    logits[s])` draws, in one batched draw."""
    u_S = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys_S)
    return inverse_cdf(u_S, logits_SxN)


def sample_logits(rng: jax.Array, logits: jax.Array, temperature: float = 1.0,
                  top_k: Optional[int] = None, top_p: Optional[float] = None) -> jax.Array:
    """Draw int32 token ids [B] from logits [B, V]; temperature 0 (or below MIN_TEMPERATURE) is greedy.

    The distribution is softmax(logits / temperature) (`scale_logits`) restricted by `top_k_filter` then
    `top_p_filter`.
    With top_k the draw is among the k candidates only (`lax.top_k` returns them sorted, so top-p needs
    no sort of the whole vocabulary), padded with -inf to as many as the engine's sampler draws among for
    that top_k (`sample_rows`), so that both draw the same token from the same key (`categorical`).
    """
    if temperature < MIN_TEMPERATURE:
        return argmax_last(logits)
    logits = scale_logits(logits, temperature)
    if top_k is not None and top_k < logits.shape[-1]:
        values, candidates = jax.lax.top_k(logits, top_k)  # descending, ties broken by index
        if top_p is not None and top_p < 1.0:
            values = jnp.where(_top_p_keep(values, top_p), values, NEG_INF)
        v = logits.shape[-1]
        width = min(TOP_K_FAST, v) if top_k <= TOP_K_FAST else v
        values = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, width - top_k)], constant_values=NEG_INF)
        choice = categorical(rng, values)
        return jnp.take_along_axis(candidates, choice[..., None], axis=-1)[..., 0].astype(jnp.int32)
    if top_p is not None and top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    return categorical(rng, logits)


# ---------------------------------------------------------------------------------------------------
# Per-row settings as traced values (the engine's sampler)

TOP_K_FAST = 64  # a row's top_k up to this is drawn among lax.top_k's candidates; above, by a full sort


class RowSettings(NamedTuple):
    """Each row's sampler settings as arrays [S], traced (no value is part of a program's key):
    temperature (0, or below MIN_TEMPERATURE = greedy), top_k (0 = off), top_p (1 = off), the row's PRNG
    key data uint32 [S, 2] and the index of the token being drawn (it is folded into the key); `top_wanted`,
    a bool scalar, whether any row asks for its top logprobs (None: computed always)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    key_data: jax.Array
    index: jax.Array
    top_wanted: Optional[jax.Array] = None


def _draw(keys_S, logits_SxN, keep_SxN):
    """Each row's draw among its kept logits (`categorical_rows`); the candidates' count n is the one
    `sample_logits` pads its candidates to for the row's settings."""
    return categorical_rows(keys_S, jnp.where(keep_SxN, logits_SxN, NEG_INF))


def _top_p_rows(sorted_SxN, p_S):
    """`_top_p_keep` per row; all kept in rows whose top_p is 1 (sample_logits skips the filter there)."""
    return jax.vmap(_top_p_keep)(sorted_SxN, p_S) | (p_S >= 1.0)[:, None]


def _rows_among_candidates(keys, scaled_SxV, k_S, p_S):
    """Rows with 0 < top_k <= TOP_K_FAST: `sample_logits`'s top-k path, k per row."""
    values, candidates = jax.lax.top_k(scaled_SxV, min(TOP_K_FAST, scaled_SxV.shape[-1]))
    first_k = jnp.arange(values.shape[-1])[None, :] < k_S[:, None]
    values = jnp.where(first_k, values, NEG_INF)
    keep = _top_p_rows(values, p_S) & first_k
    choice = _draw(keys, values, keep)
    return jnp.take_along_axis(candidates, choice[:, None], axis=-1)[:, 0]


def _rows_full(keys, scaled_SxV, k_S, p_S, sort: bool):
    """Every other row: no filter (a draw over the vocabulary), or (`sort`) top-p alone (`top_p_mask`, a draw
    over the vocabulary) or a top_k above TOP_K_FAST (a full sort), as `sample_logits` does for those
    settings."""
    if not sort:
        return categorical_rows(keys, scaled_SxV)
    # without top_k, sample_logits draws over the vocabulary's order, the top-p set kept
    by_vocab = _draw(keys, scaled_SxV, top_p_mask(scaled_SxV, p_S) | (p_S >= 1.0)[:, None])
    by_rank = jax.lax.cond((k_S > 0).any(), lambda: _rows_by_rank(keys, scaled_SxV, k_S, p_S),
                           lambda: jnp.zeros(k_S.shape, jnp.int32))
    return jnp.where(k_S > 0, by_rank, by_vocab)


def _rows_by_rank(keys, scaled_SxV, k_S, p_S):
    """Rows with a top_k above TOP_K_FAST: the vocabulary sorted, the first k kept, top-p among them."""
    v = scaled_SxV.shape[-1]
    order = jnp.argsort(-scaled_SxV, axis=-1, stable=True)
    sorted_SxV = jnp.take_along_axis(scaled_SxV, order, axis=-1)
    first_k = jnp.arange(v)[None, :] < jnp.where(k_S > 0, k_S, v)[:, None]
    keep_sorted = _top_p_rows(jnp.where(first_k, sorted_SxV, NEG_INF), p_S) & first_k
    return jnp.take_along_axis(order, _draw(keys, sorted_SxV, keep_sorted)[:, None], axis=-1)[:, 0]


def sample_rows(logits_SxV: jax.Array, rows: RowSettings) -> jax.Array:
    """Draw int32 token ids [S], row s with its own settings and key: the token `sample_logits` draws for
    that row alone with rng `fold_in(key, index)` (top_k 0 or >= V and top_p 1 mean off). One program for
    every value of every setting; the costlier forms (a draw over the vocabulary, a full sort) run only in
    steps where some row needs them."""
    v = logits_SxV.shape[-1]
    greedy = rows.temperature < MIN_TEMPERATURE
    k_S = jnp.where(rows.top_k >= v, 0, rows.top_k).astype(jnp.int32)
    p_S = rows.top_p.astype(jnp.float32)
    keys = jax.vmap(lambda d, i: jax.random.fold_in(jax.random.wrap_key_data(d), i))(rows.key_data, rows.index)
    fast = ~greedy & (k_S > 0) & (k_S <= TOP_K_FAST)
    needs_sort = ~greedy & ~fast & ((p_S < 1.0) | (k_S > 0))
    needs_vocab = ~greedy & ~fast

    def none():
        return jnp.zeros(k_S.shape, jnp.int32)

    def scaled():
        return scale_logits(logits_SxV, jnp.where(greedy, 1.0, rows.temperature)[:, None])

    # each form over [S, V] runs only in a step where some row takes it (what each costs: bench/README.md)
    branch = jnp.where(needs_sort.any(), 2, jnp.where(needs_vocab.any(), 1, 0))
    other = jax.lax.switch(branch, [none,
                                    lambda: _rows_full(keys, scaled(), k_S, p_S, sort=False).astype(jnp.int32),
                                    lambda: _rows_full(keys, scaled(), k_S, p_S, sort=True).astype(jnp.int32)])
    among = jax.lax.cond(fast.any(), lambda: _rows_among_candidates(keys, scaled(), k_S, p_S).astype(jnp.int32),
                         none)
    top = jax.lax.cond(greedy.any(), lambda: argmax_last(logits_SxV), none)
    return jnp.where(greedy, top, jnp.where(fast, among, other))


def argmax_last(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32 (the first maximum; the first NaN where there is one) by two plain
    reductions, which XLA:CPU runs faster than argmax's reduction of (value, index) pairs (bench/README.md)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    m = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == m) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, iota, x.shape[-1]), axis=-1).astype(jnp.int32)


def token_logprobs(logits_SxV: jax.Array, tokens_S: jax.Array, n: int, wanted: Optional[jax.Array] = None):
    """log-softmax of float32 logits: each row's token's logprob [S] and the n most likely tokens' ids and
    logprobs [S, n] (ties by index). With `wanted` (a traced bool) False, the n most likely are zeros and
    their top-n over the vocabulary is skipped."""
    logp = jax.nn.log_softmax(logits_SxV.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens_S[:, None].astype(jnp.int32), axis=-1)[:, 0]

    def top():
        top_lp, top_ids = jax.lax.top_k(logp, n)
        return top_ids.astype(jnp.int32), top_lp

    if wanted is None:
        top_ids, top_lp = top()
    else:
        top_ids, top_lp = jax.lax.cond(wanted, top, lambda: (jnp.zeros(logp.shape[:-1] + (n,), jnp.int32),
                                                             jnp.zeros(logp.shape[:-1] + (n,), jnp.float32)))
    return chosen, top_ids, top_lp


class GenerateOutput(NamedTuple):
    tokens: jax.Array   # int32 [B, P + N]: prompt then generated tokens, padding past `lengths`
    lengths: jax.Array  # int32 [B]


def validate_sampler(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    """Raise ValueError for sampler settings outside their domain."""
    if not is_real(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and (not is_real(top_p) or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")


def _check_token(name: str, value, config: GPTConfig) -> None:
    if not is_int(value) or not 0 <= value < config.vocab_size:
        raise ValueError(f"{name} must be a token id in [0, {config.vocab_size}), got {value!r}")


def _check_rng(rng) -> None:
    typed = isinstance(rng, jax.Array) and jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.shape == ()
    raw = isinstance(rng, (jax.Array, np.ndarray)) and rng.dtype == np.uint32 and rng.shape == (2,)
    if not (typed or raw):
        raise ValueError(f"rng must be a PRNG key such as jax.random.key(0), got {type(rng).__name__} "
                         f"{getattr(rng, 'shape', '')}")


def _as_rows(prompts, prompt_lengths) -> tuple[np.ndarray, object]:
    """prompts as an array; a list of prompts of different lengths padded at the end, with their lengths."""
    if isinstance(prompts, (list, tuple)) and prompts and all(np.ndim(row) == 1 for row in prompts):
        rows = [np.asarray(row) for row in prompts]
        lengths = [len(row) for row in rows]
        if len(set(lengths)) > 1:
            if prompt_lengths is not None:
                raise ValueError("prompts of different lengths give their own lengths: leave prompt_lengths out, "
                                 "or pass the prompts as one [batch, prompt_len] array padded at the end")
            if min(lengths) == 0:
                raise ValueError(f"prompt {lengths.index(0)} is empty; every prompt needs at least one token")
            padded = np.zeros((len(rows), max(lengths)), np.result_type(*rows))
            for padded_row, row in zip(padded, rows):
                padded_row[:len(row)] = row
            return padded, np.asarray(lengths)
    try:
        return np.asarray(prompts), prompt_lengths
    except ValueError:  # numpy's "inhomogeneous shape": nested deeper than rows of tokens
        raise ValueError("prompts must be token ids [batch, prompt_len] (or a list of prompts, each a list of "
                         "ids); pad them to one length and pass prompt_lengths") from None


def _prepare(config: GPTConfig, prompts, max_new_tokens, prompt_lengths, temperature, top_k, top_p, eos_id,
             pad_id, rng) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate generate's arguments; returns (padded prompts int32 [B, P], prompt lengths [B], N)."""
    prompts, prompt_lengths = _as_rows(prompts, prompt_lengths)
    if prompts.ndim == 1:
        prompts = prompts[None, :]
    if prompts.ndim != 2 or prompts.shape[1] == 0 or prompts.shape[0] == 0:
        raise ValueError(f"prompts must be int [batch, prompt_len] with both > 0, got shape {prompts.shape}")
    if not np.issubdtype(prompts.dtype, np.integer):
        raise ValueError(f"prompts must hold integer token ids, got dtype {prompts.dtype}")
    b, p = prompts.shape
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if p + max_new_tokens > config.block_size:
        raise ValueError(f"prompt length ({p}) + max_new_tokens ({max_new_tokens}) = "
                         f"{p + max_new_tokens} exceeds block_size ({config.block_size}); "
                         "shorten the prompt or ask for fewer tokens")
    if prompt_lengths is None:
        prompt_lengths = np.full((b,), p, np.int32)
    prompt_lengths = np.asarray(prompt_lengths)
    if prompt_lengths.shape != (b,):
        raise ValueError(f"prompt_lengths must have shape ({b},), got {prompt_lengths.shape}")
    if not np.issubdtype(prompt_lengths.dtype, np.integer):
        raise ValueError(f"prompt_lengths must be integers, got {prompt_lengths.tolist()}")
    if prompt_lengths.min() < 1 or prompt_lengths.max() > p:
        raise ValueError(f"prompt_lengths must be in [1, {p}] (the prompt array's length), got "
                         f"{prompt_lengths.tolist()}")
    valid = np.arange(p)[None, :] < prompt_lengths[:, None]
    used = prompts[valid]
    if used.min() < 0 or used.max() >= config.vocab_size:
        bad = int(used.min()) if used.min() < 0 else int(used.max())
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {config.vocab_size})")
    validate_sampler(temperature, top_k, top_p)
    if eos_id is not None:
        _check_token("eos_id", eos_id, config)
    _check_token("pad_id", pad_id, config)
    _check_rng(rng)
    return np.where(valid, prompts, pad_id).astype(np.int32), prompt_lengths.astype(np.int32), int(max_new_tokens)


# ---------------------------------------------------------------------------------------------------
# The decode loop, shared by generate (one compiled call) and stream (a call per chunk)

class Sampler(NamedTuple):
    """Sampler settings; static, so part of the compiled program's key."""

    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    eos_id: Optional[int]
    pad_id: int

    @classmethod
    def of(cls, temperature, top_k, top_p, eos_id, pad_id) -> "Sampler":
        """Settings already checked by `_prepare`, as plain Python values (a temperature below
        MIN_TEMPERATURE as 0: greedy)."""
        temperature = float(temperature) if temperature >= MIN_TEMPERATURE else 0.0
        return cls(temperature, None if top_k is None else int(top_k), None if top_p is None else float(top_p),
                   None if eos_id is None else int(eos_id), int(pad_id))


class DecodeState(NamedTuple):
    """What the decode loop carries: the cache, the logits for the next token [B, V], each row's token
    count, which rows have emitted eos, and how many tokens were drawn so far (it seeds the next draw)."""

    cache: KVCache
    logits: jax.Array
    lengths: jax.Array
    done: jax.Array
    step: jax.Array


def params_mesh(params):
    """The mesh that params placed by `jaxgpt.shard_params` lie on (None: one device)."""
    for x in jax.tree.leaves(params):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1:
            return sharding.mesh
    return None


def on_params_mesh(backend: Backend, params, split_cache: Optional[bool]) -> tuple:
    """(backend, cache mesh) for params that `jaxgpt.shard_params` placed on a mesh: the backend splitting
    attention by heads over its tensor axis (Backend.on_mesh), and the mesh to split the cache by kv head
    over when `split_cache` (None: wherever the mesh has a tensor axis of more than one device); (backend,
    None) for params on one device."""
    mesh = params_mesh(params)
    if mesh is None:
        return backend, None
    if split_cache is None:
        split_cache = dict(mesh.shape).get("tensor", 1) > 1
    return backend.on_mesh(mesh, ()), mesh if split_cache else None


def _prefill(model: GPT, variables: dict, prompts_BxP, prompt_lengths_B, max_len: int, kv_dtype=None,
             mesh=None) -> DecodeState:
    """The whole (padded) prompt at once through `variables` (`DecodeWeights.prefill_variables`: the
    params, with w8a8 the int8 kernels too), logits only at each row's last prompt token; the cache in
    `kv_dtype` (default: the compute dtype; "int8": int8 with scales, jaxgpt/cache.py), split by kv head
    over `mesh`'s tensor axis when a mesh is given (KVCache.on_mesh)."""
    b, p = prompts_BxP.shape
    cache = KVCache.create(model.config, b, max_len, dtype=kv_dtype, layout=model.backend.cache_layout)
    if mesh is not None:
        cache = cache.on_mesh(mesh, inside_jit=True)
    if p <= PREFILL_CHUNK:
        logits, cache = model.apply(variables, prompts_BxP, cache, token_lengths=prompt_lengths_B,
                                    logits_index=prompt_lengths_B - 1)
        logits_BxV = logits[:, 0]
    else:
        logits_BxV, cache = _prefill_in_chunks(model, variables, prompts_BxP, prompt_lengths_B, cache)
    return DecodeState(cache, logits_BxV, prompt_lengths_B, jnp.zeros((b,), bool), jnp.zeros((), jnp.int32))


PREFILL_CHUNK = 512  # a longer prompt goes through the model this many tokens at a time (`_prefill_in_chunks`)


def _prefill_in_chunks(model: GPT, variables: dict, prompts_BxP, prompt_lengths_B, cache: KVCache):
    """The padded prompt PREFILL_CHUNK tokens at a time into an empty cache (a lax.scan over the whole
    chunks, then the rest): each token attends to the same keys as with the prompt at once, and the
    activations are a chunk's (issue 59: a whole 8 x 2048 prompt held float32 [8, 2048, 4096] hidden
    states, several at once, on every chip of a tensor mesh). (logits [B, V] at each row's last prompt
    token, the cache with each row's prompt length.)"""
    b, p = prompts_BxP.shape
    c = PREFILL_CHUNK
    n, last_B = p // c, prompt_lengths_B - 1

    def chunk(cache, tokens_BxT, start):
        index_B = jnp.clip(last_B - start, 0, tokens_BxT.shape[1] - 1)
        logits, cache = model.apply(variables, tokens_BxT, cache, logits_index=index_B)
        return cache, logits[:, 0]

    tokens_NxBxC = prompts_BxP[:, :n * c].reshape(b, n, c).swapaxes(0, 1)
    cache, logits_NxBxV = jax.lax.scan(lambda cache, xs: chunk(cache, *xs), cache,
                                       (tokens_NxBxC, jnp.arange(n, dtype=jnp.int32) * c))
    if p > n * c:  # the rest, shorter than a chunk
        cache, rest_BxV = chunk(cache, prompts_BxP[:, n * c:], n * c)
        logits_NxBxV = jnp.concatenate([logits_NxBxV, rest_BxV[None]], axis=0)
    # each row's logits from the chunk holding its last prompt token
    logits_BxV = jnp.take_along_axis(logits_NxBxV, (last_B // c)[None, :, None], axis=0)[0]
    return logits_BxV, cache.replace(lengths=prompt_lengths_B)


def _emit(state: DecodeState, rng, s: Sampler) -> tuple[DecodeState, jax.Array]:
    """Draw each row's next token from the state's logits (pad_id for finished rows)."""
    tok = sample_logits(jax.random.fold_in(rng, state.step), state.logits, s.temperature, s.top_k, s.top_p)
    tok = jnp.where(state.done, s.pad_id, tok)
    done = state.done if s.eos_id is None else state.done | (tok == s.eos_id)
    lengths = state.lengths + (~state.done).astype(jnp.int32)
    return state._replace(lengths=lengths, done=done, step=state.step + 1), tok


def _decode(model: GPT, variables: dict, state: DecodeState, rng, n: int, s: Sampler, last: bool):
    """n tokens per row [B, n]; each is fed back through the model, except the very last one (`last`)."""
    def step(state, _):
        state, tok = _emit(state, rng, s)
        logits, cache = model.apply(variables, tok[:, None], state.cache)
        return state._replace(cache=cache, logits=logits[:, 0]), tok

    state, toks = jax.lax.scan(step, state, None, length=n - 1 if last else n)
    if last:
        state, tok = _emit(state, rng, s)
        toks = jnp.concatenate([toks, tok[None]], axis=0)
    return state, toks.T


def _cast(weights: DecodeWeights, config: GPTConfig) -> DecodeWeights:
    """The params in the compute dtype, once per call (not per step)."""
    return weights.replace(params=cast_floats(weights.params, config.compute_dtype))


def _variables(weights: DecodeWeights, config: GPTConfig, backend: Backend) -> tuple[dict, dict]:
    """(the prompt's variables, the decode steps' variables) of `weights` in the compute dtype, made once
    per call: with attention split by heads, c_attn's kernels regrouped by kv head (`heads_grouped`) join
    both "prepared" collections, each device holding its own groups, instead of being rebuilt (whole, on
    every device) inside the decode loop."""
    weights = _cast(weights, config)
    grouped = traverse_util.flatten_dict(heads_grouped(weights.params, config, backend))

    def plus(variables: dict) -> dict:
        if not grouped:
            return variables
        prepared = {**traverse_util.flatten_dict(variables.get("prepared", {})), **grouped}
        return {**variables, "prepared": traverse_util.unflatten_dict(prepared)}
    return plus(weights.prefill_variables()), plus(weights.variables())


# Incremented each time `_generate` is traced; tests use it to check that new prompts don't recompile.
TRACE_COUNT = 0


@functools.partial(jax.jit, static_argnames=("config", "backend", "max_new_tokens", "sampler", "kv_dtype", "mesh"))
def _generate(weights: DecodeWeights, prompts_BxP, prompt_lengths_B, rng, *, config: GPTConfig, backend: Backend,
              max_new_tokens: int, sampler: Sampler, kv_dtype=None, mesh=None) -> GenerateOutput:
    global TRACE_COUNT
    TRACE_COUNT += 1
    b, p = prompts_BxP.shape
    model, (prefill_vars, decode_vars) = GPT(config, backend), _variables(weights, config, backend)
    state = _prefill(model, prefill_vars, prompts_BxP, prompt_lengths_B, p + max_new_tokens, kv_dtype, mesh)
    state, new_BxN = _decode(model, decode_vars, state, rng, max_new_tokens, sampler, last=True)
    # row b's new tokens go right after its prompt (ragged rows: over the padding)
    tokens = jnp.concatenate([prompts_BxP, jnp.full((b, max_new_tokens), sampler.pad_id, jnp.int32)], axis=1)
    at = prompt_lengths_B[:, None] + jnp.arange(max_new_tokens)[None, :]
    tokens = tokens.at[jnp.arange(b)[:, None], at].set(new_BxN)
    return GenerateOutput(tokens, state.lengths)


@functools.partial(jax.jit, static_argnames=("config", "backend", "max_len", "kv_dtype", "mesh"))
def _prefill_jit(weights: DecodeWeights, prompts_BxP, prompt_lengths_B, *, config, backend, max_len, kv_dtype=None,
                 mesh=None):
    return _prefill(GPT(config, backend), _variables(weights, config, backend)[0], prompts_BxP, prompt_lengths_B,
                    max_len, kv_dtype, mesh)


@functools.partial(jax.jit, static_argnames=("config", "backend", "n", "sampler", "last"), donate_argnums=(1,))
def _decode_jit(weights: DecodeWeights, state, rng, *, config, backend, n, sampler, last):
    return _decode(GPT(config, backend), _variables(weights, config, backend)[1], state, rng, n, sampler, last)


@functools.partial(jax.jit, static_argnames=("config", "backend", "batch_size", "quantize"))
def _prepare_jit(params, *, config: GPTConfig, backend: Backend, batch_size: int, quantize=None):
    return backend.prepare_decode(cast_floats(params, config.compute_dtype), batch_size, config.compute_dtype,
                                  config.tie_embeddings, quantize, config=config)


@functools.partial(jax.jit, static_argnames=("config",))
def _dequantized_jit(params, *, config: GPTConfig):
    return dequantized(params, config)


class Decoder:
    """A model ready to decode: the backend chosen once, and the decode steps' weights (`DecodeWeights`,
    the backend's prepared kernels) made once per batch size and kept while this object lives.

    `Decoder(params, config).generate(...)` equals `generate(params, config, ...)`; hold a Decoder to
    decode repeatedly without preparing the weights again.

    `speculative=jaxgpt.Speculative(k, draft)` makes `generate` decode speculatively (jaxgpt/speculative.py):
    greedy output equals plain decoding's, sampled output follows the same distribution; the latest call's
    acceptance is in `last_speculative_stats`.

    `kv_dtype="int8"` keeps the KV cache as int8 with a scale per position and head (jaxgpt/cache.py):
    a quarter of float32's bytes.

    Params placed on a mesh by `jaxgpt.shard_params` decode there, attention split by heads over its
    `tensor` axis (each device on its own heads); `split_cache` (default: on wherever `tensor` > 1): the
    programs constrain the cache they allocate to split by kv head over `tensor` too, so that each device
    writes and reads only its heads' keys and values (`mesh` says which mesh; docs/multihost.md).

    `quantize="int8"` decodes with int8 weights (jaxgpt/quantize.py): every dense kernel and the output
    head as int8 with a float scale per output, made once here. Its model is `quantize.dequantized(params)`
    (kept as `self.params`, and what the prompts are prefilled with): the tokens equal that float model's.
    `quantize="w8a8"` rounds every matmul's rows to int8 too, the prompts' included: its model is the int8
    kernels' full forward.
    """

    def __init__(self, params, config: GPTConfig, backend: Optional[Backend] = None, quantize: Optional[str] = None,
                 speculative=None, kv_dtype: Optional[str] = None, split_cache: Optional[bool] = None):
        self.quantize = check_quantize(quantize)
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.config = config.replace(remat="none")
        self.params = params if self.quantize is None else _dequantized_jit(params, config=self.config)
        # params placed on a mesh: attention split by heads there, and the cache by kv head (split_cache)
        self.backend, self.mesh = on_params_mesh(backend or resolve(config), params, split_cache)
        self.backend.setup()
        self._weights: dict = {}  # batch size -> DecodeWeights (the latest one only)
        if speculative is not None and not hasattr(speculative, "generate_with"):
            raise ValueError(f"speculative must be a jaxgpt.Speculative, got {type(speculative).__name__}")
        self.speculative = speculative
        self.last_speculative_stats = None  # rounds, proposed, accepted, acceptance of the latest call
        self.draft = None if speculative is None else speculative.draft_decoder(self)  # the draft model's

    def weights(self, batch_size: int) -> DecodeWeights:
        """The decode steps' weights for `batch_size` rows (the backend's prepared forms, made once)."""
        if batch_size not in self._weights:
            prepared = _prepare_jit(self.params, config=self.config, backend=self.backend, batch_size=batch_size,
                                    quantize=self.quantize)
            self._weights = {batch_size: DecodeWeights(self.params, prepared)}
        return self._weights[batch_size]

    def generate(self, prompts, max_new_tokens: int, rng: jax.Array, *, prompt_lengths=None,
                 temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_id: Optional[int] = None, pad_id: int = 0) -> GenerateOutput:
        """See `generate`."""
        prompts, prompt_lengths, n = _prepare(self.config, prompts, max_new_tokens, prompt_lengths, temperature,
                                              top_k, top_p, eos_id, pad_id, rng)
        sampler = Sampler.of(temperature, top_k, top_p, eos_id, pad_id)
        if self.speculative is not None:
            return self.speculative.generate_with(self, prompts, prompt_lengths, n, rng, sampler)
        return _generate(self.weights(prompts.shape[0]), jnp.asarray(prompts), jnp.asarray(prompt_lengths), rng,
                         config=self.config, backend=self.backend, max_new_tokens=n, sampler=sampler,
                         kv_dtype=self.kv_dtype, mesh=self.mesh)

    def stream(self, prompts, max_new_tokens: int, rng: jax.Array, *, chunk_size: int = 32, prompt_lengths=None,
               temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
               eos_id: Optional[int] = None, pad_id: int = 0) -> Iterator[np.ndarray]:
        """See `generate_stream`."""
        if self.speculative is not None:
            raise ValueError("Decoder.stream does not decode speculatively; use generate, or a Decoder without "
                             "speculative=")
        prompts, prompt_lengths, total = _prepare(self.config, prompts, max_new_tokens, prompt_lengths,
                                                  temperature, top_k, top_p, eos_id, pad_id, rng)
        if not is_int(chunk_size) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
        sampler = Sampler.of(temperature, top_k, top_p, eos_id, pad_id)
        static = dict(config=self.config, backend=self.backend)
        weights, done = self.weights(prompts.shape[0]), 0
        state = _prefill_jit(weights, jnp.asarray(prompts), jnp.asarray(prompt_lengths),
                             max_len=prompts.shape[1] + total, kv_dtype=self.kv_dtype, mesh=self.mesh, **static)
        while done < total:
            n = min(chunk_size, total - done)
            done += n
            state, toks = _decode_jit(weights, state, rng, n=n, sampler=sampler, last=done == total, **static)
            yield np.asarray(toks)
            if eos_id is not None and bool(np.asarray(state.done).all()):
                return


def generate(params, config: GPTConfig, prompts, max_new_tokens: int, rng: jax.Array, *,
             prompt_lengths=None, temperature: float = 1.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, eos_id: Optional[int] = None, pad_id: int = 0) -> GenerateOutput:
    """Continue each prompt row by up to `max_new_tokens` tokens, with a KV cache and lax.scan.

    prompts int [B, P]; row b's prompt is its first `prompt_lengths[b]` tokens (default all P). Rows that
    emit `eos_id` stop: their later tokens are `pad_id` and their length stops growing. Compiled once per
    (B, P, max_new_tokens, sampler settings). Each call prepares the decode weights: hold a `Decoder`
    to decode repeatedly.
    """
    return Decoder(params, config).generate(prompts, max_new_tokens, rng, prompt_lengths=prompt_lengths,
                                            temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id,
                                            pad_id=pad_id)


def generate_stream(params, config: GPTConfig, prompts, max_new_tokens: int, rng: jax.Array, *,
                    chunk_size: int = 32, prompt_lengths=None, temperature: float = 1.0,
                    top_k: Optional[int] = None, top_p: Optional[float] = None, eos_id: Optional[int] = None,
                    pad_id: int = 0) -> Iterator[np.ndarray]:
    """`generate`, yielding the new tokens chunk by chunk (int32 [B, n], n <= chunk_size) as they are
    decoded; finished rows yield `pad_id`. The same rng gives the same tokens as `generate`. One compiled
    lax.scan per chunk size; the cache stays on the device between chunks."""
    return Decoder(params, config).stream(prompts, max_new_tokens, rng, chunk_size=chunk_size,
                                          prompt_lengths=prompt_lengths, temperature=temperature, top_k=top_k,
                                          top_p=top_p, eos_id=eos_id, pad_id=pad_id)


def lower_generate(config: GPTConfig, batch_size: int, prompt_len: int, max_new_tokens: int, *,
                   backend: Optional[Backend] = None, sampler: Optional[Sampler] = None, sharding=None,
                   row_sharding=None, params=None, mesh=None, weight_shardings=None):
    """`generate`'s program lowered for abstract inputs (nothing allocated): `.compile()` it to check it
    ahead of time, e.g. for another platform's devices: `sharding` for the weights and rng, `row_sharding`
    for the prompts and their lengths (default `sharding`). `params` default: the config's abstract ones.
    `weight_shardings`: instead of `sharding` for the weights, a function from the abstract DecodeWeights
    (params and the backend's prepared forms) to their shardings, e.g. by a rules table over a mesh
    (`sharding.tree_shardings`). `mesh`: attention split by heads and the cache by kv head over its tensor
    axis, as `Decoder` does for params on a mesh."""
    backend = backend or resolve(config)
    if mesh is not None:
        backend = backend.on_mesh(mesh, ())
    config = config.replace(remat="none")
    sampler = sampler or Sampler(1.0, None, None, None, 0)
    params = abstract_params(config) if params is None else params
    prepared = jax.eval_shape(lambda p: backend.prepare_decode(cast_floats(p, config.compute_dtype), batch_size,
                                                               config.compute_dtype, config.tie_embeddings,
                                                               config=config), params)

    def place(x, where=sharding):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)

    rows = sharding if row_sharding is None else row_sharding
    weights = DecodeWeights(params, prepared)
    weights = jax.tree.map(place, weights, *(() if weight_shardings is None else (weight_shardings(weights),)))
    prompts = place(jax.ShapeDtypeStruct((batch_size, prompt_len), jnp.int32), rows)
    lengths = place(jax.ShapeDtypeStruct((batch_size,), jnp.int32), rows)
    rng = place(jax.eval_shape(lambda: jax.random.key(0)))
    return _generate.lower(weights, prompts, lengths, rng, config=config, backend=backend,
                           max_new_tokens=max_new_tokens, sampler=sampler, mesh=mesh)
