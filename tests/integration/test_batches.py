"""Task batches: all-or-none fan-out, counters kept by every path, results, waiting."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

from dagster_leasequeue import (
    BatchNotFound,
    ConfigurationError,
    LeaseLost,
    LeaseQueue,
    PayloadError,
    migrations,
    sql,
)

from ..helpers import expire, install_as_of, run_sql


def statuses_of(queue: LeaseQueue, batch_id: int) -> dict[str, int]:
    """The batch's tasks per status, counted from the tasks themselves."""
    counted = dict.fromkeys(("enqueued", "processing", "done", "dead", "cancelled"), 0)
    for status, count in run_sql(
        queue,
        "SELECT status, count(*) FROM {schema}.tasks WHERE batch_id = %(id)s GROUP BY 1",
        {"id": batch_id},
    ):
        counted[status] = count
    return counted


def test_a_batch_is_enqueued_counted_and_finished_by_acks_fails_and_cancels(
    queue: LeaseQueue,
) -> None:
    batch = queue.enqueue_batch(({"n": n} for n in range(6)), queue="docs", max_attempts=1)
    assert (batch.total, batch.queue, batch.created) == (6, "docs", True)
    info = queue.batch(batch.id)
    assert (info.enqueued, info.finished, info.finished_at) == (6, False, None)
    first = queue.claim(queue="docs")
    second = queue.claim(queue="docs")
    assert first is not None and second is not None
    assert queue.batch(batch.id).processing == 2
    first.ack({"words": 3})
    second.fail("bad scan")  # max_attempts=1: dead
    assert queue.cancel_batch(batch.id) == 4
    info = queue.batch(batch.id)
    assert info.counts == {"enqueued": 0, "processing": 0, "done": 1, "dead": 1, "cancelled": 4}
    assert info.finished and info.finished_at is not None
    assert info.finished_at >= info.created_at
    assert info.counts == statuses_of(queue, batch.id)


def test_a_sweep_that_kills_the_last_task_finishes_the_batch(queue: LeaseQueue) -> None:
    batch = queue.enqueue_batch([{"n": 1}], queue="docs", max_attempts=1)
    lease = queue.claim(queue="docs")
    assert lease is not None
    expire(queue, lease.task_id)
    assert not queue.batch(batch.id).finished
    queue.sweep()
    info = queue.batch(batch.id)
    assert (info.dead, info.finished) == (1, True)


def test_retry_dead_of_a_batch_makes_it_unfinished_again(queue: LeaseQueue) -> None:
    batch = queue.enqueue_batch([{"n": 1}, {"n": 2}], queue="docs", max_attempts=1)
    other = queue.enqueue_batch([{"n": 3}], queue="docs", max_attempts=1)
    for _ in range(3):
        lease = queue.claim(queue="docs")
        assert lease is not None
        lease.fail("boom")
    assert queue.batch(batch.id).finished and queue.batch(other.id).finished
    assert queue.retry_dead(batch=batch.id) == 2
    info = queue.batch(batch.id)
    assert (info.dead, info.enqueued, info.finished) == (0, 2, False)
    assert queue.batch(other.id).dead == 1  # the other batch is left as it was
    assert queue.retry_dead() == 1  # unscoped: counted for its batch as well
    assert queue.batch(other.id).counts == statuses_of(queue, other.id)


def test_a_claim_leaves_the_batch_trigger_alone_and_an_ack_is_counted(
    queue: LeaseQueue, dsn: str
) -> None:
    # What the server calls, counted for this transaction (pg_stat_xact_user_functions):
    # the trigger is considered only by statements that set finished_at (migration 18), so
    # a claim, which cannot change a batch's count, skips it; an ack fires it once.
    batch = queue.enqueue_batch([{"n": 1}])
    calls = (
        "SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions"
        " WHERE schemaname = %s AND funcname = 'count_batch_task'"
    )
    with psycopg.connect(dsn) as conn:
        conn.execute("SET LOCAL track_functions = 'pl'")
        claim = {"queue": "default", "worker_id": "w", "lease_seconds": None, "default_lease": 30}
        (task,) = conn.execute(sql.compose_claim(queue.schema, 1), claim).fetchall()
        assert conn.execute(calls, (queue.schema,)).fetchone() == (0,)
        ack = {"task_id": task[0], "token": task[5], "result": None}
        assert conn.execute(sql.compose(sql.ACK, queue.schema), ack).rowcount == 1
        assert conn.execute(calls, (queue.schema,)).fetchone() == (1,)
    assert queue.batch(batch.id).finished


