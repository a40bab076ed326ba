"""The engine: each request's tokens equal `generate` for its prompt alone, whatever its neighbours, slot,
prompt chunks or slot reuse; logprobs equal the full forward's log-softmax; scoring with prefix reuse; a
bounded set of programs; per-row sampling equal to `sample_logits`."""

import collections
import io
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpt
from jaxgpt import engine as engine_mod
from jaxgpt.engine import Engine
from jaxgpt.sampling import TOP_K_FAST, RowSettings, sample_logits, sample_rows
from tests.helpers import varied_params, whole_buffer_copies

CFG = jaxgpt.GPTConfig(vocab_size=97, block_size=64, n_layer=2, n_head=4, n_embd=32)
# every sampler path: greedy, top-k among the fast candidates, plain, top-p alone (full sort), top-k above
# the fast candidates (full sort), top-k with top-p
SETTINGS = [dict(temperature=0.0), dict(temperature=0.8, top_k=10, seed=3), dict(temperature=1.0, seed=5),
            dict(temperature=0.7, top_p=0.9, seed=7), dict(temperature=1.2, top_k=TOP_K_FAST + 16, top_p=0.8, seed=1),
            dict(temperature=0.9, top_k=5, top_p=0.5, seed=2)]


@pytest.fixture(scope="module")
def params():
    return jaxgpt.init_params(CFG, jax.random.key(0))


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in lengths]


def _alone(params, cfg, prompt, n, s):
    out = jaxgpt.generate(params, cfg, np.array([prompt]), n, jax.random.key(s.get("seed", 0)),
                          temperature=s["temperature"], top_k=s.get("top_k"), top_p=s.get("top_p"))
    return np.asarray(out.tokens[0, len(prompt):]).tolist()


def _log_softmax(params, cfg, tokens):
    return np.asarray(jax.nn.log_softmax(jaxgpt.GPT(cfg).apply({"params": params}, jnp.array([tokens]))[0], -1))


def test_requests_equal_generate_alone_whatever_their_neighbours(params):
    # 6 requests through 4 slots (two reuse a slot), prompts longer than the 16-token chunk (chunked prefill)
    eng = Engine(params, CFG, slots=4, max_len=64, prefill_chunk=16)
    prompts = _prompts(0, (5, 20, 9, 33, 3, 12))
    outs = eng.run([dict(prompt=p, max_tokens=10, logprobs=3, **s) for p, s in zip(prompts, SETTINGS)])
    for p, s, o in zip(prompts, SETTINGS, outs):
        assert o.token_ids == _alone(params, CFG, p, 10, s), s
        assert o.finish_reason == "length"
        lp = _log_softmax(params, CFG, p + o.token_ids)
        rows = lp[len(p) - 1:len(p) - 1 + 10]
        np.testing.assert_allclose([t.logprob for t in o.tokens], rows[np.arange(10), o.token_ids], atol=1e-5)
        for t, row in zip(o.tokens, rows):  # the 3 alternatives: the 3 largest of the full forward's row
            assert [a for a, _ in t.top] == np.argsort(-row, kind="stable")[:3].tolist()
            np.testing.assert_allclose([b for _, b in t.top], np.sort(row)[::-1][:3], atol=1e-5)


def test_a_request_alone_and_among_others_gives_the_same_tokens(params):
    s = dict(temperature=0.9, top_k=20, top_p=0.95, seed=11)
    prompt = _prompts(1, (7,))[0]
    alone = Engine(params, CFG, slots=3, max_len=48, prefill_chunk=8).run([dict(prompt=prompt, max_tokens=12, **s)])
    eng = Engine(params, CFG, slots=3, max_len=48, prefill_chunk=8)
    others = [dict(prompt=p, max_tokens=n, temperature=1.0, seed=i) for i, (p, n) in
              enumerate(zip(_prompts(2, (20, 4)), (5, 20)))]
    crowd = eng.run(others + [dict(prompt=prompt, max_tokens=12, **s)])  # it lands in slot 2, then others end
    assert crowd[-1].token_ids == alone[0].token_ids


def test_prefill_in_chunks_keeps_the_decoding_rows_pace(params):
    eng = Engine(params, CFG, slots=2, max_len=64, prefill_chunk=4)
    first = eng.submit(_prompts(3, (3,))[0], max_tokens=30, temperature=0.0)
    eng.step()
    eng.submit(_prompts(4, (40,))[0], max_tokens=3, temperature=0.0)
    for _ in range(10):  # the 40-token prompt enters 4 tokens a step; the first request gets a token each step
        assert [e.request_id for e in eng.step() if e.token is not None].count(first) == 1


