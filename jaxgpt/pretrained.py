"""Pretrained weights: Hugging Face GPT-2 and Llama folders (safetensors) in and out, nanoGPT ckpt.pt in.

A Hugging Face folder holds `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`). GPT-2 stores its Conv1D weights as [in, out], which is a Flax Dense
kernel's layout, so its import is a renaming: `h.3.attn.c_attn.weight` <-> `h_3/attn/c_attn/kernel`.
Llama's nn.Linear weights are [out, in] and its q/k/v projections separate; jaxgpt's c_attn is
[q | k | v] in one kernel (see the Llama section). Only numpy and safetensors are needed; torch only for
nanoGPT checkpoints, huggingface_hub only to download.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.checks import is_int
from jaxgpt.config import GPTConfig
from jaxgpt.model import abstract_params, convert_layers
from jaxgpt.schema import ParamInfo, leaf_infos

# GPT-2's sizes, name -> (n_layer, n_head, n_embd): the one table of them (jaxgpt-aot builds a GPT-2 name's
# architecture from it without downloading its config.json). Each has 50257 tokens, biases and a tied head.
GPT2_SIZES = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280),
              "gpt2-xl": (48, 25, 1600)}
GPT2_NAMES = tuple(GPT2_SIZES)
_HUB_REPOS = {name: f"openai-community/{name}" for name in GPT2_NAMES}
_WEIGHTS = "model.safetensors"
_WEIGHTS_INDEX = "model.safetensors.index.json"
# Causal-mask buffers that older transformers versions (and nanoGPT without flash attention) save.
_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")
# All three name GELU's tanh approximation, which jaxgpt's MLP computes.
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")

PathLike = Union[str, os.PathLike]


# ----------------------------------------------------------------------------------------------------
# Names: one rule maps every jaxgpt parameter to its GPT-2 tensor name.

def _path_names(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)


def gpt2_name(path: tuple) -> str:
    """GPT-2 tensor name of a jaxgpt parameter path, e.g. ('h_3', 'ln_1', 'scale') -> 'h.3.ln_1.weight'."""
    *modules, leaf = path
    parts = [f"h.{m[2:]}" if re.fullmatch(r"h_\d+", m) else m for m in modules]
    return ".".join(parts + ["bias" if leaf == "bias" else "weight"])


def _expected_shapes(config: GPTConfig) -> dict:
    """{jaxgpt param path: shape} for `config` in GPT-2's per-layer layout, without allocating anything."""
    abstract = abstract_params(config.replace(scan_layers=False, remat="none"))
    return {_path_names(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(abstract)}


def _infos(config: GPTConfig) -> dict:
    """{jaxgpt param path: its ParamInfo} for `config` in GPT-2's per-layer layout (jaxgpt/schema.py)."""
    unrolled = config.replace(scan_layers=False, remat="none")
    return leaf_infos(abstract_params(unrolled), unrolled)


def _is_transposed(info: ParamInfo, linear_layout: bool) -> bool:
    # torch nn.Linear stores [out, in]: the head (the one matrix outside the blocks) always, and every
    # projection in nanoGPT's layout; GPT-2's Conv1D stores [in, out] as jaxgpt does
    return info.role == "matrix" and (linear_layout or not info.block)


def _nest(flat: dict) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _params_from_tensors(shapes: dict, read: Callable[[str], np.ndarray], config: GPTConfig,
                         linear_layout: bool, source: str, crop_positions: Optional[int] = None) -> dict:
    """Check a checkpoint's names and shapes against `config`, then read it into a jaxgpt params tree.

    `shapes` maps GPT-2 tensor names (prefixes already stripped) to shapes; `read(name)` loads one.
    """
    expected, infos = _expected_shapes(config), _infos(config)
    wanted = {gpt2_name(p): p for p in expected}
    missing = sorted(set(wanted) - set(shapes))
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} tensors that the config needs: {_short(missing)}")
    ignorable = {n for n in shapes if _BUFFER.match(n)}
    if config.tie_embeddings:
        ignorable.add("lm_head.weight")  # a tied head is wte; transformers ignores a stored copy too
    unexpected = sorted(set(shapes) - set(wanted) - ignorable)
    if unexpected:
        raise ValueError(f"{source} has {len(unexpected)} tensors that a GPT-2 with this config does not "
                         f"use: {_short(unexpected)}; is it a GPT-2 checkpoint?")
    dims = (f"vocab_size={config.vocab_size}, n_positions={crop_positions or config.block_size}, "
            f"n_embd={config.n_embd}, n_layer={config.n_layer}, n_head={config.n_head}")
    for name, path in wanted.items():
        want = expected[path]
        if path == ("wpe", "embedding") and crop_positions is not None:
            want = (crop_positions,) + want[1:]
        if _is_transposed(infos[path], linear_layout):
            want = want[::-1]
        if tuple(shapes[name]) != want:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(shapes[name])}, but the config "
                             f"({dims}) implies {want}")
    flat = {}
    for name, path in wanted.items():
        x = np.asarray(read(name))
        if _is_transposed(infos[path], linear_layout):
            x = x.T
        if path == ("wpe", "embedding"):
            x = x[:config.block_size]
        flat[path] = jnp.asarray(x.astype(config.params_dtype, copy=False))
    return convert_layers(_nest(flat), config)  # stacked for a scan_layers config


