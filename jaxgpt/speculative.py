"""Speculative decoding: a draft proposes k tokens, the target checks them all in one forward.

Each round, per row: the draft proposes d_1..d_k (a smaller jaxgpt model decoding k steps with its own KV
cache, or n-gram lookup: the tokens that followed an earlier occurrence of the row's last n tokens
in its prompt and output, which needs no second model); the target runs [last, d_1..d_k] through its cache
in one call (k + 1 positions) and keeps the longest accepted prefix plus one token of its own, so a round
emits 1 to k + 1 tokens. Greedy: d_i is accepted while it is the target's argmax, so the output is plain
greedy decoding's. Sampling: d_i is accepted with probability min(1, p(d_i) / q(d_i)) and the first
rejection is replaced by a draw from max(0, p - q) renormalised (q: the draft's distribution, a point mass
for n-gram proposals), which leaves the output distributed as the target's own sampling (p: the target's
distribution after temperature, top-k and top-p; the draft samples with the same settings).

The cache keeps only what was accepted: each row's length moves past the accepted tokens, and positions
written beyond it are overwritten later. The whole loop is one `lax.while_loop` in one compiled program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.backends import Backend, DecodeWeights
from jaxgpt.backends.base import cast_floats
from jaxgpt.checks import is_int
from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT
from jaxgpt.sampling import (Decoder, GenerateOutput, _prefill, argmax_last, categorical, scale_logits, top_k_filter,
                             top_p_filter)


@dataclasses.dataclass(frozen=True)
class Speculative:
    """Speculative decoding's settings: `k` tokens proposed per round by `draft`: "ngram" (lookup of the
    last `ngram` tokens in the row's own text) or a (params, GPTConfig) pair of a smaller model with the
    target's vocabulary."""

    k: int = 4
    draft: object = "ngram"
    ngram: int = 3

    def __post_init__(self):
        if not is_int(self.k) or not 1 <= self.k <= 15:
            raise ValueError(f"speculative k must be an integer in [1, 15], got {self.k!r}")
        if not is_int(self.ngram) or self.ngram < 1:
            raise ValueError(f"speculative ngram must be an integer >= 1, got {self.ngram!r}")
        if isinstance(self.draft, str):
            if self.draft != "ngram":
                raise ValueError(f"draft must be 'ngram' or a (params, GPTConfig) pair, got {self.draft!r}")
        elif not (isinstance(self.draft, tuple) and len(self.draft) == 2 and isinstance(self.draft[1], GPTConfig)):
            raise ValueError("draft must be 'ngram' or a (params, GPTConfig) pair of the draft model")

    @property
    def uses_model(self) -> bool:
        return not isinstance(self.draft, str)

    def draft_decoder(self, decoder: Decoder) -> Optional[Decoder]:
        """The draft model's Decoder for a target `decoder` (None for n-gram drafts); its vocabulary must be
        the target's."""
        if not self.uses_model:
            return None
        params, config = self.draft
        if config.vocab_size != decoder.config.vocab_size:
            raise ValueError(f"the draft model's vocab_size ({config.vocab_size}) differs from the target's "
                             f"({decoder.config.vocab_size}); a draft must use the target's tokenizer")
        return Decoder(params, config, quantize=decoder.quantize)

    def generate_with(self, decoder: Decoder, prompts, prompt_lengths, n: int, rng, sampler) -> GenerateOutput:
        """`decoder.generate` by speculative decoding (arguments already checked); its stats are kept in
        `decoder.last_speculative_stats`."""
        b = prompts.shape[0]
        if prompts.shape[1] + n + self.k > decoder.config.block_size:
            raise ValueError(f"prompt length ({prompts.shape[1]}) + max_new_tokens ({n}) + speculative k ({self.k}) "
                             f"exceeds block_size ({decoder.config.block_size}); ask for fewer tokens")
        draft = decoder.draft
        out, stats = speculative_generate(
            decoder.weights(b * (self.k + 1)), None if draft is None else draft.weights(2 * b), jnp.asarray(prompts),
            jnp.asarray(prompt_lengths), rng, config=decoder.config, backend=decoder.backend,
            draft_config=None if draft is None else draft.config, draft_backend=None if draft is None else draft.backend,
            max_new_tokens=n, k=self.k, ngram=self.ngram, sampler=sampler, kv_dtype=decoder.kv_dtype)
        decoder.last_speculative_stats = stats_of(stats)
        return out


