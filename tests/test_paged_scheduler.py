"""The paged engine's host side: the page pool, the prefix cache and the scheduler (no JAX, no device).

A fake engine loop drives the scheduler to completion (schedule -> a fake runner that writes each
position's "keys and values" into its page -> deterministic fake draws -> update -> finish at max_tokens)
and checks every step: budgets, the tokens fed, the block tables, page ownership and, through the fake
cache, that every position a work attends to holds what it would hold had the request run alone (the
fake value of position j is the sequence's tokens 0 .. j, as real keys and values depend on all of them).
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxgpt.engine import pages as pages_mod
from jaxgpt.engine.pages import BlockKey, PagePool
from jaxgpt.engine.plan import Plan
from jaxgpt.engine.scheduler import Scheduler, SchedulerStats


def draw_token(request_id: int, index: int) -> int:
    """The fake model's draw: a function of the request and the token's index only, so a request's output
    is the same whatever it shared a step with and however often it was preempted."""
    return (request_id * 31 + index * 17 + 3) % 11


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class FakeEngine:
    """Runs a scheduler's plans against a fake KV cache and checks each step (see the module docstring)."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.ps = sched.page_size
        self.kv: dict = {}  # (page, slot) -> the tokens 0 .. j of the sequence that wrote position j
        self.specs: dict = {}  # request id -> (prompt, max_tokens, cacheable)
        self.ref: dict = {}  # request id -> its sequence as it would be uninterrupted
        self.computed: dict = {}  # request id -> tokens computed, for requests running (as the plans say)
        self.finished: dict = {}  # request id -> final sequence
        self.added: dict = {}  # request id -> (prompt, max_tokens), kept after it finished
        self.steps = 0

    def add(self, rid: int, prompt: list, max_tokens: int, cacheable: int, salt: tuple = ()) -> None:
        self.sched.add(rid, prompt, max_tokens, cacheable=cacheable, salt=salt)
        self.specs[rid] = (list(prompt), max_tokens, cacheable)
        self.ref[rid] = list(prompt)
        self.added[rid] = (list(prompt), max_tokens)

    def cancel(self, rid: int) -> None:
        assert self.sched.finish(rid)
        del self.specs[rid], self.ref[rid]
        self.computed.pop(rid, None)

    def step(self) -> Plan:
        plan = self.sched.schedule()
        self.check_plan(plan)
        self.check_pages(plan)
        sampled = {}
        for w in plan.work:
            seq = self.ref[w.request_id]
            for j in range(w.start, w.end):
                self.kv[w.pages[j // self.ps], j % self.ps] = tuple(seq[:j + 1])
            self.computed[w.request_id] = w.end
            prompt, max_tokens, _ = self.specs[w.request_id]
            if w.sample and len(seq) - len(prompt) < max_tokens:
                sampled[w.request_id] = draw_token(w.request_id, len(seq) - len(prompt))
        self.sched.update(plan, sampled)
        for rid, tok in sampled.items():
            self.ref[rid].append(tok)
        for w in plan.work:
            rid = w.request_id
            prompt, max_tokens, _ = self.specs[rid]
            if len(self.ref[rid]) - len(prompt) == max_tokens and (max_tokens or w.sample):
                assert self.sched.sequence(rid) == tuple(self.ref[rid])
                assert self.sched.finish(rid)
                self.finished[rid] = self.ref.pop(rid)
                del self.specs[rid], self.computed[rid]
        self.steps += 1
        return plan

    def check_plan(self, plan: Plan) -> None:
        s, ps = self.sched, self.ps
        ids = [w.request_id for w in plan.work]
        assert plan.num_tokens <= s.token_budget and plan.num_requests <= s.max_requests
        assert len(set(ids)) == len(ids) and not set(ids) & set(plan.preempted)
        assert plan or plan.preempted or not s.has_work(), "a step with work to do scheduled nothing"
        for rid in plan.preempted:
            self.computed.pop(rid, None)
        for w in plan.work:
            seq = self.ref[w.request_id]
            assert 1 <= len(w.tokens) <= s.max_chunk
            assert w.tokens == tuple(seq[w.start:w.end])
            assert w.sample == (w.end == len(seq))
            if w.request_id in self.computed:  # running: it goes on where it stopped
                assert w.start == self.computed[w.request_id] and w.request_id not in plan.cached
            else:  # admitted by this step: from position 0 or after its cached prefix
                prompt, _, cacheable = self.specs[w.request_id]
                hit = plan.cached.get(w.request_id, 0)
                assert w.start == hit and hit % ps == 0 and hit <= len(seq) - 1
                assert hit == 0 or s.prefix_caching
                if len(seq) == len(prompt):
                    assert hit <= cacheable
            assert 0 not in w.pages and len(w.pages) == pages_for(w.end, ps)
            for j in range(w.start):  # what the step attends to was written for this very prefix
                assert self.kv.get((w.pages[j // ps], j % ps)) == tuple(seq[:j + 1]), (w, j)

    def check_pages(self, plan: Plan) -> None:
        s, pool, ps = self.sched, self.sched.pool, self.ps
        owners = collections.Counter(p for r in s._running for p in r.pages)
        assert 0 not in owners
        for p in range(1, pool.num_pages):
            assert pool.refcount(p) == owners.get(p, 0)
        assert pool.num_free + pool.num_used == pool.num_pages - 1 and pool.num_used == len(owners)
        for r in s._running:
            for i, p in enumerate(r.pages):
                if owners[p] > 1:  # shared: a cached full page before where anyone computes
                    assert pool.key_of(p) is not None and (i + 1) * ps <= r.num_computed
        for w in plan.work:
            for j in range(w.start, w.end):
                assert owners[w.pages[j // ps]] == 1, "a step writes into a shared page"

    def run(self, arrivals: dict = None, cancels: dict = None, max_steps: int = 2000) -> None:
        """Steps until every request finished; arrivals/cancels: step -> [(rid, prompt, max_tokens, cacheable,
        salt)] / [rid] (a cancel of a request already finished is skipped)."""
        arrivals, cancels = dict(arrivals or {}), dict(cancels or {})
        while arrivals or self.sched.has_work():
            for spec in arrivals.pop(self.steps, ()):
                self.add(*spec)
            for rid in cancels.get(self.steps, ()):
                if rid in self.specs:
                    self.cancel(rid)
            self.step()
            assert self.steps < max_steps, "the requests never finished"
        self.check_empty()

    def check_empty(self) -> None:
        pool = self.sched.pool
        assert not self.sched.has_work() and self.sched.num_waiting == self.sched.num_running == 0
        assert pool.num_used == 0 and pool.num_free == pool.num_pages - 1
        assert all(pool.refcount(p) == 0 for p in range(1, pool.num_pages))
        assert self.sched.stats.pages_in_use == 0
        for rid, seq in self.finished.items():  # what it would have drawn alone, never interrupted
            prompt, max_tokens = self.added[rid]
            assert seq == prompt + [draw_token(rid, i) for i in range(max_tokens)]


# ---- the property test ----


@st.composite
def scenarios(draw):
    ps = draw(st.integers(1, 4))
    bases = [draw(st.lists(st.integers(0, 3), max_size=12)) for _ in range(2)]
    reqs = []
    for rid in range(draw(st.integers(1, 8))):
        base = bases[draw(st.integers(0, 1))]
        cut = draw(st.sampled_from([len(base), draw(st.integers(0, len(base)))]))
        prompt = base[:cut] + draw(st.lists(st.integers(0, 3), min_size=0 if cut else 1, max_size=6))
        spec = (rid, prompt, draw(st.integers(0, 6)), draw(st.integers(0, len(prompt))),
                draw(st.sampled_from([(), (), (1,)])))
        reqs.append((draw(st.integers(0, 6)), spec))
    need = max(pages_for(max(len(p), len(p) + m - 1), ps) for _, (_, p, m, _, _) in reqs)
    sizes = dict(num_pages=need + 1 + draw(st.integers(0, 4)), page_size=ps,
                 max_len=max(len(p) + m for _, (_, p, m, _, _) in reqs), token_budget=draw(st.integers(1, 12)),
                 max_requests=draw(st.integers(1, 4)), max_chunk=draw(st.one_of(st.none(), st.integers(1, 8))),
                 prefix_caching=draw(st.booleans()))
    cancels = draw(st.lists(st.tuples(st.integers(0, 12), st.integers(0, len(reqs) - 1)), max_size=2))
    return sizes, reqs, cancels


def run_scenario(sizes: dict, reqs: list, cancels: list) -> FakeEngine:
    eng = FakeEngine(Scheduler(**sizes))
    arrivals = collections.defaultdict(list)
    for at, spec in reqs:
        arrivals[at].append(spec)
    by_step = collections.defaultdict(list)
    for at, rid in cancels:
        by_step[at].append(rid)
    eng.run(arrivals, by_step)
    return eng


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_request_finishes_with_its_own_tokens(scenario):
    eng = run_scenario(*scenario)
    cancelled = {rid for _, rid in scenario[2]}
    assert set(eng.finished) | cancelled >= {spec[0] for _, spec in scenario[1]}


def test_a_small_pool_preempts_and_recomputes():
    """Three requests of 4 pages each in a pool of 4: they cannot all run; each finishes with the tokens
    it would have drawn alone, and a preempted one comes back from position 0 (no prefix caching)."""
    sizes = dict(num_pages=5, page_size=2, max_len=8, token_budget=16, max_requests=3, prefix_caching=False)
    reqs = [(0, (rid, [rid, 1, 2, 3], 4, 3, ())) for rid in range(3)]
    eng = run_scenario(sizes, reqs, [])
    assert sorted(eng.finished) == [0, 1, 2]
    assert eng.sched.stats.preemptions > 0 and eng.sched.stats.peak_pages == 4


def test_a_preempted_request_restarts_after_its_cached_prefix():
    """With prefix caching, a request preempted after drawing comes back after its cached pages: here
    `cacheable=0`, which only binds before a request's first draw (its prompt has been computed since)."""
    sched = Scheduler(num_pages=6, page_size=2, max_len=9, token_budget=16, max_requests=2)
    eng = FakeEngine(sched)
    eng.add(0, [1, 2, 3, 4], 5, cacheable=0)
    eng.add(1, [5, 6], 5, cacheable=0)
    preempted, back = [], {}
    while sched.has_work():
        plan = eng.step()
        preempted += plan.preempted
        back.update({w.request_id: w.start for w in plan.work if w.request_id in preempted and w.start == 0 or
                     w.request_id in plan.cached})
    eng.check_empty()
    assert preempted == [1] and back == {1: 2} and sched.stats.prefix_hits == 2


# ---- order and budget ----


def test_decoding_requests_come_first_in_the_budget():
    sched = Scheduler(num_pages=16, page_size=4, max_len=32, token_budget=5, max_requests=4, max_chunk=4)
    sched.add(0, list(range(12)), 4, cacheable=11)
    sched.add(1, [7], 4, cacheable=0)
    plan = sched.schedule()
    assert [(w.request_id, len(w.tokens), w.sample) for w in plan.work] == [(0, 4, False), (1, 1, True)]
    sched.update(plan, {1: 3})
    plan = sched.schedule()  # the younger decoding request goes first; the prompt gets the rest
    assert [(w.request_id, w.start, len(w.tokens)) for w in plan.work] == [(1, 1, 1), (0, 4, 4)]
    sched.update(plan, {1: 3})
    sched.token_budget = 1
    plan = sched.schedule()
    assert [w.request_id for w in plan.work] == [1]


def test_admission_is_first_come_first_served():
    """A waiting request that does not fit stops admission: a smaller one behind it waits too."""
    sched = Scheduler(num_pages=5, page_size=2, max_len=8, token_budget=32, max_requests=4)
    sched.add(0, [1] * 5, 1, cacheable=0)  # 3 pages
    sched.add(1, [2] * 4, 1, cacheable=0)  # 2 pages: does not fit beside it
    sched.add(2, [3], 1, cacheable=0)  # 1 page: would fit, but may not overtake
    plan = sched.schedule()
    assert [w.request_id for w in plan.work] == [0] and sched.num_waiting == 2
    assert sched.finish(0) and not sched.finish(0)
    assert [w.request_id for w in sched.schedule().work] == [1, 2]


def test_a_preempted_request_waits_at_the_head_of_the_queue():
    """The newest running request is preempted for the oldest's page, and it comes back before anyone
    who was waiting already (who may not overtake it, though it fits and the victim does not)."""
    sched = Scheduler(num_pages=5, page_size=2, max_len=8, token_budget=32, max_requests=2)
    sched.add(0, [1, 2], 5, cacheable=0)
    sched.add(1, [3, 4], 6, cacheable=0)
    sched.add(2, [5, 6], 1, cacheable=0)
    plans = []
    for _ in range(5):
        plans.append(sched.schedule())
        sched.update(plans[-1], {w.request_id: 9 for w in plans[-1].work if w.sample})
    assert [[w.request_id for w in p.work] for p in plans] == [[0, 1], [0, 1], [0, 1], [0], [0]]
    assert [p.preempted for p in plans] == [(), (), (), (1,), ()]
    assert [r.request_id for r in sched._waiting] == [1, 2] and sched.stats.preemptions == 1


def test_rows_and_chunks():
    sched = Scheduler(num_pages=32, page_size=4, max_len=64, token_budget=10, max_requests=2, max_chunk=3)
    for rid in range(3):
        sched.add(rid, list(range(8)), 2, cacheable=0)
    plan = sched.schedule()
    assert [(w.request_id, w.start, len(w.tokens)) for w in plan.work] == [(0, 0, 3), (1, 0, 3)]
    assert sched.num_running == 2 and sched.num_waiting == 1


# ---- the prefix cache through the scheduler ----


def _run_prompt(sched: Scheduler, rid: int, prompt: list, **kw) -> None:
    sched.add(rid, prompt, 4, cacheable=kw.pop("cacheable", len(prompt) - 1), **kw)
    plan = sched.schedule()
    assert [w.end for w in plan.work] == [len(prompt)]
    sched.update(plan, {rid: 0})


PREFIX = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]  # 2.5 pages of 4


def test_a_shared_prefix_hits_its_full_pages():
    sched = Scheduler(num_pages=16, page_size=4, max_len=32, token_budget=64, max_requests=4)
    _run_prompt(sched, 0, PREFIX + [50, 51])
    sched.add(1, PREFIX + [60, 61, 62], 4, cacheable=12)
    plan = sched.schedule()
    assert plan.cached == {1: 8}
    a, b = (w for w in plan.work)
    assert (b.request_id, b.start, b.tokens) == (1, 8, (1, 0, 60, 61, 62)) and b.pages[:2] == a.pages[:2]
    assert b.pages[2] != a.pages[2] and sched.pool.refcount(a.pages[0]) == 2
    assert sched.stats == SchedulerStats(prefix_queries=12 + 13, prefix_hits=8, preemptions=0,
                                         peak_pages=6, pages_in_use=6)


def test_requests_admitted_together_do_not_hit_each_other():
    """A page is found only once computed: the second of two requests in one step computes its own."""
    sched = Scheduler(num_pages=16, page_size=4, max_len=32, token_budget=64, max_requests=4)
    sched.add(0, PREFIX + [50], 4, cacheable=10)
    sched.add(1, PREFIX + [60], 4, cacheable=10)
    plan = sched.schedule()
    assert plan.cached == {} and [w.start for w in plan.work] == [0, 0]


@pytest.mark.parametrize("cacheable,hit", [(12, 8), (8, 8), (7, 4), (4, 4), (3, 0), (0, 0)])
def test_cacheable_caps_the_hit(cacheable, hit):
    sched = Scheduler(num_pages=16, page_size=4, max_len=32, token_budget=64, max_requests=4)
    _run_prompt(sched, 0, PREFIX + [50, 51])
    sched.add(1, PREFIX + [60, 61, 62], 4, cacheable=cacheable)
    plan = sched.schedule()
    assert plan.cached.get(1, 0) == hit and plan.work[-1].start == hit


def test_the_last_token_is_always_computed():
    """A prompt that is all cached pages still computes its last token (its draw needs the logits)."""
    sched = Scheduler(num_pages=16, page_size=4, max_len=32, token_budget=64, max_requests=4)
    _run_prompt(sched, 0, PREFIX[:8] + [1])
    sched.add(1, PREFIX[:8], 4, cacheable=8)
    assert sched.schedule().cached == {1: 4}


def test_a_different_salt_or_caching_off_gives_no_hit():
    for salt, caching in (((2,), True), ((1,), False)):
        sched = Scheduler(num_pages=16, page_size=4, max_len=32, token_budget=64, max_requests=4,
                          prefix_caching=caching)
        _run_prompt(sched, 0, PREFIX + [50, 51], salt=(1,))
        sched.add(1, PREFIX + [60], 4, cacheable=10, salt=salt)
        plan = sched.schedule()
        assert plan.cached == {} and plan.work[-1].start == 0
        assert sched.stats.prefix_hits == 0 and sched.pool.num_cached == (3 if caching else 0)


def test_generated_tokens_are_cached_too():
    sched = Scheduler(num_pages=16, page_size=4, max_len=32, token_budget=64, max_requests=4)
    sched.add(0, [1, 2, 3], 6, cacheable=2)
    for _ in range(6):
        plan = sched.schedule()
        sched.update(plan, {0: 40 + len(sched.sequence(0)) - 3})
    seq = list(sched.sequence(0))
    assert len(seq) == 9 and sched.finish(0)
    assert sched.pool.num_cached == 2  # tokens 0 .. 7 computed (the last draw is never fed): two full pages
    sched.add(1, seq, 4, cacheable=len(seq) - 1)
    assert sched.schedule().cached == {1: 8}


def test_a_pending_draw_keeps_its_page_out_of_the_cache_until_filled():
    # asynchronous scheduling: a draw not read back yet is PENDING in the sequence; the next step feeds it
    # (its position counts as computed), but no page holding it is cached until `fill` puts the token there
    from jaxgpt.engine.scheduler import PENDING

    sched = Scheduler(num_pages=16, page_size=4, max_len=32, token_budget=64, max_requests=4)
    sched.add(0, [1, 2, 3], 6, cacheable=2)
    sched.update(sched.schedule(), {0: PENDING})       # the prompt's step; its draw still on the device
    plan = sched.schedule()
    assert [w.tokens for w in plan.work] == [(PENDING,)]  # the next step feeds it
    sched.update(plan, {0: PENDING})
    assert sched.pool.num_cached == 0                    # page 0 holds positions 0 .. 3: 1, 2, 3, PENDING
    assert sched.fill(0, 3, 7) and sched.pool.num_cached == 1 and sched.sequence(0)[:4] == (1, 2, 3, 7)
    with pytest.raises(ValueError, match="no pending token"):
        sched.fill(0, 3, 8)
    assert sched.fill(0, 4, 9) and sched.finish(0) and not sched.fill(0, 4, 9)


def test_extend_gives_all_or_none_and_schedule_survives_pages_given_ahead():
    sched = Scheduler(num_pages=5, page_size=4, max_len=16, token_budget=16, max_requests=4)
    sched.add(0, [1, 2], 6, cacheable=1)
    sched.add(1, [3, 4, 5], 6, cacheable=2)
    sched.update(sched.schedule(), {0: 7, 1: 8})
    assert sched.pool.num_free == 2
    assert not sched.extend({0: 12, 1: 12}) and sched.pool.num_free == 2  # 4 pages asked for: none given
    assert sched.extend({0: 8}) and sched.pool.num_free == 1 and len(sched.pages(0)) == 2
    plan = sched.schedule()  # request 0 holds a page past what its next token needs: nothing to allocate
    assert [len(w.tokens) for w in plan.work] == [1, 1] and sched.pool.num_free == 1


def test_finished_pages_stay_cached_until_evicted():
    sched = Scheduler(num_pages=4, page_size=4, max_len=16, token_budget=64, max_requests=4)
    _run_prompt(sched, 0, PREFIX[:9])
    assert sched.finish(0) and sched.pool.num_free == 3 and sched.pool.num_cached == 2
    _run_prompt(sched, 1, [0] * 9)  # needs every page: the cached ones are evicted
    assert sched.pool.num_cached == 2 and sched.pool.evictions == 2
    assert sched.finish(1)
    sched.add(2, PREFIX[:9], 4, cacheable=8)
    assert sched.schedule().cached == {}


# ---- the pool ----


def test_lru_eviction_order():
    pool = PagePool(5, 2)
    assert pool.allocate(4) == [1, 2, 3, 4] and pool.allocate(1) is None and pool.peak_used == 4
    keys = {p: pool.cache_page(p, None, (p, p)) for p in (1, 2, 3)}
    pool.release([3, 1, 2, 4])  # 4 holds no block: plain free
    assert pool.num_free == 4 and pool.num_used == 0
    assert pool.allocate(1) == [4]  # plain pages go first
    assert pool.allocate(1) == [3] and pool.match([3, 3]) == []  # then the least recently released
    assert pool.lookup([1, 1]) == [1] and pool.refcount(1) == 1 and pool.num_free == 1
    pool.release([1])  # 1 is now the most recently released
    assert pool.allocate(1) == [2] and pool.allocate(1) == [1] and pool.evictions == 3
    assert pool.num_cached == 0 and pool.key_of(1) is None and keys[1] == BlockKey(None, (1, 1))


def test_an_equal_block_keeps_its_first_page():
    pool = PagePool(4, 2)
    a, b = pool.allocate(2)
    ka = pool.cache_page(a, None, (1, 2))
    assert pool.cache_page(b, None, [1, 2]) is ka and pool.key_of(b) is None
    pool.release([a, b])
    assert pool.match([1, 2]) == [a] and pool.num_cached == 1


def _constant_hash(monkeypatch):
    monkeypatch.setattr(pages_mod, "block_hash", lambda parent, tokens, salt=(): 0)


def test_a_hash_collision_never_returns_other_tokens(monkeypatch):
    """Every block hashes alike: blocks are still told apart by their tokens, salt and whole parent chain
    (a block after another first page is not the same block even with the same tokens)."""
    _constant_hash(monkeypatch)
    pool = PagePool(8, 2)
    a1, a2, b1, b2 = pool.allocate(4)
    ka = pool.cache_page(a2, pool.cache_page(a1, None, (1, 2)), (3, 4))
    kb = pool.cache_page(b2, pool.cache_page(b1, None, (5, 6)), (7, 8))
    assert ka.hash == kb.hash and ka != kb
    assert pool.match([1, 2, 3, 4]) == [a1, a2] and pool.match([5, 6, 7, 8]) == [b1, b2]
    assert pool.match([5, 6, 3, 4]) == [b1]  # a2's tokens, but computed after (1, 2)
    assert pool.match([9, 9, 3, 4]) == [] and pool.match([1, 2], salt=(1,)) == []
    c = pool.allocate(1)[0]
    pool.cache_page(c, pool.key_of(b1), (3, 4))
    assert pool.match([5, 6, 3, 4]) == [b1, c] and pool.match([1, 2, 3, 4]) == [a1, a2]


def test_the_scheduler_is_exact_under_colliding_hashes(monkeypatch):
    _constant_hash(monkeypatch)
    sizes = dict(num_pages=7, page_size=2, max_len=12, token_budget=6, max_requests=3, max_chunk=4)
    reqs = [(at, (rid, [rid % 2, 1, rid % 3, 0, 2, rid], 4, 5, ())) for at, rid in
            ((0, 0), (0, 1), (2, 2), (3, 3), (5, 4), (9, 5))]
    eng = run_scenario(sizes, reqs, [])
    assert len(eng.finished) == 6 and eng.sched.stats.prefix_hits > 0


def test_long_chains_compare_without_recursion():
    a = b = None
    for i in range(5000):
        a, b = BlockKey(a, (i,)), BlockKey(b, (i,))
    assert a == b and hash(a) == hash(b) and a != BlockKey(a.parent, (-1,))


# ---- bad arguments ----


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(1, 4)
    with pytest.raises(ValueError, match="page_size"):
        PagePool(4, 0)
    pool = PagePool(4, 2)
    with pytest.raises(ValueError, match="null page"):
        pool.release([0])
    with pytest.raises(ValueError, match="reference"):
        pool.release([1])
    with pytest.raises(ValueError, match="allocate it"):
        pool.share([1])
    p = pool.allocate(1)[0]
    with pytest.raises(ValueError, match="full page"):
        pool.cache_page(p, None, (1,))
    sched = Scheduler(num_pages=4, page_size=2, max_len=16, token_budget=8, max_requests=2)
    with pytest.raises(ValueError, match="needs 4 pages; the pool has 3"):
        sched.add(0, [1] * 6, 2, cacheable=0)
    sched.add(0, [1] * 6, 1, cacheable=0)  # 6 tokens fed: 3 pages
    with pytest.raises(ValueError, match="already queued"):
        sched.add(0, [1], 1, cacheable=0)
    with pytest.raises(ValueError, match="max_len"):
        sched.add(1, [1] * 10, 7, cacheable=0)
    for bad in (dict(prompt=[]), dict(prompt=[1.5]), dict(max_tokens=-1), dict(cacheable=-1), dict(salt=[1])):
        kw = dict(prompt=[1], max_tokens=1, cacheable=0) | bad
        with pytest.raises(ValueError):
            sched.add(2, kw.pop("prompt"), kw.pop("max_tokens"), **kw)
    with pytest.raises(ValueError, match="token_budget"):
        Scheduler(num_pages=4, page_size=2, max_len=16, token_budget=0, max_requests=2)
    plan = sched.schedule()
    with pytest.raises(ValueError, match="no token drawn"):
        sched.update(plan, {})
    with pytest.raises(ValueError, match="did not sample"):
        sched.update(plan, {0: 1, 5: 1})
    sched.update(plan, {0: 1})
    with pytest.raises(ValueError, match="not its next step"):
        sched.update(plan, {0: 1})


def test_the_host_modules_import_no_jax():
    """pages.py, plan.py and scheduler.py stay host code: no JAX or NumPy import anywhere in them."""
    import ast
    import pathlib
    root = pathlib.Path(pages_mod.__file__).parent
    for name in ("pages.py", "plan.py", "scheduler.py"):
        tree = ast.parse((root / name).read_text())
        mods = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        mods += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in mods if m.split(".")[0] in ("jax", "jaxlib", "numpy", "flax")], name
