"""The paged engine: each request's tokens equal `generate` for its prompt alone, whatever its neighbours,
its chunks, the prefix cache or a preemption; logprobs equal the full forward's log-softmax; every program
compiled by warmup(); the ragged step's arrays and the runner checked against the full forward."""

import contextlib
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import pytest

import jaxgpt
from jaxgpt import engine as engine_mod
from jaxgpt.backends import PORTABLE
from jaxgpt.engine import Engine, runner
from jaxgpt.engine.paged import PagedEngine
from jaxgpt.engine.plan import Plan, Work
from jaxgpt.paged import PagedCache

from tests.test_engine import CFG, SETTINGS, _alone, _log_softmax, _prompts  # (the same model and helpers)

GQA = jaxgpt.GPTConfig(vocab_size=97, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)


@pytest.fixture(scope="module")
def params():
    return jaxgpt.init_params(CFG, jax.random.key(0))


def _check_alone(params, cfg, prompts, settings, outs, n):
    for p, s, o in zip(prompts, settings, outs):
        assert o.token_ids == _alone(params, cfg, p, n, s), s
        lp = _log_softmax(params, cfg, p + o.token_ids)
        rows = lp[len(p) - 1:len(p) - 1 + n]
        np.testing.assert_allclose([t.logprob for t in o.tokens], rows[np.arange(n), o.token_ids], atol=1e-5)


@pytest.mark.parametrize("backend", [None, PORTABLE], ids=["default", "portable"])
def test_requests_equal_generate_alone_whatever_their_neighbours(params, backend):
    # 6 requests, 4 running at once, a 24-token budget: prompts chunked over steps, beside decoding rows
    eng = PagedEngine(params, CFG, max_requests=4, max_len=64, page_size=4, token_budget=24, max_chunk=16,
                      backend=backend)
    prompts = _prompts(0, (5, 20, 9, 33, 3, 12))
    outs = eng.run([dict(prompt=p, max_tokens=10, logprobs=3, **s) for p, s in zip(prompts, SETTINGS)])
    _check_alone(params, CFG, prompts, SETTINGS, outs, 10)
    for o in outs:
        assert o.finish_reason == "length"
        lp = _log_softmax(params, CFG, list(o.prompt) + o.token_ids)[len(o.prompt) - 1:]
        for t, row in zip(o.tokens, lp):  # the 3 alternatives: the 3 largest of the full forward's row
            assert [a for a, _ in t.top] == np.argsort(-row, kind="stable")[:3].tolist()
    assert eng.stats.padding_tokens >= 0 and eng.stats.generated_tokens == 60
    assert eng.scheduler.stats.pages_in_use == 0  # every page back in the pool


def test_grouped_query_attention_and_page_sizes():
    params = jaxgpt.init_params(GQA, jax.random.key(1))
    prompts = _prompts(1, (7, 18, 30))
    for page, least in ((1, 1), (16, 4)):  # (steps of at least 4 tokens: padding rows change nothing)
        eng = PagedEngine(params, GQA, max_requests=3, max_len=64, page_size=page, token_budget=16,
                          min_step_tokens=least, decode_steps={1: 4})
        assert min(t for t, _ in eng.shapes) == least
        outs = eng.run([dict(prompt=p, max_tokens=8, **s) for p, s in zip(prompts, SETTINGS)])
        _check_alone(params, GQA, prompts, SETTINGS, outs, 8)


def test_preempted_requests_are_recomputed_unchanged(params):
    # 4 requests of up to 30 + 20 positions each in a pool of 24 pages of 4 (92 positions): the newest is
    # preempted (its pages taken back) and recomputed later, prompt and generated tokens alike
    prompts = _prompts(2, (30, 25, 28, 22))
    eng = PagedEngine(params, CFG, max_requests=4, max_len=64, page_size=4, num_pages=24, token_budget=32,
                      prefix_caching=False)
    outs = eng.run([dict(prompt=p, max_tokens=20, **s) for p, s in zip(prompts, SETTINGS)])
    assert eng.stats.preemptions > 0
    _check_alone(params, CFG, prompts, SETTINGS, outs, 20)
    assert eng.stats.peak_pages <= 23


