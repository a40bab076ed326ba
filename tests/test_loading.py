"""One loader (jaxgpt.loading) for run folders, Hugging Face folders and GPT-2 names, and user code that
reaches the CLI: a run with a custom block, defined in the user's own module, trains (config.imports),
records that module, and samples with `jaxgpt-sample --import=...` or with the recorded module alone."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from jaxgpt import loading
from jaxgpt.registry import BLOCKS
from jaxgpt.training import train
from jaxgpt.training.config import validate_config
from jaxgpt.user_modules import MissingPart, import_modules, module_names, require_parts
from tests.helpers import REPO, tiny_config

MODULE, BLOCK = "loading_test_blocks", "loading_post_norm"  # names no other test uses

# the post-norm block of docs/extending.md, in a module of the user's own
BLOCK_SOURCE = textwrap.dedent(f"""
    import flax.linen as nn
    import jaxgpt
    from jaxgpt.model import MLPS, CausalSelfAttention, norm

    @jaxgpt.register_block({BLOCK!r})
    class PostNormBlock(nn.Module):
        config: jaxgpt.GPTConfig
        backend: jaxgpt.Backend
        deterministic: bool = True

        @nn.compact
        def __call__(self, x, positions, cache=None, layer=None):
            cfg, be, det = self.config, self.backend, self.deterministic
            y, cache = CausalSelfAttention(cfg, be, det, name="attn")(x, positions, cache, layer)
            x = norm(cfg, be, "ln_1")(x + y)
            return norm(cfg, be, "ln_2")(x + MLPS[cfg.mlp](cfg, be, det, name="mlp")(x)), cache
