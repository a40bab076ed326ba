"""int8 weights for decoding: a decode-time transform of float params (no retraining, any checkpoint).

Every dense kernel and the output head become int8 with one float32 scale per output channel (symmetric:
scale = max |w| over the channel's inputs / 127, q = round(w / scale)). `dequantized(params, config)` is
the float model those int8 weights stand for (q * scale in the params' dtype): it is what prefill runs,
and what the int8 decode steps equal to float rounding. The backends multiply the int8 kernels their own
way (`Backend.prepare_decode(..., quantize="int8")`): the CPU backend's native kernel widens them to
float32 in registers (jaxgpt/backends/rows.cc); elsewhere `linear` multiplies `Int8Kernel`s with XLA,
which reads the int8 bytes and scales the float32 products.

Per channel rather than per block of 32 inputs (llama.cpp's q8_0): one scale per output is applied once
to the accumulated sum, and the accuracy measured on trained models (bench/README.md, "int8 weights")
is inside the 0.5% validation-loss budget.

quantize="w8a8" keeps the same int8 weights and rounds each row multiplied by them to int8 as well
(`quantize_rows`: one scale per row), the products summed in int32: four multiply-adds per lane and
instruction with AVX512-VNNI, where int8 weights with float32 rows are bound by float multiply-adds from
about 8 rows (bench/README.md, "int8 rows too"). A prompt's rows are rounded as a decode step's are (one
row per token), so prefill and decoding are one model: the int8 kernels' full forward.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct, traverse_util

from jaxgpt.config import GPTConfig
from jaxgpt.schema import HEAD, leaf_infos

QUANTIZE_CHOICES = (None, "int8", "w8a8")
KV_DTYPES = (None, "int8", "bfloat16", "float32")


def _choice(name: str, value, choices: tuple) -> Optional[str]:
    """`value` if it is one of `choices` ("none" and "" read as None), else ValueError naming `name`."""
    if value in ("none", ""):
        return None
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_quantize(quantize) -> Optional[str]:
    """`quantize` checked against QUANTIZE_CHOICES."""
    return _choice("quantize", quantize, QUANTIZE_CHOICES)


def check_kv_dtype(kv_dtype) -> Optional[str]:
    """`kv_dtype` checked against KV_DTYPES (None: the compute dtype)."""
    return _choice("kv_dtype", kv_dtype, KV_DTYPES)


def weights_int8(quantize: Optional[str]) -> bool:
    """Whether `quantize` (a checked QUANTIZE_CHOICES value) decodes with int8 weights."""
    return quantize in ("int8", "w8a8")


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., n] -> (int8 q [..., n], float32 scale [..., 1]), one symmetric scale per row: scale = max |x|
    over the row / 127 (1 for a row of zeros; NaN for a row with a NaN, so that its products stay NaN, as
    the model's overflowing rows must), q = round(x / scale) (halves to even). w8a8's activations."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    # (XLA:CPU's vectorized max can drop a NaN: a row's NaN is found explicitly)
    amax = jnp.where(jnp.isnan(x32).any(axis=-1, keepdims=True), jnp.nan, amax)
    scale = jnp.where(amax == 0, 1.0, amax / 127.0)
    return jnp.clip(jnp.round(x32 / scale), -127, 127).astype(jnp.int8), scale


@struct.dataclass
class Int8Kernel:
    """A dense kernel as int8 `q` ([..., in, out], or [..., out, in] for a head's table) and a float32
    `scale` per output ([..., out]): w = q * scale. `activations="int8"` (quantize="w8a8"): the rows
    multiplied by it are rounded to int8 first (`quantize_rows`) and the product is taken in integers."""

    q: jax.Array
    scale: jax.Array
    activations: Optional[str] = struct.field(pytree_node=False, default=None)

    def dequantize(self, w_out_in: bool = False, dtype=jnp.float32) -> jax.Array:
        s = self.scale[..., :, None] if w_out_in else self.scale[..., None, :]
        return (self.q.astype(jnp.float32) * s).astype(dtype)


def quantize_int8(w: jax.Array, w_out_in: bool = False, activations: Optional[str] = None) -> Int8Kernel:
    """w [..., in, out] (or [..., out, in] with `w_out_in`) -> its `Int8Kernel`, one scale per output
    (`activations`: the kernel's, "int8" for w8a8)."""
    axis = -1 if w_out_in else -2  # the inputs: each output's scale is the max over them
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=axis)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    s = jnp.expand_dims(scale, axis)
    q = jnp.clip(jnp.round(w32 / s), -127, 127).astype(jnp.int8)
    return Int8Kernel(q, scale, activations)


def decode_kernels(params: dict, tie_embeddings: bool, config: Optional[GPTConfig] = None) -> dict:
    """{params path: (path in the "prepared" collection, w_out_in)} of the leaves that decoding keeps in
    a decode form (packed, or int8): those their layers declare `decode` (schema.ParamInfo): every dense
    kernel ([in, out], stacked [L, in, out] for scan_layers) at its own path, and with `tie_embeddings`
    the tied head's table ([vocab, embd]) at schema.HEAD. `config`: the model's (else the schema is
    found by the params' names and shapes, schema.leaf_infos)."""
    out = {}
    for path, info in leaf_infos(params, config).items():
        if info.decode and not info.w_out_in:
            out[path] = (path, False)
        elif info.decode and tie_embeddings:
            out[path] = (HEAD, True)
    return out


def quantized_paths(params: dict, config: GPTConfig) -> dict:
    """{path: w_out_in} of the leaves int8 decoding replaces (`decode_kernels`): every dense kernel
    and the tied head's table."""
    return {path: w_out_in for path, (_, w_out_in) in decode_kernels(params, config.tie_embeddings, config).items()}


def dequantized(params: dict, config: GPTConfig) -> dict:
    """The float model int8 decoding computes: each leaf of `quantized_paths` replaced by its int8
    rounding (q * scale, in the leaf's dtype); every other leaf as it was. Quantizing the result again
    gives the same int8 values (scales to within an ulp)."""
    paths = quantized_paths(params, config)
    flat = traverse_util.flatten_dict(params)
    for path, w_out_in in paths.items():
        leaf = flat[path]
        flat[path] = quantize_int8(leaf, w_out_in).dequantize(w_out_in, leaf.dtype)
    return traverse_util.unflatten_dict(flat)


def int8_bytes(params: dict, config: GPTConfig) -> dict:
    """{"int8": bytes of the int8 kernels and scales, "float": bytes of those leaves as stored}."""
    flat = traverse_util.flatten_dict(params)
    n_int8 = n_float = 0
    for path, w_out_in in quantized_paths(params, config).items():
        leaf = flat[path]
        n_float += leaf.size * leaf.dtype.itemsize
        n_int8 += leaf.size + 4 * (leaf.size // leaf.shape[-1 if w_out_in else -2])
    return {"int8": n_int8, "float": n_float}
