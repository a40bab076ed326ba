"""nanoGPT's GPU run on character-level Shakespeare: 6 layers, 6 heads, 384 wide, context 256, batch 64."""

from jaxgpt.training.config import default_config


def get_config():
    c = default_config()
    c.out_dir = "out-shakespeare-char-gpu"
    c.data.corpus = "shakespeare"
    c.data.tokenizer = "char"
    c.model.block_size = 256
    c.model.n_layer = 6
    c.model.n_head = 6
    c.model.n_embd = 384
    c.model.dropout = 0.2
    c.model.dtype = "bfloat16"
    c.train.batch_size = 64
    c.train.max_steps = 5000
    c.train.lr = 1e-3
    c.train.min_lr = 1e-4
    c.train.warmup_steps = 100
    c.train.decay_steps = 5000
    c.train.beta2 = 0.99
    c.train.eval_interval = 250
    c.train.eval_steps = 200
    c.train.log_interval = 10
    c.train.checkpoint_interval = 500
    return c
