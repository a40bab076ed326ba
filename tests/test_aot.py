"""jaxgpt-aot: a tiny model's train step and generate program compiled for a TPU topology and for two
H100s with no accelerator attached, the out-of-memory refusal (exit 2, one line), and its usage errors.
Needs the aot extra (libtpu, the CUDA plugin); skips without it."""

import json
import os
import re
import subprocess
import sys

import pytest

from jaxgpt import aot
from jaxgpt.training.config import default_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_aot = pytest.mark.skipif(aot.missing_extra() is not None, reason=f"aot extra: {aot.missing_extra()}")


def _tiny(**train):
    c = default_config()
    c.train.parallel = "mesh"
    c.data.tokenizer = "byte"
    c.model.block_size = 64
    c.model.n_layer = 2
    c.model.n_head = 4
    c.model.n_embd = 64
    c.train.batch_size = 8
    for k, v in train.items():
        c.train[k] = v
    return c


def test_target_strings():
    t = aot.parse_target("tpu:v5e:2x4")
    assert (t.platform, t.kind, t.shape, t.chips) == ("tpu", "v5e", (2, 4, 1), 8)
    assert aot.parse_target("tpu:v4:2x2x1", slices=2).chips == 8
    assert aot.parse_target("gpu:h200:8").shape == (8,)
    for bad, words in [("tpu:v9:2x2", "unknown TPU generation"), ("tpu:v5e:2by2", "chip counts per axis"),
                       ("gpu:a100:8", "unknown GPU"), ("gpu:h100:0", "positive integer"), ("h100", "bad --target"),
                       ("cpu:x:1", "unknown platform"),
                       # digits that str.isdigit takes and int() does not (or reads as another digit)
                       ("tpu:v5e:2x\u00b2", "chip counts per axis"), ("tpu:v5e:\uff12x2", "chip counts per axis"),
                       ("gpu:h100:\u00b2", "positive integer")]:
        with pytest.raises(aot.AotError, match=words):
            aot.parse_target(bad)


def test_topologies_beyond_the_generations_slices_are_refused_before_libtpu_sees_them():
    # libtpu describes tpu:v5e:64x64 and then aborts the process compiling for it (chip_bounds().x <= 16)
    for bad, words in [("tpu:v5e:64x64", "largest v5e slice is 16x16 (256 chips)"),
                       ("tpu:v6e:32x16", "largest v6e slice is 16x16"),
                       ("tpu:v4:32x4x4", "largest v4 slice is 16x16x16"),
                       ("tpu:v5p:16x16x32", "largest v5p slice is 16x16x24"),
                       ("tpu:v5e:2x2x2", "v5e slices are 2-D"),
                       ("tpu:v5e:3x16", "whole hosts of 2x4 chips"), ("tpu:v4:3x3x3", "whole hosts of 2x2 chips")]:
        with pytest.raises(aot.AotError, match=re.escape(words)):
            aot.parse_target(bad)
    # the generations' real slices, in any order of their axes, with the chips per host libtpu is given
    for good, host in [("tpu:v5e:16x16", (2, 4, 1)), ("tpu:v5e:1x1", (1, 1, 1)), ("tpu:v5e:2x2", (2, 2, 1)),
                       ("tpu:v6e:8x16", (2, 4, 1)), ("tpu:v4:16x16x16", (2, 2, 1)), ("tpu:v5p:24x16x16", (2, 2, 1))]:
        assert aot.tpu_host_bounds(aot.parse_target(good)) == host