def test_a_prompt_enters_in_chunks_padded_to_the_next_length(params):
    """16 prompt tokens a step, each chunk padded to the next power of two (splitting 136 tokens as 128 + 8
    measured slower than padding to 256 on a CPU): 9 tokens run as one chunk of 16, 37 as 16, 16 and 5 in
    a chunk of 8; stats count the calls and padded positions; the tokens are generate's."""
    eng = Engine(params, CFG, slots=1, max_len=64, prefill_chunk=16)
    for n, calls, padding in ((9, 1, 7), (16, 1, 0), (37, 3, 3)):
        prompt = _prompts(60 + n, (n,))[0]
        before = collections.Counter(eng.stats)
        rid = eng.submit(prompt, max_tokens=4, temperature=0.0)
        first = eng.step()
        assert (rid in [e.request_id for e in first if e.token]) == (n <= 16)  # its first token in one step
        while eng.has_work():
            eng.step()
        got = eng.stats - before
        assert (got["prefill_calls"], got["prefill_padding"]) == (calls, padding), (n, got)
        out = eng.run([dict(prompt=prompt, max_tokens=4, temperature=0.0)])  # (reuses all but the last token)
        assert out[0].token_ids == _alone(params, CFG, prompt, 4, dict(temperature=0.0))


def test_long_chunks_pad_to_a_multiple_past_64():
    """Past 64 tokens the chunk lengths step by max(32, prefill_chunk / 8), not by powers of two: 70 tokens
    run as one chunk of 96; near the slot's end a chunk that would pad past it is cut to the longest
    length that fits (370 tokens in 380 positions: 256, then 96 of the 114 left, 16 and 2); the tokens
    are generate's."""
    cfg = CFG.replace(block_size=400)
    p = jaxgpt.init_params(cfg, jax.random.key(1))
    assert engine_mod.chunk_lengths(128) == (1, 2, 4, 8, 16, 32, 64, 96, 128)
    assert engine_mod.chunk_lengths(512)[7:] == (128, 192, 256, 320, 384, 448, 512)
    for max_len, n, calls, padding in ((160, 70, 1, 26), (380, 370, 4, 0)):
        eng = Engine(p, cfg, slots=1, max_len=max_len, prefill_chunk=256)
        prompt = _prompts(70 + n, (n,))[0]
        out = eng.run([dict(prompt=prompt, max_tokens=3, temperature=0.0)])
        assert (eng.stats["prefill_calls"], eng.stats["prefill_padding"]) == (calls, padding), (n, eng.stats)
        assert out[0].token_ids == _alone(p, cfg, prompt, 3, dict(temperature=0.0))


def test_stop_tokens_cancel_and_stream(params):
    eng = Engine(params, CFG, slots=2, max_len=64, prefill_chunk=16)
    prompt = _prompts(5, (6,))[0]
    greedy = eng.run([dict(prompt=prompt, max_tokens=12, temperature=0.0)])[0].token_ids
    stop = greedy[4]
    out = eng.run([dict(prompt=prompt, max_tokens=12, temperature=0.0, stop_token_ids=(stop,))])[0]
    assert out.token_ids == greedy[:greedy.index(stop) + 1] and out.finish_reason == "stop"
    assert [t.id for t in eng.stream(prompt, max_tokens=12, temperature=0.0)] == greedy
    # a request's rng: a typed key, or its raw uint32 data, draws as the seed it was made from
    by_seed = eng.run([dict(prompt=prompt, max_tokens=6, seed=9)])[0].token_ids
    for rng in (jax.random.key(9), jax.random.key_data(jax.random.key(9))):
        assert eng.run([dict(prompt=prompt, max_tokens=6, rng=rng)])[0].token_ids == by_seed
    rid = eng.submit(prompt, max_tokens=12)
    eng.step()
    assert eng.num_running == 1 and eng.cancel(rid) and eng.num_running == 0 and not eng.cancel(rid)


