"""The connections a queue keeps between statements: reused, shared by threads, recovered."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from dagster_leasequeue import DatabaseUnavailable, LeaseQueue, LeaseQueueSettings
from dagster_leasequeue.connection import CachedConnection

from ..helpers import run_sql
from ..own_server import OwnServer


def backend_pid(queue: LeaseQueue) -> int:
    with queue.connection() as conn:
        return conn.info.backend_pid


def live_backends(dsn: str, pids: set[int]) -> set[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s)", (list(pids),)
        ).fetchall()
    return {int(row[0]) for row in rows}


def test_one_worker_claims_and_acks_on_one_connection(queue: LeaseQueue) -> None:
    queue.enqueue_many([{"n": n} for n in range(20)])
    pids = {backend_pid(queue)}
    while (lease := queue.claim()) is not None:
        lease.ack()
        pids.add(backend_pid(queue))
    assert len(pids) == 1


def test_threads_share_the_pool_without_waiting_on_each_other(
    make_queue: Callable[..., LeaseQueue],
) -> None:
    queue = make_queue(pool_size=2)
    queue.install()
    queue.enqueue_many([{"n": n} for n in range(200)])
    errors: list[BaseException] = []
    pids: set[int] = set()

    def work() -> None:
        try:
            while (lease := queue.claim()) is not None:
                lease.ack()
                pids.add(backend_pid(queue))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert queue.stats().counts["done"] == 200
    assert 1 <= len(pids) <= 2  # never more connections than pool_size


def test_a_statement_left_in_a_transaction_is_rolled_back_not_reused(queue: LeaseQueue) -> None:
    with queue._driver.connection() as conn:
        conn.execute("BEGIN")
        conn.execute(f'CREATE TABLE "{queue.schema}".half_done (n int)')
    assert run_sql(queue, "SELECT to_regclass('{schema}.half_done')") == [(None,)]
    assert run_sql(queue, "SELECT 1") == [(1,)]


def test_a_connection_killed_while_idle_costs_one_call(dsn: str, queue: LeaseQueue) -> None:
    pid = backend_pid(queue)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    deadline = time.monotonic() + 5
    while pid in live_backends(dsn, {pid}) and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(DatabaseUnavailable):
        queue.enqueue({"n": 1})
    task_id = queue.enqueue({"n": 2})
    assert queue.get(task_id).status == "enqueued"


def test_close_ends_every_connection_the_queue_kept(dsn: str, queue: LeaseQueue) -> None:
    queue.enqueue({"n": 1})
    lease = queue.claim()
    assert lease is not None
    lease.ack()
    pids = {backend_pid(queue)}
    assert live_backends(dsn, pids) == pids
    queue.close()
    deadline = time.monotonic() + 5
    while live_backends(dsn, pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_backends(dsn, pids) == set()


def test_a_lent_connection_left_out_of_autocommit_does_not_swallow_writes(
    make_queue: Callable[..., LeaseQueue],
) -> None:
    queue = make_queue(pool_size=1)
    queue.install()
    with queue.connection() as conn:
        conn.autocommit = False
        conn.execute("SELECT 1")
        conn.commit()
    task_id = queue.enqueue({"n": 1})
    other = make_queue(pool_size=1)
    assert other.get(task_id).status == "enqueued"


def test_autocommit_changes_as_psycopg_changes_it_on_a_lent_connection(
    make_queue: Callable[..., LeaseQueue],
) -> None:
    # The queue's connections change the flag without a trip through wait() when idle; in
    # a transaction the change is refused, and in a pipeline it syncs first, as psycopg's.
    queue = make_queue(pool_size=1)
    queue.install()
    with queue.connection() as conn:
        before = conn.round_trips  # type: ignore[attr-defined]
        conn.autocommit = False
        assert not conn.autocommit
        assert conn.round_trips == before + 1  # type: ignore[attr-defined]
        conn.execute("SELECT 1")
        with pytest.raises(psycopg.ProgrammingError, match="autocommit"):
            conn.autocommit = True
        conn.rollback()
        with conn.pipeline():
            conn.autocommit = True
        assert conn.autocommit
        conn.execute("CREATE TEMP TABLE written_in_autocommit ()")
    with queue.connection() as conn:
        assert conn.autocommit


def test_a_role_and_locks_taken_on_a_lent_connection_do_not_outlive_the_loan(
    dsn: str, make_queue: Callable[..., LeaseQueue]
) -> None:
    queue = make_queue(pool_size=1)
    queue.install()
    user = run_sql(queue, "SELECT current_user")[0][0]
    with queue.connection() as conn:
        conn.execute("SET ROLE pg_monitor")
        conn.execute("SELECT pg_advisory_lock(4242)")
    assert run_sql(queue, "SELECT current_user") == [(user,)]
    with psycopg.connect(dsn, autocommit=True) as other:
        taken = other.execute("SELECT pg_try_advisory_lock(4242)").fetchone()
        assert taken == (True,)
        other.execute("SELECT pg_advisory_unlock(4242)")


def test_connections_kept_past_their_time_go_back_to_the_pool(queue: LeaseQueue) -> None:
    queue._driver._connections.REFRESH_SECONDS = 0.0  # every kept connection is due back at once
    queue.enqueue_many([{"n": n} for n in range(5)])
    while (lease := queue.claim()) is not None:
        lease.ack()
    assert queue.stats().counts["done"] == 5
    stats = queue._driver._pool.get_stats()
    assert stats.get("connections_num", 1) <= queue.settings.pool_size


def test_each_statement_keeps_its_own_cursor_and_results_stay_apart(queue: LeaseQueue) -> None:
    with queue._driver.statements() as cached:
        statements = [
            f"SELECT {n}::int + %(x)s::int" for n in range(CachedConnection.MAX_CURSORS + 3)
        ]
        for _ in range(2):  # a second pass reuses each statement's cursor
            cursors = [cached.execute(text, {"x": 1}) for text in statements]
        # The first MAX_CURSORS statements have a cursor each; the rest share one.
        kept = cursors[: CachedConnection.MAX_CURSORS]
        assert len({id(cursor) for cursor in kept}) == len(kept)
        assert len({id(cursor) for cursor in cursors[CachedConnection.MAX_CURSORS :]}) == 1
        # Running one statement leaves the results of the others unread and intact.
        assert [cursor.fetchone() for cursor in kept] == [(n + 1,) for n in range(len(kept))]


def test_a_call_while_the_server_is_down_fails_within_its_timeouts(tmp_path: Path) -> None:
    server = OwnServer(tmp_path)
    server.start()
    settings = LeaseQueueSettings(
        lease_seconds=3, connect_timeout=2, data_dir=tmp_path / "unused", _env_file=None
    )
    queue = LeaseQueue(server.dsn, settings=settings)
    try:
        queue.install()
        server.crash()
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable):
            queue.stats()
        with pytest.raises(DatabaseUnavailable):
            queue.enqueue({"n": 1})
        # One connect attempt and one network timeout each, not the pool's old 30 s.
        assert time.monotonic() - started < 2 * (2 + 3) + 4
    finally:
        queue.close()
        with contextlib.suppress(Exception):
            server.stop()
