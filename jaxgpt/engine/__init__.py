"""The engine: many requests at once over one model.

Two engines share one request interface (`submit`, `step`, `run`, `stream`, `score`, `cancel`, `warmup`):

- `Engine` (slots.py): dense slots, each a row of one KV cache preallocated to `max_len`; prompts in
  their own compiled calls, decode in another, prefixes reused by copying a slot's row.
- `PagedEngine` (paged.py): a pool of fixed-size pages with a block table per request, one ragged step
  a call (decode tokens and prompt chunks under one token budget), prefixes reused by block hash. Its
  parts: pages.py (the page pool and the prefix cache: host data only), scheduler.py (which tokens run
  next, as a plain-data plan), runner.py (the compiled step and the cache on the device).
"""

from jaxgpt.engine.slots import (TRACES, Completion, Engine, Event, Request, Token, _prefill, check_packed,
                                 check_sizes, chunk_lengths, decode_sizes, lower_engine, packed_lengths,
                                 prefill_programs, prefill_windows, seed_key, steps_by_rows)

__all__ = ["TRACES", "Completion", "Engine", "Event", "Request", "Token", "check_packed", "check_sizes",
           "chunk_lengths", "decode_sizes", "lower_engine", "packed_lengths", "prefill_programs",
           "prefill_windows", "seed_key", "steps_by_rows"]
