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