def test_prefix_cache_reuses_pages_and_changes_nothing(params):
    system = _prompts(3, (21,))[0]  # 5 full pages of 4 and one token
    tails = _prompts(4, (3, 6, 1))
    prompts = [system + t for t in tails]
    eng = PagedEngine(params, CFG, max_requests=4, max_len=64, page_size=4, token_budget=64)
    first = eng.run([dict(prompt=prompts[0], max_tokens=5, **SETTINGS[1])])
    assert eng.stats.prefix_hits == 0
    rest = eng.run([dict(prompt=p, max_tokens=5, **s) for p, s in zip(prompts[1:], SETTINGS[2:])])
    assert eng.stats.prefix_hits == 2 * 20  # the system prompt's 5 full pages, twice
    assert eng.stats.prefix_queries == sum(len(p) for p in prompts)
    _check_alone(params, CFG, prompts, SETTINGS[1:], first + rest, 5)
    off = PagedEngine(params, CFG, max_requests=4, max_len=64, page_size=4, token_budget=64, prefix_caching=False)
    again = off.run([dict(prompt=p, max_tokens=5, **s) for p, s in zip(prompts, SETTINGS[1:])])
    assert off.stats.prefix_hits == 0
    assert [o.token_ids for o in again] == [o.token_ids for o in first + rest]


def test_prompt_logprobs_and_scoring_equal_the_full_forward(params):
    prompts = _prompts(5, (12, 30, 7))
    eng = PagedEngine(params, CFG, max_requests=2, max_len=64, page_size=8, token_budget=16)
    outs = eng.run([dict(prompt=p, max_tokens=2, prompt_logprobs=True, logprobs=2) for p in prompts])
    for p, o in zip(prompts, outs):
        lp = _log_softmax(params, CFG, p)
        assert o.prompt_logprobs[0] is None
        np.testing.assert_allclose(o.prompt_logprobs[1:], lp[np.arange(len(p) - 1), p[1:]], atol=1e-5)
        assert o.prompt_greedy[1:] == (np.argmax(lp[:-1], -1) == np.array(p[1:])).tolist()
    ctx = _prompts(6, (20,))[0]
    conts = [[1, 2, 3], [4], [5, 6]]
    scored = eng.score([ctx] * 3, conts)
    for (total, _), cont in zip(scored, conts):
        lp = _log_softmax(params, CFG, ctx + cont)
        want = sum(lp[len(ctx) - 1 + i, t] for i, t in enumerate(cont))
        assert abs(total - want) < 1e-4


def test_int8_pages_equal_the_dense_int8_engine(params):
    prompts = _prompts(7, (9, 26, 14))
    reqs = [dict(prompt=p, max_tokens=8, logprobs=0, **s) for p, s in zip(prompts, SETTINGS)]
    paged = PagedEngine(params, CFG, max_requests=3, max_len=64, page_size=8, token_budget=32, kv_dtype="int8")
    dense = Engine(params, CFG, slots=3, max_len=64, prefill_chunk=32, kv_dtype="int8")
    for a, b in zip(paged.run(reqs), dense.run(reqs)):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose([t.logprob for t in a.tokens], [t.logprob for t in b.tokens], atol=1e-4)
    assert paged.cache.k[0].dtype == jnp.int8


