"""The generic drain runner: worker processes (spawned) drain a filled queue with a strategy.

Each worker opens its own connections (its own :class:`LeaseQueue` for the package's paths),
waits at a barrier, then claims and concludes until the queue is empty. The drain's time
runs from the first worker's start to the last worker's end, both read from the system-wide
monotonic clock. A sweeper thread in the parent may call ``queue.sweep()`` meanwhile.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Barrier
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from benchmarks.harness.cpu import backend_cpu, spent
from benchmarks.harness.db import (
    bench_schema,
    checkpoint,
    connect,
    fill_lean_tasks,
    fill_tasks,
    open_queue,
    status_counts,
    vacuum,
)
from benchmarks.harness.rss import peak_rss_kib, rss_kib
from benchmarks.harness.strategies import STRATEGIES, Drainer

_SPAWN = multiprocessing.get_context("spawn")
_START_TIMEOUT = 120.0
_DRAIN_TIMEOUT = 900.0

Filler = Callable[[str, str, int], None]
"""Puts a drain's ``tasks`` tasks in its fresh schema: ``(dsn, schema, tasks)``."""
Reader = Callable[[psycopg.Connection[Any]], dict[str, int]]
"""Reads from a drained schema (search_path set), before it is dropped, what a section keeps."""


def fill_no_ops(dsn: str, schema: str, tasks: int) -> None:
    """The drains' usual tasks: no-op rows written in one statement, no package code."""
    with connect(dsn, schema) as conn:
        fill_tasks(conn, tasks)


def fill_lean(dsn: str, schema: str, tasks: int) -> None:
    """The lean baselines' tasks, in a table of the seed's own shape."""
    with connect(dsn, schema) as conn:
        fill_lean_tasks(conn, tasks)


@dataclass(frozen=True)
class DrainJob:
    """What every worker of one drain is told (picklable, for spawn)."""

    dsn: str
    schema: str
    strategy: str
    batch: int
    sample_every: int


@dataclass
class WorkerReport:
    """One worker's count, clock readings and memory samples ``(tasks done, RSS KiB)``."""

    tasks: int = 0
    calls: int = 0
    started: float = 0.0
    ended: float = 0.0
    rss_kib: list[tuple[int, int]] = field(default_factory=list)
    peak_rss_kib: int = 0
    client_cpu: float = 0.0
    server_cpu: float | None = None
    error: str | None = None


@dataclass
class DrainResult:
    """One drain: a strategy, a worker count, the tasks and how long they took."""

    strategy: str
    workers: int
    tasks: int
    seconds: float
    sweeper: bool
    verified: bool
    tasks_per_worker: list[int]
    rss_kib: list[list[tuple[int, int]]]
    client_cpu_us: float
    server_cpu_us: float | None
    sweep_ms: list[float] = field(default_factory=list)
    readings: dict[str, int] = field(default_factory=dict)  # what the drain's Reader read

    @property
    def throughput(self) -> float:
        return self.tasks / self.seconds if self.seconds > 0 else 0.0


def drain_worker(job: DrainJob, index: int, barrier: Barrier, reports: Any) -> None:
    """A worker process's body (module level, so spawn can import it).

    Its connections carry an application_name of their own, so that the CPU time of its
    server backends can be told apart.
    """
    report = WorkerReport()
    name = f"{job.schema}_w{index}"
    try:
        monitor = connect(job.dsn)
        drainer = STRATEGIES[job.strategy].open(
            make_conninfo(job.dsn, application_name=name), job.schema, job.batch
        )
    except Exception:
        barrier.abort()
        report.error = traceback.format_exc()
        reports.put(report)
        return
    try:
        barrier.wait()
        server_before, client_before = backend_cpu(monitor, name), time.process_time()
        _drain(drainer, job.sample_every, report)
        report.client_cpu = time.process_time() - client_before
        report.server_cpu = spent(server_before, backend_cpu(monitor, name))
    except Exception:
        report.error = traceback.format_exc()
    finally:
        drainer.close()
        monitor.close()
        report.peak_rss_kib = peak_rss_kib()
        reports.put(report)


def _drain(drainer: Drainer, sample_every: int, report: WorkerReport) -> None:
    report.started = time.monotonic()
    next_sample = 0
    while claimed := drainer.claim():
        drainer.finish(claimed)
        report.tasks += len(claimed)
        report.calls += 1
        if report.tasks >= next_sample:  # the first sample is taken warm, after one task
            report.rss_kib.append((report.tasks, rss_kib()))
            next_sample = report.tasks + sample_every
    report.ended = time.monotonic()
    report.rss_kib.append((report.tasks, rss_kib()))


