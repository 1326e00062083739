"""The queue behind a real PgBouncer in transaction mode (see tests/pgbouncer.py).

In transaction mode PgBouncer hands a server connection to another client as soon as a
transaction (or an autocommit statement) ends, so anything a client sets for its session
reaches whoever gets that server connection next. These tests prove that none of the
package's settings leak that way, that claims, renewals, attempts, sweeps and purges work
through PgBouncer with ``prepared_statements=False``, and record what does not work
(LISTEN, prepared statements before PgBouncer 1.21, session SET on a lent connection).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dagster_leasequeue import (
    Lease,
    LeaseLost,
    LeaseQueue,
    LeaseQueueError,
    LeaseQueueSettings,
    migrations,
)
from dagster_leasequeue.sql import listen_statement

from .. import pgbouncer
from ..pgbouncer import DATABASE, DEFAULT_POOL_SIZE, SINGLE_DATABASE, PgBouncer

# Settings the package sets, resets or could leave behind; their value is read with SHOW.
WATCHED = (
    "idle_in_transaction_session_timeout",
    "synchronous_commit",
    "statement_timeout",
    "lock_timeout",
    "search_path",
    "role",
)
# Parameters PgBouncer itself keeps in line with each client's; any other setting whose
# source is 'session' was set by some client and left on the server connection.
_TRACKED_BY_PGBOUNCER = (
    "client_encoding",
    "DateStyle",
    "TimeZone",
    "standard_conforming_strings",
    "application_name",
)
# The stripe a server session counts its batches' finishes in (migration 14) belongs to
# that server session, with the advisory lock it names: every client's transaction on it
# counts there, rightly. It is the one setting of ours meant to stay.
_SERVER_SESSIONS_OWN = (migrations.BATCH_STRIPE_SETTING,)
_SESSION_SETTINGS = (
    "SELECT pg_backend_pid(), "
    + ", ".join(f"current_setting('{name}')" for name in WATCHED[2:])
    + ", coalesce(array_agg(name || '=' || setting) FILTER (WHERE source = 'session'"
    + " AND name <> ALL(ARRAY["
    + ", ".join(f"'{name}'" for name in _TRACKED_BY_PGBOUNCER + _SERVER_SESSIONS_OWN)
    + "])), '{}') FROM pg_settings"
)


@pytest.fixture(scope="module")
def bouncer(dsn: str) -> Iterator[PgBouncer]:
    program = pgbouncer.binary()
    if program is None:
        pytest.skip("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
    if os.geteuid() != 0:
        pytest.skip(
            "needs root: PgBouncer is started as another OS user (-u) that can reach the server"
        )
    server = PgBouncer(program, dsn)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def defaults(dsn: str) -> dict[str, str]:
    """The server's values of the watched settings in a fresh session."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {name: show(conn, name) for name in WATCHED}


@pytest.fixture
def installed(dsn: str, schema_name: str, tmp_path: Path) -> str:
    """The queue's schema, installed directly, with an effects table beside it."""
    with LeaseQueue(dsn, schema=schema_name, settings=queue_settings(tmp_path)) as queue:
        queue.install()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {schema_name}.effects (id bigserial PRIMARY KEY, task_id bigint,"
            " backend_pid int, idle_timeout text)"
        )
    return schema_name


@pytest.fixture
def make_queue(
    bouncer: PgBouncer, installed: str, tmp_path: Path
) -> Iterator[Callable[..., LeaseQueue]]:
    """Queues that reach the server through PgBouncer (``database`` picks the pool)."""
    opened: list[LeaseQueue] = []

    def make(database: str = DATABASE, **overrides: Any) -> LeaseQueue:
        queue = LeaseQueue(
            bouncer.dsn(database), schema=installed, settings=queue_settings(tmp_path, **overrides)
        )
        opened.append(queue)
        return queue

    yield make
    for queue in opened:
        queue.close()


def queue_settings(tmp_path: Path, **overrides: Any) -> LeaseQueueSettings:
    values: dict[str, Any] = {
        "prepared_statements": False,
        "lease_seconds": 30,
        "pool_size": 2,
        "retry_backoff_base": 0,
        "data_dir": tmp_path / "unused",
    }
    return LeaseQueueSettings(**(values | overrides), _env_file=None)


