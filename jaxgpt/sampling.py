"""Sampling: logit filters as pure functions, a batched prefill, and a lax.scan decode loop."""

from __future__ import annotations

import functools
import math
import weakref
from typing import Iterator, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt import kernels
from jaxgpt.cache import KVCache
from jaxgpt.config import GPTConfig
from jaxgpt.kernels import cpu
from jaxgpt.model import GPT

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
    With top_k the draw is among the k candidates only (`lax.top_k` returns them sorted, so top-p needs
    no sort of the whole vocabulary and the noise is drawn for k logits, not V).
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
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.number)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float, np.number))
                              or not 0.0 < top_p <= 1.0):  # (NaN fails the comparison)
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")


def _check_token(name: str, value, config: GPTConfig) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < config.vocab_size:
        raise ValueError(f"{name} must be a token id in [0, {config.vocab_size}), got {value!r}")


def _check_rng(rng) -> None:
    typed = isinstance(rng, jax.Array) and jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.shape == ()
    raw = isinstance(rng, (jax.Array, np.ndarray)) and rng.dtype == np.uint32 and rng.shape == (2,)
    if not (typed or raw):
        raise ValueError(f"rng must be a PRNG key such as jax.random.key(0), got {type(rng).__name__} "
                         f"{getattr(rng, 'shape', '')}")


def _prepare(config: GPTConfig, prompts, max_new_tokens, prompt_lengths, temperature, top_k, top_p, eos_id,
             pad_id, rng) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate generate's arguments; returns (padded prompts int32 [B, P], prompt lengths [B], N)."""
    prompts = np.asarray(prompts)
    if prompts.ndim == 1:
        prompts = prompts[None, :]
    if prompts.ndim != 2 or prompts.shape[1] == 0 or prompts.shape[0] == 0:
        raise ValueError(f"prompts must be int [batch, prompt_len] with both > 0, got shape {prompts.shape}")
    if not np.issubdtype(prompts.dtype, np.integer):
        raise ValueError(f"prompts must hold integer token ids, got dtype {prompts.dtype}")
    b, p = prompts.shape
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
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
    if kernels.resolve(config.kernels) == "cpu":
        cpu.tune_allocator()  # XLA:CPU: kernels/cpu.py
    return np.where(valid, prompts, pad_id).astype(np.int32), prompt_lengths.astype(np.int32), int(max_new_tokens)


# ---------------------------------------------------------------------------------------------------
# The decode loop, shared by generate (one compiled call) and generate_stream (a call per chunk)

class _Sampler(NamedTuple):  # static: part of the compiled program's key
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    eos_id: Optional[int]
    pad_id: int


class DecodeState(NamedTuple):
    """What the decode loop carries: the cache, the logits for the next token [B, V], each row's token
    count, which rows have emitted eos, and how many tokens were drawn so far (it seeds the next draw)."""

    cache: KVCache
    logits: jax.Array
    lengths: jax.Array
    done: jax.Array
    step: jax.Array


def _model_and_params(params, config: GPTConfig, batch_size: int, decode: bool = True,
                      layout: Optional[str] = None):
    """The model and parameters to run with: the compute dtype cast once per call (not per step), and for
    the CPU kernels' decode steps their layout (kernels/cpu.py: decode_params; `layout` if given); the
    prefill (`decode=False`) keeps the stored one."""
    dtype = config.compute_dtype
    params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    if decode and kernels.resolve(config.kernels) == "cpu":
        params, layout = cpu.decode_params(params, batch_size, dtype, config.tie_embeddings, layout)
    return GPT(config.replace(remat="none"), kernel_layout=layout or "in_out"), params


_decode_params_jit = jax.jit(lambda params, *, config, batch_size, layout: _model_and_params(
    params, config, batch_size, layout=layout)[1], static_argnames=("config", "batch_size", "layout"))


_DECODE_PARAMS: dict = {}  # at most one entry: (key, weak references to the arrays it was made from, params)


