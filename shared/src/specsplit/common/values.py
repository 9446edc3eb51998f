"""Type checks for numbers read from users and files: Python counts a bool as an int."""
from __future__ import annotations

import numbers


def whole(value: object) -> bool:
    """An int or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def real(value: object) -> bool:
    """A number (int, float, numpy's), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
