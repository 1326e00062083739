"""Database helpers: throw-away ``bench_`` schemas, fast table fills, the server's settings."""

from __future__ import annotations

import os
import platform
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from importlib import metadata
from typing import Any

import psycopg
from psycopg import sql

import dagster_leasequeue
from benchmarks.harness import source
from benchmarks.harness.stats import Summary
from dagster_leasequeue import LeaseQueue, LeaseQueueSettings

SCHEMA_PREFIX = "bench_"
LEASE_SECONDS = 300.0
SERVER_SETTINGS = (
    "shared_buffers",
    "synchronous_commit",
    "fsync",
    "max_connections",
    "work_mem",
    "autovacuum",
    "full_page_writes",
    "wal_sync_method",
    "max_wal_size",
)
EFFECTS_TABLE = "bench_effects"


def connect(
    dsn: str, schema: str | None = None, *, prepared: bool = True
) -> psycopg.Connection[Any]:
    """An autocommit connection, its search_path set to ``schema`` when given.

    psycopg prepares a statement on its fifth execution; ``prepared=False`` turns that off.
    """
    conn = psycopg.connect(dsn, autocommit=True)
    if not prepared:
        conn.prepare_threshold = None
    if schema is not None:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
    return conn


def supports_setting(name: str) -> bool:
    """Whether the measured package has this setting (it grows between revisions)."""
    return name in LeaseQueueSettings.model_fields


def queue_settings(
    *, pool_size: int = 2, overrides: Mapping[str, object] | None = None
) -> LeaseQueueSettings:
    """The package settings every benchmark queue uses (no .env file is read)."""
    return LeaseQueueSettings(
        **{"pool_size": pool_size, "lease_seconds": LEASE_SECONDS, "max_attempts": 5}
        | dict(overrides or {}),
        _env_file=None,
    )


def open_queue(
    dsn: str, schema: str, *, pool_size: int = 2, overrides: Mapping[str, object] | None = None
) -> LeaseQueue:
    settings = queue_settings(pool_size=pool_size, overrides=overrides)
    return LeaseQueue(dsn, schema=schema, settings=settings)


@contextmanager
def bench_schema(dsn: str, label: str) -> Iterator[str]:
    """A new schema installed by the package (plus an effects table), dropped afterwards."""
    name = f"{SCHEMA_PREFIX}{label}_{uuid.uuid4().hex[:8]}"
    try:
        with open_queue(dsn, name, pool_size=1) as queue:
            queue.install()
        with connect(dsn, name) as conn:
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {} (task_id bigint PRIMARY KEY, "
                    "done_at timestamptz NOT NULL DEFAULT clock_timestamp())"
                ).format(sql.Identifier(EFFECTS_TABLE))
            )
        yield name
    finally:
        drop_schema(dsn, name)


def drop_schema(dsn: str, name: str) -> None:
    if not name.startswith(SCHEMA_PREFIX):
        raise ValueError(f"refusing to drop {name!r}: not a benchmark schema")
    with connect(dsn) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def fill_tasks(conn: psycopg.Connection[Any], count: int, status: str = "enqueued") -> int:
    """Insert ``count`` no-op tasks in one statement (search_path set); return the first id.

    ``done`` rows look like tasks the package acked: one attempt, a finish time, no lease.
    """
    row = conn.execute(
        """
        WITH inserted AS (
            INSERT INTO tasks (queue, status, payload, max_attempts, attempts, finished_at)
            SELECT 'default', %(status)s::text, '{}'::jsonb, 5,
                   CASE WHEN %(status)s::text = 'done' THEN 1 ELSE 0 END,
                   CASE WHEN %(status)s::text = 'done' THEN clock_timestamp() END
            FROM generate_series(1, %(count)s)
            RETURNING id
        )
        SELECT min(id) FROM inserted
        """,
        {"status": status, "count": count},
    ).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