def test_the_counting_triggers_conditions_are_their_columns_null_tests(
    queue: LeaseQueue,
) -> None:
    # Prepared in every statement that sets a column the trigger watches, whatever the
    # rows: the rest of each condition is the trigger function's first test (migration 20).
    conditions = run_sql(
        queue,
        "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger"
        " WHERE tgrelid = '{schema}.tasks'::regclass AND NOT tgisinternal ORDER BY tgname",
    )
    when = {name: d.split(" WHEN ")[1].split(" EXECUTE ")[0] for name, d in conditions}
    assert when == {
        "tasks_batch_counts": "((new.batch_id IS NOT NULL))",
        "tasks_key_running": "((new.concurrency_key IS NOT NULL))",
    }


def test_a_transaction_that_says_it_counted_in_bulk_is_not_counted_again(
    queue: LeaseQueue, dsn: str
) -> None:
    # The settings by which code from before migrations 8 and 9 told the triggers it had
    # counted its tasks itself; still honoured for a deploy that runs both.
    batch = queue.enqueue_batch([{"n": 1}, {"n": 2}], concurrency_key="k")
    with psycopg.connect(dsn) as conn:
        conn.execute("SET LOCAL leasequeue.counted_in_bulk = 'on'")
        conn.execute("SET LOCAL leasequeue.keys_counted = 'on'")
        claim = {"queue": "default", "worker_id": "w", "lease_seconds": None, "default_lease": 30}
        (task,) = conn.execute(sql.compose_claim(queue.schema, 1), claim).fetchall()
        ack = {"task_id": task[0], "token": task[5], "result": None}
        assert conn.execute(sql.compose(sql.ACK, queue.schema), ack).rowcount == 1
    assert queue.batch(batch.id).counts["done"] == 0  # counted by no one: as it said
    running = "SELECT coalesce(sum(running), 0) FROM {schema}.flow_keys WHERE key = 'k'"
    assert run_sql(queue, running) == [(0,)]
    lease = queue.claim()
    assert lease is not None
    lease.ack()
    assert queue.batch(batch.id).counts["done"] == 1
    assert run_sql(queue, running) == [(0,)]


def test_a_task_concluded_by_an_attempt_is_counted_in_its_batch(queue: LeaseQueue) -> None:
    batch = queue.enqueue_batch([{"n": 1}, {"n": 2}])
    for _ in range(2):
        lease = queue.claim()
        assert lease is not None
        with queue.attempt(lease=lease):
            pass
    info = queue.batch(batch.id)
    assert info.finished and info.counts["done"] == 2


def test_a_named_batch_is_made_once(queue: LeaseQueue) -> None:
    first = queue.enqueue_batch([{"n": 1}, {"n": 2}], queue="docs", name="run-42")

    def never_read() -> Iterator[dict[str, Any]]:
        raise AssertionError("the payloads of an existing batch are not read")
        yield {}

    again = queue.enqueue_batch(never_read(), queue="docs", name="run-42")
    assert (again.id, again.total, again.created) == (first.id, 2, False)
    assert queue.stats("docs").counts["enqueued"] == 2


def test_a_bad_payload_stores_nothing_and_says_which(queue: LeaseQueue) -> None:
    payloads: list[Any] = [{"n": 0}, {"n": 1}, {"n": 2}, ["not", "an", "object"]]
    with pytest.raises(PayloadError, match="payload #3"):
        queue.enqueue_batch(payloads, queue="docs", name="broken")
    assert queue.stats("docs").total == 0
    assert queue.batches() == []
    # The name is free again: nothing of the failed call was kept.
    assert queue.enqueue_batch([{"n": 0}], queue="docs", name="broken").created


