"""Server instructions per task, counted by valgrind: the server's side of the worker loop,
in a measure the machine's noise can't move.

``python -m benchmarks.server_instructions`` starts a PostgreSQL server of its own (the
binaries bundled with pgserver, in a temporary folder) under ``valgrind --tool=callgrind``,
which follows each backend the server forks. Per strategy it fills a fresh schema and
drains it in this process, twice, with two task counts, and adds up the instructions of
the drain's backends (told apart by their application_name): the difference, divided by
the difference in tasks, leaves out connecting, preparing and filling. Only backends are
counted, user space only: not the WAL writer, not the kernel's part of a commit. The
server runs with ``fsync=off`` and without autovacuum, which change neither count. It
takes one to two minutes for the default strategies, and needs valgrind.

Use it to weigh a change in what the server does per task: two versions of a statement,
a trigger or a constraint, each counted here in the same session (``--source``-style
comparisons: run it from each version's tree).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

from benchmarks.harness.db import bench_schema, connect, vacuum
from benchmarks.harness.runner import fill_lean, fill_no_ops
from benchmarks.harness.strategies import STRATEGIES
from benchmarks.instructions import print_counts, valgrind_missing
from benchmarks.sections.batches import fill_batch

DEFAULT_STRATEGIES = ("raw_one_lean", "lq_one", "lq_chain", "lq_chain_attempt")
APPLICATION = "leasequeue_counted_drain"
# The two drains' task counts. At 300 and 1,300 tasks the seed-shaped strategies' smaller
# drain cost twice as much per task as the larger one (raw_one_lean: 678,306 and 324,647),
# and their difference was no cost per task; from 700 tasks on, their drains cost alike.
# Each claim also passes over the index entries of the tasks claimed before it, so a count
# per task grows with the tasks drained: compare counts made at the same sizes.
SMALL, LARGE = 1_500, 3_000
_TOTALS = re.compile(rb"^totals: (\d+)", re.MULTILINE)
_START_SECONDS = 180


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def counted_server() -> Iterator[tuple[str, Path]]:
    """A server under callgrind: its DSN, and the folder its backends' counts land in."""
    import pgserver  # noqa: F401  (the import sets up the bundled binaries)
    from pgserver._commands import POSTGRES_BIN_PATH
    from pgserver.utils import (
        ensure_prefix_permissions,
        ensure_user_exists,
    )

    # PostgreSQL refuses to run as root: as root, run it as pgserver's own user.
    user = "pgserver" if os.geteuid() == 0 else None
    with tempfile.TemporaryDirectory(prefix="lq-server-instructions-") as folder:
        root = Path(folder)
        data, counts = root / "data", root / "counts"
        data.mkdir()
        counts.mkdir()
        if user:
            ensure_user_exists(user)
            ensure_prefix_permissions(data)
            for path in (root, data, counts):
                shutil.chown(path, user, user)
        subprocess.run(
            [str(POSTGRES_BIN_PATH / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres"],
            check=True,
            user=user,
            stdout=subprocess.DEVNULL,
        )
        port = _free_port()
        server = subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                "--trace-children=yes",
                f"--callgrind-out-file={counts}/backend.%p",
                str(POSTGRES_BIN_PATH / "postgres"),
                *("-D", str(data), "-p", str(port), "-k", str(root)),
                *("-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"),
                *("-c", "autovacuum=off", "-c", "max_connections=40"),
            ],
            user=user,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        try:
            _wait_until_ready(dsn, server)
            yield dsn, counts
        finally:
            server.send_signal(signal.SIGINT)  # a fast shutdown
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()


def _wait_until_ready(dsn: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + _START_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError("the server under valgrind exited while starting")
        try:
            psycopg.connect(dsn, connect_timeout=5).close()
            return
        except psycopg.OperationalError:
            time.sleep(1)
    raise RuntimeError(f"the server under valgrind did not start in {_START_SECONDS} s")


def drain_instructions(
    dsn: str, counts: Path, strategy: str, tasks: int, *, in_batch: bool = False
) -> int:
    """Instructions of the backends that drained ``tasks`` tasks with ``strategy`` (the
    tasks of one batch with ``in_batch``)."""
    counted = make_conninfo(dsn, application_name=APPLICATION)
    fill = fill_lean if STRATEGIES[strategy].lean else fill_batch if in_batch else fill_no_ops
    with bench_schema(dsn, "srvinstr") as schema:
        fill(dsn, schema, tasks)
        with connect(dsn, schema) as conn:
            vacuum(conn)
        drainer = STRATEGIES[strategy].open(counted, schema, 100)
        try:
            while claimed := drainer.claim():
                drainer.finish(claimed)
            pids = _backends(dsn)
        finally:
            drainer.close()
    return sum(_backend_total(counts, pid) for pid in pids)


def _backends(dsn: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (APPLICATION,)
        ).fetchall()
    return [int(row[0]) for row in rows]


def _backend_total(counts: Path, pid: int) -> int:
    """A backend's count, written by callgrind once the backend has exited."""
    path = counts / f"backend.{pid}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if path.exists() and (match := _TOTALS.search(path.read_bytes())):
            path.unlink()
            return int(match.group(1))
        time.sleep(0.2)
    raise RuntimeError(f"callgrind wrote no count for backend {pid}")


# The smaller drain's average per task this much above the larger one's: the two did not
# run alike, and their difference is no cost per task. Their plans may differ (PostgreSQL
# may plan a statement on a table of a few hundred rows as a scan of the whole table: one
# such 300-task drain once read as 43% fewer), or the smaller drain carried a cost of its
# own (see SMALL, LARGE).
_PLANS_DIFFER = 1.3


def plans_differ(small: int, large: int) -> bool:
    """Whether the drains of SMALL and LARGE tasks that counted ``small`` and ``large``
    instructions ran different plans (see _PLANS_DIFFER)."""
    return small / SMALL > _PLANS_DIFFER * large / LARGE


def per_task(dsn: str, counts: Path, strategy: str, *, in_batch: bool = False) -> float:
    large = drain_instructions(dsn, counts, strategy, LARGE, in_batch=in_batch)
    small = drain_instructions(dsn, counts, strategy, SMALL, in_batch=in_batch)
    if plans_differ(small, large):
        print(
            f"warning: {strategy}'s {SMALL:,}-task drain ran {small / SMALL:,.0f} instructions "
            f"per task, its {LARGE:,}-task drain {large / LARGE:,.0f}: they did not run alike, "
            f"and the difference per task below is not a cost per task; compare the "
            f"drains' totals ({small:,} and {large:,})"
        )
    return (large - small) / (LARGE - SMALL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.server_instructions")
    parser.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES))
    parser.add_argument(
        "--in-batch",
        action="store_true",
        help="drain the tasks of one batch (enqueue_batch) with the package's strategies",
    )
    args = parser.parse_args(argv)
    if valgrind_missing():
        return 1
    names = args.strategies.split(",")
    with counted_server() as (dsn, counts):
        measured = {name: per_task(dsn, counts, name, in_batch=args.in_batch) for name in names}
    tasks = ", the tasks of one batch" if args.in_batch else ""
    print_counts(f"server instructions per task (callgrind, backends only{tasks})", measured)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
