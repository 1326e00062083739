"""Waking waiting workers: LISTEN for the hint that enqueues send with NOTIFY."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

from . import sql


class Listener:
    """One listening connection per queue object, opened on first use.

    It starts listening before the first claim that may wait, so a task enqueued between
    that claim and the wait still wakes the waiter: notifications queue on the connection.
    """

    def __init__(self, dsn: str, schema: str, options: dict[str, Any]) -> None:
        self._dsn = dsn
        self._schema = schema
        self._options = options
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None

    def listen(self) -> None:
        """Make sure the connection is open and listening."""
        with self._lock:
            self._ensure()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a notification; True if one came.

        Threads sharing the listener take turns; a thread never waits past its own timeout.
        """
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout):
            return False
        try:
            conn = self._ensure()
            remaining = max(0.0, deadline - time.monotonic())
            for _ in conn.notifies(timeout=remaining, stop_after=1):
                return True
        except psycopg.OperationalError:
            if self._conn is not None:
                self._conn.close()  # reopened, and listening again, on the next call
        finally:
            self._lock.release()
        return False

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _ensure(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = psycopg.connect(self._dsn, **self._options)
            self._conn.execute(sql.listen_statement(self._schema))
        return self._conn
