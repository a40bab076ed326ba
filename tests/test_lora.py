"""LoRA: adapters change nothing at init, merging equals applying, a step moves only the adapters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import GPT, GPTConfig, init_params
from jaxgpt.training.config import default_config
from jaxgpt.lora import LoraSpec, init_adapters, merge
from jaxgpt.model import convert_layers
from jaxgpt.training.step import create_train_state, make_optimizer, make_train_step, model_variables
from tests.helpers import STYLES


def _cfg(style="gpt2", **kw):
    return GPTConfig(**{**dict(vocab_size=48, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32),
                        **STYLES[style], **kw})


def _tokens(seed=1):
    return jax.random.randint(jax.random.key(seed), (3, 12), 0, 48)


def _random_b(adapters, seed=5):
    """Adapters as after some training: b no longer zero."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jax.random.normal(jax.random.key(seed), x.shape) * 0.3 if p[-1].key == "b" else x, adapters)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("style", sorted(STYLES))
def test_fresh_adapters_give_the_base_logits_exactly(style, scan):
    cfg = _cfg(style, scan_layers=scan)
    base = init_params(cfg, jax.random.key(0))
    adapters = init_adapters(base, cfg, LoraSpec(4, 8.0, ("c_attn", "c_proj", "c_fc")), jax.random.key(1))
    want = GPT(cfg).apply({"params": base}, _tokens())
    got = GPT(cfg).apply({"params": base, "lora": adapters}, _tokens())
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("style,targets", [("gpt2", ("c_attn", "mlp.c_proj", "lm_head")),
                                           ("llama", ("q", "v", "gate", "down"))])
def test_merged_equals_applied_and_changes_the_output(style, targets, scan):
    cfg = _cfg(style, scan_layers=scan, tie_embeddings=False)
    base = init_params(cfg, jax.random.key(0))
    adapters = _random_b(init_adapters(base, cfg, LoraSpec(4, 8.0, targets), jax.random.key(1)))
    applied = GPT(cfg).apply({"params": base, "lora": adapters}, _tokens())
    merged = GPT(cfg).apply({"params": merge(base, adapters)}, _tokens())
    np.testing.assert_allclose(np.asarray(merged), np.asarray(applied), atol=1e-5, rtol=0)
    plain = GPT(cfg).apply({"params": base}, _tokens())
    assert float(jnp.abs(applied - plain).max()) > 1e-2


def test_llama_q_and_v_adapt_only_their_columns_of_c_attn():
    cfg = _cfg("llama")
    base = init_params(cfg, jax.random.key(0))
    adapters = _random_b(init_adapters(base, cfg, LoraSpec(2, 2.0, ("q", "v")), jax.random.key(1)))
    assert set(adapters["h_0"]) == {"attn"} and set(adapters["h_0"]["attn"]) == {"c_attn"}
    change = merge(base, adapters)["h_0"]["attn"]["c_attn"]["kernel"] - base["h_0"]["attn"]["c_attn"]["kernel"]
    changed = np.abs(np.asarray(change)).max(axis=0) > 0
    q, k = 32, 16  # 4 query heads and 2 kv heads of 8
    assert changed[:q].all() and not changed[q:q + k].any() and changed[q + k:].all()


def test_unknown_target_names_the_layers():
    cfg = _cfg()
    with pytest.raises(ValueError, match=r"\['c_gate'\].*c_attn"):
        init_adapters(init_params(cfg, jax.random.key(0)), cfg, LoraSpec(2, 2.0, ("c_gate",)), jax.random.key(1))
    with pytest.raises(ValueError, match="rank"):
        LoraSpec(0, 2.0, ("c_attn",))


