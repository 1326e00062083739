"""Flow control: what a queue without limits pays for their existence, and what a
concurrency limit costs the batched drain.

- **claim, no limits**: the claim statement against the one from before flow control
  (written out below), on one connection, alternating call by call over the same queue:
  each claims one task and acks it; only the claims are timed. The new statement reads one
  row of ``queue_flow`` by its key, and adds a branch the planner skips.
- **limited drain, many keys**: the drain section's ``lq_batch`` workers (``claim_many(100)``
  + ``ack_many``) on tasks spread over many concurrency keys, with a limit per key against
  the same tasks without one. The limit makes every claim go through ``claim_flow()``.
- **limited drain, few keys**: the same with three keys at 2 each: correctness (every task
  done once), and its rate beside the others'.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.db import bench_schema, connect, open_queue, vacuum
from benchmarks.harness.progress import Progress
from benchmarks.harness.report import table
from benchmarks.harness.runner import DrainResult, Filler
from benchmarks.harness.stats import Summary, ratio
from benchmarks.sections.drain import repeat_drain
from dagster_leasequeue import sql as lq_sql

STRATEGY = "lq_batch"
CLAIM_CALLS = 3000

# The claim of one task as it was before flow control (migration 9).
PREVIOUS_CLAIM_ONE = """
    UPDATE {schema}.tasks AS t
    SET status = 'processing',
        attempts = t.attempts + 1,
        lease_token = nextval({lease_tokens}::regclass),
        lease_expires_at = clock_timestamp()
            + make_interval(
                secs => coalesce(%(lease_seconds)s, t.lease_seconds, %(default_lease)s)),
        worker_id = %(worker_id)s,
        updated_at = clock_timestamp()
    WHERE t.id = (
        SELECT id FROM {schema}.tasks
        WHERE status = 'enqueued' AND queue = %(queue)s AND run_at <= clock_timestamp()
        ORDER BY priority DESC, run_at, id
        LIMIT 1
        FOR UPDATE SKIP LOCKED
    )
    RETURNING t.id, t.payload, t.priority, t.attempts, t.max_attempts, t.lease_token,
              t.lease_expires_at, t.idempotency_key,
              coalesce(%(lease_seconds)s, t.lease_seconds, %(default_lease)s)
"""


@dataclass
class ClaimCost:
    previous: Summary
    current: Summary

    @property
    def ratio(self) -> float | None:
        """Claims per second with the current statement over the previous one (p50s)."""
        return ratio(self.previous.p50_ms, self.current.p50_ms)


def _claim_cost(config: BenchConfig, log: Progress) -> ClaimCost:
    calls = CLAIM_CALLS if not config.quick else 300
    log(f"flow: the claim without limits against the previous one ({calls:,} calls each)")
    with (
        bench_schema(config.dsn, "flow") as schema,
        open_queue(config.dsn, schema, pool_size=1) as queue,
        connect(config.dsn, schema) as conn,
    ):
        queue.enqueue_many([{"n": n} for n in range(2 * calls)])
        vacuum(conn)
        statements = {
            "previous": lq_sql.compose(PREVIOUS_CLAIM_ONE, schema),
            "current": lq_sql.compose_claim(schema, 1),
        }
        ack = lq_sql.compose(lq_sql.ACK, schema)
        params = {
            "queue": "default",
            "worker_id": "bench",
            "lease_seconds": None,
            "default_lease": 30.0,
        }
        times: dict[str, list[float]] = {name: [] for name in statements}
        for call in range(2 * calls):
            name = ("previous", "current")[call % 2]
            started = time.perf_counter()
            row = conn.execute(statements[name], params, prepare=True).fetchone()
            times[name].append(time.perf_counter() - started)
            assert row is not None
            conn.execute(ack, {"task_id": row[0], "token": row[5], "result": None})
    cost = ClaimCost(Summary.of_seconds(times["previous"]), Summary.of_seconds(times["current"]))
    log(f"  p50 {cost.previous.p50_ms:.3f} ms before, {cost.current.p50_ms:.3f} ms now")
    return cost


def _keyed(keys: int, limit: int | None) -> Filler:
    """Tasks spread over ``keys`` concurrency keys, with ``limit`` per key (or none)."""

    def fill(dsn: str, schema: str, tasks: int) -> None:
        with open_queue(dsn, schema, pool_size=1) as queue:
            for start in range(0, tasks, 5000):
                queue.enqueue_many(
                    ({"n": n} for n in range(start, min(tasks, start + 5000))),
                    concurrency_key=lambda payload: f"customer-{payload['n'] % keys}",
                )
            if limit is not None:
                queue.set_concurrency_limit("default", limit)

    return fill


@dataclass(frozen=True)
class Case:
    name: str
    label: str
    fill: Callable[[], Filler]


CASES = (
    Case("many_unlimited", "1,000 keys, no limit", lambda: _keyed(1000, None)),
    Case("many_limited", "1,000 keys, 5 running each", lambda: _keyed(1000, 5)),
    Case("few_limited", "3 keys, 2 running each", lambda: _keyed(3, 2)),
)


@dataclass
class FlowDrain:
    case: str
    result: DrainResult


@dataclass
class FlowResult:
    claim: ClaimCost | None
    drains: list[FlowDrain]

    def rate(self, case: str) -> float | None:
        rates = [d.result.throughput for d in self.drains if d.case == case]
        return statistics.fmean(rates) if rates else None

    @property
    def limited_ratio(self) -> float | None:
        """The limited drain's rate over the unlimited one's, many keys."""
        return ratio(self.rate("many_limited"), self.rate("many_unlimited"))


def _drains(config: BenchConfig, log: Progress) -> list[FlowDrain]:
    workers = max(config.workers)
    drains: list[FlowDrain] = []
    for pair in range(config.flow_drain_pairs):
        cases = CASES if pair % 2 == 0 else CASES[::-1]
        for case in cases:
            try:
                runs = repeat_drain(
                    config, log, STRATEGY, workers, fill=case.fill(), label=case.name
                )
            except Exception as error:
                log.failed(f"flow: drain {case.name}", error)
                continue
            drains.extend(FlowDrain(case.name, run) for run in runs)
    return drains


def run(config: BenchConfig, log: Progress) -> FlowResult:
    claim = None
    try:
        claim = _claim_cost(config, log)
    except Exception as error:
        log.failed("flow: claim", error)
    return FlowResult(claim, _drains(config, log))


def render(result: FlowResult) -> str:
    parts = []
    if result.claim is not None:
        c = result.claim
        rows = [
            (
                "previous (no queue_flow read)",
                c.previous.count,
                c.previous.p50_ms,
                c.previous.p90_ms,
            ),
            ("current", c.current.count, c.current.p50_ms, c.current.p90_ms),
            ("previous p50 / current p50", None, c.ratio, None),
        ]
        parts.append(
            table(
                "the claim of one task on a queue without limits",
                ("statement", "calls", "p50 ms", "p90 ms"),
                rows,
            )
        )
    if result.drains:
        rows2 = []
        for case in CASES:
            runs = [d.result for d in result.drains if d.case == case.name]
            if not runs:
                continue
            rows2.append(
                (
                    case.name,
                    case.label,
                    runs[0].workers,
                    len(runs),
                    result.rate(case.name),
                    "yes" if all(r.verified for r in runs) else "NO",
                )
            )
        parts.append(
            table(
                f"{STRATEGY} drain of keyed tasks, with and without a concurrency limit",
                ("case", "tasks", "workers", "runs", "tasks/s", "all done once"),
                rows2,
            )
        )
    return "\n".join(parts)
