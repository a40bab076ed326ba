"""Restoring a run: resume from the newest readable checkpoint (damaged newer ones moved aside), after
checking its metadata against the config (tokenizer, model shape, llm.c shards, optimizer layout) in one
line each; init_from's base weights (a run folder, a Hugging Face folder, a GPT-2 name) and a LoRA run's
base reference."""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax

from jaxgpt import checkpoint as ckpt_lib
from jaxgpt import loading
from jaxgpt.data import tokenizer_difference, tokenizer_fingerprint
from jaxgpt.data.shards import shards_difference
from jaxgpt.lora import LoraSpec
from jaxgpt.model import convert_layers
from jaxgpt.report import warn
from jaxgpt.training.config import model_config_from


class Restored(NamedTuple):
    """What a resume continues from: the state (laid out as the runner lays it out), its step, its
    checkpoint's metadata and the best val loss it records."""
    state: Any
    step: int
    meta: dict
    best_val: float


def restore_newest(checkpointer, runner, gcfg, make_state: Callable, init_args: tuple, *, tokenizer, data_meta: dict,
                   cfg_t, out_dir: str, barrier: Callable[[str], None], lora: bool) -> Restored:
    """The newest checkpoint that reads, checked against the config, restored in the layer layout it was
    saved in (on any device count) and converted to `gcfg`'s; damaged newer ones are moved aside, never
    deleted. A LoRA state gets its frozen base, init_args[0], back."""
    saved_layers = {}  # step -> whether that checkpoint stores the blocks stacked (scan_layers)

    def attempt(step):
        meta = checkpointer.restore_meta(step)
        check_meta(meta, gcfg, tokenizer)  # clear words before orbax's
        check_data(meta, data_meta)
        check_optimizer(meta, cfg_t)
        saved = gcfg.replace(scan_layers=bool(meta.get("model", {}).get("scan_layers", False)))
        saved_layers[step] = saved.scan_layers
        abstract = runner.abstract_state(lambda *a: convert_layers(make_state(*a), saved), *init_args)
        return checkpointer.restore(abstract.replace(frozen=None), step)  # (LoRA: no base in it)

    start_step, (state, meta), skipped = checkpointer.restore_newest(attempt)
    if skipped:
        barrier("jaxgpt-restored")
        for e in skipped:
            if jax.process_index() == 0:
                warn(f"{e}; moved it to {checkpointer.move_aside(e.step, out_dir)} and resuming from "
                     f"checkpoint {start_step}")
        barrier("jaxgpt-moved-aside")
        checkpointer.reload()
    step = int(state.step)  # replicated: readable on every process
    if saved_layers[step] != gcfg.scan_layers:
        state = jax.jit(lambda s: convert_layers(s, gcfg))(state)
    if lora:
        state = state.replace(frozen=init_args[0])
    return Restored(runner.put_state(state), step, meta, meta.get("best_val_loss", math.inf))


def check_meta(meta: dict, gcfg, tokenizer) -> None:
    """Refuse, in one line, a checkpoint whose tokenizer or model shape differs from the config's."""
    saved_tok, now_tok = meta.get("tokenizer"), tokenizer.to_dict()
    same = meta.get("tokenizer_sha256") == tokenizer_fingerprint(now_tok)  # older checkpoints: compare the dicts
    diff = None if same or not isinstance(saved_tok, dict) else tokenizer_difference(saved_tok, now_tok)
    if diff:
        raise ckpt_lib.CheckpointError(
            f"the data's tokenizer is not the checkpoint's: {diff}. Resuming would feed the model ids that "
            "mean other text; resume with the data settings the run was trained on (config.data), or start "
            "a new run")
    saved = meta.get("model", {})
    now = gcfg.to_dict()
    diff = {k: (saved.get(k), now[k]) for k in now if k in saved and saved[k] != now[k]
            and k not in ("dropout", "attention", "kernels", "dtype", "scan_layers", "remat")}  # same params either way
    if diff:
        raise ckpt_lib.CheckpointError(
            "the checkpoint's model differs from the config: " +
            ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items()))


def check_data(meta: dict, now: dict) -> None:
    """Refuse, in one line, a checkpoint trained on llm.c shards other than the config's (files added,
    removed or changed: the sampler's windows would fall elsewhere)."""
    saved = meta.get("dataset") or {}
    if now.get("corpus") != "shards" and saved.get("corpus") != "shards":
        return
    if saved.get("corpus") != now.get("corpus"):
        diff = f"{saved.get('corpus') or 'a text corpus'} before, {now.get('corpus') or 'a text corpus'} now"
    else:
        diff = shards_difference(saved, now)
    if diff:
        raise ckpt_lib.CheckpointError(
            f"the data is not the checkpoint's: {diff}. Resuming would not continue the run's batches; resume "
            "with the shards it was trained on (config.data.path), or start a new run")


# The train settings that shape the optimizer state, and what of each does: which optimizer, and whether
# gradients are clipped (another lr, betas or clipping threshold fits the same state)
_OPTIMIZER_LAYOUT = {"optimizer": lambda v: v, "grad_clip": lambda v: v > 0}