def _short(names: list, limit: int = 6) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


# ----------------------------------------------------------------------------------------------------
# Configs

def config_from_hf(hf: dict, **overrides) -> GPTConfig:
    """The GPTConfig of a Hugging Face GPT-2 `config.json` dict; `overrides` set other GPTConfig fields."""
    model_type = hf.get("model_type")
    if model_type != "gpt2":
        raise ValueError(f"config.json describes model_type={model_type!r}; jaxgpt imports 'gpt2' and 'llama' "
                         "checkpoints")
    for key in ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size"):
        if key not in hf:
            raise ValueError(f"config.json lacks the GPT-2 field {key!r}")
    act = hf.get("activation_function", "gelu_new")
    if act not in _TANH_GELUS + ("relu2",):
        raise ValueError(f"config.json has activation_function={act!r}; jaxgpt's GPT-2 MLP computes GELU's tanh "
                         f"approximation, which GPT-2 calls one of {_TANH_GELUS}, or ReLU² ('relu2')")
    n_inner = hf.get("n_inner")
    if n_inner is not None and n_inner != 4 * hf["n_embd"]:
        raise ValueError(f"config.json has n_inner={n_inner}; jaxgpt's MLP width is 4 * n_embd "
                         f"= {4 * hf['n_embd']}")
    unsupported = {"scale_attn_weights": False, "scale_attn_by_inverse_layer_idx": True,
                   "add_cross_attention": True}
    for key, bad in unsupported.items():
        if hf.get(key, not bad) == bad:
            raise ValueError(f"config.json sets {key}={bad}, which jaxgpt's attention does not support")
    fields = dict(vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
                  n_head=hf["n_head"], n_embd=hf["n_embd"], n_kv_head=hf["n_head"], bias=True,
                  tie_embeddings=hf.get("tie_word_embeddings", True), dropout=0.0,
                  layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
                  mlp="relu2" if act == "relu2" else "gelu")
    return _gpt_config(fields, overrides)


def _gpt_config(fields: dict, overrides: dict) -> GPTConfig:
    """GPTConfig(**fields) with `overrides` on top; a config.json that gives no valid one is a ValueError."""
    try:
        return GPTConfig(**{**fields, **overrides})
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.json does not give a valid GPTConfig: {e}") from e


def config_to_hf(config: GPTConfig) -> dict:
    """A Hugging Face GPT2Config dict for `config` (always with biases and n_kv_head == n_head)."""
    eos = 50256 if config.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, when it exists
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.block_size, "n_embd": config.n_embd,
        "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
        # (transformers' ACT2FN: "gelu_new" is GELU's tanh approximation, "relu2" relu(x) ** 2)
        "activation_function": "relu2" if config.mlp == "relu2" else "gelu_new",
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
        "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": config.tie_embeddings,
        "use_cache": True, "bos_token_id": eos, "eos_token_id": eos,
        "torch_dtype": config.param_dtype,
    }


