"""Enqueue, claim order, scheduling, idempotency keys, inspection and steering."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import psycopg
import pytest

from dagster_leasequeue import (
    ConfigurationError,
    LeaseQueue,
    LeaseQueueError,
    SchemaNotInstalled,
    TaskNotFound,
    migrations,
    schema as schema_module,
)
from dagster_leasequeue.models import LIVE

from ..helpers import install_as_of, run_sql, start_blocked


def drain(queue: LeaseQueue, name: str = "default") -> list[int]:
    order = []
    while (lease := queue.claim(queue=name)) is not None:
        order.append(lease.payload["n"])
        lease.ack()
    return order


def test_claim_order_is_priority_then_fifo(queue: LeaseQueue) -> None:
    for n, priority in [(1, 0), (2, 5), (3, 0), (4, 5), (5, -1)]:
        queue.enqueue({"n": n}, priority=priority)
    assert drain(queue) == [2, 4, 1, 3, 5]


def test_enqueue_many_keeps_order_and_returns_ids(queue: LeaseQueue) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(2000)], queue="bulk", max_attempts=2)
    assert len(ids) == 2000 and ids == sorted(ids)
    assert queue.get(ids[17]).payload == {"n": 17}
    assert queue.get(ids[17]).max_attempts == 2
    assert drain(queue, "bulk")[:5] == [0, 1, 2, 3, 4]
    assert queue.enqueue_many([]) == []


def test_queues_are_separate(queue: LeaseQueue) -> None:
    queue.enqueue({"n": 1}, queue="a")
    assert queue.claim(queue="b") is None
    lease = queue.claim(queue="a")
    assert lease is not None and lease.queue == "a"
    assert queue.queues() == ["a"]


def test_delay_and_run_at_hold_a_task_back(queue: LeaseQueue) -> None:
    queue.enqueue({"n": 1}, delay=0.6)
    queue.enqueue({"n": 2}, run_at=datetime.now(timezone.utc) + timedelta(hours=1))
    assert queue.claim() is None
    time.sleep(0.7)
    assert drain(queue) == [1]
    with pytest.raises(ConfigurationError, match="timezone-aware"):
        queue.enqueue({"n": 3}, run_at=datetime.now())
    with pytest.raises(ConfigurationError, match="not both"):
        queue.enqueue({"n": 3}, run_at=datetime.now(timezone.utc), delay=1)


def test_a_due_run_at_in_the_past_is_claimable(queue: LeaseQueue) -> None:
    queue.enqueue({"n": 1}, run_at=datetime.now(timezone.utc) - timedelta(minutes=5))
    assert drain(queue) == [1]


def test_lease_fields(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1}, priority=3, idempotency_key="k1", lease_seconds=12)
    lease = queue.claim(worker_id="w-1")
    assert lease is not None
    assert (lease.task_id, lease.queue, lease.payload, lease.priority) == (
        task_id,
        "default",
        {"n": 1},
        3,
    )
    assert (lease.attempt, lease.worker_id, lease.idempotency_key) == (1, "w-1", "k1")
    assert lease.lease_seconds == 12
    db_now = run_sql(queue, "SELECT clock_timestamp()")[0][0]
    assert timedelta(seconds=11) < lease.expires_at - db_now <= timedelta(seconds=12)
    info = queue.get(task_id)
    assert info.status == "processing" and info.worker_id == "w-1" and info.attempts == 1


def test_claim_lease_seconds_overrides_the_task_and_the_default(queue: LeaseQueue) -> None:
    queue.enqueue({"n": 1}, lease_seconds=100)
    lease = queue.claim(lease_seconds=7)
    assert lease is not None and lease.lease_seconds == 7
    queue.enqueue({"n": 2})
    lease = queue.claim()
    assert lease is not None and lease.lease_seconds == queue.settings.lease_seconds


def test_token_is_new_and_increasing_for_every_claim(queue: LeaseQueue) -> None:
    queue.enqueue({"n": 1})
    tokens = []
    for _ in range(3):
        lease = queue.claim()
        assert lease is not None
        tokens.append(lease.token)
        lease.fail("again", retry_in=0)
    assert tokens == sorted(set(tokens)) and len(tokens) == 3


def test_claim_many_returns_in_claim_order_and_honours_limit(queue: LeaseQueue) -> None:
    queue.enqueue_many([{"n": n} for n in range(10)])
    queue.enqueue({"n": 99}, priority=1)
    leases = queue.claim_many(4)
    assert [lease.payload["n"] for lease in leases] == [99, 0, 1, 2]
    assert len(queue.claim_many(100)) == 7
    assert queue.claim_many(5) == []
    with pytest.raises(ConfigurationError, match="limit"):
        queue.claim_many(0)


def test_idempotency_key_returns_the_unfinished_task(queue: LeaseQueue) -> None:
    first = queue.enqueue({"n": 1}, idempotency_key="invoice-7")
    assert queue.enqueue({"n": 2}, idempotency_key="invoice-7") == first
    assert queue.enqueue({"n": 3}, idempotency_key="invoice-7", queue="other") != first
    lease = queue.claim()
    assert lease is not None
    assert queue.enqueue({"n": 4}, idempotency_key="invoice-7") == first  # still processing
    lease.ack()
    # Once finished, the key is free: a new task is created.
    again = queue.enqueue({"n": 5}, idempotency_key="invoice-7")
    assert again != first
    assert queue.get(first).payload == {"n": 1}
    assert queue.stats("default").total == 2


def test_stats_counts_every_status(queue: LeaseQueue) -> None:
    assert queue.stats().counts == {
        "enqueued": 0,
        "processing": 0,
        "done": 0,
        "dead": 0,
        "cancelled": 0,
    }
    assert queue.stats().oldest_enqueued_seconds is None
    ids = queue.enqueue_many([{"n": n} for n in range(5)])
    queue.enqueue({"n": 9}, queue="other")
    lease = queue.claim()
    assert lease is not None
    lease.ack()
    queue.claim()
    queue.cancel(ids[4])
    time.sleep(0.2)
    stats = queue.stats("default")
    assert stats.counts == {"enqueued": 2, "processing": 1, "done": 1, "dead": 0, "cancelled": 1}
    assert stats.oldest_enqueued_seconds is not None and stats.oldest_enqueued_seconds >= 0.2
    assert queue.stats().counts["enqueued"] == 3


def test_live_stats_agree_with_the_full_count_and_leave_finished_tasks_out(
    queue: LeaseQueue,
) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(6)], max_attempts=1)
    queue.enqueue({"n": 9}, queue="other", delay=60)
    done = queue.claim()
    assert done is not None
    done.ack()
    dying = queue.claim()
    assert dying is not None
    dying.fail("boom")
    queue.claim()
    queue.cancel(ids[5])
    for name in (None, "default", "other"):
        full, live = queue.stats(name), queue.stats(name, finished=False)
        assert live.counts == {status: full.counts[status] for status in LIVE}
        assert (live.due, live.oldest_enqueued_seconds is None) == (
            full.due,
            full.oldest_enqueued_seconds is None,
        )
    assert queue.stats("default", finished=False).counts == {
        "enqueued": 2,
        "processing": 1,
        "dead": 1,
    }
    assert set(queue.stats_by_queue(finished=False)) == {"default", "other"}
    assert queue.stats("other", finished=False).due == 0


def test_cancel(queue: LeaseQueue) -> None:
    waiting = queue.enqueue({"n": 1})
    held = queue.enqueue({"n": 2})
    assert queue.cancel(waiting) is True
    lease = queue.claim()
    assert lease is not None and lease.task_id == held
    assert queue.cancel(held) is True
    assert queue.cancel(held) is False
    assert queue.get(held).status == "cancelled"
    with pytest.raises(TaskNotFound):
        queue.cancel(10**12)


def test_retry_dead_gives_a_fresh_budget(queue: LeaseQueue) -> None:
    a = queue.enqueue({"n": 1}, max_attempts=1, queue="q1")
    queue.enqueue({"n": 2}, max_attempts=1, queue="q2")
    for name in ("q1", "q2"):
        lease = queue.claim(queue=name)
        assert lease is not None
        assert lease.fail("boom") == "dead"
    assert queue.retry_dead([a]) == 1
    assert queue.get(a).status == "enqueued" and queue.get(a).attempts == 0
    assert queue.get(a).last_error == "boom"
    assert queue.retry_dead(queue="q2") == 1
    assert queue.retry_dead() == 0
    lease = queue.claim(queue="q1")
    assert lease is not None and lease.attempt == 1


def test_get_unknown_task(queue: LeaseQueue) -> None:
    with pytest.raises(TaskNotFound, match="no task with id 424242"):
        queue.get(424242)


def test_install_is_idempotent_and_versioned(make_queue) -> None:  # type: ignore[no-untyped-def]
    queue = make_queue()
    assert queue.installed_version() == 0
    with pytest.raises(SchemaNotInstalled, match=r"call LeaseQueue.install\(\)"):
        queue.enqueue({"n": 1})
    with pytest.raises(SchemaNotInstalled):
        queue.claim()
    assert queue.install() == len(migrations.MIGRATIONS)
    assert queue.install() == 0
    assert queue.installed_version() == migrations.LATEST_VERSION


def test_concurrent_installs(make_queue) -> None:  # type: ignore[no-untyped-def]
    from concurrent.futures import ThreadPoolExecutor

    queues = [make_queue() for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        applied = list(pool.map(lambda q: q.install(), queues))
    assert sorted(applied) == [0, 0, 0, len(migrations.MIGRATIONS)]
    queues[0].enqueue({"n": 1})


def test_a_newer_schema_is_refused(queue: LeaseQueue) -> None:
    run_sql(queue, "INSERT INTO {schema}.schema_version VALUES (99, 'future')")
    with pytest.raises(ConfigurationError, match="upgrade dagster-leasequeue"):
        queue.install()


def test_list_tasks_filters_and_pages(queue: LeaseQueue) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(5)])
    queue.enqueue({"n": 9}, queue="other")
    queue.claim()
    assert [t.task_id for t in queue.list_tasks(status="processing")] == [ids[0]]
    first_page = queue.list_tasks(queue="default", limit=2)
    assert [t.task_id for t in first_page] == ids[:2]
    next_page = queue.list_tasks(queue="default", after_id=first_page[-1].task_id, limit=10)
    assert [t.task_id for t in next_page] == ids[2:]
    with pytest.raises(ConfigurationError, match="status must be one of"):
        queue.list_tasks(status="running")


def test_retry_dead_leaves_a_task_whose_key_was_taken(queue: LeaseQueue) -> None:
    dead = queue.enqueue({"n": 1}, idempotency_key="k", max_attempts=1)
    other = queue.enqueue({"n": 2}, max_attempts=1, queue="other")
    for name in ("default", "other"):
        lease = queue.claim(queue=name)
        assert lease is not None
        lease.fail("boom")
    newer = queue.enqueue({"n": 3}, idempotency_key="k")  # the key is free once dead
    assert newer != dead
    assert queue.retry_dead() == 1
    assert queue.get(dead).status == "dead"
    assert queue.get(other).status == "enqueued"


def test_ack_many_is_fenced_per_token(queue: LeaseQueue) -> None:
    from dagster_leasequeue import LeaseLost

    from ..helpers import expire

    ids = queue.enqueue_many([{"n": n} for n in range(4)])
    leases = queue.claim_many(4)
    expire(queue, ids[1])
    queue.sweep()
    with pytest.raises(LeaseLost, match=rf"tasks \[{ids[1]}\].*other 3 were acked"):
        queue.ack_many(leases, [{"n": n} for n in range(4)])
    assert [queue.get(i).status for i in ids] == ["done", "enqueued", "done", "done"]
    assert queue.get(ids[2]).result == {"n": 2}
    assert all(lease.finished for i, lease in enumerate(leases) if i != 1)
    assert queue.ack_many([]) == []


def test_purge_deletes_old_finished_tasks_in_batches(queue: LeaseQueue) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(25)])
    queue.ack_many(queue.claim_many(20))
    lease = queue.claim()
    assert lease is not None
    lease.fail("x", retry_in=0)
    assert queue.purge(3600) == 0
    assert queue.purge(0, batch_size=7) == 20
    assert queue.stats().counts == {
        "enqueued": 5,
        "processing": 0,
        "done": 0,
        "dead": 0,
        "cancelled": 0,
    }
    assert queue.get(ids[-1]).status == "enqueued"
    with pytest.raises(ConfigurationError, match="statuses"):
        queue.purge(0, statuses=["enqueued"])


def test_a_database_at_an_older_version_is_migrated(make_queue) -> None:  # type: ignore[no-untyped-def]
    queue = make_queue()
    assert install_as_of(queue, 1) == 1
    # A task stored by that release (its statement: this one's names later columns).
    ((task_id,),) = run_sql(
        queue,
        "INSERT INTO {schema}.tasks (queue, payload, max_attempts)"
        " VALUES ('default', '{\"kept\": true}', 3) RETURNING id",
    )
    assert queue.installed_version() == 1
    with pytest.raises(SchemaNotInstalled, match="is at version 1"):
        queue.check_installed()
    assert queue.install() == len(migrations.MIGRATIONS) - 1
    assert queue.installed_version() == migrations.LATEST_VERSION
    assert queue.get(task_id).payload == {"kept": True}
    options = run_sql(
        queue,
        "SELECT reloptions FROM pg_class WHERE oid = %(t)s::regclass",
        {"t": f'"{queue.schema}".tasks'},
    )[0][0]
    assert "autovacuum_vacuum_scale_factor=0.02" in options


def test_a_migration_behind_a_long_read_gives_way_and_tries_again(
    make_queue,
    dsn: str,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    """A migration that must lock the tasks (migration 17 locks them exclusively) waited
    without end behind a long read of them, and every write to the tasks queued behind
    it: the whole queue stopped. Each try now gives up after a short lock timeout, lets
    the writes through, and tries again; past its deadline install() says why."""
    monkeypatch.setattr(schema_module, "MIGRATION_LOCK_TIMEOUT", "300ms", raising=False)
    monkeypatch.setattr(schema_module, "MIGRATION_DEADLINE_SECONDS", 2.0, raising=False)
    queue = make_queue()
    install_as_of(queue, 16)
    tasks = f'"{queue.schema}".tasks'
    with psycopg.connect(dsn) as reader, psycopg.connect(dsn, autocommit=True) as writer:
        reader.execute(f"SELECT count(*) FROM {tasks}")  # its lock lasts to its commit
        longest = 0.0

        def write_meanwhile() -> None:
            nonlocal longest
            while not done.is_set():
                started = time.monotonic()
                writer.execute(f"UPDATE {tasks} SET priority = 0 WHERE id = -1")
                longest = max(longest, time.monotonic() - started)
                time.sleep(0.05)

        done = threading.Event()
        writes = threading.Thread(target=write_meanwhile, daemon=True)
        writes.start()
        try:
            with pytest.raises(LeaseQueueError, match="could not take the locks") as raised:
                queue.install()
        finally:
            done.set()
            writes.join(timeout=10)
        assert "stays at version 16" in str(raised.value)
        assert queue.installed_version() == 16
        # Each try held the writes up for its lock timeout at most, not for the read.
        assert longest < 1.5, f"a write waited {longest:.2f} s behind the migration"
        reader.rollback()
    assert queue.install() == migrations.LATEST_VERSION - 16
    assert queue.installed_version() == migrations.LATEST_VERSION


def test_a_waiting_claim_wakes_on_enqueue(queue: LeaseQueue) -> None:
    import threading

    def enqueue_later() -> None:
        time.sleep(0.3)
        queue.enqueue({"n": 1})

    producer = threading.Thread(target=enqueue_later)
    started = time.monotonic()
    producer.start()
    lease = queue.claim(wait=5)
    waited = time.monotonic() - started
    producer.join()
    assert lease is not None and lease.payload == {"n": 1}
    assert waited < 0.9  # woken by the notification, not by the one-second poll
    started = time.monotonic()
    assert queue.claim(wait=0.3) is None
    assert 0.3 <= time.monotonic() - started < 1.5


def test_a_waiting_claim_still_polls_without_notifications(make_queue) -> None:  # type: ignore[no-untyped-def]
    queue = make_queue(notify=False)
    queue.install()
    queue.enqueue({"n": 1}, delay=0.5)  # a delayed task sends no wake-up when it comes due
    lease = queue.claim(wait=3)
    assert lease is not None and lease.payload == {"n": 1}
    with pytest.raises(ConfigurationError, match="wait"):
        queue.claim(wait=-1)


def test_prepared_statements_can_be_turned_off(make_queue) -> None:  # type: ignore[no-untyped-def]
    queue = make_queue(prepared_statements=False)
    queue.install()
    for n in range(8):  # past psycopg's threshold of 5 executions
        queue.enqueue({"n": n})
    assert run_sql(queue, "SELECT count(*) FROM pg_prepared_statements") == [(0,)]


def test_stats_count_due_tasks_apart_from_delayed_ones(queue: LeaseQueue) -> None:
    queue.enqueue_many([{"n": n} for n in range(3)])
    queue.enqueue({"n": 9}, delay=3600)
    stats = queue.stats()
    assert (stats.counts["enqueued"], stats.due) == (4, 3)
    assert queue.stats_by_queue()["default"].due == 3


def _kill(queue: LeaseQueue, name: str = "default") -> int:
    lease = queue.claim(queue=name)
    assert lease is not None
    assert lease.fail("boom") == "dead"
    return lease.task_id


def test_retry_dead_never_takes_a_keyless_task_for_a_key(queue: LeaseQueue) -> None:
    keyless = queue.enqueue({"n": 1}, max_attempts=1)
    _kill(queue)
    # A dead task whose key reads like the keyless task's id.
    keyed = queue.enqueue({"n": 2}, max_attempts=1, idempotency_key=str(keyless))
    _kill(queue)
    assert queue.retry_dead() == 2
    assert queue.get(keyless).status == queue.get(keyed).status == "enqueued"


def test_retry_dead_skips_a_key_enqueued_meanwhile_and_retries_the_rest(
    dsn: str, queue: LeaseQueue, caplog: pytest.LogCaptureFixture
) -> None:
    keyed = queue.enqueue({"n": 1}, max_attempts=1, idempotency_key="k")
    _kill(queue)
    plain = queue.enqueue({"n": 2}, max_attempts=1)
    _kill(queue)
    with psycopg.connect(dsn) as producer:
        # An enqueue of the key, not yet committed while retry_dead looks: the key is free
        # in retry_dead's snapshot, and its update then waits on this insert.
        producer.execute(
            f'INSERT INTO "{queue.schema}".tasks (queue, payload, idempotency_key, max_attempts)'
            " VALUES ('default', '{}', 'k', 1)"
        )
        retried = start_blocked(dsn, queue.schema, queue.retry_dead)
        producer.commit()
    assert retried() == 1
    assert queue.get(keyed).status == "dead"
    assert queue.get(plain).status == "enqueued"
    assert f"task {keyed} stays dead" in caplog.text


def test_purge_looks_again_at_a_row_that_changed_while_it_waited(
    dsn: str, queue: LeaseQueue
) -> None:
    task_id = queue.enqueue({"n": 1}, max_attempts=1)
    _kill(queue)
    with psycopg.connect(dsn) as operator:
        # retry_dead's update, held open while purge picks the row and waits for its lock.
        operator.execute(
            f"UPDATE \"{queue.schema}\".tasks SET status = 'enqueued', attempts = 0,"
            " finished_at = NULL, run_at = clock_timestamp() WHERE id = %s",
            (task_id,),
        )
        purged = start_blocked(dsn, queue.schema, lambda: queue.purge(0, statuses=("dead",)))
        operator.commit()
    assert purged() == 0
    lease = queue.claim()
    assert lease is not None and lease.task_id == task_id


def test_the_triggers_conditions_are_small_for_every_statement_to_prepare(
    queue: LeaseQueue,
) -> None:
    """A trigger's WHEN clause is read from its stored text and prepared again in every
    statement that sets a status: each is a NULL test and one call, not a long expression."""
    rows = run_sql(
        queue,
        "SELECT t.tgname, length(t.tgqual::text) FROM pg_trigger AS t"
        " WHERE t.tgrelid = %(tasks)s::regclass AND NOT t.tgisinternal",
        {"tasks": f'"{queue.schema}".tasks'},
    )
    conditions = {str(name): int(length) for name, length in rows}
    assert set(conditions) == {"tasks_batch_counts", "tasks_key_running"}
    assert all(length < 1000 for length in conditions.values()), conditions