# The seed's own table: the columns its statements name, and an index only for its claim
# (plus the key its ack looks rows up by), in place of the package's tasks table.
LEAN_TASKS = """
    CREATE TABLE tasks (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        queue text NOT NULL,
        status text NOT NULL DEFAULT 'enqueued',
        priority integer NOT NULL DEFAULT 0,
        run_at timestamptz NOT NULL DEFAULT clock_timestamp(),
        lease_expires_at timestamptz
    )
"""
LEAN_CLAIM_INDEX = """
    CREATE INDEX tasks_claim_idx ON tasks (queue, priority DESC, run_at, id)
        WHERE status = 'enqueued'
"""


def fill_lean_tasks(conn: psycopg.Connection[Any], count: int) -> None:
    """Put ``count`` tasks in a table of the seed's shape, replacing the package's tasks."""
    conn.execute("DROP TABLE tasks CASCADE")
    conn.execute(LEAN_TASKS)
    conn.execute(LEAN_CLAIM_INDEX)
    conn.execute(
        "INSERT INTO tasks (queue) SELECT 'default' FROM generate_series(1, %(count)s)",
        {"count": count},
    )


def expire_leases(conn: psycopg.Connection[Any], first_id: int) -> int:
    """Turn every task from ``first_id`` on into a lease that expired a minute ago."""
    return conn.execute(
        """
        UPDATE tasks
        SET status = 'processing', attempts = 1, finished_at = NULL,
            lease_token = nextval('lease_tokens'),
            lease_expires_at = clock_timestamp() - interval '1 minute',
            worker_id = 'bench-dead-worker'
        WHERE id >= %(first_id)s
        """,
        {"first_id": first_id},
    ).rowcount


def vacuum(conn: psycopg.Connection[Any], analyze: bool = True) -> None:
    conn.execute("VACUUM (ANALYZE) tasks" if analyze else "VACUUM tasks")


def checkpoint(conn: psycopg.Connection[Any]) -> None:
    """Write all dirty pages now (if this role may), so no drain pays for an earlier one's.

    Each drain then also starts with the same full-page writes to do.
    """
    with suppress(psycopg.errors.InsufficientPrivilege):
        conn.execute("CHECKPOINT")


def status_counts(conn: psycopg.Connection[Any]) -> dict[str, int]:
    rows = conn.execute("SELECT status, count(*) FROM tasks GROUP BY status").fetchall()
    return {str(status): int(count) for status, count in rows}


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _show(conn: psycopg.Connection[Any], name: str) -> str:
    row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
    return str(row[0]) if row else "?"


def environment(dsn: str) -> dict[str, Any]:
    """The server's version and settings, the client's versions, and the machine."""
    with connect(dsn) as conn:
        server = conn.execute("SHOW server_version").fetchone()
        settings = {name: _show(conn, name) for name in SERVER_SETTINGS}
    return {
        "postgresql": str(server[0]) if server else "?",
        "settings": settings,
        "python": sys.version.split()[0],
        "psycopg": _version("psycopg"),
        "psycopg_pool": _version("psycopg-pool"),
        "dagster_leasequeue": dagster_leasequeue.__version__,
        "source": source.describe(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()),
    }


def probe_round_trips(dsn: str, calls: int = 200) -> dict[str, Summary]:
    """The floor under every path: one round trip (SELECT 1) and one durable commit."""
    with bench_schema(dsn, "probe") as schema, connect(dsn, schema) as conn:
        conn.execute("CREATE TABLE probe (id int PRIMARY KEY, n bigint NOT NULL)")
        conn.execute("INSERT INTO probe VALUES (1, 0)")
        statements = {
            "round_trip": "SELECT 1",
            "commit": "UPDATE probe SET n = n + 1 WHERE id = 1",
        }
        return {name: _time_statement(conn, text, calls) for name, text in statements.items()}


def _time_statement(conn: psycopg.Connection[Any], statement: str, calls: int) -> Summary:
    durations = []
    for _ in range(calls):
        started = time.perf_counter()
        conn.execute(statement)
        durations.append(time.perf_counter() - started)
    return Summary.of_seconds(durations)
