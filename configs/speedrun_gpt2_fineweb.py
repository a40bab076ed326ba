"""The speedrun recipe (configs/speedrun_gpt2.py, unchanged model and optimizer) on FineWeb-10B in llm.c's token
shards, aimed at modded-nanogpt's target: a validation loss of 3.28 over 10,485,760 validation tokens, with
HellaSwag scored in the loop.

The validation figure: train.eval_steps x train.batch_size x model.block_size = 20 x 512 x 1024 = 10,485,760
tokens, the count modded-nanogpt evaluates. modded-nanogpt reads the first 10,485,760 tokens of
fineweb_val_000000.bin in order; jaxgpt's evaluation reads as many tokens in fixed windows drawn at random
(seeded, the same at every eval) from the validation shards, so the two losses estimate the same quantity
over different windows, not the same tokens. train.target_val_loss stops the run (and saves it) at the first
eval at or below 3.28.

Paths and checks as in configs/gpt2_124m_fineweb.py (--config.data.path=..., --config.train.eval_tasks=...,
`jaxgpt-aot ... --vocab_size=50257 --config.train.eval_tasks=''`).
"""

import importlib.util
import os


def _speedrun_recipe():
    """configs/speedrun_gpt2.py's get_config: the recipe kept in one file."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "speedrun_gpt2.py")
    spec = importlib.util.spec_from_file_location("jaxgpt_config_speedrun_gpt2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def get_config():
    c = _speedrun_recipe()
    c.out_dir = "out-speedrun-gpt2-fineweb"
    c.data.corpus = "shards"
    c.data.path = "fineweb10B/fineweb_*.bin"
    c.data.tokenizer = "auto"
    c.train.eval_interval = 125  # modded-nanogpt's val_loss_every
    c.train.eval_steps = 20      # 20 x 512 x 1024 = 10,485,760 validation tokens
    c.train.target_val_loss = 3.28
    c.train.eval_tasks = "hellaswag_val.jsonl"
    c.train.eval_tasks_interval = 250  # HellaSwag's 10,042 items at every second eval
    return c
