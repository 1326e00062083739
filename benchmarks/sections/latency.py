"""Claim and conclude latency, p50/p99, in one process on a filled queue."""

from __future__ import annotations

import time
from dataclasses import dataclass

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.db import bench_schema, connect, fill_tasks, vacuum
from benchmarks.harness.progress import Progress
from benchmarks.harness.report import table
from benchmarks.harness.stats import Summary
from benchmarks.harness.strategies import STRATEGIES, Drainer

LATENCY_STRATEGIES = (
    "raw_one",
    "sql_one",
    "lq_one",
    "lq_attempt",
    "lq_attempt_effect",
    "raw_one_unprepared",
    "lq_one_unprepared",
)


@dataclass
class LatencyResult:
    strategy: str
    label: str
    claim: Summary
    finish: Summary


def run(config: BenchConfig, log: Progress) -> list[LatencyResult]:
    names = [name for name in LATENCY_STRATEGIES if STRATEGIES[name].available]
    return [_measure(config, name, log) for name in names]


def _measure(config: BenchConfig, name: str, log: Progress) -> LatencyResult:
    log(f"latency {name} ({config.latency_tasks} tasks)")
    strategy = STRATEGIES[name]
    with bench_schema(config.dsn, "latency") as schema:
        with connect(config.dsn, schema) as conn:
            fill_tasks(conn, config.latency_tasks)
            vacuum(conn)
        drainer = strategy.open(config.dsn, schema, config.batch)
        try:
            claims, finishes = _time_drain(drainer)
        finally:
            drainer.close()
    return LatencyResult(
        name, strategy.label, Summary.of_seconds(claims), Summary.of_seconds(finishes)
    )


def _time_drain(drainer: Drainer) -> tuple[list[float], list[float]]:
    """Each claim's and each conclusion's duration, in seconds, until the queue is empty."""
    claims: list[float] = []
    finishes: list[float] = []
    while True:
        started = time.perf_counter()
        claimed = drainer.claim()
        claimed_at = time.perf_counter()
        if not claimed:
            return claims, finishes
        drainer.finish(claimed)
        claims.append(claimed_at - started)
        finishes.append(time.perf_counter() - claimed_at)


def render(results: list[LatencyResult]) -> str:
    rows = [
        (
            r.strategy,
            r.label,
            r.claim.count,
            r.claim.p50_ms,
            r.claim.p99_ms,
            r.finish.p50_ms,
            r.finish.p99_ms,
        )
        for r in results
    ]
    headers = (
        "strategy",
        "how",
        "calls",
        "claim p50 ms",
        "claim p99 ms",
        "ack p50 ms",
        "ack p99 ms",
    )
    return table(
        "claim / ack latency (single process; ack = lease.ack, the attempt block, or the UPDATE)",
        headers,
        rows,
    )
