"""The speedrun recipe at GPT-2 small's size (124M-class), for accelerators: the CPU speedrun's pieces
(configs/speedrun_char_cpu.py) on an OpenWebText/FineWeb-style corpus with GPT-2's tokenizer.

Needs `pip install 'jaxgpt[hf]'`, network for the first prepare, and accelerators; check it first with
`jaxgpt-aot --config=configs/speedrun_gpt2.py --target=gpu:h100:8` (or `--target=tpu:v5e:2x4`), which needs
neither (bench/README.md, "The speedrun recipe at 124M, compiled"). The shape of the NanoGPT speedrun's
records: 12 layers of 768 in 6 heads of 128, rotary, RMSNorm without biases, QK-norm, ReLU^2, zero-initialised
projections, a soft-capped untied head, value embeddings, embedding skips, Muon for the blocks' matrices,
warmup-stable-decay; about 0.5M tokens a step (512 x 1024) for 1,500 steps (0.8B tokens, against
GPT-2's 600k-step recipe in configs/gpt2_124m.py). The loss runs over chunks of 256 positions (the
50257-wide logits would otherwise take ~1.5 GiB a sequence).
"""

from jaxgpt.training.config import default_config


def get_config():
    c = default_config()
    c.out_dir = "out-speedrun-gpt2"
    c.data.corpus = "hf"
    c.data.path = "openwebtext"  # or a FineWeb sample: --config.data.path=HuggingFaceFW/fineweb-edu
    c.data.tokenizer = "gpt2"
    c.data.val_fraction = 0.0005
    c.model.block_size = 1024
    c.model.n_layer = 12
    c.model.n_head = 6
    c.model.n_embd = 768
    c.model.dtype = "bfloat16"
    c.model.position = "rope"
    c.model.norm = "rmsnorm"
    c.model.bias = False
    c.model.tie_embeddings = False
    c.model.mlp = "relu2"
    c.model.qk_norm = True
    c.model.zero_init_proj = True
    c.model.embed_skip = True
    c.model.value_embeds = 2
    c.model.logit_softcap = 30.0
    c.train.batch_size = 512
    c.train.grad_accum = 8       # 8 rows of 1024 per device per micro-batch on 8 devices
    c.train.loss_chunk = 256
    c.train.optimizer = "muon"
    c.train.muon_lr = 0.05
    c.train.muon_momentum = 0.95
    c.train.muon_ns_dtype = "bfloat16"  # accelerators multiply bf16 several times faster than float32
    c.train.lr = 6e-3
    c.train.min_lr = 0.0
    c.train.schedule = "wsd"
    c.train.decay_fraction = 0.4
    c.train.weight_decay = 0.0
    c.train.beta2 = 0.95
    c.train.warmup_steps = 50
    c.train.max_steps = 1500
    c.train.decay_steps = 1500
    c.train.eval_interval = 250
    c.train.eval_steps = 20
    c.train.log_interval = 10
    c.train.steps_per_call = 1
    c.train.checkpoint_interval = 500
    c.train.progress = True
    return c
