"""Flow control: pausing a queue, concurrency limits per key, and rate limits.

The controls live in the database (``queue_flow`` and ``flow_keys``, see migrations.py,
migration 9) and are enforced by the claim itself, so they hold however many workers,
processes and hosts claim. A queue without any control is claimed by the plain statement;
a controlled one by ``claim_flow()``. :class:`~dagster_leasequeue.queue.LeaseQueue`
exposes these functions as its methods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeAlias

import psycopg

from . import sql
from .driver import QueueDriver
from .models import KeyAtLimit, KeyFlow, QueueFlow
from .payloads import encode_object
from .validation import check_key

# A task's concurrency key: one for every task of a call, or one per payload from a
# function of it (None: no key, so no concurrency limit applies to the task).
ConcurrencyKey: TypeAlias = "str | Callable[[Mapping[str, Any]], str | None] | None"


def key_of(concurrency_key: ConcurrencyKey, payload: Mapping[str, Any], index: int) -> str | None:
    """The checked concurrency key of the payload at ``index``."""
    if callable(concurrency_key):
        return check_key(concurrency_key(payload), f"the concurrency key of payload #{index}")
    return check_key(concurrency_key, "concurrency_key")


def encode_payloads(
    payloads: Iterable[Mapping[str, Any]], concurrency_key: ConcurrencyKey, max_bytes: int
) -> Iterator[tuple[str, str | None]]:
    """Each payload's JSON text and its concurrency key, checked, in the payloads' order."""
    if callable(concurrency_key):
        for index, payload in enumerate(payloads):
            text = encode_object(payload, what=f"payload #{index}", max_bytes=max_bytes)
            yield text, key_of(concurrency_key, payload, index)
        return
    # One key for every payload: checked once.
    key = check_key(concurrency_key, "concurrency_key")
    for index, payload in enumerate(payloads):
        yield encode_object(payload, what=f"payload #{index}", max_bytes=max_bytes), key


def _changed(
    driver: QueueDriver,
    queue: str,
    statement: str,
    params: Mapping[str, Any],
    notify: Mapping[str, Any],
    *,
    key_limits: bool = False,
) -> None:
    """Apply one change to a queue's controls, in one transaction with the queue's row.

    The change ends with the enqueue's hint on the queue's channel: claimers waiting on a
    queue just resumed, or given room, look again at once.
    """
    with driver.connection() as conn, conn.transaction():
        conn.execute(driver.statement(sql.ENSURE_QUEUE_FLOW), {"queue": queue})
        conn.execute(driver.statement(statement), {"queue": queue, **params})
        if key_limits:
            conn.execute(driver.statement(sql.MARK_KEY_LIMITS), {"queue": queue})
        if notify.get("notify"):
            conn.execute(sql.NOTIFY, {"channel": notify["channel"], "payload": queue})


def set_paused(driver: QueueDriver, queue: str, paused: bool, notify: Mapping[str, Any]) -> None:
    """Pause or resume a queue; see :meth:`LeaseQueue.pause`."""
    _changed(driver, queue, sql.SET_PAUSED, {"paused": paused}, notify)


def set_concurrency_limit(
    driver: QueueDriver,
    queue: str,
    max_running: int | None,
    key: str | None,
    notify: Mapping[str, Any],
) -> None:
    """See :meth:`LeaseQueue.set_concurrency_limit`."""
    if key is None:
        _changed(driver, queue, sql.SET_QUEUE_CONCURRENCY, {"max_running": max_running}, notify)
    else:
        params = {"key": key, "max_running": max_running}
        _changed(driver, queue, sql.SET_KEY_CONCURRENCY, params, notify, key_limits=True)


def set_rate_limit(
    driver: QueueDriver,
    queue: str,
    per_second: float | None,
    burst: float | None,
    key: str | None,
    notify: Mapping[str, Any],
) -> None:
    """See :meth:`LeaseQueue.set_rate_limit`."""
    params = {"key": key, "per_second": per_second, "burst": burst}
    if key is None:
        _changed(driver, queue, sql.SET_QUEUE_RATE, params, notify)
    else:
        _changed(driver, queue, sql.SET_KEY_RATE, params, notify, key_limits=True)


def _key_flow(
    key: str, running: int, max_running: int | None, per_second: float | None, burst: float | None
) -> KeyFlow:
    """A row of flow_keys (key, running, max_running, per_second, burst)."""
    return KeyFlow(key, int(running), max_running, per_second, burst)


def queue_flow(conn: psycopg.Connection[Any], driver: QueueDriver, queue: str) -> QueueFlow:
    """The controls in force on a queue, with the keys that have limits of their own."""
    keys = tuple(
        _key_flow(*row) for row in conn.execute(driver.statement(sql.FLOW_KEYS), {"queue": queue})
    )
    row = conn.execute(driver.statement(sql.QUEUE_FLOW), {"queue": queue}).fetchone()
    if row is None:
        return QueueFlow(queue, keys=keys)
    paused, max_running, per_second, burst = row
    return QueueFlow(queue, bool(paused), max_running, per_second, burst, keys)


def controlled_queues(driver: QueueDriver) -> dict[str, QueueFlow]:
    """See :meth:`LeaseQueue.flows`."""
    with driver.connection() as conn:
        keys: dict[str, list[KeyFlow]] = {}
        for queue, *row in conn.execute(driver.statement(sql.ALL_FLOW_KEYS)):
            keys.setdefault(queue, []).append(_key_flow(*row))
        rows = conn.execute(driver.statement(sql.CONTROLLED_QUEUES)).fetchall()
    return {
        queue: QueueFlow(
            queue, bool(paused), max_running, per_second, burst, tuple(keys.get(queue, ()))
        )
        for queue, paused, max_running, per_second, burst in rows
    }


def keys_at_limit(
    driver: QueueDriver, queue: str, waiting_longer_than: float, limit: int
) -> list[KeyAtLimit]:
    """See :meth:`LeaseQueue.keys_at_limit`."""
    with driver.connection() as conn:
        rows = conn.execute(
            driver.statement(sql.KEYS_AT_LIMIT),
            {"queue": queue, "seconds": waiting_longer_than, "limit": limit},
        ).fetchall()
    return [
        KeyAtLimit(key, int(running), int(max_running), float(waited))
        for key, running, max_running, waited in rows
    ]
