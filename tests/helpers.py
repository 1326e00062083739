"""Helpers shared by the tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from dagster_leasequeue import LeaseQueue, migrations

T = TypeVar("T")


def run_sql(queue: LeaseQueue, statement: str, params: dict[str, Any] | None = None) -> list[Any]:
    """Run SQL against the queue's schema (``{schema}`` is replaced by its quoted name)."""
    with queue._driver.connection() as conn:
        cursor = conn.execute(statement.replace("{schema}", f'"{queue.schema}"'), params)
        return cursor.fetchall() if cursor.description else []


def stored_tasks(queue: LeaseQueue) -> dict[int, tuple[str, int, int]]:
    """Every task of the schema: its status, attempts and max_attempts, by id."""
    rows = run_sql(queue, "SELECT id, status, attempts, max_attempts FROM {schema}.tasks")
    return {row[0]: (row[1], row[2], row[3]) for row in rows}


def run_model(machine: type[RuleBasedStateMachine], chaos_long: bool) -> None:
    """Run a state machine against its model: 40 sequences of 30 steps, 300 of 60 in the
    long form (``--chaos-long``)."""
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=300 if chaos_long else 40,
            stateful_step_count=60 if chaos_long else 30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )


def expire(queue: LeaseQueue, *task_ids: int) -> None:
    """Move the leases of these tasks one second into the past (database clock)."""
    run_sql(
        queue,
        "UPDATE {schema}.tasks SET lease_expires_at = clock_timestamp() - interval '1 second'"
        " WHERE id = ANY(%(ids)s)",
        {"ids": list(task_ids)},
    )


def waits_for_a_lock(dsn: str, schema: str) -> bool:
    """Whether a session is waiting for a lock in a statement on the schema's tasks."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE %s",
            (f'%"{schema}".tasks%',),
        ).fetchone()
    return row is not None and row[0] > 0


def wait_for_a_lock_waiter(dsn: str, schema: str, timeout: float = 10) -> None:
    """Until a session waits for a lock in a statement on the schema's tasks."""
    deadline = time.monotonic() + timeout
    while not waits_for_a_lock(dsn, schema):
        assert time.monotonic() < deadline, "no call came to wait for a lock"
        time.sleep(0.05)


def start_blocked(dsn: str, schema: str, call: Callable[[], T]) -> Callable[[], T]:
    """Run ``call`` in a thread until it waits for a lock on the schema's tasks.

    Returns a function that waits for the call to end and gives its result.
    """
    results: list[T] = []
    thread = threading.Thread(target=lambda: results.append(call()))
    thread.start()
    wait_for_a_lock_waiter(dsn, schema)

    def finish() -> T:
        thread.join(timeout=30)
        return results[0]

    return finish


def on_claiming(queue: LeaseQueue, mark: str, action: str) -> None:
    """A trigger that runs ``action`` (PL/pgSQL) in the claim of a task whose payload has
    the key ``mark``."""
    run_sql(
        queue,
        f"""
        CREATE FUNCTION {{schema}}.on_claiming_{mark}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.payload ? '{mark}' THEN {action}; END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER on_claiming_{mark} BEFORE UPDATE ON {{schema}}.tasks FOR EACH ROW
            WHEN (NEW.status = 'processing') EXECUTE FUNCTION {{schema}}.on_claiming_{mark}();
        """,
    )


def break_the_session_reset(queue: LeaseQueue) -> None:
    """Replace the schema's reset_session() with one that raises."""
    run_sql(
        queue,
        """
        ALTER FUNCTION {schema}.reset_session() RENAME TO reset_session_as_installed;
        CREATE FUNCTION {schema}.reset_session() RETURNS text[] LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'no reset today';
        END $$;
        """,
    )


def install_as_of(queue: LeaseQueue, version: int) -> int:
    """Install the schema as the release whose last migration was ``version`` did."""
    with pytest.MonkeyPatch.context() as older_release:
        older_release.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:version])
        older_release.setattr(migrations, "LATEST_VERSION", version)
        return queue.install()
