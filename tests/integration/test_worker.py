"""run_worker: the CLI's worker loop as a library call."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from dagster_leasequeue import ConfigurationError, Lease, LeaseQueue, WorkerSummary, run_worker


def test_run_worker_drains_a_queue_and_counts_outcomes(queue: LeaseQueue) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(5)], queue="jobs", max_attempts=1)

    def double(payload: dict[str, Any], lease: Lease) -> dict[str, Any]:
        if payload["n"] == 3:
            raise ValueError("three is bad")
        return {"doubled": payload["n"] * 2, "attempt": lease.attempt}

    summary = run_worker(queue, double, queue_name="jobs", burst=True)
    assert isinstance(summary, WorkerSummary)
    assert summary.outcomes == {"done": 4, "failed": 1}
    assert queue.get(ids[2]).result == {"doubled": 4, "attempt": 1}
    assert queue.get(ids[3]).status == "dead"


def test_run_worker_runs_outside_the_main_thread(queue: LeaseQueue) -> None:
    queue.enqueue_many([{"n": n} for n in range(3)])
    summaries: list[WorkerSummary] = []
    thread = threading.Thread(
        target=lambda: summaries.append(run_worker(queue, lambda payload: None, max_tasks=2))
    )
    thread.start()
    thread.join(timeout=30)
    assert summaries[0].outcomes == {"done": 2}
    assert queue.stats().counts["enqueued"] == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"poll_interval": 0}, "poll_interval"),
        ({"max_tasks": 0}, "max_tasks"),
        ({"lease_seconds": 10**7}, "lease_seconds"),
    ],
)
def test_run_worker_refuses_bad_options(
    queue: LeaseQueue, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        run_worker(queue, lambda payload: None, burst=True, **kwargs)


def test_a_handler_must_be_callable(queue: LeaseQueue) -> None:
    with pytest.raises(ConfigurationError, match="callable"):
        run_worker(queue, "not a function", burst=True)  # type: ignore[arg-type]


def test_an_interrupt_during_an_attempt_releases_the_task_and_keeps_its_attempts(
    queue: LeaseQueue,
) -> None:
    # What the worker's second stop signal raises inside the handler: a KeyboardInterrupt.
    task_id = queue.enqueue({"n": 1}, max_attempts=1)
    lease = queue.claim()
    assert lease is not None
    with pytest.raises(KeyboardInterrupt), lease, queue.attempt(lease=lease) as attempt:
        attempt.connection.execute("SELECT 1")
        raise KeyboardInterrupt
    task = queue.get(task_id)
    assert (task.status, task.attempts) == ("enqueued", 0)
    assert [r.outcome for r in queue.attempts(task_id=task_id)] == ["failed"]
    again = queue.claim()
    assert again is not None and again.task_id == task_id and again.attempt == 1


def test_a_handler_that_concludes_its_own_task_counts_as_done(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})

    def through_an_attempt(payload: dict[str, Any], lease: Lease) -> None:
        with queue.attempt(lease=lease) as attempt:
            attempt.result = {"n": payload["n"]}

    assert run_worker(queue, through_an_attempt, burst=True).outcomes == {"done": 1}
    assert queue.get(task_id).result == {"n": 1}
