"""Multiple-choice evaluation (jaxgpt/evals.py, jaxgpt-eval): per-choice losses equal the engine's scores and
a plain full forward's, a long context is cut from the left, lm-eval's preprocessing and scores are matched,
and the command prints its table and JSON."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpt
from jaxgpt import evals
from jaxgpt.data import CharTokenizer
from tests.helpers import varied_params

CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz[]"
TOK = CharTokenizer(CHARS)
CFG = jaxgpt.GPTConfig(vocab_size=TOK.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def params():
    return varied_params(CFG)


def _word(rng, lo, hi):
    return "".join(rng.choice(list(LETTERS), int(rng.integers(lo, hi + 1))))


def _generic(rng, n, ctx=(5, 12)):
    return [{"context": _word(rng, *ctx) + ":", "choices": [" " + _word(rng, 1, 6) for _ in range(4)],
             "label": int(rng.integers(4))} for _ in range(n)]


def _full_forward_loss(params, ctx, cont):
    """The continuation's summed loss from one plain forward over the last block_size + 1 tokens."""
    seq = (list(ctx) + list(cont))[-(CFG.block_size + 1):]
    logits = jaxgpt.GPT(CFG).apply({"params": params}, jnp.asarray([seq[:-1]], jnp.int32))[0]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -np.asarray(logp)[np.arange(len(seq) - 1), seq[1:]]
    return float(nll[-len(cont):].sum())


def test_choice_losses_equal_the_engine_and_a_full_forward(params):
    from jaxgpt.engine import Engine

    rng = np.random.default_rng(0)
    rows = [evals.parse_item(r) for r in _generic(rng, 6)]
    scorer = evals.Scorer({"params": params}, CFG, rows=8)  # 24 rows: three calls, the last one padded
    losses = evals.item_losses(scorer, TOK, rows)
    pairs = [evals.encode_pair(TOK, it.context, c, "llmc") for it in rows for c in it.continuations]
    engine = Engine(params, CFG, slots=4, prefill_chunk=16)
    got = np.concatenate([s for s, _ in losses])
    want_engine = -np.array([lp for lp, _ in engine.score([p[0] for p in pairs], [p[1] for p in pairs])])
    want_full = np.array([_full_forward_loss(params, *p) for p in pairs])
    np.testing.assert_allclose(got, want_engine, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, want_full, rtol=1e-4, atol=1e-4)
    assert [list(c) for _, c in losses] == [[len(p[1]) for p in pairs[4 * i:4 * i + 4]] for i in range(6)]
    # acc and acc_norm are the argmins of the sums and of the means per token
    scores = evals.accuracy(rows, losses)
    sums, means = want_full.reshape(6, 4), (want_full / [len(p[1]) for p in pairs]).reshape(6, 4)
    labels = np.array([it.label for it in rows])
    assert scores == {"acc": np.mean(sums.argmin(1) == labels), "acc_norm": np.mean(means.argmin(1) == labels), "n": 6}


