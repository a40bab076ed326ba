"""The benchmarks run in smoke modes on the CPU, so that the scripts never rot (the accelerator one before a
GPU is lent)."""

import json

import numpy as np
import pytest

from bench.accelerator import main


def test_accelerator_benchmark_smoke(tmp_path):
    import glob

    out = tmp_path / "accelerator.json"
    results = main(["--smoke", "--out", str(out), "--profile", str(tmp_path / "profile")])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    (xplane,) = glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert b"make_train_step.<locals>.train_step" in open(xplane, "rb").read()  # --profile traced the step
    train = results["train"]
    assert train["tokens_per_s"] > 0 and train["model_flops_per_s"] > 0
    assert train["mfu"] is None  # no datasheet peak for a CPU: reported as unknown, not guessed
    assert [r["batch"] for r in results["decode"]] == [1, 2]
    assert all(r["tokens_per_s"] > 0 and r["bytes_per_s"] > 0 for r in results["decode"])
    assert results["attention"] == "dot_product" and results["smoke"] is True


def test_attention_benchmark_smoke(tmp_path, monkeypatch):
    """bench/attention.py times the CPU kernels' attention and the portable core's on a train config's
    shape, and checks them against each other (outputs and all three input gradients)."""
    from bench import attention

    written = {}
    monkeypatch.setattr(attention, "write_results", lambda name, results: written.setdefault(name, results))
    results = attention.main(["--configs", "baby", "--reps", "1", "--no-peer"])
    assert written == {"attention": results}
    rows = {r["impl"]: r for r in results["runs"]}
    from jaxgpt.backends import native
    assert set(rows) == {"cpu xla", "portable"} | ({"cpu native"} if native.available() else set())
    b, t, n, h = attention.shapes("baby")
    assert rows["portable"]["shape"] == [b, t, n, h] and rows["portable"]["max_abs_diff"] == 0.0
    for impl in set(rows) - {"portable"}:
        assert rows[impl]["max_abs_diff"] < 1e-4  # the same function, to float rounding
    for r in rows.values():
        assert r["fwd_s"] > 0 and r["fwd_bwd_s"] > 0
        assert r["fwd_bwd_flops_per_s"] == 3 * attention.causal_flops(b, t, n, h) / r["fwd_bwd_s"]


FAKE_NANOGPT_MODEL = """
import torch
class GPTConfig:
    def __init__(self, **kw):
        self.__dict__.update(kw)
class GPT(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        print("number of parameters: (a stand-in for nanoGPT's model.py)")
        self.emb, self.head = torch.nn.Embedding(c.vocab_size, 8), torch.nn.Linear(8, c.vocab_size)
    def forward(self, x, y):
        logits = self.head(self.emb(x))
        return logits, torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    def configure_optimizers(self, weight_decay, lr, betas, device):
        return torch.optim.AdamW(self.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
"""


