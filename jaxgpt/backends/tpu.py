"""The TPU backend: Pallas splash attention for causal self-attention (training and the no-cache forward;
document-masked windows too, through splash's segment ids);
XLA's masked attention over the cache. Everything else is the portable core, which is what XLA:TPU wants.
Off a TPU the kernel runs in Pallas' interpreter (`interpret=True`), so tests and forkers can check it.
"""

from __future__ import annotations

import functools

from jaxgpt.backends.base import Backend, self_attention_kernel


def _splash(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, *, interpret: bool, segment_ids_BxT=None):
    from jaxgpt.backends.tpu_attention import splash_attention  # (imports Pallas' TPU ops)

    return splash_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, interpret=interpret, segment_ids=segment_ids_BxT)


@functools.lru_cache(maxsize=None)
def make_backend(interpret: bool) -> Backend:
    attend = self_attention_kernel(functools.partial(_splash, interpret=interpret))
    # (a Mosaic call cannot be partitioned by XLA: under jit over a mesh it runs per batch shard)
    return Backend(name="tpu", attention_kernels=(("dot_product", attend),), per_shard_attention=True)
