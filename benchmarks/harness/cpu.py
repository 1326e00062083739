"""CPU time spent on both sides of a drain: the worker process and its server backends.

The server side is read from ``/proc/<pid>/schedstat`` of the backends whose
``application_name`` is the worker's own, so it is only known when PostgreSQL runs on this
machine (and in the same PID namespace); otherwise it is None.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg


def process_cpu_seconds(pid: int) -> float | None:
    """On-CPU time of a PostgreSQL process of this machine, in seconds; None if unreadable."""
    proc = Path("/proc") / str(pid)
    try:
        if not proc.joinpath("comm").read_text().startswith("postgres"):
            return None
        return int(proc.joinpath("schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def backend_cpu(conn: psycopg.Connection[Any], application_name: str) -> dict[int, float] | None:
    """On-CPU seconds of every backend with this application_name; None if any is unreadable."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (application_name,)
    ).fetchall()
    readings = {int(row[0]): process_cpu_seconds(int(row[0])) for row in rows}
    if any(value is None for value in readings.values()):
        return None
    return {pid: value for pid, value in readings.items() if value is not None}


def spent(before: dict[int, float] | None, after: dict[int, float] | None) -> float | None:
    """CPU seconds between two readings (a backend opened meanwhile counts from zero)."""
    if before is None or after is None:
        return None
    return sum(value - before.get(pid, 0.0) for pid, value in after.items())