class SpecStats(dict):
    """rounds, proposed and accepted draft tokens of a speculative call, and the acceptance rate."""


def _filtered(logits, temperature, top_k, top_p):
    """The sampling distribution's log-probabilities [..., V] (temperature >= MIN_TEMPERATURE), as
    `sample_logits` draws."""
    x = scale_logits(logits, temperature)
    if top_k is not None and top_k < x.shape[-1]:
        x = top_k_filter(x, top_k)
    if top_p is not None and top_p < 1.0:
        x = top_p_filter(x, top_p)
    return jax.nn.log_softmax(x, axis=-1)


def _choose(key, logits, sampler):
    """One draw per row of logits [B, V] with the sampler's settings, and the log-probs it drew from."""
    if sampler.temperature == 0:
        return argmax_last(logits), None
    logp = _filtered(logits, sampler.temperature, sampler.top_k, sampler.top_p)
    return categorical(key, logp), logp


def _ngram_proposals(hist, hist_len, n: int, k: int):
    """For each row of hist [B, H] (its first hist_len tokens real): the k tokens after an earlier
    occurrence of its last n tokens, the latest with k tokens after it, else the earliest ([B, k]; the row's
    last token repeated where there is none)."""
    b, h = hist.shape
    pos = jnp.arange(h)
    tail = jax.vmap(lambda row, ln: jax.lax.dynamic_slice_in_dim(row, ln - n, n))(hist, jnp.maximum(hist_len, n))
    match = jnp.ones((b, h), bool)
    for i in range(n):
        shifted = jnp.roll(hist, -i, axis=1)  # shifted[:, j] = hist[:, j + i]
        match &= shifted == tail[:, i:i + 1]
    # an occurrence that starts at j ends before the tail starts, and has a token after it
    match &= (pos[None, :] + n < hist_len[:, None]) & (hist_len[:, None] >= n + 1)
    # the latest occurrence with k tokens after it, else the earliest (the longest continuation)
    room = jnp.minimum(hist_len[:, None] - pos[None, :] - n, k)
    start = jnp.argmax(jnp.where(match, room * h + pos[None, :], -1), axis=1)
    start = jnp.where(match.any(axis=1), start, -1)
    last = jax.vmap(lambda row, ln: row[ln - 1])(hist, hist_len)
    idx = start[:, None] + n + jnp.arange(k)[None, :]
    found = (start[:, None] >= 0) & (idx < hist_len[:, None])
    got = jnp.take_along_axis(hist, jnp.clip(idx, 0, h - 1), axis=1)
    return jnp.where(found, got, last[:, None]).astype(jnp.int32)


def ngram_lookup(tokens, n: int, k: int) -> list:
    """Host-side n-gram drafting (the engine's): the up to k tokens after an earlier occurrence of the last
    n of `tokens` (the latest with k tokens after it, else the earliest), [] when there is none;
    `_ngram_proposals` for one row, without the padding."""
    arr = np.asarray(tokens, np.int64)
    if k <= 0 or len(arr) < n + 1:
        return []
    windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # starts 0 .. len - n - 1
    hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
    if not hits.size:
        return []
    full = hits[hits + n + k <= len(arr)]
    start = int(full[-1] if full.size else hits[0]) + n
    return arr[start:start + k].tolist()


def _put_rows(buf, rows, at):
    """buf [B, N] with rows [B, m] written at each row's offset at [B]."""
    return jax.vmap(lambda b, r, a: jax.lax.dynamic_update_slice_in_dim(b, r, a, 0))(buf, rows, at)


def _accept_greedy(logits, d):
    """Greedy: proposals accepted while each is the target's argmax; then the target's own argmax."""
    k = d.shape[1]
    g = argmax_last(logits)  # [B, k + 1]
    n_acc = jnp.sum(jnp.cumprod(d == g[:, :k], axis=1), axis=1)
    return n_acc, jnp.take_along_axis(g, n_acc[:, None], axis=1)[:, 0]


