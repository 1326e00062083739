"""Attempts: the idempotency table that makes an effect, its record and the ack one commit.

Each attempt is first recorded as ``running`` in a commit of its own, so an attempt whose
process dies stays visible; the next attempt for the key marks it ``abandoned``. The work
then runs in one transaction that ends by marking the key ``succeeded`` and, with a lease,
by the fenced ack. A unique index allows one success per key: when two attempts of a key
run at once (a paused zombie and its replacement, say), the one that commits second finds
the key taken, rolls its effects back and reports a duplicate. No lock is held across the
work, so a paused process never holds its replacement up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import psycopg
from psycopg import errors as pg_errors, pq

from . import sql
from .connection import (
    CachedConnection,
    Executor,
    ScriptOutcome,
    deallocate,
    reset_session,
)
from .driver import QueueDriver
from .errors import (
    ConfigurationError,
    LeaseLost,
    LeaseQueueError,
    TransactionAbandoned,
    describe_error,
)
from .fastpath import Row
from .lease import Lease, leases_from_rows
from .validation import check_key

logger = logging.getLogger(__name__)

_IDLE = pq.TransactionStatus.IDLE


class Attempt:
    """One try at the work behind a key.

    ``duplicate``: the work already succeeded; skip it (``result`` holds the first
    success's result). ``connection``: write effects through it, inside the attempt's
    transaction. Set ``result`` to store a JSON object with the success (and the ack).
    ``key`` is the caller's key or the task's idempotency key (None for a task without
    one); ``queue`` is the task's queue, None for a key the caller chose. ``claimed``: with
    ``claim_next``, the next task of the lease's queue once the attempt has concluded (None
    when none was due, or the attempt did not succeed).
    """

    def __init__(
        self,
        *,
        target: AttemptTarget,
        attempt_id: int,
        number: int,
        duplicate: bool,
        result: dict[str, Any] | None,
        abandoned: int,
        connection: psycopg.Connection[Any],
    ) -> None:
        self.key = target.key
        self.queue = target.queue
        self.target = target
        self.id = attempt_id
        self.number = number
        self.duplicate = duplicate
        self.result = result
        self.abandoned = abandoned
        self.connection = connection
        self.claimed: Lease | None = None

    def __repr__(self) -> str:
        return (
            f"Attempt(key={self.key!r}, queue={self.queue!r}, number={self.number}, "
            f"duplicate={self.duplicate})"
        )


@dataclass(frozen=True)
class AttemptTarget:
    """What an attempt is an attempt at; two attempts with equal targets are the same work.

    A key the caller chooses (``queue`` None) lives in a space of its own, shared by every
    queue. Otherwise the work is the task's: its queue and idempotency key, or, for a task
    without one (``key`` None), the task itself.
    """

    queue: str | None
    key: str | None
    task_id: int | None

    @property
    def identity(self) -> str:
        """The target as one text, injective (migration 5 computes the same in SQL)."""
        if self.key is None:
            return f"task:{self.task_id}"
        if self.queue is None:
            return f"key:{self.key}"
        return f"queue:{len(self.queue)}:{self.queue}:{self.key}"

    @property
    def legacy_identity(self) -> str | None:
        """Where records of an earlier release with this key live (see migration 5)."""
        return None if self.key is None else f"legacy:{self.key}"


def attempt_target(key: str | None, lease: Lease | None) -> AttemptTarget:
    """The target of an attempt: the given key, else the lease's task (see AttemptTarget)."""
    task_id = lease.task_id if lease is not None else None
    if key is not None:
        return AttemptTarget(queue=None, key=check_key(key, "an attempt's key"), task_id=task_id)
    if lease is None:
        raise ConfigurationError("attempt() needs a key, a lease, or both")
    return AttemptTarget(queue=lease.queue, key=lease.idempotency_key, task_id=task_id)


class _SucceededElsewhere(Exception):
    """Another attempt of the key committed its success first."""


