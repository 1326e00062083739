"""Attempts whose work runs REPEATABLE READ or SERIALIZABLE.

Under those levels a row that another transaction changed after the work's snapshot cannot
be updated: the lease's renewal changes the task's row, and every claim and finish of a
key's tasks changes the key's row. The attempt still concludes: its effects and its success
mark commit, and the ack follows in a transaction of its own.
"""

from __future__ import annotations

from typing import Any

import pytest

from dagster_leasequeue import (
    Attempt,
    Lease,
    LeaseLost,
    LeaseQueue,
    migrations,
)

from ..helpers import break_the_session_reset, expire, install_as_of, on_claiming, run_sql

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


@pytest.mark.parametrize("claim_next", [False, True], ids=["alone", "claim_next"])
@pytest.mark.parametrize("level", LEVELS)
def test_an_attempt_concludes_after_its_lease_was_renewed_during_its_work(
    results: LeaseQueue, level: str, claim_next: bool
) -> None:
    queue = results
    first, second = queue.enqueue_many([{"doc": "a"}, {"doc": "b"}])
    lease = _claim(queue)
    with lease, queue.attempt(lease=lease, claim_next=claim_next) as attempt:
        _begin_work(queue, attempt, level, "a")
        lease.renew()  # what the lease's renewal thread does while the work runs
        attempt.result = {"pages": 1}
    assert _documents(queue) == ["a"]
    info = queue.get(first)
    assert (info.status, info.result) == ("done", {"pages": 1})
    assert [r.outcome for r in queue.attempts(task_id=first)] == ["succeeded"]
    if claim_next:
        assert attempt.claimed is not None and attempt.claimed.task_id == second
    else:
        assert attempt.claimed is None


@pytest.mark.parametrize("claim_next", [False, True], ids=["alone", "claim_next"])
@pytest.mark.parametrize("level", LEVELS)
def test_an_attempt_on_a_keyed_task_concludes_when_its_key_changed_during_its_work(
    results: LeaseQueue, level: str, claim_next: bool
) -> None:
    queue = results
    first, second, third = queue.enqueue_many(
        [{"doc": "a"}, {"doc": "b"}, {"doc": "c"}], concurrency_key="customer-17"
    )
    lease = _claim(queue)
    with queue.attempt(lease=lease, claim_next=claim_next) as attempt:
        _begin_work(queue, attempt, level, "a")
        other = _claim(queue)  # the key's running count changes after the work's snapshot
        assert other.task_id == second
    assert _documents(queue) == ["a"]
    assert queue.get(first).status == "done"
    running = "SELECT running FROM {schema}.flow_keys WHERE key = 'customer-17'"
    if claim_next:
        assert attempt.claimed is not None and attempt.claimed.task_id == third
        assert run_sql(queue, running) == [(2,)]
        attempt.claimed.ack()
    else:
        assert run_sql(queue, running) == [(1,)]
    other.ack()
    assert run_sql(queue, running) == [(0,)]


@pytest.mark.parametrize("taken", ["swept and claimed", "swept dead", "cancelled"])
@pytest.mark.parametrize("level", LEVELS)
def test_an_attempt_whose_lease_was_taken_during_its_work_writes_nothing(
    results: LeaseQueue, level: str, taken: str
) -> None:
    # The snapshot still shows the lease; the sweep or the cancel wrote the attempt's record
    # after it, so the success mark fails and the work rolls back, as under READ COMMITTED.
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


@pytest.mark.parametrize("level", LEVELS)
def test_an_attempt_marked_abandoned_by_another_start_is_fenced_too(
    results: LeaseQueue, level: str
) -> None:
    # Another attempt of the same work started (and gave up) before this one's work took its
    # snapshot: this one's record reads 'abandoned', and the sweep must fence it all the same.
    queue = results
    task_id = queue.enqueue({"doc": "a"})
    lease = _claim(queue)
    with (
        pytest.raises(LeaseLost, match="nothing was changed"),
        queue.attempt(key="doc-a", lease=lease) as attempt,
    ):
        with pytest.raises(RuntimeError), queue.attempt(key="doc-a"):
            raise RuntimeError("the other attempt gives up")
        _begin_work(queue, attempt, level, "a")
        expire(queue, task_id)
        queue.sweep()
    assert _documents(queue) == []


