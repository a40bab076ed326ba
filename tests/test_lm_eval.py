"""lm-evaluation-harness (`lm_eval --model local-completions`) against `jaxgpt-serve` in a subprocess, offline,
on two small local tasks written here: a multiple-choice task (log-likelihoods through /v1/completions with
echo and logprobs, tokenized through the server's /tokenize since a char tokenizer is no Hugging Face one)
whose per-item accuracy and log-likelihoods equal scoring the same items through `Engine.score` in
process, and a generate_until task whose generations equal the engine's greedy ones cut at the stop string.
The model is random, so the figures themselves mean nothing; their equality does."""

import glob
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the eval extra")
pytest.importorskip("fastapi", reason="the server needs the serve extra")

from jaxgpt.engine import Engine  # noqa: E402
from tests.test_serve import CFG, REPO, TOK, _params, _start_server, _write_run  # noqa: E402

LETTERS = "abcdefghijklmnopqrstuvwxyz"
MAX_GEN = 8


def _word(rng, lo, hi):
    return "".join(rng.choice(list(LETTERS), int(rng.integers(lo, hi + 1))))


def _mc_items(rng, n=8):
    items = []
    while len(items) < n:
        choices = [_word(rng, 1, 3) for _ in range(4)]
        if len(set(choices)) == 4:  # (a repeated choice would tie)
            items.append({"question": _word(rng, 5, 10) + ":", "choices": choices, "label": int(rng.integers(4))})
    return items


def _greedy_texts(engine, prompts):
    outs = engine.run([dict(prompt=TOK.encode(p), max_tokens=MAX_GEN, temperature=0.0) for p in prompts])
    return [TOK.decode(o.token_ids) for o in outs]


def _stop_string(texts):
    """A character that occurs inside some greedy generation (past its first), so the stop cut is exercised."""
    for t in texts:
        for ch in t[1:]:
            if ch.isalpha():
                return ch
    raise AssertionError(f"no letter to stop at in {texts}")


def _write_tasks(folder, mc, gen, until):
    os.makedirs(folder, exist_ok=True)
    for name, rows in (("mc", mc), ("gen", gen)):
        with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    common = (f"dataset_path: json\ntest_split: test\n")
    with open(os.path.join(folder, "jaxgpt_mc.yaml"), "w") as f:
        f.write("task: jaxgpt_mc\n" + common +
                f"dataset_kwargs:\n  data_files:\n    test: {os.path.join(folder, 'mc.jsonl')}\n"
                "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: choices\n"
                "doc_to_target: label\nmetric_list:\n  - metric: acc\n")
    with open(os.path.join(folder, "jaxgpt_gen.yaml"), "w") as f:
        f.write("task: jaxgpt_gen\n" + common +
                f"dataset_kwargs:\n  data_files:\n    test: {os.path.join(folder, 'gen.jsonl')}\n"
                "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{answer}}\"\n"
                f"generation_kwargs:\n  until: [{json.dumps(until)}]\n  max_gen_toks: {MAX_GEN}\n"
                "metric_list:\n  - metric: exact_match\n")


def _samples(out, task):
    paths = glob.glob(os.path.join(out, "**", f"samples_{task}_*.jsonl"), recursive=True)
    assert len(paths) == 1, paths
    with open(paths[0]) as f:
        return sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])


@pytest.mark.slow
def test_lm_eval_local_completions_equals_the_engine_in_process(tmp_path):
    t0 = time.perf_counter()
    params = _params()
    engine = Engine(params, CFG, slots=4, prefill_chunk=16)
    rng = np.random.default_rng(1)

    # in process: lm_eval's acc picks the choice whose " " + choice has the highest summed logprob
    mc = _mc_items(rng)
    # every pair in one call: more requests than slots, four at a time sharing a context
    scores = engine.score([TOK.encode(it["question"]) for it in mc for _ in it["choices"]],
                          [TOK.encode(" " + c) for it in mc for c in it["choices"]])
    lls = np.array([s[0] for s in scores]).reshape(len(mc), 4)
    acc = [float(np.argmax(row) == it["label"]) for row, it in zip(lls, mc)]
    top2 = np.sort(lls, axis=1)[:, -2:]
    assert np.min(top2[:, 1] - top2[:, 0]) > 1e-3  # no near tie that float rounding could flip

    prompts = [_word(rng, 4, 8) + ":" for _ in range(4)]
    full = _greedy_texts(engine, prompts)
    until = _stop_string(full)
    want = [t.split(until)[0] for t in full]
    assert any(len(w) < len(t) for w, t in zip(want, full))  # the stop string cut at least one generation
    # half the answers are what the model says, half are not: exact_match 0.5
    gen = [{"prompt": p, "answer": w if i % 2 == 0 else w + "zq"} for i, (p, w) in enumerate(zip(prompts, want))]
    _write_tasks(str(tmp_path / "tasks"), mc, gen, until)

    t1 = time.perf_counter()
    # the server's engine has the same sizes: its warm-up finds these programs in the session's XLA cache
    _write_run(tmp_path / "run", params)
    proc, url, err = _start_server(tmp_path / "run", "--slots=4", "--prefill_chunk=16",
                                   "--served_model_name=tiny", "--cpu_dispatch=inline")
    try:
        assert "; CPU dispatch inline)" in proc.ready_line  # (the other test's server: async, the default)
        t2 = time.perf_counter()
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
                   TOKENIZERS_PARALLELISM="false")
        r = subprocess.run(
            [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
             f"model=tiny,base_url={url}/v1/completions,max_length={CFG.block_size},num_concurrent=1",
             "--tasks", "jaxgpt_mc,jaxgpt_gen", "--include_path", str(tmp_path / "tasks"),
             "--output_path", str(tmp_path / "results"), "--log_samples"],
            cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-5000:])
        assert "remote tokenizer" in r.stderr.lower() or "remote tokenizer" in r.stdout.lower(), r.stderr[-3000:]
        t3 = time.perf_counter()
    finally:
        proc.kill()
        proc.wait(30)

    res_paths = glob.glob(str(tmp_path / "results" / "**" / "results_*.json"), recursive=True)
    assert len(res_paths) == 1, res_paths
    with open(res_paths[0]) as f:
        results = json.load(f)["results"]

    # multiple choice: the same accuracy, item by item, from the same log-likelihoods
    assert results["jaxgpt_mc"]["acc,none"] == pytest.approx(np.mean(acc), abs=1e-9)
    mc_samples = _samples(str(tmp_path / "results"), "jaxgpt_mc")
    assert [s["acc"] for s in mc_samples] == acc
    got = np.array([[float(resp[0][0]) for resp in s["resps"]] for s in mc_samples])
    np.testing.assert_allclose(got, lls, atol=1e-4)
    greedy = [[str(resp[0][1]) == "True" for resp in s["resps"]] for s in mc_samples]
    assert greedy == [[bool(s[1]) for s in scores[4 * i:4 * i + 4]] for i in range(len(mc))]

    # generate_until: lm_eval's generations are the engine's greedy ones cut at the stop string
    gen_samples = _samples(str(tmp_path / "results"), "jaxgpt_gen")
    assert [s["resps"][0][0] for s in gen_samples] == want
    assert results["jaxgpt_gen"]["exact_match,none"] == pytest.approx(0.5)
    print(f"lm_eval acc {results['jaxgpt_mc']['acc,none']} (in process {np.mean(acc)}); "
          f"exact_match {results['jaxgpt_gen']['exact_match,none']}; generations {want} (stop {until!r}); "
          f"in process {t1 - t0:.1f} s, server start {t2 - t1:.1f} s, lm_eval {t3 - t2:.1f} s")