def test_payloads_with_characters_copy_escapes_come_back_as_they_went(
    queue: LeaseQueue,
) -> None:
    payloads = [{"text": "tab\there, newline\nthere, a \\ backslash, \\n, \r and é"}]
    batch = queue.enqueue_batch(payloads, queue="tab\tand\\slash")
    (result,) = queue.batch_results(batch.id, statuses=("enqueued",))
    assert result.payload == payloads[0]
    assert queue.get(result.task_id).queue == "tab\tand\\slash"


def test_idempotency_keys_skip_keys_held_by_unfinished_tasks(queue: LeaseQueue) -> None:
    queue.enqueue({"n": 0}, queue="docs", idempotency_key="doc-0")
    batch = queue.enqueue_batch(
        [{"n": 0}, {"n": 1}, {"n": 1}], queue="docs", idempotency_keys=["doc-0", "doc-1", "doc-1"]
    )
    assert batch.total == 1
    assert queue.batch(batch.id).enqueued == 1
    with pytest.raises(ConfigurationError, match="one key per payload"):
        queue.enqueue_batch([{"n": 5}, {"n": 6}], queue="docs", idempotency_keys=["only-one"])
    assert queue.stats("docs").total == 2


def test_batch_results_stream_by_status_in_enqueue_order(queue: LeaseQueue) -> None:
    batch = queue.enqueue_batch(({"n": n} for n in range(5)), queue="docs", max_attempts=1)
    for n in range(5):
        lease = queue.claim(queue="docs")
        assert lease is not None
        if n == 2:
            lease.fail("page 7 unreadable")
        else:
            lease.ack({"double": lease.payload["n"] * 2})
    done = list(queue.batch_results(batch.id))
    assert [r.payload["n"] for r in done] == [0, 1, 3, 4]
    assert [r.result for r in done] == [{"double": 0}, {"double": 2}, {"double": 6}, {"double": 8}]
    everything = list(queue.batch_results(batch.id, statuses=("dead", "done")))
    assert everything[0].status == "dead"
    assert everything[0].last_error == "page 7 unreadable"
    assert len(everything) == 5
    with pytest.raises(ConfigurationError, match="statuses"):
        list(queue.batch_results(batch.id, statuses=("finished",)))
    with pytest.raises(BatchNotFound, match="12345"):
        queue.batch(12345)
    with pytest.raises(BatchNotFound):
        list(queue.batch_results(12345))


def test_wait_batch_is_woken_by_the_last_ack(queue: LeaseQueue) -> None:
    batch = queue.enqueue_batch([{"n": 1}, {"n": 2}], queue="docs")
    for _ in range(1):
        lease = queue.claim(queue="docs")
        assert lease is not None
        lease.ack()
    last = queue.claim(queue="docs")
    assert last is not None
    threading.Timer(0.5, last.ack).start()
    started = time.monotonic()
    # A poll interval far above the test's bound: only the NOTIFY can end the wait in time.
    info = queue.wait_batch(batch.id, timeout=30, poll_interval=30)
    assert info.finished and info.done == 2
    assert time.monotonic() - started < 5


def test_serializable_attempts_finishing_a_batch_do_not_fail_each_other(
    queue: LeaseQueue,
) -> None:
    # Two attempts whose work runs SERIALIZABLE, one concluded inside the other, finish the
    # batch's two tasks. Reading the batch's tasks and stripes to decide whether it has
    # ended would make each read what the other writes, and the second commit would fail
    # its attempt for the package's own bookkeeping. Under SERIALIZABLE a finish counts and
    # reads nothing more: the batch's end is found by wait_batch's poll.
    batch = queue.enqueue_batch([{"n": 1}, {"n": 2}], queue="docs")
    first = queue.claim(queue="docs", worker_id="a")
    second = queue.claim(queue="docs", worker_id="b")
    assert first is not None and second is not None
    with queue.attempt(lease=first) as outer:
        outer.connection.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        outer.connection.execute("SELECT 1")
        with queue.attempt(lease=second) as inner:
            inner.connection.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
            inner.connection.execute("SELECT 1")
    assert [task.status for task in map(queue.get, (first.task_id, second.task_id))] == [
        "done",
        "done",
    ]
    info = queue.wait_batch(batch.id, timeout=10, poll_interval=0.2)
    assert info.finished and info.done == 2


