"""Helpers shared by the tests."""

from __future__ import annotations

from typing import Any

from dagster_leasequeue import LeaseQueue


def run_sql(queue: LeaseQueue, statement: str, params: dict[str, Any] | None = None) -> list[Any]:
    """Run SQL against the queue's schema (``{schema}`` is replaced by its quoted name)."""
    with queue._driver.connection() as conn:
        cursor = conn.execute(statement.replace("{schema}", f'"{queue.schema}"'), params)
        return cursor.fetchall() if cursor.description else []


def expire(queue: LeaseQueue, *task_ids: int) -> None:
    """Move the leases of these tasks one second into the past (database clock)."""
    run_sql(
        queue,
        "UPDATE {schema}.tasks SET lease_expires_at = clock_timestamp() - interval '1 second'"
        " WHERE id = ANY(%(ids)s)",
        {"ids": list(task_ids)},
    )
