"""Task handlers run by `leasequeue worker` in the CLI tests (importable by module path)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from psycopg import sql

from dagster_leasequeue import Lease, LeaseQueue


def double(payload: dict[str, Any], lease: Lease) -> dict[str, Any]:
    """Takes the lease too; fails on request, so the tests see both outcomes."""
    if payload.get("fail"):
        raise ValueError(f"asked to fail: {payload['n']}")
    return {"doubled": payload["n"] * 2, "attempt": lease.attempt}


def count_only(payload: dict[str, Any]) -> None:
    """Takes the payload only and returns nothing: the task is done with no result."""
    assert "n" in payload


def slow(payload: dict[str, Any]) -> dict[str, Any]:
    """Writes a marker file when it starts (so a test knows it runs), then sleeps."""
    Path(payload["marker"]).write_text("started")
    time.sleep(payload["seconds"])
    return {"slept": payload["seconds"]}


def nap(payload: dict[str, Any]) -> dict[str, Any]:
    """Sleeps for a moment, as a short task does."""
    time.sleep(payload["seconds"])
    return {"slept": payload["seconds"]}


def not_a_dict(payload: dict[str, Any]) -> list[int]:
    """Returns a list, which the worker refuses as a result."""
    return [1, 2]


# The queue effect_through_attempt writes through: opened on first use, once per process.
_effects_queue: LeaseQueue | None = None


def effect_through_attempt(payload: dict[str, Any], lease: Lease) -> None:
    """Writes one row (task id, pid) to the schema's ``effects`` table through an attempt.

    The attempt's commit also acks the task, so the row is written once however often the
    task is claimed. The queue comes from the LEASEQUEUE_* settings of the worker's
    environment. Each attempt is logged to stderr as ``ATTEMPT {json}``: the task, how long
    its claim took, when the attempt started and ended (wall clock) and how (written,
    duplicate, or the exception's name), for the tests that time calls against network cuts.
    """
    global _effects_queue
    started = time.time()
    # How long the claim took: a lease's local deadline is counted from before its claim
    # was sent (no renewal has moved it yet: the first comes a third of the lease in).
    claimed_at = lease._local_deadline - lease.lease_seconds
    claim_seconds = time.monotonic() - claimed_at
    outcome = "written"
    try:
        if _effects_queue is None:
            _effects_queue = LeaseQueue.from_settings()
            started = time.time()  # the attempt's own time, without the queue's opening
        queue = _effects_queue
        with queue.attempt(lease=lease) as attempt:
            if attempt.duplicate:
                outcome = "duplicate"
                return
            attempt.connection.execute(
                sql.SQL("INSERT INTO {} (task_id, pid) VALUES (%s, %s)").format(
                    sql.Identifier(queue.schema, "effects")
                ),
                (lease.task_id, os.getpid()),
            )
    except BaseException as exc:
        outcome = type(exc).__name__
        raise
    finally:
        record = {"task": lease.task_id, "claim_s": claim_seconds, "started": started}
        record["ended"] = time.time()
        # One write: the worker's threads log to stderr too.
        sys.stderr.write(f"ATTEMPT {json.dumps({**record, 'outcome': outcome})}\n")
        sys.stderr.flush()
