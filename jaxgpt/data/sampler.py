"""Batches of random token windows (nanoGPT's sampling) that are a pure function of (seed, step).

The global batch of step t is drawn from a generator seeded with (seed, t), so it does not depend on
how many processes read it: process i of n takes rows [i * B/n, (i + 1) * B/n) of it. The sampler's
state is just (seed, step); restoring it gives exactly the batches that would have come next, on any
number of processes.

`DocumentSampler` draws windows that start at a document's first token (`data.align = "document"`).
Documents are separated by an end-of-text token; a window starts AT that token (modded-nanogpt's rule:
it is the document's beginning-of-sequence token, and belongs to the document that follows it), or at
the first token of the array. With `segments` its batches also carry each token's document id within
the window (`document_ids`), which the model's document masking reads.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np


class BatchSampler:
    """Random windows of block_size + 1 tokens -> (x, y) int32 [batch_size // process_count, block_size]."""

    align = "random"  # where windows start (state_dict records it; DocumentSampler: "document")

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        block_size: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        tokens_shape = getattr(tokens, "shape", None)
        if tokens_shape is None or len(tokens_shape) != 1:
            raise ValueError(f"tokens must be a 1-D array of token ids, got shape {tokens_shape}")
        for name, v in (
            ("batch_size", batch_size),
            ("block_size", block_size),
            ("process_count", process_count),
        ):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if not isinstance(process_index, (int, np.integer)) or not 0 <= process_index < process_count:
            raise ValueError(f"process_index must be in [0, {process_count}), got {process_index!r}")
        if batch_size % process_count:
            raise ValueError(
                f"batch_size {batch_size} is not divisible by process_count {process_count}; "
                f"each process reads an equal share of the global batch"
            )
        n = int(tokens_shape[0])
        if n < block_size + 1:
            raise ValueError(
                f"the token array has {n} tokens, fewer than block_size + 1 = {block_size + 1}; "
                f"use a smaller block_size, a larger corpus, or a larger val_fraction for the val split"
            )
        self.tokens = tokens
        self.n_tokens = n
        self.batch_size = int(batch_size)
        self.block_size = int(block_size)
        self.seed = int(seed)
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self.local_batch_size = self.batch_size // self.process_count
        self.step = 0
        # A whole np.memmap is mapped afresh for each batch and unmapped after, so that the pages a long
        # run has touched do not pile up in this process's resident memory.
        self._file = None
        if isinstance(tokens, np.memmap) and isinstance(tokens.base, mmap.mmap) and tokens.filename:
            self._file = (tokens.filename, tokens.dtype, int(tokens.offset), n)

    def starts(self, step: int) -> np.ndarray:
        """Window starts of global batch `step`: int64 [batch_size], a pure function of (seed, step)."""
        rng = np.random.default_rng([self.seed, int(step)])
        return rng.integers(0, self.n_tokens - self.block_size, size=self.batch_size, dtype=np.int64)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """This process's rows of global batch `step`: x, y int32 [local_batch_size, block_size]."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        lo = self.process_index * self.local_batch_size
        starts = self.starts(step)[lo : lo + self.local_batch_size]
        if self._file is not None:
            filename, dtype, offset, n = self._file
            data = np.memmap(filename, dtype=dtype, mode="r", offset=offset, shape=(n,))
        else:
            data = self.tokens
        window = np.empty((self.local_batch_size, self.block_size + 1), dtype=np.int32)
        for row, s in enumerate(starts):
            window[row] = data[s : s + self.block_size + 1]
        del data
        return np.ascontiguousarray(window[:, :-1]), np.ascontiguousarray(window[:, 1:])

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """The batch of the current step; advances the step."""
        out = self.batch(self.step)
        self.step += 1
        return out

    def __iter__(self) -> "BatchSampler":
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        return self.next()

    def state_dict(self) -> dict:
        """JSON-able state: the next step to draw, with the settings that must match on restore."""
        return {
            "seed": self.seed,
            "step": self.step,
            "batch_size": self.batch_size,
            "block_size": self.block_size,
            "n_tokens": self.n_tokens,
            "align": self.align,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict(): the next batches are those that would have come next."""
        for k in ("batch_size", "block_size", "n_tokens"):
            if k in state and int(state[k]) != getattr(self, k):
                raise ValueError(
                    f"sampler state has {k}={state[k]} but this sampler has {k}={getattr(self, k)}; "
                    f"restore with the same data and batch settings as the saved run"
                )
        saved_align = state.get("align", "random")  # (states from before data.align: random windows)
        if saved_align != self.align:
            raise ValueError(
                f"sampler state has align={saved_align!r} but this sampler has align={self.align!r}; "
                f"restore with the saved run's data.align"
            )
        seed, step = state.get("seed"), state.get("step")
        if (
            not isinstance(seed, (int, np.integer))
            or seed < 0
            or not isinstance(step, (int, np.integer))
            or step < 0
        ):
            raise ValueError(f"not a sampler state (needs non-negative integer seed and step): {state!r}")
        self.seed = int(seed)
        self.step = int(step)


_STARTS_CHUNK = 1 << 24  # tokens scanned for separators at a time (64 MB of uint32 at most in memory)


def document_starts(tokens: np.ndarray, separator: int, cache: Optional[str | os.PathLike] = None,
                    key: str = "") -> np.ndarray:
    """int64 [n_documents]: where each document starts in a 1-D token array: every position holding the
    `separator` (end-of-text) token, and position 0 when it holds another token. Read a chunk at a time
    (a memmap is never read whole); with `cache` (a .npy path) the result is saved there and reused,
    memory-mapped, while it matches the array's length, the separator and `key` (the dataset's fingerprint:
    data prepared again with the same length is not taken for the old); an unwritable path is skipped."""
    n = int(tokens.shape[0])
    if cache is not None:
        found = _cached_starts(Path(cache), _starts_key(n, separator, key))
        if found is not None:
            return found
    parts = [] if n and int(tokens[0]) == separator else [np.zeros(1, np.int64)]
    for lo in range(0, n, _STARTS_CHUNK):
        chunk = np.asarray(tokens[lo : lo + _STARTS_CHUNK])
        parts.append(np.flatnonzero(chunk == separator).astype(np.int64) + lo)
    starts = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if cache is not None:
        _save_starts(Path(cache), starts, _starts_key(n, separator, key))
    return starts


def _starts_key(n: int, separator: int, key: str) -> np.ndarray:
    """uint8 [32]: what the cached starts were computed from (SHA-256 of the length, separator and key)."""
    return np.frombuffer(hashlib.sha256(f"{n}:{int(separator)}:{key}".encode()).digest(), np.uint8)


def _cached_starts(path: Path, want: np.ndarray) -> Optional[np.ndarray]:
    """The starts saved at `path` under the key `want`, memory-mapped; else None."""
    try:
        head = np.load(path.with_suffix(".key.npy"))
        if head.shape != want.shape or not np.array_equal(head, want):
            return None
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        return None


def _save_starts(path: Path, starts: np.ndarray, key: np.ndarray) -> None:
    """Write the starts and their key under temporary names, renamed into place."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for target, value in ((path, starts), (path.with_suffix(".key.npy"), key)):
            tmp = target.with_name(f".tmp-{uuid.uuid4().hex[:8]}-{target.name}")
            np.save(tmp, value)
            os.replace(tmp, target)
    except OSError:
        pass  # a read-only dataset folder: computed again next time


def document_ids(x_BxT: np.ndarray, separator: int) -> np.ndarray:
    """int32 [B, T]: each token's document within its window: the count of separator tokens at or before
    it (a separator opens the document after it; tokens before a window's first separator are document 0)."""
    return np.cumsum(np.asarray(x_BxT) == separator, axis=1, dtype=np.int32)


class DocumentSampler(BatchSampler):
    """Windows of block_size + 1 tokens that each start at a document's start (`document_starts`), drawn
    uniformly over the documents with room for a whole window, as a pure function of (seed, step): the
    same resume and process-count properties as BatchSampler. A window holds its document's first
    block_size + 1 tokens (a longer document's rest is never trained on, modded-nanogpt's rule too) and,
    after a shorter one, the documents that follow. Batches are (x, y), or (x, y, document_ids(x))
    with `segments`."""

    align = "document"

    def __init__(self, tokens: np.ndarray, separator: int, batch_size: int, block_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1, *, segments: bool = True,
                 starts: Optional[np.ndarray] = None):
        super().__init__(tokens, batch_size, block_size, seed, process_index, process_count)
        if not isinstance(separator, (int, np.integer)) or separator < 0:
            raise ValueError(f"separator must be a non-negative token id, got {separator!r}")
        self.separator = int(separator)
        self.segments = bool(segments)
        all_starts = document_starts(tokens, self.separator) if starts is None else starts
        # the documents whose window fits: starts are sorted, so those before the last possible start
        self.doc_starts = all_starts[: np.searchsorted(all_starts, self.n_tokens - self.block_size, side="left")]
        if len(self.doc_starts) < 2:  # (one start: every window the same)
            raise ValueError(
                f"{len(self.doc_starts)} document(s) start a whole window of block_size + 1 = {self.block_size + 1} "
                f"tokens (the array has {self.n_tokens} tokens and {len(all_starts)} document starts, separator id "
                f"{self.separator}); document alignment needs a corpus of several documents (a folder of files, a "
                f"Hugging Face dataset)"
            )

    def coverage(self) -> float:
        """The share of the array's tokens that some window holds (what training can ever see): the union
        of the windows at every document start, over all tokens."""
        ends = np.append(np.asarray(self.doc_starts[1:]), self.n_tokens).astype(np.int64)
        seen = np.minimum(ends - self.doc_starts, self.block_size + 1).sum()
        return float(seen) / self.n_tokens

    def starts(self, step: int) -> np.ndarray:
        """Window starts of global batch `step`: document starts, int64 [batch_size], a pure function of
        (seed, step)."""
        rng = np.random.default_rng([self.seed, int(step)])
        return np.asarray(self.doc_starts[rng.integers(0, len(self.doc_starts), size=self.batch_size)], np.int64)

    def batch(self, step: int) -> tuple[np.ndarray, ...]:
        """This process's rows of global batch `step`: x, y int32 [local_batch_size, block_size], and with
        `segments` x's document ids."""
        x, y = super().batch(step)
        return (x, y, document_ids(x, self.separator)) if self.segments else (x, y)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "separator": self.separator}

    def load_state_dict(self, state: dict) -> None:
        if "separator" in state and int(state["separator"]) != self.separator:
            raise ValueError(f"sampler state has separator={state['separator']} but this sampler has separator="
                             f"{self.separator}; restore with the saved run's data and tokenizer")
        super().load_state_dict(state)


_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """Produce items on a background thread, `size` ahead of the consumer; an iterator; close() when done.

    The source is an iterable (e.g. a BatchSampler) or a callable returning the next item; `transform`
    runs on the thread too (e.g. a device put). When the source has state_dict(), this object's
    state_dict() is the source's state after the last item handed out, which is what to checkpoint:
    the source itself has run ahead.
    """

    def __init__(
        self,
        source: Iterable[Any] | Callable[[], Any],
        size: int = 2,
        transform: Callable[[Any], Any] | None = None,
    ):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"prefetch size must be a positive integer, got {size!r}")
        if hasattr(source, "__iter__"):
            it = iter(source)
            self._produce: Callable[[], Any] = lambda: next(it)
        elif callable(source):
            self._produce = source
        else:
            raise ValueError(f"Prefetcher needs an iterable or a callable, got {type(source).__name__}")
        self._stateful = source if hasattr(source, "state_dict") else None
        self._state = self._stateful.state_dict() if self._stateful is not None else None
        self._transform = transform
        self.produced, self.produce_s = 0, 0.0  # items made and the thread's seconds making them (loader speed)
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name="jaxgpt-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    item = self._produce()
                except StopIteration:
                    self._put(_END)
                    return
                if self._transform is not None:
                    item = self._transform(item)
                self.produce_s += time.perf_counter() - t0
                self.produced += 1
                state = self._stateful.state_dict() if self._stateful is not None else None
                self._put((item, state))
        except BaseException as e:  # handed to the consumer, raised there
            self._put(_Failure(e))

    def _put(self, x: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(x, timeout=0.05)
                return
            except queue.Full:
                pass

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        x = self._queue.get()
        if x is _END:
            self._done = True
            raise StopIteration
        if isinstance(x, _Failure):
            self._done = True
            raise x.error
        item, self._state = x
        return item

    def state_dict(self) -> dict:
        """The source's state after the last item this prefetcher handed out."""
        if self._stateful is None:
            raise ValueError("this Prefetcher's source has no state_dict()")
        return dict(self._state)

    def close(self) -> None:
        """Stop the background thread and drop the items it made ahead."""
        self._stop.set()
        self._done = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=10)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