@contextmanager
def run_attempt(
    driver: QueueDriver,
    *,
    target: AttemptTarget,
    lease: Lease | None,
    worker_id: str,
    idle_timeout: float,
    claim_next: bool = False,
    next_lease_seconds: float | None = None,
) -> Iterator[Attempt]:
    """The attempt's life on one kept autocommit connection, lent for the attempt; see
    :meth:`LeaseQueue.attempt`.

    The package's own statements run on the connection's per-statement cursors, the
    caller's effects on ``attempt.connection``: both in the same transaction.

    The transaction begins with the first statement or ``transaction()`` block run on
    ``attempt.connection`` (or with the success mark), so work done before writing holds no
    lock. A session left idle in that transaction for ``idle_timeout`` seconds (a paused
    process) is ended by the server, releasing whatever rows it locked for the worker that
    took its place.

    With ``claim_next`` (and a lease), the round trip that concludes the attempt also claims
    the next task of the lease's queue, for its worker: in the attempt's own commit when
    the task has no concurrency key and the queue no flow control, else in a commit of its
    own after it. A conclusion that fails claims nothing, and a claim that fails costs the
    conclusion nothing.
    """
    cached = driver.lend()
    conn = cached.conn
    # The session is reset when the attempt ends: by its commit, else in the finally below.
    session_reset = False
    try:
        try:
            row = _begun(cached, target, lease, worker_id)
            if row is None:
                row = _begin(cached, driver, target, lease, worker_id)
            attempt = Attempt(
                target=target,
                attempt_id=row[0],
                number=row[1],
                duplicate=row[2],
                result=row[3],
                abandoned=row[4],
                connection=conn,
            )
            conn.attempt_settings = _attempt_settings(idle_timeout)
            claim = None
            if claim_next and lease is not None:
                claim = _NextClaim(driver, lease, next_lease_seconds)
            session_reset = yield from _run(cached, driver, attempt, lease, claim)
            if claim is not None and claim.succeeded and lease is not None:
                attempt.claimed = lease.next_lease = claim.lease(cached)
        finally:
            if not session_reset:
                conn.bounded = True  # cleared when the loan ends (QueueDriver.take_back)
                reset_session(conn, driver.statement(sql.RESET_SESSION))
    finally:
        driver.take_back(cached)


def _begun(
    cached: CachedConnection, target: AttemptTarget, lease: Lease | None, worker_id: str
) -> Row | None:
    """The start record the claim of ``lease`` made, when this attempt is at the task's own
    work, by the claim's worker (sql.CONCLUDE_ATTEMPT_AND_CLAIM); else None, and the record
    is taken back (an attempt at a key of the caller's is other work, and one that names
    another worker records it)."""
    if lease is None:
        return None
    row = lease._take_begun_attempt()
    if row is not None and (target != attempt_target(None, lease) or worker_id != lease.worker_id):
        lease._discard_attempt_record(cached, row)
        return None
    return row


def _begin(
    cached: CachedConnection,
    driver: QueueDriver,
    target: AttemptTarget,
    lease: Lease | None,
    worker_id: str,
) -> Row:
    """The attempt's start record, made apart; on a lease, only while the lease holds its
    task (sql.BEGIN_ATTEMPT_UNDER_LEASE), else LeaseLost and nothing written."""
    params: dict[str, Any] = {
        "identity": target.identity,
        "legacy_identity": target.legacy_identity,
        "queue": target.queue,
        "key": target.key,
        "task_id": target.task_id,
        "worker_id": worker_id,
    }
    statement = sql.BEGIN_ATTEMPT
    if lease is not None:
        statement = sql.BEGIN_ATTEMPT_UNDER_LEASE
        params["token"] = lease.token
    with driver.errors:
        rows = cached.rows(driver.statement(statement), params)
        if not rows and lease is not None:
            lease._raise_lost_on(cached, "begin an attempt on")
    return rows[0]


# Where the row of a claim made with an attempt's conclusion has the start record it made
# for the claimed task (conclude_claim_and_begin(), migration 26).
_BEGUN_COLUMN = 12


