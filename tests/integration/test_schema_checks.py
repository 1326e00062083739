"""The database's own checks on tasks and attempts, and the migration that made them cheap."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from dagster_leasequeue import LeaseQueue, migrations

from ..helpers import install_as_of, run_sql

# A statement that writes what the package never writes, and the check that refuses it.
REFUSED = [
    ("UPDATE {schema}.tasks SET status = 'finished'", "tasks_values_check"),
    ("UPDATE {schema}.tasks SET attempts = -1", "tasks_values_check"),
    ("UPDATE {schema}.tasks SET max_attempts = 0", "tasks_values_check"),
    ("UPDATE {schema}.tasks SET lease_seconds = 0", "tasks_values_check"),
    (
        "INSERT INTO {schema}.tasks (queue, payload, max_attempts) VALUES ('q', '{}', 0)",
        "tasks_values_check",
    ),
    ("UPDATE {schema}.attempts SET outcome = 'won'", "attempts_outcome_check"),
]


def _one_task_and_attempt(queue: LeaseQueue) -> None:
    queue.enqueue({"n": 1}, lease_seconds=30)
    lease = queue.claim()
    assert lease is not None
    with queue.attempt(lease=lease):
        pass


def _refused(dsn: str, queue: LeaseQueue, statement: str) -> str | None:
    """The constraint that refused ``statement``, run on a connection of its own."""
    with psycopg.connect(dsn) as conn, pytest.raises(psycopg.errors.CheckViolation) as refused:
        conn.execute(statement.replace("{schema}", f'"{queue.schema}"'))
    return refused.value.diag.constraint_name


@pytest.mark.parametrize(("statement", "constraint"), REFUSED)
def test_a_value_the_package_never_writes_is_refused_by_name(
    dsn: str, queue: LeaseQueue, statement: str, constraint: str
) -> None:
    _one_task_and_attempt(queue)
    before = run_sql(queue, "SELECT * FROM {schema}.tasks ORDER BY id")
    assert _refused(dsn, queue, statement) == constraint
    assert run_sql(queue, "SELECT * FROM {schema}.tasks ORDER BY id") == before


def test_a_copied_row_is_checked_too(dsn: str, queue: LeaseQueue) -> None:
    copy = f'COPY "{queue.schema}".tasks (queue, payload, max_attempts, status) FROM STDIN'
    with (
        psycopg.connect(dsn) as conn,
        pytest.raises(psycopg.errors.CheckViolation) as refused,
        conn.cursor().copy(copy) as rows,
    ):
        rows.write_row(("q", "{}", 3, "finished"))
    assert refused.value.diag.constraint_name == "tasks_values_check"
    assert queue.stats().counts["enqueued"] == 0


def test_the_cheap_checks_migration_rewrites_nothing_and_keeps_every_row(
    dsn: str, make_queue: Any
) -> None:
    queue = make_queue()
    install_as_of(queue, 16)  # the release before migration 17
    # The attempt's record written as that release wrote it: this release's attempts
    # end through a function of a later migration.
    task_id = queue.enqueue({"n": 1}, lease_seconds=30)
    lease = queue.claim()
    assert lease is not None
    lease.ack()
    run_sql(
        queue,
        "INSERT INTO {schema}.attempts (identity, queue, attempt, task_id, outcome)"
        " VALUES ('task:' || %(id)s, 'default', 1, %(id)s, 'succeeded')",
        {"id": task_id},
    )
    queue.enqueue({"n": 2}, max_attempts=7, lease_seconds=12.5)
    # Every relation's storage: a rewrite or an index rebuilt would give it a new file.
    storage = "SELECT relname, relfilenode FROM pg_class WHERE relnamespace = %(s)s::regnamespace"
    files = dict(run_sql(queue, storage, {"s": queue.schema}))
    rows = run_sql(queue, "SELECT * FROM {schema}.tasks ORDER BY id")
    attempts = run_sql(queue, "SELECT * FROM {schema}.attempts ORDER BY id")

    assert queue.install() == len(migrations.MIGRATIONS) - 16
    assert dict(run_sql(queue, storage, {"s": queue.schema})) == files
    assert run_sql(queue, "SELECT * FROM {schema}.tasks ORDER BY id") == rows
    assert run_sql(queue, "SELECT * FROM {schema}.attempts ORDER BY id") == attempts
    assert _refused(dsn, queue, REFUSED[0][0]) == "tasks_values_check"
    lease = queue.claim()
    assert lease is not None and lease.payload == {"n": 2} and lease.lease_seconds == 12.5
    lease.ack()