def client(bouncer: PgBouncer, database: str = DATABASE) -> psycopg.Connection[Any]:
    """Another client of PgBouncer: a plain autocommit connection."""
    return psycopg.connect(bouncer.dsn(database), autocommit=True, prepare_threshold=None)


def show(conn: psycopg.Connection[Any], name: str) -> str:
    row = conn.execute(f"SHOW {name}").fetchone()
    assert row is not None
    return str(row[0])


def session_settings(conn: psycopg.Connection[Any]) -> list[str]:
    """Settings some client set for the session of the server connection this query got."""
    row = conn.execute(_SESSION_SETTINGS).fetchone()
    assert row is not None
    return list(row[-1])


class SettingsWatcher(threading.Thread):
    """Another client of PgBouncer that polls the watched settings until stopped."""

    def __init__(self, dsn: str, defaults: dict[str, str]) -> None:
        super().__init__(name="settings-watcher", daemon=True)
        self._dsn = dsn
        self._defaults = defaults
        self._stopped = threading.Event()
        self.polls = 0
        self.backends: set[int] = set()
        self.leaks: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self._dsn, autocommit=True, prepare_threshold=None) as conn:
                while not self._stopped.is_set():
                    self._poll(conn)
        except BaseException as exc:
            self.error = exc

    def _poll(self, conn: psycopg.Connection[Any]) -> None:
        # Three statements: each may get a different server connection.
        for name in WATCHED[:2]:
            value = show(conn, name)
            if value != self._defaults[name]:
                self.leaks.append(f"{name}={value}")
        row = conn.execute(_SESSION_SETTINGS).fetchone()
        assert row is not None
        self.backends.add(int(row[0]))
        for name, value in zip(WATCHED[2:], row[1:-1], strict=True):
            if value != self._defaults[name]:
                self.leaks.append(f"{name}={value}")
        self.leaks.extend(row[-1])
        self.polls += 1

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=30)


# -- no setting reaches another client --------------------------------------------------------

TASKS = 200
WORKERS = 4
LEASE_SECONDS = 2.0
SLOW_EVERY = 25  # every 25th task outlasts a third of its lease: renewed in the background
RENEW_EVERY = 5  # every 5th task renews its lease itself


class Worker(threading.Thread):
    def __init__(self, queue: LeaseQueue) -> None:
        super().__init__(daemon=True)
        self.queue = queue
        self.done = 0
        self.duplicates = 0
        self.lost = 0
        self.renewed = 0
        self.renewed_in_background = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while (lease := self.queue.claim(lease_seconds=LEASE_SECONDS)) is not None:
                try:
                    self._work(lease.payload["n"], lease)
                except LeaseLost:
                    self.lost += 1
        except BaseException as exc:
            self.error = exc

    def _work(self, n: int, lease: Lease) -> None:
        schema = self.queue.schema
        with lease:
            if n % RENEW_EVERY == 0:
                before = lease.expires_at
                if lease.renew() > before:
                    self.renewed += 1
            if n % SLOW_EVERY == 0:
                before = lease.expires_at
                time.sleep(LEASE_SECONDS * 0.6)
                if lease.expires_at > before:
                    self.renewed_in_background += 1
            with self.queue.attempt(lease=lease) as attempt:
                if attempt.duplicate:
                    self.duplicates += 1
                else:
                    attempt.connection.execute(
                        f"INSERT INTO {schema}.effects (task_id, backend_pid, idle_timeout)"
                        " VALUES (%s, pg_backend_pid(),"
                        " current_setting('idle_in_transaction_session_timeout'))",
                        (lease.task_id,),
                    )
                    attempt.result = {"n": n}
        self.done += 1


