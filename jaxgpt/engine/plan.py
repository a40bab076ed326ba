"""What one step of the paged engine runs, as plain data: the scheduler's output and the runner's input.

Nothing here touches a device: a `Plan` can be built, printed and checked on the host (tests/test_paged_scheduler.py).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Work:
    """One request's part of a step: tokens `start` .. `start + len(tokens) - 1` of its sequence (its prompt
    and then the tokens it generated) fed through the model, their keys and values written into `pages`.

    `pages`: the request's block table: page ids holding positions 0 .. start + len(tokens) - 1, page i
    positions i * page_size .. (i + 1) * page_size - 1. `sample`: this work feeds the last token the request
    has, so the step draws its next token after it. A decoding request's work is one token; a prompt's (or a
    preempted request's recomputation) is a chunk."""

    request_id: int
    start: int
    tokens: tuple
    pages: tuple
    sample: bool

    @property
    def end(self) -> int:
        """The position after the last token fed: the request's keys and values in the cache after the step."""
        return self.start + len(self.tokens)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One step: `work` (decoding requests first, then prompt chunks, each request at most once), the
    requests preempted to make room (`preempted`: their pages were freed; they wait at the queue's head
    and are recomputed when they come back), and the prompt tokens found in the prefix cache for requests
    admitted by this step (`cached`: request id -> tokens, whole pages, not computed again)."""

    work: tuple = ()
    preempted: tuple = ()
    cached: dict = dataclasses.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(w.tokens) for w in self.work)

    @property
    def num_requests(self) -> int:
        return len(self.work)

    def __bool__(self) -> bool:
        return bool(self.work)
