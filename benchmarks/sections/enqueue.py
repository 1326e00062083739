"""Enqueue throughput: the package's enqueue_many and enqueue against plain INSERTs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.db import bench_schema, connect, open_queue, supports_setting
from benchmarks.harness.progress import Progress
from benchmarks.harness.report import table
from benchmarks.harness.stats import ratio
from dagster_leasequeue import LeaseQueue

Payload = dict[str, Any]
Producer = Callable[[LeaseQueue, psycopg.Connection[Any], Sequence[Payload], int], None]

RAW_INSERT_ONE = "INSERT INTO tasks (queue, payload, max_attempts) VALUES ('default', %s, 5)"
RAW_INSERT_MANY = """
    INSERT INTO tasks (queue, payload, max_attempts)
    SELECT 'default', p::jsonb, 5 FROM unnest(%s::text[]) AS p
"""


def _chunks(payloads: Sequence[Payload], size: int) -> Iterator[Sequence[Payload]]:
    for start in range(0, len(payloads), size):
        yield payloads[start : start + size]


def _package_many(queue: LeaseQueue, _: Any, payloads: Sequence[Payload], chunk: int) -> None:
    for part in _chunks(payloads, chunk):
        queue.enqueue_many(part)


def _package_one(queue: LeaseQueue, _: Any, payloads: Sequence[Payload], chunk: int) -> None:
    for payload in payloads:
        queue.enqueue(payload)


def _raw_many(
    _: Any, conn: psycopg.Connection[Any], payloads: Sequence[Payload], chunk: int
) -> None:
    for part in _chunks(payloads, chunk):
        conn.execute(RAW_INSERT_MANY, ([json.dumps(p) for p in part],))


def _raw_one(
    _: Any, conn: psycopg.Connection[Any], payloads: Sequence[Payload], chunk: int
) -> None:
    for payload in payloads:
        conn.execute(RAW_INSERT_ONE, (json.dumps(payload),))


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    baseline: str | None
    one_by_one: bool
    produce: Producer
    settings: dict[str, object] = field(default_factory=dict)  # package settings to override

    @property
    def available(self) -> bool:
        return all(supports_setting(name) for name in self.settings)


NOTIFY_OFF: dict[str, object] = {"notify": False}
METHODS = (
    Method("raw_insert_many", "INSERT ... unnest, chunks", None, False, _raw_many),
    Method("lq_enqueue_many", "enqueue_many, chunks", "raw_insert_many", False, _package_many),
    Method(
        "lq_enqueue_many_quiet",
        "enqueue_many, notify=False",
        "raw_insert_many",
        False,
        _package_many,
        NOTIFY_OFF,
    ),
    Method("raw_insert_one", "INSERT, one per commit", None, True, _raw_one),
    Method("lq_enqueue", "enqueue, one per commit", "raw_insert_one", True, _package_one),
    Method(
        "lq_enqueue_quiet",
        "enqueue, notify=False",
        "raw_insert_one",
        True,
        _package_one,
        NOTIFY_OFF,
    ),
)


@dataclass
class EnqueueResult:
    method: str
    label: str
    baseline: str | None
    tasks: int
    seconds: float
    per_second: float


def run(config: BenchConfig, log: Progress) -> list[EnqueueResult]:
    return [_measure(config, method, log) for method in METHODS if method.available]


def _measure(config: BenchConfig, method: Method, log: Progress) -> EnqueueResult:
    count = config.enqueue_single if method.one_by_one else config.tasks
    log(f"enqueue {method.name} ({count} tasks)")
    payloads = [{"n": n} for n in range(count)]
    with (
        bench_schema(config.dsn, "enqueue") as schema,
        open_queue(config.dsn, schema, overrides=method.settings) as queue,
        connect(config.dsn, schema) as conn,
    ):
        started = time.perf_counter()
        method.produce(queue, conn, payloads, config.enqueue_chunk)
        seconds = time.perf_counter() - started
    return EnqueueResult(
        method.name, method.label, method.baseline, count, seconds, count / seconds
    )


def render(results: list[EnqueueResult]) -> str:
    rates = {r.method: r.per_second for r in results}
    rows = [
        (
            r.method,
            r.label,
            r.tasks,
            r.seconds,
            r.per_second,
            ratio(r.per_second, rates.get(r.baseline or "")),
        )
        for r in results
    ]
    headers = ("method", "how", "tasks", "seconds", "tasks/s", "x baseline")
    return table("enqueue throughput (single process)", headers, rows)
