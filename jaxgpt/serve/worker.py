"""The engine thread: the one thread that owns the engine (and so the device).

The HTTP side hands it submissions and cancellations through a thread-safe queue; it steps the engine
while there is work and blocks on the queue when there is none. Each request's events go back to the
asyncio loop that asked for it, stamped with the time they happened, a step's at once (one
`loop.call_soon_threadsafe` a loop and step). It
knows requests only as token ids and `Request` settings: nothing of HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Optional, Sequence, Union

from jaxgpt.engine import Engine, Event

log = logging.getLogger("jaxgpt.serve")


@dataclasses.dataclass(eq=False)
class Ticket:
    """One submitted request as the HTTP side holds it: its events arrive on `events` as
    (ticket, Event, perf_counter time); an engine that refuses it sends (ticket, ValueError, time)."""

    prompt: tuple
    settings: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    submitted: float
    request_id: Optional[int] = None  # the engine's id, once the engine thread has submitted it
    done: bool = False                # set by the engine thread with the final event


_STOP = object()


class EngineWorker:
    """Runs `engine` on its own thread. `submit` admits up to `capacity` requests at once (running plus
    waiting; None: no limit); `num_running` and `num_waiting` are read from any thread."""

    def __init__(self, engine: Engine, *, capacity: Optional[int] = None, warmup: Union[bool, str] = True,
                 progress: bool = False, profiler=None):
        self.engine = engine
        # a StepProfiler (jaxgpt/training/profiling.py) or None: traces a window of engine steps, counted
        # from 0 at the first step after the warm-up
        self.profiler, self._steps = profiler, 0
        self.capacity = capacity
        # warmup: True (every program before the first request), "background" (an engine with programs
        # compiled in the background, the paged one: ready once its largest step's are), False (none)
        self.warmup, self.progress = warmup, progress  # progress: the warm-up's bar (on a terminal)
        self.ready = threading.Event()
        self.failed: Optional[BaseException] = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._outstanding = 0  # submitted and not yet finished (under _lock)
        self._running = 0      # the engine's num_running after its latest step (written by the thread)
        self._live: dict[int, Ticket] = {}
        self._outbox: dict = {}  # asyncio loop -> [(events queue, item)] not handed over yet (engine thread)
        self._thread = threading.Thread(target=self._run, name="jaxgpt-engine", daemon=True)

    @classmethod
    def for_engine(cls, engine: Engine, max_waiting: Optional[int], warmup: Union[bool, str] = True,
                   progress: bool = False, profiler=None) -> "EngineWorker":
        """A worker that lets `max_waiting` requests wait for a slot beyond the engine's slots."""
        return cls(engine, capacity=None if max_waiting is None else engine.slots + max_waiting, warmup=warmup,
                   progress=progress, profiler=profiler)

    # -- from the HTTP side (any thread) --------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, requests: Sequence[tuple], events: Optional[asyncio.Queue] = None) -> Optional[list]:
        """Submit (prompt ids, settings) pairs together, from inside a running asyncio loop: their Tickets
        (whose events all go to `events`, default one queue each), or None (nothing submitted) when they
        would take more than the capacity left."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.capacity is not None and self._outstanding + len(requests) > self.capacity:
                return None
            self._outstanding += len(requests)
        now = time.perf_counter()
        tickets = [Ticket(tuple(p), dict(s), loop, events if events is not None else asyncio.Queue(), now) for p, s in requests]
        for t in tickets:
            self._inbox.put(("submit", t))
        return tickets

    def cancel(self, ticket: Ticket) -> None:
        """Drop a request (its slot is free at the next step); nothing if it has finished."""
        if not ticket.done:
            self._inbox.put(("cancel", ticket))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is left and end the thread."""
        self._inbox.put((_STOP, None))
        if hasattr(self.engine, "programs"):
            # a background compilation ends after its current program, waited for: a thread still inside
            # XLA's compiler when the interpreter exits aborts the process
            self.engine.programs.stop()
            self.engine.programs.join(max(timeout, 120.0))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_running(self) -> int:
        return min(self._running, self._outstanding)  # (a request that just ended counts at once)

    @property
    def num_waiting(self) -> int:
        return max(0, self._outstanding - self._running)

    # -- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.warmup:
                t0 = time.perf_counter()
                log.info("compiling the engine's %d programs (or loading them from the compile cache)",
                         self.engine.warmup_programs())
                if self.warmup == "background" and hasattr(self.engine, "programs"):
                    self.engine.warmup(progress=self.progress, background=True)
                    log.info("ready with the largest step's programs (%.1f s); the other %d are compiled in the "
                             "background, steps padded to compiled ones meanwhile", time.perf_counter() - t0,
                             self.engine.programs.pending)
                else:
                    self.engine.warmup(progress=self.progress)
                    log.info("the engine's programs are ready (%.1f s)", time.perf_counter() - t0)
        except BaseException as e:  # reported by the CLI; /health stays 503
            self.failed = e
            log.exception("engine warm-up failed")
            return
        self.ready.set()
        while True:
            block = not self.engine.has_work()
            try:
                while True:
                    kind, ticket = self._inbox.get(block=block)
                    if kind is _STOP:
                        self._cancel_all()
                        return
                    self._handle(kind, ticket)
                    block = False
            except queue.Empty:
                pass
            self._running = self.engine.num_running  # (a cancel frees a slot without a step)
            if self.engine.has_work():
                self._step()
            self._flush()

    def _handle(self, kind: str, ticket: Ticket) -> None:
        if kind == "cancel":
            if ticket.request_id is not None and not ticket.done:
                self.engine.cancel(ticket.request_id)
            return
        try:
            rid = self.engine.submit(ticket.prompt, callback=lambda e, t=ticket: self._deliver(t, e),
                                     **ticket.settings)
        except (ValueError, TypeError) as e:  # the HTTP side checks first: this is a backstop
            self._finished(ticket)
            self._post(ticket, e)
            return
        ticket.request_id = rid
        self._live[rid] = ticket

    def _step(self) -> None:
        try:
            self._profiled_step()
        except Exception as e:  # a device error: fail the requests in flight, keep serving
            log.exception("engine step failed")
            for ticket in list(self._live.values()):
                self._post(ticket, RuntimeError(f"the engine failed: {e}"))
                self.engine.cancel(ticket.request_id)
        self._running = self.engine.num_running

    def _profiled_step(self) -> None:
        """One engine step; inside the profiler's window traced and annotated with its number, the device
        synchronised (on the KV cache) before the window's first step and after its last."""
        n, profiler = self._steps, self.profiler
        self._steps += 1
        if profiler is None:
            self.engine.step()
            return
        if profiler.start(n, self.engine.cache):
            log.info("profiling engine steps %d to %d into %s", n, profiler.window[1] - 1, profiler.folder)
        try:
            with profiler.annotate(n):
                self.engine.step()
        finally:
            if profiler.stop(n + 1, self.engine.cache):
                log.info("the engine's profile is in %s", profiler.folder)

    def _deliver(self, ticket: Ticket, event: Event) -> None:
        if event.finish_reason is not None:
            self._finished(ticket)
            self._live.pop(ticket.request_id, None)
        self._post(ticket, event)

    def _finished(self, ticket: Ticket) -> None:
        if not ticket.done:
            ticket.done = True
            with self._lock:
                self._outstanding -= 1

    def _post(self, ticket: Ticket, item) -> None:
        """Queue an item for the ticket's loop, stamped now; `_flush` hands a step's items over at once."""
        self._outbox.setdefault(ticket.loop, []).append((ticket.events, (ticket, item, time.perf_counter())))

    def _flush(self) -> None:
        """Hand each asyncio loop its queued items in one call (not one wake-up of its thread per token)."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # its loop has closed: nobody is listening
                pass

    def _cancel_all(self) -> None:
        if self.profiler is not None:
            self.profiler.close()  # a window the server stopped inside of: what it traced is kept
        for ticket in list(self._live.values()):
            self.engine.cancel(ticket.request_id)
        while True:  # submitted after the stop: never reached the engine
            try:
                kind, ticket = self._inbox.get(block=False)
            except queue.Empty:
                break
            if kind == "submit":
                self._finished(ticket)
                self._post(ticket, Event(-1, None, "cancelled"))
        self._running = 0
        self._flush()


def _put_all(items: list) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)
