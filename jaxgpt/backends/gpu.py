"""The NVIDIA GPU backend: the Pallas GPU flash-attention kernel for causal self-attention; XLA's masked
attention over the cache. Everything else is the portable core.

Pallas rather than cuDNN by default: it compiles for any dtype and, ahead of time, without the cuDNN
libraries (`jaxgpt-aot`); `GPTConfig(attention="cudnn")` asks for cuDNN's fused kernel instead. Off a GPU
the kernel runs in Pallas' interpreter (`interpret=True`).
"""

from __future__ import annotations

import functools

from jaxgpt.attention import check_shapes, dot_product_attention
from jaxgpt.backends.base import Backend


def flash_dot_product_attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT=None, kv_lengths_B=None, *,
                                interpret: bool = False):
    """The registry's "dot_product" attention on a GPU: Pallas flash for self-attention, XLA over a cache."""
    if q_positions_BxT is not None or kv_lengths_B is not None:
        return dot_product_attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT, kv_lengths_B)
    from jaxgpt.backends.gpu_attention import pallas_attention  # (imports Pallas' GPU ops)

    check_shapes(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH)
    return pallas_attention(q_BxTxNxH, k_BxKxSxH.swapaxes(1, 2), v_BxKxSxH.swapaxes(1, 2), interpret=interpret)


@functools.lru_cache(maxsize=None)
def make_backend(interpret: bool) -> Backend:
    attend = functools.partial(flash_dot_product_attention, interpret=interpret)
    return Backend(name="gpu", attention_kernels=(("dot_product", attend),))
