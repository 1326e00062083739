"""The worker's waits while the database is unreachable."""

from __future__ import annotations

import logging

from dagster_leasequeue.errors import DatabaseUnavailable
from dagster_leasequeue.worker import MAX_OUTAGE_WAIT, _Outage


def test_the_wait_doubles_up_to_its_cap_and_starts_over_once_the_database_answers() -> None:
    outage = _Outage(logging.getLogger("tests.outage"), poll_interval=1.0)
    down = DatabaseUnavailable("down")
    waits = [outage.failed(down) for _ in range(8)]
    assert waits == [1, 2, 4, 8, 16, MAX_OUTAGE_WAIT, MAX_OUTAGE_WAIT, MAX_OUTAGE_WAIT]
    outage.ended()
    assert outage.failed(down) == 1


def test_a_poll_interval_above_the_cap_is_kept() -> None:
    outage = _Outage(logging.getLogger("tests.outage"), poll_interval=60.0)
    down = DatabaseUnavailable("down")
    assert [outage.failed(down) for _ in range(3)] == [60, 60, 60]
