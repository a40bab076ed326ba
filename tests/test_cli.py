import json

import pytest

from jaxgpt.cli import plot


def test_plot_reads_train_and_val_lines(tmp_path):
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 2, "val_loss": 2.7}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    train, val = plot.read_metrics(str(tmp_path))
    assert train == [(1, 3.0), (2, 2.5)] and val == [(2, 2.7)]


def test_plot_missing_run_is_a_clear_error(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="jaxgpt-plot needs the plot extra")
    assert plot.main([str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib", reason="jaxgpt-plot needs the plot extra")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 1, "val_loss": 3.1}\n')
    assert plot.main([str(tmp_path)]) == 0
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_train_cli_rejects_unknown_override(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "jaxgpt.cli.train", "--config=configs/shakespeare_char_cpu.py",
                        "--config.train.learning_rate=1"], capture_output=True, text=True, timeout=120,
                       cwd=__file__.rsplit("/tests/", 1)[0])
    assert r.returncode != 0 and "learning_rate" in r.stderr