def test_a_context_longer_than_the_window_is_cut_from_the_left(params):
    rng = np.random.default_rng(1)
    long_ctx = TOK.encode(_word(rng, 150, 150))  # > block_size 64
    short = [(TOK.encode("abc:"), TOK.encode(" de")), (TOK.encode("x"), TOK.encode(" yz"))]
    pairs = [(long_ctx, TOK.encode(" end")), *short, (long_ctx[:60], TOK.encode(" fin"))]
    scorer = evals.Scorer({"params": params}, CFG, rows=4)  # the long and short rows share one padded call
    sums, counts = scorer.score(pairs)
    want = [_full_forward_loss(params, *p) for p in pairs]
    np.testing.assert_allclose(sums, want, rtol=1e-4, atol=1e-4)
    assert list(counts) == [4, 3, 3, 4]
    # the cut keeps the tokens nearest the continuation: another start changes nothing
    other = scorer.score([(TOK.encode("qqqq") + long_ctx, TOK.encode(" end"))])[0]
    np.testing.assert_allclose(other, sums[:1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not fit the model's window"):
        scorer.score([(TOK.encode("a"), TOK.encode("b" * 65))])


HELLASWAG_TEXTS = [
    "  Removing ice from car [title] Use a scraper.  ",
    "[header] How to dance [step] Stand up. [substeps] Move  your feet.",
    "A man is  seen [title]   speaking [x] to   the camera.",
    "no markup at all",
    "brackets [a] [b] and [unclosed",
]


def test_lm_eval_preprocessing_equals_lm_eval_hellaswag_task():
    utils = pytest.importorskip("lm_eval.tasks.hellaswag.utils", reason="lm-evaluation-harness is the eval extra")
    for text in HELLASWAG_TEXTS:
        assert evals.lm_eval_preprocess(text) == utils.preprocess(text), text
    datasets = pytest.importorskip("datasets")
    rows = [{"ind": 1, "activity_label": "Fixing a car", "ctx_a": "A man [title] opens  the hood.",
             "ctx_b": "THEN he", "ctx": "A man [title] opens  the hood. then he",
             "endings": [" looks [step] inside.", "runs  away", "[header] sings", "jumps."], "label": "2"}]
    doc = utils.process_docs(datasets.Dataset.from_list(rows))[0]
    item = evals.parse_item(rows[0], "lm_eval")
    assert item.context == doc["query"] and item.label == doc["gold"] == 2
    assert item.continuations == tuple(" " + c for c in doc["choices"])  # lm-eval's target_delimiter " "
    assert item.norm_lengths == tuple(float(len(c)) for c in doc["choices"])
    llmc = evals.parse_item(rows[0], "llmc")  # llm.c: ctx as it is, " " + each ending as it is
    assert llmc.context == rows[0]["ctx"] and llmc.continuations[1] == " runs  away" and llmc.norm_lengths is None


def test_encode_pair_moves_the_contexts_trailing_space_in_lm_eval_style():
    assert evals.encode_pair(TOK, "ab ", "cd", "lm_eval") == (TOK.encode("ab"), TOK.encode(" cd"))
    assert evals.encode_pair(TOK, "ab ", "cd", "llmc") == (TOK.encode("ab "), TOK.encode("cd"))


def test_bad_task_files_are_refused_naming_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"context": "a", "choices": ["b", "c"], "label": 0}) + "\n" +
                    json.dumps({"context": "a", "choices": ["b", "c"], "label": 2}) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl line 2: label 2 is not one of the item's 2 choices"):
        evals.read_task(str(path))
    assert len(evals.read_task(str(path), limit=1)) == 1
    path.write_text('{"question": "a"}\n')
    with pytest.raises(ValueError, match="line 1: an item needs 'ctx' and 'endings'"):
        evals.read_task(str(path))
    with pytest.raises(ValueError, match="share the name 'a'"):
        evals.parse_task_list("x/a.jsonl,y/a.jsonl")


