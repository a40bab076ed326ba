"""One loader for every consumer (training's init_from, jaxgpt-sample, jaxgpt-serve, the engine's users): a
model from a training run's folder (a LoRA run's adapters merged into its base), a Hugging Face folder or
a GPT-2 name, with the user's modules that registered its parts imported first (jaxgpt.user_modules)."""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple, Optional

import jax

from jaxgpt.checkpoint import (CheckpointError, Checkpointer, abstract_like, checkpoint_dir, existing_steps,
                               is_run_folder)
from jaxgpt.config import GPTConfig
from jaxgpt.data import Tokenizer, get_tokenizer, tokenizer_from_dict
from jaxgpt.lora import LoraSpec, base_fingerprint, init_adapters, merge
from jaxgpt.model import convert_layers, init_params
from jaxgpt.pretrained import TOKENIZER_FILE, from_pretrained
from jaxgpt.report import one_line, warn
from jaxgpt.user_modules import Names, import_modules, require_parts


class Loaded(NamedTuple):
    """A model ready to run, and where it came from."""
    config: GPTConfig
    params: Any  # on one device, in config's layer layout; a LoRA run's with its adapters merged in
    tokenizer: Optional[Tokenizer]  # None for pretrained weights when none was asked for
    meta: dict  # a run's checkpoint meta (step, config, tokenizer, imports, ...); {} for pretrained weights
    # {"init_from": a run folder and its "step"} or {"init_from": an HF folder or a GPT-2 name}, folders
    # absolute: how a LoRA run refers to its base
    source: dict


def load(source: str, *, step: Optional[int] = None, block_size: Optional[int] = None,
         tokenizer: Optional[str] = "gpt2", imports: Names = None, flag: str = "--import", **compute) -> Loaded:
    """The model at `source`: a jaxgpt run folder (checkpoint `step`, default the newest that reads), a
    Hugging Face folder or a GPT-2 name. `imports` name the modules to import first (ValueError naming
    `flag` for one that is not found); a run's recorded modules are imported when it needs them.

    `compute` sets GPTConfig fields that do not change the weights (dtype, attention, kernels, scan_layers,
    ...); a smaller `block_size` keeps the first position embeddings. Pretrained weights come with the
    folder's tokenizer.json, else the tokenizer named `tokenizer` (None: no tokenizer, as training, which
    has its data's, asks).
    """
    import_modules(imports, flag)
    if is_run_folder(source):
        loaded = load_run(source, step, flag=flag)
        if block_size is None and not compute:
            return loaded
        config, params = _adapt(loaded.config, loaded.params, block_size, compute, source)
        return loaded._replace(config=config, params=params)
    if step is not None:
        raise ValueError(f"a step chooses a checkpoint of a training run, and {source} is not a run folder "
                         f"(it has no {os.path.join(source, 'checkpoints')}); leave the step out")
    config, params = from_pretrained(source, block_size=block_size, **compute)
    folder = os.path.abspath(os.path.expanduser(source))
    local = os.path.isdir(folder)
    tok = None if tokenizer is None else folder_tokenizer(folder, tokenizer) if local else get_tokenizer(tokenizer)
    return Loaded(config, params, tok, {}, {"init_from": folder if local else source})


def _adapt(config: GPTConfig, params, block_size: Optional[int], compute: dict, source: str):
    """(config, params) computed as `compute` says, the position table cropped to `block_size`."""
    if block_size is not None and block_size > config.block_size:
        raise ValueError(f"block_size={block_size} exceeds the block_size of {source} ({config.block_size}); it "
                         "has no position embeddings past that")
    block_size = config.block_size if block_size is None else block_size
    config = config.replace(block_size=block_size, **compute)
    return config, convert_layers(_crop_positions(params, block_size), config)


def _crop_positions(params, block_size: int):
    """`params` with only the first `block_size` position embeddings (none to crop with RoPE)."""
    if "wpe" not in params or params["wpe"]["embedding"].shape[0] <= block_size:
        return params
    return {**params, "wpe": {**params["wpe"], "embedding": params["wpe"]["embedding"][:block_size]}}


