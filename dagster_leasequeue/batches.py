"""Task batches: enqueued together, counted as they finish, waited on, read back.

A batch is a row of ``batches`` and its tasks carry its id. Its finished tasks are counted
by a trigger in stripes (see migrations.py, migration 6), so its state costs the same to
read at 10 tasks or a million, and workers acking its tasks do not queue on one counter.
:class:`~dagster_leasequeue.queue.LeaseQueue` exposes these functions as its methods.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any

import psycopg

from . import sql
from .bulk import copy_tasks
from .driver import QueueDriver
from .errors import BatchNotFound, ConfigurationError
from .flow import ConcurrencyKey, encode_payloads
from .models import STATUSES, Batch, BatchInfo, TaskResult
from .notify import Listener
from .validation import check_iterable, check_key

# Payloads per statement when idempotency keys make COPY unusable.
KEYED_ROWS_PER_STATEMENT = 1000
# Rows fetched per page by batch_results' server-side cursor.
RESULTS_PAGE = 1000


def enqueue_batch(
    driver: QueueDriver,
    payloads: Iterable[Mapping[str, Any]],
    *,
    queue: str,
    name: str | None,
    priority: int,
    max_attempts: int,
    idempotency_keys: Iterable[str] | None,
    concurrency_key: ConcurrencyKey,
    notify: Mapping[str, Any],
) -> Batch:
    """Add a batch and its tasks in one transaction; see :meth:`LeaseQueue.enqueue_batch`."""
    with driver.connection() as conn, conn.transaction():
        row = conn.execute(
            driver.statement(sql.CREATE_BATCH), {"name": name, "queue": queue}
        ).fetchone()
        if row is None:  # a batch of this name exists: a retried fan-out adds nothing
            found = conn.execute(driver.statement(sql.BATCH_BY_NAME), {"name": name}).fetchone()
            assert found is not None  # the conflict's batch is committed, and never deleted
            if found[1] != queue:
                raise ConfigurationError(
                    f"batch name {name!r} is taken by batch {found[0]} of queue {found[1]!r}: "
                    f"names are unique across queues; give the batch of queue {queue!r} "
                    "another name"
                )
            return Batch(found[0], name, found[1], int(found[2]), found[3], created=False)
        batch_id, created_at = row
        columns = {
            "queue": queue,
            "priority": priority,
            "max_attempts": max_attempts,
            "batch_id": batch_id,
            "concurrency_key": concurrency_key,
        }
        max_bytes = driver.settings.payload_max_bytes
        if idempotency_keys is None:
            encoded = encode_payloads(payloads, concurrency_key, max_bytes)
            total = copy_tasks(conn, driver, encoded, columns)
        else:
            total = _insert_keyed_tasks(
                conn, driver, payloads, idempotency_keys, columns, max_bytes
            )
        conn.execute(driver.statement(sql.SEAL_BATCH), {"total": total, "batch_id": batch_id})
        if total and notify["notify"]:
            conn.execute(sql.NOTIFY, {"channel": notify["channel"], "payload": queue})
    return Batch(batch_id, name, queue, total, created_at)


def _insert_keyed_tasks(
    conn: psycopg.Connection[Any],
    driver: QueueDriver,
    payloads: Iterable[Mapping[str, Any]],
    keys: Iterable[str],
    columns: Mapping[str, Any],
    max_bytes: int,
) -> int:
    """Insert the tasks in chunks, skipping keys held by unfinished tasks, as enqueue does."""
    statement = driver.statement(sql.ENQUEUE_BATCH_KEYED)
    encoded = encode_payloads(payloads, columns["concurrency_key"], max_bytes)
    pairs = zip(encoded, _checked_keys(keys), strict=True)
    total = 0
    try:
        while chunk := list(islice(pairs, KEYED_ROWS_PER_STATEMENT)):
            params = dict(columns) | {
                "payloads": [text for (text, _), _ in chunk],
                "concurrency_keys": [key for (_, key), _ in chunk],
                "keys": [key for _, key in chunk],
            }
            total += conn.execute(statement, params).rowcount
    except ValueError as exc:
        if "zip()" not in str(exc):
            raise
        raise ConfigurationError(
            "idempotency_keys must have one key per payload: " + str(exc)
        ) from None
    return total


def _checked_keys(keys: Iterable[str]) -> Iterator[str]:
    for index, key in enumerate(keys):
        if key is None:
            raise ConfigurationError(f"idempotency key #{index} is None: give every task a key")
        yield check_key(key, f"idempotency key #{index}")  # type: ignore[misc]


def batch_info(driver: QueueDriver, batch_id: int) -> BatchInfo:
    with driver.connection() as conn:
        row = conn.execute(driver.statement(sql.BATCH_INFO), {"batch_id": batch_id}).fetchone()
    if row is None:
        raise _not_found(driver, batch_id)
    return _info(row)


def list_batches(driver: QueueDriver, *, queue: str | None, limit: int) -> list[BatchInfo]:
    with driver.connection() as conn:
        rows = conn.execute(
            driver.statement(sql.LIST_BATCHES), {"queue": queue, "limit": limit}
        ).fetchall()
    return [_info(row) for row in rows]


def _info(row: Sequence[Any]) -> BatchInfo:
    batch_id, name, queue, total, created_at, done, dead, cancelled, changed_at, processing = row
    finished = done + dead + cancelled
    return BatchInfo(
        id=batch_id,
        name=name,
        queue=queue,
        total=total,
        enqueued=max(0, total - finished - processing),
        processing=processing,
        done=done,
        dead=dead,
        cancelled=cancelled,
        created_at=created_at,
        # The last change of a counter is the last task's finish; an empty batch is
        # finished as it is made.
        finished_at=(changed_at or created_at) if finished >= total else None,
    )


def batch_results(
    driver: QueueDriver, batch_id: int, statuses: Sequence[str]
) -> Iterator[TaskResult]:
    """Yield the batch's tasks of these statuses, a status at a time, each in id order."""
    statement = driver.statement(sql.BATCH_RESULTS)
    with driver.connection() as conn, conn.transaction():
        require_batch(conn, driver, batch_id)  # BatchNotFound, not an empty iteration
        for status in statuses:
            # A server-side cursor: a million results come a page at a time.
            with conn.cursor(name=f"leasequeue_batch_{batch_id}") as cursor:
                cursor.itersize = RESULTS_PAGE
                cursor.execute(statement, {"batch_id": batch_id, "status": status})
                for task_id, payload, task_status, result, last_error in cursor:
                    yield TaskResult(task_id, payload, task_status, result, last_error)


