"""A worker role with only the grants it needs runs the whole worker life cycle."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from dagster_leasequeue import LeaseQueue, LeaseQueueError, LeaseQueueSettings

from ..helpers import expire, run_sql


@pytest.fixture
def worker_role(dsn: str) -> Iterator[str]:
    role = f"lq_worker_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    yield role
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_the_worker_role_runs_claim_ack_renew_attempt_and_sweep(
    dsn: str, queue: LeaseQueue, worker_role: str
) -> None:
    queue.grant_worker(worker_role)
    run_sql(queue, "CREATE TABLE {schema}.effects (task_id bigint)")
    run_sql(queue, f"GRANT INSERT ON {{schema}}.effects TO {worker_role}")
    settings = LeaseQueueSettings(_env_file=None)
    with LeaseQueue(
        make_conninfo(dsn, user=worker_role), schema=queue.schema, settings=settings
    ) as worker:
        assert worker.install() == 0  # nothing to do, and no DDL right needed to find that out
        ids = worker.enqueue_many([{"n": n} for n in range(3)])
        worker.enqueue({"n": 3}, idempotency_key="k")
        lease = worker.claim()
        assert lease is not None
        lease.renew(60)
        with worker.attempt(lease=lease) as attempt:
            attempt.connection.execute(
                sql.SQL("INSERT INTO {} VALUES (%s)").format(
                    sql.Identifier(queue.schema, "effects")
                ),
                (lease.task_id,),
            )
        # The loop through attempts: the next task's start record commits with its claim;
        # one its lease did not use is taken back, with no DELETE right on attempts.
        first = worker.claim()
        assert first is not None
        with worker.attempt(lease=first, claim_next=True) as attempt:
            pass
        assert attempt.claimed is not None
        assert [a.outcome for a in worker.attempts(task_id=attempt.claimed.task_id)] == ["running"]
        attempt.claimed.ack()
        assert worker.attempts(task_id=attempt.claimed.task_id) == []
        stale = worker.claim()
        assert stale is not None
        expire(queue, stale.task_id)
        assert [r.task_id for r in worker.sweep()] == [stale.task_id]
        failing = worker.claim()
        assert failing is not None
        failing.fail("retry me", retry_in=0)
        assert worker.stats().counts["done"] == 3
        assert worker.get(ids[0]).status == "done"
        # A batch's tasks and keyed ones, each counted by a trigger as the worker finishes
        # them (a stripe row of the worker's session made on its first finish).
        batch = worker.enqueue_batch([{"n": 10}, {"n": 11}], queue="docs")
        worker.enqueue({"n": 12}, queue="docs", concurrency_key="customer-1")
        while (held := worker.claim(queue="docs")) is not None:
            held.ack()
        assert worker.batch(batch.id).finished
        # What it must not do.
        for forbidden in (
            lambda: worker.purge(0),
            lambda: run_sql(worker, "TRUNCATE {schema}.tasks"),
            lambda: run_sql(worker, "DROP TABLE {schema}.attempts"),
            lambda: run_sql(worker, "CREATE TABLE {schema}.intruder (x int)"),
        ):
            with pytest.raises(LeaseQueueError, match=r"permission denied|must be owner"):
                forbidden()
    assert run_sql(queue, "SELECT count(*) FROM {schema}.tasks")[0][0] == 7


def test_a_role_without_the_worker_grants_cannot_take_back_start_records(
    dsn: str, queue: LeaseQueue, worker_role: str
) -> None:
    # discard_begun_attempt() deletes as the schema's owner: only grant_worker's roles call it.
    run_sql(queue, f"GRANT USAGE ON SCHEMA {{schema}} TO {worker_role}")
    with (
        psycopg.connect(make_conninfo(dsn, user=worker_role)) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute(f'SELECT "{queue.schema}".discard_begun_attempt(1, 1, 1)')
