"""Fine-tune GPT-2 on Shakespeare with GPT-2's BPE (nanoGPT's finetune_shakespeare recipe).

init_from may be a GPT-2 name (downloads through huggingface_hub) or a local Hugging Face GPT-2 folder.
The gpt2 tokenizer needs GPT-2's vocab.bpe and encoder.json offline (see docs/data.md).
"""

from jaxgpt.training.config import default_config


def get_config():
    c = default_config()
    c.out_dir = "out-finetune-shakespeare"
    c.init_from = "gpt2"
    c.data.corpus = "shakespeare"
    c.data.tokenizer = "gpt2"
    c.model.block_size = 1024  # the model's shape (n_layer, n_head, n_embd, ...) comes from init_from
    c.model.dropout = 0.1
    c.train.batch_size = 32
    c.train.grad_accum = 32
    c.train.max_steps = 20
    c.train.lr = 3e-5
    c.train.min_lr = 3e-5
    c.train.warmup_steps = 0
    c.train.weight_decay = 0.1
    c.train.eval_interval = 5
    c.train.eval_steps = 20
    c.train.log_interval = 1
    c.train.checkpoint_interval = 5
    return c
