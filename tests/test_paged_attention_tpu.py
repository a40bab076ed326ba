"""The combined page pool ([P, page, 2K, H], keys and values interleaved), the flat one ([P, page, K*H],
for heads narrower than a TPU's 128 lanes) and the TPU backend's paged
attention: JAX's Pallas ragged paged attention kernel. On CPU the kernel's own reference
(`ref_ragged_paged_attention`) is the oracle for the portable form over the combined layout and for the
arguments the TPU hook builds from a step; with the aot extra the kernel compiles into every paged-engine
program for a TPU target."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

import jaxgpt
from jaxgpt import aot
from jaxgpt.backends import PORTABLE
from jaxgpt.backends import tpu, tpu_attention
from jaxgpt.engine import runner
from jaxgpt.engine.paged import PagedEngine
from jaxgpt.engine.plan import Plan, Work
from jaxgpt.paged import PagedCache, paged_attention, pool_layout

CFG = jaxgpt.GPTConfig(vocab_size=97, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)


def _step(rng, num_pages=16, page_size=4, kv_heads=2, q_heads=4, head_dim=16, dtype=jnp.float32):
    """A combined pool and a step laid out as the engine lays it out: row 0 a prompt chunk (positions 3..8
    of 9), row 1 a decode (position 10), row 2 a decode at position 0, then padding tokens and a padding
    row. -> (q, kv_pages, rows, limits, tables, the kernel's kv_lens, cu_q_lens, num_seqs)."""
    kv = jnp.asarray(rng.normal(size=(num_pages, page_size, 2 * kv_heads, head_dim)), dtype)
    tables = np.array([[3, 1, 7, 0], [5, 2, 9, 0], [6, 0, 0, 0], [0, 0, 0, 0]], np.int32)
    rows = np.array([0] * 6 + [1, 2] + [0] * 4, np.int32)
    limits = np.array(list(range(4, 10)) + [11, 1] + [0] * 4, np.int32)
    q = jnp.asarray(rng.normal(size=(len(rows), q_heads, head_dim)), dtype)
    kernel_args = (jnp.array([9, 11, 1, 0], jnp.int32), jnp.asarray(tables), jnp.array([0, 6, 7, 8, 8], jnp.int32),
                   jnp.array([3], jnp.int32))
    return q, kv, rows, limits, tables, kernel_args


def test_the_kernels_reference_equals_the_portable_form_over_a_combined_pool():
    q, kv, rows, limits, tables, kernel_args = _step(np.random.default_rng(0))
    want = rpa.ref_ragged_paged_attention(q[:8], kv, *kernel_args, sm_scale=1 / 4.0)  # the 8 real tokens
    got = paged_attention(q, kv, None, rows, limits, tables)
    np.testing.assert_allclose(got[:8], want, atol=2e-6)
    assert not np.asarray(got[8:]).any()  # padding tokens see nothing
    # the split layout of the same keys and values gives the same
    k, v = (kv[:, :, i::2].transpose(0, 2, 1, 3) for i in (0, 1))
    np.testing.assert_allclose(paged_attention(q, k, v, rows, limits, tables, tile_positions=8), got, atol=2e-6)


def test_the_tpu_hook_builds_the_kernels_arguments_from_the_step(monkeypatch):
    # the Mosaic kernel does not run off a TPU: the hook's call is checked with the kernel's reference in its
    # place (run eagerly: the reference loops over num_seqs in Python)
    calls = []

    def reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, **blocks):
        calls.append((np.asarray(kv_lens), np.asarray(cu_q_lens), np.asarray(num_seqs), blocks))
        out = rpa.ref_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                             sm_scale=sm_scale)
        return jnp.concatenate([out, jnp.full((q.shape[0] - out.shape[0],) + q.shape[1:], jnp.nan, q.dtype)])

    monkeypatch.setattr("jax.experimental.pallas.ops.tpu.ragged_paged_attention.ragged_paged_attention", reference)
    q, kv, rows, limits, tables, (kv_lens, _, cu_q_lens, num_seqs) = _step(np.random.default_rng(1), head_dim=128)
    hook = tpu.make_backend(interpret=False).paged_attention
    got = hook(q, kv, None, rows, limits - 1, limits, tables)
    (seen_kv, seen_cu, seen_n, blocks), = calls
    np.testing.assert_array_equal(seen_kv, kv_lens)
    np.testing.assert_array_equal(seen_cu, cu_q_lens)
    np.testing.assert_array_equal(seen_n, num_seqs)
    assert blocks == dict(num_kv_pages_per_block=4, num_queries_per_block=12)
    np.testing.assert_allclose(got, paged_attention(q, kv, None, rows, limits, tables), atol=2e-6)  # padding: 0