def checked_statuses(statuses: str | Iterable[str]) -> list[str]:
    """Task statuses, each once: one status, or some of them."""
    if isinstance(statuses, str):
        statuses = (statuses,)
    listed = list(check_iterable("statuses", statuses, "status names"))
    unknown = [status for status in listed if status not in STATUSES]
    if unknown or not listed:
        raise ConfigurationError(f"statuses must be some of {', '.join(STATUSES)}; got {listed!r}")
    return list(dict.fromkeys(listed))


def wait_batch(
    driver: QueueDriver,
    listener: Listener,
    batch_id: int,
    *,
    timeout: float | None,
    poll_interval: float,
) -> BatchInfo:
    """Wait until the batch has finished, or the timeout passed; return its state.

    Woken by the NOTIFY its last tasks send; polls every ``poll_interval`` seconds too,
    since a notification can be missed (a connection that dropped, PgBouncer).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    # Before reading: a finish after the read still wakes us.
    mark = listener.listen(poll_interval if timeout is None else min(timeout, poll_interval))
    while True:
        info = batch_info(driver, batch_id)
        if info.finished:
            return info
        wait = poll_interval
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
            if wait <= 0:
                return info
        mark = listener.wait(wait, mark)


def cancel_batch(driver: QueueDriver, batch_id: int, notify_channel: str) -> int:
    """Cancel the batch's unfinished tasks; return how many."""
    with driver.connection() as conn, conn.transaction():
        params = {"batch_id": batch_id, "channel": notify_channel}
        row = conn.execute(driver.statement(sql.CANCEL_BATCH), params).fetchone()
        task_ids: list[int] = row[0] if row else []
        cancelled = len(task_ids)
        if cancelled:
            abandon = driver.statement(sql.ABANDON_RECORDS_OF_CANCELLED_TASKS)
            conn.execute(abandon, {"task_ids": task_ids})
            conn.execute(sql.NOTIFY, {"channel": notify_channel, "payload": f"batch:{batch_id}"})
        else:  # nothing to cancel: a finished batch, or none of that id
            require_batch(conn, driver, batch_id)
    return cancelled


def require_batch(conn: psycopg.Connection[Any], driver: QueueDriver, batch_id: int) -> None:
    """BatchNotFound unless the batch exists."""
    if conn.execute(driver.statement(sql.BATCH_EXISTS), {"batch_id": batch_id}).fetchone() is None:
        raise _not_found(driver, batch_id)


def _not_found(driver: QueueDriver, batch_id: int) -> BatchNotFound:
    return BatchNotFound(f"no batch with id {batch_id} in schema {driver.schema!r}")
