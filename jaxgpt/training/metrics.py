"""What the user sees of a run: metrics.jsonl (and TensorBoard), device peak FLOP/s for MFU."""

from __future__ import annotations

import functools
import json
import math
import os
import time
from typing import Optional

import jax
import jax.numpy as jnp

# Dense bf16 peak FLOP/s per chip for accelerators we know (vendor datasheets).
KNOWN_PEAKS = {
    "h200": 989e12, "h100": 989e12, "a100": 312e12, "l4": 121e12, "a10": 125e12,
    "tpu v4": 275e12, "tpu v5 lite": 197e12, "tpu v5e": 197e12, "tpu v5p": 459e12, "tpu v6": 918e12,
}


@functools.lru_cache(maxsize=None)
def measured_matmul_flops(dtype: str = "float32", n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of a jitted n^3 matmul on the default device (fp32 accumulation), best of `reps`."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(dtype: str = "float32", override: Optional[float] = None) -> tuple[float, str]:
    """Peak FLOP/s of all local devices together for MFU, and where the figure came from."""
    devices = jax.local_devices()
    if override:
        return override * len(devices), "train.peak_flops"
    kind = devices[0].device_kind.lower()
    for name, flops in KNOWN_PEAKS.items():
        if name in kind:
            scale = 1.0 if dtype in ("bfloat16", "float16") else 0.5  # TF32-class rate for float32
            return flops * scale * len(devices), f"datasheet ({kind})"
    # CPU (fake CPU devices share the same cores): measure the machine's matmul rate once.
    return measured_matmul_flops(dtype), f"measured {dtype} matmul on {kind}"


class MetricsLog:
    """Appends JSON lines to out_dir/metrics.jsonl (and TensorBoard events when tensorboardX is there)."""

    def __init__(self, out_dir: str, enabled: bool = True, truncate_after_step: Optional[int] = None):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        if truncate_after_step is not None and os.path.exists(self.path):
            # on resume, forget what happened after the checkpoint so the file tells one history
            with open(self.path) as f:
                keep = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= truncate_after_step]
            with open(self.path, "w") as f:
                f.writelines(keep)
        elif truncate_after_step is None and os.path.exists(self.path):
            os.remove(self.path)
        try:
            from tensorboardX import SummaryWriter  # optional extra
            self._tb = SummaryWriter(os.path.join(out_dir, "tb"))
        except ImportError:
            self._tb = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
