"""Bounds on the numbers the package sends to PostgreSQL, checked before anything is sent.

A number the server cannot hold fails there, often far from where it was given (a lease
too long for the idle timeout of an attempt fails every attempt of its task). Each bound
here is checked where the number enters, with a ConfigurationError that names it.
"""

from __future__ import annotations

import math

from .errors import ConfigurationError

# An attempt's idle-in-transaction timeout is the lease in milliseconds, which PostgreSQL
# holds in a 32-bit integer (about 24.8 days); a week is far below it.
MAX_LEASE_SECONDS = 7 * 24 * 3600
# Delays and ages become intervals added to the database clock: about 31.7 years.
MAX_DELAY_SECONDS = 10**9
# Row counts and limits are sent as integers; a 32-bit one is more than any batch needs.
MAX_ROWS = 2**31 - 1


def check_seconds(
    name: str, value: float, *, allow_zero: bool = False, maximum: float = MAX_DELAY_SECONDS
) -> float:
    """``value`` as a float if it is a number of seconds within bounds, else raise."""
    lowest = "0 or more" if allow_zero else "more than 0"
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
        or value > maximum
    ):
        raise ConfigurationError(
            f"{name} must be {lowest} seconds and at most {maximum:g}, got {value!r}"
        )
    return float(value)


def check_count(name: str, value: int, *, minimum: int = 1, maximum: int = MAX_ROWS) -> int:
    """``value`` if it is a whole number within bounds, else raise."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ConfigurationError(
            f"{name} must be a whole number from {minimum} to {maximum}, got {value!r}"
        )
    return value
