"""A worker process for the fault-injection tests, started with ``python -m tests.chaos_worker``.

Modes:
- ``drain``: claim, work through an attempt (writing one row to ``effects``) whose
  conclusion claims the next task, repeat; a payload with ``"poison": true`` kills the
  process (``os._exit``) mid-attempt.
- ``loop``: ``run_worker``, whose acks claim the next task, an effect written before each
  ack (at least once).
- ``zombie``: claim one task, write its effect inside an attempt, print ``HOLDING <id>``,
  wait ``--hold`` seconds (the test pauses the process meanwhile), then try to commit,
  renew and ack, and print what each raised as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

from psycopg import sql

from dagster_leasequeue import (
    DatabaseUnavailable,
    Lease,
    LeaseLost,
    LeaseQueue,
    LeaseQueueError,
    LeaseQueueSettings,
    run_worker,
)


def write_effect(attempt_connection: Any, schema: str, lease: Lease) -> None:
    attempt_connection.execute(
        sql.SQL("INSERT INTO {} (task_id, pid) VALUES (%s, %s)").format(
            sql.Identifier(schema, "effects")
        ),
        (lease.task_id, os.getpid()),
    )


def drain(queue: LeaseQueue, args: argparse.Namespace) -> None:
    # Each attempt's conclusion claims the next task in the same round trip, as a worker
    # loop does; a claim of its own only when that found none.
    lease: Lease | None = None
    while True:
        try:
            if lease is None:
                lease = queue.claim(lease_seconds=args.lease)
            if lease is None:
                time.sleep(0.02)
                continue
            with (
                lease,
                queue.attempt(
                    lease=lease, claim_next=True, next_lease_seconds=args.lease
                ) as attempt,
            ):
                if not attempt.duplicate:
                    if lease.payload.get("poison"):
                        os._exit(17)
                    time.sleep(random.uniform(args.work_min, args.work_max))
                    write_effect(attempt.connection, queue.schema, lease)
            lease = attempt.claimed
        except (LeaseLost, DatabaseUnavailable):
            lease = None
            time.sleep(0.05)


def loop(queue: LeaseQueue, args: argparse.Namespace) -> None:
    """run_worker's loop (each ack claims the next task), the effect written before the ack
    on a connection of its own: at least once."""

    def handle(payload: dict[str, Any], lease: Lease) -> None:
        time.sleep(random.uniform(args.work_min, args.work_max))
        with queue.connection() as conn:
            write_effect(conn, queue.schema, lease)

    run_worker(queue, handle, lease_seconds=args.lease, poll_interval=0.05)


def outcome(action: Any) -> str:
    try:
        action()
    except LeaseQueueError as exc:
        return type(exc).__name__
    return "accepted"


def zombie(queue: LeaseQueue, args: argparse.Namespace) -> None:
    lease = queue.claim(lease_seconds=args.lease)
    assert lease is not None
    results: dict[str, str] = {}

    def run_attempt() -> None:
        with queue.attempt(lease=lease) as attempt:
            write_effect(attempt.connection, queue.schema, lease)
            print(f"HOLDING {lease.task_id}", flush=True)
            time.sleep(args.hold)

    results["attempt"] = outcome(run_attempt)
    results["renew"] = outcome(lease.renew)
    results["ack"] = outcome(lease.ack)
    print(json.dumps(results), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["drain", "loop", "zombie"])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--schema", required=True)
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--work-min", type=float, default=0.01)
    parser.add_argument("--work-max", type=float, default=0.05)
    parser.add_argument("--hold", type=float, default=4.0)
    args = parser.parse_args()
    settings = LeaseQueueSettings(pool_size=2, connect_timeout=2, _env_file=None)
    with LeaseQueue(args.dsn, schema=args.schema, settings=settings) as queue:
        {"drain": drain, "loop": loop, "zombie": zombie}[args.mode](queue, args)


if __name__ == "__main__":
    sys.exit(main())
