"""The pool, the connections the queue keeps between statements, and password-free errors."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Protocol

import psycopg
from psycopg import Transaction, errors as pg_errors, generators, pq
from psycopg.abc import Params, PQGen
from psycopg_pool import ConnectionPool, PoolTimeout

from . import sql
from .dsn import describe, redact
from .errors import DatabaseUnavailable, LeaseQueueError, TransactionAbandoned
from .payloads import JsonbLoader
from .schema import not_installed

logger = logging.getLogger("dagster_leasequeue")


def connection_options(*, connect_timeout: float, prepared_statements: bool) -> dict[str, Any]:
    """Keyword arguments for every connection the package opens."""
    # libpq counts whole seconds and treats values below 2 as 2.
    options: dict[str, Any] = {
        "autocommit": True,
        "connect_timeout": max(2, math.ceil(connect_timeout)),
        # Notice a peer that vanished (a crashed host, a dropped network path) within about
        # a minute instead of the kernel's default hours, so a worker's renewals and claims
        # fail and it can stop, rather than hang.
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
    }
    if not prepared_statements:
        options["prepare_threshold"] = None
    return options


class QueueConnection(psycopg.Connection[Any]):
    """The class of the pool's connections: psycopg's, with one change inside an attempt.

    An attempt's transaction begins with its first statement, so that work done before
    writing holds no transaction open. psycopg makes a ``transaction()`` block entered
    before any statement the outer transaction, and commits it when the block ends: the
    effects would commit before the attempt's success mark, and again on a retry. Inside
    an attempt, such a block first begins the attempt's transaction, and so becomes a
    savepoint within it.

    The attempt's own settings (``attempt_settings``) travel with the ``BEGIN`` psycopg
    sends, as ``SET LOCAL``: they end with the transaction, so behind PgBouncer in
    transaction mode they never reach the next client of the server connection, and they
    are always in force on the server connection that runs the attempt's transaction.
    """

    # Statements sent in the same simple query as the attempt's BEGIN; None outside one.
    attempt_settings: bytes | None = None

    def _start_query(self) -> PQGen[None]:
        if (
            self.attempt_settings is None
            or self.autocommit
            or self.pgconn.transaction_status != _IDLE
        ):
            yield from super()._start_query()
            return
        if self._pipeline:
            # A pipeline queues each command on its own: no round trip to save.
            yield from super()._start_query()
            yield from self._exec_command(self.attempt_settings)
            return
        # psycopg sends its BEGIN as a command of one statement; the settings go in the
        # same simple query, so the attempt's transaction costs no extra round trip.
        self._check_connection_ok()
        self.pgconn.send_query(self._get_tx_start_command() + b"; " + self.attempt_settings)
        for result in (yield from generators.execute(self.pgconn)):
            if result.status == pq.ExecStatus.FATAL_ERROR:
                raise pg_errors.error_from_result(result, encoding=self.pgconn._encoding)

    @contextmanager
    def transaction(
        self, savepoint_name: str | None = None, force_rollback: bool = False
    ) -> Iterator[Transaction]:
        if self.attempt_settings is not None and self.pgconn.transaction_status == _IDLE:
            # Any statement makes psycopg send the BEGIN of the attempt's transaction.
            self.execute(sql.NO_OP)
        with super().transaction(savepoint_name, force_rollback) as transaction:
            yield transaction


def open_pool(
    dsn: str, *, pool_size: int, connect_timeout: float, options: dict[str, Any], name: str
) -> ConnectionPool[QueueConnection]:
    """Open a pool of autocommit connections, failing fast with a clear error.

    One direct connection is made first: a pool retries a bad DSN in the background until
    its timeout and keeps the reason to its log, while the user needs the reason now.
    """
    where = describe(dsn)
    failure = None
    try:
        psycopg.connect(dsn, **options).close()
    except psycopg.Error as exc:
        failure = redact(str(exc).strip(), dsn)
    # Raised outside the except block: the driver's error, which may quote the DSN, must
    # not travel along as the new error's __context__.
    if failure is not None:
        raise DatabaseUnavailable(f"cannot connect to PostgreSQL at {where}: {failure}")
    pool = ConnectionPool(
        dsn,
        connection_class=QueueConnection,
        min_size=1,
        max_size=pool_size,
        kwargs=options,
        reset=_restore_autocommit,
        timeout=max(connect_timeout, 30.0),
        reconnect_timeout=max(connect_timeout * 12, 60.0),
        name=name,
        open=False,
    )
    try:
        pool.open(wait=True, timeout=connect_timeout)
    except PoolTimeout:
        pool.close()
        raise DatabaseUnavailable(
            f"cannot connect to PostgreSQL at {where} within {connect_timeout:g} s"
        ) from None
    return pool


def _restore_autocommit(conn: psycopg.Connection[Any]) -> None:
    # The pool hands this connection to the queue's own statements next, which expect
    # autocommit as it was opened with.
    if not conn.autocommit:
        conn.autocommit = True


class DatabaseErrors:
    """Map driver errors to LeaseQueueError subclasses whose messages hide the password.

    A class, not a generator-based context manager: it wraps every claim and ack.
    """

    __slots__ = ("_dsn", "_schema")

    def __init__(self, dsn: str, schema: str) -> None:
        self._dsn = dsn
        self._schema = schema

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.raise_translated(exc)

    def raise_translated(self, exc: BaseException) -> None:
        """Raise our error for a driver error; return for anything else."""
        translated = self.translate(exc)
        if translated is not None:
            raise translated from None

    def translate(self, exc: BaseException) -> LeaseQueueError | None:
        """Our error for a driver error; None for anything else, which passes through."""
        if isinstance(exc, (pg_errors.UndefinedTable, pg_errors.InvalidSchemaName)):
            return not_installed(self._schema)
        if isinstance(exc, pg_errors.IdleInTransactionSessionTimeout):
            return TransactionAbandoned(
                "the server ended this attempt's transaction: it sat idle for longer than the "
                "lease (was the process paused?); nothing in it was written"
            )
        if isinstance(exc, PoolTimeout):
            return DatabaseUnavailable(
                f"no database connection available from the pool for {describe(self._dsn)}: "
                f"{redact(str(exc), self._dsn)}"
            )
        if isinstance(exc, psycopg.OperationalError):
            return DatabaseUnavailable(
                f"lost or could not open the connection to PostgreSQL at "
                f"{describe(self._dsn)}: {redact(str(exc).strip(), self._dsn)}"
            )
        if isinstance(exc, psycopg.Error):
            return LeaseQueueError(
                f"database error ({type(exc).__name__}): {redact(str(exc).strip(), self._dsn)}"
            )
        return None


_IDLE = pq.TransactionStatus.IDLE


class Executor(Protocol):
    """What the package's statements run on: a connection, a cursor, or a cached connection."""

    def execute(self, query: str, params: Params | None = None) -> psycopg.Cursor[Any]: ...