def test_scoring_equals_the_full_forward_and_reuses_a_shared_context(params):
    ctx = _prompts(6, (20,))[0]
    endings = [_prompts(7 + i, (1 + i,))[0] for i in range(4)]
    eng = Engine(params, CFG, slots=4, max_len=64, prefill_chunk=16)
    got = eng.score([ctx] * 4, endings)
    assert eng.stats["reused_tokens"] >= 3 * (len(ctx) - 1)  # the context computed once, copied thrice
    for (lp, greedy), end in zip(got, endings):
        rows = _log_softmax(params, CFG, ctx + end)[len(ctx) - 1:-1]
        np.testing.assert_allclose(lp, rows[np.arange(len(end)), end].sum(), atol=1e-4)
        assert greedy == bool((rows.argmax(-1) == np.array(end)).all())
    greedy_end = eng.run([dict(prompt=ctx, max_tokens=3, temperature=0.0)])[0].token_ids
    lp_greedy, is_greedy = eng.score([ctx], [greedy_end])[0]
    assert is_greedy and np.isfinite(lp_greedy)
    # the same scores from an engine that has nothing to reuse
    fresh = [Engine(params, CFG, slots=1, max_len=64, prefill_chunk=16).score([ctx], [e])[0] for e in endings[:2]]
    np.testing.assert_allclose([f[0] for f in fresh], [g[0] for g in got[:2]], atol=1e-5)


def test_many_pairs_sharing_contexts_through_few_slots(params):
    # more requests than slots, each context shared by several: a request waiting to copy a context from
    # a slot that another request has since taken must not wait for ever
    common = _prompts(19, (6,))[0]  # as an evaluation's prompt template: every context begins alike
    ctxs = [common + c for c in _prompts(20, (12, 17, 9, 14, 6, 11, 20, 8))]
    pairs = [(ctx, _prompts(30 + 4 * i + j, (1 + j,))[0]) for i, ctx in enumerate(ctxs) for j in range(4)]
    eng = Engine(params, CFG, slots=4, max_len=64, prefill_chunk=16)
    got = eng.score([c for c, _ in pairs], [e for _, e in pairs])
    assert eng.stats["copies"] > 0 and not eng.has_work()
    for (ctx, end), (lp, _) in zip(pairs, got):
        rows = _log_softmax(params, CFG, ctx + end)[len(ctx) - 1:-1]
        np.testing.assert_allclose(lp, rows[np.arange(len(end)), end].sum(), atol=1e-4)


def test_a_request_takes_a_low_slot_and_a_prefix_held_by_a_free_high_one_is_copied_into_it(params):
    """Decode steps cover the slots up to the highest busy one: a new request goes to a low free slot (not
    to a high one because it shares a token or two with that slot's old text), and a free high slot that
    holds more of its prompt is copied into the low one."""
    eng = Engine(params, CFG, slots=4, max_len=64, prefill_chunk=16)
    prompts = _prompts(40, (10, 12, 14, 16))
    eng.run([dict(prompt=p, max_tokens=3, temperature=0.0) for p in prompts])  # slots 0..3, all free again
    before = collections.Counter(eng.stats)
    s, events = dict(temperature=0.7, top_k=20, seed=9), []
    rid = eng.submit(prompts[3] + [5, 6], max_tokens=6, callback=events.append, **s)
    eng.step()
    assert [live.rid if live else None for live in eng._live] == [rid, None, None, None]
    assert eng.stats["copies"] == before["copies"] + 1 and eng.stats["reused_tokens"] >= before["reused_tokens"] + 16
    while eng.has_work():
        eng.step()
    assert [e.token.id for e in events if e.token] == _alone(params, CFG, prompts[3] + [5, 6], 6, s)


def test_no_program_is_compiled_for_new_settings_lengths_or_counts(params):
    eng = Engine(params, CFG, slots=3, max_len=44, prefill_chunk=8)  # a shape no other test uses
    # prefill with and without logprobs per chunk length and window (the chunks of 8 positions or fewer
    # from 0: 1, 2, 4 and 8 in windows of 8, 32 and 44), decode per count of leading slots, the copy
    assert engine_mod.prefill_windows(8, 44) == (8, 32, 44)
    assert engine_mod.prefill_programs(8, 44) == [(c, w) for w in (8, 32, 44) for c in (1, 2, 4, 8)]
    programs = 2 * len(engine_mod.prefill_programs(8, 44)) + len(engine_mod.decode_sizes(3)) + 1
    assert eng.warmup_programs() == programs
    assert eng.warmup() == programs
    before = dict(engine_mod.TRACES)
    prompts = _prompts(8, (1, 2, 3, 5, 7, 8, 9, 17, 30))
    reqs = [dict(prompt=p, max_tokens=1 + i % 5, temperature=[0.0, 0.3, 1.7][i % 3], top_k=[None, 2, 90][i % 3],
                 top_p=[None, 0.5, 1.0][(i + 1) % 3], seed=i, logprobs=i % 4) for i, p in enumerate(prompts)]
    eng.run(reqs)
    eng.run(reqs[:2])
    eng.score([prompts[4]], [prompts[5]])
    assert dict(engine_mod.TRACES) == before
    assert eng.programs_compiled == programs
    assert eng.warmup() == 0


