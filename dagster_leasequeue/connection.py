"""Opening the connection pool, and turning driver errors into our own, password-free."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import ConnectionPool, PoolTimeout

from .dsn import describe, redact
from .errors import DatabaseUnavailable, LeaseQueueError, TransactionAbandoned
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


def open_pool(
    dsn: str, *, pool_size: int, connect_timeout: float, options: dict[str, Any], name: str
) -> ConnectionPool:
    """Open a pool of autocommit connections, failing fast with a clear error.

    One direct connection is made first: a pool retries a bad DSN in the background until
    its timeout and keeps the reason to its log, while the user needs the reason now.
    """
    where = describe(dsn)
    try:
        psycopg.connect(dsn, **options).close()
    except psycopg.Error as exc:
        raise DatabaseUnavailable(
            f"cannot connect to PostgreSQL at {where}: {redact(str(exc).strip(), dsn)}"
        ) from None
    pool: ConnectionPool = ConnectionPool(
        dsn,
        min_size=1,
        max_size=pool_size,
        kwargs=options,
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


@contextmanager
def database_errors(dsn: str, schema: str) -> Iterator[None]:
    """Map driver errors to LeaseQueueError subclasses whose messages hide the password."""
    try:
        yield
    except (pg_errors.UndefinedTable, pg_errors.InvalidSchemaName):
        raise not_installed(schema) from None
    except pg_errors.IdleInTransactionSessionTimeout:
        raise TransactionAbandoned(
            "the server ended this attempt's transaction: it sat idle for longer than the "
            "lease (was the process paused?); nothing in it was written"
        ) from None
    except PoolTimeout as exc:
        raise DatabaseUnavailable(
            f"no database connection available from the pool for {describe(dsn)}: "
            f"{redact(str(exc), dsn)}"
        ) from None
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(
            f"lost or could not open the connection to PostgreSQL at {describe(dsn)}: "
            f"{redact(str(exc).strip(), dsn)}"
        ) from None
    except psycopg.Error as exc:
        raise LeaseQueueError(
            f"database error ({type(exc).__name__}): {redact(str(exc).strip(), dsn)}"
        ) from None


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