@pytest.mark.parametrize("level", LEVELS)
def test_a_duplicate_whose_lease_was_taken_during_its_work_writes_nothing(
    results: LeaseQueue, level: str
) -> None:
    # A duplicate makes no success mark that could fence it: the conflict of its ack is
    # raised instead, and its writes roll back with it.
    queue = results
    earlier = queue.enqueue({"doc": "a"}, idempotency_key="doc-a")
    with queue.attempt(lease=_claim(queue)):
        pass
    assert queue.get(earlier).status == "done"
    task_id = queue.enqueue({"doc": "a"}, idempotency_key="doc-a")
    lease = _claim(queue)
    with (
        pytest.raises(LeaseLost, match="nothing was changed"),
        queue.attempt(lease=lease) as attempt,
    ):
        assert attempt.duplicate
        _begin_work(queue, attempt, level, "a")  # a duplicate's own bookkeeping, say
        expire(queue, task_id)
        queue.sweep()
    assert _documents(queue) == []
    assert queue.get(task_id).status == "enqueued"


def test_a_pending_ack_is_made_when_the_session_reset_after_the_commit_fails(
    results: LeaseQueue,
) -> None:
    # The reset that follows the commit fails and the connection is closed: the ack left
    # undone by the commit goes out on another connection.
    queue = results
    first, second = queue.enqueue_many([{"doc": "a"}, {"doc": "b"}])
    lease = _claim(queue)
    break_the_session_reset(queue)
    with queue.attempt(lease=lease, claim_next=True) as attempt:
        _begin_work(queue, attempt, "REPEATABLE READ", "a")
        lease.renew()
    assert lease.finished and attempt.claimed is None
    assert queue.get(first).status == "done" and queue.get(second).status == "enqueued"
    assert [r.outcome for r in queue.attempts(task_id=first)] == ["succeeded"]


@pytest.mark.parametrize("level", LEVELS)
def test_an_attempt_whose_next_claim_fails_after_its_commit_still_acks(
    results: LeaseQueue, level: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A keyed task's claim_next runs after the commit, in the same round trip; when it
    # fails, the attempt asks whether its commit went through: its success mark says so,
    # though the ack it left undone has not been made yet.
    queue = results
    on_claiming(queue, "boom", "RAISE EXCEPTION 'this task cannot be claimed'")
    first, boom = queue.enqueue_many([{"doc": "a"}, {"boom": True}], concurrency_key="k")
    lease = _claim(queue)
    with queue.attempt(lease=lease, claim_next=True) as attempt:
        _begin_work(queue, attempt, level, "a")
        lease.renew()
    assert attempt.claimed is None
    assert "the claim of the next task after it failed" in caplog.text
    assert queue.get(first).status == "done" and queue.get(boom).status == "enqueued"
    assert [r.outcome for r in queue.attempts(task_id=first)] == ["succeeded"]
    assert _documents(queue) == ["a"]


def test_an_upgrade_indexes_the_running_attempts_without_stopping_the_queue(
    make_queue: Any,
) -> None:
    queue = make_queue()
    install_as_of(queue, 24)
    queue.enqueue({"doc": "a"})
    assert queue.install() == len(migrations.MIGRATIONS) - 24
    (definition,) = run_sql(
        queue,
        "SELECT pg_get_indexdef(i.indexrelid) || ' ' || i.indisvalid FROM pg_index AS i "
        "WHERE i.indexrelid = '{schema}.attempts_unfinished_task_idx'::regclass",
    )
    assert "WHERE (outcome = ANY (ARRAY['running'::text, 'abandoned'::text])) true" in definition[0]