def load_run(out_dir: str, step: Optional[int] = None, *, imports: Names = None, flag: str = "--import") -> Loaded:
    """A training run's checkpoint `step` (default: the newest that reads, with a warning for each newer one
    that does not), on one device. For a LoRA run the params are its base's with the adapters merged in.
    A block or attention the run names that is not registered comes from the modules the run recorded."""
    import_modules(imports, flag)
    out_dir = os.path.expanduser(out_dir)
    steps = existing_steps(out_dir)
    if not steps:
        raise CheckpointError(f"no checkpoint in {checkpoint_dir(out_dir)}; train first (jaxgpt-train) or "
                              "point --out_dir at a training run's folder")
    if step is not None and step not in steps:
        raise CheckpointError(f"there is no checkpoint {step} in {checkpoint_dir(out_dir)}; its steps are "
                              f"{steps}: choose one of them (or leave the step out for the latest)")

    def read(s):
        meta = ckpt.restore_meta(s)
        require_parts(meta["model"], meta.get("imports"), flag)
        config = GPTConfig.from_dict(meta["model"])
        if "lora" not in meta:
            abstract = abstract_like(jax.eval_shape(lambda: init_params(config, jax.random.key(0))))
            return config, ckpt.restore_params(abstract, s), meta
        _, base = load_base(meta["lora"]["base"], config, flag=flag)
        spec = LoraSpec.from_config(meta["lora"])
        abstract = abstract_like(jax.eval_shape(lambda: init_adapters(base, config, spec, jax.random.key(0))))
        return config, merge(base, ckpt.restore_params(abstract, s)), meta

    ckpt = Checkpointer(out_dir, read_only=True)
    try:
        if step is not None:
            config, params, meta = read(step)
        else:
            step, (config, params, meta), skipped = ckpt.restore_newest(read)
            for e in skipped:
                warn(f"{e}; using checkpoint {step} instead")
    finally:
        ckpt.close()
    source = {"init_from": os.path.abspath(out_dir), "step": int(meta.get("step", step))}
    return Loaded(config, params, tokenizer_from_dict(meta["tokenizer"]), meta, source)


def load_model(out_dir: str, step: Optional[int] = None):
    """(GPTConfig, params, tokenizer, meta) of a run's checkpoint: load_run's first four, under the name
    earlier code calls it by."""
    return tuple(load_run(out_dir, step))[:4]


def load_base(ref: dict, config: Optional[GPTConfig] = None, *, flag: str = "--import"):
    """(GPTConfig, params) of the model a LoRA run adapts, from its reference in the checkpoint's meta:
    {"init_from": a jaxgpt run folder and its "step"} or {"init_from": a Hugging Face folder or GPT-2 name},
    and (since it was recorded) "sha256", the base weights' fingerprint: a base that is not the one the
    adapters were trained on is refused. With `config`, the weights come cropped and laid out for it."""
    source, step = ref["init_from"], ref.get("step")
    if step is not None:
        where = f"{source} (step {step})"
        steps = existing_steps(source)
        if not steps:
            raise CheckpointError(
                f"the LoRA base {source} holds no checkpoint (moved or deleted?); a LoRA run's checkpoints hold "
                f"only the adapters, trained on step {step} of that run: put the base run back at {source}")
        if step not in steps:
            raise CheckpointError(
                f"the LoRA base {source} has no checkpoint {step} (its steps are {steps}); the adapters were "
                f"trained on step {step} of it: put that checkpoint back, or start a new LoRA run")
        base_config, params = load_run(source, step, flag=flag)[:2]
        if config is not None:  # cropped as init_from crops it
            params = _crop_positions(params, config.block_size)
    else:
        where = source
        try:
            base_config, params = from_pretrained(source, block_size=None if config is None else config.block_size)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"the LoRA base {source} cannot be loaded: {one_line(e)}") from e
    want = ref.get("sha256")
    if want is not None:
        got = base_fingerprint(params, config or base_config)
        if got != want:
            raise CheckpointError(
                f"the LoRA base {where} is not the model these adapters were trained on: its weights' SHA-256 "
                f"is {got[:16]}..., the LoRA checkpoint recorded {want[:16]}...; put the original base back "
                f"there, or start a new LoRA run on this one")
    if config is None:
        return base_config, params
    return config, convert_layers(params, config)


def tokenizer_config(folder: str) -> dict:
    """A Hugging Face folder's tokenizer_config.json ({} when it has none)."""
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def folder_tokenizer(folder: str, fallback: str) -> Tokenizer:
    """The tokenizer a Hugging Face folder carries: jaxgpt's own file (a char or byte tokenizer that
    save_pretrained wrote), else tokenizer.json, its end token from tokenizer_config.json when that names
    one; else the tokenizer named `fallback`."""
    own = os.path.join(folder, TOKENIZER_FILE)
    if os.path.isfile(own):
        with open(own, encoding="utf-8") as f:
            return tokenizer_from_dict(json.load(f))
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return get_tokenizer(fallback)
    with open(path, encoding="utf-8") as f:
        tok = get_tokenizer("bpe", tokenizer_json=f.read())
    eos = tokenizer_config(folder).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str):
        from tokenizers import Tokenizer as HFTokenizer  # (imported where used, as jaxgpt.data does)
        tid = HFTokenizer.from_str(tok.to_dict()["tokenizer_json"]).token_to_id(eos)
        tok.eos_id = tid if tid is not None else tok.eos_id
    return tok
