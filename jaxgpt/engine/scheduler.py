"""The paged engine's scheduler: which tokens of which requests run next, as a plain-data `Plan`.

Host code only (no JAX): the engine calls `schedule()`, the runner runs the plan, the engine hands the
drawn tokens back through `update(plan, sampled)` and ends requests with `finish`.

Policy (vLLM's, first come first served):

- Running requests first, oldest first, decoding ones (one token each) before those still in a prompt
  chunk, so decode keeps its pace under a prompt: the token budget goes to them first.
- A request that needs a page the pool cannot give preempts the most recently admitted running request
  (recompute: its pages are freed, it goes back to the head of the queue with the tokens it generated, and
  is computed again when it returns, from its cached prefix on). It may have to preempt itself.
- Then waiting requests are admitted in order while rows, budget and pages allow; one that does not fit
  stops admission (nobody overtakes it). A step that preempted admits nobody: the pages it just freed are
  what its running requests lacked, and the victims would only be admitted to be preempted again.
- With prefix caching, an admitted request starts after the longest chain of cached full pages that
  matches its sequence; every full page computed is registered for later requests.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from typing import Optional, Sequence

from jaxgpt.engine.pages import PagePool
from jaxgpt.engine.plan import Plan, Work

# A drawn token not yet read back from the device (asynchronous scheduling): `update` may append it in a
# token's place, `fill` puts the token there later. No page holding one joins the prefix cache until then.
PENDING = -1


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """Counters, in tokens where they say so. `prefix_queries`: tokens of the requests admitted with prefix
    caching on (their whole sequence, as vLLM's prefix_cache_queries), `prefix_hits`: those found in the
    cache. `preemptions`: requests preempted so far. `peak_pages`: most pages referenced at once;
    `pages_in_use`: pages referenced now."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    peak_pages: int = 0
    pages_in_use: int = 0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclasses.dataclass(eq=False)
class _Request:
    """A request as the scheduler keeps it. `seq`: prompt and then the tokens drawn so far (what a
    preempted request is recomputed from); `num_computed`: tokens whose keys and values are in `pages`;
    `keys`: the prefix-cache keys of its first len(keys) pages (the parent of the next page to register)."""

    request_id: int
    seq: list
    prompt_len: int
    max_tokens: int
    cacheable: int
    salt: tuple
    pages: list = dataclasses.field(default_factory=list)
    keys: list = dataclasses.field(default_factory=list)
    num_computed: int = 0
    running: bool = False

    @property
    def num_generated(self) -> int:
        return len(self.seq) - self.prompt_len

    @property
    def remaining(self) -> int:
        """Tokens of its sequence not yet computed: 1 while decoding, more in a prompt or recomputation."""
        return len(self.seq) - self.num_computed

    @property
    def idle(self) -> bool:
        """Nothing left to feed: it drew its max_tokens (its last token is never fed; the engine finishes
        it), or, with max_tokens 0, its prompt is computed. Such a request is not scheduled."""
        return self.remaining == 0 or 0 < self.max_tokens <= self.num_generated


@dataclasses.dataclass
class _Step:
    """A plan being built: works by request id (insertion order is the plan's), what is left of the budget."""

    budget: int
    rows: int
    works: dict = dataclasses.field(default_factory=dict)
    preempted: list = dataclasses.field(default_factory=list)
    cached: dict = dataclasses.field(default_factory=dict)


def _positive(name: str, value, lo: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    return value


class Scheduler:
    """FCFS scheduling of requests over a `PagePool` under a token budget and a row limit per step.

    `token_budget`: most tokens a step feeds (decode tokens and prompt chunks together); `max_requests`:
    most requests (rows) a step; `max_chunk`: most tokens of one request a step (default: the budget);
    `max_len`: most tokens a request's prompt and generated tokens may add up to."""

    def __init__(self, *, num_pages: int, page_size: int, max_len: int, token_budget: int, max_requests: int,
                 prefix_caching: bool = True, max_chunk: Optional[int] = None):
        self.pool = PagePool(num_pages, page_size)
        self.page_size = page_size
        self.max_len = _positive("max_len", max_len)
        self.token_budget = _positive("token_budget", token_budget)
        self.max_requests = _positive("max_requests", max_requests)
        self.max_chunk = token_budget if max_chunk is None else _positive("max_chunk", max_chunk)
        self.prefix_caching = bool(prefix_caching)
        self._requests: dict = {}  # request id -> _Request, waiting or running
        self._waiting: collections.deque = collections.deque()
        self._running: list = []  # admission order: the last is the first to be preempted
        self._queries = self._hits = self._preemptions = 0

    # ---- requests in and out ----

    def add(self, request_id: int, prompt: Sequence[int], max_tokens: int, *, cacheable: int,
            salt: tuple = ()) -> None:
        """Queue a request. `cacheable`: how many leading prompt tokens may come from the prefix cache (the
        engine passes len(prompt) - 1, fewer when it needs the logprobs of prompt tokens). It applies until
        the request draws its first token; a request preempted after that has computed its whole prompt
        once, and its recomputation may take any cached page up to its last token.

        A request that could never fit (prompt + max_tokens over max_len, or more pages than the pool has)
        is a ValueError here rather than a request that waits forever."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already queued or running")
        try:
            seq = [operator.index(t) for t in prompt]
        except TypeError:
            raise ValueError(f"prompt must be a sequence of token ids (integers), got {prompt!r:.80}") from None
        if not seq:
            raise ValueError("prompt must hold at least one token")
        _positive("max_tokens", max_tokens, 0)
        _positive("cacheable", cacheable, 0)
        try:
            hash(salt)
        except TypeError:
            raise ValueError(f"salt must be hashable (a tuple), got {salt!r:.80}") from None
        if len(seq) + max_tokens > self.max_len:
            raise ValueError(f"prompt ({len(seq)} tokens) + max_tokens ({max_tokens}) exceeds max_len "
                             f"({self.max_len})")
        need = self._pages_for(max(len(seq), len(seq) + max_tokens - 1))  # the last token drawn is never fed
        if need > self.pool.num_pages - 1:
            raise ValueError(f"request {request_id!r} needs {need} pages; the pool has {self.pool.num_pages - 1}")
        req = _Request(request_id, seq, len(seq), max_tokens, cacheable, salt)
        self._requests[request_id] = req
        self._waiting.append(req)

    def finish(self, request_id: int) -> bool:
        """The request is done or cancelled, waiting or running: its pages are released (its cached full
        pages stay in the prefix cache, evictable). False for an unknown id. The engine finishes a request
        as soon as `update` gave it its last token (max_tokens, a stop token), before the next `schedule`:
        a request kept past that is not scheduled, but it holds its pages and can still be preempted."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req.running:
            self._running.remove(req)
            self._free(req)
        else:
            self._waiting.remove(req)
        return True

    def sequence(self, request_id: int) -> tuple:
        """A request's prompt and the tokens drawn so far, as the scheduler holds them."""
        return tuple(self._requests[request_id].seq)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(prefix_queries=self._queries, prefix_hits=self._hits, preemptions=self._preemptions,
                              peak_pages=self.pool.peak_used, pages_in_use=self.pool.num_used)

    # ---- one step ----

    def schedule(self) -> Plan:
        """The next step's plan: running requests (decoding ones first), then admissions (see the module
        docstring). Pages for every work are allocated here; `update` must follow once the step ran."""
        step = _Step(budget=self.token_budget, rows=self.max_requests)
        active = [r for r in self._running if not r.idle]
        decoding = [r for r in active if r.remaining == 1]
        chunking = [r for r in active if r.remaining > 1]
        for req in decoding + chunking:
            if step.budget == 0 or step.rows == 0:
                break
            if req.running:  # not preempted earlier in this step
                self._schedule_running(req, step)
        if not step.preempted:
            self._admit(step)
        return Plan(work=tuple(step.works.values()), preempted=tuple(step.preempted), cached=step.cached)

    def _schedule_running(self, req: _Request, step: _Step) -> None:
        """Give a running request its next chunk, preempting the newest running requests for pages."""
        n = min(req.remaining, self.max_chunk, step.budget)
        need = max(0, self._pages_for(req.num_computed + n) - len(req.pages))  # (extend may have given more)
        while need > self.pool.num_free:
            victim = self._running[-1]
            self._preempt(victim, step)
            if victim is req:
                return
        req.pages += self.pool.allocate(need)
        self._add_work(req, n, step)

    def _admit(self, step: _Step) -> None:
        """Admit waiting requests in order while rows, budget and pages allow."""
        ps = self.page_size
        while self._waiting and step.budget > 0 and step.rows > 0:
            req = self._waiting[0]
            hits = self._match(req)
            start = len(hits) * ps
            n = min(len(req.seq) - start, self.max_chunk, step.budget)
            need = self._pages_for(start + n) - len(hits)
            revived = sum(1 for p in hits if self.pool.refcount(p) == 0)  # cached free pages it takes back
            if need + revived > self.pool.num_free:
                break
            self._waiting.popleft()
            self.pool.share(hits)  # before allocating, so no hit is evicted to make room
            req.pages = hits + self.pool.allocate(need)
            req.keys = [self.pool.key_of(p) for p in hits]
            req.num_computed = start
            req.running = True
            self._running.append(req)
            if self.prefix_caching:
                self._queries += len(req.seq)
                self._hits += start
            if start:
                step.cached[req.request_id] = start
            self._add_work(req, n, step)

    def _match(self, req: _Request) -> list:
        """The cached pages an admitted request may start after: at most `cacheable` tokens before its first
        draw, and always at least one token left to compute (a draw needs its logits)."""
        if not self.prefix_caching:
            return []
        limit = len(req.seq) - 1
        if req.num_generated == 0:
            limit = min(limit, req.cacheable)
        return self.pool.match(req.seq, req.salt, limit)

    def _add_work(self, req: _Request, n: int, step: _Step) -> None:
        start = req.num_computed
        step.works[req.request_id] = Work(request_id=req.request_id, start=start,
                                          tokens=tuple(req.seq[start:start + n]), pages=tuple(req.pages),
                                          sample=start + n == len(req.seq))
        step.budget -= n
        step.rows -= 1

    def _preempt(self, req: _Request, step: _Step) -> None:
        """Recompute policy: free its pages, back to the head of the queue; undo its work in this step."""
        work = step.works.pop(req.request_id, None)
        if work is not None:
            step.budget += len(work.tokens)
            step.rows += 1
        self._running.remove(req)
        self._free(req)
        req.num_computed = 0
        req.running = False
        self._waiting.appendleft(req)
        step.preempted.append(req.request_id)
        self._preemptions += 1

    def _free(self, req: _Request) -> None:
        self.pool.release(reversed(req.pages))  # last page first: the tail is evicted before the head
        req.pages, req.keys = [], []

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def pages(self, request_id: int) -> tuple:
        """A running request's block table (its pages in order), as the scheduler holds it."""
        return tuple(self._requests[request_id].pages)

    def extend(self, wants: dict) -> bool:
        """Give running requests pages for their first `wants[request_id]` positions now, all or none,
        without preempting anyone (cached free pages may be evicted); False, having taken nothing, where
        the pool cannot give them all. (Several decode steps in one call write positions that no plan has
        scheduled yet.)"""
        needs = {rid: max(0, self._pages_for(min(n, self.max_len)) - len(self._requests[rid].pages))
                 for rid, n in wants.items()}
        if sum(needs.values()) > self.pool.num_free:
            return False
        for rid, need in needs.items():
            if need:
                self._requests[rid].pages += self.pool.allocate(need)
        return True

    # ---- after the step ----

    def update(self, plan: Plan, sampled: dict) -> None:
        """The runner ran `plan` (the last `schedule()`'s): each work's tokens are computed, full pages join
        the prefix cache, each token drawn (`sampled`: request id -> token) joins its sequence. A work whose
        request was finished since is skipped. A request that already drew max_tokens draws no more: the
        engine finishes it (a token for it here is a ValueError, as is a missing one for any other)."""
        sampling = {w.request_id for w in plan.work if w.sample}
        extra = set(sampled) - sampling
        if extra:
            raise ValueError(f"tokens for requests the plan did not sample: {sorted(extra, key=repr)!r:.200}")
        live = [(w, self._requests[w.request_id]) for w in plan.work
                if w.request_id in self._requests and self._requests[w.request_id].running]
        for work, req in live:  # check everything before changing anything
            if work.start != req.num_computed or work.end > len(req.seq):
                raise ValueError(f"the plan's work for request {work.request_id!r} (tokens {work.start} .. "
                                 f"{work.end - 1}) is not its next step: update each plan once, in order")
            if work.sample:
                self._check_token(req, sampled.get(work.request_id))
        for work, req in live:
            req.num_computed = work.end
            if self.prefix_caching:
                self._register(req)
            if work.sample and work.request_id in sampled:
                req.seq.append(operator.index(sampled[work.request_id]))

    def _check_token(self, req: _Request, token) -> None:
        done = req.num_generated >= req.max_tokens
        if token is None and not done:
            raise ValueError(f"no token drawn for request {req.request_id!r}, whose work sampled")
        if token is not None and done:
            raise ValueError(f"request {req.request_id!r} already has its {req.max_tokens} tokens: finish it")
        if token is not None:
            try:
                operator.index(token)
            except TypeError:
                raise ValueError(f"a drawn token must be an integer, got {token!r}") from None

    def fill(self, request_id: int, index: int, token: int) -> bool:
        """Put a drawn token in place of the PENDING one at `index` of a request's sequence (then register
        the pages it completes); False for a request no longer known (finished, cancelled)."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        if not 0 <= index < len(req.seq) or req.seq[index] != PENDING:
            raise ValueError(f"request {request_id!r} holds no pending token at {index}")
        req.seq[index] = operator.index(token)
        if req.running and self.prefix_caching:
            self._register(req)
        return True

    def _register(self, req: _Request) -> None:
        """Register the request's newly full, computed pages in the prefix cache (prompt or generated); a
        page holding a PENDING token waits for `fill`."""
        ps = self.page_size
        while (len(req.keys) + 1) * ps <= req.num_computed:
            i = len(req.keys)
            if PENDING in req.seq[i * ps:(i + 1) * ps]:
                return
            parent = req.keys[-1] if req.keys else None
            req.keys.append(self.pool.cache_page(req.pages[i], parent, req.seq[i * ps:(i + 1) * ps], req.salt))