class PeriodicSweeper(threading.Thread):
    """Calls ``queue.sweep()`` every ``interval`` seconds until stopped; keeps the durations."""

    def __init__(self, dsn: str, schema: str, interval: float) -> None:
        super().__init__(name="bench-sweeper", daemon=True)
        self._queue = open_queue(dsn, schema, pool_size=1)
        self._interval = interval
        self._stop_event = threading.Event()
        self.durations_ms: list[float] = []

    def run(self) -> None:
        while not self._stop_event.wait(self._interval):
            started = time.perf_counter()
            self._queue.sweep()
            self.durations_ms.append((time.perf_counter() - started) * 1000)

    def stop(self) -> None:
        """Stop sweeping (if it ever started) and close the sweeper's queue."""
        self._stop_event.set()
        if self.ident is not None:
            self.join()
        self._queue.close()


def run_drain(
    dsn: str,
    strategy: str,
    *,
    workers: int,
    tasks: int,
    batch: int,
    sample_every: int,
    sweep_interval: float | None = None,
    fill: Filler = fill_no_ops,
    read: Reader | None = None,
) -> DrainResult:
    """Fill a fresh schema with ``tasks`` tasks (no-op rows unless ``fill`` says otherwise),
    then drain it with ``workers``."""
    if STRATEGIES[strategy].lean and fill is fill_no_ops:
        fill = fill_lean
    with bench_schema(dsn, f"drain_{strategy}") as schema:
        fill(dsn, schema, tasks)
        with connect(dsn, schema) as conn:
            vacuum(conn)
            checkpoint(conn)
        job = DrainJob(dsn, schema, strategy, batch, sample_every)
        sweeper = PeriodicSweeper(dsn, schema, sweep_interval) if sweep_interval else None
        reports = _run_workers(job, workers, sweeper)
        with connect(dsn, schema) as conn:
            verified = status_counts(conn) == {"done": tasks}
            readings = read(conn) if read is not None else {}
    tasks_done = max(1, sum(r.tasks for r in reports))
    server_cpu = [r.server_cpu for r in reports]
    return DrainResult(
        strategy=strategy,
        workers=workers,
        tasks=sum(r.tasks for r in reports),
        seconds=max(r.ended for r in reports) - min(r.started for r in reports),
        sweeper=sweeper is not None,
        verified=verified,
        tasks_per_worker=[r.tasks for r in reports],
        rss_kib=[r.rss_kib for r in reports],
        client_cpu_us=sum(r.client_cpu for r in reports) / tasks_done * 1e6,
        server_cpu_us=None
        if None in server_cpu
        else sum(c for c in server_cpu if c is not None) / tasks_done * 1e6,
        sweep_ms=sweeper.durations_ms if sweeper else [],
        readings=readings,
    )


def _run_workers(
    job: DrainJob, workers: int, sweeper: PeriodicSweeper | None
) -> list[WorkerReport]:
    barrier = _SPAWN.Barrier(workers + 1, timeout=_START_TIMEOUT)
    reports: Any = _SPAWN.Queue()
    processes = [
        _SPAWN.Process(target=drain_worker, args=(job, index, barrier, reports), daemon=True)
        for index in range(workers)
    ]
    for process in processes:
        process.start()
    try:
        barrier.wait()
        if sweeper is not None:
            sweeper.start()
        collected = _collect(reports, processes, workers)
    except threading.BrokenBarrierError:
        collected = _collect(reports, processes, workers)
    finally:
        if sweeper is not None:
            sweeper.stop()
        for process in processes:
            process.join(timeout=30)
    errors = [r.error for r in collected if r.error]
    if errors:
        raise RuntimeError(f"drain worker failed ({job.strategy}):\n{errors[0]}")
    return collected


def _collect(reports: Any, processes: Sequence[SpawnProcess], count: int) -> list[WorkerReport]:
    """Every worker's report; fails if a worker died without sending one."""
    collected: list[WorkerReport] = []
    deadline = time.monotonic() + _DRAIN_TIMEOUT
    all_exited_before = False
    while len(collected) < count:
        try:
            collected.append(reports.get(timeout=1.0))
            continue
        except queue_module.Empty:
            pass
        # A worker that exited has flushed its report: give the pipe one more second.
        if all_exited_before or time.monotonic() > deadline:
            raise RuntimeError(f"{count - len(collected)} drain worker(s) sent no report")
        all_exited_before = not any(p.is_alive() for p in processes)
    return collected
