"""Attention split by heads under `tensor` (issue 59, items 1 and 2), on the fake CPU devices: the compiled
step moves no attention activation between devices (q, k and v computed per device on its own heads, c_proj
row-parallel with one all-reduce per block), data x tensor and fsdp x tensor train as one device with
dropout, fewer kv heads than tensor devices are replicated, and decoding under tensor=2 and 4 gives one
device's tokens and logits with the cache split by kv head."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxgpt import Decoder, Engine, GPTConfig, generate, init_params, sampling, shard_params
from jaxgpt.backends import resolve
from jaxgpt.training import MeshRunner, create_train_state, make_optimizer
from jaxgpt.training.config import default_config
from jaxgpt.training.mesh import build_mesh
from tests.helpers import assert_same_training

# four heads of 8, two kv heads (GQA), SwiGLU and RoPE, as tests/test_tensor_parallel.py's
CFG = GPTConfig(vocab_size=48, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, bias=False,
                kernels="portable", position="rope", norm="rmsnorm", mlp="swiglu", mlp_hidden=64,
                tie_embeddings=False)
ROWS, STEPS = 8, 3


def _opt():
    t = default_config().train
    t.warmup_steps, t.max_steps = 1, 10
    return make_optimizer(t)


OPT = _opt()


def _batches(cfg, n=STEPS):
    r = np.random.default_rng(0)
    tokens = [r.integers(0, cfg.vocab_size, (ROWS, cfg.block_size + 1)).astype(np.int32) for _ in range(n)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _run(cfg, runner, steps=STEPS):
    state = runner.init_state(lambda: create_train_state(init_params(cfg, jax.random.key(0)), OPT, jax.random.key(1)))
    losses = []
    for x, y in _batches(cfg, steps):
        state, metrics = runner.step(state, x, y)
        losses.append(float(runner.to_host(metrics)["loss"]))
    return np.array(losses), state


def _devices(mesh: str) -> list:
    return jax.devices()[:int(np.prod([int(part.split("=")[1]) for part in mesh.split(",")]))]


_COLLECTIVE = re.compile(r"= (.*?) (all-gather|collective-permute|all-to-all|all-reduce|reduce-scatter)(?:-start)?\("
                         r".*?op_name=\"([^\"]*)\"")


def _collectives(hlo: str) -> list:
    """(kind, [shape dims, ...], op name) of every collective in a compiled program's text."""
    found = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            shapes = [[int(d) for d in dims.split(",") if d] for dims in re.findall(r"\w+\[([\d,]*)\]", m.group(1))]
            found.append((m.group(2), shapes, m.group(3)))
    return found


def _compiled_step(cfg, mesh: str, table: str = "") -> str:
    runner = MeshRunner(cfg, OPT, mesh=mesh, devices=_devices(mesh), rules=table)
    x, y = _batches(cfg, 1)[0]
    state = runner.abstract_state(lambda: create_train_state(init_params(cfg, jax.random.key(0)), OPT,
                                                             jax.random.key(1)))
    return runner.jitted_step(state).lower(state, runner.put_batch(x), runner.put_batch(y)).compile().as_text()


def _moved_attention_activations(hlo: str, rows: int, t: int, forward_only: bool = False, width: int = 0) -> list:
    """The collectives that move attention's activations ([rows, t, ...] per device, under attn/) between
    devices: all-gathers, permutes, all-to-alls (all-reduces are the row-parallel partial sums). With
    `width` (the model's) less sequence parallelism's all-gathers of c_proj's output gradient [rows, t,
    width] along t: the residual stream's."""
    return [(kind, shapes, name) for kind, shapes, name in _collectives(hlo)
            if kind not in ("all-reduce", "reduce-scatter") and "/attn/" in name
            and not (forward_only and "transpose(" in name)
            and not (width and kind == "all-gather" and "/attn/c_proj/" in name and shapes == [[rows, t, width]])
            and any(len(s) >= 3 and s[0] == rows and t in s[1:] for s in shapes)]


