"""Throughput in the training loop: tokens/s and MFU between log lines (a program call's steps timed at even
shares of its time), the time waited for data and the loader's rate, and the peak FLOP/s they are against."""

from __future__ import annotations

import time
from typing import Callable, NamedTuple, Optional

from jaxgpt.model import flops_per_token
from jaxgpt.training.metrics import measured_matmul_flops, peak_flops


class Rates(NamedTuple):
    """What a log line says of the steps since the previous one."""
    tokens_per_s: float
    mfu: Optional[float]
    data_wait_s: float  # seconds the loop waited for batches
    loader_tokens_per_s: Optional[float]  # the loader's rate on this process
    waited: float  # the share of the time the loop waited for data

    def data_note(self) -> str:
        """The log line's data part: the share waited for data when 2% or more, with the loader's rate when
        it made a batch since the last line (a wait can span a line with no batch finished)."""
        if self.waited < 0.02:
            return ""
        loader = ("" if self.loader_tokens_per_s is None
                  else f" (loader {self.loader_tokens_per_s:,.0f} tok/s per process)")
        return f" | waited for data {100 * self.waited:.0f}%{loader}"


class Throughput:
    """Clocks for tokens/s, MFU and the data rates of one run; `note` says the one-off peak re-measurement."""

    def __init__(self, cfg_t, gcfg, n_devices: int, process_count: int, local_batch_size: int,
                 note: Callable[[str], None]):
        self.dtype, self.process_count, self.note = gcfg.dtype, process_count, note
        self.tokens_per_step = cfg_t.batch_size * gcfg.block_size
        self.flops_per_token = flops_per_token(gcfg, gcfg.block_size)
        rows = cfg_t.batch_size // (cfg_t.grad_accum * n_devices) * gcfg.block_size  # one device's rows
        self.peak_shape = (rows, gcfg.n_embd, gcfg.mlp_hidden)
        self.peak, self.peak_source = peak_flops(gcfg.dtype, cfg_t.peak_flops, matmul_shape=self.peak_shape)
        if self.peak is not None:
            self.peak *= process_count  # peak_flops counts this process's devices, tokens/s all of them
        self.peak_measured = self.peak_source.startswith("measured")
        self.peak_noted = False  # whether the measured peak has been raised (remeasure_peak)
        self.batch_tokens = local_batch_size * gcfg.block_size  # one batch's tokens on this process
        self.data_wait = 0.0  # seconds the loop has waited for the prefetcher's batches
        self.data_mark = (0.0, 0, 0.0)  # (data_wait, batches made, seconds making them) at the last log line
        self.last_log = (time.time(), 0)  # (time, step) of the last log line
        self.last_finished = self.last_log[0]  # when the last program call read finished

    def describe(self) -> str:
        """The start-up line's MFU part: the peak and where it came from, the FLOPs per token."""
        return ((f"MFU against {self.peak / 1e9:.0f} GFLOP/s ({self.peak_source})" if self.peak is not None
                 else f"MFU unknown: {self.peak_source}")
                + f", {self.flops_per_token / 1e6:.2f} MFLOP/token (6N + 12*L*T*D, attention not halved)")

    def restart(self, step: int) -> None:
        """The next call's time, and rate, start now (at the start, and after an eval or a save)."""
        self.last_finished = time.time()
        self.last_log = (self.last_finished, step)

    def next_batch(self, prefetch):
        """The next batch from `prefetch`, the time waited for it counted."""
        t0 = time.perf_counter()
        batch = next(prefetch)
        self.data_wait += time.perf_counter() - t0
        return batch

    def finish_share(self, count: int, later: int, finished: float) -> float:
        """When a call of `count` steps ended whose finish went unseen, the next (of `later` steps) ending by
        `finished`: a share of the time since the last read by its steps (not all of it, leaving none)."""
        share = count / (count + later)
        return self.last_finished + (finished - self.last_finished) * share

    def step_times(self, count: int, finished: Optional[float]) -> list:
        """The finish times of a call's `count` steps (it finished at `finished`, else now): even shares of
        its time from the previous call's finish, so tokens/s and MFU over any steps are those of the calls
        that ran them."""
        finished = time.time() if finished is None else finished
        started, self.last_finished = self.last_finished, finished
        return [started + (finished - started) * (i + 1) / count for i in range(count)]

    def rates(self, step: int, now: float, prefetch) -> Rates:
        """The rates since the last log line, which `step`, finished at `now`, becomes."""
        last_time, last_step = self.last_log
        tok_s = self.tokens_per_step * (step - last_step) / max(now - last_time, 1e-9)
        mfu = None if self.peak is None else self.flops_per_token * tok_s / self.peak
        if mfu is not None and mfu > 1 and self.peak_measured:
            mfu = self.flops_per_token * tok_s / self.remeasure_peak(self.flops_per_token * tok_s)
        wait, loader = self._data_rates(prefetch)
        self.last_log = (now, step)
        return Rates(tok_s, mfu, wait, loader, wait / max(now - last_time, 1e-9))

    def _data_rates(self, p) -> tuple[float, Optional[float]]:
        """(seconds waited for data, the loader's tokens/s on this process) since the last log line."""
        wait0, made0, busy0 = self.data_mark
        self.data_mark = (self.data_wait, p.produced, p.produce_s)
        made, busy = p.produced - made0, p.produce_s - busy0
        return self.data_wait - wait0, (self.batch_tokens * made / busy if made and busy > 0 else None)

    def remeasure_peak(self, attained: float) -> float:
        """The run went faster than the CPU's measured peak, so that matmul was timed while something else
        held the cores (another process, a test worker beside it). Measures it again and keeps the higher of
        the two and the rate the run itself attained, the true peak's best lower bound: an MFU never above
        100%. Says so once."""
        before = self.peak
        again = measured_matmul_flops.__wrapped__(self.dtype, self.peak_shape) * self.process_count
        self.peak = max(self.peak, again, attained)
        if not self.peak_noted:
            self.peak_noted = True
            self.note(f"jaxgpt: MFU now against {self.peak / 1e9:.0f} GFLOP/s: this run attained "
                      f"{attained / 1e9:.0f}, above the {before / 1e9:.0f} measured at the start (the cores were "
                      f"busy then; measured again: {again / 1e9:.0f})")
        return self.peak