class _NextClaim:
    """The claim a conclusion carries (``claim_next``), and what it answered."""

    def __init__(self, driver: QueueDriver, lease: Lease, lease_seconds: float | None) -> None:
        self._driver = driver
        self._queue = lease.queue
        self.task = lease.task_id  # the task whose attempt carries the claim
        self._worker_id = lease.worker_id or ""
        self.params = driver.claims.params(self._queue, self._worker_id, lease_seconds)
        self.statement, self._plain = driver.claims.script_statement(self._queue)
        # Claimed in the attempt's own commit (sql.CONCLUDE_ATTEMPT_AND_CLAIM), else after it.
        self.together = self._plain and lease.keyless
        self.sent = 0.0
        self.rows: list[Row] = []
        self.succeeded = False
        self.failed = False

    def lease(self, cached: CachedConnection) -> Lease | None:
        """The claimed task's lease. A plain claim that found nothing asks once more whether
        the queue is controlled, and a claim that was to be made with the conclusion but was
        not (a row of NULLs: see sql.CONCLUDE_ATTEMPT_AND_CLAIM) is made apart, on the
        attempt's connection, its session reset."""
        rows = self.rows
        claims = self._driver.claims
        try:
            with self._driver.errors:
                if self.together and rows and rows[0][0] is None:
                    rows = claims.claim(cached, 1, self.params)
                elif not rows and self._plain and not self.failed:
                    rows = claims.claim_if_controlled(cached, 1, self.params)
        except LeaseQueueError as exc:
            # The attempt concluded: a failed claim after it only means no next task.
            logger.warning("the claim after task %s's attempt failed: %s", self.task, exc)
            return None
        leases = leases_from_rows(
            self._driver, rows, queue=self._queue, worker_id=self._worker_id, sent=self.sent
        )
        if not leases:
            return None
        (lease,) = leases
        for row in rows:
            if row[0] == lease.task_id and len(row) > _BEGUN_COLUMN and row[_BEGUN_COLUMN]:
                lease._begin_attempt_with(row[_BEGUN_COLUMN:])
        return lease


def _run(
    cached: CachedConnection,
    driver: QueueDriver,
    attempt: Attempt,
    lease: Lease | None,
    claim: _NextClaim | None,
) -> Generator[Attempt, None, bool]:
    """The work's transaction and how it ends; True when its commit also reset the session."""
    conn = cached.conn
    session_reset = False
    try:
        conn.autocommit = False
        round_trips = conn.round_trips
        try:
            yield attempt
            # The caller's work is over: what follows is the package's own (bounded.py).
            conn.bounded = True
            encoded = driver.encode_result(attempt.result)
            empty = conn.pgconn.transaction_status == _IDLE
            # Nor did it change the session, when it made no round trip on the connection
            # (psycopg counts its setters, autocommit's too, as round trips: set below).
            # Every psycopg call passes through wait(); only libpq driven directly
            # (attempt.connection.pgconn) would go unseen.
            untouched = empty and conn.round_trips == round_trips
            if empty:
                # The work ran no statement (a duplicate, or effects kept elsewhere): no
                # transaction to open just to conclude.
                conn.autocommit = True
            script = _conclusion_script(empty, untouched, claim)
            session_reset = _conclude(cached, driver, script, attempt, lease, encoded, claim)
        except BaseException:
            conn.bounded = True
            _rollback(conn)
            raise
        finally:
            conn.attempt_settings = None
            if not conn.closed and not conn.autocommit:
                conn.autocommit = True  # psycopg's setter costs a call even when unchanged
    except _SucceededElsewhere:
        _adopt_success(conn, driver, attempt, lease)
    except (TransactionAbandoned, pg_errors.IdleInTransactionSessionTimeout):
        if lease is None:
            raise
        # Idle past the lease (a paused process): the task may be someone else's by now.
        raise LeaseLost(
            f"the attempt on task {lease.task_id} sat idle in its transaction for longer than "
            "the lease and the server ended it; nothing was written"
        ) from None
    except BaseException as exc:
        _record_failure(conn, driver, attempt, exc)
        # An interrupt is not the task's fault: the lease is left to its holder (`with
        # lease` releases it), so the task keeps its attempts.
        if lease is not None and isinstance(exc, Exception) and not isinstance(exc, LeaseLost):
            _fail_lease(conn, driver, lease, exc)
        if isinstance(exc, psycopg.OperationalError) and conn.broken:
            # The caller's statement met a dropped connection (a restart, a failover, a
            # cut): the database's failure, told as the package tells it everywhere else.
            driver.errors.raise_translated(exc)
        raise
    if lease is not None:
        lease._mark_acked()
    if claim is not None and session_reset:
        claim.succeeded = True
    return session_reset


