"""Task batches: ``enqueue_batch`` against a raw COPY, a batch's drain against plain tasks',
and ``batch()`` on a batch of a million tasks.

- **enqueue**: ``enqueue_batch`` of a generator of small payloads, against the same rows
  (queue, priority, payload, max_attempts, batch_id) sent in one transaction by psycopg's
  ``copy.write_row``. Each run in a fresh schema; pairs, every other one reversed (ABBA).
- **drain**: the drain section's workers on tasks of one batch (``enqueue_batch``) against
  as many plain tasks (``enqueue_many`` in chunks), both then ``VACUUM ANALYZE``d. What
  differs: every ack of a batch task runs the ``tasks_batch_counts`` trigger (``ack_many``
  counts its batch tasks once per statement instead), and its claim and ack each add an
  entry to ``tasks_batch_idx``. ``lq_one`` (claim + ack) is the
  target's pair; ``lq_batch`` shows the trigger where the rest of an ack costs least. The
  counters are read back before the schema is dropped.
- **batch()**: a batch of a million tasks, some acked and a few held processing; many
  calls, each after a ``SELECT 1`` on a connection of its own, so the two see the same
  machine. Measured as the acks left the table (never analyzed, as with autovacuum off)
  and again after ``VACUUM ANALYZE``, each with its plan (``EXPLAIN ANALYZE``, rolled back).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.db import bench_schema, connect, open_queue, vacuum
from benchmarks.harness.progress import Progress
from benchmarks.harness.report import table
from benchmarks.harness.runner import DrainResult, Filler
from benchmarks.harness.stats import Summary, ratio
from benchmarks.sections.drain import repeat_drain
from benchmarks.sections.sweep import Plan, explain
from dagster_leasequeue import LeaseQueue, sql as lq_sql

Payloads = Iterator[dict[str, Any]]
Producer = Callable[[LeaseQueue, psycopg.Connection[Any], Payloads], None]

# The columns enqueue_batch sends; a batch row is made first so that batch_id is real.
RAW_COPY = "COPY tasks (queue, priority, payload, max_attempts, batch_id) FROM STDIN"
MAKE_BATCH = "INSERT INTO batches (queue) VALUES ('default') RETURNING id"
DRAIN_STRATEGIES = ("lq_one", "lq_batch")
TARGET_STRATEGY = "lq_one"
KINDS = ("plain", "batch")
COUNTERS = """
    SELECT coalesce(sum(done), 0), count(*) FILTER (WHERE done > 0) FROM batch_counts
"""


def payloads(count: int) -> Payloads:
    """The enqueue section's small payloads, generated as a caller would stream them."""
    return ({"n": n} for n in range(count))


# -- enqueue: enqueue_batch against a raw COPY of the same rows ----------------------------


def _raw_copy(_: LeaseQueue, conn: psycopg.Connection[Any], rows: Payloads) -> None:
    row = conn.execute(MAKE_BATCH).fetchone()
    batch_id = int(row[0]) if row else 0
    with conn.transaction(), conn.cursor().copy(RAW_COPY) as copy:
        for payload in rows:
            copy.write_row(("default", 0, json.dumps(payload), 5, batch_id))


def _package_batch(queue: LeaseQueue, _: psycopg.Connection[Any], rows: Payloads) -> None:
    queue.enqueue_batch(rows)


def _package_many(queue: LeaseQueue, _: psycopg.Connection[Any], rows: Payloads) -> None:
    queue.enqueue_many(rows)


@dataclass(frozen=True)
class EnqueueMethod:
    name: str
    label: str
    produce: Producer


ENQUEUE_METHODS = (
    EnqueueMethod("raw_copy", "COPY, psycopg write_row", _raw_copy),
    EnqueueMethod("lq_enqueue_batch", "enqueue_batch(generator)", _package_batch),
    EnqueueMethod("lq_enqueue_many", "enqueue_many(generator)", _package_many),
)


@dataclass
class EnqueueRun:
    method: str
    label: str
    tasks: int
    seconds: float
    stored: bool  # every row arrived

    @property
    def per_second(self) -> float:
        return self.tasks / self.seconds if self.seconds > 0 else 0.0