# GPTConfig fields that say how to compute, not what the weights are: an import may set them.
COMPUTE_FIELDS = ("dtype", "param_dtype", "attention", "kernels", "dropout", "scan_layers", "remat")


def _overrides(given: dict) -> dict:
    unknown = sorted(set(given) - set(COMPUTE_FIELDS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}; the GPTConfig fields an import can set "
                        f"are {COMPUTE_FIELDS} (and block_size, to crop the position table)")
    return {k: v for k, v in given.items() if v is not None}


# ----------------------------------------------------------------------------------------------------
# Import

def resolve(name_or_path: PathLike, cache_dir: Optional[PathLike] = None) -> Path:
    """A local folder for `name_or_path`: the folder itself, or a GPT-2 name downloaded from the Hub."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        raise FileNotFoundError(f"{str(path)!r} is a file; pass the folder that holds config.json and "
                                f"{_WEIGHTS}")
    name = str(name_or_path)
    if name not in _HUB_REPOS:
        raise FileNotFoundError(f"{name!r} is neither a folder nor one of the GPT-2 names {GPT2_NAMES}")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ImportError(f"downloading {name!r} needs huggingface_hub: pip install 'jaxgpt[hf]' "
                          "(or pass a local folder)") from e
    try:
        folder = snapshot_download(_HUB_REPOS[name], cache_dir=cache_dir, allow_patterns=[
            "config.json", _WEIGHTS, _WEIGHTS_INDEX, "model-*-of-*.safetensors"])
    except Exception as e:  # the Hub raises many types (offline, HTTP, missing cache); one message
        raise OSError(f"could not download {name!r} ({_HUB_REPOS[name]}) from the Hugging Face Hub: "
                      f"{type(e).__name__}: {e}. Without network access, copy the model folder here and "
                      "pass its path instead") from e
    return Path(folder)


def _read_config(folder: Path) -> dict:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json; a GPT-2 folder needs config.json and "
                                f"{_WEIGHTS}")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(config_file)!r} is not valid JSON: {e}") from e


def _weight_files(folder: Path) -> list:
    if (folder / _WEIGHTS).is_file():
        return [folder / _WEIGHTS]
    if (folder / _WEIGHTS_INDEX).is_file():
        weight_map = json.loads((folder / _WEIGHTS_INDEX).read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".h5", ".msgpack"))
    hint = f" (found {others}: convert them to safetensors)" if others else ""
    raise FileNotFoundError(f"{str(folder)!r} has no {_WEIGHTS} or {_WEIGHTS_INDEX}{hint}")


def _strip(name: str, prefixes: tuple) -> str:
    for prefix in prefixes:
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


def from_pretrained(name_or_path: PathLike, *, block_size: Optional[int] = None,
                    cache_dir: Optional[PathLike] = None, **overrides) -> tuple[GPTConfig, dict]:
    """(GPTConfig, params) of a Hugging Face GPT-2 or Llama folder, or of 'gpt2'...'gpt2-xl' from the Hub.

    `overrides` set GPTConfig fields that do not change the weights (dtype, attention, kernels,
    scan_layers, ...; see COMPUTE_FIELDS); a `block_size` below the checkpoint's n_positions keeps the
    first `block_size` position embeddings. The params come in the config's layer layout.
    """
    folder = resolve(name_or_path, cache_dir)
    hf = _read_config(folder)
    files = _weight_files(folder)
    if hf.get("model_type") == "llama":
        return _from_llama(folder, hf, files, block_size, _overrides(overrides))
    config = config_from_hf(hf, **_overrides(overrides))
    crop = _crop(config, block_size)
    config = config.replace(block_size=crop[0]) if crop else config

    with _tensors(folder, files, ("transformer.",)) as (shapes, read):
        params = _params_from_tensors(shapes, read, config, linear_layout=False, source=str(folder),
                                      crop_positions=crop[1] if crop else None)
    return config, params


@contextlib.contextmanager
def _tensors(folder: Path, files: list, prefixes: tuple):
    """({name: shape}, read(name) -> array) over a folder's safetensors files, names without `prefixes`."""
    from safetensors import safe_open

    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{str(file)!r}, listed in {_WEIGHTS_INDEX}, does not exist")
    with contextlib.ExitStack() as stack:
        shapes, where = {}, {}
        for file in files:
            try:
                f = stack.enter_context(safe_open(str(file), framework="np"))
            except Exception as e:  # safetensors' own error type: a cut or damaged file
                raise ValueError(f"{str(file)!r} is not a readable safetensors file ({e}); it may be "
                                 "truncated or damaged: download or export it again") from None
            for key in f.keys():
                name = _strip(key, prefixes)
                if name in shapes:
                    raise ValueError(f"{str(folder)!r} holds tensor {name!r} twice (with and without "
                                     f"a prefix {prefixes}?)")
                shapes[name] = tuple(f.get_slice(key).get_shape())
                where[name] = (f, key)
        yield shapes, lambda name: where[name][0].get_tensor(where[name][1])