def test_a_batchs_counts_outlive_its_purged_tasks(queue: LeaseQueue) -> None:
    batch = queue.enqueue_batch([{"n": 1}, {"n": 2}], queue="docs")
    while (lease := queue.claim(queue="docs")) is not None:
        lease.ack({"n": lease.payload["n"]})
    assert queue.purge(0) == 2
    info = queue.batch(batch.id)
    assert info.finished and (info.total, info.done) == (2, 2)
    assert list(queue.batch_results(batch.id)) == []


def _task_ids(queue: LeaseQueue, batch_id: int) -> list[int]:
    rows = run_sql(queue, "SELECT id FROM {schema}.tasks WHERE batch_id = %(id)s", {"id": batch_id})
    return [id for (id,) in rows]


def _last_task_ids(queue: LeaseQueue, batch_id: int) -> set[int | None]:
    """The last task the batch's row and each of its stripes name."""
    return {
        last
        for (last,) in run_sql(
            queue,
            "SELECT last_task_id FROM {schema}.batches WHERE id = %(id)s"
            " UNION ALL SELECT last_task_id FROM {schema}.batch_counts WHERE batch_id = %(id)s",
            {"id": batch_id},
        )
    }


def test_a_batch_and_its_stripes_record_its_last_task(queue: LeaseQueue) -> None:
    queue.enqueue_many([{"n": n} for n in range(3)], queue="docs")  # ids before the batch's
    batch = queue.enqueue_batch(({"n": n} for n in range(5)), queue="docs")
    keyed = queue.enqueue_batch([{"n": 1}, {"n": 2}], queue="docs", idempotency_keys=["k1", "k2"])
    later = queue.enqueue_many([{"n": 9}], queue="docs")  # an id after the batches'
    for _ in range(4):  # the three plain tasks, then the batch's first
        lease = queue.claim(queue="docs")
        assert lease is not None
        lease.ack()  # the session's first finish in the batch makes its stripe's row
    stripes = run_sql(
        queue,
        "SELECT count(*) FROM {schema}.batch_counts WHERE batch_id = %(id)s",
        {"id": batch.id},
    )
    assert stripes == [(migrations.BATCH_STRIPES + 1,)]
    for made in (batch, keyed):
        assert _last_task_ids(queue, made.id) == {max(_task_ids(queue, made.id))}
        assert max(_task_ids(queue, made.id)) < later[0]
    assert _last_task_ids(queue, queue.enqueue_batch([], queue="docs").id) == {None}


def test_a_sessions_first_finish_in_a_batch_by_a_failure_makes_its_stripe(
    queue: LeaseQueue,
) -> None:
    batch = queue.enqueue_batch(({"n": n} for n in range(3)), queue="docs", max_attempts=1)
    lease = queue.claim(queue="docs")
    assert lease is not None
    assert lease.fail("bad scan") == "dead"  # not an ack: counted by the general update
    assert _last_task_ids(queue, batch.id) == {max(_task_ids(queue, batch.id))}
    assert queue.batch(batch.id).counts == statuses_of(queue, batch.id)
    assert queue.batch(batch.id).dead == 1


def _wait_woken_by(queue: LeaseQueue, batch_id: int, finish: Any) -> float:
    """Seconds wait_batch took when ``finish`` runs half a second after it starts waiting;
    its poll interval is far above what a NOTIFY takes."""
    threading.Timer(0.5, finish).start()
    started = time.monotonic()
    info = queue.wait_batch(batch_id, timeout=30, poll_interval=30)
    assert info.finished
    return time.monotonic() - started


