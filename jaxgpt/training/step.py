"""The pure training step: loss, optimizer, TrainState and the step-0 state, train_step and eval_step."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding

from jaxgpt.backends import Backend, resolve
from jaxgpt.checks import is_int
from jaxgpt.config import GPTConfig
from jaxgpt.lora import LoraSpec, adapter_decay_mask, init_adapters, trainable_labels
from jaxgpt.model import GPT, init_params
from jaxgpt.schema import map_params


@struct.dataclass
class TrainState:
    """Everything the step changes: step counter, params, optimizer state and the dropout RNG; and, when
    the params are LoRA adapters, the frozen base parameters they adapt (`frozen`, never updated)."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    frozen: Any = None


def lr_schedule(lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to lr over warmup_steps, cosine to min_lr at decay_steps, then min_lr."""
    if decay_steps <= warmup_steps:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, max(warmup_steps, 1)), optax.constant_schedule(min_lr)],
            [max(warmup_steps, 1)])
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, decay_steps, end_value=min_lr)


def wsd_schedule(lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                 decay_fraction: float) -> optax.Schedule:
    """Warmup-stable-decay: linear warmup from 0 to lr over warmup_steps, lr held, then a linear decay to
    min_lr over the last `decay_fraction` of the decay_steps (at least one step), then min_lr."""
    cool = max(1, round(decay_fraction * decay_steps))
    start = max(decay_steps - cool, warmup_steps)
    pieces = [optax.linear_schedule(0.0, lr, max(warmup_steps, 1)), optax.constant_schedule(lr),
              optax.linear_schedule(lr, min_lr, max(decay_steps - start, 1))]
    return optax.join_schedules(pieces, [max(warmup_steps, 1), start])


def decay_mask(params, config: Optional[GPTConfig] = None) -> Any:
    """Weight decay on the parameters their layers declare decayed (schema.ParamInfo.decay: matrices and
    embeddings; not biases, norms' scales or the attention's value-embedding mix). `config`: the
    model's, when `params` may not be a tree this process has seen (jaxgpt.schema.leaf_infos)."""
    return map_params(lambda p, info: info.decay, params, config)


def make_schedule(train_cfg) -> optax.Schedule:
    """The learning-rate schedule that a training config's `train` section describes: "cosine" (warmup,
    cosine decay) or "wsd" (warmup, stable, linear decay over the last train.decay_fraction)."""
    decay = train_cfg.max_steps if train_cfg.decay_steps is None else train_cfg.decay_steps
    if train_cfg.get("schedule", "cosine") == "wsd":
        return wsd_schedule(train_cfg.lr, train_cfg.min_lr, train_cfg.warmup_steps, decay, train_cfg.decay_fraction)
    return lr_schedule(train_cfg.lr, train_cfg.min_lr, train_cfg.warmup_steps, decay)


def muon_dimensions(params, config: Optional[GPTConfig] = None) -> Any:
    """Which parameters Muon trains, as optax's MuonDimensionNumbers (the matrix axes: the last two, the
    stacked blocks of scan_layers batched over their first): those their layers declare `muon` (every
    block's dense kernels). None for the rest (embeddings, head, norms, biases, mixing weights), which
    AdamW trains. `config` as for `decay_mask`."""
    def dims(p, info):
        if not info.muon or p.ndim < 2:
            return None
        return optax.contrib.MuonDimensionNumbers(reduction_axis=p.ndim - 2, output_axis=p.ndim - 1)

    return map_params(dims, params, config)


def _muon_labels(params, config: Optional[GPTConfig] = None) -> Any:
    is_dims = lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)  # noqa: E731
    return jax.tree_util.tree_map(lambda d: "adamw" if d is None else "muon", muon_dimensions(params, config),
                                  is_leaf=is_dims)


def scale_by_width() -> optax.GradientTransformation:
    """Muon's shape factor: an orthogonalised [.., in, out] update times sqrt(max(1, out / in))."""
    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map(lambda u: u * max(1.0, u.shape[-1] / u.shape[-2]) ** 0.5, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Muon's quintic (optax's default, Keller Jordan's modded-nanogpt)


def newton_schulz(x: jax.Array, steps: int = 5, dtype=jnp.float32) -> jax.Array:
    """Muon's orthogonalisation of the matrices x [..., m, n] (leading axes batch): on the wide orientation,
    scaled to unit Frobenius norm, `steps` quintic iterations x <- a x + (b A + c A^2) x with A = x x^T,
    their matmuls on `dtype` operands accumulating in float32 (bfloat16 halves the time on CPUs with it)."""
    a, b, c = NS_COEFFS
    tall = x.shape[-2] > x.shape[-1]
    x = jnp.swapaxes(x, -1, -2) if tall else x
    x = x.astype(jnp.float32)
    x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + 1e-8)
    mm = lambda u, v: jnp.matmul(u.astype(dtype), v.astype(dtype), preferred_element_type=jnp.float32)  # noqa: E731
    for _ in range(steps):
        gram = mm(x, jnp.swapaxes(x, -1, -2))
        x = a * x + mm(b * gram + c * mm(gram, gram), x)
    return jnp.swapaxes(x, -1, -2) if tall else x


