"""The TPU backend: Pallas splash attention for causal self-attention (training and the no-cache forward;
document-masked windows too, through splash's segment ids);
XLA's masked attention over the cache; JAX's Pallas ragged paged attention kernel over the paged engine's
page pool, which it wants in the "combined" layout (keys and values in one buffer, as the kernel reads them).
Everything else is the portable core, which is what XLA:TPU wants.
Off a TPU splash runs in Pallas' interpreter (`interpret=True`), so tests and forkers can check it; the
paged kernel's DMAs and semaphores do not run there, so off a TPU the portable paged attention reads the
combined pool instead (its results the tests compare with the kernel's own reference).
"""

from __future__ import annotations

import functools

from jaxgpt.backends.base import Backend, self_attention_kernel


def _splash(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, *, interpret: bool, segment_ids_BxT=None):
    from jaxgpt.backends.tpu_attention import splash_attention  # (imports Pallas' TPU ops)

    return splash_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, interpret=interpret, segment_ids=segment_ids_BxT)


def _paged(q_TxNxH, k_pool, v_pool, token_rows, positions, limits, block_tables, k_scale=None, v_scale=None):
    """`Backend.paged_attention` on a TPU: the Pallas kernel for a combined float pool; None (the portable
    form) for a split or int8 pool or heads the kernel does not tile."""
    from jaxgpt.backends.tpu_attention import ragged_paged_attention, ragged_paged_supported

    if v_pool is not None or k_scale is not None or not ragged_paged_supported(q_TxNxH.shape, k_pool.shape,
                                                                                k_pool.dtype):
        return None
    return ragged_paged_attention(q_TxNxH, k_pool, token_rows, limits, block_tables)


@functools.lru_cache(maxsize=None)
def make_backend(interpret: bool) -> Backend:
    attend = self_attention_kernel(functools.partial(_splash, interpret=interpret))
    # (a Mosaic call cannot be partitioned by XLA: under jit over a mesh it runs per batch shard; the paged
    # kernel is dropped there, `Backend.on_mesh`)
    return Backend(name="tpu", attention_kernels=(("dot_product", attend),), per_shard_attention=True,
                   paged_attention=None if interpret else _paged, paged_layout="combined")
