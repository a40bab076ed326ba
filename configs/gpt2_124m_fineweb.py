"""GPT-2 small (124M) on FineWeb-10B in llm.c's token shards, with llm.c's hyperparameters and HellaSwag scored
in the loop: the run docs/reproduce-gpt2.md walks through.

llm.c's 124M run (its scripts/run_gpt2_124M.sh): 8 GPUs x 64 rows x 1024 positions = 524,288 tokens a step,
18,865 steps (one pass over the ~9.9B tokens of the FineWeb-10B training shards), AdamW at 6e-4 with betas
(0.9, 0.95), weight decay 0.1, gradients clipped at 1.0, 700 warmup steps then a cosine to 0, bf16; the
validation loss every 250 steps over 20 batches (10,485,760 tokens) and HellaSwag every 250 steps. It reaches
a validation loss of about 3.28 and HellaSwag acc_norm about 0.299 (llm.c's scoring), against 0.2955 for
OpenAI's GPT-2 124M.

Needs the shards (`jaxgpt-prepare --shards`, or llm.c's own `fineweb10B/` folder) and HellaSwag's validation
items as JSON Lines (rowanz/hellaswag's data/hellaswag_val.jsonl) in the working folder, or:
  --config.data.path='/data/fineweb10B/fineweb_*.bin' --config.train.eval_tasks=/data/hellaswag_val.jsonl
  --config.train.eval_tasks=''   (no task in the loop)
A run refuses to start while the task file is missing (before anything compiles). On fewer devices keep the
step's 512 rows and raise train.grad_accum (the update is the same); check memory first with
`jaxgpt-aot --config=configs/gpt2_124m_fineweb.py --target=gpu:h100:8 --vocab_size=50257
--config.train.eval_tasks=''` (bench/README.md).
"""

from jaxgpt.training.config import default_config


def get_config():
    c = default_config()
    c.out_dir = "out-gpt2-124m-fineweb"
    c.data.corpus = "shards"
    c.data.path = "fineweb10B/fineweb_*.bin"  # names with _val_ are the validation split
    c.data.tokenizer = "auto"  # version-1 shards: GPT-2's 50257 (or the shards.json jaxgpt-prepare writes)
    c.model.block_size = 1024
    c.model.n_layer = 12
    c.model.n_head = 12
    c.model.n_embd = 768
    c.model.dropout = 0.0
    c.model.bias = True
    c.model.dtype = "bfloat16"
    c.train.batch_size = 512     # x 1024 = 524,288 tokens a step, llm.c's -d 524288
    c.train.grad_accum = 1       # 64 rows of 1024 per device on 8 devices, llm.c's -b 64 -t 1024
    c.train.loss_chunk = 256     # the [64, 1024, 50257] logits a chunk at a time, never whole
    c.train.max_steps = 18865    # llm.c's run: one epoch of the ~9.9B training tokens
    c.train.decay_steps = 18865
    c.train.warmup_steps = 700   # -u 700
    c.train.lr = 6e-4            # -l 0.0006
    c.train.min_lr = 0.0         # -q 0.0: the cosine ends at 0
    c.train.schedule = "cosine"
    c.train.weight_decay = 0.1   # -c 0.1
    c.train.beta1 = 0.9
    c.train.beta2 = 0.95
    c.train.grad_clip = 1.0
    c.train.eval_interval = 250  # -v 250
    c.train.eval_steps = 20      # 20 x 512 x 1024 = 10,485,760 validation tokens, llm.c's 20 val batches
    c.train.eval_tasks = "hellaswag_val.jsonl"  # -h 1: all 10,042 items at every eval
    c.train.log_interval = 10
    c.train.checkpoint_interval = 1000
    c.train.keep_checkpoints = 2
    return c