def _decode_params(params, config: GPTConfig, batch_size: int):
    """(decode params or None, layout) for `_generate`/`_decode_jit`: None where the decode steps run on the
    stored layout, else the CPU kernels' decode parameters, made by one compiled call and kept for the
    next call with the same arrays. Packing costs GPT-2 124M ~0.2 s per call, most of it page faults on
    its fresh 0.5 GB. The entry goes as soon as one of its source arrays is freed (or other ones come)."""
    layout = cpu.decode_layout(batch_size, config.compute_dtype) if kernels.resolve(config.kernels) == "cpu" \
        else "in_out"
    if layout == "in_out":
        return None, layout
    leaves = jax.tree.leaves(params)
    key = (tuple(map(id, leaves)), config, batch_size, layout)
    entry = _DECODE_PARAMS.get("entry")
    if entry is not None and entry[0] == key and all(ref() is x for ref, x in zip(entry[1], leaves)):
        return entry[2], layout
    _DECODE_PARAMS.clear()
    made = _decode_params_jit(params, config=config, batch_size=batch_size, layout=layout)
    try:
        refs = [weakref.ref(x, lambda _: _DECODE_PARAMS.clear()) for x in leaves]
    except TypeError:  # (leaves that cannot be referenced weakly: nothing kept)
        return made, layout
    _DECODE_PARAMS["entry"] = (key, refs, made)
    return made, layout


def _decode_model_and_params(params, decode_params, layout: Optional[str], config: GPTConfig, batch_size: int):
    """The decode steps' model and parameters: made here, or the ones `_decode_params` made."""
    if decode_params is None:
        return _model_and_params(params, config, batch_size)
    return GPT(config.replace(remat="none"), kernel_layout=layout), decode_params


def _prefill(model, params, prompts, prompt_lengths, max_len) -> DecodeState:
    """The whole (padded) prompt at once, logits only at each row's last prompt token."""
    b = prompts.shape[0]
    cache = KVCache.create(model.config, b, max_len)
    logits, cache = model.apply({"params": params}, prompts, cache, token_lengths=prompt_lengths,
                                logits_index=prompt_lengths - 1)
    return DecodeState(cache, logits[:, 0], prompt_lengths, jnp.zeros((b,), bool), jnp.zeros((), jnp.int32))


def _emit(state: DecodeState, rng, s: _Sampler) -> tuple[DecodeState, jax.Array]:
    """Draw each row's next token from the state's logits (pad_id for finished rows)."""
    tok = sample_logits(jax.random.fold_in(rng, state.step), state.logits, s.temperature, s.top_k, s.top_p)
    tok = jnp.where(state.done, s.pad_id, tok)
    done = state.done if s.eos_id is None else state.done | (tok == s.eos_id)
    lengths = state.lengths + (~state.done).astype(jnp.int32)
    return state._replace(lengths=lengths, done=done, step=state.step + 1), tok


def _decode(model, params, state: DecodeState, rng, n: int, s: _Sampler, last: bool):
    """n tokens per row [B, n]; each is fed back through the model, except the very last one (`last`)."""
    def step(state, _):
        state, tok = _emit(state, rng, s)
        logits, cache = model.apply({"params": params}, tok[:, None], state.cache)
        return state._replace(cache=cache, logits=logits[:, 0]), tok

    state, toks = jax.lax.scan(step, state, None, length=n - 1 if last else n)
    if last:
        state, tok = _emit(state, rng, s)
        toks = jnp.concatenate([toks, tok[None]], axis=0)
    return state, toks.T


# Incremented each time `_generate` is traced; tests use it to check that new prompts don't recompile.
TRACE_COUNT = 0


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "sampler", "layout"))
def _generate(params, prompts, prompt_lengths, rng, *, config: GPTConfig, max_new_tokens: int, sampler: _Sampler,
              decode_params=None, layout: Optional[str] = None):
    global TRACE_COUNT
    TRACE_COUNT += 1
    b, p = prompts.shape
    state = _prefill(*_model_and_params(params, config, b, decode=False), prompts, prompt_lengths, p + max_new_tokens)
    model, params = _decode_model_and_params(params, decode_params, layout, config, b)
    state, new = _decode(model, params, state, rng, max_new_tokens, sampler, last=True)
    # row b's new tokens go right after its prompt (ragged rows: over the padding)
    tokens = jnp.concatenate([prompts, jnp.full((b, max_new_tokens), sampler.pad_id, jnp.int32)], axis=1)
    at = prompt_lengths[:, None] + jnp.arange(max_new_tokens)[None, :]
    tokens = tokens.at[jnp.arange(b)[:, None], at].set(new)
    return GenerateOutput(tokens, state.lengths)