@pytest.mark.parametrize("table", ["", "length=tensor"])
@pytest.mark.parametrize("mesh, kv_heads", [("data=2,tensor=2", 2), ("tensor=4", 4)])
def test_the_compiled_step_computes_attention_per_device_on_its_own_heads(mesh, kv_heads, table):
    """Before heads were split, GSPMD split c_attn's [q | k | v] columns in contiguous halves and moved q,
    k and v between the devices (collective-permutes of [4, 16, 16] and [4, 16, 8] under attn/c_attn, forward
    and backward); now each device computes its own heads' q, k and v from c_attn's columns. With sequence
    parallelism ("length=tensor"; off by default) the backward also gathers c_proj's
    output gradient [rows, T, D] along T: the residual stream's, not attention's."""
    cfg = CFG.replace(n_kv_head=kv_heads)
    tensor = int(mesh.split("tensor=")[1])
    rows = ROWS // (len(_devices(mesh)) // tensor)
    hlo = _compiled_step(cfg, mesh, table)
    assert _moved_attention_activations(hlo, rows, cfg.block_size, width=cfg.n_embd if table else 0) == []
    # the forward's all-reduces on the attention path: c_proj's partial sums, one per block
    forward = [name for kind, _, name in _collectives(hlo) if kind in ("all-reduce", "reduce-scatter")
               and name.startswith("jit(train_step)/jvp(GPT)/") and "/attn/" in name]
    assert len(forward) == cfg.n_layer and all("/attn/c_proj/" in name for name in forward), forward
    # q, k and v of the device's own heads: c_attn's product has (N + 2K) H / tensor columns per device
    width = (cfg.n_head + 2 * kv_heads) * cfg.head_dim // tensor
    dots = re.findall(r"= f32\[(\d+),(\d+)\]\{1,0\} dot\(.*op_name=\"jit\(train_step\)/jvp\(GPT\)/h_0/attn/c_attn/",
                      hlo)
    assert dots and {(int(a), int(b)) for a, b in dots} == {(rows * cfg.block_size, width)}, dots


def test_fewer_kv_heads_than_tensor_devices_are_replicated():
    """Two kv heads on tensor=4: each device computes its query head and both kv heads (replicated), the
    forward moves no attention activation, and training equals one device."""
    hlo = _compiled_step(CFG, "tensor=4")
    assert _moved_attention_activations(hlo, ROWS, CFG.block_size, forward_only=True) == []
    want_losses, want = _run(CFG, MeshRunner(CFG, OPT, devices=jax.devices()[:1]), steps=2)
    losses, state = _run(CFG, MeshRunner(CFG, OPT, mesh="tensor=4"), steps=2)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_same_training(state, want, atol=1e-5, what="tensor=4")


@pytest.fixture(scope="module")
def dropout_one_device():
    cfg = CFG.replace(dropout=0.1)
    return _run(cfg, MeshRunner(cfg, OPT, devices=jax.devices()[:1]))


@pytest.mark.parametrize("mesh", ["data=2,tensor=2", "fsdp=2,tensor=2"])
def test_a_tensor_mesh_trains_with_dropout_as_one_device(dropout_one_device, mesh):
    cfg = CFG.replace(dropout=0.1)
    want_losses, want = dropout_one_device
    losses, state = _run(cfg, MeshRunner(cfg, OPT, mesh=mesh))
    no_dropout, _ = _run(CFG, MeshRunner(CFG, OPT, devices=jax.devices()[:1]), steps=1)
    assert abs(losses[0] - no_dropout[0]) > 1e-4  # (dropout is on)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_same_training(state, want, atol=1e-5, what=mesh)


def _decode_logits(decoder, prompts, lengths, steps=3):
    """The logits after the prompt and after each of `steps` greedy decode steps, [steps + 1, B, V]."""
    weights = decoder.weights(prompts.shape[0])
    static = dict(config=decoder.config, backend=decoder.backend)
    state = sampling._prefill_jit(weights, prompts, lengths, max_len=prompts.shape[1] + steps + 1,
                                  mesh=decoder.mesh, **static)
    out = [np.asarray(state.logits)]
    greedy = sampling.Sampler.of(0.0, None, None, None, 0)
    for _ in range(steps):
        state, _ = sampling._decode_jit(weights, state, jax.random.key(0), n=1, sampler=greedy, last=False, **static)
        out.append(np.asarray(state.logits))
    return np.stack(out), state


