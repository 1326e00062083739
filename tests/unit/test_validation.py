"""Argument checks: every bad value is a ConfigurationError that names what to fix."""

from __future__ import annotations

import math

import pytest

from dagster_leasequeue import ConfigurationError
from dagster_leasequeue.attempts import attempt_target
from dagster_leasequeue.validation import (
    MAX_KEY_LENGTH,
    check_batch_name,
    check_key,
    check_seconds,
)


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


@pytest.mark.parametrize("name", ["", "   ", "a\x00b", "x" * 401, 5])
def test_a_batch_name_is_refused_before_anything_is_written(name: object) -> None:
    with pytest.raises(ConfigurationError, match="batch name"):
        check_batch_name(name)  # type: ignore[arg-type]


def test_a_batch_name_may_be_none_or_any_key() -> None:
    assert check_batch_name(None) is None
    assert check_batch_name("document_batch:run-1") == "document_batch:run-1"
