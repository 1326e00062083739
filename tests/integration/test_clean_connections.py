"""A kept connection is handed out clean: what a borrower left on it is gone for the next.

Connections are reused last in, first out, so a single-threaded worker's next borrower
gets the connection its previous borrower had. Each test lends the connection of a
one-connection queue through the public API, leaves something on it, and checks that the
next borrower (the same server session) finds it clean and that the queue still works.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import psycopg
import pytest
from psycopg import IsolationLevel
from psycopg.abc import Buffer
from psycopg.rows import dict_row
from psycopg.types import TypeInfo
from psycopg.types.string import StrDumper, TextLoader

from dagster_leasequeue import LeaseQueue

from ..helpers import run_sql

Lend = Callable[[LeaseQueue], AbstractContextManager[psycopg.Connection[Any]]]


@contextmanager
def _by_connection(queue: LeaseQueue) -> Iterator[psycopg.Connection[Any]]:
    with queue.connection() as conn:
        yield conn


@contextmanager
def _by_attempt(queue: LeaseQueue) -> Iterator[psycopg.Connection[Any]]:
    with queue.attempt(f"work-{uuid.uuid4().hex}") as attempt:
        yield attempt.connection


@pytest.fixture(params=[_by_connection, _by_attempt], ids=["connection", "attempt"])
def lend(request: pytest.FixtureRequest) -> Lend:
    """How the connection is lent: ``queue.connection()`` or ``attempt.connection``."""
    lender: Lend = request.param
    return lender


@pytest.fixture
def small(make_queue: Callable[..., LeaseQueue]) -> LeaseQueue:
    """A queue of one connection: every borrower gets the same one."""
    queue = make_queue(pool_size=1)
    queue.install()
    with queue.connection() as conn:
        conn.execute(f'CREATE TABLE "{queue.schema}".effects (n int)')
    return queue


def backend_pid(queue: LeaseQueue) -> int:
    with queue.connection() as conn:
        return conn.info.backend_pid


@contextmanager
def next_borrower(queue: LeaseQueue, pid: int) -> Iterator[psycopg.Connection[Any]]:
    """The next loan, checked to be of the same server session as the last one."""
    with queue.connection() as conn:
        assert conn.info.backend_pid == pid
        yield conn


def assert_queue_works(queue: LeaseQueue) -> None:
    """A task goes through: enqueued, read back, claimed, its effect written in an attempt."""
    name = f"check-{uuid.uuid4().hex}"
    task_id = queue.enqueue({"doc": "a"}, queue=name, idempotency_key="a")
    info = queue.get(task_id)
    assert (info.task_id, info.status, info.payload) == (task_id, "enqueued", {"doc": "a"})
    lease = queue.claim(queue=name)
    assert lease is not None and lease.task_id == task_id
    with queue.attempt(lease=lease) as attempt:
        assert not attempt.duplicate
        attempt.connection.execute(f'INSERT INTO "{queue.schema}".effects VALUES (1)')
        attempt.result = {"rows": 1}
    done = queue.get(task_id)
    assert (done.status, done.result) == ("done", {"rows": 1})


# -- server session -----------------------------------------------------------------------


def test_a_temp_table_does_not_outlive_the_loan(small: LeaseQueue, lend: Lend) -> None:
    pid = backend_pid(small)
    with lend(small) as conn:
        conn.execute("CREATE TEMP TABLE staging (n int)")
        conn.execute("INSERT INTO staging VALUES (1)")
    # The next task's own staging table: "already exists" if the last one was left.
    task_id = small.enqueue({"doc": "b"})
    lease = small.claim()
    assert lease is not None and lease.task_id == task_id
    with small.attempt(lease=lease) as attempt:
        assert attempt.connection.info.backend_pid == pid
        attempt.connection.execute("CREATE TEMP TABLE staging (n int)")
        count = attempt.connection.execute("SELECT count(*) FROM staging").fetchone()
        assert count == (0,)
    assert small.get(task_id).status == "done"
    with next_borrower(small, pid) as conn:
        assert conn.execute("SELECT to_regclass('pg_temp.staging')").fetchone() == (None,)
    assert_queue_works(small)


def test_a_with_hold_cursor_does_not_outlive_the_loan(small: LeaseQueue, lend: Lend) -> None:
    pid = backend_pid(small)
    with lend(small) as conn:
        conn.execute("DECLARE held CURSOR WITH HOLD FOR SELECT generate_series(1, 3)")
    with next_borrower(small, pid) as conn:
        assert conn.execute("SELECT count(*) FROM pg_cursors").fetchone() == (0,)
        conn.execute("DECLARE held CURSOR WITH HOLD FOR SELECT 1")
    with next_borrower(small, pid) as conn:
        assert conn.execute("SELECT count(*) FROM pg_cursors").fetchone() == (0,)
    assert_queue_works(small)


def test_a_prepared_statement_of_the_borrower_does_not_outlive_the_loan(
    small: LeaseQueue, lend: Lend
) -> None:
    pid = backend_pid(small)
    # Enough of the queue's own statements that psycopg prepares some of them.
    for _ in range(3):
        assert_queue_works(small)
    ours = "SELECT name FROM pg_prepared_statements WHERE NOT from_sql ORDER BY name"
    with next_borrower(small, pid) as conn:
        prepared_by_psycopg = conn.execute(ours).fetchall()
    assert prepared_by_psycopg  # prepared_statements is on by default
    with lend(small) as conn:
        conn.execute("PREPARE mine (int) AS SELECT $1 + 1")
        assert conn.execute("EXECUTE mine (1)").fetchone() == (2,)
    with next_borrower(small, pid) as conn:
        from_sql = "SELECT count(*) FROM pg_prepared_statements WHERE from_sql"
        assert conn.execute(from_sql).fetchone() == (0,)
        conn.execute("PREPARE mine (int) AS SELECT $1 + 2")  # "already exists" if left
        # psycopg's own prepared statements are kept, and its cache still matches them.
        assert set(prepared_by_psycopg) <= set(conn.execute(ours).fetchall())
    with next_borrower(small, pid) as conn:
        assert conn.execute(from_sql).fetchone() == (0,)
    assert_queue_works(small)


def test_a_role_without_rights_on_the_schema_does_not_keep_the_session_from_its_reset(
    small: LeaseQueue,
) -> None:
    # The reset's function lives in the queue's schema, which pg_monitor may not use: the
    # role is reset before the function is called, or the reset fails and the connection
    # is dropped instead of handed on clean.
    pid = backend_pid(small)
    user = run_sql(small, "SELECT session_user")[0][0]
    with small.connection() as conn:
        conn.execute("CREATE TEMP TABLE staging (n int)")
        conn.execute("SET ROLE pg_monitor")
        assert conn.execute("SELECT current_user").fetchone() == ("pg_monitor",)
    with next_borrower(small, pid) as conn:
        assert conn.execute("SELECT current_user").fetchone() == (user,)
        assert conn.execute("SELECT to_regclass('pg_temp.staging')").fetchone() == (None,)
    assert_queue_works(small)


def test_the_schemas_reset_session_undoes_what_a_session_was_left_with(
    dsn: str, queue: LeaseQueue
) -> None:
    queue.install()
    schema = f'"{queue.schema}"'
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn) as other:
        conn.execute("SET work_mem = '7MB'")
        conn.execute("SET search_path = nowhere")
        conn.execute("LISTEN left_behind")
        conn.execute("PREPARE mine AS SELECT 1")
        conn.execute("CREATE TEMP TABLE staging (n int)")
        conn.execute("DECLARE held CURSOR WITH HOLD FOR SELECT 1")
        conn.execute("SELECT pg_advisory_lock(4243)")
        (names,) = conn.execute(f"SELECT {schema}.reset_session()").fetchone() or (None,)
        assert names == ["mine"]  # dropped by the caller, which keeps its own statements
        for setting in ("work_mem", "search_path"):
            shown = f"SHOW {setting}"
            assert conn.execute(shown).fetchone() == other.execute(shown).fetchone()
        assert conn.execute("SELECT pg_listening_channels()").fetchall() == []
        assert conn.execute("SELECT to_regclass('pg_temp.staging')").fetchone() == (None,)
        assert conn.execute("SELECT count(*) FROM pg_cursors").fetchone() == (0,)
        assert other.execute("SELECT pg_try_advisory_lock(4243)").fetchone() == (True,)


# -- psycopg client attributes -------------------------------------------------------------


def test_a_row_factory_does_not_outlive_the_loan(small: LeaseQueue, lend: Lend) -> None:
    pid = backend_pid(small)
    task_id = small.enqueue({"doc": "a"})
    with lend(small) as conn:
        conn.row_factory = dict_row
    # get() builds its TaskInfo out of a row: out of column names under dict_row.
    info = small.get(task_id)
    assert (info.task_id, info.status, info.payload) == (task_id, "enqueued", {"doc": "a"})
    with next_borrower(small, pid) as conn:
        assert conn.execute("SELECT 1 AS one").fetchone() == (1,)
    assert_queue_works(small)


def test_a_cursor_factory_does_not_outlive_the_loan(small: LeaseQueue, lend: Lend) -> None:
    pid = backend_pid(small)
    with lend(small) as conn:
        conn.cursor_factory = psycopg.ClientCursor
        conn.server_cursor_factory = _OtherServerCursor
    with next_borrower(small, pid) as conn:
        assert type(conn.cursor()) is psycopg.Cursor
        assert type(conn.cursor("named")) is psycopg.ServerCursor
    assert_queue_works(small)


class _OtherServerCursor(psycopg.ServerCursor[Any]):
    pass


def test_read_only_does_not_outlive_the_loan(small: LeaseQueue, lend: Lend) -> None:
    pid = backend_pid(small)
    with lend(small) as conn:
        conn.read_only = True
    with next_borrower(small, pid) as conn:
        assert conn.read_only is None
    # Every attempt's write would fail in a READ ONLY transaction.
    assert_queue_works(small)


def test_an_isolation_level_does_not_outlive_the_loan(small: LeaseQueue, lend: Lend) -> None:
    pid = backend_pid(small)
    with lend(small) as conn:
        conn.isolation_level = IsolationLevel.SERIALIZABLE
    with next_borrower(small, pid) as conn:
        assert conn.isolation_level is None
    with small.attempt(f"work-{uuid.uuid4().hex}") as attempt:
        level = attempt.connection.execute("SHOW transaction_isolation").fetchone()
        assert level == ("read committed",)
    assert_queue_works(small)


def test_deferrable_does_not_outlive_the_loan(small: LeaseQueue, lend: Lend) -> None:
    pid = backend_pid(small)
    with lend(small) as conn:
        conn.deferrable = True
    with next_borrower(small, pid) as conn:
        assert conn.deferrable is None
    assert_queue_works(small)


def test_autocommit_does_not_outlive_the_loan(dsn: str, small: LeaseQueue, lend: Lend) -> None:
    pid = backend_pid(small)
    with lend(small) as conn:
        conn.autocommit = not conn.autocommit
    with next_borrower(small, pid) as conn:
        assert conn.autocommit is True
    task_id = small.enqueue({"doc": "a"})
    # Committed: another session sees it.
    with psycopg.connect(dsn, autocommit=True) as other:
        status = other.execute(
            f'SELECT status FROM "{small.schema}".tasks WHERE id = %s', (task_id,)
        ).fetchone()
    assert status == ("enqueued",)
    assert_queue_works(small)


@pytest.mark.parametrize("prepared_statements", [True, False])
def test_a_prepare_threshold_does_not_outlive_the_loan(
    make_queue: Callable[..., LeaseQueue], lend: Lend, prepared_statements: bool
) -> None:
    queue = make_queue(pool_size=1, prepared_statements=prepared_statements)
    queue.install()
    with queue.connection() as conn:
        conn.execute(f'CREATE TABLE "{queue.schema}".effects (n int)')
        pid = conn.info.backend_pid
        configured = conn.prepare_threshold
        max_prepared = conn.prepared_max
    assert (configured is None) is not prepared_statements
    with lend(queue) as conn:
        # Off where it was on; preparing everything where it was off.
        conn.prepare_threshold = None if prepared_statements else 0
        conn.prepared_max = 1
    with next_borrower(queue, pid) as conn:
        assert (conn.prepare_threshold, conn.prepared_max) == (configured, max_prepared)
    for _ in range(3):
        assert_queue_works(queue)
    if not prepared_statements:
        # Behind PgBouncer in transaction mode nothing may be prepared on the server.
        with next_borrower(queue, pid) as conn:
            prepared = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
            assert prepared == (0,)


class _ShoutingDumper(StrDumper):
    def dump(self, obj: str) -> Buffer | None:
        return super().dump(obj.upper())


def test_adapters_do_not_outlive_the_loan(small: LeaseQueue, lend: Lend) -> None:
    pid = backend_pid(small)
    task_id = small.enqueue({"doc": "a"})
    with lend(small) as conn:
        conn.adapters.register_loader("int8", TextLoader)
        conn.adapters.register_loader("jsonb", TextLoader)
        conn.adapters.register_dumper(str, _ShoutingDumper)
    info = small.get(task_id)
    assert (info.task_id, info.payload) == (task_id, {"doc": "a"})
    with next_borrower(small, pid) as conn:
        row = conn.execute("SELECT 7::int8, %s::text, '{}'::jsonb", ["quiet"]).fetchone()
        assert row == (7, "quiet", {})
    # Through an attempt, the cursor the queue made to conclude it took the borrower's
    # dumper: the next attempt's result would be stored as {"ROWS": 1} if it were kept.
    assert_queue_works(small)


def test_a_registered_type_does_not_outlive_the_loan(small: LeaseQueue, lend: Lend) -> None:
    pid = backend_pid(small)
    with lend(small) as conn:
        info = TypeInfo.fetch(conn, "int4")
        assert info is not None
        info.name = "renamed_int4"
        info.register(conn)
    with next_borrower(small, pid) as conn:
        assert conn.adapters.types.get("renamed_int4") is None
    assert_queue_works(small)


def test_a_notice_handler_does_not_outlive_the_loan(small: LeaseQueue, lend: Lend) -> None:
    pid = backend_pid(small)
    heard: list[str] = []
    with lend(small) as conn:
        conn.add_notice_handler(lambda diag: heard.append(diag.message_primary or ""))
    with next_borrower(small, pid) as conn:
        conn.execute("DO $$BEGIN RAISE NOTICE 'for the next borrower'; END$$")
    assert heard == []
    assert_queue_works(small)
