"""Claiming: which statement claims a queue, and the leases its rows become.

A queue without flow control is claimed by one plain statement (sql.CLAIM_ONE, CLAIM_MANY),
a controlled one by ``claim_flow()``. The plain statements pick nothing from a controlled
queue, so a stale guess costs a round trip, never a limit: when one finds nothing, the
queue is asked whether it is controlled, and is then claimed through ``claim_flow()`` for
a while. The queue's claims and its leases' ``ack_and_claim`` share that guess.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from . import sql
from .connection import CachedConnection
from .fastpath import Row

if TYPE_CHECKING:
    from .driver import QueueDriver

# How long a queue found controlled is claimed through claim_flow before it is asked again
# (a queue whose controls were all removed is claimed correctly, if slower, meanwhile).
CONTROLLED_RECHECK_SECONDS = 5.0

logger = logging.getLogger(__name__)


class Claims:
    """The claims of one queue object: its statements and its guess of controlled queues."""

    def __init__(self, driver: QueueDriver) -> None:
        self._driver = driver
        # Queues found controlled, and until when (monotonic) to claim them by claim_flow.
        self._controlled: dict[str, float] = {}

    def params(self, queue: str, worker_id: str, lease_seconds: float | None) -> dict[str, Any]:
        """The parameters every claim statement takes."""
        return {
            "queue": queue,
            "worker_id": worker_id,
            "lease_seconds": lease_seconds,
            "default_lease": self._driver.settings.lease_seconds,
            "channel": sql.notify_channel(self._driver.schema),
        }

    def claim(self, conn: CachedConnection, limit: int, params: Mapping[str, Any]) -> list[Row]:
        """Claim up to ``limit`` tasks of ``params['queue']``; the statement's rows."""
        statement, plain = self.statement(params["queue"], limit)
        rows = conn.rows(statement, params)
        return rows or (self.claim_if_controlled(conn, limit, params) if plain else [])

    def statement(self, queue: str, limit: int) -> tuple[str, bool]:
        """The statement that claims ``queue`` now, and whether it is the plain one (whose
        empty answer calls for :meth:`claim_if_controlled`)."""
        if self._is_controlled(queue):
            return sql.compose_claim_flow(self._driver.schema, limit), False
        return sql.compose_claim(self._driver.schema, limit), True

    def script_statement(self, queue: str) -> tuple[str, bool]:
        """As :meth:`statement` for one task, for a claim sent in a script (a simple query,
        where nothing is prepared): a function call, whose statement keeps its plan."""
        if self._is_controlled(queue):
            return sql.compose_claim_flow(self._driver.schema, 1), False
        return self._driver.statement(sql.CLAIM_ONE_CALL), True

    def ack_and_claim(
        self,
        conn: CachedConnection,
        acks: Mapping[str, Any],
        limit: int,
        params: Mapping[str, Any],
        *,
        keyless: bool = False,
        leases: int = 1,
    ) -> tuple[set[int], list[Row]]:
        """Ack one lease (``acks``: ACK's parameters) or ``leases`` of them (ACK_MANY's),
        then, if every fence held, claim up to ``limit`` tasks, all in one commit.

        Returns the acked tasks' ids and the claimed rows. A plain queue takes one
        statement (a leaner one for one lease known to have no concurrency key:
        ``keyless``); a controlled one an ack and a ``claim_flow()`` in one transaction.
        Either way a claim that fails after the acks only means no next task: the acks
        are kept.
        """
        schema, queue = self._driver.schema, params["queue"]
        many = "task_ids" in acks
        if self._is_controlled(queue):
            with conn.conn.bounded_round_trips(), conn.conn.transaction():
                acked = self._ack(conn, acks, many)
                if len(acked) < leases:
                    return acked, []
                statement = sql.compose_claim_flow(schema, limit)
                try:
                    # A savepoint: a claim that fails (a lock or statement timeout, say)
                    # is undone alone, and the acks still commit.
                    with conn.conn.transaction():
                        return acked, conn.execute(statement, params).fetchall()
                except psycopg.Error as exc:
                    if conn.conn.broken:
                        # The session is gone, and the acks with it: psycopg ends a
                        # transaction block on a broken connection silently.
                        raise
                    _no_claim_after_acks(queue, exc)
                    return acked, []
        statement = sql.compose_ack_and_claim(schema, limit, many=many, keyless=keyless)
        try:
            rows = conn.rows(statement, {**params, **acks})
        except psycopg.Error as exc:
            if exc.sqlstate != sql.LEASE_GONE:
                raise
            return set(), []  # the fence failed, and the claim was undone with it
        acked = {int(row[0]) for row in rows if row[1] is None}
        claimed = [row for row in rows if row[1] is not None]
        if claimed or len(acked) < leases:
            return acked, claimed
        try:
            return acked, self.claim_if_controlled(conn, limit, params)
        except psycopg.Error as exc:  # the acks committed
            _no_claim_after_acks(queue, exc)
            return acked, []

    def _ack(self, conn: CachedConnection, acks: Mapping[str, Any], many: bool) -> set[int]:
        if not many:
            done = conn.execute(self._driver.statement(sql.ACK), acks).rowcount == 1
            return {int(acks["task_id"])} if done else set()
        rows = conn.execute(self._driver.statement(sql.ACK_MANY), acks)
        return {int(row[0]) for row in rows}

    def _is_controlled(self, queue: str) -> bool:
        return self._controlled.get(queue, 0.0) > time.monotonic()

    def claim_if_controlled(
        self, conn: CachedConnection, limit: int, params: Mapping[str, Any]
    ) -> list[Row]:
        """After a plain claim found nothing: claim_flow's rows if the queue is controlled."""
        queue = params["queue"]
        row = conn.execute(self._driver.statement(sql.QUEUE_CONTROLLED), params).fetchone()
        if not (row and row[0]):
            self._controlled.pop(queue, None)
            return []
        self._controlled[queue] = time.monotonic() + CONTROLLED_RECHECK_SECONDS
        statement = sql.compose_claim_flow(self._driver.schema, limit)
        return conn.execute(statement, params).fetchall()


def _no_claim_after_acks(queue: str, error: psycopg.Error) -> None:
    logger.warning("the claim after an ack of %s failed: %s", queue, error)


def in_claim_order(rows: Sequence[Row]) -> list[Row]:
    """The claimed rows in claim order (UPDATE ... RETURNING gives none; run_at is 10th)."""
    return sorted(rows, key=lambda row: (-row[2], row[9], row[0])) if len(rows) > 1 else list(rows)