def generate(params, config: GPTConfig, prompts, max_new_tokens: int, rng: jax.Array, *,
             prompt_lengths=None, temperature: float = 1.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, eos_id: Optional[int] = None, pad_id: int = 0) -> GenerateOutput:
    """Continue each prompt row by up to `max_new_tokens` tokens, with a KV cache and lax.scan.

    prompts int [B, P]; row b's prompt is its first `prompt_lengths[b]` tokens (default all P). Rows that
    emit `eos_id` stop: their later tokens are `pad_id` and their length stops growing.
    Compiled once per (B, P, max_new_tokens, sampler settings); new prompt values reuse the program.
    """
    prompts, prompt_lengths, n = _prepare(config, prompts, max_new_tokens, prompt_lengths, temperature, top_k,
                                          top_p, eos_id, pad_id, rng)
    sampler = _Sampler(float(temperature), None if top_k is None else int(top_k),
                       None if top_p is None else float(top_p), None if eos_id is None else int(eos_id), int(pad_id))
    decode_params, layout = _decode_params(params, config, prompts.shape[0])
    return _generate(params, jnp.asarray(prompts), jnp.asarray(prompt_lengths), rng, config=config,
                     max_new_tokens=n, sampler=sampler, decode_params=decode_params, layout=layout)


_prefill_jit = jax.jit(lambda params, prompts, lengths, *, config, max_len: _prefill(
    *_model_and_params(params, config, prompts.shape[0], decode=False), prompts, lengths, max_len),
    static_argnames=("config", "max_len"))


@functools.partial(jax.jit, static_argnames=("config", "n", "sampler", "last", "layout"), donate_argnums=(1,))
def _decode_jit(params, state, rng, *, config, n, sampler, last, decode_params=None, layout=None):
    model, params = _decode_model_and_params(params, decode_params, layout, config, state.lengths.shape[0])
    return _decode(model, params, state, rng, n, sampler, last)


def generate_stream(params, config: GPTConfig, prompts, max_new_tokens: int, rng: jax.Array, *,
                    chunk_size: int = 32, prompt_lengths=None, temperature: float = 1.0,
                    top_k: Optional[int] = None, top_p: Optional[float] = None, eos_id: Optional[int] = None,
                    pad_id: int = 0) -> Iterator[np.ndarray]:
    """`generate`, yielding the new tokens chunk by chunk (int32 [B, n], n <= chunk_size) as they are
    decoded; finished rows yield `pad_id`. The same rng gives the same tokens as `generate`. Each chunk is
    one compiled lax.scan (compiled once per chunk size), and the cache stays on the device between them."""
    prompts, prompt_lengths, total = _prepare(config, prompts, max_new_tokens, prompt_lengths, temperature,
                                              top_k, top_p, eos_id, pad_id, rng)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    sampler = _Sampler(float(temperature), None if top_k is None else int(top_k),
                       None if top_p is None else float(top_p), None if eos_id is None else int(eos_id), int(pad_id))
    state = _prefill_jit(params, jnp.asarray(prompts), jnp.asarray(prompt_lengths), config=config,
                         max_len=prompts.shape[1] + total)
    decode_params, layout = _decode_params(params, config, prompts.shape[0])
    done = 0
    while done < total:
        n = min(chunk_size, total - done)
        done += n
        state, toks = _decode_jit(params, state, rng, config=config, n=n, sampler=sampler, last=done == total,
                                  decode_params=decode_params, layout=layout)
        yield np.asarray(toks)
        if eos_id is not None and bool(np.asarray(state.done).all()):
            return
