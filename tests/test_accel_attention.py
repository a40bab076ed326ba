"""The accelerator attention kernels (backends/tpu_attention.py, backends/gpu_attention.py) against the einsum
reference: values and gradients, causal and grouped-query, T not a multiple of the kernels' blocks, float32
and bf16, their Pallas programs run in interpret mode on the CPU. And the splash kernel compiled for a
TPU topology becomes a Mosaic custom call (needs libtpu: the aot extra)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.attention import einsum_attention
from jaxgpt.backends import gpu_attention, tpu_attention


def reference(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH):
    """The einsum reference, which reads k and v head-major ([B, K, S, H], the cache's layout)."""
    return einsum_attention(q_BxTxNxH, k_BxTxKxH.swapaxes(1, 2), v_BxTxKxH.swapaxes(1, 2))

# (B, T, N, K, H, dtype): GQA at a T that no block divides (padded), plain causal MHA in bf16 at one block
CASES = [(1, 200, 4, 2, 16, jnp.float32), (2, 128, 2, 2, 32, jnp.bfloat16)]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 6e-2}  # bf16: the kernels round p (and its gradient) to bf16 per block


def _inputs(b, t, n, k, h, dtype):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    kv = [jax.random.normal(key, (b, t, k, h), dtype) for key in keys[1:3]]
    weights = jax.random.normal(keys[3], (b, t, n, h), jnp.float32)  # a loss that weighs every output
    return (q, *kv), weights


def _check_against_reference(fn, case):
    *shape, dtype = case
    args, weights = _inputs(*shape, dtype)

    def value_and_grads(attn):  # one jitted program each: interpret mode op by op would take far longer
        def run(q, k, v):
            out, vjp = jax.vjp(attn, q, k, v)
            return out, vjp(weights.astype(out.dtype))
        return jax.jit(run)(*args)

    (out, grads), (ref, want) = value_and_grads(fn), value_and_grads(reference)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)
    for name, g, w in zip("qkv", grads, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=2 * tol, rtol=2 * tol,
                                   err_msg=f"d{name}")


@pytest.mark.parametrize("case", CASES, ids=["gqa-f32-padded", "mha-bf16"])
def test_splash_attention_matches_the_reference(case):
    _check_against_reference(functools.partial(tpu_attention.splash_attention, interpret=True), case)


@pytest.mark.parametrize("case", CASES, ids=["gqa-f32-padded", "mha-bf16"])
def test_pallas_gpu_attention_matches_the_reference(case):
    _check_against_reference(functools.partial(gpu_attention.pallas_attention, interpret=True), case)


def test_cudnn_option_computes_the_same_function():
    # cuDNN itself needs a GPU; its interpret stand-in is XLA's, through the same jax.nn call
    _check_against_reference(functools.partial(gpu_attention.gpu_attention, implementation="cudnn", interpret=True),
                             CASES[0])
    with pytest.raises(ValueError, match="'pallas' or 'cudnn'"):
        gpu_attention.gpu_attention(*_inputs(1, 16, 2, 2, 16, jnp.float32)[0], implementation="flash")


def test_block_choice_and_padding():
    assert [tpu_attention.padded_length(t) for t in (1, 128, 129, 1024)] == [128, 128, 256, 1024]
    assert [tpu_attention.block_size(t) for t in (128, 256, 384, 1024, 2048)] == [128, 256, 128, 512, 512]
    assert [gpu_attention.padded_length(t) for t in (1, 16, 17, 1000)] == [16, 16, 32, 1008]
    with pytest.raises(ValueError, match="K dividing N"):
        tpu_attention.splash_attention(jnp.zeros((1, 8, 3, 16)), jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 2, 16)))


def test_splash_lowers_to_a_tpu_custom_call_inside_shard_map():
    pytest.importorskip("libtpu", reason="libtpu is not installed (pip install -e '.[aot]')")
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxgpt import aot
    aot.prepare_environment()
    topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu", chip_config_name="default",
                                        chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=(False,) * 3)
    mesh = topologies.make_mesh(topo, (4,), ("data",))
    rows = P("data")
    # a Pallas call is not partitioned by XLA: each device runs it on its rows, inside shard_map
    attn = jax.shard_map(tpu_attention.splash_attention, mesh=mesh, in_specs=(rows,) * 3, out_specs=rows,
                         check_vma=False)
    sharding = NamedSharding(mesh, rows)
    q = jax.ShapeDtypeStruct((4, 200, 4, 64), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((4, 200, 2, 64), jnp.bfloat16, sharding=sharding)
    grads = jax.jit(jax.grad(lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    text = grads.lower(q, kv, kv).as_text()
    assert text.count("tpu_custom_call") == 3  # the forward, dq and dkv kernels


@pytest.mark.parametrize("name", ["tpu", "gpu"])
def test_the_accelerator_backends_run_the_model_like_the_portable_one(name):
    # their kernels interpreted on this CPU: the model's logits and loss gradient through them, and
    # cached decode (XLA's attention on those backends), against the portable backend's
    from jaxgpt import GPT, GPTConfig, KVCache, init_params, resolve
    from jaxgpt.backends import PORTABLE
    from jaxgpt.training.step import cross_entropy

    cfg = GPTConfig(vocab_size=40, block_size=24, n_layer=1, n_head=4, n_kv_head=2, n_embd=64)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 20), 0, 40)
    backend = resolve(name)
    assert backend.name == name and dict(backend.attention_kernels)

    def loss_and_grads(be):
        fn = lambda p: cross_entropy(GPT(cfg, be).apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])  # noqa: E731
        return jax.jit(jax.value_and_grad(fn))(params)

    (loss, grads), (want, want_grads) = loss_and_grads(backend), loss_and_grads(PORTABLE)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, atol=1e-5)
    cache = KVCache.create(cfg, 2, 24, layout=backend.cache_layout)
    logits, _ = jax.jit(lambda p, c: GPT(cfg, backend).apply({"params": p}, tokens, c))(params, cache)
    np.testing.assert_allclose(logits, GPT(cfg, PORTABLE).apply({"params": params}, tokens), atol=1e-5)
