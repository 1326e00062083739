"""Attempts: effects, success mark and fenced ack in one commit; duplicates skipped."""

from __future__ import annotations

import threading
import time

import pytest

from dagster_leasequeue import Attempt, ConfigurationError, LeaseLost, LeaseQueue

from .helpers import expire, run_sql


@pytest.fixture
def results(queue: LeaseQueue) -> LeaseQueue:
    run_sql(queue, "CREATE TABLE {schema}.results (doc text PRIMARY KEY, pages int)")
    return queue


def write_result(attempt: Attempt, doc: str, pages: int) -> None:
    schema = _schema[0]
    attempt.connection.execute(f'INSERT INTO "{schema}".results VALUES (%s, %s)', (doc, pages))


_schema: list[str] = []


@pytest.fixture(autouse=True)
def _remember_schema(schema_name: str) -> None:
    _schema[:] = [schema_name]


def count_results(queue: LeaseQueue) -> int:
    return int(run_sql(queue, "SELECT count(*) FROM {schema}.results")[0][0])


def test_effect_success_and_ack_commit_together(results: LeaseQueue) -> None:
    queue = results
    task_id = queue.enqueue({"doc": "invoice.pdf"}, idempotency_key="invoice.pdf")
    lease = queue.claim()
    assert lease is not None
    with lease, queue.attempt(lease=lease) as attempt:
        assert not attempt.duplicate and attempt.number == 1
        assert attempt.key == "invoice.pdf"
        write_result(attempt, "invoice.pdf", 2)
        attempt.result = {"pages": 2}
    info = queue.get(task_id)
    assert info.status == "done" and info.result == {"pages": 2}
    assert count_results(queue) == 1
    (record,) = queue.attempts("invoice.pdf")
    assert (record.outcome, record.attempt, record.task_id) == ("succeeded", 1, task_id)
    assert record.finished_at is not None and record.worker_id == lease.worker_id


def test_a_duplicate_is_skipped_and_acked_with_the_first_result(results: LeaseQueue) -> None:
    queue = results
    with queue.attempt("contract-9") as attempt:
        write_result(attempt, "contract-9", 200)
        attempt.result = {"pages": 200}
    task_id = queue.enqueue({"doc": "contract-9"})
    lease = queue.claim()
    assert lease is not None
    with queue.attempt("contract-9", lease=lease) as attempt:
        assert attempt.duplicate and attempt.result == {"pages": 200}
    assert queue.get(task_id).status == "done"
    assert queue.get(task_id).result == {"pages": 200}
    assert count_results(queue) == 1
    assert [r.outcome for r in queue.attempts("contract-9")] == ["succeeded", "skipped"]


def test_an_error_rolls_back_the_effect_and_keeps_the_key_open(results: LeaseQueue) -> None:
    queue = results
    task_id = queue.enqueue({"doc": "scan.pdf"})
    lease = queue.claim()
    assert lease is not None
    with pytest.raises(RuntimeError, match="ocr"), lease, queue.attempt(lease=lease) as attempt:
        write_result(attempt, "scan.pdf", 1)
        raise RuntimeError("ocr crashed")
    assert count_results(queue) == 0
    info = queue.get(task_id)
    assert info.status == "enqueued" and info.last_error == "RuntimeError: ocr crashed"
    run_sql(queue, "UPDATE {schema}.tasks SET run_at = clock_timestamp()")
    lease = queue.claim()
    assert lease is not None and lease.attempt == 2
    with queue.attempt(lease=lease) as attempt:
        assert not attempt.duplicate and attempt.number == 2
        write_result(attempt, "scan.pdf", 1)
    assert count_results(queue) == 1
    outcomes = [(r.outcome, r.error) for r in queue.attempts(f"default:{task_id}")]
    assert outcomes == [("failed", "RuntimeError: ocr crashed"), ("succeeded", None)]


def test_a_lost_lease_rolls_back_the_effect(results: LeaseQueue) -> None:
    queue = results
    task_id = queue.enqueue({"doc": "report.pdf"})
    stale = queue.claim()
    assert stale is not None
    with pytest.raises(LeaseLost), queue.attempt(lease=stale) as attempt:
        write_result(attempt, "report.pdf", 5)
        expire(queue, task_id)
        queue.sweep()
        fresh = queue.claim()
    assert count_results(queue) == 0
    assert fresh is not None
    with queue.attempt(lease=fresh) as attempt:
        assert not attempt.duplicate
        write_result(attempt, "report.pdf", 5)
    assert count_results(queue) == 1 and queue.get(task_id).status == "done"


def test_a_stale_lease_cannot_start_an_attempt_after_its_renewal_failed(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    lease = queue.claim(lease_seconds=0.3)
    assert lease is not None
    with pytest.raises(LeaseLost), lease:
        queue.cancel(task_id)
        time.sleep(0.5)
        with queue.attempt(lease=lease):
            pytest.fail("the attempt should not start")


def test_an_abandoned_attempt_is_marked_and_retried(queue: LeaseQueue) -> None:
    run_sql(
        queue,
        "INSERT INTO {schema}.attempts (key, attempt, outcome) VALUES ('k', 1, 'running')",
    )
    with queue.attempt("k") as attempt:
        assert attempt.number == 2 and attempt.abandoned == 1 and not attempt.duplicate
    assert [r.outcome for r in queue.attempts("k")] == ["abandoned", "succeeded"]


def test_attempts_of_one_key_take_turns(results: LeaseQueue) -> None:
    queue = results
    entered = threading.Event()
    outcomes: list[bool] = []

    def slow_first() -> None:
        with queue.attempt("shared") as attempt:
            entered.set()
            time.sleep(0.5)
            write_result(attempt, "shared", 1)
            outcomes.append(attempt.duplicate)

    first = threading.Thread(target=slow_first)
    first.start()
    entered.wait()
    with queue.attempt("shared") as attempt:
        outcomes.append(attempt.duplicate)
    first.join()
    assert outcomes == [False, True] and count_results(queue) == 1


def test_attempt_needs_a_key_or_a_lease(queue: LeaseQueue) -> None:
    with pytest.raises(ConfigurationError, match="needs a key"), queue.attempt():
        pass
