"""The CPU baby run of shakespeare_char_cpu.py with a Llama-style block: rotary positions, RMSNorm, SwiGLU,
no biases, an untied head and grouped-query attention (2 key/value heads for 4 query heads)."""

from configs.shakespeare_char_cpu import get_config as gpt2_config


def get_config():
    c = gpt2_config()
    c.out_dir = "out-llama-char"
    c.model.position = "rope"
    c.model.norm = "rmsnorm"
    c.model.mlp = "swiglu"
    c.model.bias = False
    c.model.tie_embeddings = False
    c.model.n_kv_head = 2
    return c