def orthogonalize(steps: int = 5, dtype=jnp.float32) -> optax.GradientTransformation:
    """`newton_schulz` over every update (the matrices' last two axes)."""
    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map(lambda u: newton_schulz(u, steps, dtype).astype(u.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def muon(train_cfg, schedule: optax.Schedule, config: Optional[GPTConfig] = None) -> optax.GradientTransformation:
    """Muon (optax.contrib.scale_by_muon's Nesterov momentum train.muon_momentum; then 5 Newton-Schulz
    steps, in train.muon_ns_dtype), the width factor, decoupled weight decay, and train.muon_lr on the
    schedule's shape."""
    scale = train_cfg.muon_lr / train_cfg.lr
    ns_dtype = jnp.dtype(train_cfg.get("muon_ns_dtype", "float32"))
    return optax.chain(
        # optax's momentum and normalisation (ns_steps=0), then the iterations in the chosen precision
        optax.contrib.scale_by_muon(ns_steps=0, beta=train_cfg.muon_momentum, nesterov=True,
                                    weight_dimension_numbers=functools.partial(muon_dimensions, config=config)),
        orthogonalize(5, ns_dtype),
        scale_by_width(),
        optax.add_decayed_weights(train_cfg.weight_decay),
        optax.scale_by_learning_rate(lambda step: schedule(step) * scale))


def make_optimizer(train_cfg, config: Optional[GPTConfig] = None) -> optax.GradientTransformation:
    """Clipping by global norm, then AdamW with the schedule and the decay mask; with train.optimizer
    "muon", Muon for the blocks' matmul kernels and AdamW for the rest (both as the parameter schema
    says: `decay_mask`, `muon_dimensions`; `config` the model's GPTConfig, else the schema is found by the
    params' names and shapes). With LoRA (train.lora.rank > 0) the params are adapters: AdamW trains (and
    decays) their a and b, and their constants (the column masks and scales) take no update and hold no
    optimizer state."""
    schedule = make_schedule(train_cfg)
    lora = "lora" in train_cfg and train_cfg.lora.rank > 0
    parts = []
    if train_cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(train_cfg.grad_clip))
    mask = adapter_decay_mask if lora else functools.partial(decay_mask, config=config)
    adamw = optax.adamw(schedule, b1=train_cfg.beta1, b2=train_cfg.beta2, weight_decay=train_cfg.weight_decay,
                        mask=mask)
    if train_cfg.get("optimizer", "adamw") == "muon":
        adamw = optax.multi_transform({"muon": muon(train_cfg, schedule, config), "adamw": adamw},
                                      functools.partial(_muon_labels, config=config))
    parts.append(adamw)
    optimizer = optax.chain(*parts)
    if lora:
        optimizer = optax.multi_transform({"train": optimizer, "freeze": optax.set_to_zero()}, trainable_labels)
    return optimizer


def create_train_state(params, optimizer: optax.GradientTransformation, rng: jax.Array, frozen=None) -> TrainState:
    """A step-0 state: `params` are what trains (LoRA adapters, with the base model as `frozen`)."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=jax.jit(optimizer.init)(params),
                      rng=rng, frozen=frozen)


def init_train_state(config: GPTConfig, optimizer: optax.GradientTransformation, seed: int,
                     lora: Optional[LoraSpec] = None, params=None) -> TrainState:
    """The step-0 state a run starts from: `params` (default: fresh from key(seed)), or with `lora` adapters
    over them from key(seed + 2), the params frozen; the dropout rng key(seed + 1). The one builder: the
    loop initialises and restores through it, jaxgpt.aot lowers the step for its shapes."""
    p = init_params(config, jax.random.key(seed)) if params is None else params
    if lora is None:
        return create_train_state(p, optimizer, jax.random.key(seed + 1))
    adapters = init_adapters(p, config, lora, jax.random.key(seed + 2))
    return create_train_state(adapters, optimizer, jax.random.key(seed + 1), frozen=p)


def model_variables(params, frozen=None) -> dict:
    """The variables the model applies: the params, or the frozen base plus LoRA adapters."""
    return {"params": params} if frozen is None else {"params": frozen, "lora": params}


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in float32; logits [B, T, V], targets int [B, T]."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return losses.mean()


def chunked_cross_entropy(head: Callable[[Any, jax.Array], jax.Array], head_vars: Any, h_BxTxD: jax.Array,
                          targets_BxT: jax.Array, chunk: int) -> jax.Array:
    """cross_entropy(head(head_vars, h), targets) for hidden states h [B, T, D], computed over chunks of
    `chunk` positions of every row: one [B, chunk, V] block of logits at a time, recomputed in the backward
    pass (jax.checkpoint) instead of kept, so the whole [B, T, V] logits never exist. Each chunk spans all
    the rows, so rows sharded over devices stay sharded; a last partial chunk is padded and masked out."""
    if check_loss_chunk(chunk) == 0:
        raise ValueError("config.train.loss_chunk: chunked_cross_entropy needs chunks of >= 1 positions")
    b, t, d = h_BxTxD.shape
    c = min(chunk, t)
    n = -(-t // c)
    pad = n * c - t
    mask_BxT = jnp.pad(jnp.ones((b, t), jnp.float32), ((0, 0), (0, pad)))
    h_BxTxD = jnp.pad(h_BxTxD, ((0, 0), (0, pad), (0, 0)))
    targets_BxT = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
    hs_NxBxCxD = h_BxTxD.reshape(b, n, c, d).swapaxes(0, 1)
    ys_NxBxC, ms_NxBxC = (a.reshape(b, n, c).swapaxes(0, 1) for a in (targets_BxT, mask_BxT))

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk_sum(head_vars, h_BxCxD, y_BxC, m_BxC):
        logits_BxCxV = head(head_vars, h_BxCxD).astype(jnp.float32)
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits_BxCxV, y_BxC) * m_BxC)

    def body(total, xs):
        return total + chunk_sum(head_vars, *xs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (hs_NxBxCxD, ys_NxBxC, ms_NxBxC))
    return total / (b * t)


def check_loss_chunk(loss_chunk) -> int:
    """`loss_chunk` itself when it is an integer >= 0 (0: whole logits); else a ValueError naming the key."""
    if not is_int(loss_chunk) or loss_chunk < 0:
        raise ValueError(f"config.train.loss_chunk: must be an integer >= 0 (positions per chunk of the loss; "
                         f"0 computes the whole logits), got {loss_chunk!r}")
    return int(loss_chunk)


def model_loss(model: GPT, variables: dict, x: jax.Array, y: jax.Array, loss_chunk: int = 0, **apply_kw) -> jax.Array:
    """Mean next-token cross-entropy of `model` on x, y int [B, T]: from the whole logits [B, T, V], or with
    `loss_chunk` > 0 from the final hidden states, `loss_chunk` positions at a time (the same value)."""
    if not loss_chunk:
        return cross_entropy(model.apply(variables, x, **apply_kw), y)
    h_BxTxD = model.apply(variables, x, hidden=True, **apply_kw)
    return chunked_cross_entropy(lambda v, h: model.apply(v, h, method=GPT.head), variables, h_BxTxD, y, loss_chunk)


def make_train_step(config: GPTConfig, optimizer: optax.GradientTransformation, grad_accum: int = 1,
                    axis_name: Optional[str] = None, schedule: Optional[optax.Schedule] = None,
                    backend: Optional[Backend] = None, batch_sharding: Optional[NamedSharding] = None,
                    loss_chunk: int = 0):
    """Build `train_step(state, x, y, segment_ids=None) -> (state, metrics)` for x, y int [b, T]; with
    `segment_ids` int [b, T] (data.doc_mask) every document of a row computed as if alone (GPT's
    `segment_ids`). Without them the program is the same as before document masking existed.

    The b rows are split into `grad_accum` micro-batches whose gradients are averaged, which equals one
    step on all b rows. With `axis_name` (under pmap) gradients and metrics are averaged over that axis.
    `backend` None: `resolve(config)`, once, here. `batch_sharding` (under jit over a mesh): the rows'
    sharding, which every micro-batch is held to (XLA would otherwise be free to lay them out otherwise).
    `loss_chunk` > 0 (train.loss_chunk): the loss over that many positions at a time (`model_loss`).
    """
    model = GPT(config, backend or resolve(config))
    deterministic = config.dropout == 0.0
    rows = _constrain_rows(batch_sharding)
    loss_chunk = check_loss_chunk(loss_chunk)

    def loss_fn(params, frozen, x, y, rng, segments):
        segment_kw = {} if segments is None else {"segment_ids": segments}
        return model_loss(model, model_variables(params, frozen), x, y, loss_chunk, deterministic=deterministic,
                          rngs={"dropout": rng}, **segment_kw)

    grad_fn = jax.value_and_grad(loss_fn)

    def train_step(state: TrainState, x: jax.Array, y: jax.Array, segment_ids: Optional[jax.Array] = None):
        b, t = x.shape
        if b % grad_accum:
            raise ValueError(f"batch of {b} rows is not divisible by grad_accum={grad_accum}")
        rng = jax.random.fold_in(state.rng, state.step)
        if axis_name is not None:  # a different dropout mask on every device
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))
        # micro-batch i takes rows i, i + grad_accum, ...: an even split however rows are sharded
        batch = (x, y) if segment_ids is None else (x, y, segment_ids)
        micro_batches = tuple(a.reshape(b // grad_accum, grad_accum, t).swapaxes(0, 1) for a in batch)

        def micro(carry, inputs):
            loss_sum, grad_sum = carry
            i, xi, yi, *si = inputs
            si = rows(si[0]) if si else None
            loss, grads = grad_fn(state.params, state.frozen, rows(xi), rows(yi), jax.random.fold_in(rng, i), si)
            return (loss_sum + loss, jax.tree_util.tree_map(jnp.add, grad_sum, grads)), None

        if grad_accum == 1:
            segments = None if segment_ids is None else rows(segment_ids)
            loss, grads = grad_fn(state.params, state.frozen, rows(x), rows(y), rng, segments)
        else:
            zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
            (loss, grads), _ = jax.lax.scan(micro, (jnp.zeros((), jnp.float32), zeros),
                                            (jnp.arange(grad_accum), *micro_batches))
            loss = loss / grad_accum
            grads = jax.tree_util.tree_map(lambda g: g / grad_accum, grads)
        # over one device the mean is the value itself: skip the all-reduce
        if axis_name is not None and jax.lax.psum(1, axis_name) > 1:
            loss, grads = jax.lax.pmean((loss, grads), axis_name)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return train_step


def _constrain_rows(sharding: Optional[NamedSharding]):
    """`x [b, T] -> x` held to `sharding` inside a jit (the identity without one)."""
    if sharding is None:
        return lambda x: x
    return lambda x: jax.lax.with_sharding_constraint(x, sharding)


def repeat_steps(train_step):
    """`steps(state, xs, ys, ss=None) -> (state, metrics)`: train_step over K stacked batches xs, ys (and
    segment ids ss) [K, b, T] in one lax.scan, the same updates as K separate calls; metrics come back
    stacked [K]. One program call per K steps saves the host its per-call work (bench/README.md)."""
    def steps(state, xs, ys, ss=None):
        stacked = (xs, ys) if ss is None else (xs, ys, ss)
        return jax.lax.scan(lambda s, batch: train_step(s, *batch), state, stacked)

    return steps


def map_batches(eval_step):
    """`evals(params, xs, ys, frozen=None, ss=None) -> losses [E]`: eval_step over E stacked batches xs, ys
    (and segment ids ss) [E, b, T] one after another (lax.map) in one program: one call per evaluation."""
    def evals(params, xs, ys, frozen=None, ss=None):
        if ss is None:
            return jax.lax.map(lambda batch: eval_step(params, *batch, frozen), (xs, ys))
        return jax.lax.map(lambda batch: eval_step(params, *batch[:2], frozen, batch[2]), (xs, ys, ss))

    return evals


def make_eval_step(config: GPTConfig, axis_name: Optional[str] = None, backend: Optional[Backend] = None,
                   loss_chunk: int = 0):
    """Build `eval_step(params, x, y, frozen=None, segment_ids=None) -> mean loss` (deterministic, float32),
    over chunks of `loss_chunk` positions when > 0 (as the train step); document-masked with segment ids."""
    model = GPT(config, backend or resolve(config))
    loss_chunk = check_loss_chunk(loss_chunk)

    def eval_step(params, x, y, frozen=None, segment_ids=None):
        segment_kw = {} if segment_ids is None else {"segment_ids": segment_ids}
        loss = model_loss(model, model_variables(params, frozen), x, y, loss_chunk, **segment_kw)
        return jax.lax.pmean(loss, axis_name) if axis_name is not None else loss

    return eval_step