class CachedConnection:
    """A connection taken from the pool, with a cursor of its own for each hot statement.

    psycopg builds a cursor for each ``conn.execute()``, and a cursor that runs a different
    statement than last time looks up how to adapt every parameter and column again. On a
    claim or an ack that is a good part of the client's CPU, so each statement the queue
    runs here keeps its own cursor (up to MAX_CURSORS; any further ones share a cursor).
    A cursor holds its last result until its statement runs again: at most the rows of
    one claim per connection, which the worker's leases hold decoded anyway.
    """

    MAX_CURSORS = 8

    __slots__ = ("_cursors", "_script", "_shared", "conn", "taken_at")

    def __init__(self, conn: QueueConnection) -> None:
        self.conn = conn
        self.taken_at = time.monotonic()
        self._cursors: dict[str, psycopg.Cursor[Any]] = {}
        self._shared: psycopg.Cursor[Any] | None = None
        self._script: psycopg.ClientCursor[Any] | None = None

    def execute(self, query: str, params: Params | None = None) -> psycopg.Cursor[Any]:
        """Run ``query`` on its own cursor (statements are compared by identity first)."""
        cursor = self._cursors.get(query)
        if cursor is None:
            cursor = self._cursor_for(query)
        return cursor.execute(query, params)

    def execute_script(self, script: str, params: Params) -> None:
        """Run several statements in one round trip, their values bound by the client.

        psycopg quotes each value; the server parses the text each time and prepares
        nothing, so a script should call functions or statements that are cheap to plan.
        """
        if self._script is None:
            self._script = psycopg.ClientCursor(self.conn)
        self._script.execute(script, params, prepare=False)

    def _cursor_for(self, query: str) -> psycopg.Cursor[Any]:
        if len(self._cursors) < self.MAX_CURSORS:
            cursor = self._cursors[query] = self._new_cursor()
            return cursor
        if self._shared is None:
            self._shared = self._new_cursor()
        return self._shared

    def _new_cursor(self) -> psycopg.Cursor[Any]:
        cursor = self.conn.cursor()
        # Only the package's statements run here, and payloads are its own jsonb.
        cursor.adapters.register_loader("jsonb", JsonbLoader)
        return cursor


