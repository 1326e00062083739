"""The pool, the connections the queue keeps between statements, and password-free errors."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from functools import partial
from types import TracebackType
from typing import Any, NamedTuple, Protocol, TypeVar

import psycopg
from psycopg import IsolationLevel, Transaction, errors as pg_errors, generators, pq, sql as pg_sql
from psycopg.abc import Dumper, Loader, Params, PQGen, Transformer as TransformerProtocol
from psycopg.adapt import AdaptersMap, Transformer
from psycopg.rows import RowFactory, tuple_row
from psycopg.types import TypeInfo, TypesRegistry
from psycopg_pool import ConnectionPool, PoolTimeout

from . import sql
from .bounded import wait_bounded
from .dsn import describe, redact
from .errors import DatabaseUnavailable, LeaseQueueError, TransactionAbandoned
from .fastpath import FastStatements, PreparedNames, Row
from .payloads import JsonbLoader
from .schema import not_installed

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# How often psycopg's wait looks up from the socket for a signal (its own default).
_WAIT_INTERVAL = 0.1


def connection_options(
    *, connect_timeout: float, prepared_statements: bool, network_timeout: float
) -> dict[str, Any]:
    """Keyword arguments for every connection the package opens.

    ``network_timeout`` bounds how long a call waits on a dead network path (a cut link
    drops packets without a word, and TCP alone retries for many minutes): data sent and
    not acknowledged for that long (``tcp_user_timeout``), or a silent peer probed by
    keepalives for about that long, breaks the connection and the call raises.
    """
    seconds = max(1, math.ceil(network_timeout))
    options: dict[str, Any] = {
        "autocommit": True,
        # libpq counts whole seconds and treats values below 2 as 2.
        "connect_timeout": max(2, math.ceil(connect_timeout)),
        "tcp_user_timeout": seconds * 1000,
        "keepalives": 1,
        "keepalives_idle": max(1, seconds // 3),
        "keepalives_interval": max(1, seconds // 6),
        "keepalives_count": 3,
    }
    if not prepared_statements:
        options["prepare_threshold"] = None
    return options


class ClientSettings(NamedTuple):
    """What a borrower can change on a connection on the client side, besides its adapters."""

    autocommit: bool
    row_factory: RowFactory[Any]
    cursor_factory: type[psycopg.Cursor[Any]]
    server_cursor_factory: type[psycopg.ServerCursor[Any]]
    isolation_level: IsolationLevel | None
    read_only: bool | None
    deferrable: bool | None
    prepare_threshold: int | None
    prepared_max: int | None


class _WatchedTypes(TypesRegistry):
    """A connection's registry of types, noting whether anyone added to it."""

    changed = False

    def add(self, info: TypeInfo) -> None:
        self.changed = True
        super().add(info)


class _WatchedAdapters(AdaptersMap):
    """A connection's adapters, noting whether anyone registered a dumper, loader or type.

    Cursors take a copy of their connection's map when they are made, so a change here
    reaches only the cursors made after it.
    """

    changed = False

    def __init__(self, template: AdaptersMap) -> None:
        super().__init__(template)
        self.types = self._types = _WatchedTypes(template.types)

    def register_dumper(self, cls: type | str | None, dumper: type[Dumper]) -> None:
        self.changed = True
        super().register_dumper(cls, dumper)

    def register_loader(self, oid: int | str, loader: type[Loader]) -> None:
        self.changed = True
        super().register_loader(oid, loader)

    def was_changed(self) -> bool:
        return self.changed or self._types.changed


