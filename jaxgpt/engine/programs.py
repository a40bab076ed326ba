"""The paged engine's compiled programs: which it runs (`runner.programs`), which are compiled, and
compiling them.

`warm()` compiles them all before it returns. `warm(background=True)` compiles first the programs of the
largest step shape, which hold any plan, and returns: the engine can serve from then on while a thread
beside its own compiles the rest, smallest shape first, and until a program is ready the engine pads its
steps to a larger shape whose program is (`usable`). Nothing is ever compiled while a request waits for
it. Programs are compiled without being run (`jit(...).lower(...).compile()` fills the cache that a call
reads), so compiling never touches the page pool the engine's steps write.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
import weakref
from typing import Callable, Optional, Sequence

log = logging.getLogger("jaxgpt.engine")
_COMPILING: "weakref.WeakSet[Programs]" = weakref.WeakSet()  # those with a background thread


def _finish_compiling() -> None:
    """At exit, let each background compilation end after its current program: a thread killed inside
    XLA's compiler when the interpreter finalizes aborts the process. (Registered at each thread's start,
    so that it runs before the exit handlers JAX registered by then, which clear what a trace needs.)"""
    for programs in list(_COMPILING):
        programs.stop()
        programs.join()


class Programs:
    """The (shape, kind) programs of an engine, in the order they are compiled, and which are ready.

    `compile_one(shape, kind)` lowers and compiles one of them for the engine's own arguments. A program
    no `warm` asked for is usable at once and compiles at its first call (tests, scripts)."""

    def __init__(self, calls: Sequence[tuple], compile_one: Callable[[tuple, str], None]):
        largest = max(shape for shape, _ in calls)
        first = [c for c in calls if c[0] == largest and c[1] != "steps"]  # (any plan fits these)
        self.calls = first + [c for c in calls if c not in first]
        self._compile_one = compile_one
        self.first = set(first)
        self.ready: set = set()   # compiled by `warm`
        self.wanted: set = set()  # what `warm` was asked for
        self.failed: Optional[BaseException] = None  # what stopped the background compilation, if anything
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def usable(self, shape: tuple, kind: str) -> bool:
        """Whether a step may call this program now: compiled, or never asked for by `warm` (it compiles at
        its first call, as before any warm-up)."""
        return (shape, kind) in self.ready or (shape, kind) not in self.wanted

    @property
    def pending(self) -> int:
        """Programs still to compile (in the background)."""
        return len(self.wanted - self.ready)

    def warm(self, wanted: Sequence[tuple], progress: bool = False, background: bool = False) -> None:
        """Compile `wanted` (a subset of `calls`, kept in their order); with `background`, only those of the
        largest shape before returning and the rest on a thread (`join` waits for it)."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("the engine's programs are being compiled in the background already")
        wanted = [c for c in self.calls if c in set(wanted)]
        self.wanted |= set(wanted)
        now = [c for c in wanted if c in self.first] if background else wanted
        self._compile(now, progress)
        rest = [c for c in wanted if c not in now]
        if rest:
            self._stop.clear()
            self._thread = threading.Thread(target=self._background, args=(rest,), daemon=True,
                                            name="jaxgpt-engine-compile")
            _COMPILING.add(self)
            atexit.unregister(_finish_compiling)
            atexit.register(_finish_compiling)
            self._thread.start()

    def _compile(self, calls: Sequence[tuple], progress: bool) -> None:
        from tqdm import tqdm

        with tqdm(total=len(calls), desc="compiling", unit="program", dynamic_ncols=True,
                  disable=not (progress and sys.stderr.isatty())) as bar:
            for call in calls:
                if call not in self.ready:
                    self._compile_one(*call)
                    self.ready.add(call)
                bar.update()

    def _background(self, calls: Sequence[tuple]) -> None:
        t0 = time.perf_counter()
        try:
            for call in calls:
                if self._stop.is_set():
                    return
                self._compile([call], progress=False)
        except BaseException as e:  # the engine serves on with the programs it has (padded to larger ones)
            self.failed = e
            log.exception("compiling the engine's programs in the background failed; steps are padded to the "
                          "%d compiled", len(self.ready))
            return
        log.info("the engine's other %d programs are compiled (%.1f s in the background)", len(calls),
                 time.perf_counter() - t0)

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait for the background compilation; True once it is over (or none runs)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def stop(self) -> None:
        """Stop compiling in the background after the program being compiled now."""
        self._stop.set()