def _crop(config: GPTConfig, block_size: Optional[int]):
    """(new block_size, checkpoint's n_positions) when cropping the position table, else None."""
    if block_size is None or block_size == config.block_size:
        return None
    if not is_int(block_size) or not 1 <= block_size:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if block_size > config.block_size:
        raise ValueError(f"block_size={block_size} exceeds the checkpoint's n_positions "
                         f"({config.block_size}); it has no position embeddings past that")
    return block_size, config.block_size


def from_nanogpt(ckpt_path: PathLike, *, block_size: Optional[int] = None, **overrides) -> tuple[GPTConfig, dict]:
    """(GPTConfig, params) of a nanoGPT `ckpt.pt` (needs torch: pip install 'jaxgpt[torch]').

    nanoGPT's MLP uses exact GELU while jaxgpt's uses the tanh approximation (|difference| < 1e-3 per
    activation), so logits agree closely, not bit for bit.
    """
    path = Path(ckpt_path).expanduser()
    if path.is_dir():
        path = path / "ckpt.pt"
    if not path.is_file():
        raise FileNotFoundError(f"no nanoGPT checkpoint at {str(path)!r}")
    try:
        import torch
    except ImportError as e:
        raise ImportError("reading a nanoGPT ckpt.pt needs torch: pip install torch==2.13.0") from e
    ckpt = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise ValueError(f"{str(path)!r} is not a nanoGPT checkpoint (expected a dict with 'model' and "
                         "'model_args')")
    args = ckpt["model_args"]
    fields = dict(vocab_size=args["vocab_size"], block_size=args["block_size"], n_layer=args["n_layer"],
                  n_head=args["n_head"], n_embd=args["n_embd"], bias=args.get("bias", True),
                  tie_embeddings=True, dropout=0.0)
    fields.update(_overrides(overrides))
    try:
        config = GPTConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{str(path)!r}: model_args do not give a valid GPTConfig: {e}") from e
    crop = _crop(config, block_size)
    config = config.replace(block_size=crop[0]) if crop else config
    state = {_strip(k, ("_orig_mod.", "transformer.")): v for k, v in ckpt["model"].items()}
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    return config, _params_from_tensors(shapes, lambda n: state[n].float().numpy(), config,
                                        linear_layout=True, source=str(path),
                                        crop_positions=crop[1] if crop else None)


# ----------------------------------------------------------------------------------------------------
# Export