def _enqueue(config: BenchConfig, method: EnqueueMethod, log: Progress) -> EnqueueRun:
    count = config.batch_enqueue_tasks
    log(f"batches: {method.name} ({count:,} tasks)")
    with (
        bench_schema(config.dsn, "batches") as schema,
        open_queue(config.dsn, schema, pool_size=1) as queue,
        connect(config.dsn, schema) as conn,
    ):
        started = time.perf_counter()
        method.produce(queue, conn, payloads(count))
        seconds = time.perf_counter() - started
        row = conn.execute("SELECT count(*) FROM tasks").fetchone()
    log(f"  {count / seconds:,.0f} tasks/s in {seconds:.2f} s")
    return EnqueueRun(method.name, method.label, count, seconds, bool(row and row[0] == count))


def _enqueue_runs(config: BenchConfig, log: Progress) -> list[EnqueueRun]:
    """Pairs, every other one reversed, so that a steady drift favours neither."""
    runs: list[EnqueueRun] = []
    for pair in range(config.batch_enqueue_pairs):
        order = ENQUEUE_METHODS if pair % 2 == 0 else ENQUEUE_METHODS[::-1]
        runs.extend(_enqueue(config, method, log) for method in order)
    return runs


# -- drain: a batch's tasks against plain tasks --------------------------------------------


def fill_batch(dsn: str, schema: str, tasks: int) -> None:
    """``tasks`` tasks of one batch, enqueued as a caller would (``enqueue_batch``)."""
    with open_queue(dsn, schema, pool_size=1) as queue:
        queue.enqueue_batch(payloads(tasks))


def _fillers(config: BenchConfig) -> dict[str, Filler]:
    """How each kind of drain gets its tasks: through the package, as a caller would."""

    def plain(dsn: str, schema: str, tasks: int) -> None:
        chunk = config.enqueue_chunk
        with open_queue(dsn, schema, pool_size=1) as queue:
            for start in range(0, tasks, chunk):
                queue.enqueue_many([{"n": n} for n in range(start, min(tasks, start + chunk))])

    return {"plain": plain, "batch": fill_batch}