def test_wait_batch_is_woken_when_a_retried_task_finishes_after_the_last_one(
    queue: LeaseQueue,
) -> None:
    # The batch's last task is done before its first, which was retried: the batch is
    # finished by a task claimed after its last, and the end is still found.
    batch = queue.enqueue_batch(({"n": n} for n in range(3)), queue="docs")
    first = queue.claim(queue="docs")
    assert first is not None
    first.fail("flaky", retry_in=1)
    for _ in range(2):
        lease = queue.claim(queue="docs")
        assert lease is not None and lease.task_id != first.task_id
        lease.ack()
    assert not queue.batch(batch.id).finished
    time.sleep(1)
    retried = queue.claim(queue="docs")
    assert retried is not None and retried.task_id == first.task_id
    assert _wait_woken_by(queue, batch.id, retried.ack) < 5
    assert queue.batch(batch.id).counts == statuses_of(queue, batch.id)


def test_a_batch_without_a_recorded_last_task_still_wakes_wait_batch(queue: LeaseQueue) -> None:
    # A batch enqueued by an earlier release has no last_task_id: its end is probed for.
    batch = queue.enqueue_batch(({"n": n} for n in range(3)), queue="docs")
    for table, column in (("batches", "id"), ("batch_counts", "batch_id")):
        run_sql(
            queue,
            f"UPDATE {{schema}}.{table} SET last_task_id = NULL WHERE {column} = %(id)s",
            {"id": batch.id},
        )
    for _ in range(2):
        lease = queue.claim(queue="docs")
        assert lease is not None
        lease.ack()
    assert not queue.batch(batch.id).finished
    last = queue.claim(queue="docs")
    assert last is not None
    assert _wait_woken_by(queue, batch.id, last.ack) < 5
    assert queue.batch(batch.id).counts == statuses_of(queue, batch.id)


def test_wait_batch_is_woken_by_ack_many(queue: LeaseQueue) -> None:
    batch = queue.enqueue_batch(({"n": n} for n in range(150)), queue="docs")
    plain = queue.enqueue_many([{"n": n} for n in range(5)], queue="docs")
    leases = queue.claim_many(200, queue="docs")
    assert len(leases) == 155
    threading.Timer(0.5, queue.ack_many, [leases]).start()
    started = time.monotonic()
    info = queue.wait_batch(batch.id, timeout=30, poll_interval=30)
    assert info.finished and info.done == 150
    assert time.monotonic() - started < 5
    assert queue.stats("docs").counts["done"] == 150 + len(plain)
    assert info.counts == statuses_of(queue, batch.id)


def test_ack_many_counts_each_batch_once_per_statement(queue: LeaseQueue, dsn: str) -> None:
    """Row by row, one statement's updates of one stripe row pile up versions of it that
    the statement cannot prune: each slower than the last."""
    first = queue.enqueue_batch(({"n": n} for n in range(60)), queue="docs")
    second = queue.enqueue_batch(({"n": n} for n in range(40)), queue="docs")
    leases = queue.claim_many(100, queue="docs")
    with psycopg.connect(dsn) as conn:  # one transaction: its own statistics are exact
        acked = conn.execute(
            sql.compose(sql.ACK_MANY, queue.schema),
            {
                "task_ids": [lease.task_id for lease in leases],
                "tokens": [lease.token for lease in leases],
                "results": [None] * len(leases),
                "channel": sql.notify_channel(queue.schema),
            },
        ).fetchall()
        (updates,) = conn.execute(
            "SELECT n_tup_upd FROM pg_stat_xact_user_tables WHERE relid = %s::regclass",
            (f'"{queue.schema}".batch_counts',),
        ).fetchone() or (None,)
    assert len(acked) == 100
    assert updates == 2
    for batch, size in ((first, 60), (second, 40)):
        info = queue.batch(batch.id)
        assert info.finished and info.done == size
        assert info.counts == statuses_of(queue, batch.id)


