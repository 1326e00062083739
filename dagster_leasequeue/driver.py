"""The driver: what leases, attempts and the queue need of the database, and nothing more.

A :class:`Lease` and an attempt depend on this small object, never on :class:`LeaseQueue`:
the schema's statements, connections (kept, lent, and the one renewals use), the mapping
of driver errors, the encoding of results and the retry delay. The queue builds one and
hands it to every lease it claims.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from . import sql
from .claims import Claims
from .connection import (
    BorrowedConnection,
    BorrowedStatements,
    CachedConnection,
    ConnectionCache,
    DatabaseErrors,
    QueueConnection,
    SharedConnection,
    connection_options,
    open_pool,
    round_trip_bound,
)
from .payloads import encode_object
from .settings import LeaseQueueSettings


class QueueDriver:
    """Connections to one schema of one database, and how the package talks through them."""

    def __init__(self, dsn: str, schema: str, settings: LeaseQueueSettings) -> None:
        self.schema = schema
        self.settings = settings
        self.options = connection_options(
            connect_timeout=settings.connect_timeout,
            prepared_statements=settings.prepared_statements,
            network_timeout=settings.network_timeout_seconds(),
        )
        self._pool: ConnectionPool[QueueConnection] = open_pool(
            dsn,
            pool_size=settings.pool_size,
            connect_timeout=settings.connect_timeout,
            network_timeout=settings.network_timeout_seconds(),
            options=self.options,
            name=f"leasequeue-{schema}",
        )
        self._connections = ConnectionCache(self._pool)
        self.errors = DatabaseErrors(dsn, schema)
        # Renewals have a connection of their own: a worker whose pooled connections are
        # all busy (an attempt holds one) must still keep its leases.
        self._renewals = SharedConnection(
            dsn, self.options, round_trip_bound(settings.network_timeout_seconds())
        )
        self._closed = threading.Event()
        self.claims = Claims(self)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._connections.close()
            self._pool.close()
            self._renewals.close()

    def statement(self, template: str) -> str:
        """A template of sql.py rendered for this schema."""
        return sql.compose(template, self.schema)

    def connection(self) -> AbstractContextManager[psycopg.Connection[Any]]:
        """A kept connection for the package's own statements, errors mapped."""
        return BorrowedConnection(self._connections, self.errors)

    def statements(self) -> AbstractContextManager[CachedConnection]:
        """A kept connection with a cursor per statement, for the hot ones (claim, ack)."""
        return BorrowedStatements(self._connections, self.errors)

    def lend(self) -> CachedConnection:
        """A kept connection lent to caller code, until :meth:`take_back`."""
        with self.errors:
            return self._connections.acquire()

    def take_back(self, cached: CachedConnection) -> None:
        """End a loan: the connection is handed back as it was opened."""
        # Whatever the loan ended with (an interrupt mid-way through an attempt's own
        # statements), the next borrower's statements are not bounded (bounded.py).
        cached.conn.bounded = False
        self._connections.release(cached)

    @contextmanager
    def lent_connection(self) -> Iterator[CachedConnection]:
        """A kept connection lent to caller code for the block (lend, then take_back)."""
        cached = self.lend()
        try:
            yield cached
        finally:
            self.take_back(cached)

    @contextmanager
    def renewal_connection(self, *, wait: float = 1.0) -> Iterator[psycopg.Connection[Any]]:
        """The connection renewals share; one of its own after ``wait`` seconds busy. Also
        for a statement that must not wait for the pool (an attempt may hold its last)."""
        with self.errors, self._renewals.use(wait=wait) as conn:
            yield conn

    def encode_result(self, result: Mapping[str, Any] | None) -> str | None:
        if result is None:
            return None
        return encode_object(result, what="result", max_bytes=self.settings.payload_max_bytes)

    def retry_delay(self, attempt: int) -> float:
        """Exponential backoff with jitter: between half and all of base * 2**(attempt-1)."""
        base, cap = self.settings.retry_backoff_base, self.settings.retry_backoff_cap
        ceiling = min(cap, base * 2.0 ** min(max(attempt - 1, 0), 62))
        return ceiling / 2 + random.uniform(0, ceiling / 2)