class ConnectionCache:
    """Pooled connections the queue keeps between its statements, last used first.

    Checking a connection out of psycopg_pool and back in costs about as much client CPU
    as a claim's own statement, and a worker claims and acks all day. So connections the
    queue took stay with it while idle; the pool still opens them, caps their number and
    makes callers wait when all are busy. A connection goes back to the pool when a caller
    is waiting for one there; when it is broken, mid-transaction or out of autocommit (the
    pool discards it, rolls it back or restores autocommit); when the queue closes; and
    after REFRESH_SECONDS, so the pool's lifetime and idle limits still apply.
    """

    REFRESH_SECONDS = 300.0

    def __init__(self, pool: ConnectionPool[QueueConnection]) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._idle: list[CachedConnection] = []
        self._waiting = 0  # callers inside pool.getconn()
        self._closed = False

    def acquire(self) -> CachedConnection:
        while True:
            with self._lock:
                if not self._idle:
                    self._waiting += 1
                    break
                cached = self._idle.pop()
            # Its state was checked when it was released; only its age can have changed.
            if time.monotonic() - cached.taken_at <= self.REFRESH_SECONDS:
                return cached
            # Kept too long: the pool's lifetime and idle limits apply to it again.
            self._pool.putconn(cached.conn)
        try:
            return CachedConnection(self._pool.getconn())
        finally:
            with self._lock:
                self._waiting -= 1

    def release(self, cached: CachedConnection) -> None:
        conn = cached.conn
        # IDLE also means open and unbroken: libpq reports UNKNOWN for a lost connection.
        # A connection a borrower left out of autocommit would wrap the queue's own
        # statements in a transaction that nobody commits.
        if conn.pgconn.transaction_status == _IDLE and conn.autocommit:
            with self._lock:
                # A caller waiting in the pool only wakes for a connection given back there.
                if not self._waiting and not self._closed:
                    self._idle.append(cached)
                    return
        self._pool.putconn(conn)

    def close(self) -> None:
        """Give every idle connection back to the pool (before the pool closes)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for cached in idle:
            self._pool.putconn(cached.conn)


class _Borrowed:
    __slots__ = ("_cache", "_cached", "_errors")

    def __init__(self, cache: ConnectionCache, errors: DatabaseErrors) -> None:
        self._cache = cache
        self._errors = errors
        self._cached: CachedConnection | None = None

    def _acquire(self) -> CachedConnection:
        try:
            self._cached = self._cache.acquire()
        except Exception as exc:
            self._errors.raise_translated(exc)
            raise
        return self._cached

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._cached is not None:
            self._cache.release(self._cached)
            self._cached = None
        if exc is not None:
            self._errors.raise_translated(exc)


class BorrowedConnection(_Borrowed):
    """One block's use of a connection from a :class:`ConnectionCache`, errors mapped."""

    __slots__ = ()

    def __enter__(self) -> psycopg.Connection[Any]:
        return self._acquire().conn


class BorrowedStatements(_Borrowed):
    """One block's use of a cached connection through its per-statement cursors."""

    __slots__ = ()

    # The hot path (every claim and ack): no frame of its own.
    __enter__ = _Borrowed._acquire


def reset_session(conn: psycopg.Connection[Any]) -> None:
    """Undo what caller code may have done to a lent connection (see sql.RESET_SESSION)."""
    if conn.closed or conn.broken:
        return
    try:
        if conn.info.transaction_status != _IDLE:
            conn.rollback()
        conn.autocommit = True
        # Several statements in one simple query; never prepared (a prepared statement
        # holds one).
        conn.execute(sql.RESET_SESSION, prepare=False)
    except psycopg.Error:
        conn.close()  # the pool discards a closed connection


class SharedConnection:
    """One autocommit connection shared by threads for short statements, opened on first use.

    It is reopened when found closed or broken, so a restarted server costs one failed
    statement, not a stuck worker.
    """

    def __init__(self, dsn: str, options: dict[str, Any]) -> None:
        self._dsn = dsn
        self._options = options
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None

    @contextmanager
    def use(self) -> Iterator[psycopg.Connection[Any]]:
        with self._lock:
            if self._conn is None or self._conn.closed or self._conn.broken:
                self._conn = psycopg.connect(self._dsn, **self._options)
            yield self._conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
