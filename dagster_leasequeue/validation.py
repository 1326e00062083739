"""Checks of the arguments callers give, in one place, each with a ConfigurationError that
says what to fix.

They also bound the numbers the package sends to PostgreSQL: a number the server cannot
hold fails there, often far from where it was given (a lease too long for the idle
timeout of an attempt fails every attempt of its task).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from .errors import ConfigurationError

# An attempt's idle-in-transaction timeout is the lease in milliseconds, which PostgreSQL
# holds in a 32-bit integer (about 24.8 days); a week is far below it.
MAX_LEASE_SECONDS = 7 * 24 * 3600
# Delays and ages become intervals added to the database clock: about 31.7 years.
MAX_DELAY_SECONDS = 10**9
# Row counts and limits are sent as integers; a 32-bit one is more than any batch needs.
MAX_ROWS = 2**31 - 1
# Claims before a task is dead.
MAX_ATTEMPTS = 10_000
# Keys are indexed (with the queue's name, at most 200 characters): a btree entry holds
# at most about 2,700 bytes, and a character takes up to 4.
MAX_KEY_LENGTH = 400
# Task and batch ids are PostgreSQL bigints.
MAX_ID = 2**63 - 1
# The shortest interval between two reads of a batch's state while waiting for it.
MIN_POLL_SECONDS = 0.01
# A schema name needs no quoting and fits PostgreSQL's 63-byte identifiers.
SCHEMA_NAME_PATTERN = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def check_seconds(
    name: str, value: float, *, allow_zero: bool = False, maximum: float = MAX_DELAY_SECONDS
) -> float:
    """``value`` as a float if it is a number of seconds within bounds, else raise."""
    lowest = "0 or more" if allow_zero else "more than 0"
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(max(min(value, maximum + 1), -1))  # ints too large for floats
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


def check_id(name: str, value: int) -> int:
    """A task's or a batch's id: a whole number the database's ids can hold."""
    return check_count(name, value, maximum=MAX_ID)


def check_iterable(name: str, value: Iterable[Any], of: str) -> Iterable[Any]:
    """``value`` if it is an iterable of items (a list, a generator), not one item whose
    characters or keys would be taken for the items."""
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise ConfigurationError(
            f"{name} must be an iterable of {of} (a list or a generator), "
            f"got {type(value).__name__}"
        )
    return value


def storable(text: str) -> bool:
    """Whether PostgreSQL can store ``text`` in a text column: no NUL character, which
    text cannot hold, and no lone surrogate, which has no UTF-8 form."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_queue(queue: str) -> str:
    """A queue name: not blank, at most 200 characters, storable (see storable)."""
    if not isinstance(queue, str) or not queue.strip() or len(queue) > 200 or not storable(queue):
        raise ConfigurationError(
            "queue must be a non-empty name of up to 200 characters, without NUL or lone "
            f"surrogates, got {_shown(queue)}"
        )
    return queue


def check_worker_id(worker_id: str | None) -> str | None:
    """A worker's id, stored on the tasks it claims: a non-empty string of at most
    MAX_KEY_LENGTH characters, storable (see storable), or None for the default."""
    return check_key(worker_id, "worker_id")


def check_priority(priority: int) -> int:
    """A priority: a whole number the server holds in 32 bits."""
    if not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > MAX_ROWS:
        raise ConfigurationError(f"priority must be a whole number within ±2**31, got {priority!r}")
    return priority


def check_key(key: str | None, name: str = "idempotency_key") -> str | None:
    """A key (an idempotency key, an attempt's key): a non-empty string of at most
    MAX_KEY_LENGTH characters, storable (see storable), or None."""
    if key is not None and (
        not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH or not storable(key)
    ):
        raise ConfigurationError(
            f"{name} must be a non-empty string of up to {MAX_KEY_LENGTH} characters without "
            f"NUL or lone surrogates, got {_shown(key)}"
        )
    return key


def check_limit(max_running: int | None) -> int | None:
    """A concurrency limit: a whole number of tasks, 0 (hold every task back) or more."""
    if max_running is not None and (
        not isinstance(max_running, int)
        or isinstance(max_running, bool)
        or not 0 <= max_running <= MAX_ROWS
    ):
        raise ConfigurationError(
            f"max_running must be a whole number from 0 to {MAX_ROWS}, or None to remove "
            f"the limit, got {_shown(max_running)}"
        )
    return max_running


def check_rate(per_second: float | None, burst: float | None) -> tuple[float | None, float | None]:
    """A token bucket: a rate above 0 per second and a burst of 1 or more (by default one
    second's worth, at least 1), or no rate (and no burst) to remove it."""
    if per_second is None:
        if burst is not None:
            raise ConfigurationError("burst needs a rate: give per_second too")
        return None, None
    if not _positive_number(per_second):
        raise ConfigurationError(
            f"per_second must be a number above 0, or None to remove the limit, "
            f"got {_shown(per_second)}"
        )
    if burst is None:
        burst = max(1.0, float(per_second))
    if not _positive_number(burst) or burst < 1:
        raise ConfigurationError(f"burst must be a number of 1 or more, got {_shown(burst)}")
    return float(per_second), float(burst)


def _positive_number(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def check_batch_name(name: str | None) -> str | None:
    """A batch name: as a key (see check_key), and not blank, or None."""
    if isinstance(name, str) and name and not name.strip():
        raise ConfigurationError(f"a batch name must not be blank, got {_shown(name)}")
    return check_key(name, "a batch name")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_lease_seconds(value: float | None) -> float | None:
    """A lease length in seconds, at most MAX_LEASE_SECONDS, or None."""
    if value is None:
        return None
    return check_seconds("lease_seconds", value, maximum=MAX_LEASE_SECONDS)


def check_run_at(run_at: datetime | None, delay: float | None) -> datetime | None:
    """A timezone-aware time to run at, given without a delay, or None."""
    if run_at is None:
        return None
    if delay is not None:
        raise ConfigurationError("give run_at or delay, not both")
    if not isinstance(run_at, datetime) or run_at.tzinfo is None:
        raise ConfigurationError(
            "run_at must be a timezone-aware datetime, for example datetime.now(timezone.utc)"
        )
    return run_at


def validate_schema_name(name: str) -> str:
    """Return ``name`` if it is a safe PostgreSQL schema name, else raise ConfigurationError."""
    if not isinstance(name, str) or not SCHEMA_NAME_PATTERN.match(name):
        raise ConfigurationError(
            f"schema name {name!r} is not allowed: use 1 to 63 lowercase ASCII letters, "
            "digits or underscores, starting with a letter or underscore (for example 'leasequeue')"
        )
    return name
