"""Large enqueue_many calls through COPY: ids in order, all or none, side by side."""

from __future__ import annotations

import threading

import pytest

from dagster_leasequeue import LeaseQueue, PayloadError, sql
from dagster_leasequeue.queue import COPY_FROM_TASKS

from ..helpers import run_sql

MANY = COPY_FROM_TASKS * 3 + 7


def test_a_large_enqueue_many_returns_each_tasks_id_in_the_payloads_order(
    queue: LeaseQueue,
) -> None:
    payloads = ({"n": n, "text": "tab\there, backslash \\ and é"} for n in range(MANY))
    ids = queue.enqueue_many(payloads, queue="bulk", priority=3, concurrency_key="k")
    assert len(ids) == MANY
    rows = run_sql(
        queue,
        "SELECT id, (payload->>'n')::int, payload->>'text', queue, priority, concurrency_key,"
        " status FROM {schema}.tasks ORDER BY id",
    )
    assert [row[0] for row in rows] == ids
    assert [row[1] for row in rows] == list(range(MANY))
    assert {row[2:] for row in rows} == {
        ("tab\there, backslash \\ and é", "bulk", 3, "k", "enqueued")
    }
    lease = queue.claim(queue="bulk")
    assert lease is not None and lease.task_id == ids[0]


def test_a_bad_payload_deep_in_a_large_enqueue_many_stores_none(queue: LeaseQueue) -> None:
    queue.enqueue({"kept": True})
    payloads = [{"n": n} for n in range(MANY)]
    payloads[MANY - 10] = {"n": float("nan")}
    with pytest.raises(PayloadError, match=f"payload #{MANY - 10} is not JSON"):
        queue.enqueue_many(payloads)
    assert queue.stats().counts["enqueued"] == 1


def test_large_enqueue_manys_side_by_side_each_get_their_own_ids(queue: LeaseQueue) -> None:
    results: dict[int, list[int]] = {}

    def enqueue(worker: int) -> None:
        results[worker] = queue.enqueue_many({"w": worker, "n": n} for n in range(MANY))

    threads = [threading.Thread(target=enqueue, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    stored = dict(
        (row[0], (row[1], row[2]))
        for row in run_sql(
            queue, "SELECT id, (payload->>'w')::int, (payload->>'n')::int FROM {schema}.tasks"
        )
    )
    assert len(stored) == 4 * MANY
    for worker, ids in results.items():
        assert [stored[task_id] for task_id in ids] == [(worker, n) for n in range(MANY)]


def test_ids_are_drawn_without_looking_the_sequence_up_for_each(queue: LeaseQueue) -> None:
    # Looked up per id, the sequence's name took most of the time of a large enqueue_many.
    statement = queue._driver.statement(sql.RESERVE_TASK_IDS).replace("%(count)s", "10")
    plan = [row[0] for row in run_sql(queue, f"EXPLAIN (VERBOSE) {statement}")]
    drawing = [line for line in plan if "nextval(" in line]
    assert drawing, plan
    assert not any("pg_get_serial_sequence" in line for line in drawing), plan
