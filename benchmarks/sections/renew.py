"""Lease renewals: how many stay HOT updates, and what one costs.

A renewal changes only ``lease_expires_at``, which no index covers, so PostgreSQL can
write the new row version on the same page without new index entries (a HOT update), as
long as the page has room: the tasks table leaves a fifth of each page free
(``fillfactor = 80``). Claims and acks change ``status``, which the partial indexes'
predicates read, so they are never HOT. The counts come from ``pg_stat_user_tables``,
which a backend reports when it ends; so the claims and the renewals each run on a
connection of their own that is closed before the counts are read. The same is run on a
table set to ``fillfactor = 100``, to show what the free space buys.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.db import LEASE_SECONDS, bench_schema, connect, fill_tasks, vacuum
from benchmarks.harness.progress import Progress
from benchmarks.harness.report import table
from benchmarks.harness.stats import Summary
from dagster_leasequeue import sql as lq_sql

_SCHEMA_FILLFACTOR = 80  # migration 1's
_TASKS = 1_000
_ROUNDS = 5  # renewals of every lease
_FLUSH_WAIT_SECONDS = 10.0


@dataclass
class RenewResult:
    fillfactor: int
    leases: int
    renewals: int
    claim_updates: int
    claim_hot: int
    renew_updates: int
    renew_hot: int
    latency: Summary

    @property
    def hot_share(self) -> float:
        return self.renew_hot / self.renew_updates if self.renew_updates else 0.0


def _update_counts(conn: psycopg.Connection[Any], schema: str) -> tuple[int, int]:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
        " WHERE schemaname = %s AND relname = 'tasks'",
        (schema,),
    ).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def _counts_after(
    monitor: psycopg.Connection[Any], schema: str, before: tuple[int, int], expected: int
) -> tuple[int, int]:
    """The update counts once ``expected`` more updates are reported (a closed backend
    reports as it exits, a moment after the client closed it)."""
    deadline = time.monotonic() + _FLUSH_WAIT_SECONDS
    while True:
        after = _update_counts(monitor, schema)
        if after[0] - before[0] >= expected or time.monotonic() > deadline:
            return after[0] - before[0], after[1] - before[1]
        time.sleep(0.05)


def run(config: BenchConfig, log: Progress) -> list[RenewResult]:
    return [_renewals(config, log, fillfactor) for fillfactor in (_SCHEMA_FILLFACTOR, 100)]


def _renewals(config: BenchConfig, log: Progress, fillfactor: int) -> RenewResult:
    log(f"renew: {_TASKS} leases renewed {_ROUNDS} times each, fillfactor {fillfactor}")
    with bench_schema(config.dsn, "renew") as schema, connect(config.dsn, schema) as monitor:
        monitor.execute(
            sql.SQL("ALTER TABLE tasks SET (fillfactor = {})").format(sql.Literal(fillfactor))
        )
        fill_tasks(monitor, _TASKS)
        vacuum(monitor)
        start = _update_counts(monitor, schema)
        with connect(config.dsn, schema) as conn:
            params = {
                "queue": "default",
                "worker_id": "bench-renew",
                "lease_seconds": None,
                "default_lease": LEASE_SECONDS,
            }
            cursor = conn.execute(lq_sql.compose_claim(schema, _TASKS), params)
            names = [column.name for column in cursor.description or ()]
            held = [(row[0], row[names.index("lease_token")]) for row in cursor.fetchall()]
        claims = _counts_after(monitor, schema, start, len(held))
        before = _update_counts(monitor, schema)
        renew = lq_sql.compose(lq_sql.RENEW, schema)
        took: list[float] = []
        with connect(config.dsn, schema) as conn:
            for _ in range(_ROUNDS):
                for task_id, token in held:
                    sent = time.perf_counter()
                    conn.execute(
                        renew, {"task_id": task_id, "token": token, "lease_seconds": LEASE_SECONDS}
                    ).fetchone()
                    took.append(time.perf_counter() - sent)
        renewals = _counts_after(monitor, schema, before, len(took))
    return RenewResult(
        fillfactor=fillfactor,
        leases=len(held),
        renewals=len(took),
        claim_updates=claims[0],
        claim_hot=claims[1],
        renew_updates=renewals[0],
        renew_hot=renewals[1],
        latency=Summary.of_seconds(took),
    )


def render(results: list[RenewResult]) -> str:
    if not results:
        return ""
    first = results[0]
    return table(
        f"lease renewals ({first.leases} leases renewed {first.renewals // first.leases} times "
        "each, one process)",
        ["fillfactor", "claims", "claims HOT", "renewals", "renewals HOT", "p50 ms", "p99 ms"],
        [
            [
                result.fillfactor,
                result.claim_updates,
                result.claim_hot,
                result.renew_updates,
                f"{result.renew_hot} ({result.hot_share:.0%})",
                round(result.latency.p50_ms, 3),
                round(result.latency.p99_ms, 3),
            ]
            for result in results
        ],
    )