def _accept_sampled(logits, d, q_logp, sampler, key):
    """Sampling: d_i accepted with probability min(1, p(d_i) / q(d_i)); the first rejected one replaced by
    a draw from max(0, p - q) renormalised (from p after the last proposal when all are accepted)."""
    k_accept, k_final = jax.random.split(key)
    p_logp = _filtered(logits, sampler.temperature, sampler.top_k, sampler.top_p)  # [B, k + 1, V]
    p_d = jnp.exp(jnp.take_along_axis(p_logp[:, :-1], d[..., None], axis=-1)[..., 0])
    if q_logp is None:  # n-gram: a point mass at each proposal
        q_all = jax.nn.one_hot(d, logits.shape[-1], dtype=jnp.float32)
        q_d = jnp.ones_like(p_d)
    else:
        q_all = jnp.exp(q_logp)
        q_d = jnp.take_along_axis(q_all, d[..., None], axis=-1)[..., 0]
    ok = jax.random.uniform(k_accept, p_d.shape) * q_d < p_d  # u < p / q, without dividing by a zero q
    n_acc = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)
    p_at = jnp.take_along_axis(jnp.exp(p_logp), n_acc[:, None, None], axis=1)[:, 0]
    q_pad = jnp.concatenate([q_all, jnp.zeros_like(q_all[:, :1])], axis=1)  # nothing to take away after k
    resid = jnp.maximum(p_at - jnp.take_along_axis(q_pad, n_acc[:, None, None], axis=1)[:, 0], 0.0)
    resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p_at)
    return n_acc, categorical(k_final, jnp.log(resid))


def _propose_with_model(draft: GPT, variables, c, key, k: int, sampler):
    """k proposals [B, k] from the draft model, their log-probs [B, k, V] (None when greedy) and its cache.
    A row whose last round accepted every proposal has the draft's cache one token behind: its first step
    feeds that token (the one before `last`) too."""
    before = jax.vmap(lambda row, ln: row[ln - 2])(c["hist"], c["hist_len"])
    behind = c["behind"][:, None] == 1
    two = jnp.where(behind, jnp.stack([before, c["last"]], 1), jnp.stack([c["last"], c["last"]], 1))
    width = 1 + c["behind"]
    logits, cache = draft.apply(variables, two, c["cache_d"], token_lengths=width, logits_index=width - 1)
    toks, logps = [], []
    for i in range(k):
        tok, logp = _choose(jax.random.fold_in(key, i), logits[:, 0], sampler)
        toks.append(tok)
        logps.append(logp)
        if i + 1 < k:
            logits, cache = draft.apply(variables, tok[:, None], cache)
    return jnp.stack(toks, 1), None if sampler.temperature == 0 else jnp.stack(logps, 1), cache


def _round(c: dict, key, *, target: GPT, t_vars, draft: Optional[GPT], d_vars, k: int, ngram: int, n: int, sampler):
    """One round: proposals, the target's check of them in one forward, and the accepted tokens kept."""
    k_draft, k_accept = jax.random.split(key)
    active = c["n_out"] < n
    if draft is None:
        d, q_logp, cache_d = _ngram_proposals(c["hist"], c["hist_len"], ngram, k), None, None
    else:
        d, q_logp, cache_d = _propose_with_model(draft, d_vars, c, k_draft, k, sampler)
    L = c["cache_t"].lengths
    tokens = jnp.concatenate([c["last"][:, None], d], axis=1)  # [B, k + 1] at positions L .. L + k
    logits, cache_t = target.apply(t_vars, tokens, c["cache_t"])
    if sampler.temperature == 0:
        n_acc, final = _accept_greedy(logits, d)
    else:
        n_acc, final = _accept_sampled(logits, d, q_logp, sampler, k_accept)
    emitted = jnp.concatenate([d, jnp.zeros_like(d[:, :1])], axis=1)
    emitted = jnp.where(jnp.arange(k + 1)[None, :] == n_acc[:, None], final[:, None], emitted)
    step = jnp.where(active, n_acc + 1, 0)
    new = dict(c, n_out=c["n_out"] + step, hist_len=c["hist_len"] + step, round=c["round"] + 1,
               out=jnp.where(active[:, None], _put_rows(c["out"], emitted, jnp.minimum(c["n_out"], n)), c["out"]),
               hist=jnp.where(active[:, None], _put_rows(c["hist"], emitted, c["hist_len"]), c["hist"]),
               last=jnp.where(active, final, c["last"]), cache_t=cache_t.replace(lengths=L + step),
               proposed=c["proposed"] + k * jnp.sum(active), accepted=c["accepted"] + jnp.sum(jnp.where(active, n_acc, 0)))
    if draft is not None:  # the draft's cache holds last, d_1 .. d_{k-1}: valid through the accepted ones
        new["cache_d"] = cache_d.replace(lengths=jnp.where(active, L + jnp.minimum(n_acc + 1, k), c["cache_d"].lengths))
        new["behind"] = jnp.where(active, (n_acc == k).astype(jnp.int32), c["behind"])
    return new


