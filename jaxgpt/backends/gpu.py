"""The NVIDIA GPU backend: the Pallas GPU flash-attention kernel for causal self-attention (document-masked
windows too, through its segment ids); XLA's masked
attention over the cache. Everything else is the portable core.

Pallas rather than cuDNN by default: it compiles for any dtype and, ahead of time, without the cuDNN
libraries (`jaxgpt-aot`); `GPTConfig(attention="cudnn")` asks for cuDNN's fused kernel instead. Off a GPU
the kernel runs in Pallas' interpreter (`interpret=True`).
"""

from __future__ import annotations

import functools

from jaxgpt.backends.base import Backend, self_attention_kernel


def _flash(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, *, interpret: bool, segment_ids_BxT=None):
    from jaxgpt.backends.gpu_attention import pallas_attention  # (imports Pallas' GPU ops)

    return pallas_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, interpret=interpret, segment_ids=segment_ids_BxT)


@functools.lru_cache(maxsize=None)
def make_backend(interpret: bool) -> Backend:
    attend = self_attention_kernel(functools.partial(_flash, interpret=interpret))
    return Backend(name="gpu", attention_kernels=(("dot_product", attend),))
