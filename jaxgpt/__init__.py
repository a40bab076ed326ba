"""jaxgpt: a functional JAX/Flax GPT."""

from jaxgpt.attention import attention, causal_mask
from jaxgpt.cache import KVCache, cache_bytes
from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT, count_params, init_params
from jaxgpt.sampling import GenerateOutput, generate, sample_logits, top_k_filter, top_p_filter

__version__ = "0.1.0"

__all__ = [
    "GPT", "GPTConfig", "GenerateOutput", "KVCache", "attention", "cache_bytes", "causal_mask",
    "count_params", "generate", "init_params", "sample_logits", "top_k_filter", "top_p_filter",
]
