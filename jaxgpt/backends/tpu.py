"""The TPU backend: Pallas splash attention for causal self-attention (training and the no-cache forward);
XLA's masked attention for prefill and decode over the cache (one query row per step gains nothing from
a flash kernel). Everything else is the portable core, which is what XLA:TPU wants.

Off a TPU the kernel runs in Pallas' interpreter (`interpret=True`), so tests and forkers can check it.
"""

from __future__ import annotations

import functools

from jaxgpt.attention import check_shapes, dot_product_attention
from jaxgpt.backends.base import Backend


def splash_dot_product_attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT=None, kv_lengths_B=None, *,
                                 interpret: bool = False):
    """The registry's "dot_product" attention on a TPU: splash for self-attention, XLA over a cache."""
    if q_positions_BxT is not None or kv_lengths_B is not None:
        return dot_product_attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT, kv_lengths_B)
    from jaxgpt.backends.tpu_attention import splash_attention  # (imports Pallas' TPU ops)

    check_shapes(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH)
    return splash_attention(q_BxTxNxH, k_BxKxSxH.swapaxes(1, 2), v_BxKxSxH.swapaxes(1, 2), interpret=interpret)


@functools.lru_cache(maxsize=None)
def make_backend(interpret: bool) -> Backend:
    attend = functools.partial(splash_dot_product_attention, interpret=interpret)
    return Backend(name="tpu", attention_kernels=(("dot_product", attend),))
