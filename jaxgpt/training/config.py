"""The training configuration: an ml_collections ConfigDict whose schema is `default_config()`.

configs/*.py start from `default_config()` and change what they need; `validate_config` rejects unknown
keys and impossible values before anything is compiled; `model_config_from` is the one place a ConfigDict
becomes a GPTConfig.
"""

from __future__ import annotations

import math
from typing import Optional

from ml_collections import config_dict

from jaxgpt import distributed
from jaxgpt.checks import is_int, is_real
from jaxgpt.compile_cache import cache_folder
from jaxgpt.config import GPTConfig
from jaxgpt.lora import LoraSpec
from jaxgpt.sharding import BATCH, rules
from jaxgpt.training.mesh import mesh_sizes, mesh_text, parse_mesh
from jaxgpt.user_modules import import_modules, require_parts

MODEL_KEYS = ("block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "dropout", "bias", "tie_embeddings",
              "dtype", "attention", "block", "kernels", "scan_layers", "remat", "position", "rope_theta", "norm", "mlp",
              "mlp_hidden", "layer_norm_epsilon", "qk_norm", "zero_init_proj", "logit_softcap", "embed_skip",
              "value_embeds")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")
PARALLEL_MODES = ("pmap", "mesh")
ALIGNS = ("random", "document")  # data.align


def _data_section():
    """config.data: the corpus, its tokenizer and where training windows start."""
    placeholder = config_dict.placeholder
    d = config_dict.ConfigDict()
    d.corpus = "shakespeare"  # shakespeare | tinyshakespeare | file | hf | shards (llm.c's token shards)
    # file/folder for `file`, local copy for `tinyshakespeare`, dataset for `hf`, a folder or glob for `shards`
    d.path = placeholder(str)
    d.val_path = placeholder(str)  # shards: the validation shards (a folder or glob); None: names with _val_
    d.tokenizer = "char"       # char | byte | bpe | gpt2 | auto (shards: their shards.json, else by version)
    d.vocab_size = placeholder(int)  # for `bpe`
    d.val_fraction = 0.1
    d.cache_dir = placeholder(str)   # None: $JAXGPT_CACHE or ~/.cache/jaxgpt
    # where training windows start: "random" (any token, nanoGPT's) or "document" (at a document's first
    # token, its end-of-text token; the tokenizer must have one); validation stays on fixed random windows
    d.align = "random"
    # with align="document": each token attends only to earlier tokens of its own document, whose positions
    # start at 0 (every document computed as if alone); False: windows aligned, attention across documents
    d.doc_mask = True
    return d