def _write_run(folder, params):
    from jaxgpt.checkpoint import Checkpointer
    ck = Checkpointer(str(folder))
    ck.save(1, {"params": params}, {"step": 1, "model": CFG.to_dict(), "tokenizer": TOK.to_dict()})
    ck.wait()
    ck.close()


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_cli_prints_a_table_and_the_json_scores(tmp_path, params):
    rng = np.random.default_rng(2)
    generic = _generic(rng, 5)
    hella = [{"ctx": _word(rng, 5, 20), "endings": [_word(rng, 2, 8) for _ in range(4)], "label": i % 4,
              "split": "val"} for i in range(6)]
    _write_jsonl(tmp_path / "gen.jsonl", generic)
    _write_jsonl(tmp_path / "hs.jsonl", hella)
    _write_run(tmp_path / "run", params)
    r = subprocess.run([sys.executable, "-m", "jaxgpt.cli.eval", f"--out_dir={tmp_path / 'run'}",
                        f"--tasks={tmp_path / 'gen.jsonl'},{tmp_path / 'hs.jsonl'}", "--limit=4", "--json"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().split("\n")
    got = json.loads(lines[-1])
    assert set(got) == {"gen", "hs"}
    scorer = evals.Scorer({"params": params}, CFG)
    for name, rows in (("gen", generic), ("hs", hella)):
        items = [evals.parse_item(x) for x in rows[:4]]
        want = evals.accuracy(items, evals.item_losses(scorer, TOK, items))
        assert got[name] == want
        row = next(line for line in lines if line.startswith(name + " "))
        assert row.split()[1:4] == ["4", f"{want['acc']:.4f}", f"{want['acc_norm']:.4f}"]
    assert lines[1].split()[:4] == ["task", "n", "acc", "acc_norm"]
    bad = subprocess.run([sys.executable, "-m", "jaxgpt.cli.eval", f"--out_dir={tmp_path / 'run'}",
                          f"--tasks={tmp_path / 'missing.jsonl'}"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("jaxgpt-eval: task file") and "Traceback" not in bad.stderr


def _hellaswag_rows(rng, n):
    """HellaSwag-form items whose text carries the markup lm-eval's preprocessing removes."""
    rows = []
    for i in range(n):
        endings = [_word(rng, 1, 4) + (" [step] " + _word(rng, 1, 3) if j % 2 else "") for j in range(4)]
        ctx_a, ctx_b = _word(rng, 3, 8) + " [title] " + _word(rng, 2, 5) + ".", _word(rng, 2, 6).upper()
        rows.append({"ind": i, "activity_label": _word(rng, 3, 6), "ctx_a": ctx_a, "ctx_b": ctx_b,
                     "ctx": ctx_a + " " + ctx_b.lower(), "endings": endings, "label": int(rng.integers(4))})
    return rows


@pytest.mark.slow
def test_lm_eval_style_scores_equal_lm_eval_through_the_server(tmp_path):
    """lm-eval's own hellaswag preprocessing (its process_docs, imported) and its acc / acc_norm over
    local-completions through jaxgpt-serve equal style="lm_eval" in process, item by item."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the eval extra")
    pytest.importorskip("fastapi", reason="the server needs the serve extra")
    from tests.test_lm_eval import _samples
    from tests.test_serve import CFG as SCFG, TOK as STOK, _params, _start_server, _write_run as write_served

    sparams = _params()
    rng = np.random.default_rng(3)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    hs, gen = _hellaswag_rows(rng, 8), [{**r, "choices": [c.strip() for c in r["choices"]]} for r in _generic(rng, 8)]
    _write_jsonl(tasks / "hs.jsonl", hs)
    _write_jsonl(tasks / "gen.jsonl", gen)
    (tasks / "hs_utils.py").write_text("from lm_eval.tasks.hellaswag.utils import process_docs  # noqa: F401\n")
    common = ("dataset_path: json\ntest_split: test\noutput_type: multiple_choice\n"
              "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (tasks / "jaxgpt_hs.yaml").write_text(
        f"task: jaxgpt_hs\n{common}dataset_kwargs:\n  data_files:\n    test: {tasks / 'hs.jsonl'}\n"
        "process_docs: !function hs_utils.process_docs\ndoc_to_text: \"{{query}}\"\ndoc_to_target: gold\n"
        "doc_to_choice: choices\n")
    (tasks / "jaxgpt_gen.yaml").write_text(  # each choice appended exactly as written: no delimiter
        f"task: jaxgpt_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {tasks / 'gen.jsonl'}\n"
        "doc_to_text: \"{{context}}\"\ndoc_to_target: label\ndoc_to_choice: choices\ntarget_delimiter: \"\"\n")

    scorer = evals.Scorer({"params": sparams}, SCFG)
    mine = {}
    for name, rows in (("jaxgpt_hs", hs), ("jaxgpt_gen", gen)):
        items = [evals.parse_item(r, "lm_eval") for r in rows]
        losses = evals.item_losses(scorer, STOK, items, "lm_eval")
        mine[name] = (evals.accuracy(items, losses), np.stack([s for s, _ in losses]))

    write_served(tmp_path / "run", sparams)
    proc, url, _ = _start_server(tmp_path / "run", "--slots=4", "--prefill_chunk=16", "--served_model_name=tiny")
    try:
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
                   TOKENIZERS_PARALLELISM="false")
        r = subprocess.run(
            [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
             f"model=tiny,base_url={url}/v1/completions,max_length={SCFG.block_size},num_concurrent=1",
             "--tasks", "jaxgpt_hs,jaxgpt_gen", "--include_path", str(tasks), "--output_path",
             str(tmp_path / "results"), "--log_samples"],
            cwd=str(tasks), env=env, capture_output=True, text=True, timeout=400)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-5000:])
    finally:
        proc.kill()
        proc.wait(30)
    import glob
    (path,) = glob.glob(str(tmp_path / "results" / "**" / "results_*.json"), recursive=True)
    with open(path) as f:
        results = json.load(f)["results"]
    for name, (scores, sums) in mine.items():
        lls = np.array([[float(resp[0][0]) for resp in s["resps"]] for s in _samples(str(tmp_path / "results"), name)])
        np.testing.assert_allclose(-sums, lls, atol=1e-4)
        assert results[name]["acc,none"] == pytest.approx(scores["acc"], abs=1e-9)
        assert results[name]["acc_norm,none"] == pytest.approx(scores["acc_norm"], abs=1e-9)
    assert mine["jaxgpt_hs"][0]["acc"] != mine["jaxgpt_hs"][0]["acc_norm"] or \
        mine["jaxgpt_gen"][0]["acc"] != mine["jaxgpt_gen"][0]["acc_norm"]  # the two normalisations differ somewhere


def _corpus_tasks(tmp_path, text, n=4):
    """A generic and a HellaSwag-form task cut from the corpus's own text (so the char tokenizer has it)."""
    rng = np.random.default_rng(4)
    words = text.split()
    pick = lambda k: " ".join(rng.choice(words, k))  # noqa: E731
    gen = [{"context": pick(3), "choices": [" " + pick(1) for _ in range(3)], "label": i % 3} for i in range(n)]
    hs = [{"ctx": pick(4), "endings": [pick(2) for _ in range(4)], "label": i % 4} for i in range(n)]
    _write_jsonl(tmp_path / "gen.jsonl", gen)
    _write_jsonl(tmp_path / "hs.jsonl", hs)
    return [str(tmp_path / "gen.jsonl"), str(tmp_path / "hs.jsonl")]


def test_tasks_in_the_training_loop_reach_metrics_the_log_and_the_checkpoint(tmp_path, capsys, monkeypatch):
    from jaxgpt import loading
    from jaxgpt.checkpoint import Checkpointer
    from jaxgpt.training import train
    from tests.helpers import tiny_config

    c = tiny_config(tmp_path, max_steps=30, eval_interval=10, checkpoint_interval=30)
    paths = _corpus_tasks(tmp_path, open(c.data.path).read(), n=5)
    c.train.eval_tasks = ",".join(paths)
    c.train.eval_tasks_interval = 20
    c.train.eval_tasks_limit = 4
    encoded, encode = [], evals.encode_items
    monkeypatch.setattr(evals, "encode_items", lambda items, *a: encoded.append(len(items)) or encode(items, *a))
    train(c)
    assert encoded == [4, 4]  # each task tokenized once, at the start, not at each of its two evals
    rows = [json.loads(line) for line in open(os.path.join(c.out_dir, "metrics.jsonl"))]
    evals_ = {r["step"]: r for r in rows if "val_loss" in r}
    assert sorted(evals_) == [10, 20, 30]
    assert "gen/acc" not in evals_[10]  # 10 is no multiple of eval_tasks_interval
    assert {"gen/acc", "gen/acc_norm", "hs/acc", "hs/acc_norm", "tasks_s"} <= set(evals_[20]) <= set(evals_[30])
    assert not any("gen/acc" in r for r in rows if "val_loss" not in r)
    # the last scores are the checkpoint's own: scored again from it, in process, by the standalone path
    loaded = loading.load_run(c.out_dir)
    scorer = evals.Scorer({"params": loaded.params}, loaded.config)
    want = {}
    for p in paths:
        items = evals.read_task(p, limit=4)
        want[evals.task_name(p)] = evals.accuracy(items, evals.item_losses(scorer, loaded.tokenizer, items))
    for name, s in want.items():
        assert (evals_[30][f"{name}/acc"], evals_[30][f"{name}/acc_norm"]) == (s["acc"], s["acc_norm"])
        assert loaded.meta["tasks"][name] == {**s, "step": 30}
    out = capsys.readouterr().out
    assert "jaxgpt: eval tasks gen (4 items), hs (4 items), every 20 steps" in out
    assert f"| hs acc {want['hs']['acc']:.4f} acc_norm {want['hs']['acc_norm']:.4f}" in out


@pytest.mark.parametrize("key, value, match", [
    ("eval_tasks", "nowhere.jsonl", "train.eval_tasks: task file nowhere.jsonl does not exist"),
    ("eval_tasks_interval", 15, "train.eval_tasks_interval: must be a multiple of train.eval_interval"),
    ("eval_tasks_limit", 0, "train.eval_tasks_limit: must be an integer >= 1"),
    ("eval_tasks_style", "helm", "train.eval_tasks_style: must be one of"),
])
def test_bad_eval_task_settings_are_refused_naming_the_key(tmp_path, key, value, match):
    from jaxgpt.training.config import validate_config
    from tests.helpers import tiny_config

    c = tiny_config(tmp_path)
    if key != "eval_tasks":
        c.train.eval_tasks = _corpus_tasks(tmp_path, "a b c d e")
    c.train[key] = value
    with pytest.raises(ValueError, match=match):
        validate_config(c)


def _write_llmc_bin(path, examples):
    """llm.c's multiple-choice file as its format is described: a header of 256 int32 (magic 20240522,
    version 1, examples, longest example in bytes), then per example uint16 fields: 65535, the record's size
    in bytes, its index, the label, the number of completions, the context's length and ids, then each
    completion's length and ids. `examples`: (context ids, [completion ids], label)."""
    records = []
    for k, (ctx, ends, label) in enumerate(examples):
        fields = [k, label, len(ends), len(ctx), *ctx]
        for e in ends:
            fields += [len(e), *e]
        records.append([2 ** 16 - 1, 2 * (len(fields) + 2), *fields])
    header = np.zeros(256, np.int32)
    header[:4] = [20240522, 1, len(examples), max(2 * len(r) for r in records)]
    with open(path, "wb") as f:
        f.write(header.astype("<i4").tobytes())
        for r in records:
            f.write(np.asarray(r, "<u2").tobytes())


def test_llmc_bin_scores_equal_its_items_as_hellaswag_jsonl(tmp_path, params, capsys):
    """llm.c's hellaswag_val.bin (written here by its format's description, with the char tokenizer's ids
    for GPT-2's): the same items as HellaSwag-form JSON Lines through that tokenizer give the same ids, the
    same per-choice losses and the same scores, standalone (jaxgpt-eval) and as train.eval_tasks accepts it."""
    from jaxgpt.cli import eval as eval_cli

    rng = np.random.default_rng(7)
    rows = [{"ctx": _word(rng, 3, 20), "endings": [_word(rng, 1, 9) for _ in range(3 + i % 2)], "label": i % 3}
            for i in range(7)]
    _write_jsonl(tmp_path / "hs.jsonl", rows)
    _write_llmc_bin(tmp_path / "hellaswag_val.bin",
                    [(TOK.encode(r["ctx"]), [TOK.encode(" " + e) for e in r["endings"]], r["label"]) for r in rows])
    binary, text = evals.read_task(str(tmp_path / "hellaswag_val.bin")), evals.read_task(str(tmp_path / "hs.jsonl"))
    assert [it.ids for it in binary] == [(tuple(TOK.encode(r["ctx"])), tuple(tuple(TOK.encode(" " + e))
                                          for e in r["endings"])) for r in rows]
    scorer = evals.Scorer({"params": params}, CFG)
    got, want = evals.item_losses(scorer, TOK, binary), evals.item_losses(scorer, TOK, text)
    for (s1, c1), (s2, c2) in zip(got, want):
        np.testing.assert_array_equal(s1, s2)
        np.testing.assert_array_equal(c1, c2)
    scores = evals.accuracy(text, want)
    assert evals.accuracy(binary, got) == scores
    assert len(evals.read_task(str(tmp_path / "hellaswag_val.bin"), limit=3)) == 3
    _write_run(tmp_path / "run", params)
    argv = [f"--out_dir={tmp_path / 'run'}", f"--tasks={tmp_path / 'hellaswag_val.bin'}", "--compile_cache=off"]
    assert eval_cli.main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"hellaswag_val": scores}
    assert eval_cli.main(argv + ["--style=lm_eval"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hellaswag_val.bin: llm.c's .bin file holds GPT-2 token ids, scored in style llmc only" \
        in err[0], err


def test_train_eval_tasks_take_an_llmc_bin_in_style_llmc_only(tmp_path):
    from jaxgpt.training import task_eval
    from jaxgpt.training.config import validate_config
    from tests.helpers import tiny_config

    c = tiny_config(tmp_path)
    _write_llmc_bin(tmp_path / "hellaswag_val.bin", [([1, 2], [[3], [4, 5]], 1)])
    c.train.eval_tasks = str(tmp_path / "hellaswag_val.bin")
    validate_config(c)
    c.train.eval_tasks_style = "lm_eval"
    with pytest.raises(ValueError, match=r"config.train.eval_tasks_style: .*hellaswag_val.bin is llm.c's .bin file"):
        task_eval.check_config(c.train)
    tasks = evals.read_tasks([c.train.eval_tasks])
    evals.check_vocab(tasks, 6)
    with pytest.raises(ValueError, match=r"task hellaswag_val item 0 has token id 5, past the model's vocabulary \(5"):
        evals.check_vocab(tasks, 5)


def test_a_damaged_llmc_bin_is_refused_naming_the_example(tmp_path):
    path = tmp_path / "hs.bin"
    _write_llmc_bin(path, [([1, 2], [[3], [4, 5]], 1), ([6], [[7], [8]], 0)])
    raw = path.read_bytes()
    path.write_bytes(raw[:-2])
    with pytest.raises(ValueError, match=r"hs.bin example 1: its token lists run past the record's size"):
        evals.read_task(str(path))
    path.write_bytes(raw[:-14])  # 4 of example 1's 11 fields left
    with pytest.raises(ValueError, match=r"hs.bin example 1: no record starts at byte 1050"):
        evals.read_task(str(path))
    path.write_bytes(np.int32(20240520).tobytes() + raw[4:])
    with pytest.raises(ValueError, match=r"hs.bin is no llm.c evaluation file \(magic 20240522, version 1\)"):
        evals.read_task(str(path))
    bad_label = bytearray(raw)
    bad_label[1024 + 6:1024 + 8] = np.uint16(2).tobytes()  # example 0's label: 2 of 2 completions
    path.write_bytes(bytes(bad_label))
    with pytest.raises(ValueError, match=r"hs.bin example 0: label 2 is not one of its 2 completions"):
        evals.read_task(str(path))
