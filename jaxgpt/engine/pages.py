"""The paged engine's page pool and its prefix cache: host data only (no JAX, nothing on a device).

The KV cache on the device is `num_pages` pages of `page_size` positions; this module decides which page
holds what. Page 0 is the null page: never handed out, so the runner can point padding rows at it.

Each page has a reference count: the requests whose block tables hold it. A page nobody holds is free,
and one of two kinds:

- plain: nothing worth keeping; handed out first.
- cached: a full page whose keys and values were computed for a known block of tokens. It stays in the
  prefix cache, in an LRU queue, until a request finds it by `lookup` (it is taken out of the queue again)
  or `allocate` runs out of plain pages and evicts the least recently released one.

Prefix cache. A block is a full page of tokens; its keys and values depend on every token before it, so a
block is named by its tokens, a salt (what else changes them: a model or adapter id) and its parent, the
block before it (`BlockKey`). The dict finds candidates by `block_hash`, Python's hash of the tuple (parent's
hash, tokens, salt), and then compares keys exactly, parents included all the way up the chain: a hash
collision, even at every block (tests/test_paged_scheduler.py makes `block_hash` a constant), can only cost
a miss, never return a page computed for other tokens or another prefix.
"""

from __future__ import annotations

import collections
import operator
from typing import Iterable, Optional, Sequence


def block_hash(parent_hash: Optional[int], tokens: tuple, salt: tuple = ()) -> int:
    """The hash a block is filed under: its parent's hash (None for a sequence's first page), its tokens
    and its salt. Only a bucket: `BlockKey` equality decides a match."""
    return hash((parent_hash, tokens, salt))


class BlockKey:
    """The exact name of a cached block: its tokens, its salt and its parent block (None for the first
    page of a sequence). Equal keys mean equal keys and values in the page, whichever page holds them.

    The hash is computed once (a chain's hash is a chain of `block_hash`es, so a long prefix costs one
    tuple hash per page, not its length). Equality walks both chains up to a common ancestor: keys built
    from the cache's own parent objects (`lookup`, `cache_page`) meet at the first step."""

    __slots__ = ("parent", "tokens", "salt", "hash")

    def __init__(self, parent: Optional[BlockKey], tokens: tuple, salt: tuple = ()):
        self.parent = parent
        self.tokens = tokens
        self.salt = salt
        self.hash = block_hash(None if parent is None else parent.hash, tokens, salt)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        if not isinstance(other, BlockKey):
            return NotImplemented
        a, b = self, other
        while a is not b:  # iterative: a chain can be thousands of pages long
            if a is None or b is None or a.hash != b.hash or a.tokens != b.tokens or a.salt != b.salt:
                return False
            a, b = a.parent, b.parent
        return True

    def __repr__(self) -> str:
        depth, k = 0, self.parent
        while k is not None:
            depth, k = depth + 1, k.parent
        return f"BlockKey(depth={depth}, tokens={self.tokens!r}, salt={self.salt!r})"


