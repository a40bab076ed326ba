"""jax.profiler traces of a window of steps (train.profile = "START:STOP", jaxgpt-serve --profile): the device
synchronised before the first step and after the last, so the trace holds whole steps, each annotated with
its number (StepTraceAnnotation). TensorBoard's profile plugin and Perfetto (ui.perfetto.dev) read the
trace: FOLDER/plugins/profile/<time>/<host>.xplane.pb (and a .trace.json.gz)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import jax


def parse_window(spec: Any, key: str = "config.train.profile") -> Optional[tuple[int, int]]:
    """(start, stop) of "START:STOP" (0 <= START < STOP; the steps START..STOP-1), None for "" or None;
    ValueError naming `key` otherwise."""
    if spec is None or spec == "":
        return None
    parts = spec.split(":") if isinstance(spec, str) else []
    try:
        start, stop = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"{key}: must be 'START:STOP' (step numbers, e.g. '10:12' traces steps 10 and 11), "
                         f"got {spec!r}") from None
    if not 0 <= start < stop:
        raise ValueError(f"{key}: needs 0 <= START < STOP (e.g. '10:12' traces steps 10 and 11), got {spec!r}")
    return start, stop


def bounds(spec: Any) -> tuple[int, ...]:
    """The steps a program call should end at so the window holds whole calls: () or (START, STOP)."""
    window = parse_window(spec)
    return () if window is None else window


class StepProfiler:
    """Traces steps [start, stop) into `folder`: `start(step, sync)` before dispatching step `step`, `annotate`
    around the dispatch, `stop(step, sync)` once `step` steps are done; `close()` ends a trace cut short."""

    def __init__(self, window: Optional[tuple[int, int]], folder: str, name: str = "train"):
        self.window, self.folder, self.name = window, folder, name
        self.active = self.done = False

    def start(self, step: int, sync: Any = None) -> bool:
        """Begin the trace if `step` is the first one in the window not yet traced; True if it began."""
        if self.window is None or self.active or self.done or not self.window[0] <= step < self.window[1]:
            return False
        jax.block_until_ready(sync)  # the steps before it finish outside the trace
        os.makedirs(self.folder, exist_ok=True)
        jax.profiler.start_trace(self.folder)
        self.active = True
        return True

    def annotate(self, step: int):
        """A StepTraceAnnotation for step `step` while tracing (TensorBoard's step view reads it)."""
        if not self.active:
            return contextlib.nullcontext()
        return jax.profiler.StepTraceAnnotation(self.name, step_num=step)

    def stop(self, step: int, sync: Any = None) -> bool:
        """End the trace once `step` (the steps done) reaches the window's end; True if it ended."""
        if not self.active or step < self.window[1]:
            return False
        jax.block_until_ready(sync)  # the window's last step finishes inside the trace
        self.close()
        return True

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active, self.done = False, True