def _conclusion_script(empty: bool, untouched: bool, claim: _NextClaim | None) -> str:
    """How the attempt ends: ``empty`` when its work ran no statement (no transaction is
    open), ``untouched`` when it made no round trip on the connection at all, ``claim`` the
    next claim it carries, if any (see sql.CONCLUDE_ATTEMPT)."""
    if claim is not None and claim.together:
        if untouched:
            return sql.CONCLUDE_UNTOUCHED_ATTEMPT_AND_CLAIM
        return sql.CONCLUDE_EMPTY_ATTEMPT_AND_CLAIM if empty else sql.CONCLUDE_ATTEMPT_AND_CLAIM
    if untouched and claim is None:
        return sql.CONCLUDE_UNTOUCHED_ATTEMPT
    if empty:
        return sql.CONCLUDE_EMPTY_ATTEMPT_APART if claim else sql.CONCLUDE_EMPTY_ATTEMPT
    return sql.CONCLUDE_ATTEMPT


@lru_cache(maxsize=64)
def _attempt_settings(idle_timeout: float) -> bytes:
    milliseconds = min(int(idle_timeout * 1000), sql.MAX_TIMEOUT_MILLISECONDS)
    return sql.ATTEMPT_SETTINGS.format(milliseconds=milliseconds).encode()


def _rollback(conn: psycopg.Connection[Any]) -> None:
    if conn.closed or conn.broken:
        return
    try:
        conn.rollback()
    except psycopg.Error:
        conn.close()


def _conclude(
    cached: CachedConnection,
    driver: QueueDriver,
    script: str,
    attempt: Attempt,
    lease: Lease | None,
    encoded_result: str | None,
    claim: _NextClaim | None,
) -> bool:
    """The success mark, the lease's fenced ack, the commit and the session's reset, and
    the next claim with ``claim``; False when the session is left to reset.

    One round trip (``script``: see sql.CONCLUDE_ATTEMPT), which tells whether its commit
    went through; the commit happens only if the mark and the ack both went through. A
    conclusion of one statement (_ALONE) is sent as the worker loop's statements are, and
    commits when it succeeds. The claim comes before that commit
    (sql.CONCLUDE_ATTEMPT_AND_CLAIM), or after it: either way a claim that fails (a
    conflict, a timeout) costs the attempt nothing, and no next task comes with it (the
    first kind is made again apart: see _NextClaim.lease).
    """
    params: dict[str, Any] = {
        "attempt_id": None if attempt.duplicate else attempt.id,
        "task_id": lease.task_id if lease else None,
        "token": lease.token if lease else None,
        "result": encoded_result,
    }
    text = driver.statement(script)
    alone = script in _ALONE
    if claim is not None:
        if not claim.together:
            text = sql.with_next_claim(text, claim.statement)
        params |= claim.params
        claim.sent = time.monotonic()
    try:
        if alone:
            rows = cached.rows(text, params)
        else:
            outcome = cached.run_script(text, params)
            if outcome.error is not None and not outcome.committed:
                raise outcome.error
    except psycopg.Error as exc:
        # Only the success index means another attempt won; the caller's own unique
        # constraints (deferred ones fail at COMMIT) are errors like any other.
        on_success_index = (exc.diag.schema_name, exc.diag.constraint_name) == (
            driver.schema,
            sql.SUCCESS_INDEX,
        )
        if isinstance(exc, pg_errors.UniqueViolation) and on_success_index:
            raise _SucceededElsewhere() from None
        if lease is not None and exc.sqlstate == sql.LEASE_GONE:
            with driver.errors:
                cached.conn.rollback()
                lease._raise_lost_on(cached, "ack")
        if lease is not None and isinstance(exc, pg_errors.SerializationFailure):
            # Outside READ COMMITTED, an ack that meets a conflict (see sql.CONCLUDE_ATTEMPT):
            # the lease may have been taken, or renewed, after the work's snapshot.
            with driver.errors:
                cached.conn.rollback()
                lease._raise_if_lost_on(cached, "ack")
        if cached.conn.broken and _committed_before_the_cut(driver, attempt):
            logger.warning(
                "%s concluded, but the connection was lost after its commit: %s",
                _subject(attempt, lease),
                exc,
            )
            if claim is not None:
                claim.failed = True  # a task the commit claimed is left to its lease
            return False
        with driver.errors:
            raise
    if alone:
        if claim is not None:
            claim.rows = rows
        return True
    return _committed(cached, outcome, claim, attempt, lease)


# The conclusions that are one statement, its own transaction, and reset nothing.
_ALONE = (sql.CONCLUDE_UNTOUCHED_ATTEMPT, sql.CONCLUDE_UNTOUCHED_ATTEMPT_AND_CLAIM)