def test_workers_drain_the_queue_and_no_setting_reaches_another_client(
    bouncer: PgBouncer,
    make_queue: Callable[..., LeaseQueue],
    dsn: str,
    installed: str,
    defaults: dict[str, str],
) -> None:
    producer = make_queue()
    producer.enqueue_many([{"n": n} for n in range(TASKS)])
    watcher = SettingsWatcher(bouncer.dsn(), defaults)
    workers = [Worker(make_queue()) for _ in range(WORKERS)]
    sweeps = 0
    watcher.start()
    try:
        for worker in workers:
            worker.start()
        while any(worker.is_alive() for worker in workers):
            producer.sweep()  # through PgBouncer too, while the workers hold leases
            sweeps += 1
            time.sleep(0.2)
        servers = [row for row in bouncer.admin("SHOW SERVERS") if row["database"] == DATABASE]
    finally:
        for worker in workers:
            worker.join(timeout=60)
        watcher.stop()

    assert [worker.error for worker in workers] == [None] * WORKERS
    assert watcher.error is None
    # Every effect exactly once, every task done.
    with psycopg.connect(dsn, autocommit=True) as conn:
        counts = conn.execute(
            f"SELECT task_id, count(*) FROM {installed}.effects GROUP BY task_id"
        ).fetchall()
        statuses: dict[str, int] = dict(
            conn.execute(f"SELECT status, count(*) FROM {installed}.tasks GROUP BY 1").fetchall()
        )
        in_attempts = conn.execute(
            f"SELECT array_agg(DISTINCT idle_timeout), array_agg(DISTINCT backend_pid)"
            f" FROM {installed}.effects"
        ).fetchone()
    assert len(counts) == TASKS
    assert {count for _, count in counts} == {1}
    assert statuses == {"done": TASKS}
    assert sum(worker.done + worker.lost for worker in workers) >= TASKS
    assert sweeps > 0
    # The other client never saw a setting of ours, in many polls.
    assert watcher.leaks == []
    assert watcher.polls > 200, watcher.polls
    # The attempts' own setting was in force inside each of their transactions.
    assert in_attempts is not None
    assert in_attempts[0] == [f"{int(LEASE_SECONDS)}s"]
    # The server connections were shared: the pool's few served every client (each queue
    # keeps several), and the watcher ran on those the attempts ran on.
    attempt_backends = set(in_attempts[1])
    assert len(attempt_backends) <= DEFAULT_POOL_SIZE
    assert len(servers) <= DEFAULT_POOL_SIZE
    assert watcher.backends & attempt_backends
    # Renewals really happened, both ways.
    assert sum(worker.renewed for worker in workers) == TASKS // RENEW_EVERY
    assert sum(worker.renewed_in_background for worker in workers) > 0


@pytest.mark.parametrize("outcome", ["commit", "error", "duplicate"])
def test_an_attempts_idle_timeout_stays_in_its_transaction(
    bouncer: PgBouncer,
    make_queue: Callable[..., LeaseQueue],
    defaults: dict[str, str],
    outcome: str,
) -> None:
    """With one server connection for all clients, another client runs on the attempt's
    server connection between the attempt's statements; it must see only the defaults.

    Before the setting moved into the attempt's transaction (``SET LOCAL``), it was set for
    the session by the attempt's first statement, and this client saw it.
    """
    queue = make_queue(SINGLE_DATABASE)
    other = client(bouncer, SINGLE_DATABASE)
    task_id = queue.enqueue({"n": 1})
    lease = queue.claim(lease_seconds=3)
    assert lease is not None
    key = f"task-{task_id}"
    if outcome == "duplicate":
        with queue.attempt(key, lease=lease):
            pass
        lease = None
    expected: AbstractContextManager[Any] = (
        pytest.raises(RuntimeError) if outcome == "error" else nullcontext()
    )
    with expected, queue.attempt(key, lease=lease) as attempt:
        assert attempt.duplicate is (outcome == "duplicate")
        # The attempt is recorded; its transaction has not begun.
        for name in ("idle_in_transaction_session_timeout", "synchronous_commit"):
            assert show(other, name) == defaults[name], name
        assert session_settings(other) == []
        if outcome != "duplicate":
            # The attempt's transaction begins: its idle timeout is in force in it.
            inside = show(attempt.connection, "idle_in_transaction_session_timeout")
            assert inside == "3s"
        if outcome == "error":
            raise RuntimeError("the work failed")
    for name in WATCHED:
        assert show(other, name) == defaults[name], name
    assert session_settings(other) == []
    other.close()


# -- what works in transaction mode, and what does not ----------------------------------------


