"""Enqueue-to-claim latency with a waiting worker.

The worker, a spawned process, either polls ``claim()`` every X ms or, when the measured
package has it, waits in ``claim(wait=...)``, which LISTENs for the NOTIFY an enqueue sends.
A task's latency runs from the moment ``enqueue()`` returned (committed) to the moment the
worker's claim returned it, both read from the system-wide monotonic clock. The producer
(this process) waits a random one to two poll intervals between tasks, so tasks arrive at
random points of the worker's polling cycle.
"""

from __future__ import annotations

import inspect
import multiprocessing
import random
import time
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from typing import Any

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.db import bench_schema, open_queue
from benchmarks.harness.progress import Progress
from benchmarks.harness.report import table
from benchmarks.harness.stats import Summary
from dagster_leasequeue import LeaseQueue

_SPAWN = multiprocessing.get_context("spawn")
_TIMEOUT = 30.0
POLL = "poll"
NOTIFY = "notify"
# claim(wait=...) returns after this long with nothing, so the worker sees the stop request.
NOTIFY_WAIT = 1.0
NOTIFY_SPACING = 0.05
NOT_IMPLEMENTED = "LISTEN/NOTIFY: not implemented in the measured package (polling only)"


def notify_supported() -> bool:
    """Whether the measured package's claim() can wait for an enqueue's notification."""
    return "wait" in inspect.signature(LeaseQueue.claim).parameters


@dataclass
class PollingResult:
    mode: str
    interval_ms: float
    latency: Summary
    empty_claim: Summary
    empty_claims_per_second: float


def waiting_worker(
    dsn: str, schema: str, mode: str, interval: float, ready: Event, stop: Event, out: Any
) -> None:
    """Claim until stopped, reporting each claim's time; then report the empty claims."""
    empty: list[float] = []
    with open_queue(dsn, schema) as queue:
        queue.claim()  # connect and warm up before the first task
        ready.set()
        started = time.monotonic()
        while not stop.is_set():
            before = time.perf_counter()
            lease = queue.claim(wait=interval) if mode == NOTIFY else queue.claim()
            if lease is not None:
                out.put((lease.task_id, time.monotonic()))
                lease.ack()
                continue
            empty.append(time.perf_counter() - before)
            if mode == POLL:
                stop.wait(interval)
        out.put(("idle", empty, time.monotonic() - started))


def run(config: BenchConfig, log: Progress) -> list[PollingResult]:
    modes = [(POLL, ms / 1000) for ms in config.poll_intervals_ms]
    if notify_supported():
        modes.append((NOTIFY, NOTIFY_WAIT))
    return [_measure(config, mode, interval, log) for mode, interval in modes]


def _measure(config: BenchConfig, mode: str, interval: float, log: Progress) -> PollingResult:
    log(f"waiting worker: {mode} {interval * 1000:g} ms ({config.poll_samples} tasks)")
    spacing = interval if mode == POLL else NOTIFY_SPACING
    with bench_schema(config.dsn, "polling") as schema, open_queue(config.dsn, schema) as queue:
        ready, stop, out = _SPAWN.Event(), _SPAWN.Event(), _SPAWN.Queue()
        worker = _SPAWN.Process(
            target=waiting_worker,
            args=(config.dsn, schema, mode, interval, ready, stop, out),
            daemon=True,
        )
        worker.start()
        try:
            if not ready.wait(_TIMEOUT):
                raise RuntimeError("the waiting worker did not start")
            latencies = [_one_task(queue, out, spacing) for _ in range(config.poll_samples)]
        finally:
            stop.set()
        _, empty, elapsed = out.get(timeout=_TIMEOUT)
        worker.join(timeout=_TIMEOUT)
    return PollingResult(
        mode=mode,
        interval_ms=interval * 1000,
        latency=Summary.of_seconds(latencies),
        # A notify worker's empty claim is its whole wait: only a poll's is a cost.
        empty_claim=Summary.of_seconds(empty if mode == POLL else []),
        empty_claims_per_second=len(empty) / elapsed if elapsed > 0 else 0.0,
    )


def _one_task(queue: LeaseQueue, out: Any, spacing: float) -> float:
    time.sleep(random.uniform(spacing, 2 * spacing))
    task_id = queue.enqueue({"probe": True})
    enqueued = time.monotonic()
    claimed_id, claimed = out.get(timeout=_TIMEOUT)
    if claimed_id != task_id:
        raise RuntimeError(f"the waiting worker claimed task {claimed_id}, expected {task_id}")
    return float(claimed - enqueued)


def render(results: list[PollingResult]) -> str:
    rows = [
        (
            "claim() every X ms" if r.mode == POLL else "claim(wait=...), NOTIFY",
            r.interval_ms,
            r.latency.count,
            r.latency.p50_ms,
            r.latency.p99_ms,
            r.latency.mean_ms,
            r.empty_claim.p50_ms,
            r.empty_claims_per_second,
        )
        for r in results
    ]
    headers = (
        "worker",
        "X / wait ms",
        "tasks",
        "p50 ms",
        "p99 ms",
        "mean ms",
        "empty claim ms",
        "empty claims/s",
    )
    note = "" if any(r.mode == NOTIFY for r in results) else NOT_IMPLEMENTED + "\n"
    return table("enqueue-to-claim latency, one waiting worker", headers, rows) + note