def default_config():
    """The full training schema with nanoGPT-like defaults (every key a config may set is here)."""
    placeholder = config_dict.placeholder
    c = config_dict.ConfigDict()
    c.out_dir = "out"
    c.seed = 1337
    c.init_from = "scratch"  # "scratch", "resume", a GPT-2 name ("gpt2", ...), a jaxgpt run folder or an HF folder
    c.overwrite = False      # allow a fresh start in an out_dir that already holds checkpoints
    # compiled programs kept on disk for the next run: "auto" ($JAXGPT_CACHE/xla), "off", or a folder
    c.compile_cache = "auto"
    # the user's modules that register parts the model names (a block, an attention), imported before the
    # model is built: "mypkg.blocks" or "a,b" or a list; the run records them (and the modules that registered
    # its parts), so jaxgpt-sample, jaxgpt-serve and init_from import them again
    c.imports = config_dict.placeholder(object)

    c.model = _model_section()
    c.data = _data_section()

    c.train = config_dict.ConfigDict()
    c.train.batch_size = 12      # global, over all devices and processes
    c.train.grad_accum = 1       # micro-batches per step; the update equals one batch_size batch
    c.train.max_steps = 2000
    c.train.steps_per_call = 1   # optimizer steps per compiled call (a lax.scan): fewer host round trips
    # > 0: the loss over chunks of this many positions of every row, logits [rows, loss_chunk, V] at a time
    # (recomputed in the backward), never the whole [rows, T, V]: memory for large vocabularies. 0: off
    c.train.loss_chunk = 0
    c.train.optimizer = "adamw"  # or "muon": Muon for the blocks' matmul kernels, AdamW (lr) for the rest
    c.train.muon_lr = 0.02       # Muon's peak learning rate (on the same schedule as lr)
    c.train.muon_momentum = 0.95
    c.train.muon_ns_dtype = "float32"  # Muon's Newton-Schulz matmul operands: "float32" or "bfloat16" (float32 sums)
    c.train.lr = 1e-3
    c.train.min_lr = 1e-4
    c.train.schedule = "cosine"  # "cosine" (warmup, cosine decay) or "wsd" (warmup, stable, linear decay)
    c.train.decay_fraction = 0.2  # wsd: the share of decay_steps spent decaying to min_lr
    c.train.warmup_steps = 100
    c.train.decay_steps = placeholder(int)  # None: max_steps
    c.train.weight_decay = 0.1
    c.train.beta1 = 0.9
    c.train.beta2 = 0.99
    c.train.grad_clip = 1.0      # 0 disables clipping
    c.train.eval_interval = 250
    c.train.eval_steps = 20
    _instrument_keys(c.train)  # downstream tasks, trackers, profiling
    c.train.target_val_loss = placeholder(float)  # stop (and save) once an eval's val loss is at or below it
    c.train.log_interval = 10
    c.train.parallel = "pmap"    # pmap | mesh
    c.train.fsdp = False         # mesh only: shard params and optimizer state over the devices ("fsdp=-1")
    # the mesh's axes and sizes, e.g. "data=-1,fsdp=2", "dcn=2,data=-1,fsdp=4" or "fsdp=-1,tensor=4" (implies
    # parallel=mesh): batch over dcn (across slices), data and fsdp, the state sharded over fsdp and tensor
    # (heads, MLP hidden, vocab); -1: the rest of the devices. "": "data=-1", or "fsdp=-1" with fsdp=True
    # (jaxgpt/training/mesh.py)
    c.train.mesh = ""
    # overrides of the rules table that maps logical axes to mesh axes (jaxgpt/sharding.py), e.g.
    # "qkv=tensor+fsdp,embed=" (embed unsplit); "": the defaults
    c.train.logical_axis_rules = ""
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

    c.distributed = distributed.default_section()  # several processes through jax.distributed
    return c


def _instrument_keys(t) -> None:
    """config.train's instruments: multiple-choice tasks scored in the loop (jaxgpt/evals.py), trackers, profiling."""
    placeholder = config_dict.placeholder
    # task files, "a.jsonl,b.jsonl" or a list: the scores go to the log line, metrics.jsonl ("<file stem>/acc",
    # "<file stem>/acc_norm"), the trackers and the checkpoint's meta
    t.eval_tasks = placeholder(object)
    t.eval_tasks_interval = placeholder(int)  # a multiple of eval_interval; None: every eval
    t.eval_tasks_limit = placeholder(int)     # the first N items of each task; None: all
    t.eval_tasks_style = "llmc"               # "llmc" (llm.c's scoring) or "lm_eval" (lm-eval's)
    # where metrics go besides the console (jaxgpt/training/trackers.py): any of "jsonl" (always written),
    # "tensorboard", "wandb", comma-separated or a list; "auto": jsonl, and tensorboard when tensorboardX is installed
    t.trackers = "auto"
    t.wandb_project = "jaxgpt"
    t.wandb_name = placeholder(str)    # None: wandb's own name for the run
    t.wandb_entity = placeholder(str)  # None: the logged-in user's default entity
    t.wandb_mode = placeholder(str)    # "online", "offline", "disabled"; None: wandb's own ($WANDB_MODE)
    # "START:STOP": a jax.profiler trace of steps START..STOP-1 in out_dir/profile (jaxgpt/training/profiling.py)
    t.profile = ""