def test_enqueue_claim_sweep_purge_and_install_work(
    make_queue: Callable[..., LeaseQueue],
) -> None:
    queue = make_queue()
    assert queue.install() == 0  # already current: only reads
    ids = queue.enqueue_many([{"n": n} for n in range(3)])
    task_id = queue.enqueue({"n": 3}, idempotency_key="once")
    assert queue.enqueue({"n": 3}, idempotency_key="once") == task_id
    leases = queue.claim_many(4, lease_seconds=0.2)
    assert sorted(lease.task_id for lease in leases) == sorted([*ids, task_id])
    time.sleep(0.4)
    recovered = queue.sweep()
    assert sorted(task.task_id for task in recovered) == sorted([*ids, task_id])
    assert len(queue.recovery_events()) == 4
    for lease in leases:
        with pytest.raises(LeaseLost):
            lease.ack()
    while (again := queue.claim()) is not None:
        with again:
            pass
    assert queue.stats().counts["done"] == 4
    assert queue.purge(older_than=0) == 4
    assert queue.stats().total == 0


def test_a_batch_acked_by_clients_sharing_server_connections_is_counted_right(
    bouncer: PgBouncer, make_queue: Callable[..., LeaseQueue]
) -> None:
    """A batch task's ack counts in the stripe of the server connection it ran on (a
    session-level advisory lock and the setting that names it): whichever client's
    transaction gets that connection next counts in the same stripe, as it should, since
    the stripe belongs to the server session. That setting is the only one a server
    connection keeps."""
    producer = make_queue()
    batch = producer.enqueue_batch(({"n": n} for n in range(200)), queue="docs")

    def drain(queue: LeaseQueue) -> None:
        while (lease := queue.claim(queue="docs")) is not None:
            lease.ack()

    queues = [make_queue() for _ in range(4)]
    threads = [threading.Thread(target=drain, args=(queue,)) for queue in queues]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    info = producer.batch(batch.id)
    assert info.finished and info.done == 200 and info.total == 200
    with client(bouncer) as other:
        for _ in range(2 * DEFAULT_POOL_SIZE):
            assert session_settings(other) == []
            kept = other.execute(
                "SELECT array_agg(name) FROM pg_settings"
                " WHERE source = 'session' AND name LIKE 'leasequeue.%'"
            ).fetchone()
            assert kept is not None and kept[0] in (None, list(_SERVER_SESSIONS_OWN))


def test_listen_gets_no_notification_through_pgbouncer(
    bouncer: PgBouncer, make_queue: Callable[..., LeaseQueue], dsn: str, installed: str
) -> None:
    """Measured: LISTEN runs on a server connection that the listener gives back at once;
    a notification arriving there later goes to whichever client holds it then, or is
    dropped (PgBouncer logs "got packet 'A' from server when not linked")."""
    through_bouncer = client(bouncer)
    direct = psycopg.connect(dsn, autocommit=True)
    for listener in (through_bouncer, direct):
        listener.execute(listen_statement(installed))
    make_queue().enqueue({"n": 1})  # sends the NOTIFY, through PgBouncer
    assert len(list(direct.notifies(timeout=5, stop_after=1))) == 1
    assert list(through_bouncer.notifies(timeout=1.5, stop_after=1)) == []
    through_bouncer.close()
    direct.close()


@pytest.mark.parametrize("delay", [0.3, 0.8])
def test_a_waiting_claim_finds_a_new_task_by_polling(
    make_queue: Callable[..., LeaseQueue], delay: float
) -> None:
    """``claim(wait=...)`` is never woken by the enqueue's NOTIFY through PgBouncer, but
    looks again every second: a task enqueued while it waits is claimed at most about a
    second later (directly: within milliseconds)."""
    waiting = make_queue()
    producer = make_queue()
    claimed: list[tuple[Lease | None, float]] = []
    thread = threading.Thread(
        target=lambda: claimed.append((waiting.claim(wait=5), time.monotonic()))
    )
    thread.start()
    time.sleep(delay)
    enqueued_at = time.monotonic()
    task_id = producer.enqueue({"n": 1})
    thread.join(timeout=10)
    [(lease, claimed_at)] = claimed
    assert lease is not None and lease.task_id == task_id
    # One poll interval (1 s), with room for a busy machine.
    assert claimed_at - enqueued_at < 2.0
    lease.ack()