@pytest.mark.parametrize("scan", [False, True])
def test_a_lora_step_moves_only_the_adapters(scan):
    cfg = _cfg(scan_layers=scan)
    tc = default_config().train
    tc.warmup_steps, tc.lora.rank, tc.lora.targets = 0, 4, "c_attn,c_fc"
    opt = make_optimizer(tc)
    base = init_params(cfg, jax.random.key(0))
    adapters = init_adapters(base, cfg, LoraSpec.from_config(tc.lora), jax.random.key(1))
    state = create_train_state(adapters, opt, jax.random.key(2), frozen=base)
    step = jax.jit(make_train_step(cfg, opt))
    tokens = _tokens()
    losses = []
    for _ in range(5):
        state, metrics = step(state, tokens[:, :-1], tokens[:, 1:])
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    for a, b in zip(jax.tree.leaves(state.frozen), jax.tree.leaves(base)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the base is bit-identical
    for path, new in jax.tree_util.tree_leaves_with_path(state.params):
        old = adapters
        for k in path:
            old = old[k.key]
        moved = not np.array_equal(np.asarray(new), np.asarray(old))
        assert moved == (path[-1].key in ("a", "b")), jax.tree_util.keystr(path)
    # AdamW's two moments for a and b only: at most twice the adapters' size
    opt_bytes = sum(x.nbytes for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    ab_bytes = sum(x.nbytes for p, x in jax.tree_util.tree_leaves_with_path(state.params) if p[-1].key in "ab")
    assert opt_bytes == 2 * ab_bytes <= 2 * adapter_bytes
    variables = model_variables(state.params, state.frozen)
    assert set(variables) == {"params", "lora"}


def test_adapters_follow_the_layer_layout():
    cfg = _cfg()
    scan = cfg.replace(scan_layers=True)
    base = init_params(cfg, jax.random.key(0))
    spec = LoraSpec(3, 3.0, ("c_attn",))
    unrolled = init_adapters(base, cfg, spec, jax.random.key(1))
    stacked = init_adapters(convert_layers(base, scan), scan, spec, jax.random.key(1))
    assert stacked["h"]["attn"]["c_attn"]["a"].shape == (2, 32, 3)
    assert set(unrolled) == {"h_0", "h_1"} and unrolled["h_1"]["attn"]["c_attn"]["a"].shape == (32, 3)


# ---------------------------------------------------------------------------------------------------
# LoRA runs through train(): base from a jaxgpt run folder, resume, sampling

def _losses(out_dir):
    import json
    import os

    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    from jaxgpt.training import train
    from tests.helpers import tiny_config

    c = tiny_config(tmp_path_factory.mktemp("base"), max_steps=80, warmup_steps=2, checkpoint_interval=80,
                    eval_interval=80, lr=1e-2, min_lr=1e-3)
    c.data.tokenizer = "byte"  # a fixed vocabulary, so another corpus keeps the same ids
    train(c)
    return c


def _lora_config(tmp_path, base, **train):
    from tests.helpers import _WORDS, tiny_config

    c = tiny_config(tmp_path, **train)
    c.data.tokenizer = "byte"
    other = tmp_path / "other.txt"  # a new corpus: the base's words, always in one order
    other.write_text(("KING:\n" + " ".join(_WORDS[:12]) + "\n") * 200)
    c.data.path = str(other)
    c.init_from = base.out_dir
    c.train.lora.rank, c.train.lora.alpha, c.train.lora.targets = 4, 16.0, "c_attn,c_fc,c_proj"
    c.train.lr, c.train.min_lr, c.train.warmup_steps, c.train.log_interval = 1e-2, 1e-2, 0, 1
    return c


def test_a_lora_run_fine_tunes_resumes_exactly_and_samples(tmp_path, base_run):
    from jaxgpt.loading import load_model
    from jaxgpt.training import train

    full = _lora_config(tmp_path / "a", base_run, max_steps=30, checkpoint_interval=15, eval_interval=15)
    summary = train(full)
    losses = _losses(full.out_dir)
    first, last = np.mean([losses[k] for k in range(1, 6)]), np.mean([losses[k] for k in range(26, 31)])
    assert last < first - 0.1, losses  # the adapters learn the new corpus (0.27 lower when written)
    base_params = load_model(base_run.out_dir)[1]
    adapters = jax.device_get(summary["state"].params)
    for a, b in zip(jax.tree.leaves(summary["state"].frozen), jax.tree.leaves(base_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the base did not move
    config, merged, _, meta = load_model(full.out_dir)  # what jaxgpt-sample reads
    base_ref = meta["lora"]["base"]
    assert {k: base_ref[k] for k in ("init_from", "step")} == {"init_from": base_run.out_dir, "step": 80}
    assert len(base_ref["sha256"]) == 64  # the base weights' fingerprint
    tokens = _tokens()[:, :8] % config.vocab_size
    applied = GPT(config).apply({"params": base_params, "lora": adapters}, tokens)
    np.testing.assert_allclose(np.asarray(GPT(config).apply({"params": merged}, tokens)), np.asarray(applied),
                               atol=1e-5)
    half = _lora_config(tmp_path / "b", base_run, max_steps=15, decay_steps=30, checkpoint_interval=15,
                        eval_interval=15)
    train(half)
    half.init_from, half.train.max_steps = "resume", 30
    assert train(half)["start_step"] == 15
    b = _losses(half.out_dir)
    assert [b[k] for k in sorted(b)] == [losses[k] for k in sorted(losses)]  # resume is exact


def test_lora_needs_a_base_and_init_from_checks_the_tokenizer(tmp_path, base_run):
    from jaxgpt.checkpoint import CheckpointError
    from jaxgpt.training.config import validate_config
    from jaxgpt.training import train

    c = _lora_config(tmp_path / "a", base_run, max_steps=2)
    c.init_from = "scratch"
    with pytest.raises(ValueError, match="LoRA adapts a trained model"):
        validate_config(c)
    c = _lora_config(tmp_path / "b", base_run, max_steps=2)
    c.train.lora.rank, c.data.tokenizer = 0, "char"  # a full fine-tune from the run, with other ids
    with pytest.raises(CheckpointError, match="tokenizer is not the data's"):
        train(c)


def test_a_rank_past_a_layers_width_is_refused():
    cfg = _cfg("llama")  # n_embd 32; c_attn is 32 x 64: q 32 columns, k and v 16 each (2 kv heads of 8)
    base = init_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match=r"rank=33 is past the width .* is 32 x 64, so the rank can be at most 32"):
        init_adapters(base, cfg, LoraSpec(33, 16.0, ("c_attn",)), jax.random.key(1))
    with pytest.raises(ValueError, match=r"rank=17 .* h_0.attn.c_attn is 32 x 16, so the rank can be at most 16"):
        init_adapters(base, cfg, LoraSpec(17, 16.0, ("v",)), jax.random.key(1))  # v's 16 columns only
    for rank, targets in ((32, ("c_attn",)), (16, ("v",)), (32, ("q", "v"))):  # at the width: allowed
        adapters = init_adapters(base, cfg, LoraSpec(rank, 16.0, targets), jax.random.key(1))
        assert adapters["h_0"]["attn"]["c_attn"]["a"].shape == (32, rank)


def test_a_huge_rank_ends_training_in_one_line_before_it_allocates(tmp_path, base_run):
    """rank 100000 on a 128-wide model allocated 12+ GB and was killed (rc 137, no message)."""
    import subprocess
    import sys

    from tests.test_cli_errors import REPO

    config = tmp_path / "huge_rank.py"
    config.write_text(
        "import pathlib\nfrom tests.test_lora import _lora_config\n\n\n"
        "class Base:\n    out_dir = " + repr(base_run.out_dir) + "\n\n\n"
        "def get_config():\n"
        f"    c = _lora_config(pathlib.Path({str(tmp_path / 'run')!r}), Base, max_steps=2)\n"
        "    c.train.lora.rank = 100000\n    return c\n")
    out = subprocess.run([sys.executable, "train.py", f"--config={config}"], cwd=REPO, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert "config.train.lora.rank=100000 is past the width of the layers it adapts" in out.stderr, out.stderr
    assert "so the rank can be at most 32" in out.stderr, out.stderr


def _short_base(folder, seed):
    from jaxgpt.training import train
    from tests.helpers import tiny_config

    c = tiny_config(folder, max_steps=3, warmup_steps=0, checkpoint_interval=3, eval_interval=3)
    c.data.tokenizer, c.seed = "byte", seed
    train(c)
    return c


def test_a_lora_run_refuses_a_base_that_is_not_its_own_and_says_when_the_base_is_gone(tmp_path, capsys):
    """Another run put at the base's folder, at the same step, used to take the adapters silently (on
    resume and in jaxgpt-sample); a base that is gone was reported as the LoRA run's own missing checkpoint."""
    import shutil

    from jaxgpt.checkpoint import CheckpointError
    from jaxgpt.loading import load_model
    from jaxgpt.cli import sample
    from jaxgpt.training import train

    base, other = _short_base(tmp_path / "base", seed=0), _short_base(tmp_path / "other", seed=1)
    c = _lora_config(tmp_path / "lora", base, max_steps=2, checkpoint_interval=2, eval_interval=2)
    train(c)
    c.init_from, c.train.max_steps = "resume", 4
    shutil.rmtree(base.out_dir)
    shutil.copytree(other.out_dir, base.out_dir)  # another run, at the same step 3, in the base's place
    with pytest.raises(CheckpointError) as e:
        train(c)
    msg = str(e.value)
    assert f"the LoRA base {base.out_dir} (step 3) is not the model these adapters were trained on" in msg
    assert msg.count("...") == 2 and "\n" not in msg  # both fingerprints, one line
    with pytest.raises(CheckpointError, match="is not the model these adapters were trained on"):
        load_model(c.out_dir)  # what jaxgpt-sample merges
    capsys.readouterr()
    assert sample.main([f"--out_dir={c.out_dir}", "--max_new_tokens=2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "is not the model these adapters were trained on" in err

    shutil.rmtree(base.out_dir)  # the base is gone: the message says it is the LoRA base
    with pytest.raises(CheckpointError, match=f"the LoRA base {base.out_dir} holds no checkpoint"):
        train(c)
    assert sample.main([f"--out_dir={c.out_dir}", "--max_new_tokens=2"]) == 2
    assert "the LoRA base" in capsys.readouterr().err