def test_the_tpu_hook_declines_what_the_kernel_does_not_take():
    hook = tpu.make_backend(interpret=False).paged_attention
    q, kv, rows, limits, tables, _ = _step(np.random.default_rng(2), head_dim=128)
    k, v = (kv[:, :, i::2].transpose(0, 2, 1, 3) for i in (0, 1))
    assert hook(q, k, v, rows, limits - 1, limits, tables) is None  # a split pool
    small = _step(np.random.default_rng(2), head_dim=64)  # GPT-2's heads of 64
    assert hook(small[0], small[1], None, small[2], limits - 1, limits, tables) is None
    assert not tpu_attention.ragged_paged_supported((8, 6, 128), (4, 8, 12, 128), jnp.bfloat16)  # 2K=12 bf16
    assert tpu_attention.ragged_paged_supported((8, 6, 128), (4, 8, 4, 128), jnp.bfloat16)
    assert tpu.make_backend(interpret=True).paged_attention is None  # off a TPU: the portable form


def test_pool_layouts_and_the_int8_pool_stays_split():
    tpu_backend = tpu.make_backend(interpret=True)
    assert tpu_backend.paged_layout == "combined" and PORTABLE.paged_layout == "split"
    # heads of 128 (what the kernel takes): combined; narrower (CFG's 8, GPT-2's 64): flat, their H columns
    # side by side in the last dimension (a TPU pads a last dimension of 64 to 128 lanes)
    assert pool_layout(CFG.replace(n_embd=512), tpu_backend) == "combined" and pool_layout(CFG, tpu_backend) == "flat"
    assert pool_layout(CFG, tpu_backend, "int8") == "split" and pool_layout(CFG, PORTABLE) == "split"
    pool = PagedCache.create_pool(CFG, 5, 4, layout="combined")
    assert pool.k[0].shape == (5, 4, 4, 8) and pool.v is None and (pool.page_size, pool.num_pages) == (4, 5)
    assert pool.pool().pool_layout == "combined"
    flat = PagedCache.create_pool(CFG.replace(scan_layers=True), 5, 4, layout="flat")
    assert flat.k.shape == flat.v.shape == (2, 5, 4, 16) and (flat.page_size, flat.num_pages) == (4, 5)
    for layout in ("combined", "flat"):
        with pytest.raises(ValueError, match="split only"):
            PagedCache.create_pool(CFG, 5, 4, dtype="int8", layout=layout)
    with pytest.raises(ValueError, match="layout"):
        PagedCache.create_pool(CFG, 5, 4, layout="joint")


