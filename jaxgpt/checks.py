"""Type guards for user-given numbers; imports nothing from jaxgpt."""

from __future__ import annotations

import math
import numbers


def is_int(value) -> bool:
    """An integer (Python or NumPy), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A finite real number (Python or NumPy), but not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
