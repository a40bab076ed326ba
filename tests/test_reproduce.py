"""The GPT-2 reproduction recipe (docs/reproduce-gpt2.md): configs/gpt2_124m_fineweb.py and
configs/speedrun_gpt2_fineweb.py load with llm.c's and modded-nanogpt's settings and validate, a missing
HellaSwag file is refused naming the flag, and at a tiny scale the FineWeb recipe runs end to end through the
commands a user types: JSON Lines -> `jaxgpt-prepare --shards` -> `train.py --config=configs/gpt2_124m_fineweb.py`
with a HellaSwag-form task in the loop -> the scores in the log line, metrics.jsonl and `jaxgpt-eval`."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxgpt.training.config import validate_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the cat sat on a mat while dogs ran past the old red barn and birds sang over green hills "
         "near small rivers where people walked slowly home after work in autumn light").split()


def _load(name):
    spec = importlib.util.spec_from_file_location(f"cfg_{name}", os.path.join(REPO, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _task_file(path, n, seed=0):
    """A HellaSwag-form task (ctx, endings, label and a field the reader ignores) of the corpus's words."""
    rng = np.random.default_rng(seed)
    pick = lambda k: " ".join(rng.choice(WORDS, k))  # noqa: E731
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"ind": i, "ctx": pick(6), "endings": [pick(3) for _ in range(4)],
                                "label": int(rng.integers(4))}) + "\n")
    return path


def test_the_fineweb_config_is_llmcs_124m_run(tmp_path, monkeypatch):
    c = _load("gpt2_124m_fineweb")
    assert (c.data.corpus, c.data.path, c.data.tokenizer) == ("shards", "fineweb10B/fineweb_*.bin", "auto")
    m, t = c.model, c.train
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.dtype) == (12, 12, 768, 1024, "bfloat16")
    assert t.batch_size * m.block_size == 524288 and t.batch_size // 8 // t.grad_accum == 64  # -d, -b on 8 GPUs
    assert (t.lr, t.min_lr, t.warmup_steps, t.weight_decay, t.beta2, t.schedule) == (6e-4, 0.0, 700, 0.1, 0.95,
                                                                                      "cosine")
    assert t.max_steps == t.decay_steps == 18865 and 9.8e9 < t.max_steps * 524288 < 1.0e10
    assert t.eval_interval == 250 and t.eval_steps * t.batch_size * m.block_size == 10_485_760
    assert t.eval_tasks == "hellaswag_val.jsonl" and t.get("eval_tasks_interval") is None  # every eval
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"hellaswag_val.jsonl does not exist.*--config.train.eval_tasks="):
        validate_config(c, device_count=8)
    _task_file(tmp_path / "hellaswag_val.jsonl", 2)
    validate_config(c, device_count=8)


def test_the_speedrun_fineweb_config_aims_at_modded_nanogpts_target(tmp_path, monkeypatch):
    c, base = _load("speedrun_gpt2_fineweb"), _load("speedrun_gpt2")
    assert (c.data.corpus, c.data.path, c.data.tokenizer) == ("shards", "fineweb10B/fineweb_*.bin", "auto")
    assert c.model.to_dict() == base.model.to_dict()  # the speedrun recipe's model and optimizer, unchanged
    for key in ("optimizer", "muon_lr", "lr", "schedule", "batch_size", "max_steps", "loss_chunk"):
        assert c.train[key] == base.train[key], key
    assert c.train.eval_steps * c.train.batch_size * c.model.block_size == 10_485_760
    assert c.train.target_val_loss == 3.28 and c.train.eval_tasks == "hellaswag_val.jsonl"
    monkeypatch.chdir(tmp_path)
    _task_file(tmp_path / "hellaswag_val.jsonl", 2)
    validate_config(c, device_count=8)


def _docs(n=240, seed=1):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(8, 60)))) for _ in range(n)]


def test_shards_in_scores_out_with_the_fineweb_recipe_at_a_tiny_scale(tmp_path, capsys):
    """jaxgpt-prepare and jaxgpt-eval through their entry points in this process, train.py as a command."""
    from jaxgpt.cli import eval as eval_cli
    from jaxgpt.cli import prepare
    docs_dir = tmp_path / "fineweb"
    docs_dir.mkdir()
    with open(docs_dir / "part0.jsonl", "w") as f:
        for d in _docs():
            f.write(json.dumps({"text": d}) + "\n")
    shards = tmp_path / "fineweb10B"
    assert prepare.main(["--corpus=jsonl", f"--path={docs_dir}", "--tokenizer=bpe", "--vocab_size=300",
                         f"--shards={shards}", "--shard_name=fineweb", "--shard_tokens=4000", "--val_tokens=1500",
                         "--quiet"]) == 0
    names = sorted(os.listdir(shards))
    assert "fineweb_val_000000.bin" in names and "fineweb_train_000001.bin" in names
    task = _task_file(tmp_path / "hellaswag_val.jsonl", 6, seed=3)
    out_dir = tmp_path / "run"
    tiny = [f"--config.data.path={shards}/fineweb_*.bin", f"--config.train.eval_tasks={task}",
            f"--config.out_dir={out_dir}", "--config.model.n_layer=2", "--config.model.n_head=2",
            "--config.model.n_embd=32", "--config.model.block_size=32", "--config.model.dtype=float32",
            "--config.train.batch_size=4", "--config.train.loss_chunk=0", "--config.train.max_steps=4",
            "--config.train.decay_steps=4", "--config.train.warmup_steps=1", "--config.train.eval_interval=2",
            "--config.train.eval_steps=2", "--config.train.checkpoint_interval=4", "--config.train.log_interval=1",
            "--config.train.trackers=jsonl", "--config.train.progress=False", "--config.compile_cache=off"]
    r = subprocess.run([sys.executable, "train.py", "--config=configs/gpt2_124m_fineweb.py", *tiny], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    evals = {row["step"]: row for row in rows if "val_loss" in row}
    assert sorted(evals) == [2, 4]
    for step in (2, 4):
        assert 0.0 <= evals[step]["hellaswag_val/acc"] <= 1.0 and 0.0 <= evals[step]["hellaswag_val/acc_norm"] <= 1.0
    assert "jaxgpt: eval tasks hellaswag_val (6 items)" in r.stdout
    last = evals[4]
    assert f"| hellaswag_val acc {last['hellaswag_val/acc']:.4f} acc_norm {last['hellaswag_val/acc_norm']:.4f}" \
        in r.stdout
    # the checkpoint scored again alone: jaxgpt-eval gives the loop's last scores
    capsys.readouterr()
    assert eval_cli.main([f"--out_dir={out_dir}", f"--tasks={task}", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["hellaswag_val"]
    assert alone["n"] == 6
    assert (alone["acc"], alone["acc_norm"]) == (last["hellaswag_val/acc"], last["hellaswag_val/acc_norm"])
