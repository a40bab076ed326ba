"""Batches of random token windows (nanoGPT's sampling) that are a pure function of (seed, step).

The global batch of step t is drawn from a generator seeded with (seed, t), so it does not depend on
how many processes read it: process i of n takes rows [i * B/n, (i + 1) * B/n) of it. The sampler's
state is just (seed, step); restoring it gives exactly the batches that would have come next, on any
number of processes.
"""

from __future__ import annotations

import mmap
import queue
import threading
import time
from typing import Any, Callable, Iterable

import numpy as np


class BatchSampler:
    """Random windows of block_size + 1 tokens -> (x, y) int32 [batch_size // process_count, block_size]."""

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
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict(): the next batches are those that would have come next."""
        for k in ("batch_size", "block_size", "n_tokens"):
            if k in state and int(state[k]) != getattr(self, k):
                raise ValueError(
                    f"sampler state has {k}={state[k]} but this sampler has {k}={getattr(self, k)}; "
                    f"restore with the same data and batch settings as the saved run"
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