def check_optimizer(meta: dict, cfg_t) -> None:
    """Refuse, in one line naming the setting and both values, a checkpoint whose optimizer state another
    optimizer made: another train.optimizer, or gradient clipping turned on or off since it was saved."""
    saved = meta.get("config", {}).get("train")
    if not isinstance(saved, dict):  # (a checkpoint without its config: orbax's words, as before)
        return
    saved = {"optimizer": "adamw", **saved}  # (checkpoints from before train.optimizer: AdamW's)
    changed = [k for k, layout in _OPTIMIZER_LAYOUT.items() if k in saved and layout(saved[k]) != layout(cfg_t[k])]
    if not changed:
        return

    def shown(key, value):
        return f"{value!r}" + (f" (clipping {'on' if value > 0 else 'off'})" if key == "grad_clip" else "")

    said = "; ".join(f"train.{k} was {shown(k, saved[k])} when it was saved and is {shown(k, cfg_t[k])} now"
                     for k in changed)
    back = " ".join(f"--config.train.{k}={saved[k]}" for k in changed)
    raise ckpt_lib.CheckpointError(
        f"checkpoint {meta.get('step')}'s optimizer state does not fit this config's optimizer: {said}. To "
        f"continue the run, put it back ({back}); to train with the new setting, start a new run (another "
        "--config.out_dir, or --config.overwrite=True)")


def init_weights(config, tokenizer, out_dir: str, lora_spec) -> tuple:
    """(GPTConfig, params, base reference) a run starts from: init_from's weights; a resumed LoRA run's base
    (its checkpoints hold only the adapters); else the config's model with no params (None, None)."""
    if config.init_from not in ("scratch", "resume"):
        return load_init(config, tokenizer)
    gcfg = model_config_from(config, tokenizer.vocab_size)
    if config.init_from == "resume" and lora_spec is not None:
        base_ref = saved_lora_base(out_dir)
        gcfg, params = loading.load_base(base_ref, gcfg, flag="--config.imports")
        return gcfg, params, base_ref
    return gcfg, None, None


def load_init(config, tokenizer):
    """(GPTConfig, params, reference) of the weights `init_from` names: a jaxgpt run folder (its latest
    checkpoint), a Hugging Face folder or a GPT-2 name. The architecture comes from the weights, how to
    compute it from config.model; a smaller model.block_size keeps the first position embeddings."""
    m, source = config.model, config.init_from
    compute = dict(dtype=m.dtype, attention=m.attention, kernels=m.kernels, dropout=m.dropout,
                   scan_layers=m.scan_layers, remat=m.remat)
    # (crops the position table when block_size is smaller, as nanoGPT's fine-tuning does)
    gcfg, params, base_tokenizer, _, ref = loading.load(source, block_size=m.block_size, tokenizer=None,
                                                        flag="--config.imports", **compute)
    _check_base_architecture(m, gcfg, source)
    if base_tokenizer is not None:  # a jaxgpt run's
        saved, now = base_tokenizer.to_dict(), tokenizer.to_dict()
        if tokenizer_fingerprint(saved) != tokenizer_fingerprint(now):
            raise ckpt_lib.CheckpointError(
                f"init_from={source}: that run's tokenizer is not the data's: "
                f"{tokenizer_difference(saved, now) or 'they differ'}; use the data settings it was trained on")
    elif tokenizer.vocab_size > gcfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but {source} has a "
                         f"vocabulary of {gcfg.vocab_size}; use data.tokenizer='gpt2' with GPT-2 weights")
    return gcfg, params, _base_ref(config, gcfg, params, ref)


# what config.model may set over an init_from base: how it computes, not what its weights are
# (block_size may only crop the position table: checked where it is cropped)
_FREE_OVER_BASE = ("dropout", "dtype", "attention", "kernels", "scan_layers", "remat", "block_size", "zero_init_proj")


def _check_base_architecture(m, base_cfg, source: str) -> None:
    """Refuse, in one line, config.model settings that contradict the init_from base's architecture. A key
    left at its default is the base's to decide; a key set otherwise must agree with the base."""
    from jaxgpt.training.config import MODEL_KEYS, default_config

    defaults = default_config().model
    clash = [(k, m[k], getattr(base_cfg, k)) for k in MODEL_KEYS
             if k not in _FREE_OVER_BASE and m[k] is not None and m[k] != defaults[k] and m[k] != getattr(base_cfg, k)]
    if clash:
        raise ValueError(
            f"config.model contradicts the init_from base {source}: " +
            ", ".join(f"model.{k}={mine!r} but the base has {k}={theirs!r}" for k, mine, theirs in clash) +
            "; the base's architecture is used as it is: drop these settings or set them to the base's values")


def _base_ref(config, gcfg, params, ref: dict) -> dict:
    """`ref` with, for a LoRA run, the fingerprint of its base weights (checked whenever the base is loaded
    again: on resume and when sampling)."""
    from jaxgpt.lora import base_fingerprint

    if LoraSpec.from_config(config.train.lora) is None:
        return ref
    return {**ref, "sha256": base_fingerprint(params, gcfg)}


def saved_lora_base(out_dir: str) -> dict:
    """The base-model reference that a LoRA run's newest readable checkpoint records."""
    ckpt = ckpt_lib.Checkpointer(out_dir, read_only=True)
    try:
        for step in sorted(ckpt_lib.existing_steps(out_dir), reverse=True):
            try:
                meta = ckpt.restore_meta(step)
            except ckpt_lib.CheckpointError:
                continue
            if "lora" not in meta:
                raise ckpt_lib.CheckpointError(f"checkpoint {step} in {out_dir} is not a LoRA run's; resume it "
                                               "with train.lora.rank=0")
            return meta["lora"]["base"]
    finally:
        ckpt.close()
    raise ckpt_lib.CheckpointError(f"no readable checkpoint in {ckpt_lib.checkpoint_dir(out_dir)}")