def _finish(c: dict, prompts_BxP, prompt_lengths_B, n: int, sampler) -> GenerateOutput:
    """The rows' first n tokens after their prompts, padding after a row's first end token."""
    b = prompts_BxP.shape[0]
    new_BxN = c["out"][:, :n]
    count = jnp.full((b,), n, jnp.int32)
    if sampler.eos_id is not None:
        is_eos = new_BxN == sampler.eos_id
        after = (jnp.cumsum(is_eos, axis=1) - is_eos) > 0
        new_BxN = jnp.where(after, sampler.pad_id, new_BxN)
        count = n - jnp.sum(after, axis=1)
    tokens = jnp.concatenate([prompts_BxP, jnp.full((b, n), sampler.pad_id, jnp.int32)], axis=1)
    at = prompt_lengths_B[:, None] + jnp.arange(n)[None, :]
    return GenerateOutput(tokens.at[jnp.arange(b)[:, None], at].set(new_BxN), prompt_lengths_B + count)


@functools.partial(jax.jit, static_argnames=("config", "backend", "draft_config", "draft_backend", "max_new_tokens",
                                             "k", "ngram", "sampler", "kv_dtype"))
def speculative_generate(weights: DecodeWeights, draft_weights: Optional[DecodeWeights], prompts_BxP,
                         prompt_lengths_B, rng, *, config: GPTConfig, backend: Backend,
                         draft_config: Optional[GPTConfig], draft_backend: Optional[Backend], max_new_tokens: int,
                         k: int, ngram: int, sampler, kv_dtype=None):
    """`generate`'s output (tokens [B, P + N], lengths [B]) by speculative decoding, and SpecStats arrays."""
    b, p = prompts_BxP.shape
    n = max_new_tokens
    max_len = min(config.block_size, p + n + 2 * k + 2)
    target = GPT(config, backend)
    t_weights = weights.replace(params=cast_floats(weights.params, config.compute_dtype))
    state = _prefill(target, t_weights.prefill_variables(), prompts_BxP, prompt_lengths_B, max_len, kv_dtype)
    first, _ = _choose(jax.random.fold_in(rng, 0), state.logits, sampler)
    draft = d_vars = cache_d = None
    if draft_config is not None:
        draft = GPT(draft_config, draft_backend)
        d_weights = draft_weights.replace(params=cast_floats(draft_weights.params, draft_config.compute_dtype))
        d_vars = d_weights.variables()
        cache_d = _prefill(draft, d_weights.prefill_variables(), prompts_BxP, prompt_lengths_B,
                           min(draft_config.block_size, max_len), kv_dtype).cache
    hist = jnp.concatenate([prompts_BxP, jnp.zeros((b, n + 2 * k + 2), jnp.int32)], axis=1)
    zero = jnp.zeros((), jnp.int32)
    carry = dict(cache_t=state.cache, cache_d=cache_d, last=first, n_out=jnp.ones((b,), jnp.int32),
                 out=jnp.zeros((b, n + k + 1), jnp.int32).at[:, 0].set(first),
                 hist=_put_rows(hist, first[:, None], prompt_lengths_B), hist_len=prompt_lengths_B + 1,
                 behind=jnp.zeros((b,), jnp.int32), round=zero, proposed=zero, accepted=zero)
    one_round = functools.partial(_round, target=target, t_vars=t_weights.variables(), draft=draft, d_vars=d_vars,
                                  k=k, ngram=ngram, n=n, sampler=sampler)
    c = jax.lax.while_loop(lambda c: jnp.any(c["n_out"] < n),
                           lambda c: one_round(c, jax.random.fold_in(rng, c["round"] + 1)), carry)
    stats = dict(rounds=c["round"], proposed=c["proposed"], accepted=c["accepted"])
    return _finish(c, prompts_BxP, prompt_lengths_B, n, sampler), stats


def stats_of(raw: dict) -> SpecStats:
    """Host-side SpecStats of `speculative_generate`'s stats arrays."""
    out = SpecStats({k: int(np.asarray(v)) for k, v in raw.items()})
    out["acceptance"] = out["accepted"] / out["proposed"] if out["proposed"] else 0.0
    return out
