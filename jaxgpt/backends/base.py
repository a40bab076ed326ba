"""The backend interface: what the model, cache and sampler need from the hardware they run on.

The core (model.py, cache.py, sampling.py, attention.py) is written against one `Backend` value and
never names an implementation; `jaxgpt.backends.resolve` picks the value once per model, step or decoder.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import struct, traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxgpt.attention import AttentionFn, check_shapes, dot_product_attention, get_attention
from jaxgpt.cache import CacheLayout
from jaxgpt.ops import linear as portable_linear
from jaxgpt.quantize import decode_kernels, quantize_int8, weights_int8
from jaxgpt.registry import ATTENTION


def _no_prepared(params, batch_size: int, compute_dtype, tie_embeddings: bool, quantize=None, *,
                 config=None) -> dict:
    """No decode forms of its own: {} for float kernels; with quantize="int8" (or "w8a8"), `Int8Kernel`s that
    `ops.linear` multiplies with XLA (int8 operands, float32 products scaled per output)."""
    return int8_prepared(params, tie_embeddings, config=config, quantize=quantize) if weights_int8(quantize) else {}


def int8_prepared(params, tie_embeddings: bool, kernel_form=None, *, config=None, quantize="int8") -> dict:
    """A "prepared" collection of every dense kernel (and a tied head as `head`) quantized to int8 (with
    quantize="w8a8" marked to round its activations to int8 too), each passed through
    `kernel_form(int8_kernel, w_out_in)` (default: kept as the `Int8Kernel`); which leaves, the parameter
    schema says (quantize.decode_kernels)."""
    form = kernel_form or (lambda k, w_out_in: k)
    activations = "int8" if quantize == "w8a8" else None
    flat = traverse_util.flatten_dict(params)
    prepared = {}
    for path, (where, w_out_in) in decode_kernels(params, tie_embeddings, config).items():
        prepared[where] = form(quantize_int8(flat[path], w_out_in=w_out_in, activations=activations), w_out_in)
    return traverse_util.unflatten_dict(prepared)


TENSOR = "tensor"  # the mesh axis that splits attention's heads (jaxgpt/sharding.py's rules table)


def _nothing() -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Backend:
    """A backend's answers to the model's questions, all of them pure functions or plain values.

    - `linear(x, w, compute_dtype, *, b=None, w_out_in=False, out_dtype=None)`: the dense matmul
      (`ops.linear`'s contract); `w` may also be a kernel that `prepare_decode` made.
    - `attention_kernels`: (registered name, function) pairs this backend computes its own way, with the
      registry's signature; every other registered attention runs as written in attention.py.
    - `cache_layout`: how the KV cache stores and writes each layer (cache.CacheLayout).
    - `prepare_decode(params, batch_size, compute_dtype, tie_embeddings, quantize=None, *, config=None)
      -> dict`: kernels in a form for the decode steps, as a "prepared" variable collection laid out like
      the params ({}: none); with quantize="int8" every dense kernel and the tied head as int8, with "w8a8"
      their activations too (jaxgpt/quantize.py). Which leaves: those the parameter schema marks `decode` (`config`: the
      model's; else found by the params' names and shapes).
    - `float32_activations`: keep activations float32 between matmuls whatever the compute dtype.
    - `fast_bf16`: whether bfloat16 matmuls are faster than float32 here (a bf16 run says so if not).
    - `run_once_options`: XLA options for programs run once (parameter init), as (key, value) pairs.
    - `setup()`: process-wide preparation, called when a step or decoder is built.
    - `per_shard_attention`: its attention kernels are calls XLA cannot partition (Pallas TPU's Mosaic
      kernels): under jit over a mesh whose axes shard the batch (or split heads over tensor) they run per
      batch shard and per head group in shard_map.
    - `batch_mesh`: (mesh, batch axes) of the jit the programs run under, set by `on_mesh` (MeshRunner);
      None: no mesh, or one device.
    - `head_mesh`: (mesh, batch axes) when that mesh has a `tensor` axis of more than one device, set by
      `on_mesh`: attention's projections and activations are then split by heads over it (`shard_heads`).
    - `sequence_mesh`: (mesh, batch axes, sequence axes) when a training runner splits the residual stream
      along the sequence over `sequence axes` (sequence parallelism, the rules' `length`), set by `on_mesh`:
      `shard_sequence` and `gather_sequence` place the blocks' activations.
    - `cache_attention(q, cache, layer, q_positions, kv_lengths)`: its built-in "dot_product" attention
      over layer `layer` of a KV cache read as stored (float or int8, a `KVCache.view_first` included:
      its buffers hold more rows than q), or None where it does not take the cache; unset or None: the
      layer is read as [B, K, S, H] floats (`KVCache.layer`) and attended by the attention function.
    - `paged_attention(q_TxNxH, k_pool, v_pool, token_rows, positions, limits, block_tables, k_scale,
      v_scale)`: attention of a ragged step's queries over a paged cache's layer as stored (jaxgpt/paged.py
      says what each argument holds; a combined pool comes as k_pool with v_pool None), or None where it does
      not take it; unset or None: `paged.paged_attention`. A backend whose hook is a call XLA cannot
      partition (`per_shard_attention`) drops it on a mesh (`on_mesh`): the portable form runs there.
    - `paged_layout`: the page pool's layout this backend's `paged_attention` reads ("split": keys and values
      [P, K, page, H] each; "combined": one [P, page, 2K, H] buffer, jaxgpt/paged.py); an int8 pool is split,
      and a backend asking for "combined" gets "flat" pools ([P, page, K*H]) for heads not a multiple of 128
      wide (`paged.pool_layout`).
    """

    name: str
    linear: Callable = portable_linear
    attention_kernels: tuple = ()
    cache_layout: CacheLayout = CacheLayout()
    prepare_decode: Callable = _no_prepared
    float32_activations: bool = False
    fast_bf16: bool = True
    run_once_options: tuple = ()
    setup: Callable[[], None] = _nothing
    per_shard_attention: bool = False
    batch_mesh: Optional[tuple] = None
    head_mesh: Optional[tuple] = None
    sequence_mesh: Optional[tuple] = None
    cache_attention: Optional[Callable] = None
    paged_attention: Optional[Callable] = None
    paged_layout: str = "split"

    def attention(self, name: str) -> AttentionFn:
        """The function that computes the registered attention `name` on this backend. A backend's own
        kernel computes the built-in it is named after: once that name is replaced in the registry
        (`register_attention(name, replace=True)`), the replacement runs as written here too."""
        kernel = None if ATTENTION.replaced(name) else dict(self.attention_kernels).get(name)
        if kernel is None:
            return get_attention(name)
        if self.per_shard_attention and (self.batch_mesh or self.head_mesh) is not None:
            mesh, batch = self.batch_mesh or self.head_mesh
            return per_batch_shard(kernel, mesh, batch, heads=self.head_mesh is not None)
        return kernel

    def on_mesh(self, mesh, batch_axes: tuple, sequence_axes: tuple = ()) -> "Backend":
        """This backend for programs jitted over `mesh` with the batch sharded over `batch_axes`, and the
        residual stream along the sequence over `sequence_axes` (a training runner's, jaxgpt.sharding's
        `sequence_axes`; none for decoding)."""
        where = (mesh, tuple(batch_axes))
        changes = {}
        sequence_axes = tuple(a for a in sequence_axes if dict(mesh.shape).get(a, 1) > 1)
        if sequence_axes:
            changes["sequence_mesh"] = where + (sequence_axes,)
        if math.prod(mesh.shape[a] for a in batch_axes) > 1:
            changes["batch_mesh"] = where
        if dict(mesh.shape).get(TENSOR, 1) > 1:
            changes["head_mesh"] = where
        if changes and self.per_shard_attention and self.paged_attention is not None:
            changes["paged_attention"] = None  # (a Mosaic paged kernel is not run per shard: the portable form is)
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def tensor_size(self) -> int:
        """How many devices the `head_mesh`'s tensor axis has (1 without one)."""
        return 1 if self.head_mesh is None else self.head_mesh[0].shape[TENSOR]

    def whole(self, x: jax.Array) -> jax.Array:
        """`x` constrained to lie whole on every device of the `head_mesh` (`x` itself without one)."""
        if self.head_mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.head_mesh[0], P()))

    def shard_heads(self, x: jax.Array, axis: int, heads: int, rows: bool = True) -> jax.Array:
        """`x` constrained to lie split over the `head_mesh`'s tensor axis along `axis`, which holds
        `heads` heads (when the tensor size divides them: else whole on every tensor device, as GQA's kv
        heads are when there are fewer than tensor devices), and with `rows` its first axis over the batch
        axes; `x` itself without a head mesh."""
        if self.head_mesh is None:
            return x
        mesh, batch = self.head_mesh
        spec = [None] * x.ndim
        if heads % mesh.shape[TENSOR] == 0:
            spec[axis] = TENSOR
        if rows and batch and x.shape[0] % math.prod(mesh.shape[a] for a in batch) == 0:
            spec[0] = batch
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    def _sequence_spec(self, x: jax.Array, split: bool):
        """The NamedSharding of activations [B, T, ...] on the `sequence_mesh`: rows over its batch axes
        (when they divide them), T over its sequence axes with `split` (when they divide it); None without
        a sequence mesh or when T cannot be split."""
        mesh, batch, sequence = self.sequence_mesh
        if split and x.shape[1] % math.prod(mesh.shape[a] for a in sequence):
            return None
        rows = batch if batch and x.shape[0] % math.prod(mesh.shape[a] for a in batch) == 0 else None
        return NamedSharding(mesh, P(rows or None, (sequence if len(sequence) > 1 else sequence[0]) if split else None))

    def shard_sequence(self, x: jax.Array) -> jax.Array:
        """Activations [B, T, ...] split along T over the `sequence_mesh`'s sequence axes (sequence
        parallelism: a row-parallel matmul's partial sums are then reduce-scattered, not all-reduced); `x`
        itself without one, or when they do not divide T."""
        spec = None if self.sequence_mesh is None else self._sequence_spec(x, True)
        return x if spec is None else jax.lax.with_sharding_constraint(x, spec)

    def gather_sequence(self, x: jax.Array) -> jax.Array:
        """Activations [B, T, ...] whole along T on every device (all-gathered: a column-parallel matmul's
        input) where `shard_sequence` splits them; `x` itself otherwise."""
        if self.sequence_mesh is None or self._sequence_spec(x, True) is None:
            return x
        return jax.lax.with_sharding_constraint(x, self._sequence_spec(x, False))

    def activation_dtype(self, compute_dtype) -> jnp.dtype:
        """The dtype activations travel in between matmuls."""
        return jnp.dtype(jnp.float32) if self.float32_activations else jnp.dtype(compute_dtype)

    def compile_once_options(self) -> dict:
        return dict(self.run_once_options)


