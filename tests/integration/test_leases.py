"""Fencing, renewal, fail and backoff, the sweeper and the recovery-event log."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from dagster_leasequeue import Lease, LeaseLost, LeaseQueue, sql

from ..helpers import expire, run_sql


def claim_one(queue: LeaseQueue, **kwargs: object):  # type: ignore[no-untyped-def]
    lease = queue.claim(**kwargs)  # type: ignore[arg-type]
    assert lease is not None
    return lease


# -- fencing -------------------------------------------------------------------------------


def test_ack_stores_the_result(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    claim_one(queue).ack({"pages": 2})
    info = queue.get(task_id)
    assert info.status == "done" and info.result == {"pages": 2}
    assert info.finished_at is not None and info.lease_expires_at is None


def test_a_swept_lease_cannot_ack_fail_or_renew(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    stale = claim_one(queue)
    expire(queue, task_id)
    assert [r.task_id for r in queue.sweep()] == [task_id]
    for action in (stale.ack, lambda: stale.fail("late"), stale.renew):
        with pytest.raises(LeaseLost, match="expired and the task was recovered"):
            action()
    info = queue.get(task_id)
    assert info.status == "enqueued" and info.attempts == 1


def test_a_reclaimed_task_refuses_the_old_token(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    stale = claim_one(queue)
    expire(queue, task_id)
    queue.sweep()
    fresh = claim_one(queue)
    assert fresh.token != stale.token and fresh.attempt == 2
    for action in (stale.ack, lambda: stale.fail("late"), stale.renew):
        with pytest.raises(LeaseLost, match=f"claimed again under token {fresh.token}"):
            action()
    assert queue.get(task_id).status == "processing"
    fresh.ack({"by": "fresh"})
    assert queue.get(task_id).result == {"by": "fresh"}


def test_a_cancelled_task_refuses_its_holder(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    lease = claim_one(queue)
    queue.cancel(task_id)
    with pytest.raises(LeaseLost):
        lease.ack()
    assert queue.get(task_id).status == "cancelled"


def test_an_expired_but_unswept_lease_still_fences_by_token(queue: LeaseQueue) -> None:
    # No one else can hold the task until a sweep, so the holder may still finish it.
    task_id = queue.enqueue({"n": 1})
    lease = claim_one(queue)
    expire(queue, task_id)
    lease.ack()
    assert queue.sweep() == []
    assert queue.get(task_id).status == "done"


def test_a_lease_concludes_once(queue: LeaseQueue) -> None:
    queue.enqueue({"n": 1})
    lease = claim_one(queue)
    lease.ack()
    with pytest.raises(LeaseLost, match="already acked"):
        lease.ack()
    with pytest.raises(LeaseLost, match="already acked"):
        lease.renew()


def test_renew_extends_from_the_database_clock(queue: LeaseQueue) -> None:
    queue.enqueue({"n": 1})
    lease = claim_one(queue, lease_seconds=5)
    first = lease.expires_at
    new_expiry = lease.renew(60)
    db_now = run_sql(queue, "SELECT clock_timestamp()")[0][0]
    assert new_expiry > first
    assert timedelta(seconds=59) < new_expiry - db_now <= timedelta(seconds=60)
    with pytest.raises(ValueError):
        lease.renew(0)


def test_claim_in_an_old_transaction_gets_its_full_lease(queue: LeaseQueue) -> None:
    queue.enqueue({"n": 1})
    with queue._driver.connection() as conn, conn.transaction():
        began = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        time.sleep(1.2)
        claimed = conn.execute(
            sql.compose_claim(queue.schema, 1),
            {
                "queue": "default",
                "worker_id": "old-tx",
                "lease_seconds": 10,
                "default_lease": 10,
            },
        )
        columns = [column.name for column in claimed.description or ()]
        row = claimed.fetchone()
        assert row is not None
        assert row[columns.index("lease_expires_at")] - began >= timedelta(seconds=11)


# -- fail, backoff, dead --------------------------------------------------------------------


def test_fail_retries_with_backoff_then_dies(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1}, max_attempts=3)
    delays = []
    for attempt in (1, 2):
        lease = claim_one(queue)
        assert lease.attempt == attempt
        before = run_sql(queue, "SELECT clock_timestamp()")[0][0]
        assert lease.fail(ValueError("bad page")) == "enqueued"
        info = queue.get(task_id)
        delays.append((info.run_at - before).total_seconds())
        assert info.last_error == "ValueError: bad page"
        run_sql(queue, "UPDATE {schema}.tasks SET run_at = clock_timestamp()")
    # base 0.5: attempt 1 waits 0.25..0.5 s, attempt 2 waits 0.5..1 s.
    assert 0.2 <= delays[0] <= 0.55 and 0.45 <= delays[1] <= 1.05
    lease = claim_one(queue)
    assert lease.fail("still bad") == "dead"
    info = queue.get(task_id)
    assert info.status == "dead" and info.attempts == 3 and info.finished_at is not None
    assert queue.claim() is None


def test_backoff_is_capped(make_queue) -> None:  # type: ignore[no-untyped-def]
    queue = make_queue(retry_backoff_base=10, retry_backoff_cap=30)
    assert all(15 <= queue._driver.retry_delay(n) <= 30 for n in (3, 10, 1000))
    assert 5 <= queue._driver.retry_delay(1) <= 10


def test_retry_in_overrides_backoff(queue: LeaseQueue) -> None:
    queue.enqueue({"n": 1})
    claim_one(queue).fail("later", retry_in=0)
    claim_one(queue).fail("later", retry_in=3600)
    assert queue.claim() is None


def test_sweeper_kills_a_task_that_used_its_attempts(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1}, max_attempts=2)
    actions = []
    for _ in range(2):
        claim_one(queue)
        expire(queue, task_id)
        actions += [r.action for r in queue.sweep()]
    assert actions == ["requeued", "dead"]
    info = queue.get(task_id)
    assert info.status == "dead" and "lease expired" in (info.last_error or "")
    assert queue.claim() is None


# -- the context manager ----------------------------------------------------------------------


def test_context_manager_acks(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    with claim_one(queue) as lease:
        assert lease.payload == {"n": 1}
    assert queue.get(task_id).status == "done"


def test_context_manager_fails_and_reraises(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    with pytest.raises(RuntimeError, match="corrupt"), claim_one(queue):
        raise RuntimeError("corrupt pdf")
    info = queue.get(task_id)
    assert info.status == "enqueued" and info.last_error == "RuntimeError: corrupt pdf"


def test_context_manager_keeps_an_explicit_ack(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    with claim_one(queue) as lease:
        lease.ack({"explicit": True})
    assert queue.get(task_id).result == {"explicit": True}


def test_context_manager_renews_a_long_task(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    with claim_one(queue, lease_seconds=0.6) as lease:
        first = lease.expires_at
        for _ in range(8):  # 1.6 s: well past the first lease
            time.sleep(0.2)
            assert queue.sweep() == []
        assert lease.expires_at > first and not lease.lost
    assert queue.get(task_id).status == "done"


def test_background_renewal_notices_a_lost_lease(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    with pytest.raises(LeaseLost), claim_one(queue, lease_seconds=0.6) as lease:
        queue.cancel(task_id)
        deadline = time.monotonic() + 3
        while not lease.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lease.lost
        lease.raise_if_lost()
    assert queue.get(task_id).status == "cancelled"


# -- the sweeper -------------------------------------------------------------------------------


def test_sweep_recovers_only_expired_leases(queue: LeaseQueue) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(4)])
    leases = queue.claim_many(4, worker_id="w-9")
    expire(queue, ids[0], ids[2])
    recovered = queue.sweep()
    assert sorted(r.task_id for r in recovered) == [ids[0], ids[2]]
    assert {(r.action, r.attempt, r.worker_id) for r in recovered} == {("requeued", 1, "w-9")}
    assert [queue.get(i).status for i in ids] == ["enqueued", "processing"] * 2
    assert queue.sweep() == []
    # A recovered task is claimable at once.
    assert {lease.task_id for lease in queue.claim_many(10)} == {ids[0], ids[2]}
    assert len(leases) == 4


def test_sweep_with_a_limit_and_in_batches(make_queue) -> None:  # type: ignore[no-untyped-def]
    queue = make_queue(sweep_batch_size=7)
    queue.install()
    ids = queue.enqueue_many([{"n": n} for n in range(50)])
    queue.claim_many(50)
    expire(queue, *ids)
    assert len(queue.sweep(limit=10)) == 10
    assert len(queue.sweep()) == 40
    assert queue.stats().counts["enqueued"] == 50


def test_concurrent_sweepers_recover_each_expiry_once(make_queue) -> None:  # type: ignore[no-untyped-def]
    queue = make_queue(sweep_batch_size=25, pool_size=8)
    queue.install()
    ids = queue.enqueue_many([{"n": n} for n in range(600)])
    queue.claim_many(600)
    expire(queue, *ids)
    start = threading.Barrier(4)

    def sweeper(_: int) -> list[int]:
        start.wait()
        return [r.task_id for r in queue.sweep()]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(sweeper, range(4)))
    recovered = [task_id for batch in results for task_id in batch]
    assert sorted(recovered) == ids
    events = queue.recovery_events(limit=10_000)
    assert sorted(e.task_id for e in events) == ids
    assert [e.id for e in events] == sorted(e.id for e in events)


def test_recovery_events_are_read_by_cursor(queue: LeaseQueue) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(3)], max_attempts=1)
    queue.claim_many(3, worker_id="w-1")
    expire(queue, *ids)
    queue.sweep()
    events = queue.recovery_events()
    assert [e.task_id for e in events] == ids
    assert {e.action for e in events} == {"dead"}
    assert all(e.worker_id == "w-1" and e.seconds_overdue >= 1 for e in events)
    assert queue.recovery_events(after_id=events[0].id) == events[1:]
    assert queue.recovery_events(after_id=events[-1].id) == []
    assert queue.recovery_events(limit=2) == events[:2]


def test_recovery_events_commit_in_id_order(make_queue) -> None:  # type: ignore[no-untyped-def]
    """A reader polling by cursor during concurrent sweeps never skips an event."""
    queue = make_queue(sweep_batch_size=5, pool_size=10)
    queue.install()
    total = 400
    seen: list[int] = []
    done = threading.Event()

    def reader() -> None:
        cursor = 0
        while True:
            finished = done.is_set()
            events = queue.recovery_events(after_id=cursor)
            seen.extend(e.task_id for e in events)
            if events:
                cursor = events[-1].id
            elif finished:
                return

    def produce_and_sweep(worker: int) -> None:
        for _ in range(total // 40):
            queue.enqueue_many([{"w": worker}] * 10, queue=f"q{worker}")
            leases = queue.claim_many(10, queue=f"q{worker}")
            expire(queue, *(lease.task_id for lease in leases))
            queue.sweep()

    reading = threading.Thread(target=reader)
    reading.start()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(produce_and_sweep, range(4)))
    done.set()
    reading.join()
    assert len(seen) == total
    assert sorted(seen) == sorted(e.task_id for e in queue.recovery_events(limit=10_000))


def test_a_lease_that_cannot_be_renewed_lapses(queue: LeaseQueue) -> None:
    from dagster_leasequeue.connection import SharedConnection

    queue.enqueue({"n": 1})
    lease = claim_one(queue, lease_seconds=0.6)
    # The database becomes unreachable for renewals only.
    queue._driver._renewals = SharedConnection(
        "postgresql://127.0.0.1:1/none", {"connect_timeout": 2}, round_trip_bound=1.0
    )
    with pytest.raises(LeaseLost), lease:
        deadline = time.monotonic() + 10
        while not lease.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        lease.raise_if_lost()


def test_release_gives_the_task_back_without_using_an_attempt(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1}, max_attempts=1)
    lease = claim_one(queue)
    lease.release()
    info = queue.get(task_id)
    assert (info.status, info.attempts, info.lease_expires_at) == ("enqueued", 0, None)
    again = claim_one(queue)
    assert again.task_id == task_id and again.attempt == lease.attempt == 1
    with pytest.raises(LeaseLost, match="cannot release"):
        lease.release()  # the old token: fenced like ack
    again.ack()
    assert queue.get(task_id).status == "done"


def test_release_with_a_delay_snoozes_the_task(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    lease = claim_one(queue)
    lease.release(delay=60)
    assert queue.claim() is None
    waits = run_sql(
        queue,
        "SELECT run_at - clock_timestamp() FROM {schema}.tasks WHERE id = %(id)s",
        {"id": task_id},
    )[0][0]
    assert timedelta(seconds=58) < waits <= timedelta(seconds=60)
    with pytest.raises(ValueError, match="delay"):
        claim_one_later(queue, task_id).release(delay=-1)


def claim_one_later(queue: LeaseQueue, task_id: int) -> Lease:
    run_sql(
        queue,
        "UPDATE {schema}.tasks SET run_at = clock_timestamp() WHERE id = %(id)s",
        {"id": task_id},
    )
    return claim_one(queue)


def test_release_inside_the_lease_block_ends_it_quietly(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    with claim_one(queue) as lease:
        lease.release()
    assert queue.get(task_id).status == "enqueued"
    with pytest.raises(LeaseLost, match="already released"):
        lease.ack()


def test_a_stuck_renewal_never_holds_up_another_leases_renewal(dsn: str, queue: LeaseQueue) -> None:
    import psycopg

    first, second = queue.enqueue_many([{"n": 1}, {"n": 2}])
    leases = {lease.task_id: lease for lease in queue.claim_many(2, lease_seconds=8)}
    with psycopg.connect(dsn) as holder:
        # The first lease's row is locked: its renewal waits on the shared connection.
        holder.execute(f'SELECT 1 FROM "{queue.schema}".tasks WHERE id = %s FOR UPDATE', (first,))
        stuck = threading.Thread(target=leases[first].renew)
        stuck.start()
        time.sleep(0.3)
        other = threading.Thread(target=leases[second].renew)
        other.start()
        other.join(timeout=2.5)
        renewed_meanwhile = not other.is_alive()  # not only once the first is let go
        holder.commit()
    stuck.join(timeout=10)
    other.join(timeout=10)
    assert renewed_meanwhile
    for lease in leases.values():
        lease.ack()