def test_open_transactions_finishing_tasks_of_one_batch_do_not_wait_on_each_other(
    queue: LeaseQueue, dsn: str
) -> None:
    """Two processes whose pids share a remainder modulo the stripe count each take a
    stripe of their own: neither waits for the other's commit."""
    batch = queue.enqueue_batch([{"n": 1}, {"n": 2}], queue="docs")
    leases = queue.claim_many(2, queue="docs")
    ack = sql.compose(sql.ACK, queue.schema)
    with contextlib.ExitStack() as stack:
        by_stripe: dict[int, psycopg.Connection[Any]] = {}
        while True:  # at most one more connection than there are stripes
            conn = stack.enter_context(psycopg.connect(dsn))
            pair = by_stripe.setdefault(conn.info.backend_pid % migrations.BATCH_STRIPES, conn)
            if pair is not conn:
                break
        for holder, lease in zip((pair, conn), leases, strict=True):
            holder.execute("SET lock_timeout = '3s'")
            holder.execute(ack, {"task_id": lease.task_id, "token": lease.token, "result": None})
        pair.commit()
        conn.commit()
    info = queue.batch(batch.id)
    assert info.finished and info.done == 2
    assert info.counts == statuses_of(queue, batch.id)


def _stripes_counted(queue: LeaseQueue, batch_id: int) -> dict[int, int]:
    """The batch's stripes that counted a finish, and what each counted."""
    rows = run_sql(
        queue,
        "SELECT stripe, done FROM {schema}.batch_counts WHERE batch_id = %(id)s AND done > 0",
        {"id": batch_id},
    )
    return {int(stripe): int(done) for stripe, done in rows}


def _ack_each_in_a_transaction(queue: LeaseQueue, conn: psycopg.Connection[Any]) -> None:
    ack = sql.compose(sql.ACK, queue.schema)
    while (lease := queue.claim(queue="docs")) is not None:
        conn.execute(ack, {"task_id": lease.task_id, "token": lease.token, "result": None})
        conn.commit()


def _session_stripes_held(conn: psycopg.Connection[Any]) -> list[int]:
    rows = conn.execute(
        "SELECT objid FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        " AND classid = %s AND objsubid = 2",
        (migrations.BATCH_STRIPE_LOCK_CLASS,),
    ).fetchall()
    return sorted(int(objid) for (objid,) in rows)


def test_a_session_counts_its_finishes_in_a_stripe_it_holds_for_its_life(
    queue: LeaseQueue, dsn: str
) -> None:
    """No search for a free stripe per transaction: the session's first finish takes one,
    numbered apart from the batch's own stripes, and keeps it after its commits."""
    batch = queue.enqueue_batch(({"n": n} for n in range(5)), queue="docs")
    with psycopg.connect(dsn) as conn:
        _ack_each_in_a_transaction(queue, conn)
        held = _session_stripes_held(conn)
    ((stripe, done),) = _stripes_counted(queue, batch.id).items()
    assert done == 5 and held == [stripe]
    assert stripe >= migrations.BATCH_STRIPES
    info = queue.batch(batch.id)
    assert info.finished and info.counts == statuses_of(queue, batch.id)


