"""Tensor parallelism (issue 37, item 2): the rules table that maps logical axes to mesh axes, data x
tensor and fsdp x tensor meshes training as one device does on the four fake CPU devices with the state
really split over tensor, the all-reduces GSPMD inserts, and generate and the engine under tensor=2, with
the params placed by the rules, equal to one device."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxgpt import Engine, GPTConfig, generate, init_params, shard_params
from jaxgpt.aot import count_collectives
from jaxgpt.checkpoint import Checkpointer, abstract_like
from jaxgpt.sharding import DEFAULT_RULES, batch_axes, logical_spec, rules, tree_specs
from jaxgpt.training import MeshRunner, create_train_state, make_optimizer, train
from jaxgpt.training.config import batch_devices, default_config, validate_config
from jaxgpt.training.mesh import build_mesh, parse_mesh
from jaxgpt.training.parallel import fsdp_spec
from tests.helpers import assert_same_training, tiny_config

# four heads of 8, two kv heads (GQA), SwiGLU and RoPE: what a Llama-style model splits
CFG = GPTConfig(vocab_size=48, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, bias=False,
                kernels="portable", position="rope", norm="rmsnorm", mlp="swiglu", mlp_hidden=64,
                tie_embeddings=False)
STEPS = 3


def _opt():
    t = default_config().train
    t.warmup_steps, t.max_steps = 1, 10
    return make_optimizer(t)


OPT = _opt()


def _batches(n=STEPS, rows=8):
    r = np.random.default_rng(0)
    tokens = [r.integers(0, CFG.vocab_size, (rows, CFG.block_size + 1)).astype(np.int32) for _ in range(n)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _state():
    return create_train_state(init_params(CFG, jax.random.key(0)), OPT, jax.random.key(1))


def _run(runner, steps=STEPS):
    state = runner.init_state(_state)
    losses = []
    for x, y in _batches(steps):
        state, metrics = runner.step(state, x, y)
        losses.append(float(runner.to_host(metrics)["loss"]))
    return np.array(losses), state


@pytest.fixture(scope="module")
def one_device():
    return _run(MeshRunner(CFG, OPT, devices=jax.devices()[:1]))


def test_the_rules_table_and_its_overrides():
    table = rules()
    assert table == dict(DEFAULT_RULES) and table["batch"] == ("dcn", "data", "fsdp") and table["qkv"] == ("fsdp",)
    assert rules("qkv=tensor+fsdp, embed=")["qkv"] == ("tensor", "fsdp") and rules("embed=")["embed"] == ()
    assert rules([("mlp", "fsdp"), ("vocab", None)])["mlp"] == ("fsdp",) and rules({"vocab": None})["vocab"] == ()
    for bad, words in {"qvk=tensor": "unknown logical axis 'qvk'", "mlp=model": "from dcn, data, fsdp, tensor",
                       "mlp": "not LOGICAL=MESH_AXES", "mlp=tensor,mlp=fsdp": "appears twice",
                       "mlp=tensor+tensor": "each mesh axis once"}.items():
        with pytest.raises(ValueError, match=f"config.train.logical_axis_rules: .*{words}"):
            rules(bad)
    assert batch_axes(("data", "fsdp", "tensor")) == ("data", "fsdp") and batch_axes(("tensor",)) == ()
    # tensor first (heads / mlp / vocab), then fsdp on a dimension tensor left whole, the largest
    mesh = {"fsdp": 2, "tensor": 4}
    assert logical_spec(("embed", "mlp"), (32, 128), mesh) == P("fsdp", "tensor")
    assert logical_spec(("mlp", "embed"), (128, 32), mesh) == P("tensor", "fsdp")
    assert logical_spec(("embed", "qkv"), (32, 96), mesh) == P(None, "fsdp")  # qkv: not over tensor
    assert logical_spec(("layers", "embed", "mlp"), (4, 32, 128), mesh) == P(None, "fsdp", "tensor")
    assert logical_spec(("vocab", "embed"), (50, 32), mesh) == P("fsdp")  # 50 % 4: tensor leaves it whole
    assert logical_spec(("vocab", "embed"), (51, 32), mesh) == P(None, "fsdp")
    assert logical_spec(("mlp",), (128,), mesh) == P(("tensor", "fsdp"))  # both on the one dimension
    assert logical_spec(("embed", "mlp"), (32, 128), {"data": 2, "fsdp": 1, "tensor": 1}) == P()  # size 1
    # on a mesh of fsdp alone: FSDP's old guess, the largest dimension the size divides
    for shape in [(50, 32), (128, 32), (32, 128), (3, 5), (), (8,), (64, 64)]:
        axes = ("embed", "mlp", "qkv")[:len(shape)]
        assert logical_spec(axes, shape, {"data": 2, "fsdp": 4}) == fsdp_spec(shape, 4), shape


def test_train_mesh_names_tensor_and_the_batch_is_split_over_data_and_fsdp_only():
    assert parse_mesh("tensor=2,fsdp=-1") == (("fsdp", -1), ("tensor", 2))  # tensor the innermost
    c = default_config()
    c.train.mesh, c.train.batch_size = "data=2,tensor=2", 2
    validate_config(c, 4)  # 2 rows over the 2 data devices
    assert batch_devices(c.train, 4) == 2
    c.train.batch_size = 3
    with pytest.raises(ValueError, match="config.train.batch_size: 3 must be divisible by the device count \\(2"):
        validate_config(c, 4)
    c.train.batch_size, c.train.logical_axis_rules = 4, "mlp=expert"
    with pytest.raises(ValueError, match="config.train.logical_axis_rules: 'mlp' maps to"):
        validate_config(c)


def _specs_of(state):
    out = {}
    for layer, name in [("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_gate"), ("mlp", "c_proj")]:
        param = state.params["h_0"][layer][name]["kernel"].sharding.spec
        moment = state.opt_state[1][0].mu["h_0"][layer][name]["kernel"].sharding.spec  # Adam's: as its param
        assert param == moment, (layer, name)
        out[f"{layer}.{name}"] = param
    out["lm_head"] = state.params["lm_head"]["kernel"].sharding.spec
    out["wte"] = state.params["wte"]["embedding"].sharding.spec
    return out


@pytest.mark.parametrize("mesh, specs", [
    ("data=2,tensor=2", {"attn.c_attn": P(), "attn.c_proj": P("tensor"), "mlp.c_fc": P(None, "tensor"),
                         "mlp.c_gate": P(None, "tensor"), "mlp.c_proj": P("tensor"), "lm_head": P(None, "tensor"),
                         "wte": P("tensor")}),
    ("fsdp=2,tensor=2", {"attn.c_attn": P(None, "fsdp"), "attn.c_proj": P("tensor", "fsdp"),
                         "mlp.c_fc": P("fsdp", "tensor"), "mlp.c_gate": P("fsdp", "tensor"),
                         "mlp.c_proj": P("tensor", "fsdp"), "lm_head": P("fsdp", "tensor"),
                         "wte": P("tensor", "fsdp")}),
])
def test_a_tensor_mesh_trains_as_one_device_with_the_state_split_over_tensor(one_device, mesh, specs):
    want_losses, want = one_device
    runner = MeshRunner(CFG, OPT, mesh=mesh)
    assert runner.batch_axes == (mesh.split("=")[0],) and runner.batch_sharding.spec == P(mesh.split("=")[0])
    losses, state = _run(runner)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_same_training(state, want, atol=1e-5, what=mesh)
    assert _specs_of(state) == specs
    c_fc = state.params["h_0"]["mlp"]["c_fc"]["kernel"]  # [32, 64]: each device a quarter, or half of it
    held = {(32, 32)} if mesh.startswith("data") else {(16, 32)}
    assert {s.data.shape for s in c_fc.addressable_shards} == held
    assert state.step.sharding.is_fully_replicated


def test_a_checkpoint_from_a_tensor_mesh_restores_on_one_device_and_on_another_mesh(tmp_path):
    runner = MeshRunner(CFG, OPT, mesh="fsdp=2,tensor=2")
    _, state = _run(runner, steps=1)
    ck = Checkpointer(str(tmp_path))
    ck.save(1, runner.get_state(state), {"step": 1})
    ck.wait()
    one, _ = ck.restore(abstract_like(jax.eval_shape(_state)))
    other = MeshRunner(CFG, OPT, mesh="data=2,tensor=2")
    onto, _ = ck.restore(other.abstract_state(_state))
    ck.close()
    assert onto.params["h_0"]["mlp"]["c_fc"]["kernel"].sharding.spec == P(None, "tensor")
    for a, b, c in zip(*(jax.tree.leaves(jax.tree.map(np.asarray, s.params)) for s in (state, one, onto))):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_train_mesh_and_the_rules_run_through_train(tmp_path):
    c = tiny_config(tmp_path, max_steps=2, eval_interval=100, checkpoint_interval=100, log_interval=1,
                    mesh="fsdp=2,tensor=2", logical_axis_rules="qkv=tensor+fsdp")
    c.model.n_layer = 1
    s = train(c)
    params = s["state"].params["h_0"]
    assert s["steps"] == 2 and params["attn"]["c_attn"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert params["mlp"]["c_fc"]["kernel"].sharding.spec == P("fsdp", "tensor")


def test_the_tensor_parallel_step_all_reduces():
    # on a mesh of tensor alone nothing carries batch: every all-reduce is a tensor-parallel one
    runner = MeshRunner(CFG, OPT, mesh="tensor=2", devices=jax.devices()[:2])
    x, y = _batches(1)[0]
    state = runner.abstract_state(_state)
    hlo = runner.jitted_step(state).lower(state, runner.put_batch(x), runner.put_batch(y)).compile().as_text()
    assert count_collectives(hlo).get("all-reduce", 0) >= 2 * CFG.n_layer  # attention's and the MLP's, each layer


def test_params_placed_by_the_rules_give_one_devices_tokens_under_tensor_2():
    params = init_params(CFG, jax.random.key(3))
    mesh = build_mesh("tensor=2", jax.devices()[:2])
    placed = shard_params(params, CFG, mesh)
    assert placed["h_0"]["mlp"]["c_fc"]["kernel"].sharding.spec == P(None, "tensor")
    assert tree_specs(params, CFG, dict(mesh.shape))["h_0"]["attn"]["c_proj"]["kernel"] == P("tensor")
    prompts = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 5)).astype(np.int32)
    for kw in [dict(temperature=0.0), dict(temperature=0.8, top_k=10)]:
        one = generate(params, CFG, prompts, 8, jax.random.key(0), prompt_lengths=np.array([5, 3]), **kw)
        split = generate(placed, CFG, prompts, 8, jax.random.key(0), prompt_lengths=np.array([5, 3]), **kw)
        np.testing.assert_array_equal(np.asarray(split.tokens), np.asarray(one.tokens))
    settings = dict(temperature=0.9, top_k=20, seed=5)
    runs = [Engine(p, CFG, slots=2, max_len=16, prefill_chunk=4).run(
        [dict(prompt=[3, 1, 4, 1, 5], max_tokens=6, **settings), dict(prompt=[2, 7], max_tokens=6)])
        for p in (params, placed)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_the_engine_splits_its_kv_cache_by_kv_head_under_tensor_2(kv_dtype):
    """Params placed by the rules on a tensor=2 mesh, split_cache=True: the engine's cache (portable layout,
    [B, K, S, H]) lies split by kv head over tensor, stays so through prefill, decode steps and slot copies, and the
    engine's tokens are one device's. (The CPU backend's [B*K, S, H] layout stays whole.)"""
    from jaxgpt.backends import resolve

    cfg = CFG.replace(kernels="portable")
    params = init_params(cfg, jax.random.key(4))
    mesh = build_mesh("tensor=2", jax.devices()[:2])
    placed = shard_params(params, cfg, mesh)
    reqs = [dict(prompt=[3, 1, 4, 1, 5], max_tokens=6, temperature=0.9, top_k=20, seed=5),
            dict(prompt=[3, 1, 4, 1, 5, 9], max_tokens=5, temperature=0.0),  # (a prefix copied from slot 0)
            dict(prompt=[2, 7], max_tokens=6, temperature=0.0)]
    one = Engine(params, cfg, slots=2, max_len=16, prefill_chunk=4, kv_dtype=kv_dtype)
    split = Engine(placed, cfg, slots=2, max_len=16, prefill_chunk=4, kv_dtype=kv_dtype, decode_steps=2,
                   split_cache=True)
    assert one.mesh is None and split.mesh is mesh
    assert Engine(placed, cfg, slots=2, max_len=16, split_cache=False).cache.k[0].sharding.is_fully_replicated
    assert not Engine(placed, cfg, slots=2, max_len=16).cache.k[0].sharding.is_fully_replicated  # (the default)
    want = NamedSharding(mesh, P(None, "tensor"))
    assert split.cache.k[0].sharding.is_equivalent_to(want, 4)
    assert [o.token_ids for o in split.run(reqs)] == [o.token_ids for o in one.run(reqs)]
    assert split.stats["copies"] >= 1
    for buf in split.cache.k + split.cache.v + (split.cache.k_scale or ()):
        assert buf.sharding.is_equivalent_to(want, buf.ndim), buf.sharding
        assert buf.addressable_shards[0].data.shape[1] == cfg.n_kv_head // 2
    whole = Engine(placed, CFG, slots=2, max_len=16, backend=resolve(CFG.replace(kernels="cpu")), split_cache=True)
    assert whole.cache.k[0].sharding.is_fully_replicated  # rows and heads share an axis there


def test_generate_splits_the_cache_it_allocates_by_kv_head_under_tensor_2(monkeypatch):
    """generate's cache lives inside its program: for params on a mesh, Decoder(split_cache=True) constrains
    it to split by kv head over tensor (what jaxgpt-aot --gen_mesh lowers too); the tokens stay one
    device's."""
    from jaxgpt import Decoder, sampling
    from jaxgpt.backends import resolve

    cfg = CFG.replace(kernels="portable")
    params = init_params(cfg, jax.random.key(6))
    mesh = build_mesh("tensor=2", jax.devices()[:2])
    placed = shard_params(params, cfg, mesh)
    decoder = Decoder(placed, cfg, split_cache=True)
    assert decoder.mesh is mesh and Decoder(params, cfg, split_cache=True).mesh is None
    assert Decoder(placed, cfg, split_cache=False).mesh is None and Decoder(placed, cfg).mesh is mesh  # (default)
    prompts, lengths = np.array([[3, 1, 4, 1, 5], [2, 7, 1, 8, 0]], np.int32), np.array([5, 4], np.int32)
    state = sampling._prefill_jit(decoder.weights(2), prompts, lengths, config=cfg, backend=decoder.backend, max_len=12,
                                  mesh=mesh)
    for buf in state.cache.k + state.cache.v:
        assert buf.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tensor")), 4), buf.sharding
    meshes, prefill = [], sampling._prefill

    def spy(*args):  # (called while generate's program is traced)
        meshes.append(args[-1])
        return prefill(*args)

    monkeypatch.setattr(sampling, "_prefill", spy)
    for kw in [dict(temperature=0.0), dict(temperature=0.8, top_k=10)]:
        one = generate(params, cfg, prompts, 7, jax.random.key(2), prompt_lengths=lengths, **kw)
        split = decoder.generate(prompts, 7, jax.random.key(2), prompt_lengths=lengths, **kw)
        np.testing.assert_array_equal(np.asarray(split.tokens), np.asarray(one.tokens))
    assert mesh in meshes  # the decoder of placed params traced generate with its mesh
    text = sampling.lower_generate(cfg, 2, 5, 7, backend=resolve(cfg), sharding=NamedSharding(mesh, P()),
                                   mesh=mesh).as_text()
    # a constraint on each layer's [B, K, S, H] keys and values: heads over tensor (Shardy's or GSPMD's text)
    split = [line for line in text.splitlines() if ("sharding_constraint" in line or "Sharding" in line)
             and ('[{}, {"tensor"}, {}, {}]' in line or "devices=[1,2,1,1]" in line)]
    assert len(split) >= 2 * cfg.n_layer, text[:3000]


def test_jaxgpt_aot_compiles_a_tensor_mesh_train_step_and_generate_at_tensor_4():
    from jaxgpt import aot
    if aot.missing_extra() is not None:
        pytest.skip(f"aot extra: {aot.missing_extra()}")
    aot.prepare_environment()
    c = default_config()
    c.data.tokenizer, c.train.batch_size, c.train.mesh = "byte", 8, "fsdp=2,tensor=2"
    c.model.block_size, c.model.n_layer, c.model.n_head, c.model.n_embd = 64, 2, 4, 64
    r = aot.compile_for_target(c, aot.parse_target("tpu:v5e:2x2"), progress=False,
                               generate_args={"prompt_len": 8, "max_new_tokens": 8, "mesh": "tensor=4"})
    train, gen = r["programs"]["train"], r["programs"]["generate"]
    assert r["fits"] and train["parallel"] == "mesh (fsdp=2, tensor=2)" and train["per_device_batch"] == 4
    assert gen["mesh"] == "tensor=4" and gen["batch_size"] == 1  # no batch axis: one row
    assert gen["heads_split"]  # lowered as Decoder runs params on the mesh: attention by heads, the cache by kv head
    assert train["collectives"]["all-reduce"] > 0 and gen["collectives"]["all-reduce"] > 0  # the partial sums
    assert "mesh tensor=4" in aot.format_result(r)


def test_a_mesh_that_gives_several_processes_the_same_rows_is_refused():
    from jaxgpt import aot
    if aot.missing_extra() is not None:
        pytest.skip(f"aot extra: {aot.missing_extra()}")
    aot.prepare_environment()
    devices = aot.target_devices(aot.parse_target("tpu:v5e:4x4")).devices  # two hosts of 8 chips
    assert len({d.process_index for d in devices}) == 2
    MeshRunner(CFG, OPT, devices=devices, mesh="data=2,tensor=8")  # data spans the hosts: each its own rows
    with pytest.raises(ValueError, match="config.train.mesh: the mesh \\(tensor=16\\) puts the same batch rows"):
        MeshRunner(CFG, OPT, devices=devices, mesh="tensor=16")
