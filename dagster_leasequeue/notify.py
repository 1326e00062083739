"""Waking waiting workers: LISTEN for the hint that enqueues send with NOTIFY."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

from . import sql

# A listener not used for this long closes its connection, and so stops listening.
# PostgreSQL keeps each notification until every listening backend has sent it to its
# client. A process that waited once and then stopped waiting reads nothing any more: its
# socket fills, its backend blocks, and the server-wide notification queue can no longer
# be emptied; once it is full every NOTIFY fails, and with it every enqueue, from every
# process. Far above the one-second poll of a waiting claim, so that a worker waiting in a
# loop keeps its connection. Read when a Listener is made: tests shorten it.
IDLE_SECONDS = 30.0


class Listener:
    """One listening connection per queue object, opened on first use, closed when idle.

    A waiting claim calls :meth:`listen` before its first claim statement and :meth:`wait`
    between statements. Listening starts before the first claim, so a task enqueued
    between that claim and the wait still wakes the waiter: notifications queue on the
    connection.

    Notifications are counted, not handed out. ``listen`` and ``wait`` return the count
    (a mark), and a wait returns at once when the count has moved past the caller's mark.
    So one notification wakes every thread that shares the listener, whichever of them
    reads it, and one read before a claim statement, whose task that claim sees, wakes
    nobody.

    A daemon thread closes the connection once it has not been used for ``idle_seconds``:
    a timer, because a process that stopped waiting may never call the queue again.
    """

    def __init__(
        self,
        dsn: str,
        schema: str,
        options: dict[str, Any],
        *,
        idle_seconds: float | None = None,
    ) -> None:
        self._dsn = dsn
        self._schema = schema
        self._options = options
        self.idle_seconds = IDLE_SECONDS if idle_seconds is None else idle_seconds
        # Guards everything below; the connection is read by one thread at a time.
        self._lock = threading.Lock()
        # The idle closer sleeps on it, so that close() ends the closer at once.
        self._closing = threading.Condition(self._lock)
        self._conn: psycopg.Connection[Any] | None = None
        # Notifications read, plus one for each connection opened (see _ensure).
        self._received = 0
        self._last_used = 0.0  # time.monotonic() at the end of the last listen or wait
        self._closer: threading.Thread | None = None

    def listen(self, timeout: float | None = None) -> int:
        """Make sure the connection listens, read what is pending, and return a mark.

        Call it before a claim statement: what is pending now is older than that claim,
        which sees its tasks, so reading it here keeps it from waking the wait that follows
        (after a long task, many may be pending). A thread that finds the listener busy
        for ``timeout`` seconds (another thread's wait, which may last a batch's whole poll
        interval) takes the mark as it stands: that thread's connection listens, and what
        it reads moves the count for every thread.
        """
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return self._received
        try:
            try:
                self._drain(self._ensure())
            except psycopg.OperationalError:
                # It died while unused (a restart, a terminated backend): listen anew.
                self._discard()
                self._ensure()
            self._last_used = time.monotonic()
            return self._received
        finally:
            self._lock.release()

    def wait(self, timeout: float, mark: int) -> int:
        """Wait up to ``timeout`` seconds for a notification not counted in ``mark``.

        Return the new mark; the caller claims again in any case. Threads sharing the
        listener take turns reading it; a thread never waits past its own timeout.
        """
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout):
            return self._received  # the thread holding it read for us meanwhile
        unreachable = False
        try:
            conn = self._ensure()
            if self._received == mark:
                remaining = max(0.0, deadline - time.monotonic())
                for _ in conn.notifies(timeout=remaining, stop_after=1):
                    self._received += 1
                # The claim that follows sees the tasks of a whole burst of enqueues:
                # one wake for all of them, not one each.
                self._drain(conn)
        except psycopg.OperationalError:
            self._discard()  # reopened, and listening again, on the next call
            unreachable = True
        finally:
            self._last_used = time.monotonic()
            self._lock.release()
        if unreachable:
            # No connection to listen on: sleep out the wait (outside the lock), so that a
            # waiting claim polls at its pace instead of spinning on failed connects.
            time.sleep(max(0.0, deadline - time.monotonic()))
        return self._received

    def close(self) -> None:
        with self._lock:
            self._discard()
            self._closing.notify_all()

    def _ensure(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._discard()
            conn = psycopg.connect(self._dsn, **self._options)
            try:
                conn.execute(sql.listen_statement(self._schema))
            except BaseException:
                conn.close()
                raise
            self._conn = conn
            # Nothing listened before: a task enqueued meanwhile sent no notification this
            # connection will see. Counting one makes a waiter claim once more instead.
            self._received += 1
            # is_alive(): a thread does not survive a fork, its Thread object does.
            if self._closer is None or not self._closer.is_alive():
                self._closer = threading.Thread(
                    target=self._close_when_idle,
                    name=f"leasequeue-listener-{self._schema}",
                    daemon=True,
                )
                self._closer.start()
        return self._conn

    def _drain(self, conn: psycopg.Connection[Any]) -> None:
        """Read, without blocking, the notifications already sent to this connection."""
        # notifies(timeout=0) reads what one poll of the socket finds; thousands may be
        # pending. Bounded, so that a steady stream of enqueues cannot keep it reading:
        # what is left costs at most one early wake.
        for _ in range(1000):
            before = self._received
            for _ in conn.notifies(timeout=0):
                self._received += 1
            if self._received == before:
                return

    def _close_when_idle(self) -> None:
        """The closer thread: run while a connection is open, close it once idle."""
        with self._lock:
            while self._conn is not None:
                idle = time.monotonic() - self._last_used
                if idle >= self.idle_seconds:
                    self._discard()
                    break
                # Releases the lock while asleep. A waiter holds it while reading, so the
                # connection is never closed under a wait.
                self._closing.wait(self.idle_seconds - idle)
            self._closer = None

    def _discard(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
