"""Sweep time against table size: idle (nothing expired) and recovering 1,000 expired leases.

On the same tables, the time to count tasks per queue: every status (``stats_by_queue()``),
and the live ones that sensors read on every tick (``stats_by_queue(finished=False)``).

The finished rows are written straight in SQL (INSERT ... SELECT generate_series, status
'done'), then VACUUM ANALYZE. The expired leases are the newest rows, turned into leases
that ended a minute ago; after each recovering sweep the table is vacuumed and they are
expired again. Each state's sweep statement is also run under EXPLAIN (ANALYZE, BUFFERS)
in a rolled-back transaction, to show the server-side cost and the index it used.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.db import (
    bench_schema,
    connect,
    expire_leases,
    fill_tasks,
    open_queue,
    vacuum,
)
from benchmarks.harness.progress import Progress
from benchmarks.harness.report import table
from benchmarks.harness.stats import Summary
from dagster_leasequeue import LeaseQueue, sql as lq_sql


@dataclass
class Plan:
    """What the server did for one sweep batch."""

    execution_ms: float
    shared_hit: int
    shared_read: int
    indexes: list[str] = field(default_factory=list)


@dataclass
class SweepResult:
    size: int
    expired: int
    fill_seconds: float
    table_mb: float
    idle: Summary
    recovering: Summary
    recovered_per_sweep: int
    idle_plan: Plan | None
    recovering_plan: Plan | None
    counts_all: Summary | None = None
    counts_live: Summary | None = None  # None when the measured package cannot


def run(config: BenchConfig, log: Progress) -> list[SweepResult]:
    return [_measure(config, size, log) for size in config.sweep_sizes]


def _measure(config: BenchConfig, size: int, log: Progress) -> SweepResult:
    log(f"sweep: {size:,} done rows + {config.sweep_expired:,} leases to expire")
    with bench_schema(config.dsn, "sweep") as schema, connect(config.dsn, schema) as conn:
        started = time.perf_counter()
        fill_tasks(conn, size, status="done")
        first_expired = fill_tasks(conn, config.sweep_expired, status="done")
        vacuum(conn)
        fill_seconds = time.perf_counter() - started
        with open_queue(config.dsn, schema, pool_size=1) as queue:
            idle = Summary.of_seconds(
                [_timed_sweep(queue)[0] for _ in range(config.sweep_idle_calls)]
            )
            idle_plan = explain_sweep(conn, schema, queue.settings.sweep_batch_size)
            recovering, recovered = _recovering_sweeps(
                conn, queue, first_expired, config.sweep_expired_repeats
            )
            expire_leases(conn, first_expired)
            recovering_plan = explain_sweep(conn, schema, queue.settings.sweep_batch_size)
            counts_all = _timed_counts(queue, {}, config.counts_calls)
            live = {"finished": False}
            counts_live = (
                _timed_counts(queue, live, config.counts_calls) if _has_live(queue) else None
            )
        table_mb = _table_mb(conn)
    log(f"  idle p50 {idle.p50_ms:.3f} ms, recovering p50 {recovering.p50_ms:.1f} ms")
    return SweepResult(
        size=size,
        expired=config.sweep_expired,
        fill_seconds=fill_seconds,
        table_mb=table_mb,
        idle=idle,
        recovering=recovering,
        recovered_per_sweep=recovered,
        idle_plan=idle_plan,
        recovering_plan=recovering_plan,
        counts_all=counts_all,
        counts_live=counts_live,
    )


def _has_live(queue: LeaseQueue) -> bool:
    """Whether the measured package can count live tasks alone (it grows between revisions)."""
    return "finished" in inspect.signature(queue.stats_by_queue).parameters


def _timed_counts(queue: LeaseQueue, options: dict[str, Any], calls: int) -> Summary:
    durations = []
    for _ in range(calls):
        started = time.perf_counter()
        queue.stats_by_queue(**options)
        durations.append(time.perf_counter() - started)
    return Summary.of_seconds(durations)


def _timed_sweep(queue: LeaseQueue) -> tuple[float, int]:
    started = time.perf_counter()
    recovered = queue.sweep()
    return time.perf_counter() - started, len(recovered)


def _recovering_sweeps(
    conn: psycopg.Connection[Any], queue: LeaseQueue, first_expired: int, repeats: int
) -> tuple[Summary, int]:
    """Expire the leases, time the sweep that recovers them, vacuum; ``repeats`` times."""
    durations = []
    recovered = 0
    for _ in range(repeats):
        expire_leases(conn, first_expired)
        seconds, recovered = _timed_sweep(queue)
        durations.append(seconds)
        vacuum(conn, analyze=False)
    return Summary.of_seconds(durations), recovered


def explain_sweep(conn: psycopg.Connection[Any], schema: str, batch: int) -> Plan | None:
    """One sweep batch under EXPLAIN (ANALYZE, BUFFERS), rolled back; None if unavailable."""
    template = getattr(lq_sql, "SWEEP_BATCH", None)
    if template is None:
        return None
    params = {"limit": batch, "channel": lq_sql.notify_channel(schema)}
    return explain(conn, lq_sql.compose(template, schema), params)


def explain(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any]) -> Plan | None:
    """A statement run under EXPLAIN (ANALYZE, BUFFERS), rolled back; None if unavailable."""
    with conn.transaction(force_rollback=True):
        row = conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, params
        ).fetchone()
    if row is None:
        return None
    document = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    root = document[0]
    return Plan(
        execution_ms=float(root["Execution Time"]),
        shared_hit=int(root["Plan"].get("Shared Hit Blocks", 0)),
        shared_read=int(root["Plan"].get("Shared Read Blocks", 0)),
        indexes=sorted(set(_index_names(root["Plan"]))),
    )


def _index_names(node: dict[str, Any]) -> Iterator[str]:
    if "Index Name" in node:
        yield str(node["Index Name"])
    for child in node.get("Plans", []):
        yield from _index_names(child)


def _table_mb(conn: psycopg.Connection[Any]) -> float:
    row = conn.execute("SELECT pg_total_relation_size('tasks')").fetchone()
    return int(row[0]) / 2**20 if row else 0.0


def render(results: list[SweepResult]) -> str:
    rows = [
        (
            r.size,
            r.table_mb,
            r.idle.p50_ms,
            r.idle.p90_ms,
            r.idle_plan.execution_ms if r.idle_plan else None,
            r.recovering.p50_ms,
            r.recovered_per_sweep,
            r.recovering_plan.execution_ms if r.recovering_plan else None,
            ", ".join(r.recovering_plan.indexes) if r.recovering_plan else "",
            r.counts_all.p50_ms if r.counts_all else None,
            r.counts_live.p50_ms if r.counts_live else None,
        )
        for r in results
    ]
    headers = (
        "done rows",
        "table MB",
        "idle p50 ms",
        "idle p90 ms",
        "idle server ms",
        "1k expired p50 ms",
        "recovered",
        "batch server ms",
        "index used",
        "count all p50 ms",
        "count live p50 ms",
    )
    return table("queue.sweep() time against table size", headers, rows)
