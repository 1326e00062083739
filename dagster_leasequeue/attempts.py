"""Attempts: the idempotency table that makes an effect, its record and the ack one commit.

An attempt holds a session advisory lock on its key, so two workers with the same key (a
zombie and its replacement, say) take turns; the unique index on successful keys is the
last word even if they did not. Each attempt is first recorded as ``running`` in its own
commit, so an attempt whose process dies stays visible; the next attempt for the key marks
it ``abandoned``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import psycopg

from . import sql
from .errors import ConfigurationError, LeaseLost, LeaseQueueError
from .lease import Lease, _describe_error

logger = logging.getLogger("dagster_leasequeue")


class Attempt:
    """One try at the work behind a key.

    ``duplicate``: the key already succeeded; skip the work (``result`` holds the first
    success's result). ``connection``: write effects through it, inside the attempt's
    transaction. Set ``result`` to store a JSON object with the success (and the ack).
    """

    def __init__(
        self,
        *,
        key: str,
        attempt_id: int,
        number: int,
        duplicate: bool,
        result: dict[str, Any] | None,
        abandoned: int,
        connection: psycopg.Connection[Any],
    ) -> None:
        self.key = key
        self.id = attempt_id
        self.number = number
        self.duplicate = duplicate
        self.result = result
        self.abandoned = abandoned
        self.connection = connection

    def __repr__(self) -> str:
        return f"Attempt(key={self.key!r}, number={self.number}, duplicate={self.duplicate})"


def attempt_key(key: str | None, lease: Lease | None) -> str:
    """The key of an attempt: the given one, else the lease's idempotency key or queue:id."""
    if key is not None:
        if not isinstance(key, str) or not key:
            raise ConfigurationError(f"an attempt key must be a non-empty string, got {key!r}")
        return key
    if lease is None:
        raise ConfigurationError("attempt() needs a key, a lease, or both")
    return lease.idempotency_key or f"{lease.queue}:{lease.task_id}"


@contextmanager
def run_attempt(
    conn: psycopg.Connection[Any],
    *,
    schema: str,
    key: str,
    lease: Lease | None,
    worker_id: str,
    errors: Callable[[], AbstractContextManager[None]],
    encode_result: Callable[[dict[str, Any] | None], str | None],
) -> Iterator[Attempt]:
    """The attempt's life on one autocommit connection; see :meth:`LeaseQueue.attempt`."""
    lock_params = {"namespace": sql.ADVISORY_NAMESPACE, "schema": schema, "key": key}
    with errors():
        conn.execute(sql.LOCK_ATTEMPT_KEY, lock_params)
    try:
        with errors():
            row = conn.execute(
                sql.compose(sql.BEGIN_ATTEMPT, schema),
                {"key": key, "task_id": lease.task_id if lease else None, "worker_id": worker_id},
            ).fetchone()
        assert row is not None
        attempt = Attempt(
            key=key,
            attempt_id=row[0],
            number=row[1],
            duplicate=row[2],
            result=row[3],
            abandoned=row[4],
            connection=conn,
        )
        try:
            with conn.transaction():
                yield attempt
                encoded = encode_result(attempt.result)
                with errors():
                    if not attempt.duplicate:
                        _finish(conn, schema, attempt, "succeeded", None, encoded)
                    if lease is not None:
                        lease.ack_on(conn, encoded)
        except BaseException as exc:
            _record_failure(conn, schema, attempt, exc, errors)
            if lease is not None and not isinstance(exc, LeaseLost):
                _fail_lease(lease, exc)
            raise
        if lease is not None:
            lease.mark_acked()
    finally:
        _unlock(conn, lock_params)


def _finish(
    conn: psycopg.Connection[Any],
    schema: str,
    attempt: Attempt,
    outcome: str,
    error: str | None,
    encoded_result: str | None,
) -> None:
    conn.execute(
        sql.compose(sql.FINISH_ATTEMPT, schema),
        {"attempt_id": attempt.id, "outcome": outcome, "error": error, "result": encoded_result},
    )


def _record_failure(
    conn: psycopg.Connection[Any],
    schema: str,
    attempt: Attempt,
    exc: BaseException,
    errors: Callable[[], AbstractContextManager[None]],
) -> None:
    if attempt.duplicate or conn.closed or conn.broken:
        return
    try:
        with errors():
            _finish(conn, schema, attempt, "failed", _describe_error(exc), None)
    except LeaseQueueError as record_error:
        logger.warning("could not record the failed attempt %s: %s", attempt.id, record_error)


def _fail_lease(lease: Lease, exc: BaseException) -> None:
    try:
        lease.fail(exc)
    except LeaseQueueError as fail_error:
        logger.warning("could not fail task %s: %s", lease.task_id, fail_error)


def _unlock(conn: psycopg.Connection[Any], lock_params: dict[str, Any]) -> None:
    if conn.closed or conn.broken:
        return  # the session, and its lock, are gone
    try:
        conn.execute(sql.UNLOCK_ATTEMPT_KEY, lock_params)
    except psycopg.Error as exc:
        logger.warning("could not release an attempt lock: %s", type(exc).__name__)
