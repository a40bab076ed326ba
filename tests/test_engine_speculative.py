"""The engine decoding speculatively (n-gram proposals, `Engine(..., speculative=Speculative(k))`): every
request's tokens equal the plain engine's and `generate`'s for its prompt alone, greedy and seeded sampling
alike, whatever its neighbours, slot reuse, stop tokens or a cache that fills up; logprobs equal the full
forward's; proposals are accepted where the model repeats itself; a bounded set of programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpt
from jaxgpt.engine import Engine
from jaxgpt.speculative import Speculative, _ngram_proposals, ngram_lookup

CFG = jaxgpt.GPTConfig(vocab_size=61, block_size=64, n_layer=2, n_head=4, n_embd=32)
SETTINGS = [dict(temperature=0.0), dict(temperature=0.8, top_k=10, seed=3), dict(temperature=1.0, seed=5),
            dict(temperature=0.7, top_p=0.9, seed=7), dict(temperature=0.9, top_k=5, top_p=0.5, seed=2)]


def _repeater(seed=0, scale=20.0):
    """A model whose blocks add nothing: each position's logits depend on its own token alone, and the
    largest is that token's (greedy decoding repeats the prompt's last token), so n-gram lookup succeeds;
    a smaller `scale` makes sampling leave the runs now and then."""
    return _repeater_for(CFG, seed, scale)


@pytest.fixture(scope="module")
def params():
    return jaxgpt.init_params(CFG, jax.random.key(1))


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in lengths]


def _alone(params, prompt, n, s):
    out = jaxgpt.generate(params, CFG, np.array([prompt]), n, jax.random.key(s.get("seed", 0)),
                          temperature=s["temperature"], top_k=s.get("top_k"), top_p=s.get("top_p"))
    return np.asarray(out.tokens[0, len(prompt):]).tolist()


def test_ngram_lookup_is_the_compiled_loops_lookup():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, k = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        text = rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist()
        got = ngram_lookup(text, n, k)
        want = np.asarray(_ngram_proposals(jnp.array([text + [0] * 8]), jnp.array([len(text)]), n, k))[0]
        assert got == want[:len(got)].tolist()
        if len(got) < k:  # the compiled loop pads with the last token where the text runs out or nothing matched
            assert (want[len(got):] == text[-1]).all()
    assert ngram_lookup([1, 2, 3, 1, 2, 3, 1, 2], 2, 3) == [3, 1, 2] and ngram_lookup([1, 2, 3], 2, 3) == []


@pytest.mark.parametrize("model", ["random", "repeater"])
def test_tokens_and_logprobs_equal_the_plain_engine_and_generate(params, model):
    p = params if model == "random" else _repeater()
    prompts = _prompts(0, (5, 20, 9, 33, 3))
    prompts[1] = [7, 8, 9] * 6  # text that repeats: proposals from the first step
    reqs = [dict(prompt=q, max_tokens=14, logprobs=3, **s) for q, s in zip(prompts, SETTINGS)]
    spec = Engine(p, CFG, slots=4, prefill_chunk=16, speculative=Speculative(k=3, ngram=2))
    got = spec.run(reqs)
    want = Engine(p, CFG, slots=4, prefill_chunk=16).run(reqs)
    for q, s, a, b in zip(prompts, SETTINGS, got, want):
        assert a.token_ids == b.token_ids == _alone(p, q, 14, s), s
        np.testing.assert_allclose([t.logprob for t in a.tokens], [t.logprob for t in b.tokens], atol=1e-5)
        assert [[i for i, _ in t.top] for t in a.tokens] == [[i for i, _ in t.top] for t in b.tokens]
        assert a.finish_reason == "length"
    assert spec.stats["proposed"] > 0
    if model == "repeater":  # greedy repeats: most proposals match, and steps emit several tokens
        assert spec.stats["accepted"] >= spec.stats["proposed"] // 3 > 0


def test_acceptance_saves_steps_on_a_repetitive_model():
    p = _repeater()
    req = dict(prompt=[3, 4, 5, 5, 5], max_tokens=30, temperature=0.0)
    spec = Engine(p, CFG, slots=2, prefill_chunk=16, speculative=Speculative(k=4, ngram=2))
    plain = Engine(p, CFG, slots=2, prefill_chunk=16)
    a, b = spec.run([req])[0], plain.run([req])[0]
    assert a.token_ids == b.token_ids == [5] * 30
    assert spec.stats["accepted"] > 0 and spec.stats["decode_steps"] <= plain.stats["decode_steps"] // 3


@pytest.mark.parametrize("kernels,dtype", [("portable", "float32"), ("cpu", "bfloat16")])
def test_near_greedy_requests_decode_speculatively_as_greedy(kernels, dtype):
    """temperature 1e-30 and top_p 1e-40 through the verify step's draws (accepted proposals and the
    token after them): the greedy tokens, proposals accepted as for greedy requests."""
    cfg = CFG.replace(kernels=kernels, dtype=dtype)
    p = _repeater_for(cfg, 2, scale=5.0)
    prompts = [[4, 4, 4, 9, 4], [7, 8, 9] * 4, _prompts(3, (6,))[0]]
    spec = Engine(p, cfg, slots=4, max_len=40, prefill_chunk=8, speculative=Speculative(k=3, ngram=1))
    greedy = [o.token_ids for o in spec.run([dict(prompt=q, max_tokens=16, temperature=0.0) for q in prompts])]
    for s in (dict(temperature=1e-30), dict(top_p=1e-40), dict(temperature=1e-12, top_k=5, top_p=1e-40)):
        outs = spec.run([dict(prompt=q, max_tokens=16, seed=i, **s) for i, q in enumerate(prompts)])
        assert [o.token_ids for o in outs] == greedy, s
    assert spec.stats["accepted"] > 0


def test_stop_tokens_full_caches_and_slot_reuse():
    """A request that reaches max_len decodes its last positions plainly; later requests reuse prefixes of
    slots that decoded speculatively; a stop token (each token of a sampled answer in turn) ends a request
    where the plain engine ends it, mid-step or not."""
    p = _repeater(2)
    spec = Engine(p, CFG, slots=2, max_len=40, prefill_chunk=8, speculative=Speculative(k=4, ngram=1))
    plain = Engine(p, CFG, slots=2, max_len=40, prefill_chunk=8)
    first = [dict(prompt=[1, 2, 3, 3], max_tokens=36, temperature=0.0),              # to max_len exactly
             dict(prompt=[4, 4, 4, 9, 4], max_tokens=20, temperature=0.9, seed=3),
             dict(prompt=[6] * 10, max_tokens=12, temperature=0.0)]
    for reqs in (first, [dict(r, prompt=r["prompt"] + [5], max_tokens=r["max_tokens"] - 1) for r in first]):
        got, want = spec.run(reqs), plain.run(reqs)
        for a, b in zip(got, want):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert spec.stats["reused_tokens"] > 0 and spec.stats["accepted"] > 0

    p = _repeater(2, scale=5.0)  # runs of repeats, left now and then
    spec = Engine(p, CFG, slots=2, max_len=40, prefill_chunk=8, speculative=Speculative(k=4, ngram=1))
    plain = Engine(p, CFG, slots=2, max_len=40, prefill_chunk=8)
    req = dict(prompt=[4, 4, 4, 9, 4], max_tokens=30, temperature=1.0, seed=3)
    answer = plain.run([req])[0].token_ids
    for stop in sorted(set(answer)):
        a, b = spec.run([dict(req, stop_token_ids=(stop,))])[0], plain.run([dict(req, stop_token_ids=(stop,))])[0]
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "stop"
    assert spec.stats["accepted"] > 0


def test_no_program_is_compiled_after_warmup(params):
    eng = Engine(params, CFG, slots=4, prefill_chunk=16, speculative=Speculative(k=3))
    n = eng.warmup()
    assert n == eng.programs_compiled > 0
    eng.run([dict(prompt=q, max_tokens=9, **s) for q, s in zip(_prompts(3, (4, 17, 8, 2, 30)), SETTINGS)]
            + [dict(prompt=[2, 3] * 8, max_tokens=12, temperature=0.0)])
    assert eng.programs_compiled == n


def test_speculative_errors():
    p = _repeater()
    with pytest.raises(ValueError, match="n-gram"):
        Engine(p, CFG, speculative=Speculative(k=2, draft=(p, CFG)))
    with pytest.raises(ValueError, match="Speculative"):
        Engine(p, CFG, speculative=4)


def test_jaxgpt_sample_and_serve_take_speculative_flags(tmp_path, monkeypatch, capsys):
    """jaxgpt-sample: greedy text with --speculative=ngram, and with a draft run folder, equals plain
    decoding's, across context windows; jaxgpt-serve builds its engine with n-gram drafting."""
    from jaxgpt.checkpoint import Checkpointer
    from jaxgpt.cli import sample, serve
    from jaxgpt.data import CharTokenizer

    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz .,;:!?'\n-ABCDEFGHIJKLMNOPQRSTUVW")
    cfg = jaxgpt.GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32)
    draft_cfg = cfg.replace(n_layer=1)
    params = _repeater_for(cfg)
    ck = Checkpointer(str(tmp_path / "draft"))
    ck.save(1, {"params": jaxgpt.init_params(draft_cfg, jax.random.key(5))},
            {"step": 1, "model": draft_cfg.to_dict(), "tokenizer": tok.to_dict()})
    ck.wait()
    ck.close()
    monkeypatch.setattr(sample, "_load", lambda args: (cfg, params, tok, {}))

    def text(*flags, n=20):
        assert sample.main(["--prompt=abcab", f"--max_new_tokens={n}", "--temperature=0", "--num_samples=2",
                            "--chunk_size=8", *flags]) == 0
        return capsys.readouterr().out.split("\n", 1)[1]

    plain = text()  # within the first window (5 + 20 + k <= 32)
    assert text("--speculative=ngram", "--speculative_k=3", "--ngram=2") == plain
    assert text(f"--speculative={tmp_path / 'draft'}", "--speculative_k=2") == plain
    long = text("--speculative=ngram", "--speculative_k=4", n=70)  # across windows
    assert [len(s) for s in long.split("\n---------------\n")[:2]] == [75, 75]
    assert sample.main(["--prompt=ab", "--speculative=ngram", "--speculative_k=0"]) == 2
    assert "speculative k must be" in capsys.readouterr().err

    args = serve.build_parser().parse_args(["--speculative=ngram", "--speculative_k=3", "--ngram=2"])
    assert (args.speculative, args.speculative_k, args.ngram) == ("ngram", 3, 2)


def _repeater_for(cfg, seed=0, scale=20.0):
    params = jaxgpt.init_params(cfg, jax.random.key(seed))
    zero = lambda t: jax.tree.map(jnp.zeros_like, t)  # noqa: E731
    params = {k: (zero(v) if k.startswith("h") or k == "wpe" else v) for k, v in params.items()}
    return {**params, "wte": jax.tree.map(lambda w: w * scale, params["wte"])}
