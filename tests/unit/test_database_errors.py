"""How driver errors are told to the caller: what happened, and what to do."""

from __future__ import annotations

import psycopg
from psycopg import errors as pg_errors

from dagster_leasequeue import DatabaseUnavailable, LeaseQueueError
from dagster_leasequeue.connection import DatabaseErrors

DSN = "postgresql://worker:s3cret@db.example:5432/app"


def test_a_deadlock_is_a_conflict_to_retry_not_an_outage() -> None:
    error = DatabaseErrors(DSN, "lq").translate(pg_errors.DeadlockDetected("deadlock detected"))
    assert type(error) is LeaseQueueError
    assert "rolled this transaction back" in str(error) and "tried again" in str(error)
    assert "DeadlockDetected" in str(error) and "s3cret" not in str(error)


def test_a_lost_connection_is_an_outage() -> None:
    error = DatabaseErrors(DSN, "lq").translate(psycopg.OperationalError("server closed"))
    assert isinstance(error, DatabaseUnavailable)
    assert "s3cret" not in str(error)