@needs_aot  # (the target's devices are looked up first: without the extra that is the error)
def test_the_gpu_memory_fraction_is_a_number_in_0_1(monkeypatch):
    assert aot.gpu_mem_fraction() == aot.GPU_MEM_FRACTION or "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert aot.gpu_mem_fraction() == 0.9
    for bad in ("5", "abc", "0", "-0.5", "nan", "inf", ""):
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", bad)
        with pytest.raises(aot.AotError, match="must be a number in \\(0, 1\\]"):
            aot.gpu_mem_fraction()
        with pytest.raises(aot.AotError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
            aot.target_devices(aot.parse_target("gpu:h100:2"))  # before the CUDA plugin reads it


def test_programs_and_kernels_that_cannot_be_compiled_for_the_target_are_refused():
    assert aot.check_programs(["generate", "train", "generate"]) == ("generate", "train")
    for bad, words in [([], "names no program"), ([""], "names no program"), (["trian"], "unknown program 'trian'")]:
        with pytest.raises(aot.AotError, match=words):
            aot.check_programs(bad)
    config = _tiny()
    for kernels, platform in [("tpu", "gpu"), ("gpu", "tpu")]:
        config.model.kernels = kernels
        with pytest.raises(aot.AotError, match=f"kernels='{kernels}' is the {kernels.upper()} backend"):
            aot.model_config(config, 256, platform)  # (it compiled the kernel in interpret mode: "fits")
        assert aot.model_config(config, 256, kernels)[1].name == kernels
    with pytest.raises(aot.AotError, match="--slices"):
        aot.parse_target("tpu:v5e:2x2", slices=0)


def test_vocab_comes_from_the_tokenizer_name():
    c = default_config()
    for tok, size in [("gpt2", 50257), ("byte", 256)]:
        c.data.tokenizer = tok
        assert aot.vocab_size_for(c) == size
    c.data.tokenizer, c.data.vocab_size = "bpe", 1024
    assert aot.vocab_size_for(c) == 1024
    c.data.tokenizer = "char"
    with pytest.raises(aot.AotError, match="--vocab_size"):
        aot.vocab_size_for(c)
    assert aot.vocab_size_for(c, 65) == 65


def test_a_gpt2_name_compiles_gpt2s_architecture_from_the_sizes_table():
    from jaxgpt.model import num_params
    from jaxgpt.pretrained import GPT2_SIZES

    c = default_config()  # (its model.n_embd is 384: the MLP must still be GPT-2's 4 * n_embd)
    c.init_from, c.model.block_size = "gpt2-medium", 1024
    gcfg, _ = aot.model_config(c, 50257, "tpu")
    assert (gcfg.n_layer, gcfg.n_head, gcfg.n_embd) == GPT2_SIZES["gpt2-medium"] and gcfg.mlp_hidden == 4096
    assert num_params(gcfg, non_embedding=False) == 354_823_168  # GPT-2 medium's parameters


@needs_aot
@pytest.mark.parametrize("target, kind, fsdp", [("tpu:v5e:2x2", "TPU v5 lite", False),
                                              ("gpu:h100:2", "NVIDIA H100 80GB HBM3", True)])
def test_train_step_and_generate_compile_for_the_target(target, kind, fsdp):
    aot.prepare_environment()
    # TPU: the pmap step (shard_map per device, where the splash kernel runs); GPU: the FSDP mesh step
    config = _tiny(parallel="mesh", fsdp=True) if fsdp else _tiny(parallel="pmap")
    r = aot.compile_for_target(config, aot.parse_target(target), progress=False,
                               generate_args={"prompt_len": 8, "max_new_tokens": 8})
    n = aot.parse_target(target).chips
    assert r["device_kind"] == kind and r["device_count"] == n and r["fits"]
    train, gen = r["programs"]["train"], r["programs"]["generate"]
    for p in (train, gen):
        assert p["fits"] and 0 < p["peak_bytes"] < p["limit_bytes"] and p["compile_s"] > 0
        assert p["argument_bytes"] > 0 and set(p["collectives"]) == set(aot.COLLECTIVES)
        # the peak is what the device holds during the call (libtpu's own peak_memory_in_bytes, which
        # also counts copies in VMEM, was below the temporaries alone for this tiny generate program)
        assert p["peak_bytes"] == p["argument_bytes"] + p["output_bytes"] - p["alias_bytes"] + p["temp_bytes"]
        assert p["peak_bytes"] >= p["temp_bytes"] and p["compiler_peak_bytes"] > 0
    assert train["per_device_batch"] == 8 // n and train["formula_flops_per_device"] > 0
    if fsdp:  # parameters gathered for the matmuls, gradients reduce-scattered back to their shards
        assert train["parallel"] == "mesh (fsdp)"
        assert train["collectives"]["all-gather"] > 0 and train["collectives"]["reduce-scatter"] > 0
    else:  # replicated state: the gradients' all-reduce only
        assert train["parallel"].startswith("pmap") and train["collectives"]["all-reduce"] > 0
    if target.startswith("tpu"):  # the TPU compiler counts flops (the GPU one does not)
        assert 0.8 < train["flops_ratio"] < 1.5
        assert train["kernels"] == "tpu" and train["custom_calls"].get("tpu_custom_call", 0) > 0  # splash
        assert "does not count the Pallas kernels' flops" in aot.format_result(r)  # why the ratio is low
    else:
        assert train["kernels"] == "gpu" and train["custom_calls"].get("__gpu$xla.gpu.triton", 0) > 0  # Pallas


@needs_aot
def test_a_2d_mesh_step_with_splash_compiles_for_a_tpu():
    # train.mesh (which implies parallel=mesh): splash runs per batch shard in shard_map, the state is
    # sharded over fsdp only (parameters gathered over it, gradients reduce-scattered back)
    aot.prepare_environment()
    config = _tiny(parallel="pmap", mesh="data=2,fsdp=2", grad_accum=2)
    train = aot.compile_for_target(config, aot.parse_target("tpu:v5e:2x2"), progress=False,
                                   programs=("train",))["programs"]["train"]
    assert train["fits"] and train["kernels"] == "tpu" and train["parallel"] == "mesh (data=2, fsdp=2)"
    assert train["custom_calls"].get("tpu_custom_call", 0) > 0  # splash's forward and backward kernels
    assert train["collectives"]["all-gather"] > 0 and train["collectives"]["reduce-scatter"] > 0
    assert 0.8 < train["flops_ratio"] < 1.5


@needs_aot
def test_a_step_too_big_is_refused_in_one_line(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "jaxgpt.cli.aot", "--target=tpu:v5e:2x2", "--programs=train", "--vocab_size=2000000",
           "--config=configs/shakespeare_char_cpu.py", "--config.model.n_layer=1", "--config.model.n_embd=2048",
           "--config.model.n_head=16", "--config.train.batch_size=8", f"--json={out}"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("jaxgpt-aot: error: the train step does not fit tpu:v5e:2x2: "
                                                     "peak "), r.stderr
    assert "limit 15.75 GiB" in errors[0]
    assert "Traceback" not in r.stderr and "cudart" not in r.stderr
    assert json.loads(out.read_text())["programs"]["train"]["fits"] is False


def test_usage_errors_are_one_line():
    base = [sys.executable, "-m", "jaxgpt.cli.aot"]
    cases = [(["--target=tpu:v9:2x2"], "unknown TPU generation"), ([], "--target is required"),
             (["--target=tpu:v5e:2x2", "--config.model.nonexistent=1"], "unknown config key")]
    procs = [subprocess.Popen(base + args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args, _ in cases]  # all at once: each is mostly imports
    for p, (_, words) in zip(procs, cases):
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2 and err.count("\n") == 1 and words in err, err
        assert err.startswith("jaxgpt-aot: error: "), err


@needs_aot  # (the target's devices are looked up first: without the extra that is the error)
def test_inputs_a_user_types_end_in_one_line_before_any_compile(tmp_path):
    base = [sys.executable, "-m", "jaxgpt.cli.aot", "--config=configs/shakespeare_char_cpu.py", "--vocab_size=65"]
    cases = [(["--target=tpu:v5e:64x64", "--programs=generate"], {}, "largest v5e slice is 16x16"),
             (["--target=tpu:v5e:2x\u00b2"], {}, "chip counts per axis"),
             (["--target=tpu:v5e:2x2", "--programs="], {}, "--programs names no program"),
             (["--target=tpu:v5e:2x2", f"--json={tmp_path}"], {}, "is a folder; give a file path"),
             (["--target=tpu:v5e:2x2", "--engine_packed=64"], {}, "add engine to --programs"),
             (["--target=tpu:v5e:1x1", "--programs=engine", "--engine_packed=4096"], {}, "packed prefill needs"),
             (["--target=tpu:v5e:2x2", "--engine_mesh=tensor=4"], {}, "add engine to --programs"),
             (["--target=tpu:v5e:2x2", "--engine_page_size=8"], {}, "add paged to --programs"),
             (["--target=tpu:v5e:2x2", "--engine_slots=8"], {}, "add engine or paged to --programs"),
             (["--target=tpu:v5e:2x2", "--programs=engine", "--engine_mesh=tensor=4", "--engine_packed=64"], {},
              "not run on a mesh"),
             (["--target=tpu:v5e:2x2", f"--json={tmp_path / 'missing' / 'r.json'}"], {}, "cannot write --json="),
             (["--target=gpu:h100:2"], {"XLA_PYTHON_CLIENT_MEM_FRACTION": "abc"}, "must be a number in (0, 1]"),
             (["--target=gpu:h100:2"], {"XLA_PYTHON_CLIENT_MEM_FRACTION": "5"}, "must be a number in (0, 1]")]
    procs = [subprocess.Popen(base + args, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args, env, _ in cases]
    for p, (args, _, words) in zip(procs, cases):
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2 and err.count("\n") == 1 and words in err, (args, err)
        assert err.startswith("jaxgpt-aot: error: "), err
    assert os.listdir(tmp_path) == []  # nothing written where the figures could not go


@needs_aot
def test_cudnn_attention_for_a_gpu_target_is_one_line_or_compiles(tmp_path):
    # the documented GPU path: cuDNN's attention needs its libraries to compile, which the aot extra lacks
    # (the parameter count used to trace the model with it, and failed first, in a traceback)
    cmd = [sys.executable, "-m", "jaxgpt.cli.aot", "--target=gpu:h100:2", "--programs=train", "--vocab_size=65",
           "--config=configs/shakespeare_char_cpu.py", "--config.model.attention=cudnn", "--config.model.n_layer=1",
           "--config.model.n_embd=64", "--config.model.n_head=2", "--config.model.block_size=32",
           "--config.model.dtype=bfloat16", "--config.train.batch_size=4"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    if r.returncode == 0:  # (where the cuDNN libraries are installed)
        assert "__cudnn" in r.stdout, r.stdout
    else:
        errors = [line for line in r.stderr.splitlines() if "error" in line]
        assert r.returncode == 2 and len(errors) == 1 and "needs cuDNN" in errors[0], r.stderr


@needs_aot
@pytest.mark.parametrize("target", ["tpu:v5e:1x1", "gpu:h100:1"])
def test_the_engine_compiles_for_the_target_and_says_how_many_slots_fit(target):
    aot.prepare_environment()
    r = aot.compile_for_target(_tiny(), aot.parse_target(target), programs=("engine",), progress=False,
                               engine_args={"slots": 4, "max_len": 32, "chunk": 8})
    e = r["programs"]["engine"]
    assert r["fits"] and e["fits"] and e["slots"] == 4 and e["prefill"]["peak_bytes"] > 0
    # a slot's keys and values: 2 x layers x kv heads x positions x head dim x 4 bytes
    assert e["cache_bytes_per_slot"] == 2 * 2 * 4 * 32 * 16 * 4 and e["cache_bytes"] == 4 * e["cache_bytes_per_slot"]
    # a slot's bytes in the compiled step (measured at twice the slots) are at least its cache's; the slots
    # that fit fill the device beside what does not grow with them
    assert e["bytes_per_slot"] >= e["cache_bytes_per_slot"]
    fixed = max(e["peak_bytes"], e["prefill"]["peak_bytes"]) - 4 * e["bytes_per_slot"]
    assert e["slots_that_fit"] == (e["limit_bytes"] - fixed) // e["bytes_per_slot"] > 4
    assert f"that fit beside the weights: {e['slots_that_fit']}" in aot.format_result(r)


@needs_aot
@pytest.mark.parametrize("target", ["tpu:v5e:1x1", "gpu:h100:1"])
def test_every_paged_engine_program_compiles_and_says_how_many_tokens_fit(target):
    from jaxgpt.cli.serve import DEFAULT_DECODE_STEPS
    from jaxgpt.engine import runner, slots

    aot.prepare_environment()
    r = aot.compile_for_target(_tiny(), aot.parse_target(target), programs=("paged",), progress=False,
                               engine_args={"slots": 4, "max_len": 32, "page_size": 8, "token_budget": 16})
    e = r["programs"]["paged"]
    # the list warmup() runs: every step shape with and without prompt logprobs, and the multi-step decodes
    shapes = runner.step_shapes(16, 4)
    want = runner.programs(shapes, runner.shape_steps(shapes, slots.steps_by_rows(DEFAULT_DECODE_STEPS, 4)))
    assert e["programs"] == len(e["steps"]) == len(want) and r["fits"] and e["fits"]
    assert [(s["tokens"], s["requests"], s["kind"]) for s in e["steps"]] == [(t, q, k) for (t, q), k in want]
    # a page's keys and values: 2 x layers x kv heads x positions x head dim x 4 bytes; measured at least that
    assert e["page_bytes"] == 2 * 2 * 4 * 8 * 16 * 4 and e["bytes_per_page"] >= e["page_bytes"]
    fixed = max(s["peak_bytes"] for s in e["steps"]) - 2 * e["bytes_per_page"]
    assert e["pages_that_fit"] == (e["limit_bytes"] - fixed) // e["bytes_per_page"] > 100
    assert e["tokens_that_fit"] == 8 * e["pages_that_fit"]
    assert f"tokens of cache that fit beside the weights: {e['tokens_that_fit']}" in aot.format_result(r)
    if target.startswith("tpu"):  # only the largest step: its figures, from one compile (and its grown twin)
        one = aot.compile_for_target(_tiny(), aot.parse_target(target), programs=("paged",), progress=False,
                                     engine_args={"slots": 4, "max_len": 32, "page_size": 8, "token_budget": 16,
                                                  "largest_only": True})["programs"]["paged"]
        assert one["programs"] == 1 and [(s["tokens"], s["kind"]) for s in one["steps"]] == [(16, "step")]
        assert "only the largest compiled" in aot.format_result({**r, "programs": {"paged": one}})


@needs_aot
def test_the_packed_prefill_compiles_for_the_target_and_counts_in_what_fits():
    aot.prepare_environment()
    tpu = aot.parse_target("tpu:v5e:1x1")
    args = {"slots": 4, "max_len": 32, "chunk": 8}
    plain = aot.compile_for_target(_tiny(), tpu, programs=("engine",), progress=False, engine_args=args)
    r = aot.compile_for_target(_tiny(), tpu, programs=("engine",), progress=False,
                               engine_args={**args, "packed": 48})
    e, p = r["programs"]["engine"], plain["programs"]["engine"]
    assert "prefill_packed" not in p and e["fits"] and e["prefill_packed"]["tokens"] == 48
    assert e["prefill_packed"]["peak_bytes"] > 0 and e["prefill_packed"]["argument_bytes"] > 0
    peak = max(e["peak_bytes"], e["prefill"]["peak_bytes"], e["prefill_packed"]["peak_bytes"])
    fixed = peak - 4 * e["bytes_per_slot"]
    assert e["slots_that_fit"] == (e["limit_bytes"] - fixed) // e["bytes_per_slot"]
    assert "packed prefill of 48 tokens peak" in aot.format_result(r)
    for bad in ({**args, "packed": 1}, {**args, "packed": 65}, {**args, "slots": 1, "packed": 16}):
        with pytest.raises(aot.AotError, match="packed prefill needs"):
            aot.compile_for_target(_tiny(), tpu, programs=("engine",), progress=False, engine_args=bad)


@needs_aot
def test_the_engine_compiles_on_a_tensor_mesh_its_cache_and_attention_split_by_heads():
    # as an Engine over params placed on a tensor=4 mesh: the weights by the rules table, attention per
    # device on its own heads and the cache split by kv head (a quarter of each slot's keys and values a chip)
    aot.prepare_environment()
    r = aot.compile_for_target(_tiny(), aot.parse_target("tpu:v5e:2x2"), programs=("engine",), progress=False,
                               engine_args={"slots": 4, "max_len": 32, "chunk": 8, "mesh": "tensor=4"})
    e = r["programs"]["engine"]
    assert r["fits"] and e["mesh"] == "tensor=4" and e["prefill"]["peak_bytes"] > 0
    assert e["cache_bytes"] == 4 * 2 * 2 * 4 * 32 * 16 * 4 and e["cache_bytes_per_chip"] == e["cache_bytes"] // 4
    assert e["weight_bytes_per_chip"] < e["weight_bytes"] // 2  # the blocks' matrices split four ways
    # a slot's bytes on a chip are at least its quarter of the cache, and the step's arguments hold less
    # than the weights and cache whole
    assert e["bytes_per_slot"] >= e["cache_bytes_per_chip"] // 4
    assert e["argument_bytes"] < e["weight_bytes"] + e["cache_bytes"] // 2
    assert e["collectives"]["all-reduce"] > 0  # the row-parallel partial sums
    assert "on mesh tensor=4" in aot.format_result(r)


@needs_aot
def test_the_int8_engine_compiles_for_a_tpu_holding_int8_kernels_instead_of_float_ones():
    from jaxgpt import quantize
    from jaxgpt.model import abstract_params

    aot.prepare_environment()
    tpu = aot.parse_target("tpu:v5e:1x1")
    # 8 slots of 64 positions: a slot's bytes are the growth of the decode step's peak from 8 slots to 16,
    # over 8, and the compiler's fixed temporaries move by some 40 KB between such programs (at 4 slots of
    # 32 positions the int8 cache's step measured 64 KB a slot one day, 39 KB another, against 10 KB of cache)
    results = [aot.compile_for_target(_tiny(), tpu, programs=("engine",), progress=False,
                                      engine_args={"slots": 8, "max_len": 64, "chunk": 8, "quantize": q, "kv_dtype": kv})
               for q, kv in [(None, None), ("int8", None), ("int8", "int8"), ("w8a8", None)]]
    figures = [r["programs"]["engine"] for r in results]
    r = results[2]  # int8 weights and cache
    f, q8, kv8, w8a8 = figures
    # w8a8 holds the same int8 weights as int8 (its activations are rounded inside the programs)
    assert w8a8["quantize"] == "w8a8" and w8a8["weight_bytes"] == q8["weight_bytes"] and w8a8["fits"]
    assert all(e["fits"] for e in figures) and (q8["quantize"], kv8["kv_dtype"]) == ("int8", "int8")
    # the weights given: the int8 kernels and their scales, and of the float leaves they stand for only the
    # tied table (the embedding lookup reads it)
    gcfg = aot.model_config(_tiny(), 256, "tpu")[0]
    sizes = quantize.int8_bytes(abstract_params(gcfg), gcfg)
    wte = gcfg.vocab_size * gcfg.n_embd * 4
    assert q8["weight_bytes"] - q8["float_weight_bytes"] == sizes["int8"]
    assert q8["float_weight_bytes"] == f["weight_bytes"] - sizes["float"] + wte
    # both programs take fewer bytes: the decode step and the prefill hold no float copy of the kernels
    assert q8["argument_bytes"] < f["argument_bytes"]
    assert q8["prefill"]["argument_bytes"] < f["prefill"]["argument_bytes"]
    # the int8 cache: 16 int8 values and a float32 scale per key or value vector, 20/64 of float32's bytes
    assert kv8["cache_bytes_per_slot"] == f["cache_bytes_per_slot"] * 20 // 64
    assert kv8["argument_bytes"] < q8["argument_bytes"] and kv8["slots_that_fit"] > q8["slots_that_fit"]
    assert "weights int8" in aot.format_result(r) and "a slot, int8)" in aot.format_result(r)


@needs_aot
@pytest.mark.parametrize("target, custom_call", [("tpu:v5e:2x2", "tpu_custom_call"),
                                                 ("gpu:h100:2", "__gpu$xla.gpu.triton")])
def test_a_document_masked_step_compiles_with_the_accelerators_own_kernels(target, custom_call):
    # data.align='document' (doc_mask on): the step takes the rows' document ids, which splash (per batch
    # shard on the mesh) and the Pallas GPU kernel take as their own segment ids
    aot.prepare_environment()
    config = _tiny(parallel="mesh", mesh="data=2,fsdp=-1" if target.startswith("tpu") else "")
    config.data.align = "document"
    config.data.tokenizer = "gpt2"  # (one with an end-of-text token: the config check refuses bytes' documents)
    train = aot.compile_for_target(config, aot.parse_target(target), vocab_size=256, progress=False,
                                   programs=("train",))["programs"]["train"]
    assert train["fits"] and train["doc_mask"] is True
    assert train["custom_calls"].get(custom_call, 0) > 0
