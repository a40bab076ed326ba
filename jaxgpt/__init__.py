"""jaxgpt: a functional JAX/Flax GPT."""

from jaxgpt.attention import attention, causal_mask, register_attention
from jaxgpt.backends import Backend, resolve
from jaxgpt.cache import KVCache, cache_bytes
from jaxgpt.config import GPTConfig
from jaxgpt.engine import Completion, Engine, Request
from jaxgpt.model import GPT, convert_layers, count_params, flops_per_token, init_params, num_params, register_block
from jaxgpt.pretrained import from_pretrained, save_pretrained
from jaxgpt.sampling import (Decoder, GenerateOutput, generate, generate_stream, sample_logits, top_k_filter,
                             top_p_filter)
from jaxgpt.schema import ParamInfo, param_schema
from jaxgpt.sharding import shard_params
from jaxgpt.speculative import Speculative

__version__ = "0.1.0"

__all__ = [
    "Backend", "Completion", "Decoder", "Engine", "GPT", "GPTConfig", "GenerateOutput", "KVCache", "attention", "cache_bytes", "causal_mask",
    "convert_layers", "count_params", "flops_per_token", "from_pretrained", "generate", "generate_stream",
    "init_params", "num_params", "ParamInfo", "param_schema", "register_attention", "register_block", "Request",
    "resolve", "sample_logits",
    "save_pretrained", "shard_params", "Speculative", "top_k_filter", "top_p_filter",
]
