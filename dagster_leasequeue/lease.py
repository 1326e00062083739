"""A claimed task and the lease that fences it: ack, fail, renew, and background renewal."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

from . import sql
from .claims import in_claim_order
from .connection import CachedConnection, Executor
from .errors import DatabaseUnavailable, LeaseLost, LeaseQueueError, describe_error
from .fastpath import Row
from .validation import MAX_LEASE_SECONDS, check_lease_seconds, check_seconds

if TYPE_CHECKING:
    from .driver import QueueDriver

logger = logging.getLogger(__name__)

# Renew when about a third of the lease has passed: two renewals can fail before it lapses.
RENEW_FRACTION = 1 / 3


class Lease:
    """A task held by this worker until ``expires_at`` (database clock), under ``token``.

    ``ack``, ``fail`` and ``renew`` are fenced: they change the task only while it is still
    processing under this lease's token, and otherwise raise :class:`LeaseLost`.

    As a context manager the lease renews itself in the background while the block runs,
    acks when the block ends normally (unless already concluded) and fails the task, then
    re-raises, when the block raises an Exception; an interrupt (KeyboardInterrupt,
    SystemExit) releases the task instead, without using up an attempt::

        lease = queue.claim()
        if lease is not None:
            with lease:
                process(lease.payload)
    """

    def __init__(
        self,
        driver: QueueDriver,
        *,
        task_id: int,
        queue_name: str,
        payload: dict[str, Any],
        priority: int,
        attempt: int,
        max_attempts: int,
        token: int,
        expires_at: datetime,
        worker_id: str | None,
        idempotency_key: str | None,
        lease_seconds: float,
        claimed_at: float,
        keyless: bool = False,
    ) -> None:
        self._driver = driver
        self.task_id = task_id
        self.queue = queue_name
        self.payload = payload
        self.priority = priority
        self.attempt = attempt
        self.max_attempts = max_attempts
        self.token = token
        self.expires_at = expires_at
        self.worker_id = worker_id
        self.idempotency_key = idempotency_key
        self.lease_seconds = lease_seconds
        # Known to have no concurrency key: its ack_and_claim takes the leaner statement.
        self._keyless = keyless
        self._lock = threading.Lock()
        self._outcome: str | None = None
        # Set by the renewal thread, read by the worker; a plain attribute suffices.
        self._lost = False
        self._renewer: _Renewer | None = None
        # Set by want_next(): the conclusion also claims the next task (see next_lease).
        self._wants_next = False
        self._next_lease_seconds: float | None = None
        self.next_lease: Lease | None = None
        # The task's attempt, begun by the commit that claimed it (sql.CONCLUDE_ATTEMPT_AND_
        # CLAIM): the row an attempt on this lease takes instead of beginning its own.
        self._begun_attempt: Row | None = None
        # The lease's end on this machine's monotonic clock, counted from before the claim
        # or renewal was sent, so never later than the database's own expiry.
        self._local_deadline = claimed_at + lease_seconds

    def __repr__(self) -> str:
        return (
            f"Lease(task_id={self.task_id}, queue={self.queue!r}, attempt={self.attempt}, "
            f"token={self.token}, expires_at={self.expires_at.isoformat()}, "
            f"worker_id={self.worker_id!r}, outcome={self._outcome!r})"
        )

    # -- state ------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """True once this lease acked, failed or released its task."""
        return self._outcome is not None

    @property
    def keyless(self) -> bool:
        """True when the task is known to have no concurrency key (a claim's rows say so);
        False when it has one, or its claim did not say."""
        return self._keyless

    @property
    def lost(self) -> bool:
        """True once the lease is gone or may be: the work should stop.

        Set when a renewal finds the lease taken; also true, while renewing in the
        background, once the lease has run out without a renewal getting through (a
        renewal can hang on a dead connection without failing).
        """
        if self._lost:
            return True
        return self._renewer is not None and time.monotonic() >= self._local_deadline

    def raise_if_lost(self) -> None:
        """Raise LeaseLost if the lease is gone or has run out; call it between steps."""
        if self.lost:
            raise LeaseLost(
                f"the lease on task {self.task_id} (token {self.token}) was lost: "
                "stop working on it"
            )

    # -- fenced operations -----------------------------------------------------------------

    @property
    def wants_next(self) -> bool:
        """True once :meth:`want_next` asked this lease's conclusion to claim the next task."""
        return self._wants_next

    @property
    def next_lease_seconds(self) -> float | None:
        """The length :meth:`want_next` asked of the next task's lease (None: its own)."""
        return self._next_lease_seconds

    def want_next(self, wanted: bool = True, *, lease_seconds: float | None = None) -> None:
        """Have this lease's conclusion also claim the next task of its queue, for its
        worker, in the same round trip: :meth:`ack` then works as :meth:`ack_and_claim`,
        and an attempt on this lease as ``attempt(lease=..., claim_next=True)``. The new
        lease (or None, when no task was due) is then :attr:`next_lease`.

        ``run_worker`` asks this of every task while it wants another, and takes it back
        (``want_next(False)``) when told to stop while the task runs.
        """
        self._next_lease_seconds = check_lease_seconds(lease_seconds)
        self._wants_next = wanted

    def ack(self, result: dict[str, Any] | None = None) -> None:
        """Mark the task done, storing ``result``; raise LeaseLost if the lease is gone.

        After :meth:`want_next`, the same statement claims the next task: see there.
        """
        if self._wants_next:
            self.ack_and_claim(result, lease_seconds=self._next_lease_seconds)
            return
        encoded = self._driver.encode_result(result)
        with self._driver.statements() as conn, self._lock:
            self._refuse_if_finished("ack")
            self._discard_begun_attempt(conn)
            self._ack_on(conn, encoded)
            self._outcome = "acked"

    def ack_and_claim(
        self, result: dict[str, Any] | None = None, *, lease_seconds: float | None = None
    ) -> Lease | None:
        """Ack this lease and claim the next due task of its queue, for its worker.

        One statement and one commit instead of two: a worker that finished a task nearly
        always wants the next. The ack is fenced as :meth:`ack`'s; when the fence fails,
        this raises LeaseLost and claims nothing. Returns the new lease, or None when the
        queue has nothing due. ``lease_seconds`` is the new lease's, as in ``claim``.
        """
        encoded = self._driver.encode_result(result)
        claims = self._driver.claims
        params = claims.params(self.queue, self.worker_id or "", check_lease_seconds(lease_seconds))
        with self._driver.statements() as conn, self._lock:
            self._refuse_if_finished("ack")
            self._discard_begun_attempt(conn)
            sent = time.monotonic()
            acked, rows = claims.ack_and_claim(
                conn, self._fence_params() | {"result": encoded}, 1, params, keyless=self._keyless
            )
            if not acked:
                self._raise_lost_on(conn, "ack")
            self._outcome = "acked"
        leases = leases_from_rows(
            self._driver, rows, queue=self.queue, worker_id=self.worker_id or "", sent=sent
        )
        self.next_lease = leases[0] if leases else None
        return self.next_lease

    def _ack_on(self, conn: Executor | CachedConnection, encoded_result: str | None) -> None:
        """Run the fenced ack on ``conn``, inside the caller's transaction if it has one.

        The caller marks the lease finished once that transaction commits (see
        :meth:`_mark_acked`); this is how an attempt makes its effects and the ack atomic.
        """
        params = self._fence_params() | {"result": encoded_result}
        statement = self._statement(sql.ACK)
        if isinstance(conn, CachedConnection):
            changed = conn.changed(statement, params)  # the worker's own: the fast path
        else:
            changed = conn.execute(statement, params).rowcount
        if changed != 1:
            self._raise_lost_on(conn, "ack")

    def _begin_attempt_with(self, row: Row) -> None:
        """Keep the attempt the claim of this lease began (see :attr:`_begun_attempt`)."""
        self._begun_attempt = row

    def _take_begun_attempt(self) -> Row | None:
        """The attempt the claim began, for an attempt on this lease; None when there is
        none, or another attempt took it."""
        with self._lock:
            row, self._begun_attempt = self._begun_attempt, None
        return row

    def _discard_begun_attempt(self, conn: Executor | CachedConnection) -> None:
        """Take back the start record the claim made, when the lease ends without using it
        (the caller holds the lease's lock, and the lease is not concluded yet): the task's
        attempts list only attempts made."""
        row, self._begun_attempt = self._begun_attempt, None
        if row is not None:
            self._discard_attempt_record(conn, row)

    def _discard_attempt_record(self, conn: Executor | CachedConnection, row: Row) -> None:
        """Take back the start record ``row`` (see :meth:`_discard_begun_attempt`). A call
        that fails is logged, and leaves the record to be marked abandoned by the task's
        next attempt; under a lease that no longer holds the task it deletes nothing, and
        the conclusion that follows reports the lost lease."""
        try:
            with self._driver.errors:
                conn.execute(
                    self._statement(sql.DISCARD_BEGUN_ATTEMPT),
                    self._fence_params() | {"attempt_id": row[0]},
                )
        except LeaseQueueError as exc:
            logger.warning("the unused attempt record of task %s is kept: %s", self.task_id, exc)

    def _mark_acked(self) -> None:
        """Record that an ack run through :meth:`_ack_on` has committed."""
        with self._lock:
            self._outcome = "acked"

    def fail(self, error: str | BaseException, *, retry_in: float | None = None) -> str:
        """Give the task back after an error; return its new status.

        With attempts left the task is enqueued again after an exponential backoff with
        jitter (``retry_in`` overrides it; 0 means at once); with none left it is ``dead``.
        The error's text is kept in ``last_error``.
        """
        if retry_in is not None:
            retry_in = check_seconds("retry_in", retry_in, allow_zero=True)
        with self._driver.statements() as conn:
            return self._fail_on(conn, error, retry_in=retry_in)

    def _fail_on(
        self,
        conn: Executor,
        error: str | BaseException,
        *,
        retry_in: float | None = None,
    ) -> str:
        """:meth:`fail` on a given autocommit connection (an attempt's, after its rollback)."""
        delay = self._driver.retry_delay(self.attempt) if retry_in is None else float(retry_in)
        params = self._fence_params() | {"error": describe_error(error), "retry_in": delay}
        with self._lock:
            self._refuse_if_finished("fail")
            self._discard_begun_attempt(conn)
            row = conn.execute(self._statement(sql.FAIL), params).fetchone()
            if row is None:
                self._raise_lost_on(conn, "fail")
            self._outcome = "failed"
        return str(row[0])

    def release(self, *, delay: float = 0) -> None:
        """Give the task back unfinished, due again after ``delay`` seconds (database clock).

        Nothing is wrong with the task, so this claim does not count against its
        ``max_attempts``: the next claim has the same ``attempt`` number. Use it when a
        worker stops before the work is done, or to put one task off for a while ("snooze").
        Fenced like :meth:`ack`: raises LeaseLost when the lease is gone.
        """
        params = self._fence_params() | {"delay": check_seconds("delay", delay, allow_zero=True)}
        with self._driver.statements() as conn, self._lock:
            self._refuse_if_finished("release")
            self._discard_begun_attempt(conn)
            if conn.execute(self._statement(sql.RELEASE), params).rowcount != 1:
                self._raise_lost_on(conn, "release")
            self._outcome = "released"

    def renew(self, lease_seconds: float | None = None) -> datetime:
        """Extend the lease to ``lease_seconds`` from now (database clock); return the expiry."""
        seconds = self.lease_seconds
        if lease_seconds is not None:
            seconds = check_seconds("lease_seconds", lease_seconds, maximum=MAX_LEASE_SECONDS)
        params = self._fence_params() | {"lease_seconds": seconds}
        with self._lock:
            self._refuse_if_finished("renew")
            sent = time.monotonic()
            # Renewals have a connection of their own: a worker whose pooled connections
            # are all busy (an attempt holds one) must still keep its leases.
            # Another lease's renewal stuck on the shared connection must not hold this
            # one up past a small part of the lease.
            wait = min(1.0, self.lease_seconds / 4)
            with self._driver.renewal_connection(wait=wait) as conn:
                row = conn.execute(self._statement(sql.RENEW), params).fetchone()
                if row is None:
                    self._raise_lost_on(conn, "renew")
            self.expires_at = row[0]
            self.lease_seconds = seconds
            self._local_deadline = sent + seconds
        return self.expires_at

    # -- context manager -------------------------------------------------------------------

    def __enter__(self) -> Lease:
        if self._renewer is None and not self.finished:
            self._renewer = _Renewer(self)
            self._renewer.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop_renewing()
        if self.finished:
            return
        if exc is None:
            self.ack()
            return
        # An interrupt (Ctrl-C, a stop signal, SystemExit) is not the task's fault: the task
        # goes back unharmed instead of using up an attempt. Nor is a database that went
        # away, but it cannot be told from a crash the task caused, so it uses the attempt
        # like a lapsed lease would; it is due again at once, as the outage is over.
        try:
            if not isinstance(exc, Exception):
                self.release()
            else:
                self.fail(exc, retry_in=0 if isinstance(exc, DatabaseUnavailable) else None)
        except LeaseQueueError as error:
            # The block's own exception is the one the caller needs to see.
            logger.warning("could not give back task %s after %r: %s", self.task_id, exc, error)

    def _stop_renewing(self) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.stop()

    # -- helpers ---------------------------------------------------------------------------

    def _statement(self, template: str) -> str:
        return self._driver.statement(template)

    def _fence_params(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "token": self.token}

    def _refuse_if_finished(self, action: str) -> None:
        if self._outcome is not None:
            raise LeaseLost(
                f"cannot {action} task {self.task_id}: this lease already {self._outcome} it"
            )

    def _raise_lost_on(self, conn: Executor, action: str) -> NoReturn:
        """Raise LeaseLost for ``action``, saying why the fence failed (read on ``conn``)."""
        raise self._lost_error(self._state_on(conn), action)

    def _raise_if_lost_on(self, conn: Executor, action: str) -> None:
        """Raise LeaseLost for ``action`` if the lease is no longer held (read on ``conn``)."""
        row = self._state_on(conn)
        if row != ("processing", self.token):
            raise self._lost_error(row, action)

    def _state_on(self, conn: Executor) -> Row | None:
        """The task's status and lease token, read on ``conn``; None when it is gone."""
        return conn.execute(self._statement(sql.LEASE_STATE), {"task_id": self.task_id}).fetchone()

    def _lost_error(self, row: Row | None, action: str) -> LeaseLost:
        if row is None:
            reason = "the task no longer exists"
        elif row[1] is not None and row[1] != self.token:
            reason = f"it was claimed again under token {row[1]} and is now {row[0]}"
        elif row[1] == self.token:
            reason = f"this lease already concluded it (now {row[0]})"
        else:
            reason = f"its lease expired and the task was recovered or cancelled (now {row[0]})"
        return LeaseLost(
            f"cannot {action} task {self.task_id} with token {self.token}: {reason}; "
            "nothing was changed"
        )

    def _concluded_by_self(self) -> bool:
        with self._driver.connection() as conn:
            row = conn.execute(
                self._statement(sql.LEASE_STATE), {"task_id": self.task_id}
            ).fetchone()
        return row is not None and row[1] == self.token and row[0] != "processing"


# Where a plain claim's row has its task's concurrency key.
_KEY_COLUMN = 11


def leases_from_rows(
    driver: QueueDriver, rows: Iterable[Row], *, queue: str, worker_id: str, sent: float
) -> list[Lease]:
    """The leases of a claim's rows, in claim order; ``sent`` is when the claim was sent.

    Rows without a task (a rate-limited queue's word on its next token) are left out. The
    plain claims' rows end with the task's concurrency key (claim_one()'s and claim_flow()'s,
    whose columns a migration fixed, do not): a lease is keyless only when that says so.
    """
    return [
        Lease(
            driver,
            task_id=row[0],
            queue_name=queue,
            payload=row[1],
            priority=row[2],
            attempt=row[3],
            max_attempts=row[4],
            token=row[5],
            expires_at=row[6],
            worker_id=worker_id,
            idempotency_key=row[7],
            lease_seconds=row[8],
            claimed_at=sent,
            keyless=len(row) > _KEY_COLUMN and row[_KEY_COLUMN] is None,
        )
        for row in in_claim_order([row for row in rows if row[0] is not None])
    ]


def discard_begun_attempts(conn: CachedConnection, leases: Iterable[Lease]) -> None:
    """Take back the start records that the claims of ``leases`` made and that they end
    without using (see :meth:`Lease._discard_begun_attempt`): for acks of many leases."""
    for lease in leases:
        if lease._begun_attempt is not None:
            with lease._lock:
                lease._discard_begun_attempt(conn)


class _Renewer(threading.Thread):
    """Renews a lease every third of its length until stopped or the lease is lost."""

    def __init__(self, lease: Lease) -> None:
        super().__init__(name=f"leasequeue-renew-{lease.task_id}", daemon=True)
        self._lease = lease
        self._stopped = threading.Event()

    def run(self) -> None:
        lease = self._lease
        while not self._stopped.wait(lease.lease_seconds * RENEW_FRACTION):
            if lease._driver.closed:
                return
            try:
                lease.renew()
            except LeaseLost:
                # An ack or fail that committed meanwhile (through an attempt, say) also
                # makes a renewal change nothing; only a lease taken from us is lost.
                if not lease.finished and not self._concluded(lease):
                    logger.warning(
                        "lease on task %s (token %s) was lost; the worker should stop",
                        lease.task_id,
                        lease.token,
                    )
                    lease._lost = True
                return
            except LeaseQueueError as exc:
                # The database may be restarting: keep trying until the lease runs out.
                logger.warning("could not renew the lease on task %s: %s", lease.task_id, exc)
                if time.monotonic() >= lease._local_deadline:
                    # Unrenewed past its end, the lease may be swept and claimed elsewhere.
                    logger.warning("lease on task %s lapsed; the worker should stop", lease.task_id)
                    lease._lost = True
                    return

    @staticmethod
    def _concluded(lease: Lease) -> bool:
        try:
            return lease._concluded_by_self()
        except LeaseQueueError:
            return False

    def stop(self) -> None:
        self._stopped.set()
        if self is not threading.current_thread():
            self.join()