def test_train_benchmark_times_every_side_in_every_round(tmp_path, monkeypatch):
    """bench/train.py builds jaxgpt's variants and both peers, then times them in turns, round after
    round; nanoGPT's side (here a stand-in model.py) is one subprocess that waits between rounds."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from bench import train

    (tmp_path / "nanogpt").mkdir()
    (tmp_path / "nanogpt" / "model.py").write_text(FAKE_NANOGPT_MODEL)
    monkeypatch.setattr(train, "write_results", lambda name, results: name)
    monkeypatch.setattr(train, "ceilings", lambda: {"matmul_fp32_flops": 1e9, "matmul_bf16_flops": 1e9,
                                                    "read_bytes_per_s": 1e9})
    rows = train.main(["--configs", "tiny", "--dtypes", "float32", "--steps", "2", "--rounds", "2",
                       "--nanogpt", str(tmp_path / "nanogpt")])
    (row,) = rows
    assert row["config"] == "tiny" and row["dtype"] == "float32"
    assert {k: len(v) for k, v in row["all_ms"].items()} == {"('float32', 'auto')": 4, "transformers": 4,
                                                             "nanogpt": 4}
    assert row["ms_per_step"] > 0 and row["peer"]["ms_per_step"] > 0 and row["nanogpt"]["ms_per_step"] > 0
    assert row["speedup_vs_nanogpt"] == pytest.approx(row["nanogpt"]["ms_per_step"] / row["ms_per_step"])


def test_speedrun_ablations_toggle_each_piece_into_a_valid_config():
    from bench.speedrun import PIECES, load_config, toggles
    from jaxgpt.training.config import validate_config
    config = load_config("configs/speedrun_char_cpu.py")
    t = toggles(config, sorted(PIECES))
    assert t["muon"] == ("without", {"train.optimizer": "adamw"})
    assert t["embed_skip"] == ("with", {"model.embed_skip": True})  # off in the speedrun config
    for name, (how, overrides) in t.items():
        c = load_config("configs/speedrun_char_cpu.py")
        for key, value in overrides.items():
            section, field = key.split(".")
            assert c[section][field] != value, f"toggling {name} changes nothing"
            c[section][field] = value
        validate_config(c, device_count=1)


def test_memory_fit_table_names_each_rows_attention_and_loss():
    from bench.memory_fit import FAST, table
    best = {"peak_bytes": 5 * 2 ** 30, "limit_bytes": 16 * 2 ** 30, "collectives": {"all-gather": 3}}
    rows = {"gpt2-1.5b/v5e-8/fsdp/block": {"largest_fitting": 6, "smallest_failing": 7, "best": best},
            "gpt2-1.5b/v5e-8/fsdp/block/fast": {"largest_fitting": 40, "smallest_failing": 48, "best": best},
            "gpt2-1.5b/h100x8/fsdp/block/fast": {"largest_fitting": 20, "smallest_failing": 24, "best": best}}
    lines = table(rows).splitlines()[2:]
    assert "| XLA, whole logits | 6 x 1024 |" in lines[0]
    assert "| splash, chunks of 256 | 40 x 1024 |" in lines[1]
    assert "| Pallas flash, chunks of 256 | 20 x 1024 |" in lines[2]
    assert all(row[4] == "fast" and row[3] == "block" for row in FAST)


def test_engine_benchmark_smoke():
    """bench/engine.py replays arrivals on the engine and on fixed batches and times a lone request."""
    from bench import engine

    results = engine.main(["--tiny", "--concurrency", "2", "--new-tokens", "4", "--min-new-tokens", "2",
                           "--min-prompt", "2", "--max-prompt", "9", "--prefill-chunk", "8", "--prefill-budget",
                           "24", "--packed", "--top-k", "0", "--paged", "--token-budget", "16", "8", "--compare-async",
                           "--page-size", "4", "--kv-dtype", "int8"])
    (run,) = results["runs"]
    assert results["kv_dtype"] == "int8"  # (every side's cache int8)
    assert run["requests"] == 8 and run["engine_programs"] >= 2 and results["min_new_tokens"] == 2
    assert results["top_k"] is None  # (draws over the whole vocabulary)
    # the serial bound is at least a request's own prefill: past it, a TTFT is no later than past its prefill
    assert run["engine_ttft_past_serial_p99_steps"] <= run["engine_ttft_past_prefill_p99_steps"] + 1e-9
    assert run["packed_tokens_per_s"] > 0 and run["packed_calls"] >= 1
    assert run["fixed_prefill_s"] > 0 and 0 <= run["fixed_prefill_padding_share"] < 1
    assert run["engine_tokens_per_s"] > 0 and run["fixed_tokens_per_s"] > 0 and run["engine_ttft_p99_s"] > 0
    # the gaps between a request's tokens as they reach the caller (a call's tokens together: gaps of ~0)
    assert 0 <= run["engine_itl_p50_s"] <= run["engine_itl_p99_s"] and run["engine_itl_p99_s"] > 0
    assert set(results) >= {"lone_request_slots_1", "lone_request_slots_2"}
    # how the load became calls: every token past each request's first from a decode step's row
    calls = run["engine_calls"]
    assert calls["mean_batch"] * calls["decode_steps"] >= run["engine_tokens"] - run["requests"] - 1e-6
    assert 0 < calls["mean_batch"] <= calls["mean_width"] <= 2 and calls["prefill_calls"] >= 1
    assert 0 < calls["prefill_share"] < calls["busy_share"] <= 1
    # the same requests through the paged engine
    assert run["paged_tokens_per_s"] > 0 and run["paged_programs"] >= 1 and 0 < run["paged_peak_pages"]
    assert 0 <= run["paged_host_share"] < 1 and 0 <= run["paged_padding_share"] < 1
    assert run["paged_ttft_past_serial_p99_steps"] <= run["paged_ttft_past_prefill_p99_steps"] + 1e-9
    # the step-cost fit over the replay's calls (prompt chunks and decode steps: several sizes), and what it implies
    a, b = run["paged_step_fixed_s"], run["paged_step_per_token_s"]
    assert np.isfinite(a) and np.isfinite(b) and run["paged_full_step_s"] == pytest.approx(a + 16 * b)
    assert run["paged_ramp_load"] == pytest.approx(b * run["paged_mean_prompt"] / run["decode_step_s"])
    # each budget asked for replayed in turn, the first's figures at the top
    assert [r["paged_token_budget"] for r in run["paged_by_budget"]] == [16, 8] and run["paged_token_budget"] == 16
    assert all(r["paged_tokens_per_s"] > 0 and not r["paged_async_scheduling"] for r in run["paged_by_budget"])
    assert run["paged_async"]["paged_async_scheduling"] and run["paged_async"]["paged_token_budget"] == 16
    for lone in (results["lone_request_slots_1"], results["lone_request_slots_2"]):  # the paged engine's too
        # (each rate is a difference of two timings, which on this tiny model a busy machine can make negative:
        # the ratio's definition is checked, not its sign)
        assert lone["paged_over_generate"] == lone["paged_tokens_per_s"] / lone["generate_tokens_per_s"]


def test_prefix_benchmark_smoke():
    """bench/prefix.py: a shared system prompt through the paged engine with and without its prefix cache."""
    from bench import prefix

    results = prefix.main(["--tiny", "--concurrency", "2", "--no-dense", "--page-size", "4", "--token-budget", "16"])
    cached, uncached = results["paged_cached"], results["paged_uncached"]
    assert cached["prefix_hits"] > 0 and uncached["prefix_hits"] == 0
    assert cached["prompt_tokens_run"] < uncached["prompt_tokens_run"]


def test_the_serial_bound_prefills_each_arrival_after_the_ones_before_it():
    from types import SimpleNamespace

    from bench import engine

    done = [SimpleNamespace(submitted=a, prefill_s=p) for a, p in [(0.15, 0.1), (0.0, 0.2), (0.1, 0.05), (1.0, 0.3)]]
    # by arrival: 0.0 -> ends 0.2; 0.1 waits -> 0.25; 0.15 waits -> 0.35; 1.0 finds nothing before it -> 1.3
    np.testing.assert_allclose(engine.serial_bound(done), [0.2, 0.2, 0.15, 0.3])


def test_serve_benchmark_smoke(monkeypatch):
    """bench/serve.py exports random weights with a byte-level BPE of the model's vocabulary to one Hugging
    Face folder, serves it with jaxgpt-serve (a subprocess) and loads it with its built-in client (no vLLM)."""
    from bench import serve
    from jaxgpt.data import get_tokenizer

    tok = get_tokenizer("bpe", tokenizer_json=serve.byte_level_bpe_json(50257))
    assert tok.vocab_size == 50257 and tok.eos_id == 50256
    assert tok.decode(tok.encode("héllo, wörld")) == "héllo, wörld"
    monkeypatch.setattr(serve, "write_results", lambda name, results: pytest.fail("the smoke run writes nothing"))
    results = serve.main(["--smoke"])
    assert results["client"] == "built-in" and results["vllm"] is None and results["errors"] == {}
    assert [(r["server"], r["concurrency"]) for r in results["runs"]] == [("jaxgpt-serve", 1), ("jaxgpt-serve", 2)]
    for r in results["runs"]:
        assert r["completed"] == r["num_prompts"] and r["failed"] == 0
        assert r["total_output_tokens"] == 8 * r["num_prompts"]  # ignore_eos: every request runs to max_tokens
        assert r["output_throughput"] > 0 and 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"]
        e = r["engine"]  # from the server's /metrics (the paged engine, the default): 7 of each request's 8
        # tokens from decode tokens of its steps, the first drawn after its prompt's last chunk
        assert e["paged"] and e["decode_tokens_per_step"] * e["steps"] == pytest.approx(7 * r["num_prompts"])
        assert e["prompt_tokens_per_step"] * e["steps"] >= r["num_prompts"] and e["calls"] <= e["steps"]
        assert e["busy_share"] > 0 and 0 < e["host_share"] <= 1
    base = results["generate_batch_1"]  # Decoder.generate at batch 1 on the folder's weights, same kind of load
    assert base["requests"] == 2 and base["quantize"] is None and base["output_throughput"] > 0
    assert results["serve_1_over_generate"] == results["runs"][0]["output_throughput"] / base["output_throughput"]
    again = results["generate_batch_1_after"]  # and right after the server's run at 1 request
    assert again["requests"] == 2 and again["output_throughput"] > 0
    mean = (base["output_throughput"] + again["output_throughput"]) / 2
    assert results["serve_1_over_generate_around"] == pytest.approx(results["runs"][0]["output_throughput"] / mean)


def test_cold_start_benchmark_smoke():
    """bench/cold_start.py: jaxgpt-serve on an empty compile cache answers, then finishes compiling its
    programs in the background (the paged engine's default)."""
    from bench import cold_start

    out = cold_start.main(["--smoke", "--runs", "1", "--", "--slots=2", "--token_budget=8"])
    (r,) = out["runs"]
    assert "paged engine: 2 requests" in r["ready_line"] and out["flags"] == ["--slots=2", "--token_budget=8"]
    assert 0 < r["ready_s"] <= r["all_compiled_s"] and r["first_completion_s"] > 0


def test_serve_benchmark_compares_configurations_in_one_run(monkeypatch):
    """Several --jaxgpt-args: one server each, in turn, each at 1 request against generate with its own
    quantization, and a summary per configuration."""
    from bench import serve

    monkeypatch.setattr(serve, "write_results", lambda name, results: pytest.fail("the smoke run writes nothing"))
    results = serve.main(["--smoke", "--jaxgpt-args=--decode_steps=2", "--jaxgpt-args=--quantize=int8"])
    assert results["errors"] == {} and results["rounds"] == 1
    runs = results["runs"]
    assert [(r["server"], r["concurrency"], r["config"]) for r in runs] == [
        ("jaxgpt-serve #1", 1, 1), ("jaxgpt-serve #1", 2, 1), ("jaxgpt-serve #2", 1, 2), ("jaxgpt-serve #2", 2, 2)]
    assert runs[0]["jaxgpt_args"][-1] == "--decode_steps=2" and runs[2]["jaxgpt_args"][-1] == "--quantize=int8"
    assert all(r["completed"] == r["num_prompts"] and r["failed"] == 0 for r in runs)
    bases = results["generate_batch_1_by_config"]  # generate mirrors each server's kernels
    assert [b["quantize"] for b in bases] == [None, "int8"]
    for lone, base in ((runs[0], bases[0]), (runs[2], bases[1])):
        mean = (base["output_throughput"] + lone["generate_after"]["output_throughput"]) / 2
        assert lone["serve_1_over_generate_around"] == pytest.approx(lone["output_throughput"] / mean)
    summary = results["by_config"]
    assert [s["jaxgpt_args"] for s in summary] == results["jaxgpt_configs"]
    assert summary[1]["output_throughput"] == {1: [runs[2]["output_throughput"]], 2: [runs[3]["output_throughput"]]}
    assert summary[1]["serve_1_over_generate_around"] == [runs[2]["serve_1_over_generate_around"]]


def test_distilled_draft_is_a_run_the_speculative_bench_takes(tmp_path):
    """bench/distill_draft.py trains a draft on its target's greedy continuations and writes a run folder
    (the draft's config and tokenizer, new params) that bench/decode.py's speculative comparison loads; the
    speculative output equals plain greedy decoding's."""
    import jax
    import numpy as np

    from bench import decode, distill_draft
    from jaxgpt.loading import load_model
    from jaxgpt.training import train
    from tests.helpers import tiny_config

    target = tiny_config(tmp_path / "target", max_steps=10)
    draft = tiny_config(tmp_path / "draft", max_steps=10)
    draft.model.n_layer, draft.model.n_embd = 1, 16
    target.data.tokenizer = draft.data.tokenizer = "byte"  # (the bench's prompts are not in a char vocabulary)
    train(target)
    train(draft)
    out = str(tmp_path / "distilled")
    distill_draft.main([target.out_dir, draft.out_dir, out, "--prompts", "8", "--prompt-len", "4", "--steps", "6",
                        "--batch", "4"])
    d_cfg, d_params, d_tok, _ = load_model(draft.out_dir)
    o_cfg, o_params, o_tok, meta = load_model(out)
    assert o_cfg == d_cfg and o_tok.to_dict() == d_tok.to_dict() and meta["distilled"]["steps"] == 6
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(d_params), jax.tree.leaves(o_params)))
    rows = decode.run_speculative(target.out_dir, out, k=2, new_tokens=4, reps=1)
    assert len(rows) == 6 and all(r["same_as_plain"] for r in rows if r["same_as_plain"] is not None)
    assert all(r["tokens_per_s"] > 0 for r in rows)
    with pytest.raises(SystemExit, match="exists"):
        distill_draft.main([target.out_dir, draft.out_dir, out])