def _gpt2_tensors(params, config: GPTConfig) -> dict:
    """GPT-2 named numpy tensors of a jaxgpt params tree: biases filled with zeros where `bias=False`,
    grouped k/v heads repeated for every query head (the same function, in GPT-2's layout)."""
    hf_architecture(config)  # a GPT-2-style config, or a ValueError
    if set(params) == {"params"}:
        params = params["params"]
    params = convert_layers(params, config.replace(scan_layers=False))  # GPT-2's h_i
    expected, infos = _expected_shapes(config), _infos(config)
    got = {_path_names(p): np.asarray(jax.device_get(x))
           for p, x in jax.tree_util.tree_leaves_with_path(params)}
    if set(got) != set(expected):
        diff = sorted("/".join(p) for p in set(got) ^ set(expected))
        raise ValueError(f"params do not match the config: these differ between them: {_short(diff)}")
    for path, shape in expected.items():
        if got[path].shape != shape:
            raise ValueError(f"params {'/'.join(path)} has shape {got[path].shape}, but the config "
                             f"implies {shape}")
    d, n, kh, h = config.n_embd, config.n_head, config.n_kv_head, config.head_dim
    dt = config.params_dtype
    out = {}
    for path, x in got.items():
        if infos[path].axes[-1] == "qkv":  # attention's fused [q | k | v] (kernel and bias)
            q, k, v = np.split(x, [n * h, (n + kh) * h], axis=-1)
            # query head i reads kv head i // (n // kh), as in attention.py's grouping
            k, v = (np.repeat(a.reshape(a.shape[:-1] + (kh, h)), n // kh, axis=-2).reshape(
                a.shape[:-1] + (n * h,)) for a in (k, v))
            x = np.concatenate([q, k, v], axis=-1)
        out[gpt2_name(path)] = np.ascontiguousarray(x.T if _is_transposed(infos[path], False) else x)
    if not config.bias:
        widths = {"attn.c_attn": 3 * d, "attn.c_proj": d, "mlp.c_fc": 4 * d, "mlp.c_proj": d,
                  "ln_1": d, "ln_2": d}
        for i in range(config.n_layer):
            for module, width in widths.items():
                out[f"h.{i}.{module}.bias"] = np.zeros((width,), dt)
        out["ln_f.bias"] = np.zeros((d,), dt)
    return out


def hf_architecture(config: GPTConfig) -> str:
    """"gpt2" or "llama": the Hugging Face architecture that computes the same function as `config`."""
    if (config.position, config.norm) == ("learned", "layernorm") and config.mlp in ("gelu", "relu2") \
            and config.mlp_hidden == 4 * config.n_embd:
        return "gpt2"  # (GPT-2's config.json names its MLP's activation: gelu_new or relu2)
    if (config.position, config.norm, config.mlp) == ("rope", "rmsnorm", "swiglu"):
        return "llama"
    raise ValueError(f"no Hugging Face architecture computes position={config.position!r}, norm={config.norm!r}, "
                     f"mlp={config.mlp!r} (GPT-2: learned/layernorm/gelu or relu2; Llama: rope/rmsnorm/swiglu); "
                     "keep it as a jaxgpt checkpoint")


# speedrun options that no transformers architecture computes, with their "off" values
_NOT_IN_TRANSFORMERS = {"qk_norm": False, "logit_softcap": 0.0, "embed_skip": False, "value_embeds": 0}


# a char or byte tokenizer (transformers has no such tokenizer) in jaxgpt's own JSON, beside the HF files
TOKENIZER_FILE = "jaxgpt_tokenizer.json"


def _write_tokenizer(tokenizer, vocab_size: int, out: Path) -> None:
    """The files that carry `tokenizer` (a jaxgpt Tokenizer) to whoever loads the folder: tokenizer.json for
    a BPE one (transformers and jaxgpt read it), jaxgpt_tokenizer.json for char and byte ones (jaxgpt-sample,
    jaxgpt-serve and loading.load read it), none for GPT-2's (their default)."""
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens and the model {vocab_size}: "
                         "pass the tokenizer the model was trained with")
    d = tokenizer.to_dict()
    if d["type"] == "bpe":
        (out / "tokenizer.json").write_text(d["tokenizer_json"], encoding="utf-8")
    elif d["type"] != "gpt2":
        (out / TOKENIZER_FILE).write_text(json.dumps(d, ensure_ascii=False), encoding="utf-8")