def read_counters(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """What the stripes counted, and how many stripes the workers' acks landed on.

    Each transaction counts in a stripe no other open one holds: with four workers, four
    stripes or more (a worker's next transaction may take another).
    """
    row = conn.execute(COUNTERS).fetchone()
    counted, stripes = (int(row[0]), int(row[1])) if row else (0, 0)
    return {"counted_done": counted, "stripes_used": stripes}


@dataclass
class BatchDrain:
    kind: str  # "plain" or "batch"
    result: DrainResult

    @property
    def counted(self) -> bool:
        """The batch's counters agree with its tasks (always, for plain tasks)."""
        return self.kind == "plain" or self.result.readings.get("counted_done") == self.result.tasks


def _drains(config: BenchConfig, log: Progress) -> list[BatchDrain]:
    """Pairs of drains per strategy and worker count: plain then batch, then reversed.

    The order also flips from one cell to the next, so with a single pair the batch drain
    does not always come second. A drain that fails is reported and left out.
    """
    fillers = _fillers(config)
    drains: list[BatchDrain] = []
    cells = [(w, s) for w in config.workers for s in DRAIN_STRATEGIES]
    for pair in range(config.batch_drain_pairs):
        for index, (workers, strategy) in enumerate(cells):
            for kind in KINDS if (pair + index) % 2 == 0 else KINDS[::-1]:
                try:
                    runs = repeat_drain(
                        config,
                        log,
                        strategy,
                        workers,
                        fill=fillers[kind],
                        read=read_counters if kind == "batch" else None,
                        label=kind,
                    )
                except Exception as error:
                    log.failed(f"batches: drain {strategy} x{workers} {kind}", error)
                    continue
                drains.extend(BatchDrain(kind, run) for run in runs)
    return drains


# -- batch(): the state of a batch of a million tasks ------------------------------------


@dataclass
class InfoState:
    """batch() in one state of the table, beside a SELECT 1 of the same moments."""

    state: str
    calls: Summary
    round_trip: Summary
    plan: Plan | None
    correct: bool  # batch() reported what was done to the batch


@dataclass
class InfoResult:
    tasks: int
    acked: int
    processing: int
    enqueue_seconds: float
    states: list[InfoState]

    @property
    def slowest(self) -> InfoState | None:
        """The state in which batch() took longest (p50): the one its target is read in."""
        return max(self.states, key=lambda s: s.calls.p50_ms, default=None)


def _info(config: BenchConfig, log: Progress) -> InfoResult:
    size, acked = config.batch_info_tasks, config.batch_info_acked
    held = config.batch_info_processing
    log(f"batches: batch() on {size:,} tasks ({acked:,} acked, {held} processing)")
    with (
        bench_schema(config.dsn, "batches") as schema,
        open_queue(config.dsn, schema) as queue,
        connect(config.dsn, schema) as conn,
        connect(config.dsn) as probe,
    ):
        started = time.perf_counter()
        batch = queue.enqueue_batch(payloads(size))
        enqueue_seconds = time.perf_counter() - started
        log(f"  enqueued in {enqueue_seconds:.1f} s")
        # One at a time: claim() takes the claim index on a table never analyzed, where
        # claim_many's plan would sort every row of it.
        for _ in range(acked):
            lease = queue.claim()
            if lease is not None:
                lease.ack()
        for _ in range(held):
            queue.claim()  # held: never concluded
        expected = {"enqueued": size - acked - held, "processing": held, "done": acked}

        def measure(state: str) -> InfoState:
            return _time_info(config, queue, probe, conn, schema, batch.id, expected, state)

        states = [measure("as the acks left it")]
        vacuum(conn)
        states.append(measure("after VACUUM ANALYZE"))
    for state in states:
        log(f"  {state.state}: p50 {state.calls.p50_ms:.3f} ms")
    return InfoResult(size, acked, held, enqueue_seconds, states)


def _time_info(
    config: BenchConfig,
    queue: LeaseQueue,
    probe: psycopg.Connection[Any],
    conn: psycopg.Connection[Any],
    schema: str,
    batch_id: int,
    expected: dict[str, int],
    state: str,
) -> InfoState:
    calls: list[float] = []
    round_trips: list[float] = []
    correct = True
    for _ in range(config.batch_info_calls):
        started = time.perf_counter()
        probe.execute("SELECT 1")
        round_trips.append(time.perf_counter() - started)
        started = time.perf_counter()
        info = queue.batch(batch_id)
        calls.append(time.perf_counter() - started)
        correct = correct and all(info.counts[name] == n for name, n in expected.items())
    plan = explain(conn, lq_sql.compose(lq_sql.BATCH_INFO, schema), {"batch_id": batch_id})
    return InfoState(
        state, Summary.of_seconds(calls), Summary.of_seconds(round_trips), plan, correct
    )


# -- the section ---------------------------------------------------------------------------


@dataclass
class BatchesResult:
    enqueue: list[EnqueueRun]
    drains: list[BatchDrain]
    info: InfoResult | None

    def enqueue_rate(self, method: str) -> float | None:
        rates = [run.per_second for run in self.enqueue if run.method == method]
        return statistics.fmean(rates) if rates else None

    def enqueue_ratio(self, method: str = "lq_enqueue_batch") -> float | None:
        """``method``'s rows/s over the raw COPY's, each the mean of its runs."""
        return ratio(self.enqueue_rate(method), self.enqueue_rate("raw_copy"))

    def cell(self, kind: str, strategy: str, workers: int) -> list[BatchDrain]:
        return [
            d
            for d in self.drains
            if (d.kind, d.result.strategy, d.result.workers) == (kind, strategy, workers)
        ]

    def runs(self, kind: str, strategy: str, workers: int) -> list[DrainResult]:
        return [d.result for d in self.cell(kind, strategy, workers)]

    def drain_rate(self, kind: str, strategy: str, workers: int) -> float | None:
        rates = [run.throughput for run in self.runs(kind, strategy, workers)]
        return statistics.fmean(rates) if rates else None

    def drain_ratio(self, strategy: str, workers: int) -> float | None:
        """The batch's drain throughput over the plain tasks', each the mean of its runs."""
        return ratio(
            self.drain_rate("batch", strategy, workers), self.drain_rate("plain", strategy, workers)
        )


def run(config: BenchConfig, log: Progress) -> BatchesResult:
    """The three parts; one that fails is reported and the others still count."""
    enqueue: list[EnqueueRun] = []
    info = None
    try:
        enqueue = _enqueue_runs(config, log)
    except Exception as error:
        log.failed("batches: enqueue", error)
    drains = _drains(config, log)
    try:
        info = _info(config, log)
    except Exception as error:
        log.failed("batches: batch()", error)
    return BatchesResult(enqueue, drains, info)


def render(result: BatchesResult) -> str:
    return "\n".join(
        part
        for part in (_render_enqueue(result), _render_drains(result), _render_info(result.info))
        if part
    )


def _render_enqueue(result: BatchesResult) -> str:
    if not result.enqueue:
        return ""
    rows: list[tuple[object, ...]] = [
        (
            run.method,
            run.label,
            run.tasks,
            run.seconds,
            run.per_second,
            "yes" if run.stored else "NO",
        )
        for run in result.enqueue
    ]
    for method in ("lq_enqueue_batch", "lq_enqueue_many"):
        rows.append(
            (f"{method} / raw", "means of the runs", None, None, result.enqueue_ratio(method), None)
        )
    headers = ("method", "how", "tasks", "seconds", "tasks/s", "all stored")
    return table(
        "enqueue_batch and enqueue_many against a raw COPY (one transaction each)", headers, rows
    )


def _render_drains(result: BatchesResult) -> str:
    if not result.drains:
        return ""
    cells = sorted(
        {(d.result.workers, d.result.strategy, d.kind) for d in result.drains},
        key=lambda c: (c[0], DRAIN_STRATEGIES.index(c[1]), KINDS.index(c[2])),
    )
    rows = []
    for workers, strategy, kind in cells:
        drains = result.cell(kind, strategy, workers)
        runs = [d.result for d in drains]
        rows.append(
            (
                strategy,
                kind,
                workers,
                len(runs),
                result.drain_rate(kind, strategy, workers),
                result.drain_ratio(strategy, workers) if kind == "batch" else None,
                statistics.median(r.client_cpu_us for r in runs),
                _median_or_none([r.server_cpu_us for r in runs]),
                _cpu_ratio(result, strategy, workers) if kind == "batch" else None,
                ", ".join(str(r.readings["stripes_used"]) for r in runs) if kind == "batch" else "",
                "yes" if all(r.verified for r in runs) and all(d.counted for d in drains) else "NO",
            )
        )
    headers = (
        "strategy",
        "tasks",
        "workers",
        "runs",
        "tasks/s",
        "x plain",
        "client CPU us/task",
        "server CPU us/task",
        "x plain CPU",
        "stripes used",
        "all done, counted",
    )
    return table("drain of one batch's tasks against plain tasks", headers, rows)


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known and len(known) == len(values) else None


def _cpu_ratio(result: BatchesResult, strategy: str, workers: int) -> float | None:
    """CPU per task, client and server, of the batch's drain over the plain one's: the cost
    the trigger adds, less moved by the machine's load than the throughput."""

    def per_task(kind: str) -> float | None:
        runs = result.runs(kind, strategy, workers)
        server = _median_or_none([r.server_cpu_us for r in runs])
        if not runs or server is None:
            return None
        return statistics.median(r.client_cpu_us for r in runs) + server

    return ratio(per_task("batch"), per_task("plain"))


def _render_info(info: InfoResult | None) -> str:
    if info is None:
        return ""
    rows = [
        (
            s.state,
            s.calls.count,
            s.calls.p50_ms,
            s.calls.p90_ms,
            s.calls.p99_ms,
            s.round_trip.p50_ms,
            s.plan.execution_ms if s.plan else None,
            s.plan.shared_hit if s.plan else None,
            ", ".join(s.plan.indexes) if s.plan else "",
            "yes" if s.correct else "NO",
        )
        for s in info.states
    ]
    headers = (
        "table",
        "calls",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "SELECT 1 p50 ms",
        "server ms",
        "buffers",
        "indexes used",
        "counts right",
    )
    title = (
        f"queue.batch() on a batch of {info.tasks:,} tasks ({info.acked:,} acked, "
        f"{info.processing} processing; enqueue_batch took {info.enqueue_seconds:.1f} s, "
        f"{info.tasks / info.enqueue_seconds:,.0f} tasks/s)"
    )
    return table(title, headers, rows)
