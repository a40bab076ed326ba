"""What the user sees of a run: metrics.jsonl (and the trackers, jaxgpt/training/trackers.py), device peak
FLOP/s for MFU."""

from __future__ import annotations

import functools
import json
import math
import os
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxgpt.report import warn

# Dense (no sparsity) bf16 peak FLOP/s of one JAX device, keyed by the exact `device_kind` JAX reports.
# NVIDIA: the product datasheets (their tables quote "with sparsity", twice these). TPU: Cloud TPU's
# per-chip figures; v2 and v3 show each of a chip's two TensorCores as a device (half a chip each), v4
# and v5p one device per chip; device kinds as jax/_src/pallas/mosaic/tpu_info.py names them. Left out
# on purpose: the A10G (no public datasheet), H100 NVL and GH200 (figures and names we could not pin
# down), TPU7x. Anything not here reports "MFU unknown" unless train.peak_flops is set. "NVIDIA H200"
# is also what an H200 NVL (835e12) reports; there the MFU shown is too low.
KNOWN_PEAKS = {
    "NVIDIA H100 80GB HBM3": 989e12,  # H100 SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H200": 989e12,  # H200 SXM
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100-PCIE-80GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A10": 125e12,
    "NVIDIA A40": 149.7e12,
    "NVIDIA L4": 121e12,
    "NVIDIA L40": 181e12,
    "NVIDIA L40S": 362e12,
    "TPU v2": 22.5e12,
    "TPU v3": 61.5e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5": 459e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}


@functools.lru_cache(maxsize=None)
def measured_matmul_flops(dtype: str = "float32", shape: tuple = (1024, 1024, 1024), reps: int = 5) -> float:
    """FLOP/s of [m, k] x [k, n] matmuls (`shape` = (m, k, n)) in `dtype` with float32 accumulation on the
    default device, best of `reps`.

    One call runs a loop of r such matmuls (r sized so a call does about 1 GFLOP), so a small shape is
    not timed by the cost of dispatching a program, which the training loop does not pay per matmul.
    """
    m, k, n = shape
    flops = 2 * m * k * n
    itemsize = jnp.dtype(dtype).itemsize
    r = int(max(1, min(1e9 // flops, 2 ** 28 // (itemsize * m * k), 1024)))  # r inputs within 256 MiB
    a, b = jnp.ones((r, m, k), dtype), jnp.ones((k, n), dtype)

    def f(xs, y):  # summed into one [m, n] buffer: no fresh output memory to fault in per call
        def body(i, acc):
            return acc + jnp.matmul(xs[i], y, preferred_element_type=jnp.float32)
        return jax.lax.fori_loop(0, r, body, jnp.zeros((m, n), jnp.float32))

    f = jax.jit(f)
    f(a, b).block_until_ready()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return r * flops / best


def peak_flops(dtype: str = "float32", override: Optional[float] = None,
               devices: Optional[list] = None, matmul_shape: tuple = (1024, 1024, 1024)) -> tuple[Optional[float], str]:
    """Peak FLOP/s of all local devices together for MFU (None when unknown), and where it came from.

    On a CPU it is measured: the rate of one matmul of `matmul_shape` (m, k, n) in the compute dtype, the
    model's own largest (its MLP's input layer at the batch's rows), never a datasheet number.
    """
    devices = jax.local_devices() if devices is None else devices
    if override:
        return override * len(devices), "train.peak_flops"
    kind = devices[0].device_kind
    if kind in KNOWN_PEAKS:
        scale = 1.0 if dtype in ("bfloat16", "float16") else 0.5  # TF32-class rate for float32
        return KNOWN_PEAKS[kind] * scale * len(devices), f"datasheet ({kind})"
    if devices[0].platform == "cpu":  # fake CPU devices share the same cores: measure the machine once
        m, k, n = (int(d) for d in matmul_shape)
        return (measured_matmul_flops(dtype, (m, k, n)),
                f"measured {dtype} matmul [{m}x{k}]x[{k}x{n}], the model's own shape, on {kind}")
    return None, (f"device kind {kind!r} is not in jaxgpt's table of peaks; set --config.train.peak_flops "
                  "to its per-device peak FLOP/s")


def read_records(path: str) -> list[dict]:
    """The JSON records of a metrics.jsonl, skipping (with a warning naming the line) any line that is not
    one, such as the half-written last line of a run that crashed mid-write."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            if not isinstance(r, dict) or not isinstance(r.get("step"), int):
                raise ValueError("not a record with a step")
        except ValueError:
            torn = " (cut off, as by a crash mid-write)" if n == len(lines) else ""
            warn(f"{path} line {n} is not a JSON metrics record{torn}; skipped it")
            continue
        records.append(r)
    return records


class MetricsLog:
    """Appends JSON lines to out_dir/metrics.jsonl and passes each record to the other trackers `trackers` names
    (train.trackers: TensorBoard, W&B; "auto": TensorBoard when tensorboardX is there); `config` is the run's
    ConfigDict, which W&B logs. Only an `enabled` log (process 0's) writes anything."""

    def __init__(self, out_dir: str, enabled: bool = True, truncate_after_step: Optional[int] = None,
                 trackers: Any = "auto", config=None):
        from jaxgpt.training.trackers import make_trackers, parse_trackers

        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.enabled = enabled
        self._trackers = []
        if not enabled:
            return
        if truncate_after_step is not None and os.path.exists(self.path):
            # on resume, forget what happened after the checkpoint so the file tells one history
            keep = [r for r in read_records(self.path) if r.get("step", 0) <= truncate_after_step]
            tmp = f"{self.path}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in keep)
            os.replace(tmp, self.path)  # a crash leaves the old file or the new one, never half of one
        elif truncate_after_step is None and os.path.exists(self.path):
            os.remove(self.path)
        self._trackers = make_trackers(parse_trackers(trackers), out_dir, config,
                                       resume=truncate_after_step is not None)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for tracker in self._trackers:
            tracker.write(record)

    def close(self) -> None:
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []
