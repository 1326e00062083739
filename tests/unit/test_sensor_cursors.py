"""The sweeper sensor's cursor: read as stored, and started over when it cannot be read."""

from __future__ import annotations

import pytest

from dagster_leasequeue.dagster.sensors import _read_cursor


@pytest.mark.parametrize(
    "cursor",
    [
        "1e999",
        '"ab"',
        "[1]",
        "true",
        '{"event": true, "queues": []}',
        '{"event": 3, "queues": "ab"}',
        '{"event": 3}',
        "not json",
    ],
)
def test_an_unreadable_sensor_cursor_starts_over(cursor: str) -> None:
    assert _read_cursor(cursor) == (0, set())


def test_sensor_cursors_are_read() -> None:
    assert _read_cursor(None) == (0, set())
    assert _read_cursor("17") == (17, set())
    assert _read_cursor('{"event": 17, "queues": ["a", "b"]}') == (17, {"a", "b"})
