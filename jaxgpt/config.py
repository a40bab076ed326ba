"""GPTConfig: the model's shape and numerics, validated on construction."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax.numpy as jnp

from jaxgpt.attention import attention_names
from jaxgpt.kernels import KERNEL_SETS

DTYPES = ("float32", "bfloat16", "float16")
REMAT_MODES = ("none", "block", "dots")
POSITIONS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
_INT_FIELDS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head", "mlp_hidden")
_BOOL_FIELDS = ("bias", "tie_embeddings", "scan_layers")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A GPT-2 style decoder-only transformer's hyperparameters.

    GPT-2 by default. Three independent switches give the pieces of Llama-style models: `position`
    "learned" (GPT-2's wpe table) or "rope" (rotary embeddings of q and k at each token's absolute
    position, base `rope_theta`); `norm` "layernorm" or "rmsnorm" (epsilon `layer_norm_epsilon` for either);
    `mlp` "gelu" (c_fc, GELU, c_proj) or "swiglu" (c_proj(silu(c_gate(x)) * c_fc(x))). `mlp_hidden` is
    the MLP's width: None means 4 * n_embd for gelu, and 8/3 * n_embd rounded up to a multiple of 64 for
    swiglu (about the same parameter count). With `bias=False`, `tie_embeddings=False` and `n_kv_head`
    these make the Llama architecture.

    `n_kv_head` < `n_head` gives grouped-query attention (1 = multi-query); `None` means `n_head`.
    `dtype` is the compute dtype; parameters are kept in `param_dtype` (float32 by default). float16 is
    for inference on GPUs without bfloat16; training has no loss scaling, so it refuses float16.

    `attention` names a registered implementation (jaxgpt.attention; "dot_product" by default), and
    `kernels` picks backend kernels: "auto" (the CPU kernels on a CPU, the portable core elsewhere),
    "portable" or "cpu" (jaxgpt/kernels/). Both change how, never what, is computed.

    `scan_layers` stores the blocks' parameters stacked ([L, ...] leaves under `h`) and runs them as one
    `jax.lax.scan`, so compile time does not grow with depth; checkpoints and Hugging Face weights
    convert between that and GPT-2's h_0 ... h_{L-1} (`jaxgpt.model.convert_layers`). `remat` recomputes
    activations in the backward pass instead of keeping them: "block" keeps only each block's input,
    "dots" also keeps the outputs of the matmuls without batch dimensions.
    """

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_kv_head: Optional[int] = None
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention: str = "dot_product"
    kernels: str = "auto"
    layer_norm_epsilon: float = 1e-5
    scan_layers: bool = False
    remat: str = "none"
    position: str = "learned"
    rope_theta: float = 10000.0
    norm: str = "layernorm"
    mlp: str = "gelu"
    mlp_hidden: Optional[int] = None

    def __post_init__(self):
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.mlp_hidden is None and self.mlp in MLPS and isinstance(self.n_embd, int):
            width = 4 * self.n_embd if self.mlp == "gelu" else -(-8 * self.n_embd // 3 // 64) * 64
            object.__setattr__(self, "mlp_hidden", width)
        choices = {"dtype": DTYPES, "param_dtype": DTYPES, "attention": attention_names(), "kernels": KERNEL_SETS,
                   "remat": REMAT_MODES, "position": POSITIONS, "norm": NORMS, "mlp": MLPS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"GPTConfig.n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if not _is_real(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be a number in [0, 1), got {self.dropout!r}")
        if not _is_real(self.layer_norm_epsilon) or not 0 < self.layer_norm_epsilon < math.inf:
            raise ValueError(f"GPTConfig.layer_norm_epsilon must be a finite number > 0, got "
                             f"{self.layer_norm_epsilon!r}")
        if not _is_real(self.rope_theta) or not 1 < self.rope_theta < math.inf:
            raise ValueError(f"GPTConfig.rope_theta must be a finite number > 1, got {self.rope_theta!r}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"GPTConfig.position='rope' needs an even head dimension (n_embd / n_head), got "
                             f"{self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> "GPTConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields {unknown}; known fields are {sorted(known)}")
        if d.get("attention") == "blocked":  # checkpoints before the kernel switch: now kernels="cpu"'s job
            d = {**d, "attention": "dot_product"}
        return cls(**d)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters of the model this config builds, counted on its (abstract) parameter tree.

        `non_embedding` leaves out the tables that are only looked up, never multiplied: the position
        embeddings, and the token embeddings when the output head is a separate matrix.
        """
        from jaxgpt.model import abstract_params, count_params  # the model module builds the tree
        return count_params(abstract_params(self), non_embedding=non_embedding)

    def flops_per_token(self, seq_len: Optional[int] = None, causal_halved: bool = False) -> float:
        """Training FLOPs per token: 6N plus attention's 12 * n_layer * T * n_embd (PaLM appendix B).

        N counts the parameters that take part in a matmul (`num_params(non_embedding=True)`); with
        `causal_halved` the attention term is halved since a causal mask skips half the score matrix.
        """
        t = self.block_size if seq_len is None else seq_len
        n = self.num_params(non_embedding=True)
        attn = 12 * self.n_layer * t * self.n_head * self.head_dim
        if causal_halved:
            attn /= 2
        return 6.0 * n + attn


# ---------------------------------------------------------------------------------------------------
# The training configuration: an ml_collections ConfigDict. configs/*.py start from `default_config()`
# and change what they need; `validate_config` rejects unknown keys and impossible values before
# anything is compiled.

MODEL_KEYS = ("block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "dropout", "bias", "tie_embeddings",
              "dtype", "attention", "kernels", "scan_layers", "remat", "position", "rope_theta", "norm", "mlp",
              "mlp_hidden", "layer_norm_epsilon")
PARALLEL_MODES = ("pmap", "mesh")


def default_config():
    """The full training schema with nanoGPT-like defaults (every key a config may set is here)."""
    from ml_collections import config_dict

    placeholder = config_dict.placeholder
    c = config_dict.ConfigDict()
    c.out_dir = "out"
    c.seed = 1337
    c.init_from = "scratch"  # "scratch", "resume", a GPT-2 name ("gpt2", ...), a jaxgpt run folder or an HF folder
    c.overwrite = False      # allow a fresh start in an out_dir that already holds checkpoints

    c.model = config_dict.ConfigDict()
    c.model.block_size = 256
    c.model.n_layer = 6
    c.model.n_head = 6
    c.model.n_kv_head = placeholder(int)  # None: n_head (plain multi-head attention)
    c.model.n_embd = 384
    c.model.dropout = 0.0
    c.model.bias = True
    c.model.tie_embeddings = True
    c.model.dtype = "float32"  # compute dtype; parameters and optimizer state stay float32
    c.model.attention = "dot_product"  # a registered attention: "dot_product", "einsum" (reference), "cudnn"
    c.model.kernels = "auto"  # "auto" (CPU kernels on a CPU), "portable" or "cpu": see jaxgpt/kernels/
    c.model.scan_layers = False  # blocks stored stacked, run as one lax.scan: compile time flat in depth
    c.model.remat = "none"       # "block" or "dots": recompute activations in the backward to save memory
    c.model.position = "learned"  # "learned" (GPT-2's wpe) or "rope" (rotary, base rope_theta)
    c.model.rope_theta = 10000.0
    c.model.norm = "layernorm"    # or "rmsnorm"
    c.model.mlp = "gelu"          # or "swiglu" (gate/up/down)
    c.model.mlp_hidden = placeholder(int)  # None: 4 * n_embd (gelu) or ~8/3 * n_embd (swiglu)
    c.model.layer_norm_epsilon = 1e-5

    c.data = config_dict.ConfigDict()
    c.data.corpus = "shakespeare"  # shakespeare | tinyshakespeare | file | hf
    c.data.path = placeholder(str)  # file/folder for `file`, local copy for `tinyshakespeare`, dataset for `hf`
    c.data.tokenizer = "char"       # char | byte | bpe | gpt2
    c.data.vocab_size = placeholder(int)  # for `bpe`
    c.data.val_fraction = 0.1
    c.data.cache_dir = placeholder(str)   # None: $JAXGPT_CACHE or ~/.cache/jaxgpt

    c.train = config_dict.ConfigDict()
    c.train.batch_size = 12      # global, over all devices and processes
    c.train.grad_accum = 1       # micro-batches per step; the update equals one batch_size batch
    c.train.max_steps = 2000
    c.train.steps_per_call = 1   # optimizer steps per compiled call (a lax.scan): fewer host round trips
    c.train.lr = 1e-3
    c.train.min_lr = 1e-4
    c.train.warmup_steps = 100
    c.train.decay_steps = placeholder(int)  # None: max_steps
    c.train.weight_decay = 0.1
    c.train.beta1 = 0.9
    c.train.beta2 = 0.99
    c.train.grad_clip = 1.0      # 0 disables clipping
    c.train.eval_interval = 250
    c.train.eval_steps = 20
    c.train.log_interval = 10
    c.train.parallel = "pmap"    # pmap | mesh
    c.train.fsdp = False         # mesh only: shard params and optimizer state over the data axis
    c.train.checkpoint_interval = 250
    c.train.keep_checkpoints = 2
    c.train.peak_flops = placeholder(float)  # per device, for MFU; None: measured or known for the device
    c.train.progress = True      # tqdm bar (quiet when stderr is not a terminal)
    # LoRA: train low-rank adapters on these dense layers of a model from init_from, the rest frozen
    c.train.lora = config_dict.ConfigDict()
    c.train.lora.rank = 0                    # 0: off (full training)
    c.train.lora.alpha = 16.0                # the adapters' scale is alpha / rank
    c.train.lora.targets = "c_attn,c_proj"   # comma-separated: c_attn, c_proj, c_fc, c_gate, lm_head,
    #                                          attn.c_proj / mlp.c_proj, or Llama's q, k, v, o, gate, up, down

    # several processes (hosts) through jax.distributed; see jaxgpt/distributed.py
    c.distributed = config_dict.ConfigDict()
    c.distributed.enabled = placeholder(bool)             # None: auto (the keys below, or a detected cluster)
    c.distributed.coordinator_address = placeholder(str)  # "HOST:PORT" of process 0
    c.distributed.num_processes = placeholder(int)
    c.distributed.process_id = placeholder(int)
    c.distributed.initialization_timeout_s = 300          # how long processes wait for each other at start
    c.distributed.heartbeat_timeout_s = 100               # a silent process is dead after this; the rest stop
    return c


def model_config_from(config, vocab_size: int) -> GPTConfig:
    """The GPTConfig described by a training config's `model` section."""
    m = config.model
    return GPTConfig(vocab_size=vocab_size, **{k: m[k] for k in MODEL_KEYS})


def _check_keys(config, schema, prefix=""):
    from ml_collections import config_dict

    unknown = sorted(set(config.keys()) - set(schema.keys()))
    if unknown:
        raise ValueError(f"unknown config key(s) {[prefix + k for k in unknown]}; "
                         f"valid keys under '{prefix or '.'}' are {sorted(schema.keys())}")
    for k in config.keys():
        if isinstance(schema[k], config_dict.ConfigDict):
            if not isinstance(config[k], config_dict.ConfigDict):
                raise ValueError(f"config.{prefix}{k} must be a section, got {config[k]!r}")
            _check_keys(config[k], schema[k], prefix + k + ".")


def validate_config(config, device_count: int = 1) -> None:
    """Raise ValueError naming the key for unknown keys or values that cannot work."""
    _check_keys(config, default_config())
    if not isinstance(config.out_dir, str) or not config.out_dir.strip():
        raise ValueError(f"config.out_dir must name a folder, got {config.out_dir!r}; e.g. --config.out_dir=out")
    model_config_from(config, vocab_size=256)  # GPTConfig's own checks (vocab is known only later)
    t, d = config.train, config.data

    def need(ok, key, msg):
        if not ok:
            raise ValueError(f"config.{key}: {msg}")

    for key in ("batch_size", "grad_accum", "max_steps", "steps_per_call", "eval_interval", "eval_steps", "log_interval",
                "checkpoint_interval", "keep_checkpoints"):
        v = t[key]
        need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"train.{key}",
             f"must be a positive integer, got {v!r}")
    need(config.model.dtype != "float16", "model.dtype",
         "float16 training has no loss scaling (gradients underflow); use bfloat16 or float32")
    need(t.parallel in PARALLEL_MODES, "train.parallel", f"must be one of {PARALLEL_MODES}, got {t.parallel!r}")
    need(isinstance(t.fsdp, bool), "train.fsdp", f"must be True or False, got {t.fsdp!r}")
    need(not t.fsdp or t.parallel == "mesh", "train.fsdp",
         "needs train.parallel='mesh' (pmap keeps a whole copy of the state on every device)")
    if "distributed" in config:
        from jaxgpt.distributed import check_config
        check_config(config.distributed)
    need(t.batch_size % (device_count * t.grad_accum) == 0, "train.batch_size",
         f"{t.batch_size} must be divisible by the device count ({device_count}) times "
         f"train.grad_accum ({t.grad_accum})")
    need(t.lr > 0, "train.lr", f"must be > 0, got {t.lr}")
    need(0 <= t.min_lr <= t.lr, "train.min_lr", f"must be in [0, lr={t.lr}], got {t.min_lr}")
    # warmup past max_steps is allowed (a short smoke run of a long config): the loop warns about it
    need(isinstance(t.warmup_steps, int) and not isinstance(t.warmup_steps, bool) and t.warmup_steps >= 0,
         "train.warmup_steps", f"must be an integer >= 0, got {t.warmup_steps!r}")
    need(t.decay_steps is None or (t.decay_steps >= t.warmup_steps and t.decay_steps >= 1), "train.decay_steps",
         f"must be >= warmup_steps ({t.warmup_steps}), got {t.decay_steps}")
    need(t.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {t.weight_decay}")
    need(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1/beta2", f"must be in [0, 1), got {t.beta1}, {t.beta2}")
    need(t.grad_clip >= 0, "train.grad_clip", f"must be >= 0 (0 disables), got {t.grad_clip}")
    need(t.peak_flops is None or t.peak_flops > 0, "train.peak_flops", f"must be > 0, got {t.peak_flops}")
    need(0 < d.val_fraction < 1, "data.val_fraction", f"must be in (0, 1), got {d.val_fraction}")
    need(d.tokenizer != "bpe" or (d.vocab_size or 0) > 256, "data.vocab_size",
         "the bpe tokenizer needs data.vocab_size > 256")
    need(isinstance(config.init_from, str) and config.init_from != "", "init_from",
         "must be 'scratch', 'resume', a GPT-2 name or a folder")
    lora = t.lora
    need(isinstance(lora.rank, int) and not isinstance(lora.rank, bool) and lora.rank >= 0, "train.lora.rank",
         f"must be an integer >= 0 (0 = off), got {lora.rank!r}")
    if lora.rank:
        from jaxgpt.lora import LoraSpec
        LoraSpec.from_config(lora)  # alpha and targets
        need(config.init_from != "scratch", "init_from",
             "LoRA adapts a trained model: set init_from to a jaxgpt run folder, a Hugging Face folder or a "
             "GPT-2 name (or 'resume' to continue a LoRA run)")


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