""")


def _tiny(tmp_path, steps=4, **model):
    c = tiny_config(tmp_path, max_steps=steps, checkpoint_interval=steps, eval_interval=steps, eval_steps=1)
    c.model.n_layer = 1
    for k, v in model.items():
        c.model[k] = v
    return c


def _forget():
    """As a new process starts: the block unregistered, its module not imported."""
    BLOCKS.unregister(BLOCK)
    sys.modules.pop(MODULE, None)


@pytest.fixture(scope="module")
def custom_run(tmp_path_factory):
    """(folder holding the user's module, the run's config): a run of the post-norm block, trained by the
    training loop with config.imports naming the module."""
    tmp = tmp_path_factory.mktemp("custom")
    code = tmp / "code"
    code.mkdir()
    (code / f"{MODULE}.py").write_text(BLOCK_SOURCE)
    c = _tiny(tmp / "run", block=BLOCK)
    c.imports = MODULE
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(code))
        summary = train(c)
    yield code, c, summary
    _forget()


@pytest.fixture
def fresh(custom_run, monkeypatch):
    """The custom run, with the block unregistered and its module forgotten (and forgotten again after)."""
    _forget()
    monkeypatch.chdir(custom_run[0].parent)  # not the module's folder: it is importable only where asked
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(custom_run[0])])  # (restored after)
    yield custom_run
    _forget()


def test_a_run_folder_loads_the_params_it_trained_and_the_old_names_still_work(tmp_path):
    c = _tiny(tmp_path)
    summary = train(c)
    loaded = loading.load_run(c.out_dir)
    trained = jax.device_get(summary["state"].params)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(loaded.params), trained)
    assert loaded.meta["step"] == 4 and loaded.meta["imports"] == []  # a built-in block: nothing to import
    assert loaded.source == {"init_from": os.path.abspath(c.out_dir), "step": 4}
    assert loaded.tokenizer.to_dict() == loaded.meta["tokenizer"]
    same = loading.load(c.out_dir)  # the one entry point: a run folder is recognised
    jax.tree.map(np.testing.assert_array_equal, same.params, loaded.params)
    assert same.config == loaded.config
    cropped = loading.load(c.out_dir, block_size=8, scan_layers=True)  # as init_from lays it out
    assert cropped.config.block_size == 8 and cropped.config.scan_layers
    assert cropped.params["wpe"]["embedding"].shape[0] == 8 and "h" in cropped.params
    with pytest.raises(ValueError, match="block_size=32 exceeds the block_size of"):
        loading.load(c.out_dir, block_size=32)
    with pytest.deprecated_call():  # moved from jaxgpt.checkpoint, still importable from there
        from jaxgpt.checkpoint import load_model
    config, params, tok, meta = load_model(c.out_dir)
    assert config == loaded.config and meta["step"] == 4
    jax.tree.map(np.testing.assert_array_equal, params, loaded.params)


def test_a_hugging_face_folder_loads_as_from_pretrained_does(tmp_path):
    from jaxgpt import GPTConfig, from_pretrained, init_params, save_pretrained

    cfg = GPTConfig(vocab_size=96, block_size=16, n_layer=1, n_head=2, n_embd=32)
    save_pretrained(init_params(cfg, jax.random.key(0)), cfg, tmp_path / "hf")
    _, want = from_pretrained(tmp_path / "hf")
    loaded = loading.load(str(tmp_path / "hf"), tokenizer=None)
    jax.tree.map(np.testing.assert_array_equal, loaded.params, want)
    assert loaded.tokenizer is None and loaded.meta == {}
    assert loaded.source == {"init_from": str(tmp_path / "hf")}
    with pytest.raises(ValueError, match="is not a run folder"):
        loading.load(str(tmp_path / "hf"), step=3)


def test_an_exported_char_run_samples_the_text_of_its_run_folder(tmp_path, capsys):
    """save_pretrained wrote no tokenizer: the exported folder fell back to GPT-2's, 50257 tokens for a
    65-token model."""
    from jaxgpt import save_pretrained
    from jaxgpt.cli import sample
    from jaxgpt.data import CharTokenizer
    from jaxgpt.pretrained import TOKENIZER_FILE
    from jaxgpt.training import train

    c = _tiny(tmp_path / "run")
    train(c)
    config, params, tok, _ = loading.load_model(c.out_dir)
    assert isinstance(tok, CharTokenizer)
    folder = save_pretrained(params, config, tmp_path / "hf", tokenizer=tok)
    assert (folder / TOKENIZER_FILE).is_file() and not (folder / "tokenizer.json").exists()
    assert loading.load(str(folder)).tokenizer.to_dict() == tok.to_dict()
    capsys.readouterr()
    texts = []
    for source in (f"--out_dir={c.out_dir}", f"--init_from={folder}"):
        assert sample.main([source, "--prompt=KING:", "--num_samples=2", "--max_new_tokens=12", "--seed=3"]) == 0
        texts.append([line for line in capsys.readouterr().out.splitlines() if not line.startswith("# settings")])
    assert texts[0] == texts[1] and sum(line.startswith("KING:") for line in texts[0]) == 2
    other = CharTokenizer([chr(33 + i) for i in range(config.vocab_size + 1)])
    with pytest.raises(ValueError, match=f"the tokenizer has {config.vocab_size + 1} tokens and the model "
                                         f"{config.vocab_size}: pass the tokenizer the model was trained with"):
        save_pretrained(params, config, tmp_path / "other", tokenizer=other)


def test_a_custom_block_run_records_its_module_and_samples_with_import_in_a_new_process(custom_run, tmp_path):
    code, c, summary = custom_run
    assert summary["steps"] == 4
    meta = loading.load_run(c.out_dir).meta
    assert meta["model"]["block"] == BLOCK and meta["imports"] == [MODULE]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(code), str(REPO)]))
    settings = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "jaxgpt.cli.sample", f"--import={MODULE}", f"--out_dir={c.out_dir}",
                        "--prompt=KING:", "--num_samples=1", "--max_new_tokens=5", f"--save_settings={settings}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    saved = json.loads(settings.read_text())
    assert saved["settings"]["step"] == 4 and saved["samples"][0].startswith("KING:")


def test_the_recorded_module_is_imported_when_it_is_importable(fresh, monkeypatch, capsys):
    from jaxgpt.cli import sample, serve

    code, c, _ = fresh
    monkeypatch.syspath_prepend(str(code))  # importable, but not named
    assert sample.main([f"--out_dir={c.out_dir}", "--prompt=KING:", "--num_samples=1", "--max_new_tokens=3"]) == 0
    assert "KING:" in capsys.readouterr().out
    _forget()
    config, _, _, name, _ = serve._load(serve.build_parser().parse_args([f"--out_dir={c.out_dir}"]))
    assert config.block == BLOCK and name == "out"
    _forget()
    assert loading.load(c.out_dir, block_size=8).config.block == BLOCK  # as training's init_from loads it


def test_import_names_the_module_for_sample_and_serve(fresh, monkeypatch):
    from jaxgpt.cli import sample, serve

    code, c, _ = fresh
    monkeypatch.syspath_prepend(str(code))
    args = serve.build_parser().parse_args([f"--import={MODULE}", "--import=json,os", f"--out_dir={c.out_dir}"])
    assert args.imports == [MODULE, "json,os"]
    assert serve._load(args)[0].block == BLOCK
    _forget()
    args = sample.build_parser().parse_args([f"--import={MODULE}", f"--out_dir={c.out_dir}"])
    assert sample._load(args)[0].block == BLOCK


def test_a_module_that_cannot_be_imported_is_named_in_one_line(fresh, capsys):
    from jaxgpt.cli import sample

    code, c, _ = fresh  # (the module's folder is not on the path, nor the current directory)
    assert sample.main([f"--out_dir={c.out_dir}", "--prompt=KING:", "--max_new_tokens=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"this run's block '{BLOCK}' is not registered" in err
    assert f"it was registered by module '{MODULE}' (pass --import={MODULE}, and make sure it is importable" in err
    assert f"no module named '{MODULE}'" in err
    assert sample.main([f"--out_dir={c.out_dir}", "--import=no_such_module_here", "--max_new_tokens=3"]) == 2
    assert "--import=no_such_module_here: no module named 'no_such_module_here'" in capsys.readouterr().err
    assert sample.main([f"--out_dir={c.out_dir}", f"--import={code / MODULE}.py", "--max_new_tokens=3"]) == 2
    assert "name a module as Python imports it" in capsys.readouterr().err


def test_a_run_that_recorded_no_module_says_how_to_name_one(fresh):
    with pytest.raises(MissingPart, match=f"this run's block '{BLOCK}' is not registered .*; name the module "
                                          "that registers it: --import=MODULE"):
        require_parts({"block": BLOCK, "attention": "dot_product"}, recorded=[])
    with pytest.raises(MissingPart, match="importing module 'json', which the run records, did not register it"):
        require_parts({"block": BLOCK}, recorded=["json"])
    require_parts({"block": "gpt2", "attention": "dot_product"}, recorded=["no_such_module_here"])  # (not needed)


def test_config_imports_is_imported_before_the_model_is_checked(fresh, tmp_path, monkeypatch):
    code, _, _ = fresh
    c = _tiny(tmp_path, block=BLOCK)
    with pytest.raises(MissingPart, match=f"config.model's block '{BLOCK}' is not registered.*--config.imports="):
        validate_config(c)  # (before: "GPTConfig.block must be one of ('gpt2', 'parallel')", no hint)
    c.imports = [MODULE]  # a list, or a comma-separated string
    with pytest.raises(ValueError, match=f"--config.imports={MODULE}: no module named '{MODULE}'"):
        validate_config(c)
    monkeypatch.chdir(code)  # the current directory is on the path (as `python -m` has it, and the scripts not)
    validate_config(c)
    assert BLOCK in BLOCKS.names()


def test_module_names():
    assert module_names(None) == [] and module_names("") == []
    assert module_names("a.b, c,,a.b") == ["a.b", "c"] and module_names(["a", "b,c", "a"]) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="--import: module names must be strings"):
        module_names([3])
    assert import_modules("json, os.path") == ["json", "os.path"]