def save_pretrained(params, config: GPTConfig, out_dir: PathLike, tokenizer=None) -> Path:
    """Write `config.json` and `model.safetensors` that transformers loads (GPT2LMHeadModel or
    LlamaForCausalLM, by `hf_architecture`), and the files of `tokenizer` (a jaxgpt Tokenizer, e.g. a
    run's from `loading.load_model`) that jaxgpt's loader reads back; returns the folder.

    A GPT-2 export takes any GPT-2-style config: biases that it lacks are written as zeros, and
    grouped-query attention as multi-head attention with each key/value head repeated (both exactly the
    same function).
    """
    from safetensors.numpy import save_file

    if config.block != "gpt2":
        raise ValueError(f"block={config.block!r} has no Hugging Face equivalent: save_pretrained exports the "
                         "pre-norm 'gpt2' block (GPT-2 and Llama) only")
    beyond = [f"{k}={getattr(config, k)!r}" for k, off in _NOT_IN_TRANSFORMERS.items() if getattr(config, k) != off]
    if beyond:
        raise ValueError(f"{', '.join(beyond)}: GPT-2 and Llama in transformers cannot compute this; keep it as a "
                         "jaxgpt checkpoint (jaxgpt-sample reads it)")
    if hf_architecture(config) == "llama":
        named, hf = _llama_tensors(params, config), config_to_hf_llama(config)
    else:
        tensors = _gpt2_tensors(params, config)
        hf = config_to_hf(config)
        named = {("lm_head.weight" if k == "lm_head.weight" else f"transformer.{k}"): v
                 for k, v in tensors.items()}
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{str(out)!r} is a file; save_pretrained writes a folder (config.json and "
                         f"{_WEIGHTS}): pass a folder path")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the folder {str(out)!r} ({e.strerror}); pass a folder path "
                         "that can be written") from None
    save_file(named, str(out / _WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if tokenizer is not None:
        _write_tokenizer(tokenizer, config.vocab_size, out)
    return out


# ----------------------------------------------------------------------------------------------------
# Llama: `model.layers.{i}.self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`, `input_layernorm` and
# `post_attention_layernorm` (RMSNorm weights), `model.embed_tokens`, `model.norm`, `lm_head`: each
# layer declares its parameters' Llama names (schema.ParamInfo.hf_name). jaxgpt's h_i/attn/c_attn is
# [q | k | v] (each weight transposed to [in, out]), the others one tensor each.

def _llama_rope_theta(hf: dict) -> float:
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    kind = rope.get("rope_type", (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))
    if kind != "default":
        raise ValueError(f"config.json asks for rope_type={kind!r}; jaxgpt's rotary embedding is the default one")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf_llama(hf: dict, **overrides) -> GPTConfig:
    """The GPTConfig of a Hugging Face Llama `config.json` dict; `overrides` set other GPTConfig fields."""
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings"):
        if key not in hf:
            raise ValueError(f"config.json lacks the Llama field {key!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json has hidden_act={hf['hidden_act']!r}; jaxgpt's SwiGLU uses silu")
    heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        raise ValueError(f"config.json has head_dim={hf['head_dim']}; jaxgpt needs hidden_size / num_attention_heads "
                         f"= {hf['hidden_size'] // heads}")
    if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
        raise ValueError("config.json sets attention_bias and mlp_bias differently; jaxgpt has one `bias` switch")
    fields = dict(vocab_size=hf["vocab_size"], block_size=hf["max_position_embeddings"],
                  n_layer=hf["num_hidden_layers"], n_head=heads, n_embd=hf["hidden_size"],
                  n_kv_head=hf.get("num_key_value_heads") or heads, bias=bool(hf.get("attention_bias", False)),
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dropout=0.0,
                  layer_norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), position="rope",
                  rope_theta=_llama_rope_theta(hf), norm="rmsnorm", mlp="swiglu",
                  mlp_hidden=hf["intermediate_size"])
    return _gpt_config(fields, overrides)


def config_to_hf_llama(config: GPTConfig) -> dict:
    """A Hugging Face LlamaConfig dict for a Llama-style `config`."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.n_embd, "intermediate_size": config.mlp_hidden,
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head, "head_dim": config.head_dim, "hidden_act": "silu",
        "max_position_embeddings": config.block_size, "rms_norm_eps": config.layer_norm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_bias": config.bias, "mlp_bias": config.bias, "attention_dropout": config.dropout,
        "tie_word_embeddings": config.tie_embeddings, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "torch_dtype": config.param_dtype,
    }


def _llama_names(config: GPTConfig) -> dict:
    """{jaxgpt path (GPT-2 layer names): Llama tensor name, or the three q/k/v names for c_attn}, from
    the names the layers declare (relative to the decoder layer `model.layers.{i}` inside a block)."""
    names = {}
    for path, info in _infos(config).items():
        if not info.hf_name:
            continue
        prefix = f"model.layers.{path[0][2:]}." if info.block else ""
        full = tuple(prefix + n for n in info.hf_name)
        names[path] = full if len(full) > 1 else full[0]
    return names


def _from_llama(folder: Path, hf: dict, files: list, block_size: Optional[int], overrides: dict):
    config = config_from_hf_llama(hf, **overrides)
    if block_size is not None:  # rotary positions have no table to crop: only the context limit changes
        config = config.replace(block_size=block_size)
    expected, infos = _expected_shapes(config), _infos(config)
    names = _llama_names(config)
    with _tensors(folder, files, ()) as (shapes, read):
        wanted = {n for v in names.values() for n in (v if isinstance(v, tuple) else (v,))}
        missing = sorted(wanted - set(shapes))
        if missing:
            raise ValueError(f"{str(folder)} lacks {len(missing)} tensors that the config needs: {_short(missing)}")
        ignorable = {n for n in shapes if n.endswith("rotary_emb.inv_freq")}
        if config.tie_embeddings:
            ignorable.add("lm_head.weight")
        unexpected = sorted(set(shapes) - wanted - ignorable)
        if unexpected:
            raise ValueError(f"{str(folder)} has {len(unexpected)} tensors that a Llama with this config does not "
                             f"use: {_short(unexpected)}")
        flat = {}
        for path, name in names.items():
            parts = [np.asarray(read(n)) for n in (name if isinstance(name, tuple) else (name,))]
            x = np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
            if infos[path].role == "matrix":
                x = x.T  # nn.Linear's [out, in] -> [in, out]
            if x.shape != expected[path]:
                raise ValueError(f"{str(folder)}: {name} gives {'/'.join(path)} the shape {x.shape}, but the "
                                 f"config implies {expected[path]}")
            flat[path] = jnp.asarray(x.astype(config.params_dtype, copy=False))
    return config, convert_layers(_nest(flat), config)


def _llama_tensors(params, config: GPTConfig) -> dict:
    """Llama-named numpy tensors of a jaxgpt params tree."""
    if set(params) == {"params"}:
        params = params["params"]
    params = convert_layers(params, config.replace(scan_layers=False))
    got = {_path_names(p): np.asarray(jax.device_get(x)) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    names, infos = _llama_names(config), _infos(config)
    if set(got) != set(names):
        diff = sorted("/".join(p) for p in set(got) ^ set(names))
        raise ValueError(f"params do not match the config: these differ between them: {_short(diff)}")
    n, kh, h = config.n_head, config.n_kv_head, config.head_dim
    out = {}
    for path, name in names.items():
        x = got[path]
        if isinstance(name, tuple):  # c_attn = [q | k | v] along its output axis
            x = np.split(x, [n * h, (n + kh) * h], axis=-1)
        else:
            x = [x]
        for part, hf_name in zip(x, name if isinstance(name, tuple) else (name,)):
            out[hf_name] = np.ascontiguousarray(part.T if infos[path].role == "matrix" else part)
    return out
