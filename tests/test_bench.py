"""The accelerator benchmark's smoke mode runs on the CPU, so the script never rots before a GPU is lent."""

import json

from bench.accelerator import main


def test_accelerator_benchmark_smoke(tmp_path):
    out = tmp_path / "accelerator.json"
    results = main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
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
    from jaxgpt.kernels import native
    assert set(rows) == {"cpu xla", "portable"} | ({"cpu native"} if native.available() else set())
    b, t, n, h = attention.shapes("baby")
    assert rows["portable"]["shape"] == [b, t, n, h] and rows["portable"]["max_abs_diff"] == 0.0
    for impl in set(rows) - {"portable"}:
        assert rows[impl]["max_abs_diff"] < 1e-4  # the same function, to float rounding
    for r in rows.values():
        assert r["fwd_s"] > 0 and r["fwd_bwd_s"] > 0
        assert r["fwd_bwd_flops_per_s"] == 3 * attention.causal_flops(b, t, n, h) / r["fwd_bwd_s"]
