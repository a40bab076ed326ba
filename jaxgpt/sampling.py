"""Sampling: logit filters as pure functions, a batched prefill, and a lax.scan decode loop."""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.cache import KVCache
from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT, transpose_kernels
from jaxgpt.ops import SMALL_ROWS

NEG_INF = -jnp.inf


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
    return jnp.cumsum(probs, axis=-1) - probs < p  # the top token always has mass 0 before it


def top_p_filter(logits: jax.Array, p: float) -> jax.Array:
    """Keep the smallest set of largest-probability tokens whose total reaches p (the crossing token too)."""
    order = jnp.argsort(-logits, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    keep = jnp.put_along_axis(jnp.zeros(logits.shape, bool), order, _top_p_keep(sorted_logits, p), axis=-1,
                              inplace=False)
    return jnp.where(keep, logits, NEG_INF)


def sample_logits(rng: jax.Array, logits: jax.Array, temperature: float = 1.0,
                  top_k: Optional[int] = None, top_p: Optional[float] = None) -> jax.Array:
    """Draw int32 token ids [B] from logits [B, V]; temperature 0 is greedy (argmax).

    The distribution is softmax(logits / temperature) restricted by `top_k_filter` then `top_p_filter`.
    With top_k it is drawn among the k candidates only (their logits come sorted from `lax.top_k`, so
    top-p needs no sort of the vocabulary): on GPT-2's 50257 tokens, drawing Gumbel noise over the whole
    vocabulary took about 8% of a batch-1 decode step.
    """
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        values, candidates = jax.lax.top_k(logits, top_k)  # descending, ties broken by index
        if top_p is not None and top_p < 1.0:
            values = jnp.where(_top_p_keep(values, top_p), values, NEG_INF)
        choice = jax.random.categorical(rng, values, axis=-1)
        return jnp.take_along_axis(candidates, choice[..., None], axis=-1)[..., 0].astype(jnp.int32)
    if top_p is not None and top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


class GenerateOutput(NamedTuple):
    tokens: jax.Array   # int32 [B, P + N]: prompt then generated tokens, padding past `lengths`
    lengths: jax.Array  # int32 [B]


def validate_sampler(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    """Raise ValueError for sampler settings outside their domain."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")


# Incremented each time `_generate` is traced; tests use it to check that new prompts don't recompile.
TRACE_COUNT = 0


def generate(params, config: GPTConfig, prompts, max_new_tokens: int, rng: jax.Array, *,
             prompt_lengths=None, temperature: float = 1.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, eos_id: Optional[int] = None, pad_id: int = 0) -> GenerateOutput:
    """Continue each prompt row by up to `max_new_tokens` tokens, with a KV cache and lax.scan.

    prompts int [B, P]; row b's prompt is its first `prompt_lengths[b]` tokens (default all P). Rows that
    emit `eos_id` stop: their later tokens are `pad_id` and their length stops growing.
    Compiled once per (B, P, max_new_tokens, sampler settings).
    """
    prompts = np.asarray(prompts)
    if prompts.ndim == 1:
        prompts = prompts[None, :]
    if prompts.ndim != 2 or prompts.shape[1] == 0 or prompts.shape[0] == 0:
        raise ValueError(f"prompts must be int [batch, prompt_len] with both > 0, got shape {prompts.shape}")
    if not np.issubdtype(prompts.dtype, np.integer):
        raise ValueError(f"prompts must hold integer token ids, got dtype {prompts.dtype}")
    b, p = prompts.shape
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
    max_new_tokens = int(max_new_tokens)
    if p + max_new_tokens > config.block_size:
        raise ValueError(f"prompt length ({p}) + max_new_tokens ({max_new_tokens}) = "
                         f"{p + max_new_tokens} exceeds block_size ({config.block_size}); "
                         "shorten the prompt or ask for fewer tokens")
    if prompt_lengths is None:
        prompt_lengths = np.full((b,), p, np.int32)
    prompt_lengths = np.asarray(prompt_lengths)
    if prompt_lengths.shape != (b,):
        raise ValueError(f"prompt_lengths must have shape ({b},), got {prompt_lengths.shape}")
    if prompt_lengths.min() < 1 or prompt_lengths.max() > p:
        raise ValueError(f"prompt_lengths must be in [1, {p}] (the prompt array's length), got "
                         f"{prompt_lengths.tolist()}")
    valid = np.arange(p)[None, :] < prompt_lengths[:, None]
    used = prompts[valid]
    if used.min() < 0 or used.max() >= config.vocab_size:
        bad = int(used.min()) if used.min() < 0 else int(used.max())
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {config.vocab_size})")
    validate_sampler(temperature, top_k, top_p)
    if eos_id is not None and not 0 <= eos_id < config.vocab_size:
        raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {config.vocab_size})")
    prompts = np.where(valid, prompts, pad_id).astype(np.int32)
    return _generate(params, jnp.asarray(prompts), jnp.asarray(prompt_lengths, jnp.int32), rng,
                     config=config, max_new_tokens=max_new_tokens, temperature=float(temperature),
                     top_k=None if top_k is None else int(top_k),
                     top_p=None if top_p is None else float(top_p), eos_id=eos_id, pad_id=int(pad_id))


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "temperature", "top_k", "top_p",
                                             "eos_id", "pad_id"))
def _generate(params, prompts, prompt_lengths, rng, *, config, max_new_tokens, temperature, top_k, top_p,
              eos_id, pad_id):
    global TRACE_COUNT
    TRACE_COUNT += 1
    b, p = prompts.shape
    # For 2..16 rows, kernels [out, in] make the decode matmuls faster (see model.transpose_kernels): one
    # copy per call. One row is a matrix-vector product, already near the memory bound in GPT-2's layout
    # (there the copy cost 6% of a 128-token batch-1 call and the layout gained nothing).
    out_in = 1 < b <= SMALL_ROWS
    # layer by layer even with scan_layers: the scan would copy the stacked parameters and the whole cache
    # at every step (same results either way)
    model = GPT(config.replace(scan_layers=False, remat="none"), kernel_out_in=out_in)
    if out_in:
        params = transpose_kernels(params)
    total = p + max_new_tokens
    cache = KVCache.create(config, b, total)
    # Prefill: the whole (padded) prompt at once, logits only at each row's last prompt token.
    logits, cache = model.apply({"params": params}, prompts, cache, token_lengths=prompt_lengths,
                                logits_index=prompt_lengths - 1)
    tokens = jnp.concatenate([prompts, jnp.full((b, max_new_tokens), pad_id, jnp.int32)], axis=1)
    rows = jnp.arange(b)

    def emit(state, logits, step):
        tokens, lengths, done = state
        tok = sample_logits(jax.random.fold_in(rng, step), logits[:, 0, :], temperature, top_k, top_p)
        tok = jnp.where(done, pad_id, tok)
        tokens = tokens.at[rows, lengths].set(jnp.where(done, tokens[rows, lengths], tok))
        lengths = lengths + (~done).astype(jnp.int32)
        if eos_id is not None:
            done = done | (tok == eos_id)
        return (tokens, lengths, done), tok

    def step_fn(carry, step):
        state, cache, logits = carry
        state, tok = emit(state, logits, step)
        logits, cache = model.apply({"params": params}, tok[:, None], cache)
        return (state, cache, logits), None

    state = (tokens, prompt_lengths, jnp.zeros((b,), bool))
    (state, _, logits), _ = jax.lax.scan(step_fn, (state, cache, logits),
                                         jnp.arange(max_new_tokens - 1, dtype=jnp.int32))
    (tokens, lengths, _), _ = emit(state, logits, max_new_tokens - 1)
    return GenerateOutput(tokens, lengths)
