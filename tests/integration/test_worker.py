"""run_worker: the CLI's worker loop as a library call."""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from dagster_leasequeue import (
    ConfigurationError,
    Lease,
    LeaseQueue,
    LeaseQueueSettings,
    WorkerSummary,
    run_worker,
)

from ..own_server import OwnServer


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


def test_run_worker_acks_a_task_and_claims_the_next_in_one_commit(queue: LeaseQueue) -> None:
    first, second, third = queue.enqueue_many([{"n": n} for n in range(3)])
    commits: dict[int, int] = {}

    def note_commit(payload: dict[str, Any], lease: Lease) -> None:
        with queue.connection() as conn:
            rows = conn.execute(
                f'SELECT id, xmin::text::bigint FROM "{queue.schema}".tasks WHERE id = ANY(%s)',
                ([first, second, third],),
            ).fetchall()
        commits.update({lease.task_id: dict(rows)[lease.task_id]})
        if lease.task_id != first:
            # The transaction that claimed this task is the one that acked the one before.
            assert dict(rows)[lease.task_id - 1] == dict(rows)[lease.task_id]

    summary = run_worker(queue, note_commit, burst=True)
    assert summary.outcomes == {"done": 3}
    assert len(set(commits.values())) == 3


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


def test_run_worker_outlives_a_database_restart(tmp_path: Path) -> None:
    """The server crashes during one task's work and comes back longer than a call waits
    for a connection later: the worker backs off, reconnects, gives that task back, and
    drains the rest; every effect is written once."""
    server = OwnServer(tmp_path)
    server.start()
    settings = LeaseQueueSettings(
        lease_seconds=30,
        connect_timeout=1,
        network_timeout=1,
        data_dir=tmp_path / "unused",
        _env_file=None,
    )
    messages: list[str] = []
    log = logging.getLogger("tests.restart")
    log.addHandler(_ListHandler(messages))
    log.setLevel(logging.INFO)
    try:
        with LeaseQueue(server.dsn, schema="lq", settings=settings) as queue:
            queue.install()
            with queue.connection() as conn:
                conn.execute("CREATE TABLE lq.effects (n int NOT NULL)")
            ids = queue.enqueue_many([{"n": n} for n in range(20)])

            def write(payload: dict[str, Any], lease: Lease) -> None:
                with queue.attempt(lease=lease) as attempt:
                    if payload["n"] == 7 and lease.attempt == 1:
                        server.crash()
                        threading.Timer(5, server.start).start()
                    attempt.connection.execute(
                        "INSERT INTO lq.effects VALUES (%s)", (payload["n"],)
                    )

            summary = run_worker(queue, write, burst=True, poll_interval=0.2, logger=log)
            assert summary.outcomes == {"done": 20, "unreachable": 1}
            assert {queue.get(task_id).status for task_id in ids} == {"done"}
            assert queue.get(ids[7]).attempts == 2
            with queue.connection() as conn:
                rows = conn.execute("SELECT n, count(*) FROM lq.effects GROUP BY n").fetchall()
            assert dict(rows) == {n: 1 for n in range(20)}
        text = "\n".join(messages)
        assert "cannot claim" in text
        assert "the database answers again" in text
        assert f"task {ids[7]} given back after the outage: enqueued" in text
    finally:
        with contextlib.suppress(Exception):
            server.stop()


class _ListHandler(logging.Handler):
    def __init__(self, messages: list[str]) -> None:
        super().__init__()
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