def _subject(attempt: Attempt, lease: Lease | None) -> str:
    """What a warning about the attempt's conclusion names."""
    return f"task {lease.task_id}" if lease else f"the attempt at {attempt.key!r}"


def _committed_before_the_cut(driver: QueueDriver, attempt: Attempt) -> bool:
    """Whether a conclusion whose connection was lost committed first: its success mark is
    there. (A duplicate makes none: it is told the database was unreachable, and concludes
    again when its task comes back.) Asked on the renewals' connection: the attempt's own
    may have held the pool's last."""
    if attempt.duplicate:
        return False
    try:
        with driver.renewal_connection() as conn:
            row = conn.execute(
                driver.statement(sql.ATTEMPT_OUTCOME), {"attempt_id": attempt.id}
            ).fetchone()
    except LeaseQueueError:
        return False
    return row is not None and row[0] == "succeeded"


def _committed(
    cached: CachedConnection,
    outcome: ScriptOutcome,
    claim: _NextClaim | None,
    attempt: Attempt,
    lease: Lease | None,
) -> bool:
    """Read a conclusion that committed: its claim's rows, and an error after its commit
    (the session's reset, or the claim that follows it, failed), which leaves the session
    to reset and brings no next task but the one the commit claimed. False when the session
    is left to reset."""
    if claim is not None:
        if claim.together:
            claim.rows = outcome.rows[0]
        elif outcome.error is None:
            claim.rows = outcome.rows[-1]
    if outcome.error is not None:
        # The reset's row came back when what failed was the claim after it.
        failed = "the claim of the next task" if len(outcome.rows) > 1 else "the session's reset"
        logger.warning(
            "%s concluded, but %s after it failed: %s",
            _subject(attempt, lease),
            failed,
            outcome.error,
        )
        if claim is not None:
            if claim.together:
                if claim.rows and claim.rows[0][0] is None:
                    claim.rows = []  # not made with the conclusion: not on a session not reset
                claim.succeeded = True
            claim.failed = True
        return False
    # Committed: a failure to drop what the borrower PREPAREd only costs the connection.
    try:
        ((reset,),) = outcome.rows[1]
        deallocate(cached.conn, reset)
    except psycopg.Error:
        cached.conn.close()  # the pool discards a closed connection
    return True


def _adopt_success(
    conn: psycopg.Connection[Any], driver: QueueDriver, attempt: Attempt, lease: Lease | None
) -> None:
    """The key succeeded elsewhere while this attempt ran: it becomes a duplicate."""
    with driver.errors:
        row = conn.execute(
            driver.statement(sql.SUCCESS_FOR_IDENTITY),
            {
                "identity": attempt.target.identity,
                "legacy_identity": attempt.target.legacy_identity,
            },
        ).fetchone()
        attempt.duplicate = True
        attempt.result = row[0] if row else None
        _finish(conn, driver, attempt, "skipped", None, None)
        if lease is not None:
            lease._ack_on(conn, driver.encode_result(attempt.result))


def _finish(
    conn: Executor,
    driver: QueueDriver,
    attempt: Attempt,
    outcome: str,
    error: str | None,
    encoded_result: str | None,
) -> None:
    conn.execute(
        driver.statement(sql.FINISH_ATTEMPT),
        {"attempt_id": attempt.id, "outcome": outcome, "error": error, "result": encoded_result},
    )


def _record_failure(
    conn: psycopg.Connection[Any], driver: QueueDriver, attempt: Attempt, exc: BaseException
) -> None:
    if attempt.duplicate or conn.closed or conn.broken:
        return
    try:
        with driver.errors:
            _finish(conn, driver, attempt, "failed", describe_error(exc), None)
    except LeaseQueueError as record_error:
        logger.warning("could not record the failed attempt %s: %s", attempt.id, record_error)


def _fail_lease(
    conn: psycopg.Connection[Any], driver: QueueDriver, lease: Lease, exc: BaseException
) -> None:
    # On this connection, idle since the rollback: the pool may have no other to lend.
    if conn.closed or conn.broken:
        return
    try:
        with driver.errors:
            lease._fail_on(conn, exc)
    except LeaseQueueError as fail_error:
        logger.warning("could not fail task %s: %s", lease.task_id, fail_error)
