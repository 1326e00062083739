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
    check_queue,
    check_seconds,
    check_worker_id,
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


# Text PostgreSQL cannot store: a NUL, and a lone surrogate (no UTF-8 form). Refused where
# it is given, with the argument's name, instead of a database or encoding error.
UNSTORABLE = ["a\x00b", "a\udcffb"]


@pytest.mark.parametrize("text", UNSTORABLE)
def test_text_the_database_cannot_store_is_refused_with_the_arguments_name(text: str) -> None:
    with pytest.raises(ConfigurationError, match=r"^queue must be .*without NUL or lone"):
        check_queue(text)
    with pytest.raises(ConfigurationError, match=r"^concurrency_key must be .*lone surrogates"):
        check_key(text, "concurrency_key")
    with pytest.raises(ConfigurationError, match=r"^worker_id must be .*lone surrogates"):
        check_worker_id(text)


@pytest.mark.parametrize("worker_id", ["", 7, "w" * (MAX_KEY_LENGTH + 1)])
def test_a_worker_id_is_a_short_non_empty_string(worker_id: object) -> None:
    with pytest.raises(ConfigurationError, match=r"^worker_id must be"):
        check_worker_id(worker_id)  # type: ignore[arg-type]
    assert check_worker_id(None) is None
    assert check_worker_id("host:42") == "host:42"