def test_lent_connections_share_their_server_connection(
    bouncer: PgBouncer, make_queue: Callable[..., LeaseQueue], defaults: dict[str, str]
) -> None:
    """A session-level SET on ``queue.connection()`` reaches other clients while lent (one
    server connection here; with more, the closing RESET ALL may even run on another).
    SET LOCAL inside a transaction stays private."""
    queue = make_queue(SINGLE_DATABASE)
    other = client(bouncer, SINGLE_DATABASE)
    with queue.connection() as conn:
        conn.execute("SET statement_timeout = '7s'")
        assert show(other, "statement_timeout") == "7s"
    assert show(other, "statement_timeout") == defaults["statement_timeout"]
    with queue.connection() as conn:
        with conn.transaction():
            conn.execute("SET LOCAL statement_timeout = '7s'")
            assert show(conn, "statement_timeout") == "7s"
        assert show(other, "statement_timeout") == defaults["statement_timeout"]
    assert session_settings(other) == []
    other.close()


def clients_preparing_on_one_server_connection(
    bouncer: PgBouncer, make_queue: Callable[..., LeaseQueue]
) -> list[LeaseQueue]:
    """Two clients with prepared statements on, sharing PgBouncer's one server connection;
    skipped from 1.21 on, which tracks prepared statements."""
    if tuple(int(part) for part in bouncer.version.split(".")[:2]) >= (1, 21):
        pytest.skip(f"PgBouncer {bouncer.version} can track prepared statements")
    return [make_queue(SINGLE_DATABASE, prepared_statements=True) for _ in range(2)]


def test_prepared_statements_must_be_off_before_pgbouncer_1_21(
    bouncer: PgBouncer, make_queue: Callable[..., LeaseQueue]
) -> None:
    """Two clients on one server connection both prepare psycopg's ``_pg3_0``."""
    prepared = clients_preparing_on_one_server_connection(bouncer, make_queue)
    task_id = prepared[0].enqueue({"n": 1})
    with pytest.raises(LeaseQueueError, match='prepared statement "_pg3_0" already exists'):
        for _ in range(10):
            for queue in prepared:
                queue.get(task_id)
    unprepared = [make_queue(SINGLE_DATABASE) for _ in range(2)]
    for _ in range(10):
        for queue in unprepared:
            assert queue.get(task_id).status == "enqueued"


def test_the_worker_loops_statements_too_need_prepared_statements_off_before_1_21(
    bouncer: PgBouncer, make_queue: Callable[..., LeaseQueue]
) -> None:
    """The claim, the ack and ``ack_and_claim`` are prepared by name as well (fastpath.py)."""
    prepared = clients_preparing_on_one_server_connection(bouncer, make_queue)
    prepared[0].enqueue_many([{"n": n} for n in range(20)])
    with pytest.raises(LeaseQueueError, match='prepared statement "_leasequeue_1" already exists'):
        for _ in range(10):
            for queue in prepared:
                lease = queue.claim()
                assert lease is not None
                lease.ack()
    unprepared = [make_queue(SINGLE_DATABASE) for _ in range(2)]
    unprepared[0].enqueue_many([{"n": n} for n in range(20)])
    for _ in range(5):
        for queue in unprepared:
            lease = queue.claim()
            assert lease is not None
            assert lease.ack_and_claim() is not None


def test_a_statement_held_up_by_a_lock_is_cancelled_through_pgbouncer(
    make_queue: Callable[..., LeaseQueue], dsn: str, installed: str
) -> None:
    """The bound on the worker loop's round trips (bounded.py) cancels through PgBouncer,
    which passes the cancel on to the server connection that runs the statement: the
    ack raises within its bound, the client connection stays usable, and nothing else on
    the server connection is cancelled."""
    queue = make_queue(network_timeout=1)
    task_id = queue.enqueue({"n": 1})
    lease = queue.claim()
    assert lease is not None
    with psycopg.connect(dsn) as holder:
        holder.execute(f"SELECT 1 FROM {installed}.tasks WHERE id = %s FOR UPDATE", (task_id,))
        started = time.monotonic()
        with pytest.raises(LeaseQueueError, match="cancelled the statement"):
            lease.ack()
        assert time.monotonic() - started < 4
        holder.rollback()
    lease.ack()
    assert queue.get(task_id).status == "done"
    assert queue.enqueue({"n": 2}) > task_id