@pytest.mark.parametrize("scan", [False, True])
def test_split_combined_and_flat_pools_give_the_same_logits_through_the_runner(scan):
    cfg = CFG.replace(scan_layers=scan)
    params = jaxgpt.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(3)
    a_seq, b_seq = rng.integers(0, 97, size=14).tolist(), rng.integers(0, 97, size=8).tolist()
    plans = [Plan(work=(Work(0, 0, tuple(a_seq[:10]), (3, 7, 1), False), Work(1, 0, tuple(b_seq[:7]), (5, 2), True))),
             Plan(work=(Work(1, 7, (b_seq[7],), (5, 2), True), Work(0, 10, tuple(a_seq[10:]), (3, 7, 1, 9), True)))]
    combined = dataclasses.replace(PORTABLE, paged_layout="combined")
    outs = {}
    for layout in ("split", "combined", "flat"):
        pool, outs[layout] = PagedCache.create_pool(cfg, 12, 4, layout=layout), []
        for plan in plans:
            shape = runner.shape_for(plan, runner.step_shapes(32, 4))
            arrays = runner.step_arrays(plan, shape, 4, 8, {0: a_seq, 1: b_seq})
            static = dict(config=cfg, backend=combined if layout == "combined" else PORTABLE, n_logprobs=3)
            pool, out = runner.ragged_step(params, pool, arrays, runner.idle_rows(shape[1]), np.zeros(4, np.int32),
                                           **static)
            out.update(runner.token_scores(params, out.pop("hidden"), arrays.targets, **static))
            outs[layout].append(jax.device_get(out))
        assert pool.pool_layout == layout
    for split, comb, flat in zip(outs["split"], outs["combined"], outs["flat"]):
        for other in (comb, flat):
            np.testing.assert_allclose(other["prompt_lp"], split["prompt_lp"], atol=1e-5)
            np.testing.assert_array_equal(other["token"], split["token"])


@pytest.mark.parametrize("cfg, wanted", [(CFG, "flat"), (CFG.replace(n_embd=512), "combined")],
                         ids=["heads of 8: flat", "heads of 128: combined"])
def test_an_engine_on_a_combined_backend_keeps_the_pool_it_picks_and_the_same_tokens(cfg, wanted):
    params = jaxgpt.init_params(cfg, jax.random.key(1))
    prompts = [np.random.default_rng(s).integers(0, 97, size=n).tolist() for s, n in ((0, 9), (1, 3))]
    out = {}
    for backend in (PORTABLE, dataclasses.replace(PORTABLE, paged_layout="combined")):
        eng = PagedEngine(params, cfg, max_requests=2, page_size=4, token_budget=8, backend=backend)
        assert eng.cache.pool_layout == ("split" if backend is PORTABLE else wanted)
        out[eng.cache.pool_layout] = [c.tokens for c in eng.run([dict(prompt=p, max_tokens=5) for p in prompts])]
    int8 = PagedEngine(params, cfg, max_requests=2, page_size=4, token_budget=8, kv_dtype="int8",
                       backend=dataclasses.replace(PORTABLE, paged_layout="combined"))
    assert int8.cache.pool_layout == "split"
    assert out["split"] == out[wanted]


needs_aot = pytest.mark.skipif(aot.missing_extra() is not None, reason=f"aot extra: {aot.missing_extra()}")


@needs_aot
def test_every_paged_program_for_a_tpu_target_compiles_with_the_pallas_kernel():
    from jaxgpt.training.config import default_config

    aot.prepare_environment()
    config = default_config()  # (test_aot's tiny model with heads of 128: what the kernel takes)
    config.train.parallel, config.data.tokenizer = "mesh", "byte"
    config.model.block_size, config.model.n_layer, config.model.n_head, config.model.n_embd = 64, 2, 2, 256
    r = aot.compile_for_target(config, aot.parse_target("tpu:v5e:1x1"), programs=("paged",), progress=False,
                               engine_args={"slots": 4, "max_len": 32, "page_size": 8, "token_budget": 16})
    e = r["programs"]["paged"]
    assert r["fits"] and e["fits"] and e["kernels"] == "tpu" and e["tokens_that_fit"] > 0
    assert e["custom_calls"].get("tpu_custom_call", 0) >= 2  # the kernel in each layer of the largest program
    assert e["page_bytes"] == 2 * 2 * 2 * 8 * 128 * 4  # keys and values: the combined pool's bytes are the same
