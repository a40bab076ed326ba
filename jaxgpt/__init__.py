"""jaxgpt: a functional JAX/Flax GPT."""

from jaxgpt.attention import attention, causal_mask, register_attention
from jaxgpt.cache import KVCache, cache_bytes
from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT, convert_layers, count_params, init_params
from jaxgpt.pretrained import from_pretrained, save_pretrained
from jaxgpt.sampling import GenerateOutput, generate, generate_stream, sample_logits, top_k_filter, top_p_filter

__version__ = "0.1.0"

__all__ = [
    "GPT", "GPTConfig", "GenerateOutput", "KVCache", "attention", "cache_bytes", "causal_mask", "convert_layers",
    "count_params", "from_pretrained", "generate", "generate_stream", "init_params", "register_attention",
    "sample_logits", "save_pretrained", "top_k_filter", "top_p_filter",
]
