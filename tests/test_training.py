import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import GPTConfig, init_params
from jaxgpt.training.config import default_config, validate_config
from jaxgpt.training import (MeshRunner, PmapRunner, TrainingDiverged, create_train_state, decay_mask,
                             lr_schedule, make_optimizer, make_schedule, make_train_step, train)
from tests.helpers import assert_same_training, tiny_config

CFG = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _train_cfg(**kw):
    t = default_config().train
    t.warmup_steps = 2
    t.max_steps = 10
    for k, v in kw.items():
        t[k] = v
    return t


def _batch(seed, b=8, t=16):
    r = np.random.default_rng(seed)
    x = r.integers(0, CFG.vocab_size, (b, t + 1)).astype(np.int32)
    return x[:, :-1], x[:, 1:]


def _state(tcfg):
    opt = make_optimizer(tcfg)
    return opt, create_train_state(init_params(CFG, jax.random.key(0)), opt, jax.random.key(1))


def test_grad_accumulation_equals_big_batch():
    # lr > 0 from the first step (no warmup) so the update depends on the gradient; grad_norm checks its
    # scale too, which AdamW's first update (about lr * sign(g)) would hide
    tcfg = _train_cfg(warmup_steps=0, lr=1e-2)
    opt, state = _state(tcfg)
    x, y = _batch(0)
    big, mb = jax.jit(make_train_step(CFG, opt, 1))(state, x, y)
    acc, ma = jax.jit(make_train_step(CFG, opt, 4))(state, x, y)
    np.testing.assert_allclose(float(mb["loss"]), float(ma["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(mb["grad_norm"]), float(ma["grad_norm"]), rtol=1e-5)
    assert_same_training(acc, big, atol=1e-6, what="grad_accum=4")
    moved = sum(int(np.sum(np.abs(np.asarray(a) - np.asarray(p0)) > 1e-3))
                for p0, a in zip(*(jax.tree_util.tree_leaves(s.params) for s in (state, big))))
    assert moved > 0.5 * sum(p.size for p in jax.tree_util.tree_leaves(state.params))  # the step did update


def test_pmap_mesh_and_one_device_agree_after_3_steps():
    assert jax.device_count() == 4, "conftest sets four fake CPU devices"
    tcfg = _train_cfg()
    opt, state0 = _state(tcfg)
    one = jax.jit(make_train_step(CFG, opt, 1))
    results = {}
    s = state0
    for i in range(3):
        s, _ = one(s, *_batch(i))
    results["one"] = s
    for runner in (PmapRunner(CFG, opt), MeshRunner(CFG, opt)):
        assert runner.n == 4
        s = runner.put_state(state0)
        for i in range(3):
            s, _ = runner.step(s, *_batch(i))
        results[runner.name] = runner.get_state(s)
    for name in ("pmap", "mesh"):
        assert_same_training(results[name], results["one"], atol=1e-6, what=name)


def test_a_pmap_state_goes_onto_the_devices_and_back_in_one_program_per_device():
    # put_state / get_state used to compile one program per device and leaf shape (88 at the start of a
    # tiny 4-device run); shapes no other test uses, so nothing is compiled already
    cfg = GPTConfig(vocab_size=41, block_size=8, n_layer=1, n_head=2, n_embd=24)
    opt = make_optimizer(_train_cfg())
    state = create_train_state(init_params(cfg, jax.random.key(0)), opt, jax.random.key(1))
    assert len({np.shape(x) for x in jax.tree_util.tree_leaves(state)}) >= 10
    from jaxgpt.training.parallel import _is_key

    runner = PmapRunner(cfg, opt)
    lowered = []
    listen = lambda event, seconds, **kw: lowered.append(1) if event.endswith("jaxpr_to_mlir_module_duration") else None
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        on_devices = runner.put_state(state)
        back = runner.get_state(on_devices)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert 0 < len(lowered) <= 2 * runner.n
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(state)
    for a, b, c in zip(*(jax.tree_util.tree_leaves(t) for t in (state, on_devices, back))):
        assert c.sharding == runner.replicated
        if _is_key(a):  # (on the devices keys are held as their raw data)
            a, c = jax.random.key_data(a), jax.random.key_data(c)
        assert b.shape == (runner.n, *a.shape)
        np.testing.assert_array_equal(np.asarray(c), np.asarray(a))
        np.testing.assert_array_equal(np.asarray(b), np.broadcast_to(np.asarray(a), b.shape))


def test_weight_decay_mask_only_matrices():
    params = init_params(CFG, jax.random.key(0))
    mask = decay_mask(params)
    assert mask["wte"]["embedding"] and mask["h_0"]["attn"]["c_attn"]["kernel"]
    assert not mask["h_0"]["attn"]["c_attn"]["bias"] and not mask["ln_f"]["scale"]
    # with a zero gradient only the masked parameters move (decoupled weight decay)
    tcfg = _train_cfg(lr=0.1, warmup_steps=0, weight_decay=0.5, grad_clip=0.0)
    opt = make_optimizer(tcfg)
    params = jax.tree_util.tree_map(lambda p: p + 1.0, params)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    updates, _ = opt.update(zeros, opt.init(params), params)
    moved = jax.tree_util.tree_map(lambda u: bool(jnp.any(u != 0)), updates)
    assert moved == mask


def test_schedule_values():
    f = lr_schedule(1e-3, 1e-4, warmup_steps=10, decay_steps=110)
    assert float(f(0)) == 0.0
    np.testing.assert_allclose(float(f(5)), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(float(f(10)), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(float(f(60)), 1e-4 + 0.5 * 9e-4, rtol=1e-5)  # halfway down the cosine
    np.testing.assert_allclose(float(f(110)), 1e-4, rtol=1e-5)
    np.testing.assert_allclose(float(f(500)), 1e-4, rtol=1e-5)
    assert float(make_schedule(_train_cfg(lr=2e-3, warmup_steps=4, max_steps=10))(4)) == pytest.approx(2e-3)


@pytest.mark.parametrize("section,key,value,match", [
    ("train", "batch_size", 10, "divisible by the device count"),
    ("train", "warmup_steps", -1, "warmup"),
    ("train", "parallel", "tpu", "parallel"),
    ("train", "lr", -1.0, "lr"),
    ("model", "n_head", 5, "n_embd"),
    ("data", "val_fraction", 1.5, "val_fraction"),
])
def test_config_validation(section, key, value, match):
    c = default_config()
    c[section][key] = value
    with pytest.raises(ValueError, match=match):
        validate_config(c, device_count=4)


def test_infinite_or_nan_train_hyperparameters_are_refused_naming_the_key():
    # train.lr=inf, muon_lr=inf and weight_decay=inf used to compile and stop at step 2 with "loss is nan"
    t = default_config().train
    floats = [k for k, v in t.items() if isinstance(v, float)] + ["target_val_loss", "peak_flops"]
    assert {"lr", "min_lr", "muon_lr", "weight_decay", "beta1", "beta2", "grad_clip", "decay_fraction"} <= set(floats)
    for key in floats:
        for bad in (math.inf, -math.inf, math.nan):
            if key == "grad_clip" and bad == math.inf:
                continue  # clipping at infinity, no clipping with the optimizer state kept as it is: allowed
            c = default_config()
            c.train[key] = bad
            with pytest.raises(ValueError, match=rf"^config\.train\.{key}: must be"):
                validate_config(c)
    c = default_config()
    c.train.grad_clip = math.inf
    validate_config(c)


def test_warmup_longer_than_training_is_allowed():
    c = default_config()  # a 5-step smoke run of a config with 100 warmup steps, as nanoGPT allows
    c.train.max_steps, c.train.warmup_steps = 5, 100
    validate_config(c)
    assert float(make_schedule(c.train)(4)) < 0.1 * c.train.lr
    c.train.decay_steps = 50  # an explicit decay that ends before the warmup does is still a mistake
    with pytest.raises(ValueError, match="decay_steps"):
        validate_config(c)


def test_unknown_config_key_rejected():
    c = default_config()
    c.train.unlock()
    c.train.learning_rate = 1e-3
    with pytest.raises(ValueError, match="learning_rate"):
        validate_config(c)


def test_a_peak_measured_while_the_cores_were_busy_is_raised_never_an_mfu_above_100_percent(tmp_path, monkeypatch,
                                                                                           capsys):
    """A CPU's peak is a matmul timed at the start; timed while another process held the cores, it is too
    low and the run's MFU went past 100% (CI: 124%, a test worker beside it). The run measures again and
    keeps the higher of that and its own attained rate, and says so once."""
    from jaxgpt.training import throughput

    calls = []

    def low_peak(dtype, override=None, devices=None, matmul_shape=(1024, 1024, 1024)):
        calls.append(tuple(matmul_shape))
        return 1e6, "measured float32 matmul, while busy"  # 1 MFLOP/s: any real step beats it

    monkeypatch.setattr(throughput, "peak_flops", low_peak)
    c = tiny_config(tmp_path, max_steps=6, log_interval=2, eval_interval=6)
    train(c)
    logged = [r for r in _metrics(c.out_dir) if "mfu" in r]
    assert [r["step"] for r in logged] == [2, 4, 6]
    for r in logged:
        assert 0 < r["mfu"] <= 1, r
    out = capsys.readouterr().out
    assert out.count("jaxgpt: MFU now against") == 1 and "above the 0 measured at the start" in out
    rows = c.train.batch_size // jax.local_device_count() * c.model.block_size  # one device's rows
    assert calls == [(rows, c.model.n_embd, 4 * c.model.n_embd)]  # measured once, at the start

    # a peak the user gave is theirs: an MFU above 100% then says that figure is wrong, and stays
    monkeypatch.setattr(throughput, "peak_flops", lambda *a, **kw: (1e6, "train.peak_flops"))
    c.overwrite = True
    train(c)
    assert all(r["mfu"] > 1 for r in _metrics(c.out_dir) if "mfu" in r)
    assert "MFU now against" not in capsys.readouterr().out


def test_a_log_line_that_waited_for_data_with_no_batch_made_since_the_last_one_is_written(tmp_path, monkeypatch):
    """A wait for data can span a log line in which the loader finished no batch: its rate is then unknown,
    and the line says the wait without it (CI: a TypeError formatting None stopped a LoRA run)."""
    import types
    from jaxgpt.training import throughput

    monkeypatch.setattr(throughput, "peak_flops", lambda *a, **kw: (1e12, "train.peak_flops"))
    from jaxgpt.training.config import model_config_from

    c = tiny_config(tmp_path)
    gcfg = model_config_from(c, vocab_size=256)
    clock = throughput.Throughput(c.train, gcfg, 1, 1, c.train.batch_size, note=print)
    loader = types.SimpleNamespace(produced=0, produce_s=0.0)
    t0 = clock.last_log[0]
    clock.data_wait = 0.5  # half of the second to step 2 waited, and no batch made
    r = clock.rates(2, t0 + 1.0, loader)
    assert r.loader_tokens_per_s is None and r.waited == pytest.approx(0.5)
    assert r.data_note() == " | waited for data 50%"
    loader.produced, loader.produce_s = 4, 0.1  # then four batches made in 0.1 s of the loader's time
    r = clock.rates(4, t0 + 2.0, loader)
    assert r.waited == 0 and r.data_note() == ""  # no new wait: nothing said
    clock.data_wait = 0.8
    loader.produced, loader.produce_s = 8, 0.2
    r = clock.rates(6, t0 + 3.0, loader)
    rate = 4 * c.train.batch_size * gcfg.block_size / 0.1
    assert r.loader_tokens_per_s == pytest.approx(rate)
    assert r.data_note() == f" | waited for data 30% (loader {rate:,.0f} tok/s per process)"


def test_train_reduces_loss_and_writes_metrics(tmp_path):
    c = tiny_config(tmp_path, max_steps=40, eval_interval=20)
    s = train(c)
    lines = [json.loads(l) for l in open(os.path.join(c.out_dir, "metrics.jsonl"))]
    steps = [l for l in lines if "loss" in l]
    evals = [l for l in lines if "val_loss" in l]
    assert [l["step"] for l in steps] == list(range(5, 41, 5))
    assert [l["step"] for l in evals] == [20, 40]
    for l in steps:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "elapsed_s"} <= set(l)
        assert l["tokens_per_s"] > 0 and 0 < l["mfu"] <= 1
    assert {"train_loss", "val_ppl", "val_bpb", "best_val_loss"} <= set(evals[0])
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    assert evals[-1]["val_loss"] < np.log(s["state"].params["wte"]["embedding"].shape[0])
    assert s["steps"] == 40 and s["saved_step"] == 40


def test_nan_loss_stops_with_step(tmp_path):
    c = tiny_config(tmp_path, max_steps=10, lr=1e30, warmup_steps=0, grad_clip=0.0)
    with pytest.raises(TrainingDiverged, match="at step"):
        train(c)


def test_every_shipped_config_validates(tmp_path, monkeypatch):
    import importlib.util
    import glob
    from jaxgpt.evals import parse_task_list
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = sorted(glob.glob(os.path.join(root, "configs", "*.py")))
    assert len(files) >= 4
    monkeypatch.chdir(tmp_path)  # the task files a recipe names, relative to where it runs, written there
    for path in files:
        spec = importlib.util.spec_from_file_location("cfg", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        config = mod.get_config()
        for task in parse_task_list(config.train.get("eval_tasks")):
            (tmp_path / task).write_text('{"ctx": "a", "endings": ["b", "c"], "label": 0}\n')
        validate_config(config, device_count=1)


def test_init_from_a_local_pretrained_folder(tmp_path):
    from jaxgpt import save_pretrained
    src = GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32)
    params = init_params(src, jax.random.key(7))
    save_pretrained(params, src, tmp_path / "hf")
    c = tiny_config(tmp_path, max_steps=2, lr=1e-9, min_lr=0.0, warmup_steps=0, weight_decay=0.0)
    c.init_from = str(tmp_path / "hf")
    c.data.tokenizer = "byte"
    s = train(c)
    got = s["state"].params
    assert got["wpe"]["embedding"].shape == (16, 32)  # cropped to model.block_size
    np.testing.assert_allclose(np.asarray(got["h_1"]["mlp"]["c_fc"]["kernel"]),
                               np.asarray(params["h_1"]["mlp"]["c_fc"]["kernel"]), atol=1e-6)


def test_model_settings_that_contradict_an_init_from_base_are_refused_and_free_ones_apply(tmp_path):
    """--config.model.n_embd=64 over a 32-wide base used to train the 32-wide model without a word."""
    from jaxgpt import save_pretrained
    src = GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32)
    save_pretrained(init_params(src, jax.random.key(7)), src, tmp_path / "hf")
    run = tiny_config(tmp_path / "run", max_steps=2, checkpoint_interval=2, eval_interval=2)
    run.data.tokenizer = "byte"
    train(run)
    for base in (str(tmp_path / "hf"), run.out_dir):  # a pretrained folder and a jaxgpt run folder
        c = tiny_config(tmp_path / "ft", max_steps=1, warmup_steps=0, eval_interval=1, checkpoint_interval=1)
        c.init_from, c.data.tokenizer, c.overwrite = base, "byte", True
        c.model.n_embd, c.model.mlp = 64, "swiglu"
        with pytest.raises(ValueError) as e:
            train(c)
        assert str(e.value).startswith(f"config.model contradicts the init_from base {base}: model.n_embd=64 but "
                                       "the base has n_embd=32, model.mlp='swiglu' but the base has mlp='gelu'")
        c.model.n_embd, c.model.mlp = 32, "gelu"  # agreeing with the base: fine; so are the free settings
        c.model.scan_layers = True
        if base == run.out_dir:  # (the costlier programs compiled for one base only)
            c.model.dropout, c.model.attention, c.model.remat = 0.1, "einsum", "block"
        s = train(c)
        assert s["steps"] == 1 and "h" in s["state"].params  # stacked: scan_layers applied


def test_several_steps_per_call_give_the_same_run(tmp_path):
    # 3 steps per call with evals every 5 and checkpoints every 4: calls of 3, 1, 1, 3, ... that end at
    # every event; the losses equal one step per call, and resume stays exact
    def run(name, max_steps, per_call, resume=False):
        c = tiny_config(tmp_path / name, max_steps=max_steps, decay_steps=14, log_interval=1, eval_interval=5,
                        checkpoint_interval=4, steps_per_call=per_call)
        if resume:
            c.init_from = "resume"
        return c, train(c)

    c1, _ = run("one", 14, 1)
    c3, s3 = run("three", 14, 3)
    a, b = _metrics(c1.out_dir), _metrics(c3.out_dir)
    steps = sorted(r["step"] for r in a if "loss" in r)
    assert steps == sorted(r["step"] for r in b if "loss" in r) == list(range(1, 15))
    np.testing.assert_allclose([r["loss"] for r in b if "loss" in r], [r["loss"] for r in a if "loss" in r],
                               rtol=0, atol=1e-5)
    assert [r["step"] for r in b if "val_loss" in r] == [5, 10, 14]
    half, _ = run("half", 8, 3)
    _, resumed = run("half", 14, 3, resume=True)
    assert resumed["start_step"] == 8
    c = [r["loss"] for r in _metrics(half.out_dir) if "loss" in r]
    assert c == [r["loss"] for r in b if "loss" in r]


def test_throughput_with_several_steps_per_call_is_each_calls_own(tmp_path):
    # 5 steps per call, a line per step: the steps of a call finish together; each line used to take the
    # time since the line before, which is 0 (clamped to 1e-9 s: 10^11 tok/s) for all but a call's first,
    # and that first reported one step's tokens over the whole call's time
    c = tiny_config(tmp_path, max_steps=20, log_interval=1, steps_per_call=5)
    train(c)
    lines = [r for r in _metrics(c.out_dir) if "tokens_per_s" in r]
    assert [r["step"] for r in lines] == list(range(1, 21))
    tokens_per_step = c.train.batch_size * c.model.block_size
    for r in lines:
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0, r
        assert 0 < r["mfu"] <= 1, r  # an honest MFU is at most 100% (Throughput.remeasure_peak)
    for call in range(4):  # steps 1-5, 6-10, ...: one call each, whose steps share its rate
        rates = [r["tokens_per_s"] for r in lines[5 * call:5 * call + 5]]
        np.testing.assert_allclose(rates, rates[0], rtol=1e-2)  # (time.time()'s rounding: ~1e-7 s)
    for before, r in zip(lines, lines[1:]):  # each line's rate: the tokens since the line before over its time
        if before["step"] % c.train.eval_interval == 0:
            continue  # (the time of an eval between them is not training's)
        seconds = r["elapsed_s"] - before["elapsed_s"]
        assert seconds > 0
        np.testing.assert_allclose(r["tokens_per_s"] * seconds, tokens_per_step * (r["step"] - before["step"]),
                                   rtol=1e-2)


def _metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("has_bf16", [False, True])
def test_bf16_on_a_cpu_without_bf16_instructions_computes_in_float32(tmp_path, monkeypatch, capsys, has_bf16):
    import dataclasses

    from jaxgpt.training import loop

    real = loop.resolve
    monkeypatch.setattr(loop, "resolve", lambda cfg: dataclasses.replace(real(cfg), fast_bf16=has_bf16))
    c = tiny_config(tmp_path, max_steps=2, warmup_steps=1, eval_interval=2, checkpoint_interval=2)
    c.model.dtype = "bfloat16"
    train(c)
    out = capsys.readouterr().out
    assert ("neither AVX512_BF16 nor AMX: computing in float32" in out) != has_bf16
    assert ("dtype float32" in out) != has_bf16 and ("dtype bfloat16" in out) == has_bf16


def test_cpu_flags_are_read_from_proc_cpuinfo():
    from jaxgpt.backends import cpu, resolve

    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    assert cpu.has_bf16_matmul() == bool({"avx512_bf16", "amx_bf16"} & flags)
    assert resolve("cpu").fast_bf16 == cpu.has_bf16_matmul()


@pytest.mark.parametrize("kind", ["pmap", "mesh"])
def test_runner_eval_gives_every_stacked_batch_its_mean_loss_in_one_call(kind):
    from jaxgpt.training import make_runner
    from jaxgpt.training.step import make_eval_step

    cfg = GPTConfig(vocab_size=40, block_size=8, n_layer=1, n_head=2, n_embd=16)
    opt = make_optimizer(default_config().train)
    runner = make_runner(kind, cfg, opt)
    params = init_params(cfg, jax.random.key(0))
    state = runner.init_state(lambda: create_train_state(init_params(cfg, jax.random.key(0)), opt,
                                                         jax.random.key(1)))
    data = np.random.default_rng(0).integers(0, 40, (5, 4, 9)).astype(np.int32)  # 4 rows: one per device
    got = np.asarray(runner.to_host(runner.eval(state, data[..., :-1], data[..., 1:])))
    want = [float(make_eval_step(cfg)(params, d[:, :-1], d[:, 1:])) for d in data]
    assert got.shape == (5,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