def _model_section():
    """config.model: the GPTConfig fields (GPTConfig's docstring), vocab_size excepted (the tokenizer's)."""
    placeholder = config_dict.placeholder
    m = config_dict.ConfigDict()
    m.block_size = 256
    m.n_layer = 6
    m.n_head = 6
    m.n_kv_head = placeholder(int)  # None: n_head (plain multi-head attention)
    m.n_embd = 384
    m.dropout = 0.0
    m.bias = True
    m.tie_embeddings = True
    m.dtype = "float32"  # compute dtype; parameters and optimizer state stay float32
    m.attention = "dot_product"  # a registered attention: "dot_product", "einsum" (reference), "cudnn"
    m.block = "gpt2"             # a registered block (jaxgpt.model): "gpt2" (pre-norm) or "parallel"
    m.kernels = "auto"  # the backend: "auto" (by platform), "portable" or "cpu": see jaxgpt/backends/
    m.scan_layers = False  # blocks stored stacked, run as one lax.scan: compile time flat in depth
    m.remat = "none"       # "block", "dots" or "offload": recompute activations in the backward to save memory
    m.position = "learned"  # "learned" (GPT-2's wpe) or "rope" (rotary, base rope_theta)
    m.rope_theta = 10000.0
    m.norm = "layernorm"    # or "rmsnorm"
    m.mlp = "gelu"          # or "swiglu" (gate/up/down)
    m.mlp_hidden = placeholder(int)  # None: 4 * n_embd (gelu) or ~8/3 * n_embd (swiglu)
    m.layer_norm_epsilon = 1e-5
    # the modern (speedrun) recipe, each part off by default (GPTConfig's docstring; docs/models.md)
    m.qk_norm = False         # RMS-normalise q and k per head
    m.zero_init_proj = False  # output projections start at zero
    m.logit_softcap = 0.0     # > 0: logits = cap * tanh(logits / cap)
    m.embed_skip = False      # every block's input mixes in the embedding (two learned weights each)
    m.value_embeds = 0        # k > 0: k token tables mixed into the values of the first and last k blocks

    return m


def parallel_mode(train_cfg) -> str:
    """How the step runs: 'mesh' whenever train.mesh names a mesh, else train.parallel."""
    return "mesh" if train_cfg.get("mesh") else train_cfg.parallel


def doc_masked(config) -> bool:
    """Whether training feeds the model document segment ids: data.align='document' with data.doc_mask."""
    d = config.data
    return d.get("align", "random") == "document" and bool(d.get("doc_mask", True))


def model_config_from(config, vocab_size: int) -> GPTConfig:
    """The GPTConfig described by a training config's `model` section."""
    m = config.model
    return GPTConfig(vocab_size=vocab_size, **{k: m[k] for k in MODEL_KEYS})


def import_user_modules(config) -> None:
    """Import the modules config.imports names, then make sure the block and attention config.model names
    are registered (ValueError naming the key and what to import otherwise): before the model is built."""
    import_modules(config.get("imports"), "--config.imports")
    require_parts({k: config.model[k] for k in ("block", "attention")}, flag="--config.imports",
                  whose="config.model's")


def _check_keys(config, schema, prefix=""):
    unknown = sorted(set(config.keys()) - set(schema.keys()))
    if unknown:
        raise ValueError(f"unknown config key(s) {[prefix + k for k in unknown]}; "
                         f"valid keys under '{prefix or '.'}' are {sorted(schema.keys())}")
    for k in config.keys():
        if isinstance(schema[k], config_dict.ConfigDict):
            if not isinstance(config[k], config_dict.ConfigDict):
                raise ValueError(f"config.{prefix}{k} must be a section, got {config[k]!r}")
            _check_keys(config[k], schema[k], prefix + k + ".")


def _check_mesh(t, device_count: Optional[int]) -> None:
    """train.mesh and train.logical_axis_rules: well formed, and with a known device count a mesh whose
    sizes multiply to it."""
    axis_rules = t.get("logical_axis_rules", "")
    if not isinstance(axis_rules, (str, tuple, list)):
        raise ValueError(f"config.train.logical_axis_rules must be a string such as 'qkv=tensor+fsdp,embed=', "
                         f"got {axis_rules!r}")
    rules(axis_rules)
    if not isinstance(t.mesh, str):
        raise ValueError(f"config.train.mesh must be a string such as 'data=-1,fsdp=2', got {t.mesh!r}")
    if not t.mesh:
        return
    if t.fsdp:
        raise ValueError("config.train.fsdp: train.fsdp=True is the mesh 'fsdp=-1'; with train.mesh set, "
                         "leave it False and name an fsdp axis in train.mesh (e.g. 'data=-1,fsdp=2')")
    if device_count is None:
        parse_mesh(t.mesh)
    else:
        mesh_sizes(t.mesh, device_count)


def batch_devices(t, device_count: Optional[int]) -> int:
    """How many devices a global batch's rows are split over (1 when the count is not known): all of them
    under pmap; on a mesh those of its batch axes (by default all but tensor)."""
    if device_count is None:
        return 1
    if parallel_mode(t) != "mesh":
        return device_count
    batch = rules(t.get("logical_axis_rules", ""))[BATCH]
    return math.prod(size for name, size in mesh_sizes(mesh_text(t.mesh, t.fsdp), device_count) if name in batch)


