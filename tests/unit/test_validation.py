"""Argument checks: every bad value is a ConfigurationError that names what to fix."""

from __future__ import annotations

import math

import pytest

from dagster_leasequeue import ConfigurationError
from dagster_leasequeue.attempts import attempt_target
from dagster_leasequeue.validation import MAX_KEY_LENGTH, check_key, check_seconds


@pytest.mark.parametrize("value", [10**400, -(10**400), math.inf, -math.inf, math.nan, -1, True])
def test_seconds_out_of_bounds_are_refused(value: float) -> None:
    with pytest.raises(ConfigurationError, match="delay must be"):
        check_seconds("delay", value)


def test_keys_fit_the_index() -> None:
    assert check_key("k" * MAX_KEY_LENGTH) == "k" * MAX_KEY_LENGTH
    with pytest.raises(ConfigurationError, match=f"up to {MAX_KEY_LENGTH} characters"):
        check_key("k" * (MAX_KEY_LENGTH + 1))
    with pytest.raises(ConfigurationError, match="an attempt's key"):
        attempt_target("é" * (MAX_KEY_LENGTH + 1), None)
