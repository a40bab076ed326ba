"""GPT-2 small (124M) on an OpenWebText-style Hugging Face corpus with GPT-2's tokenizer.

Needs `pip install 'jaxgpt[hf]'`, network for the first prepare, and accelerators. nanoGPT's recipe:
about 0.5M tokens per step (batch 480 x 1024 with gradient accumulation), 600k steps.
"""

from jaxgpt.training.config import default_config


def get_config():
    c = default_config()
    c.out_dir = "out-gpt2-124m"
    c.data.corpus = "hf"
    c.data.path = "openwebtext"
    c.data.tokenizer = "gpt2"
    c.data.val_fraction = 0.0005
    c.model.block_size = 1024
    c.model.n_layer = 12
    c.model.n_head = 12
    c.model.n_embd = 768
    c.model.dropout = 0.0
    c.model.bias = True
    c.model.dtype = "bfloat16"
    c.model.attention = "dot_product"
    c.train.batch_size = 480
    c.train.grad_accum = 5
    c.train.max_steps = 600000
    c.train.lr = 6e-4
    c.train.min_lr = 6e-5
    c.train.warmup_steps = 2000
    c.train.decay_steps = 600000
    c.train.weight_decay = 0.1
    c.train.beta1 = 0.9
    c.train.beta2 = 0.95
    c.train.grad_clip = 1.0
    c.train.eval_interval = 1000
    c.train.eval_steps = 200
    c.train.log_interval = 10
    c.train.checkpoint_interval = 1000
    c.train.keep_checkpoints = 3
    return c