@contextlib.contextmanager
def _compiles():
    """The names of the threads that compiled a program (XLA's backend compile) inside the block."""
    seen = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(threading.current_thread().name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_warmup_compiles_every_program_a_mix_needs(params):
    eng = PagedEngine(params, CFG, max_requests=4, max_len=64, page_size=4, token_budget=16)
    assert eng.warmup_programs() == 2 * len(runner.step_shapes(16, 4))
    eng.warmup()
    before = dict(engine_mod.TRACES)
    prompts = _prompts(8, (1, 2, 15, 40, 3, 9, 16, 17))
    with _compiles() as compiled:  # (compiled without running: the calls find them all the same)
        eng.run([dict(prompt=p, max_tokens=6, prompt_logprobs=i % 2 == 0, **SETTINGS[i % 6])
                 for i, p in enumerate(prompts)])
    assert dict(engine_mod.TRACES) == before and compiled == []


def test_warmup_runs_each_step_program_once_on_page_0_only(params, monkeypatch):
    # a program's first run costs more than its later ones: warmup runs each compiled step program once
    # (plain steps and several decode steps), every token padding, so the first request does not pay it;
    # what they write lands on page 0 (no request reads it), and nothing is counted
    ran = []

    class Counted:  # (the jitted function, its calls recorded; `lower` as before)
        def __init__(self, name):
            self.name, self.fn = name, getattr(runner, name)

        def __call__(self, *args, **kwargs):
            ran.append((self.name, args[2].tokens.shape[0]))
            return self.fn(*args, **kwargs)

        def __getattr__(self, attr):
            return getattr(self.fn, attr)

    for name in ("ragged_step", "ragged_decode_steps"):
        monkeypatch.setattr(runner, name, Counted(name))
    eng = PagedEngine(params, CFG, max_requests=4, max_len=32, page_size=4, token_budget=8,
                      decode_steps={1: 3, 4: 2})
    assert not eng.async_scheduling  # (the default on CPUs)
    eng.warmup(prompt_logprobs=False)
    want = [("ragged_step", t) for t, _ in eng.shapes] + [("ragged_decode_steps", t) for t, _ in eng._shape_steps]
    assert sorted(ran) == sorted(want) and eng.stats.steps == 0 and eng.stats.calls == 0
    pools = [x for x in jax.tree.leaves(eng.cache) if x.shape[0] == eng.num_pages]
    assert pools and all(not np.asarray(x[1:]).any() for x in pools)
    prompts = _prompts(14, (3, 9))
    outs = eng.run([dict(prompt=p, max_tokens=6, **s) for p, s in zip(prompts, SETTINGS)])
    _check_alone(params, CFG, prompts, SETTINGS, outs, 6)
    ran.clear()  # in the background: only the largest shape's step runs before warmup returns
    other = PagedEngine(params, CFG, max_requests=4, max_len=32, page_size=4, token_budget=8, async_scheduling=True)
    other.warmup(prompt_logprobs=False, background=True)
    assert ran == [("ragged_step", other.shapes[-1][0])] and other.async_scheduling
    assert other.programs.join(timeout=300)


def test_a_background_warmup_serves_at_once_padded_to_the_programs_ready(params):
    # sizes no other test uses (so nothing is compiled yet): the largest shape's programs are compiled before
    # warmup returns, the rest wait on the test's signal; meanwhile every step runs the largest shape's
    # program, exact, and nothing compiles on the engine's thread; then the rest is compiled and used
    eng = PagedEngine(params, CFG, max_requests=3, max_len=40, page_size=4, token_budget=12, decode_steps={1: 4})
    compile_one, go = eng.programs._compile_one, threading.Event()
    largest = eng.shapes[-1]
    eng.programs._compile_one = (lambda *call: compile_one(*call) if call[0] == largest
                                 else (go.wait(60), compile_one(*call)))
    eng.warmup(background=True)
    assert eng.programs.ready == {(largest, "step"), (largest, "scores")}  # (then serving: any plan fits)
    assert eng.programs.pending == eng.warmup_programs() - 2 > 0
    prompts = _prompts(13, (3, 11, 6))
    reqs = [dict(prompt=p, max_tokens=5, **s) for p, s in zip(prompts, SETTINGS)]
    with _compiles() as compiled:
        outs = eng.run(reqs)
    _check_alone(params, CFG, prompts, SETTINGS, outs, 5)
    assert compiled == []  # (the background thread waits)
    st = eng.stats
    assert st.calls == st.steps and st.padding_tokens == st.steps * largest[0] - st.prompt_tokens - st.decode_tokens
    go.set()
    assert eng.programs.join(timeout=300) and eng.programs.pending == 0 and eng.programs.failed is None
    padding = st.padding_tokens
    with _compiles() as compiled:
        again = eng.run(reqs + [dict(prompt=prompts[0], max_tokens=9, prompt_logprobs=True)])
    assert [o.token_ids for o in again[:3]] == [o.token_ids for o in outs] and compiled == []
    assert st.padding_tokens - padding < 5 * largest[0] and st.calls < st.steps  # small shapes, several steps


def test_stream_cancel_stop_and_errors(params):
    eng = PagedEngine(params, CFG, max_requests=2, max_len=32, page_size=4, token_budget=8)
    p = _prompts(9, (6,))[0]
    want = _alone(params, CFG, p, 7, SETTINGS[0])
    assert [t.id for t in eng.stream(p, max_tokens=7, temperature=0.0)] == want
    out = eng.run([dict(prompt=p, max_tokens=7, temperature=0.0, stop_token_ids=(want[2],))])[0]
    assert out.token_ids == want[:want.index(want[2]) + 1] and out.finish_reason == "stop"
    rid = eng.submit(p, max_tokens=20)
    eng.step()
    assert eng.cancel(rid) and not eng.cancel(rid) and not eng.has_work()
    assert eng.scheduler.stats.pages_in_use == 0
    with pytest.raises(ValueError, match="max_len"):
        eng.submit(p, max_tokens=40)
    with pytest.raises(ValueError, match="page_size"):
        PagedEngine(params, CFG, page_size=0)
    with pytest.raises(ValueError, match="num_pages"):
        PagedEngine(params, CFG, num_pages=1)


def test_runner_step_against_the_full_forward(params):
    # two steps by hand: a prompt chunk beside a whole prompt, then that prompt's decode beside the rest
    rng = np.random.default_rng(10)
    a_seq, b_seq = rng.integers(0, 97, size=20).tolist(), rng.integers(0, 97, size=7).tolist() + [50]
    pool = PagedCache.create_pool(CFG, 20, 4)
    pa, pb = (3, 7, 1, 9, 11), (5, 2)  # pages in any order
    plans = [Plan(work=(Work(0, 0, tuple(a_seq[:12]), pa[:3], False), Work(1, 0, tuple(b_seq[:7]), pb, True))),
             Plan(work=(Work(1, 7, (50,), pb, True), Work(0, 12, tuple(a_seq[12:]), pa, True)))]
    fa, fb = _log_softmax(params, CFG, a_seq), _log_softmax(params, CFG, b_seq)
    outs = []
    for plan in plans:
        shape = runner.shape_for(plan, runner.step_shapes(32, 4))
        arrays = runner.step_arrays(plan, shape, 4, 16, {0: a_seq, 1: b_seq})
        static = dict(config=CFG, backend=jaxgpt.backends.resolve(CFG), n_logprobs=3)
        pool, out = runner.ragged_step(params, pool, arrays, runner.idle_rows(shape[1]), np.zeros(4, np.int32),
                                       **static)
        out.update(runner.token_scores(params, out.pop("hidden"), arrays.targets, **static))
        outs.append(jax.device_get(out))
    np.testing.assert_allclose(outs[0]["prompt_lp"][:11], fa[np.arange(11), a_seq[1:12]], atol=1e-5)
    assert outs[0]["token"][1] == np.argmax(fb[6]) and outs[1]["token"][0] == np.argmax(fb[7])
    assert outs[1]["token"][1] == np.argmax(fa[19])
    np.testing.assert_allclose(outs[1]["prompt_lp"][1:8], fa[np.arange(12, 19), a_seq[13:20]], atol=1e-5)


def test_several_decode_steps_a_call_give_the_same_tokens(params):
    # up to 8 decode steps a call for one or two rows, 4 for up to four: a request that arrives meanwhile
    # waits for the call; a stop token inside a call ends its request there
    prompts = _prompts(11, (5, 14, 9))
    eng = PagedEngine(params, CFG, max_requests=4, max_len=64, page_size=4, token_budget=16,
                      decode_steps={1: 8, 2: 8, 4: 4})
    assert eng.warmup_programs(prompt_logprobs=False) == len(eng.shapes) + 3  # (the shapes of 1, 2 and 4 rows)
    eng.warmup(prompt_logprobs=False)  # (programs that other engines of this config compiled are reused)
    before = dict(engine_mod.TRACES)
    outs = eng.run([dict(prompt=p, max_tokens=19, logprobs=2, **s) for p, s in zip(prompts, SETTINGS)])
    _check_alone(params, CFG, prompts, SETTINGS, outs, 19)
    assert eng.stats.calls < eng.stats.steps and dict(engine_mod.TRACES) == before
    want = _alone(params, CFG, prompts[0], 19, SETTINGS[0])
    out = eng.run([dict(prompt=prompts[0], max_tokens=19, temperature=0.0, stop_token_ids=(want[5],))])[0]
    assert out.token_ids == want[:want.index(want[5]) + 1] and eng.scheduler.stats.pages_in_use == 0


def test_asynchronous_scheduling_changes_no_token(params):
    # a step planned before the last one's draws are read (fed on the device) gives the synchronous tokens,
    # stop tokens included (a request that stopped may have had one more step planned: it is dropped)
    prompts = _prompts(12, (4, 17, 8, 26, 2))
    greedy = _alone(params, CFG, prompts[0], 12, SETTINGS[0])
    reqs = [dict(prompt=p, max_tokens=12, logprobs=1, **s) for p, s in zip(prompts, SETTINGS)]
    reqs[0]["stop_token_ids"] = (greedy[3],)
    outs = {}
    for mode in (True, False):
        eng = PagedEngine(params, CFG, max_requests=3, max_len=64, page_size=4, num_pages=20, token_budget=12,
                          async_scheduling=mode)
        t = time.perf_counter()
        outs[mode] = eng.run(reqs)
        wall = time.perf_counter() - t
        assert eng.scheduler.stats.pages_in_use == 0 and eng._pending is None
        assert (eng.stats.fed_tokens > 0) == mode
        # the device's time in steps counts overlapping dispatches once: within the run's time, as is each
        # request's prefill (the steps its prompt ran in)
        assert 0 < eng.stats.step_seconds <= wall and all(0 < o.prefill_s <= wall for o in outs[mode])
    eng._read_until = 0.0  # two steps dispatched at 10 and 11, read at 12 and 13, then one alone: 2 + 1 + 1 s
    assert (eng._span(10.0, 12.0), eng._span(11.0, 13.0), eng._span(14.0, 15.0)) == (2.0, 1.0, 1.0)
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert outs[True][0].token_ids == greedy[:greedy.index(greedy[3]) + 1]
    _check_alone(params, CFG, prompts[1:], SETTINGS[1:], outs[True][1:], 12)


def test_a_recomputation_past_the_prompt_is_not_run_as_decode_steps(params):
    # a pool of 4 pages of 4 for two requests of up to 12 positions: the newest is preempted, and its
    # recomputation (prompt and drawn tokens, in chunks of 2: one starts past its prompt) must run as a
    # chunk even when nothing waits and several decode steps a call are allowed
    prompts = [[5, 9], [7, 3, 2]]
    for caching in (True, False):
        eng = PagedEngine(params, CFG, max_requests=4, max_len=12, page_size=4, num_pages=5, token_budget=16,
                          max_chunk=2, decode_steps={1: 4, 2: 4}, prefix_caching=caching)
        outs = eng.run([dict(prompt=p, max_tokens=12 - len(p), **s) for p, s in zip(prompts, SETTINGS)])
        assert eng.stats.preemptions > 0 and eng.scheduler.stats.pages_in_use == 0
        for p, s, o in zip(prompts, SETTINGS, outs):
            assert o.token_ids == _alone(params, CFG, p, 12 - len(p), s), (caching, s)


@pytest.mark.parametrize("quantize", ["int8", "w8a8"])
def test_quantized_weights_give_the_dense_engines_tokens(quantize):
    from tests.helpers import varied_params

    params = varied_params(CFG)
    reqs = [dict(prompt=p, max_tokens=8, logprobs=0, **s) for p, s in zip(_prompts(13, (5, 20, 9)), SETTINGS)]
    paged = PagedEngine(params, CFG, max_requests=3, max_len=64, page_size=8, token_budget=32, quantize=quantize)
    dense = Engine(params, CFG, slots=3, max_len=64, prefill_chunk=32, quantize=quantize)
    for a, b in zip(paged.run(reqs), dense.run(reqs)):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose([t.logprob for t in a.tokens], [t.logprob for t in b.tokens], atol=1e-4)