@struct.dataclass
class DecodeWeights:
    """What a decoder applies at each decode step: the params in the compute dtype and the backend's
    prepared forms of some of them (the "prepared" collection; empty when the backend has none)."""

    params: Any
    prepared: Any

    def variables(self) -> dict:
        return {"params": self.params, **({"prepared": self.prepared} if self.prepared else {})}

    def prefill_variables(self) -> dict:
        """What a prompt's forward applies: the params, or every variable when the prepared forms round
        their rows to int8 (quantize="w8a8": each matmul's rows are rounded, a prompt's as a decode step's)."""
        return self.variables() if rounds_rows(self.prepared) else {"params": self.params}


def rounds_rows(prepared: Any) -> bool:
    """Whether some kernel in a "prepared" collection rounds the rows it multiplies to int8 (w8a8's
    `Int8Kernel`s, or a backend's forms of them marked form="w8a8")."""
    def w8a8(x):
        return getattr(x, "activations", None) == "int8" or getattr(x, "form", None) == "w8a8"
    return any(w8a8(x) for x in jax.tree.leaves(prepared, is_leaf=lambda x: hasattr(x, "form") or
                                               hasattr(x, "activations")))


def cast_floats(tree: Any, dtype) -> Any:
    """Every floating leaf of `tree` in `dtype` (once per call, not per step)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def decode_weights(backend: Backend, params: Any, batch_size: int, compute_dtype,
                   tie_embeddings: bool, config=None) -> DecodeWeights:
    """The params cast to the compute dtype plus `backend.prepare_decode`'s forms for `batch_size` rows
    (`config`: the model's GPTConfig, for its parameter schema)."""
    params = cast_floats(params, compute_dtype)
    return DecodeWeights(params, backend.prepare_decode(params, batch_size, compute_dtype, tie_embeddings,
                                                        config=config))


def per_batch_shard(attend: AttentionFn, mesh, batch_axes: tuple, heads: bool = False) -> AttentionFn:
    """`attend` (the registry's signature; every argument batch-first, rows independent) run in shard_map
    over `batch_axes` of `mesh`, each device on its rows, heads whole; with `heads` also over the mesh's
    tensor axis, each device on its own heads (where the tensor size divides the kv heads). A batch the
    axes do not divide runs whole on every device (right, only slower)."""
    n = math.prod(mesh.shape[a] for a in batch_axes)

    def sharded(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT=None, kv_lengths_B=None, *, segment_ids_BxT=None):
        args = (q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT, kv_lengths_B, segment_ids_BxT)
        given = tuple(i for i, a in enumerate(args) if a is not None)
        row = batch_axes if batch_axes and q_BxTxNxH.shape[0] % n == 0 else None
        split = heads and k_BxKxSxH.shape[1] % mesh.shape[TENSOR] == 0
        head = TENSOR if split else None
        specs = (P(row, None, head), P(row, head), P(row, head), P(row), P(row), P(row))

        def per_shard(*arrays):
            full = [None] * len(args)
            for i, a in zip(given, arrays):
                full[i] = a
            *positional, segments = full
            return attend(*positional) if segments is None else attend(*positional, segment_ids_BxT=segments)

        # (check_vma=False: Pallas calls carry no varying-manual-axes rule; every output is per row)
        return jax.shard_map(per_shard, mesh=mesh, in_specs=tuple(specs[i] for i in given), out_specs=specs[0],
                             check_vma=False)(*(args[i] for i in given))
    return sharded


def self_attention_kernel(kernel: Callable) -> AttentionFn:
    """The registry's "dot_product" attention with causal self-attention computed by `kernel(q_BxTxNxH,
    k_BxTxKxH, v_BxTxKxH, segment_ids_BxT=None)` (a flash kernel; document-masked with segment ids), and
    XLA's masked attention over a cache (one query row per decode step gains nothing from a flash kernel)."""
    def attend(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT=None, kv_lengths_B=None, *, segment_ids_BxT=None):
        if q_positions_BxT is not None or kv_lengths_B is not None:
            return dot_product_attention(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, q_positions_BxT, kv_lengths_B,
                                         segment_ids_BxT=segment_ids_BxT)
        check_shapes(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH)
        return kernel(q_BxTxNxH, k_BxKxSxH.swapaxes(1, 2), v_BxKxSxH.swapaxes(1, 2), segment_ids_BxT=segment_ids_BxT)
    return attend


PORTABLE = Backend(name="portable")


