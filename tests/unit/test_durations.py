"""Durations as the command line reads them (``--older-than 7d``, ``1h30m``)."""

from __future__ import annotations

import pytest

from dagster_leasequeue.cli_format import parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30),
        ("15m", 900),
        ("12h", 43200),
        ("7d", 604800),
        ("1h30m", 5400),
        ("1.5h", 5400),
        ("90", 90),
        (" 2D ", 172800),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7x", "h", "-5m", "1h-", "one day"])
def test_parse_duration_refuses_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)