def test_serve_bench_keeps_its_default_slots_under_extra_jaxgpt_args():
    from bench import serve
    from bench.serve import with_default_slots

    assert with_default_slots(["--quantize=w8a8"], ["--slots=32"]) == ["--slots=32", "--quantize=w8a8"]
    assert with_default_slots(["--slots=4", "--quantize=w8a8"], ["--slots=32"]) == ["--slots=4", "--quantize=w8a8"]
    assert with_default_slots(["--slots", "4"], ["--slots=32", "--max_len=64"]) == ["--max_len=64", "--slots", "4"]
    # the generate baseline runs with the server's --quantize and --kv_dtype, read as its parser reads them
    assert serve.jaxgpt_flag(["--slots=4", "--quantize=w8a8"], "quantize") == "w8a8"
    assert serve.jaxgpt_flag(["--quantize", "int8", "--kv_dtype=int8"], "quantize") == "int8"
    assert serve.jaxgpt_flag(["--quantize", "int8", "--kv_dtype=int8"], "kv_dtype") == "int8"
    assert serve.jaxgpt_flag(["--quantize=w8a8", "--quantize=none"], "quantize") is None
    assert serve.jaxgpt_flag(["--kv_dtype=int8", "--kv_dtype", "float32"], "kv_dtype") == "float32"
    assert serve.jaxgpt_flag(["--slots=4"], "kv_dtype") is None