@pytest.mark.parametrize("tensor", [2, 4])
def test_decoding_under_tensor_equals_one_device(tensor):
    """Params placed by the rules on a tensor mesh: the decoder splits attention by heads there and, by
    default, its cache by kv head (two kv heads on tensor=4: replicated); its logits after the prompt and
    each decode step, and its tokens, are one device's."""
    params = init_params(CFG, jax.random.key(3))
    mesh = build_mesh(f"tensor={tensor}", jax.devices()[:tensor])
    placed = shard_params(params, CFG, mesh)
    decoder = Decoder(placed, CFG)
    assert decoder.backend.head_mesh == (mesh, ()) and decoder.mesh is mesh
    assert Decoder(params, CFG).backend.head_mesh is None
    prompts, lengths = np.array([[3, 1, 4, 1, 5], [2, 7, 1, 8, 0]], np.int32), np.array([5, 4], np.int32)
    want, _ = _decode_logits(Decoder(params, CFG), prompts, lengths)
    got, state = _decode_logits(decoder, prompts, lengths)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    heads = CFG.n_kv_head // tensor if CFG.n_kv_head % tensor == 0 else CFG.n_kv_head
    assert {buf.addressable_shards[0].data.shape[1] for buf in state.cache.k + state.cache.v} == {heads}
    for kw in [dict(temperature=0.0), dict(temperature=0.8, top_k=10)]:
        one = generate(params, CFG, prompts, 8, jax.random.key(0), prompt_lengths=lengths, **kw)
        split = decoder.generate(prompts, 8, jax.random.key(0), prompt_lengths=lengths, **kw)
        np.testing.assert_array_equal(np.asarray(split.tokens), np.asarray(one.tokens))


def test_the_engine_under_tensor_2_gives_one_devices_tokens_and_logprobs():
    params = init_params(CFG, jax.random.key(4))
    mesh = build_mesh("tensor=2", jax.devices()[:2])
    placed = shard_params(params, CFG, mesh)
    reqs = [dict(prompt=[3, 1, 4, 1, 5], max_tokens=6, temperature=0.9, top_k=20, seed=5, logprobs=2),
            dict(prompt=[2, 7], max_tokens=6, temperature=0.0, logprobs=0)]
    engines = [Engine(p, CFG, slots=2, max_len=16, prefill_chunk=4) for p in (params, placed)]
    assert engines[1].backend.head_mesh == (mesh, ()) and not engines[1].cache.k[0].sharding.is_fully_replicated
    one, split = (e.run(reqs) for e in engines)
    assert [o.token_ids for o in split] == [o.token_ids for o in one]
    for a, b in zip(one, split):
        np.testing.assert_allclose([t.logprob for t in b.tokens], [t.logprob for t in a.tokens], atol=1e-5)
        assert [[i for i, _ in t.top] for t in b.tokens] == [[i for i, _ in t.top] for t in a.tokens]


@pytest.mark.parametrize("layout", ["split", "flat"])
def test_the_paged_engine_under_tensor_2_gives_one_devices_tokens_with_its_pool_split_by_kv_head(layout):
    # split: [P, K, page, H], the heads' axis 1; flat (a TPU's pool for heads narrower than 128 lanes, here
    # asked for by a portable backend that wants "combined"): [P, page, K*H], each device its heads' columns
    import dataclasses

    from jaxgpt.backends import PORTABLE
    from jaxgpt.engine import runner
    from jaxgpt.engine.paged import PagedEngine

    params = init_params(CFG, jax.random.key(4))
    mesh = build_mesh("tensor=2", jax.devices()[:2])
    placed = shard_params(params, CFG, mesh)
    reqs = [dict(prompt=[3, 1, 4, 1, 5], max_tokens=6, temperature=0.9, top_k=20, seed=5, logprobs=2),
            dict(prompt=[2, 7, 1, 8, 2, 8, 1], max_tokens=8, temperature=0.0, logprobs=0)]
    backend = None if layout == "split" else dataclasses.replace(PORTABLE, paged_layout="combined")
    engines = [PagedEngine(p, CFG, max_requests=2, max_len=16, page_size=4, token_budget=8, decode_steps={1: 4},
                           backend=backend) for p in (params, placed)]
    pool = engines[1].cache.k[0]
    axis, part = (1, 1) if layout == "split" else (2, CFG.head_dim)  # (a device's share of 2 kv heads)
    assert engines[1].cache.pool_layout == layout and pool.ndim == (4 if layout == "split" else 3)
    assert engines[1].backend.head_mesh == (mesh, ()) and pool.sharding.shard_shape(pool.shape)[axis] == part
    one, split = (e.run(reqs) for e in engines)
    assert [o.token_ids for o in split] == [o.token_ids for o in one]
    for a, b in zip(one, split):
        np.testing.assert_allclose([t.logprob for t in b.tokens], [t.logprob for t in a.tokens], atol=1e-5)
    assert engines[1].cache.k[0].sharding.shard_shape(pool.shape)[axis] == part  # (still split after the steps)
    # the compiled step's attention reads each device's own kv heads of the pool: no collective under attn/
    # but c_proj's all-reduce
    e = engines[1]
    prev = np.zeros(runner._pow2(e.max_requests), np.int32)  # (asynchronous scheduling's previous draws)
    hlo = runner.ragged_step.lower(e.weights[8], e.cache, runner.warm_arrays((8, 2), e.table_width),
                                   runner.idle_rows(2), prev, **e._static).compile().as_text()
    found = _collectives(hlo)
    assert any(kind == "all-reduce" and "/attn/c_proj" in where for kind, _, where in found)
    assert [c for c in found if "/attn/" in c[2] and c[0] != "all-reduce"] == []