def _check_data(d) -> None:
    """config.data: a corpus the loop knows, and the tokenizer and paths that go with it."""
    from jaxgpt.data import CORPORA, TOKENIZERS

    if d.align not in ALIGNS:
        raise ValueError(f"config.data.align: must be one of {ALIGNS}, got {d.align!r}")
    if not isinstance(d.doc_mask, bool):
        raise ValueError(f"config.data.doc_mask: must be True or False, got {d.doc_mask!r}")
    if d.align == "document" and d.tokenizer in ("char", "byte"):
        raise ValueError(f"config.data.align: 'document' needs a tokenizer with an end-of-text token to find "
                         f"documents by; data.tokenizer={d.tokenizer!r} has none (use 'bpe' or 'gpt2', or "
                         f"data.align='random')")
    corpora = CORPORA + ("shards",)
    if d.corpus not in corpora:
        raise ValueError(f"config.data.corpus: must be one of {corpora}, got {d.corpus!r}")
    if d.corpus == "shards":
        if not d.path:
            raise ValueError("config.data.path: corpus 'shards' needs a folder or a glob of llm.c shard files, e.g. "
                             "--config.data.path='fineweb10B/fineweb_*.bin'")
        if d.tokenizer not in ("auto", "gpt2", "byte", "bpe"):
            raise ValueError(f"config.data.tokenizer: {d.tokenizer!r} does not go with corpus 'shards', whose ids "
                             "come tokenized: set 'auto' (the shards' own tokenizer file, else GPT-2's vocabulary "
                             "for version-1 shards and Llama-3's for version 7) or 'gpt2'")
        return
    if d.get("val_path") is not None:
        raise ValueError("config.data.val_path: applies to corpus 'shards' only (text corpora split by "
                         "data.val_fraction)")
    if d.tokenizer not in TOKENIZERS:
        raise ValueError(f"config.data.tokenizer: must be one of {TOKENIZERS} for a text corpus ('auto' is for "
                         f"corpus 'shards'), got {d.tokenizer!r}")


def _check_instruments(t) -> None:
    """train.eval_tasks*, train.trackers and wandb_*, train.profile (_instrument_keys)."""
    from jaxgpt.training import profiling, task_eval, trackers

    task_eval.check_config(t)
    trackers.check_config(t)
    window = profiling.parse_window(t.get("profile"))
    if window is not None and window[0] >= t.max_steps:
        raise ValueError(f"config.train.profile: START must be below train.max_steps ({t.max_steps}), got "
                         f"{t.profile!r}")


