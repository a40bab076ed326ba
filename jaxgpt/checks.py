"""Type guards for user-given numbers; imports nothing from jaxgpt."""

from __future__ import annotations

import math
import numbers

# The seeds a request may give (jax.random.key's: a C long, int64): the engine's and the server's range.
SEED_MIN, SEED_MAX = -2 ** 63, 2 ** 63 - 1


def _scalar(value, kinds: str):
    """The Python number a 0-d NumPy or JAX array holds when its dtype kind is one of `kinds` ("iu" integers,
    "f" floats), else None (a traced value has none)."""
    dtype = getattr(value, "dtype", None)
    if getattr(value, "shape", None) != () or getattr(dtype, "kind", None) not in tuple(kinds):
        return None
    try:
        return value.item()
    except Exception:  # (a tracer under jit: no concrete value to check)
        return None


def is_int(value) -> bool:
    """An integer (Python or NumPy, or a 0-d integer array), but not a bool."""
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Integral) or _scalar(value, "iu") is not None


def is_real(value) -> bool:
    """A finite real number (Python or NumPy, or a 0-d integer or float array), but not a bool."""
    if isinstance(value, bool):
        return False
    if not isinstance(value, numbers.Real):
        value = _scalar(value, "iuf")
        if value is None:
            return False
    return math.isfinite(value)
