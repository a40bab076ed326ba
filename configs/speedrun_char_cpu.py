"""The CPU speedrun: character-level Tiny Shakespeare to nanoGPT's baby-run loss (val 1.886) fast."""

from jaxgpt.training.config import default_config


def get_config():
    c = default_config()
    c.out_dir = "out-speedrun-char"
    c.data.corpus = "shakespeare"
    c.data.tokenizer = "char"
    c.model.block_size = 64
    c.model.n_layer = 4
    c.model.n_head = 4
    c.model.n_embd = 128
    c.model.dtype = "bfloat16"
    c.train.beta2 = 0.99
    c.model.position = "rope"
    c.model.norm = "rmsnorm"
    c.model.bias = False
    c.model.tie_embeddings = False
    c.model.mlp = "relu2"
    c.model.qk_norm = True
    c.model.zero_init_proj = True
    c.model.logit_softcap = 15.0
    c.model.embed_skip = True
    c.model.value_embeds = 1
    c.train.optimizer = "muon"
    c.train.muon_lr = 0.03
    c.train.lr = 3e-3
    c.train.min_lr = 0.0
    c.train.schedule = "wsd"
    c.train.decay_fraction = 0.4
    c.train.warmup_steps = 20
    c.train.batch_size = 32
    c.train.max_steps = 400
    c.train.decay_steps = 400
    c.train.weight_decay = 0.0
    c.train.eval_interval = 100
    c.train.eval_steps = 8
    c.train.log_interval = 50
    c.train.steps_per_call = 50
    c.train.checkpoint_interval = 400
    c.train.progress = False
    return c