class PagePool:
    """Pages 1 .. num_pages - 1 with reference counts, and the prefix cache over them.

    `allocate(n)` returns None when fewer than n pages are free (and takes none): the scheduler treats
    that as "preempt someone and try again"; `num_free` answers "can I get n pages?" beforehand.
    `num_free` counts every page nobody references, cached ones included (they are evicted on demand)."""

    def __init__(self, num_pages: int, page_size: int):
        for name, value, lo in (("num_pages", num_pages, 2), ("page_size", page_size, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refs = [0] * num_pages
        self._free: collections.deque = collections.deque(range(1, num_pages))  # plain free pages
        self._evictable: collections.OrderedDict = collections.OrderedDict()  # cached, unreferenced; LRU first
        self._cached: dict = {}  # BlockKey -> page
        self._key: list = [None] * num_pages  # page -> its BlockKey, or None
        self.num_used = 0  # pages with a reference
        self.peak_used = 0
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out now: plain free ones and cached ones nobody references."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages holding a block of the prefix cache, referenced or not."""
        return len(self._cached)

    def refcount(self, page: int) -> int:
        return self._refs[self._check(page)]

    def key_of(self, page: int) -> Optional[BlockKey]:
        """The block a page holds in the prefix cache, or None: the parent to pass when registering the
        page after it (`cache_page`)."""
        return self._key[self._check(page)]

    def _check(self, page) -> int:
        try:
            page = operator.index(page)
        except TypeError:
            raise ValueError(f"a page id must be an integer, got {page!r}") from None
        if not 1 <= page < self.num_pages:
            raise ValueError(f"page {page} is not a usable page (1 .. {self.num_pages - 1}; 0 is the null page)")
        return page

    def _take(self, page: int) -> None:
        self._refs[page] += 1
        if self._refs[page] == 1:
            self.num_used += 1
            self.peak_used = max(self.peak_used, self.num_used)

    def allocate(self, n: int) -> Optional[list]:
        """n pages, each with one reference (the caller's), or None (and nothing taken) when fewer than n
        are free. Plain free pages go first; then the least recently released cached pages are evicted
        (their blocks leave the prefix cache)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._cached[self._key[page]]
                self._key[page] = None
                self.evictions += 1
            self._take(page)
            out.append(page)
        return out

    def share(self, pages: Iterable[int]) -> None:
        """One more reference on each page: a referenced page, or a cached one (it leaves the LRU queue).
        Taking a plain free page this way is a ValueError: it holds nothing (use `allocate`)."""
        pages = [self._check(p) for p in pages]
        for p in pages:
            if self._refs[p] == 0 and p not in self._evictable:
                raise ValueError(f"page {p} is free and holds no cached block: allocate it instead")
        for p in pages:
            if self._refs[p] == 0:
                del self._evictable[p]
            self._take(p)

    def release(self, pages: Iterable[int]) -> None:
        """One reference less on each page. A page nobody holds any more becomes free: a cached one joins
        the back of the LRU queue, in the order given. So pass a request's pages last first: its tail is
        then evicted before its head, which is what a later prefix hit needs (a chain is only found from
        its first page on)."""
        pages = [self._check(p) for p in pages]
        counts = collections.Counter(pages)
        for p, c in counts.items():
            if self._refs[p] < c:
                raise ValueError(f"page {p} has {self._refs[p]} reference(s); cannot release {c}")
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self.num_used -= 1
                if self._key[p] is not None:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    def cache_page(self, page: int, parent: Optional[BlockKey], tokens: Sequence[int], salt: tuple = ()) -> BlockKey:
        """Register a full page whose keys and values are computed: the block `tokens` (page_size of them)
        after `parent` (the previous page's key, None for the first page), under `salt`. Returns the
        block's key, the parent for the next page.

        If an equal block is already cached in another page, that entry stays and this page is left
        uncached (it is freed as a plain page): the returned key is the existing one, so later keys of
        the chain share its objects. The caller must hold a reference on `page`."""
        page = self._check(page)
        tokens = tuple(tokens)
        if len(tokens) != self.page_size:
            raise ValueError(f"a cached block is a full page: {self.page_size} tokens, got {len(tokens)}")
        if self._refs[page] == 0:
            raise ValueError(f"page {page} is not referenced: only a page being used can be cached")
        key = BlockKey(parent, tokens, salt)
        existing = self._cached.get(key)
        if existing is not None:
            return self._key[existing]
        if self._key[page] is not None:
            raise ValueError(f"page {page} already holds another block ({self._key[page]!r})")
        self._cached[key] = page
        self._key[page] = key
        return key

    def match(self, tokens: Sequence[int], salt: tuple = (), max_tokens: Optional[int] = None) -> list:
        """The pages of the longest chain of cached blocks equal to tokens[0 : k * page_size], with
        k * page_size <= max_tokens (default: all of `tokens`). Takes no references (see `lookup`)."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        ps, out, parent = self.page_size, [], None
        for k in range(limit // ps):
            page = self._cached.get(BlockKey(parent, tuple(tokens[k * ps:(k + 1) * ps]), salt))
            if page is None:
                break
            out.append(page)
            parent = self._key[page]  # the cache's own object: the next key compares by identity
        return out

    def lookup(self, tokens: Sequence[int], salt: tuple = (), max_tokens: Optional[int] = None) -> list:
        """`match`, then a reference on each page found: the caller owns them (`release` gives them back)."""
        pages = self.match(tokens, salt, max_tokens)
        self.share(pages)
        return pages
