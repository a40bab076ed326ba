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


def test_sample_streams_before_generation_ends(tmp_path, monkeypatch, capsys):
    """--max_new_tokens=10**9 would never finish: the first sample's text must show up chunk by chunk."""
    import io
    import sys

    import jax

    from jaxgpt import GPTConfig, init_params
    from jaxgpt.cli import sample
    from jaxgpt.data import CharTokenizer

    cfg = GPTConfig(vocab_size=20, block_size=16, n_layer=1, n_head=2, n_embd=16)
    tok = CharTokenizer("abcdefghijklmnopqrs\n")
    monkeypatch.setattr(sample, "_load", lambda args: (cfg, init_params(cfg, jax.random.key(0)), tok, {}))

    class Enough(Exception):
        pass

    class Screen(io.StringIO):
        def write(self, text):
            super().write(text)
            shown = self.getvalue().split("\n", 1)
            if len(shown) == 2 and len(shown[1]) > 40:  # past the settings line: generated text arrived
                raise Enough

    screen = Screen()
    monkeypatch.setattr(sys, "stdout", screen)
    with pytest.raises(Enough):  # (past block_size, it keeps going from the recent context)
        sample.main(["--prompt=ab", "--max_new_tokens=1000000000", "--chunk_size=4", "--num_samples=2"])
    body = screen.getvalue().split("\n", 1)[1]
    assert body.startswith("ab") and len(body) > 20
    monkeypatch.undo()
    assert sample.main(["--prompt=ab", "--max_new_tokens=0"]) == 2
    assert "--max_new_tokens must be >= 1" in capsys.readouterr().err