class QueueConnection(psycopg.Connection[Any]):
    """The class of the pool's connections: psycopg's, with two changes.

    A connection lent to caller code (``queue.connection()``, ``attempt.connection``) is
    given back as it was opened: what the borrower changed on the client (the attributes
    of :class:`ClientSettings`, the adapters, notice and notification handlers) is noticed
    by a few comparisons when the loan ends, and undone (see :meth:`ConnectionCache.release`).
    What it changed in the server session is undone by sql.RESET_SESSION.

    The other change is inside an attempt.

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
    # Seconds a round trip may take while ``bounded`` (see bounded.py); set when opened.
    round_trip_bound: float | None = None
    # True while the package's own statements of the worker loop run (CachedConnection).
    bounded = False
    # Round trips made so far: an attempt whose work made none left nothing in the session
    # to undo (attempts._run).
    round_trips = 0
    # The client settings the pool opened the connection with (see remember_settings).
    opened_with: ClientSettings | None = None
    # The connection's adapters, made on first use from psycopg's global ones.
    _watched_adapters: _WatchedAdapters | None = None
    # What the fast path prepared in this session (see fastpath.py); made on first use.
    _prepared_names: PreparedNames | None = None
    # The notice and notification handlers caller code added.
    _notice_handlers_added: tuple[Callable[[pg_errors.Diagnostic], None], ...] = ()
    _notify_handlers_added: tuple[Callable[[psycopg.Notify], None], ...] = ()

    @property
    def adapters(self) -> AdaptersMap:
        adapters = self._watched_adapters
        if adapters is None:
            adapters = self._watched_adapters = _WatchedAdapters(psycopg.adapters)
        return adapters

    @property
    def prepared_names(self) -> PreparedNames:
        names = self._prepared_names
        if names is None:
            names = self._prepared_names = PreparedNames()
        return names

    def client_settings(self) -> ClientSettings:
        return ClientSettings(
            self.autocommit,
            self.row_factory,
            self.cursor_factory,
            self.server_cursor_factory,
            self.isolation_level,
            self.read_only,
            self.deferrable,
            self.prepare_threshold,
            self.prepared_max,
        )

    def remember_settings(self) -> None:
        """Note the client settings as opened (the pool's ``configure`` callback)."""
        self.opened_with = self.client_settings()

    def changed_by_borrower(self) -> bool:
        """Whether caller code changed the connection on the client since it was opened."""
        adapters = self._watched_adapters
        return (
            self.client_settings() != self.opened_with
            or (adapters is not None and adapters.was_changed())
            or bool(self._notice_handlers_added or self._notify_handlers_added)
        )

    def restore_settings(self) -> None:
        """Put the client settings back as opened; the connection must be idle.

        The adapters are made again from psycopg's global ones, as for a new connection.
        """
        opened = self.opened_with
        if opened is not None and self.client_settings() != opened:
            self.autocommit = opened.autocommit
            self.row_factory = opened.row_factory
            self.cursor_factory = opened.cursor_factory
            self.server_cursor_factory = opened.server_cursor_factory
            self.isolation_level = opened.isolation_level
            self.read_only = opened.read_only
            self.deferrable = opened.deferrable
            self.prepare_threshold = opened.prepare_threshold
            self.prepared_max = opened.prepared_max
        elif opened is None and not self.autocommit:
            self.autocommit = True
        adapters = self._watched_adapters
        if adapters is not None and adapters.was_changed():
            self._watched_adapters = None
        for notice_handler in self._notice_handlers_added:
            with suppress(ValueError):
                super().remove_notice_handler(notice_handler)
        self._notice_handlers_added = ()
        for notify_handler in self._notify_handlers_added:
            with suppress(ValueError):
                super().remove_notify_handler(notify_handler)
        self._notify_handlers_added = ()

    def add_notice_handler(self, callback: Callable[[pg_errors.Diagnostic], None]) -> None:
        super().add_notice_handler(callback)
        self._notice_handlers_added += (callback,)

    def remove_notice_handler(self, callback: Callable[[pg_errors.Diagnostic], None]) -> None:
        super().remove_notice_handler(callback)
        self._notice_handlers_added = _without(self._notice_handlers_added, callback)

    def add_notify_handler(self, callback: Callable[[psycopg.Notify], None]) -> None:
        super().add_notify_handler(callback)
        self._notify_handlers_added += (callback,)

    def remove_notify_handler(self, callback: Callable[[psycopg.Notify], None]) -> None:
        super().remove_notify_handler(callback)
        self._notify_handlers_added = _without(self._notify_handlers_added, callback)

    def set_autocommit(self, value: bool) -> None:
        # psycopg sends the change through wait() as a generator, though nothing goes to the
        # server unless a pipeline is open or a transaction forbids it: an idle connection
        # changes the flag alone. It counts as a round trip all the same, as wait() counts
        # psycopg's setters (attempts._run reads the count).
        with self.lock:
            if self.pgconn.transaction_status == _IDLE and not self._pipeline:
                self.round_trips += 1
                self._autocommit = bool(value)
                return
        super().set_autocommit(value)

    @contextmanager
    def bounded_round_trips(self) -> Iterator[None]:
        """Bound every round trip in the block (bounded.py): the package's own statements."""
        bounded, self.bounded = self.bounded, True
        try:
            yield
        finally:
            self.bounded = bounded

    def wait(
        self, gen: PQGen[_T], interval: float = _WAIT_INTERVAL, timeout: float | None = None
    ) -> _T:
        self.round_trips += 1
        bound = self.round_trip_bound
        if not self.bounded or bound is None or timeout is not None:
            return super().wait(gen, interval, timeout)
        return wait_bounded(self, super().wait, gen, interval, bound)

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


def _without(handlers: tuple[Any, ...], callback: Any) -> tuple[Any, ...]:
    """``handlers`` without the first occurrence of ``callback`` (as list.remove does)."""
    if callback not in handlers:
        return handlers
    index = handlers.index(callback)
    return handlers[:index] + handlers[index + 1 :]


def open_pool(
    dsn: str,
    *,
    pool_size: int,
    connect_timeout: float,
    network_timeout: float,
    options: dict[str, Any],
    name: str,
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
        configure=partial(_configure, round_trip_bound=round_trip_bound(network_timeout)),
        reset=_restore_settings,
        # How long a call waits for a connection: while the server is unreachable the pool
        # retries in the background, and a call gives up after one connect attempt and
        # one network timeout, so it never waits much past its lease.
        timeout=connect_timeout + network_timeout,
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


def round_trip_bound(network_timeout: float) -> float:
    """The bound of the worker loop's round trips (bounded.py): the network timeout, and at
    least a second, as libpq's TCP settings are (a lease under a second would cut short a
    large claim_many)."""
    return max(1.0, network_timeout)


def _configure(conn: QueueConnection, *, round_trip_bound: float) -> None:
    conn.round_trip_bound = round_trip_bound
    conn.remember_settings()


def _restore_settings(conn: QueueConnection) -> None:
    # The pool hands this connection to the queue's own statements next, which expect it
    # as it was opened (autocommit, tuples, psycopg's adapters). Most come back unchanged:
    # a lent one is restored before it is given back, unless it was given back mid-way.
    if not conn.closed and conn.changed_by_borrower():
        conn.restore_settings()


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
        if isinstance(exc, psycopg.Error) and (exc.sqlstate or "").startswith("40"):
            # SQLSTATE class 40, a deadlock or a serialization failure: the server is
            # there, and undid this statement's transaction to let another go on.
            return LeaseQueueError(
                f"the database rolled this transaction back to resolve a conflict with "
                f"another ({type(exc).__name__}); nothing in it was written, so it can be "
                f"tried again: {redact(str(exc).strip(), self._dsn)}"
            )
        if isinstance(exc, pg_errors.QueryCanceled):
            # A statement_timeout, or the bound on the worker loop's round trips (bounded.py).
            return DatabaseUnavailable(
                f"PostgreSQL at {describe(self._dsn)} cancelled the statement before it "
                "finished: it waited longer than its timeout (network_timeout, for the "
                "package's claims, acks and renewals), for a lock another session holds or "
                "for a server that stalled; nothing in its transaction was written: "
                f"{redact(str(exc).strip(), self._dsn)}"
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

# How many times CachedConnection.execute sends again a statement rolled back by a conflict:
# a deadlock or a serialization failure (not the rest of SQLSTATE class 40: a constraint
# that failed at commit fails again, and a statement whose completion is unknown may have
# been done).
CONFLICT_RETRIES = 3
_CONFLICTS = frozenset({"40P01", "40001"})


class Executor(Protocol):
    """What the package's statements run on: a connection, a cursor, or a cached connection."""

    def execute(self, query: str, params: Params | None = None) -> psycopg.Cursor[Any]: ...


class ScriptOutcome(NamedTuple):
    """What a script run by :meth:`CachedConnection.run_script` returned."""

    rows: list[list[Row]]  # the rows of each statement that returned rows, in order
    committed: bool  # a COMMIT in the script went through
    error: psycopg.Error | None  # the failing statement's error (the rest did not run)


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

    __slots__ = ("_cursors", "_fast", "_script", "_script_loader", "_shared", "conn", "taken_at")

    def __init__(self, conn: QueueConnection) -> None:
        self.conn = conn
        self.taken_at = time.monotonic()
        self._cursors: dict[str, psycopg.Cursor[Any]] = {}
        self._shared: psycopg.Cursor[Any] | None = None
        self._script: psycopg.ClientCursor[Any] | None = None
        self._script_loader: TransformerProtocol | None = None
        self._fast: FastStatements | None = None

    def execute(self, query: str, params: Params | None = None) -> psycopg.Cursor[Any]:
        """Run ``query`` on its own cursor (statements are compared by identity first).

        A statement that was its own transaction and that the server rolled back to end a
        deadlock or a serialization conflict wrote nothing: it is sent again, up to
        CONFLICT_RETRIES times. Workers' acks and claims can, rarely, deadlock on the
        tasks' row locks although their claims skip locked rows (once in some 20 drains of
        20,000 tasks by four workers), and the statement sent again goes through. Inside a
        transaction block nothing is sent again: the block is the caller's to retry.
        """
        cursor = self._cursors.get(query)
        if cursor is None:
            cursor = self._cursor_for(query)
        return self._retried(cursor.execute, query, params)

    def rows(self, query: str, params: Mapping[str, Any]) -> list[Row]:
        """The rows of ``query``, one of the worker loop's statements (a claim, an ack).

        Sent on the fast path (fastpath.py) when it is its own transaction, as the worker
        loop's are; else as :meth:`execute` sends it. Conflicts are sent again as there.
        """
        fast = self._fast_statements()
        if fast is None:
            return self.execute(query, params).fetchall()
        return self._retried(fast.rows, query, params)

    def changed(self, query: str, params: Mapping[str, Any]) -> int:
        """How many rows ``query`` (an UPDATE of the worker loop, an ack) changed; sent as
        :meth:`rows` sends its statements."""
        fast = self._fast_statements()
        if fast is None:
            return self.execute(query, params).rowcount
        return self._retried(fast.run, query, params).command_tuples or 0

    def _fast_statements(self) -> FastStatements | None:
        """The fast path, for a statement that is its own transaction; else None."""
        if not self.conn.autocommit or self.conn.pgconn.transaction_status != _IDLE:
            return None
        fast = self._fast
        if fast is None:
            conn = self.conn
            fast = self._fast = FastStatements(
                conn,
                conn.prepared_names,
                self._new_cursor(),
                prepare=conn.prepare_threshold is not None,
            )
        return fast

    def _retried(self, send: Callable[[str, Any], _T], query: str, params: Any) -> _T:
        retries = CONFLICT_RETRIES
        conn = self.conn
        # bounded_round_trips() inline: this runs for every claim and ack.
        bounded, conn.bounded = conn.bounded, True
        try:
            while True:
                try:
                    return send(query, params)
                except psycopg.Error as exc:
                    conflict = exc.sqlstate in _CONFLICTS
                    if not (conflict and retries and conn.pgconn.transaction_status == _IDLE):
                        raise
                    retries -= 1
                    logger.info("a statement met a conflict and is sent again: %s", exc.sqlstate)
        finally:
            conn.bounded = bounded

    def run_script(self, script: str, params: Params) -> ScriptOutcome:
        """Run several statements in one round trip, their values bound by the client.

        psycopg quotes each value; the server parses the text each time and prepares
        nothing, so a script should call functions or statements that are cheap to plan. A
        statement that fails does not take the rows of the statements before it with it:
        they come back beside its error, with whether a COMMIT among them went through.
        """
        cursor = self._script_cursor()
        query = cursor.mogrify(script, params).encode(self.conn.info.encoding)
        conn = self.conn
        with conn.lock:
            conn.pgconn.send_query(query)
            with conn.bounded_round_trips():
                results: list[pq.abc.PGresult] = conn.wait(generators.execute(conn.pgconn))
        if self._script_loader is None:
            self._script_loader = Transformer(cursor)
        loader = self._script_loader
        rows: list[list[Row]] = []
        committed = False
        for result in results:
            if result.status == pq.ExecStatus.TUPLES_OK:
                loader.set_pgresult(result)
                rows.append(loader.load_rows(0, result.ntuples, tuple))
            elif result.status == pq.ExecStatus.COMMAND_OK:
                committed = committed or result.command_status == b"COMMIT"
            else:
                error = pg_errors.error_from_result(result, encoding=conn.info.encoding)
                return ScriptOutcome(rows, committed, error)
        return ScriptOutcome(rows, committed, None)

    def _script_cursor(self) -> psycopg.ClientCursor[Any]:
        if self._script is None:
            self._script = psycopg.ClientCursor(self.conn, row_factory=tuple_row)
        return self._script

    def _cursor_for(self, query: str) -> psycopg.Cursor[Any]:
        if len(self._cursors) < self.MAX_CURSORS:
            cursor = self._cursors[query] = self._new_cursor()
            return cursor
        if self._shared is None:
            self._shared = self._new_cursor()
        return self._shared

    def forget_cursors(self) -> None:
        """Drop the kept cursors: made after a borrower changed the connection, they might
        carry its row factory or adapters."""
        self._cursors.clear()
        self._shared = None
        self._script = None
        self._script_loader = None
        self._fast = None

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
    pool discards it, or rolls it back and restores its settings); when the queue closes;
    and after REFRESH_SECONDS, so the pool's lifetime and idle limits still apply.

    Connections lent to caller code come back through :meth:`release`, which restores
    what the borrower changed on the client; the package's own statements through
    :meth:`give_back`, which checks only what a failed statement can leave.
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
        """Take back a connection lent to caller code, undoing what it changed on the client.

        A few attribute comparisons when nothing changed (see QueueConnection); the server
        session was reset by the borrower (sql.RESET_SESSION).
        """
        conn = cached.conn
        if conn.pgconn.transaction_status == _IDLE and conn.changed_by_borrower():
            try:
                conn.restore_settings()
            except psycopg.Error:
                conn.close()  # the pool discards a closed connection
            cached.forget_cursors()
        self.give_back(cached)

    def give_back(self, cached: CachedConnection) -> None:
        """Take back a connection the package's own statements used, which change nothing."""
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
            self._cache.give_back(self._cached)
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


def reset_session(conn: psycopg.Connection[Any], statement: str) -> None:
    """Undo what caller code may have done to a lent connection's session: ``statement``
    is sql.RESET_SESSION rendered for the queue's schema. ConnectionCache.release undoes
    what it did on the client."""
    if conn.closed or conn.broken:
        return
    try:
        if conn.info.transaction_status != _IDLE:
            conn.rollback()
        conn.autocommit = True
        # Several statements in one simple query; never prepared (a prepared statement
        # holds one).
        cursor = conn.cursor(row_factory=tuple_row)  # whatever row factory the borrower set
        deallocate_leftovers(cursor.execute(statement, prepare=False))
    except psycopg.Error:
        conn.close()  # the pool discards a closed connection


def deallocate_leftovers(cursor: psycopg.Cursor[Any]) -> None:
    """Drop the statements a borrower PREPAREd, named by the last result of RESET_SESSION
    on ``cursor``: one more round trip, only when there are any."""
    while cursor.nextset():
        pass
    row = cursor.fetchone()
    deallocate(cursor.connection, row[-1] if row else [])


def deallocate(conn: psycopg.Connection[Any], names: list[str]) -> None:
    """Drop the prepared statements ``names`` (RESET_SESSION's last column), if any."""
    if names:
        conn.execute(
            "; ".join(f"DEALLOCATE {pg_sql.Identifier(name).as_string(None)}" for name in names),
            prepare=False,
        )
        # Out of autocommit (an attempt's conclusion), psycopg began a transaction for it.
        if conn.info.transaction_status != _IDLE:
            conn.commit()


class SharedConnection:
    """One autocommit connection shared by threads for short statements, opened on first use.

    It is reopened when found closed or broken, so a restarted server costs one failed
    statement, not a stuck worker. A caller that finds it busy for longer than its
    ``wait`` (a statement stuck on a row lock or a dying network path) gets a connection
    of its own for that one use, so one stuck statement never holds up the others. Only
    the package's short statements run on it: each round trip is bounded (bounded.py).
    """

    def __init__(self, dsn: str, options: dict[str, Any], round_trip_bound: float) -> None:
        self._dsn = dsn
        self._options = options
        self._bound = round_trip_bound
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None

    @contextmanager
    def use(self, *, wait: float | None = None) -> Iterator[psycopg.Connection[Any]]:
        if self._lock.acquire(timeout=-1 if wait is None else wait):
            try:
                if self._conn is None or self._conn.closed or self._conn.broken:
                    self._conn = self._connect()
                yield self._conn
            finally:
                self._lock.release()
            return
        with self._connect() as conn:
            yield conn

    def _connect(self) -> QueueConnection:
        conn = QueueConnection.connect(self._dsn, **self._options)
        conn.round_trip_bound = self._bound
        conn.bounded = True
        return conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
