"""The CPU speedrun: character-level Tiny Shakespeare to nanoGPT's baby-run loss (val 1.886) fast.

python train.py --config=configs/speedrun_char_cpu.py --config.data.corpus=file --config.data.path=tinyshakespeare.txt

nanoGPT's baby model (4 layers, 128 wide, context 64) trained the modern way: rotary positions, RMSNorm,
QK-norm, ReLU^2, zero-initialised projections, a soft-capped untied head, one value embedding, Muon for
the blocks' matrices and AdamW for the rest, warmup-stable-decay; 100 steps of 32 x 64 tokens (205k
tokens, nanoGPT's run uses 1.5M), one evaluation at the end over 16k val tokens (nanoGPT: 15k). The
settings were found by sweeping the loss at a fixed step count (bench/README.md, "The CPU speedrun"):
two heads of 64 instead of four of 32, Muon at 0.015 with momentum 0.85 and AdamW at 7e-3 each gained
more than the embedding skips (off here: they cost time and loss at this size). `bench/speedrun.py`
times it against nanoGPT's own run.
"""

from jaxgpt.training.config import default_config


def get_config():
    c = default_config()
    c.out_dir = "out-speedrun-char"
    c.data.corpus = "shakespeare"
    c.data.tokenizer = "char"
    c.model.block_size = 64
    c.model.n_layer = 4
    c.model.n_head = 2
    c.model.n_embd = 128
    c.model.dtype = "bfloat16"  # float32 where the CPU has neither AVX512_BF16 nor AMX (the loop says so)
    c.train.beta2 = 0.99
    c.model.position = "rope"
    c.model.norm = "rmsnorm"
    c.model.bias = False
    c.model.tie_embeddings = False
    c.model.mlp = "relu2"
    c.model.qk_norm = True
    c.model.zero_init_proj = True
    c.model.logit_softcap = 15.0
    c.model.embed_skip = False
    c.model.value_embeds = 1
    c.train.optimizer = "muon"
    c.train.muon_lr = 0.015
    c.train.muon_momentum = 0.85
    c.train.lr = 7e-3
    c.train.min_lr = 0.0
    c.train.schedule = "wsd"
    c.train.decay_fraction = 0.4
    c.train.warmup_steps = 10
    c.train.batch_size = 32
    c.train.max_steps = 100
    c.train.decay_steps = 100
    c.train.weight_decay = 0.0
    c.train.eval_interval = 100
    c.train.eval_steps = 8
    c.train.log_interval = 50
    c.train.steps_per_call = 50
    c.train.checkpoint_interval = 100
    c.train.progress = False
    return c