def validate_config(config, device_count: Optional[int] = None) -> None:
    """Raise ValueError naming the key for unknown keys or values that cannot work; `device_count` (the
    devices the step will run on) None leaves out the checks that need it."""
    _check_keys(config, default_config())
    if not isinstance(config.out_dir, str) or not config.out_dir.strip():
        raise ValueError(f"config.out_dir must name a folder, got {config.out_dir!r}; e.g. --config.out_dir=out")
    import_user_modules(config)
    model_config_from(config, vocab_size=256)  # GPTConfig's own checks (vocab is known only later)
    t, d = config.train, config.data

    def need(ok, key, msg):
        if not ok:
            raise ValueError(f"config.{key}: {msg}")

    for key in ("batch_size", "grad_accum", "max_steps", "steps_per_call", "eval_interval", "eval_steps", "log_interval",
                "checkpoint_interval", "keep_checkpoints"):
        v = t[key]
        need(is_int(v) and v >= 1, f"train.{key}",
             f"must be a positive integer, got {v!r}")
    need(config.model.dtype != "float16", "model.dtype",
         "float16 training has no loss scaling (gradients underflow); use bfloat16 or float32")
    need(t.parallel in PARALLEL_MODES, "train.parallel", f"must be one of {PARALLEL_MODES}, got {t.parallel!r}")
    need(isinstance(t.fsdp, bool), "train.fsdp", f"must be True or False, got {t.fsdp!r}")
    need(not t.fsdp or t.parallel == "mesh" or t.mesh, "train.fsdp",
         "needs train.parallel='mesh' (pmap keeps a whole copy of the state on every device)")
    _check_mesh(t, device_count)
    if "distributed" in config:
        distributed.check_config(config.distributed)
    n = batch_devices(t, device_count)
    need(t.batch_size % (n * t.grad_accum) == 0, "train.batch_size",
         f"{t.batch_size} must be divisible by the device count ({n}; the product of the batch axes "
         f"of train.mesh) times train.grad_accum ({t.grad_accum})")
    # (is_real: finite; an infinite lr or weight decay compiles and gives a NaN loss at step 2)
    need(is_real(t.lr) and t.lr > 0, "train.lr", f"must be a finite number > 0, got {t.lr!r}")
    need(is_real(t.min_lr) and 0 <= t.min_lr <= t.lr, "train.min_lr", f"must be in [0, lr={t.lr}], got {t.min_lr!r}")
    # warmup past max_steps is allowed (a short smoke run of a long config): the loop warns about it
    need(is_int(t.warmup_steps) and t.warmup_steps >= 0,
         "train.warmup_steps", f"must be an integer >= 0, got {t.warmup_steps!r}")
    need(t.decay_steps is None or (t.decay_steps >= t.warmup_steps and t.decay_steps >= 1), "train.decay_steps",
         f"must be >= warmup_steps ({t.warmup_steps}), got {t.decay_steps}")
    need(t.optimizer in OPTIMIZERS, "train.optimizer", f"must be one of {OPTIMIZERS}, got {t.optimizer!r}")
    need(t.schedule in SCHEDULES, "train.schedule", f"must be one of {SCHEDULES}, got {t.schedule!r}")
    need(0 < t.decay_fraction <= 1, "train.decay_fraction", f"must be in (0, 1], got {t.decay_fraction}")
    need(is_real(t.muon_lr) and t.muon_lr > 0, "train.muon_lr", f"must be a finite number > 0, got {t.muon_lr!r}")
    need(t.muon_ns_dtype in ("float32", "bfloat16"), "train.muon_ns_dtype",
         f"must be 'float32' or 'bfloat16', got {t.muon_ns_dtype!r}")
    need(0 <= t.muon_momentum < 1, "train.muon_momentum", f"must be in [0, 1), got {t.muon_momentum}")
    need(t.optimizer != "muon" or not t.lora.rank, "train.optimizer",
         "'muon' trains whole models; LoRA adapters train with 'adamw'")
    need(is_real(t.weight_decay) and t.weight_decay >= 0, "train.weight_decay",
         f"must be a finite number >= 0, got {t.weight_decay!r}")
    for key in ("beta1", "beta2"):
        need(0 <= t[key] < 1, f"train.{key}", f"must be in [0, 1), got {t[key]!r}")
    need(t.grad_clip >= 0, "train.grad_clip", f"must be >= 0 (0 disables), got {t.grad_clip}")
    need(is_int(t.loss_chunk) and t.loss_chunk >= 0, "train.loss_chunk",
         f"must be an integer >= 0 (positions per chunk of the loss; 0: whole logits), got {t.loss_chunk!r}")
    need(t.target_val_loss is None or (is_real(t.target_val_loss) and 0 < t.target_val_loss < math.inf),
         "train.target_val_loss", f"must be a finite loss > 0 (None: train to max_steps), got {t.target_val_loss!r}")
    need(t.peak_flops is None or (is_real(t.peak_flops) and t.peak_flops > 0), "train.peak_flops",
         f"must be a finite number > 0 (FLOP/s of one device; None: measured or known), got {t.peak_flops!r}")
    _check_instruments(t)
    need(0 < d.val_fraction < 1, "data.val_fraction", f"must be in (0, 1), got {d.val_fraction}")
    _check_data(d)
    need(d.tokenizer != "bpe" or (d.vocab_size or 0) > 256, "data.vocab_size",
         "the bpe tokenizer needs data.vocab_size > 256")
    cache_folder(config.compile_cache)
    need(isinstance(config.init_from, str) and config.init_from != "", "init_from",
         "must be 'scratch', 'resume', a GPT-2 name or a folder")
    lora = t.lora
    need(is_int(lora.rank) and lora.rank >= 0, "train.lora.rank",
         f"must be an integer >= 0 (0 = off), got {lora.rank!r}")
    if lora.rank:
        LoraSpec.from_config(lora)  # alpha and targets
        need(config.init_from != "scratch", "init_from",
             "LoRA adapts a trained model: set init_from to a jaxgpt run folder, a Hugging Face folder or a "
             "GPT-2 name (or 'resume' to continue a LoRA run)")
