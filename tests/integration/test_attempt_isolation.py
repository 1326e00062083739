"""Attempts whose work runs REPEATABLE READ or SERIALIZABLE.

Under those levels a row that another transaction changed after the work's snapshot cannot
be updated, and the snapshot still shows the lease as it was: the fenced ack meets a
conflict whether the lease was taken (a sweep, a cancel) or only renewed. The conclusion
fails either way, writing nothing; a caller whose lease is gone is told LeaseLost.
"""

from __future__ import annotations

import pytest

from dagster_leasequeue import Attempt, Lease, LeaseLost, LeaseQueue, LeaseQueueError

from ..helpers import expire, run_sql

LEVELS = ["REPEATABLE READ", "SERIALIZABLE"]


@pytest.fixture
def results(queue: LeaseQueue) -> LeaseQueue:
    run_sql(queue, "CREATE TABLE {schema}.results (doc text PRIMARY KEY)")
    return queue


def _begin_work(queue: LeaseQueue, attempt: Attempt, level: str, doc: str) -> None:
    """The work's first statements: its isolation level, then its effect (the snapshot)."""
    attempt.connection.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
    attempt.connection.execute(f'INSERT INTO "{queue.schema}".results VALUES (%s)', (doc,))


def _documents(queue: LeaseQueue) -> list[str]:
    return [row[0] for row in run_sql(queue, "SELECT doc FROM {schema}.results ORDER BY doc")]


def _claim(queue: LeaseQueue) -> Lease:
    lease = queue.claim()
    assert lease is not None
    return lease


@pytest.mark.parametrize("taken", ["swept and claimed", "swept dead", "cancelled"])
@pytest.mark.parametrize("level", LEVELS)
def test_an_attempt_whose_lease_was_taken_during_its_work_writes_nothing(
    results: LeaseQueue, level: str, taken: str
) -> None:
    queue = results
    task_id = queue.enqueue({"doc": "a"}, max_attempts=1 if taken == "swept dead" else 3)
    stale = _claim(queue)
    with pytest.raises(LeaseLost, match="nothing was changed"), queue.attempt(lease=stale) as a:
        _begin_work(queue, a, level, "a")
        if taken == "cancelled":
            assert queue.cancel(task_id)
        else:
            expire(queue, task_id)
            queue.sweep()
    assert _documents(queue) == []
    assert [r.outcome for r in queue.attempts(task_id=task_id)] == ["failed"]
    if taken != "swept and claimed":
        assert queue.get(task_id).status == {"swept dead": "dead", "cancelled": "cancelled"}[taken]
        return
    fresh = _claim(queue)
    with queue.attempt(lease=fresh) as attempt:
        assert not attempt.duplicate
        _begin_work(queue, attempt, level, "a")
    assert queue.get(task_id).status == "done" and _documents(queue) == ["a"]


@pytest.mark.parametrize("change", ["renewed", "key claimed"])
@pytest.mark.parametrize("level", LEVELS)
def test_an_attempt_whose_rows_changed_during_its_work_is_rolled_back_and_retried(
    results: LeaseQueue, level: str, change: str
) -> None:
    # The lease still held: the conflict is raised as one to retry, and the task, given
    # back as failed, runs again.
    queue = results
    first, second = queue.enqueue_many([{"doc": "a"}, {"doc": "b"}], concurrency_key="k")
    lease = _claim(queue)
    with (
        pytest.raises(LeaseQueueError, match="conflict") as raised,
        lease,
        queue.attempt(lease=lease) as attempt,
    ):
        _begin_work(queue, attempt, level, "a")
        if change == "renewed":
            lease.renew()
        else:
            assert _claim(queue).task_id == second
    assert not isinstance(raised.value, LeaseLost)
    assert _documents(queue) == []
    info = queue.get(first)
    assert (info.status, info.attempts) == ("enqueued", 1)
    assert [r.outcome for r in queue.attempts(task_id=first)] == ["failed"]