def test_warmup_shows_its_progress_on_a_terminal_only(params, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    eng = Engine(params, CFG, slots=3, max_len=44, prefill_chunk=8)  # (the shape of the test above)
    n = eng.warmup_programs(prompt_logprobs=False)
    assert n == len(engine_mod.prefill_programs(8, 44)) + len(engine_mod.decode_sizes(3)) + 1
    for progress, tty, shown in ((True, True, True), (True, False, False), (False, True, False)):
        err = Terminal() if tty else io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        eng.warmup(prompt_logprobs=False, progress=progress)
        assert ("compiling: 100%" in err.getvalue() and f"{n}/{n}" in err.getvalue()) == shown, err.getvalue()
    monkeypatch.undo()
    assert eng.run([dict(prompt=[1, 2, 3], max_tokens=2)])[0].token_ids  # the cache was left usable


def test_prefill_budget_lets_several_prompts_in_per_step(params):
    """prefill_budget: prompt tokens per step over as many waiting requests as it reaches, each single-prompt
    call at most prefill_chunk of one prompt, or whole prompts packed into one call; the tokens are those
    of the default budget."""
    prompts = _prompts(52, (9, 12, 5, 20))
    reqs = [dict(prompt=p, max_tokens=6, **s) for p, s in zip(prompts, SETTINGS)]
    small = Engine(params, CFG, slots=4, max_len=64, prefill_chunk=16)
    big = Engine(params, CFG, slots=4, max_len=64, prefill_chunk=16, prefill_budget=64)
    packed = Engine(params, CFG, slots=4, max_len=64, prefill_chunk=16, prefill_budget=64, packed_prefill=True)
    done = {small: {}, big: {}, packed: {}}
    for eng in (small, big, packed):
        for i, r in enumerate(reqs):
            eng.submit(**r, callback=lambda e, i=i, d=done[eng]: d.__setitem__(i, e.completion.token_ids)
                       if e.finish_reason is not None else None)
        eng.step()
    assert small.stats["prefill_tokens"] == 16 and big.stats["prefill_tokens"] == packed.stats["prefill_tokens"] == 46
    assert big.stats["prefill_calls"] == 5  # (the 20-token prompt in two calls)
    # three prompts in one call; the 20-token one, longer than a chunk, in two of its own
    assert packed.stats["prefill_packed_calls"] == 1 and packed.stats["prefill_calls"] == 3
    small.run(), big.run(), packed.run()
    assert len(done[small]) == 4 and done[small] == done[big] == done[packed]
    assert all(len(t) == 6 for t in done[big].values())
    with pytest.raises(ValueError, match="prefill_budget"):
        Engine(params, CFG, slots=2, prefill_budget=0)


def test_a_step_that_prefills_an_arrival_decodes_one_step(params):
    """decode_steps=4 runs 4 steps a call while requests only decode; a step that prefilled a new request
    (arrivals come in bursts, and the next one would wait for the whole call) decodes one."""
    prompts = _prompts(51, (6, 7))
    eng = Engine(params, CFG, slots=2, max_len=64, prefill_chunk=16, decode_steps=4)
    eng.submit(prompts[0], max_tokens=30, temperature=0.0)
    eng.step()  # its prefill and one decode step
    assert eng.stats["decode_steps"] == 1
    eng.step()
    assert eng.stats["decode_steps"] == 5  # only decoding: four in one call
    eng.submit(prompts[1], max_tokens=30, temperature=0.0)
    eng.step()
    assert eng.stats["decode_steps"] == 6 and eng.stats["prefill_calls"] == 2
    eng.step()
    assert eng.stats["decode_steps"] == 10
    # the rows: 1 (one request, one row), 4 x 1, 1 x 2 (the arrival's step), 4 x 2; four calls, timed
    assert (eng.stats["decode_rows"], eng.stats["decode_width"], eng.stats["decode_calls"]) == (15, 15, 4)
    assert eng.stats["decode_seconds"] > 0 and eng.stats["prefill_seconds"] > 0


def test_decode_steps_by_rows_and_a_requests_last_tokens_in_one_call(params):
    """decode_steps as {rows: steps}: each decode row count takes the entry of the largest key at most it. A
    call runs as many steps as the nearest request to its max_tokens has left, so a request's last tokens
    take one call, not one each; the tokens and logprobs stay those of single steps."""
    assert engine_mod.steps_by_rows({1: 16, 2: 8, 4: 4}, 32) == {1: 16, 2: 8, 4: 4, 8: 4, 16: 4, 32: 4}
    assert engine_mod.steps_by_rows(3, 5) == {1: 3, 2: 3, 4: 3, 5: 3}
    assert engine_mod.steps_by_rows({1: 1, 4: 2}, 8) == {1: 1, 2: 1, 4: 2, 8: 2}
    for bad in (0, {2: 4}, {1: 0}, {1: 4, 0: 2}, {1: 2.5}, "4", {}):
        with pytest.raises(ValueError, match="decode_steps"):
            Engine(params, CFG, slots=2, decode_steps=bad)
    prompts = _prompts(53, (6, 9))
    s = dict(temperature=1.0, seed=4)
    one = Engine(params, CFG, slots=2, max_len=64, prefill_chunk=16)
    lone = Engine(params, CFG, slots=2, max_len=64, prefill_chunk=16, decode_steps={1: 8, 2: 3})
    ref = one.run([dict(prompt=prompts[0], max_tokens=12, logprobs=1, **s)])[0]
    out = lone.run([dict(prompt=prompts[0], max_tokens=12, logprobs=1, **s)])[0]
    # 12 tokens: the prefill's, one step beside it (an arrival's step), then 8 in a call and the last 2 in one
    assert (lone.stats["decode_steps"], lone.stats["decode_calls"]) == (11, 3)
    assert out.token_ids == ref.token_ids == _alone(params, CFG, prompts[0], 12, s)
    np.testing.assert_allclose([t.logprob for t in out.tokens], [t.logprob for t in ref.tokens],
                               atol=1e-5)
    # two requests decode over 2 rows: 3 steps a call there
    lone.stats.clear()
    outs = lone.run([dict(prompt=p, max_tokens=7, **s) for p in prompts])
    assert lone.stats["decode_calls"] == 1 + 2 and lone.stats["decode_steps"] == 1 + 3 + 2
    assert [o.token_ids for o in outs] == [_alone(params, CFG, p, 7, s) for p in prompts]


def test_several_decode_steps_per_call_give_the_single_steps_tokens(params):
    """decode_steps=4: while every request in a slot is generating with 4 tokens to go, one call decodes 4
    steps. Tokens, logprobs, alternatives and finish reasons equal single
    steps', with stop tokens mid-call, lengths that are not multiples of 4, a request arriving while others
    decode, slot reuse and a cancel."""
    prompts = _prompts(50, (5, 20, 9, 33, 3, 12))
    settings = [SETTINGS[1], SETTINGS[0]] + SETTINGS[2:]
    free = Engine(params, CFG, slots=1, max_len=64).run([dict(prompt=prompts[0], max_tokens=12,
                                                              **settings[0])])[0].token_ids
    at = next(i for i in range(5, 12) if free[i] not in free[:i])  # a token first drawn mid-call
    stops = [(free[at],), (), (1, 2, 3), (), tuple(range(40, 49)), ()]
    reqs = [dict(prompt=p, max_tokens=n, logprobs=2, stop_token_ids=st, **s)
            for p, n, st, s in zip(prompts, (12, 20, 15, 6, 11, 13), stops, settings)]

    def serve(decode_steps):
        eng = Engine(params, CFG, slots=3, max_len=64, prefill_chunk=16, decode_steps=decode_steps)
        ids = [eng.submit(**r) for r in reqs[:4]]
        outs = {}
        for i in range(200):
            if i == 5:  # one arrives while the others decode
                ids.append(eng.submit(**reqs[4]))
            if i == 6:
                ids.append(eng.submit(**reqs[5]))
            if i == 4:
                assert eng.cancel(ids[1])  # (20 tokens: still going)
            for e in eng.step():
                if e.finish_reason is not None:
                    outs[e.request_id] = e.completion
            if not eng.has_work() and i > 6:
                break
        return [outs.get(rid) for rid in ids], eng.stats

    single, one_stats = serve(1)
    several, stats = serve(4)
    assert stats["decode_calls"] < stats["decode_steps"] and one_stats["decode_calls"] == one_stats["decode_steps"]
    assert single[0].finish_reason == "stop" and single[0].token_ids == free[:at + 1]
    assert single[1] is several[1] is None  # (a cancelled request's callback-less events are not kept)
    for a, b in zip(single, several):
        if a is None or a.finish_reason == "cancelled":
            continue
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
        np.testing.assert_allclose([t.logprob for t in b.tokens], [t.logprob for t in a.tokens], atol=1e-5)
        assert [[i for i, _ in t.top] for t in b.tokens] == [[i for i, _ in t.top] for t in a.tokens]
    for p, r, o in zip(prompts, reqs, several):  # and each equals generate alone, up to its stop
        if o is not None and o.finish_reason != "cancelled":
            s = {k: r[k] for k in ("temperature", "top_k", "top_p", "seed") if k in r}
            assert o.token_ids == _alone(params, CFG, p, r["max_tokens"], s)[:len(o.token_ids)]
    # its programs: the single-step ones and one several-step decode per count of leading slots
    eng = Engine(params, CFG, slots=3, max_len=46, prefill_chunk=8, decode_steps=4)  # a shape no other test uses
    assert eng.warmup() == 2 * len(engine_mod.prefill_programs(8, 46)) + 2 * len(engine_mod.decode_sizes(3)) + 1
    with pytest.raises(ValueError, match="decode_steps"):
        Engine(params, CFG, slots=3, decode_steps=0)


@pytest.mark.parametrize("kernels", ["portable", "cpu", "tpu", "gpu"])
def test_every_backend_runs_the_engine(params, kernels):
    cfg = CFG.replace(kernels=kernels)
    prompts = _prompts(9, (4, 11))
    eng = Engine(params, cfg, slots=2, max_len=32, prefill_chunk=8)
    outs = eng.run([dict(prompt=p, max_tokens=6, temperature=0.0) for p in prompts])
    for p, o in zip(prompts, outs):
        assert o.token_ids == _alone(params, cfg, p, 6, dict(temperature=0.0))


@pytest.mark.parametrize("variant", ["portable", "cpu", "int8_cache", "cpu_bf16", "stacked_gqa_rope"])
def test_packed_prompts_give_the_tokens_of_one_prompt_a_call(params, variant):
    """Whole prompts packed into one prefill call (each attending within itself, its keys and values then
    scattered into its own slot; a padding prompt and padding tokens dropped): the tokens of the same
    engine prefilling one prompt a call, logprobs within 1e-5 (float32); every cache layout and dtype."""
    cfg, kw, p = CFG, {}, params
    if variant in ("cpu", "cpu_bf16"):
        cfg = CFG.replace(kernels="cpu", dtype="bfloat16" if variant == "cpu_bf16" else "float32")
    elif variant == "int8_cache":
        kw = dict(kv_dtype="int8")
    elif variant == "stacked_gqa_rope":
        cfg = CFG.replace(scan_layers=True, n_kv_head=2, position="rope", norm="rmsnorm", mlp="swiglu", bias=False)
        p = jaxgpt.init_params(cfg, jax.random.key(1))
    prompts = _prompts(60, (7, 13, 4, 22, 9))
    reqs = [dict(prompt=q, max_tokens=8, logprobs=2, **s) for q, s in zip(prompts, SETTINGS)]
    outs = {}
    for packed in (True, False):
        eng = Engine(p, cfg, slots=6, max_len=48, prefill_chunk=32, prefill_budget=64, packed_prefill=packed, **kw)
        outs[packed] = eng.run(reqs)
        assert eng.stats["prefill_packed_calls"] == (1 if packed else 0)
        assert eng.stats["prefill_tokens"] == sum(map(len, prompts))
    tol = 2e-2 if variant == "cpu_bf16" else 1e-5
    for a, b, q in zip(outs[True], outs[False], prompts):
        assert a.token_ids == b.token_ids, q
        np.testing.assert_allclose([t.logprob for t in a.tokens], [t.logprob for t in b.tokens], atol=tol)
    if variant == "portable":  # and each equals generate alone; the packed programs are warmed up too
        for q, s, o in zip(prompts, SETTINGS, outs[True]):
            assert o.token_ids == _alone(params, CFG, q, 8, s)
        Engine(p, cfg, slots=5, max_len=50, prefill_chunk=32, prefill_budget=64).warmup()  # a shape no other test uses
        eng = Engine(p, cfg, slots=5, max_len=50, prefill_chunk=32, prefill_budget=64, packed_prefill=True)
        assert eng.warmup() == len(engine_mod.packed_lengths(64))
        before = dict(engine_mod.TRACES)
        eng.run(reqs)
        assert eng.stats["prefill_packed_calls"] == 1 and dict(engine_mod.TRACES) == before
        # a budget past the model's context packs at most block_size tokens (one forward's length)
        wide = Engine(p, cfg, slots=2, max_len=48, prefill_chunk=32, prefill_budget=500, packed_prefill=True)
        assert wide._packed_lengths == engine_mod.packed_lengths(cfg.block_size)


def test_stacked_layers_grouped_queries_and_rope():
    cfg = CFG.replace(scan_layers=True, n_kv_head=2, position="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    params = jaxgpt.init_params(cfg, jax.random.key(1))
    prompts = _prompts(10, (5, 19, 2))
    s = dict(temperature=0.8, top_k=30, seed=4)
    eng = Engine(params, cfg, slots=2, max_len=40, prefill_chunk=8)
    outs = eng.run([dict(prompt=p, max_tokens=8, **s) for p in prompts])
    for p, o in zip(prompts, outs):
        assert o.token_ids == _alone(params, cfg, p, 8, s)
    got = eng.score([prompts[1]] * 2, [[1, 2], [3]])
    rows = _log_softmax(params, cfg, prompts[1] + [1, 2])[len(prompts[1]) - 1:-1]
    np.testing.assert_allclose(got[0][0], rows[0, 1] + rows[1, 2], atol=1e-4)


def test_sample_rows_is_sample_logits_per_row():
    logits = jax.random.normal(jax.random.key(0), (len(SETTINGS) * 4, 97)) * 3
    logits = logits.at[0, :5].set(10.0)  # ties
    settings = SETTINGS * 4
    rows = RowSettings(
        temperature=np.array([s["temperature"] for s in settings], np.float32),
        top_k=np.array([s.get("top_k") or 0 for s in settings], np.int32),
        top_p=np.array([s.get("top_p") or 1.0 for s in settings], np.float32),
        key_data=np.stack([np.asarray(jax.random.key_data(jax.random.key(s.get("seed", 0) + i))) for i, s in
                           enumerate(settings)]),
        index=np.arange(len(settings), dtype=np.int32) % 3)
    got = np.asarray(jax.jit(sample_rows)(logits, rows))
    for i, s in enumerate(settings):
        rng = jax.random.fold_in(jax.random.key(s.get("seed", 0) + i), i % 3)
        want = sample_logits(rng, logits[i:i + 1], s["temperature"], s.get("top_k"), s.get("top_p"))
        assert got[i] == int(want[0]), (i, s)


def test_a_bad_request_never_touches_its_neighbours(params):
    """A seed past int64 is refused at submit, naming the field; a top_k past int32 (it overflowed the
    step's int32 arrays: an OverflowError in that step and every later one) is the vocabulary, as generate
    takes it. The requests around them give their tokens alone, and the engine keeps working."""
    eng = Engine(params, CFG, slots=4, max_len=48, prefill_chunk=16)
    prompts = _prompts(70, (5, 9, 4, 7))
    good = [dict(prompt=p, max_tokens=6, **s) for p, s in zip(prompts[:3], SETTINGS[1:4])]
    done = {}

    def keep(event):
        if event.completion is not None:
            done[event.request_id] = event.completion.token_ids

    ids = [eng.submit(callback=keep, **r) for r in good[:2]]
    for seed in (10 ** 30, 2 ** 63, -2 ** 63 - 1):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\]"):
            eng.submit(prompts[3], max_tokens=6, seed=seed)
    huge = dict(temperature=0.8, top_k=2 ** 31, seed=9)
    outs = eng.run([dict(prompt=prompts[3], max_tokens=6, **huge), good[2]])  # all four in the same steps
    assert outs[0].token_ids == _alone(params, CFG, prompts[3], 6, dict(huge, top_k=None))
    assert outs[0].token_ids == _alone(params, CFG, prompts[3], 6, huge)  # (generate clamps it too)
    got = [done[i] for i in ids] + [outs[1].token_ids]
    assert got == [_alone(params, CFG, r["prompt"], 6, s) for r, s in zip(good, SETTINGS[1:4])]
    assert eng.run([good[0]])[0].token_ids == got[0]
    assert len(eng.score([prompts[0]], [[1, 2]])) == 1 and not eng.has_work()
    for seed in (2 ** 63 - 1, -2 ** 63):  # the ends of the range are taken
        assert len(eng.run([dict(prompt=prompts[0], max_tokens=2, seed=seed)])[0].token_ids) == 2


@pytest.mark.parametrize("kernels", ["portable", "cpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_near_greedy_requests_get_the_greedy_tokens(params, kernels, dtype):
    """temperature 1e-30 or top_p 1e-40, on every row path of the sampler (top-k among the candidates, top-k
    by a full sort, top-p over the vocabulary, no filter): the greedy request's tokens, never token 0."""
    cfg = CFG.replace(kernels=kernels, dtype=dtype)
    p = varied_params(cfg)
    prompt = _prompts(71, (6,))[0]
    eng = Engine(p, cfg, slots=6, max_len=32, prefill_chunk=8)
    greedy = eng.run([dict(prompt=prompt, max_tokens=10, temperature=0.0)])[0].token_ids
    assert len(set(greedy)) >= 4  # (a continuation that varies)
    near = [dict(temperature=1e-30), dict(temperature=1e-12, top_k=10), dict(temperature=1e-30, top_k=80),
            dict(top_p=1e-40), dict(temperature=0.9, top_k=10, top_p=1e-40), dict(temperature=1e-40, top_p=0.5)]
    outs = eng.run([dict(prompt=prompt, max_tokens=10, seed=i, **s) for i, s in enumerate(near)])
    assert [o.token_ids for o in outs] == [greedy] * len(near)


def test_engine_errors_name_the_setting(params):
    eng = Engine(params, CFG, slots=1, max_len=32, prefill_chunk=8)
    for prompt, kw, words in [([], {}, "at least one"), ([1, 200], {}, "outside the vocabulary"),
                              ([1] * 30, dict(max_tokens=5), "max_len"), ([1], dict(max_tokens=-1), "max_tokens"),
                              ([1], dict(temperature=-1.0), "temperature"), ([1], dict(logprobs=21), "logprobs"),
                              ([1], dict(top_p=0.0), "top_p"), ([1], dict(stop_token_ids=(97,)), "stop token"),
                              (["a"], {}, "token ids")]:
        with pytest.raises(ValueError, match=words):
            eng.submit(prompt, **kw)
    with pytest.raises(ValueError, match="rng"):
        eng.submit([1], rng=3)
    with pytest.raises(TypeError, match="unknown request setting"):
        eng.submit([1], temprature=0.5)
    with pytest.raises(ValueError, match="block_size"):
        Engine(params, CFG, slots=1, max_len=65)
    with pytest.raises(ValueError, match="slots"):
        Engine(params, CFG, slots=0)
    assert not eng.has_work()


@pytest.mark.parametrize("kernels", ["portable", "cpu"])
def test_a_prefill_chunk_writes_the_cache_in_place(params, kernels):
    """No prefill program copies the cache's buffers: a one-token chunk in a window smaller than the slot
    (what follows a copied prefix) once made XLA:CPU copy the whole cache around the chunk's write (0.9 s
    a call at 32 slots of 1024 positions, the whole cache in fresh pages), as a whole window put back did."""
    cfg = CFG.replace(kernels=kernels)
    eng = Engine(params, cfg, slots=4, max_len=64, prefill_chunk=8)
    shapes = {f"{a.dtype}{list(a.shape)}".replace(" ", "").replace("float32", "f32")
              for a in jax.tree.leaves((eng.cache.k, eng.cache.v))}
    for c, w in engine_mod.prefill_programs(8, 64):
        hlo = engine_mod._prefill.lower(
            eng._prefill_weights, eng.cache, np.int32(1), np.int32(w - c), np.zeros((1, c), np.int32), np.int32(c),
            np.zeros((c,), np.int32), eng._rows([None]), prompt_logprobs=False, n_logprobs=eng.max_logprobs,
            window=w, **eng._static).compile().as_text()
        assert not whole_buffer_copies(hlo, shapes), (c, w)


def test_seeds_past_32_bits_draw_differently_and_small_seeds_keep_their_keys():
    from jaxgpt.engine import seed_key

    data = lambda seed: jax.random.key_data(seed_key(seed)).tolist()  # noqa: E731
    assert data(5) == jax.random.key_data(jax.random.key(5)).tolist()  # what a request's seed always gave
    seeds = [0, 2 ** 32, 2 ** 33, -2 ** 63, 2 ** 63 - 1, 2 ** 62]
    assert len({tuple(data(s)) for s in seeds}) == len(seeds)  # jax.random.key alone: 0, 2**32, 2**62 alike
