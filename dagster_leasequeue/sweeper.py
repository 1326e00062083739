"""The sweeper: recovers tasks whose lease expired, in batches, safe to run anywhere at once.

Each batch is one transaction that first takes a per-schema advisory lock, then moves up to
``batch_size`` expired leases back to ``enqueued`` (or to ``dead`` when their attempts are
used up) with a compare-and-set UPDATE over rows locked ``FOR UPDATE SKIP LOCKED``, and
appends one recovery event per task. The lock makes concurrent sweepers take turns per
batch, so event ids commit in increasing order; the compare-and-set makes a second sweeper
find nothing left to do. A worker's renew or ack racing the sweeper meets the same row
lock: whichever commits first wins and the other changes nothing.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import class_row

from . import sql
from .models import RecoveredTask


def sweep_expired(
    conn: psycopg.Connection[Any], schema: str, *, batch_size: int, limit: int | None
) -> list[RecoveredTask]:
    """Recover expired leases batch after batch until none is left or ``limit`` is reached."""
    recovered: list[RecoveredTask] = []
    lock_params = {"namespace": sql.SWEEP_LOCK, "schema": schema}
    channel = sql.notify_channel(schema)
    statement = sql.compose(sql.SWEEP_BATCH, schema)
    while limit is None or len(recovered) < limit:
        size = batch_size if limit is None else min(batch_size, limit - len(recovered))
        with conn.transaction():
            # Sweeps of one schema take turns per batch, so recovery events commit in id
            # order: a reader that remembers the last id it saw can never skip one.
            conn.execute(sql.ADVISORY_XACT_LOCK, lock_params)
            cursor = conn.cursor(row_factory=class_row(RecoveredTask))
            rows = cursor.execute(statement, {"limit": size, "channel": channel}).fetchall()
        recovered.extend(rows)
        if len(rows) < size:
            break
    return recovered