def test_draw_benchmark_smoke(monkeypatch):
    """bench/draw.py times the Gumbel-max draw (jax.random.categorical's tokens) against the sampler's."""
    import jax

    from bench import draw

    written = {}
    monkeypatch.setattr(draw, "write_results", lambda name, results: written.setdefault(name, results))
    results = draw.main(["--rows", "1", "3", "--vocab", "300", "--reps", "2"])
    assert written == {"draw": results} and set(results["ms"]) == {"1", "3"}
    assert all(ms > 0 for row in results["ms"].values() for ms in row.values())
    assert set(results["ms"]["3"]) == {"gumbel_max", "inverse_cdf", "sample_rows_vocab", "sample_rows_top_k_50",
                                       "sample_rows_greedy"}
    keys = jax.random.split(jax.random.key(3), 4)
    logits = jax.random.normal(jax.random.key(4), (4, 300))
    expected = [int(jax.random.categorical(k, x)) for k, x in zip(keys, logits)]
    assert np.asarray(draw.gumbel_rows(keys, logits)).tolist() == expected  # the old draw's tokens


def test_data_benchmark_smoke(tmp_path):
    """bench/data.py prepares shards with jaxgpt and with llm.c's recipe (the same bytes), and times the
    loader; the start-up part (training processes) is left out here."""
    import subprocess
    import sys

    text = tmp_path / "t.txt"
    text.write_text("".join(f"line {i} of the king and the queen\n" for i in range(400)))
    out = tmp_path / "data.json"
    # (its own process: the process pools fork, which a test process running JAX's threads should not)
    subprocess.run([sys.executable, "bench/data.py", "--text", str(text), "--smoke", "--no_startup", "--out",
                    str(out)], check=True, capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    assert r["prepare"]["same_shards_as_llmc_recipe"] is True
    assert all(v > 0 for v in r["prepare"]["tokens_per_s"].values())
    assert r["loader"]["sampler_tokens_per_s"] > 0 and r["smoke"] is True


def test_engine_bench_step_cost_fit():
    """bench/engine.py's fit of a call's seconds as a + b x tokens: exact on a line, the calls that ran no
    token left out, undefined with one size of call."""
    from bench.engine import step_cost
    steps = [(n, 0.02 + 0.001 * n) for n in (32, 512, 256, 40)] + [(0, 5.0)]
    a, b = step_cost(steps)
    assert a == pytest.approx(0.02) and b == pytest.approx(0.001)
    assert all(np.isnan(v) for v in step_cost([(32, 0.1), (32, 0.2), (0, 1.0)]))