def test_a_session_reset_between_finishes_takes_a_stripe_again(queue: LeaseQueue, dsn: str) -> None:
    batch = queue.enqueue_batch(({"n": n} for n in range(4)), queue="docs")
    ack = sql.compose(sql.ACK, queue.schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(2):
            lease = queue.claim(queue="docs")
            assert lease is not None
            conn.execute(ack, {"task_id": lease.task_id, "token": lease.token, "result": None})
            assert len(_session_stripes_held(conn)) == 1
            conn.execute("RESET ALL")
            conn.execute("SELECT pg_advisory_unlock_all()")
            assert _session_stripes_held(conn) == []
        conn.autocommit = False
        _ack_each_in_a_transaction(queue, conn)
    info = queue.batch(batch.id)
    assert info.finished and info.done == 4
    assert info.counts == statuses_of(queue, batch.id)


def test_with_every_session_stripe_held_a_finish_counts_in_a_stripe_of_the_batch(
    queue: LeaseQueue, dsn: str
) -> None:
    batch = queue.enqueue_batch(({"n": n} for n in range(3)), queue="docs")
    first = migrations.BATCH_STRIPES
    with psycopg.connect(dsn, autocommit=True) as holder, psycopg.connect(dsn) as conn:
        for stripe in range(first, first + migrations.BATCH_SESSION_STRIPES):
            holder.execute(
                "SELECT pg_advisory_lock(%s, %s)", (migrations.BATCH_STRIPE_LOCK_CLASS, stripe)
            )
        _ack_each_in_a_transaction(queue, conn)
    counted = _stripes_counted(queue, batch.id)
    assert sum(counted.values()) == 3 and all(stripe < first for stripe in counted)
    assert queue.batch(batch.id).finished


def test_wait_batch_returns_the_unfinished_state_at_its_timeout(queue: LeaseQueue) -> None:
    batch = queue.enqueue_batch([{"n": 1}], queue="docs")
    started = time.monotonic()
    info = queue.wait_batch(batch.id, timeout=0.3, poll_interval=0.1)
    assert not info.finished and info.enqueued == 1
    assert time.monotonic() - started < 3


def test_an_empty_batch_is_finished_at_once(queue: LeaseQueue) -> None:
    batch = queue.enqueue_batch([], queue="docs")
    info = queue.wait_batch(batch.id, timeout=1)
    assert info.total == 0 and info.finished


def test_counts_stay_right_under_concurrent_acks_fails_sweeps_and_a_cancel(
    queue: LeaseQueue,
) -> None:
    batch = queue.enqueue_batch(({"n": n} for n in range(800)), queue="docs", max_attempts=2)

    def work() -> None:
        while (lease := queue.claim(queue="docs", lease_seconds=30)) is not None:
            n = lease.payload["n"]
            # The cancel takes tasks from under their leases.
            with contextlib.suppress(LeaseLost):
                if n % 7 == 0:
                    lease.fail("sevens fail", retry_in=0)
                elif n % 11 == 0:
                    expire(queue, lease.task_id)  # left to a sweeper
                    queue.sweep()
                else:
                    lease.ack()

    with ThreadPoolExecutor(4) as pool:
        workers = [pool.submit(work) for _ in range(4)]
        time.sleep(0.3)
        queue.cancel_batch(batch.id)
        for worker in workers:
            worker.result()
    info = queue.batch(batch.id)
    assert info.counts == statuses_of(queue, batch.id)
    assert info.finished and info.total == 800


_ENQUEUE_IN_A_PROCESS = """
import resource, sys
from dagster_leasequeue import LeaseQueue
dsn, schema, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
with LeaseQueue(dsn, schema=schema) as queue:
    payloads = ({"document": f"doc-{n:07d}.pdf", "pages": n % 300} for n in range(count))
    batch = queue.enqueue_batch(payloads, queue="docs")
    assert batch.total == count, batch
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def test_a_million_payloads_from_a_generator_with_flat_memory(queue: LeaseQueue, dsn: str) -> None:
    """The peak memory of a process that enqueues a million payloads is that of one that
    enqueues ten thousand: a few thousand rows are in flight at a time."""

    def peak_kilobytes(count: int) -> int:
        done = subprocess.run(
            [sys.executable, "-c", _ENQUEUE_IN_A_PROCESS, dsn, queue.schema, str(count)],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        return int(done.stdout.split()[-1])

    small = peak_kilobytes(10_000)
    large = peak_kilobytes(1_000_000)
    assert queue.stats("docs").counts["enqueued"] == 1_010_000
    assert large - small < 20 * 1024, f"{small} kB for 10k payloads, {large} kB for 1M"


def test_an_upgrade_builds_the_batch_index_concurrently_and_mends_an_interrupted_build(
    make_queue: Any,
) -> None:
    queue = make_queue()
    install_as_of(queue, 6)
    # Tasks stored by that release (its statements: this one's need the later columns).
    run_sql(
        queue,
        "INSERT INTO {schema}.tasks (queue, payload, max_attempts)"
        " SELECT 'default', jsonb_build_object('n', n), 3 FROM generate_series(1, 10) AS n",
    )
    # An interrupted CREATE INDEX CONCURRENTLY leaves an invalid index of that name.
    run_sql(queue, "CREATE INDEX tasks_batch_idx ON {schema}.tasks (id)")
    run_sql(
        queue,
        "UPDATE pg_index SET indisvalid = false WHERE indexrelid = "
        "'{schema}.tasks_batch_idx'::regclass",
    )
    assert queue.install() == len(migrations.MIGRATIONS) - 6
    (definition,) = run_sql(
        queue,
        "SELECT pg_get_indexdef(i.indexrelid) || ' ' || i.indisvalid FROM pg_index AS i "
        "WHERE i.indexrelid = '{schema}.tasks_batch_idx'::regclass",
    )
    assert "(batch_id, status, id)" in definition[0] and definition[0].endswith("true")
    assert queue.install() == 0
    assert queue.enqueue_batch([{"n": 1}], queue="docs").total == 1


def test_batch_results_takes_one_status_by_its_name(queue: LeaseQueue) -> None:
    batch = queue.enqueue_batch([{"n": 1}], queue="docs")
    lease = queue.claim(queue="docs")
    assert lease is not None
    lease.ack({"n": 1})
    assert [r.result for r in queue.batch_results(batch.id, statuses="done")] == [{"n": 1}]
    assert list(queue.batch_results(batch.id, statuses="dead")) == []


@pytest.mark.parametrize("bad", ["abc", "14", True, 1.5, [1], None, 0, -1, 2**70])
def test_a_batch_id_that_is_not_one_says_so_before_the_database_is_asked(
    queue: LeaseQueue, bad: Any
) -> None:
    for call in (
        lambda: queue.batch(bad),
        lambda: queue.batch_results(bad),
        lambda: queue.wait_batch(bad, timeout=0),
        lambda: queue.cancel_batch(bad),
    ):
        with pytest.raises(ConfigurationError, match="batch_id must be a whole number"):
            call()
    if bad is not None:
        with pytest.raises(ConfigurationError, match="batch must be a whole number"):
            queue.retry_dead(batch=bad)


def test_retry_dead_of_a_batch_that_does_not_exist_says_so(queue: LeaseQueue) -> None:
    with pytest.raises(BatchNotFound, match="12345"):
        queue.retry_dead(batch=12345)


@pytest.mark.parametrize("payloads", ["hello", b"hello", {"a": 1}, None, 5])
def test_payloads_that_are_not_an_iterable_of_them_are_refused_whole(
    queue: LeaseQueue, payloads: Any
) -> None:
    with pytest.raises(ConfigurationError, match="payloads must be an iterable of dicts"):
        queue.enqueue_batch(payloads, queue="docs")
    with pytest.raises(ConfigurationError, match="payloads must be an iterable of dicts"):
        queue.enqueue_many(payloads, queue="docs")
    assert queue.batches() == [] and queue.stats("docs").counts.get("enqueued", 0) == 0


def test_idempotency_keys_given_as_one_string_are_refused(queue: LeaseQueue) -> None:
    with pytest.raises(ConfigurationError, match="idempotency_keys must be an iterable of keys"):
        queue.enqueue_batch([{"n": 1}, {"n": 2}], queue="docs", idempotency_keys="xy")
    assert queue.batches() == []


def test_wait_batch_refuses_a_poll_that_would_spin(queue: LeaseQueue) -> None:
    batch = queue.enqueue_batch([{"n": 1}], queue="docs")
    with pytest.raises(ConfigurationError, match=r"poll_interval must be at least 0\.01"):
        queue.wait_batch(batch.id, timeout=1, poll_interval=1e-9)


def test_a_batch_name_taken_in_another_queue_is_an_error(queue: LeaseQueue) -> None:
    first = queue.enqueue_batch([{"n": 1}], queue="docs", name="nightly")
    taken = r"'nightly' is taken by batch \d+ of queue 'docs'"
    with pytest.raises(ConfigurationError, match=taken):
        queue.enqueue_batch([{"n": 2}], queue="mail", name="nightly")
    again = queue.enqueue_batch([{"n": 3}], queue="docs", name="nightly")
    assert (again.id, again.created) == (first.id, False)
    assert [b.id for b in queue.batches()] == [first.id]