def test_generate_under_tensor_2_keeps_the_cache_split_in_the_compiled_program():
    """The decode program's attention reads each device's own kv heads: no collective moves the cache's
    [B, K, S, H] keys and values (with heads whole on every device, they were gathered every step)."""
    mesh = build_mesh("tensor=2", jax.devices()[:2])
    decoder = Decoder(shard_params(init_params(CFG, jax.random.key(0)), CFG, mesh), CFG)
    prompts, lengths = np.zeros((2, 5), np.int32), np.array([5, 3], np.int32)
    hlo = sampling._generate.lower(decoder.weights(2), prompts, lengths, jax.random.key(0), config=decoder.config,
                                   backend=decoder.backend, max_new_tokens=7, sampler=sampling.Sampler.of(
                                       1.0, None, None, None, 0), mesh=decoder.mesh).compile().as_text()
    found = _collectives(hlo)
    assert any(kind == "all-reduce" for kind, _, _ in found)  # (c_proj's and the MLP's partial sums)
    # (before heads were split: q, k and v permuted between the devices under attn/c_attn, every step)
    assert [c for c in found if c[0] != "all-reduce" and "/attn/" in c[2]] == []
    moved = [c for c in found if c[0] != "all-reduce" and any(len(s) == 4 and s[0] == 2 and s[2] == 12 for s in c[1])]
    assert moved == []


def test_the_tpu_backend_runs_splash_per_device_on_its_own_heads():
    """The splash kernel (interpreted on this CPU) in shard_map over the batch axes and tensor: each device
    on its rows and its own heads, the losses the portable backend's."""
    cfg = CFG.replace(kernels="tpu")
    runner = MeshRunner(cfg, OPT, mesh="data=2,tensor=2")
    assert runner.backend.name == "tpu" and runner.backend.head_mesh == (runner.mesh, ("data",))
    hlo = _compiled_step(cfg, "data=2,tensor=2")
    assert _moved_attention_activations(hlo, ROWS // 2, cfg.block_size, width=cfg.n_embd) == []
    losses, _ = _run(cfg, runner, steps=1)
    np.testing.assert_allclose(losses, _run(CFG, MeshRunner(CFG, OPT, mesh="data=2,tensor=2"), steps=1)[0], rtol=1e-5)


@pytest.mark.parametrize("tensor", [1, 2])
@pytest.mark.parametrize("what", ["prefill", "attention"])
def test_a_prompt_in_chunks_gives_what_the_prompt_at_once_gives(monkeypatch, tensor, what):
    """The prompt through the model 2 tokens at a time (sampling.PREFILL_CHUNK: two chunks and the rest), or
    its attention over the cache 2 queries at a time (model.QUERY_CHUNK, the last chunk padded): the logits
    after the prompt and a decode step, and the tokens, are the prompt's at once, on one device and split by
    heads over tensor=2."""
    from jaxgpt import model

    params = init_params(CFG, jax.random.key(5))
    if tensor > 1:
        params = shard_params(params, CFG, build_mesh(f"tensor={tensor}", jax.devices()[:tensor]))
    prompts, lengths = np.array([[3, 1, 4, 1, 5], [2, 7, 1, 8, 0]], np.int32), np.array([5, 3], np.int32)
    want, _ = _decode_logits(Decoder(params, CFG), prompts, lengths, steps=1)
    want_tokens = Decoder(params, CFG).generate(prompts, 4, jax.random.key(0), prompt_lengths=lengths).tokens
    module, name = (sampling, "PREFILL_CHUNK") if what == "prefill" else (model, "QUERY_CHUNK")
    monkeypatch.setattr(module, name, 2)
    chunked, in_chunks, lax_map = [], sampling._prefill_in_chunks, jax.lax.map
    monkeypatch.setattr(sampling, "_prefill_in_chunks", lambda *a: chunked.append("prefill") or in_chunks(*a))
    monkeypatch.setattr(jax.lax, "map", lambda *a, **k: chunked.append("attention") or lax_map(*a, **k))
    jax.clear_caches()  # (the programs traced again, in chunks)
    got, state = _decode_logits(Decoder(params, CFG), prompts, lengths, steps=1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), lengths + 1)
    tokens = Decoder(params, CFG).generate(prompts, 4, jax.random.key(0), prompt_lengths=lengths).tokens
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))
    assert what in chunked
