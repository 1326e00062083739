"""Client instructions per task, counted by valgrind: a measure the machine's noise can't move.

``python -m benchmarks.instructions`` drains a queue in one process under
``valgrind --tool=callgrind`` twice per strategy, with two task counts, and divides the
difference in instructions by the difference in tasks. Start-up, imports and the schema's
creation cancel out. Only the client process is counted, not the server. It takes about
20 s per strategy, and needs valgrind (``apt install valgrind``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping

from benchmarks.harness.db import bench_schema, connect, fill_tasks, vacuum
from benchmarks.harness.report import table
from benchmarks.harness.strategies import STRATEGIES

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_STRATEGIES = (
    "raw_one",
    "sql_one",
    "lq_one",
    "raw_batch",
    "lq_batch",
    "lq_attempt",
    "lq_attempt_effect",
)
SMALL, LARGE = 300, 1_300
_COLLECTED = re.compile(r"Collected : (\d+)")


def drain_once(dsn: str, strategy: str, tasks: int) -> None:
    """Fill a fresh schema with ``tasks`` tasks and drain it with ``strategy``, in process."""
    with bench_schema(dsn, "instr") as schema:
        with connect(dsn, schema) as conn:
            fill_tasks(conn, tasks)
            vacuum(conn)
        drainer = STRATEGIES[strategy].open(dsn, schema, 100)
        try:
            while claimed := drainer.claim():
                drainer.finish(claimed)
        finally:
            drainer.close()


def instructions(dsn: str, strategy: str, tasks: int) -> int:
    """Instructions the client process ran for one fill-and-drain of ``tasks`` tasks."""
    command = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        "-m",
        "benchmarks.instructions",
        "--dsn",
        dsn,
        "--child",
        f"{strategy}:{tasks}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    match = _COLLECTED.search(done.stderr)
    if match is None:
        raise RuntimeError(f"valgrind printed no instruction count for {strategy}")
    return int(match.group(1))


def per_task(dsn: str, strategy: str) -> float:
    return (instructions(dsn, strategy, LARGE) - instructions(dsn, strategy, SMALL)) / (
        LARGE - SMALL
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.instructions")
    parser.add_argument("--dsn", default=DEFAULT_DSN)
    parser.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        strategy, tasks = args.child.split(":")
        drain_once(args.dsn, strategy, int(tasks))
        return 0
    if valgrind_missing():
        return 1
    counts = {name: per_task(args.dsn, name) for name in args.strategies.split(",")}
    print_counts("client instructions per task (callgrind)", counts)
    return 0


def valgrind_missing() -> bool:
    """Whether valgrind is missing (and said so)."""
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: apt install valgrind", file=sys.stderr)
        return True
    return False


def print_counts(title: str, counts: Mapping[str, float]) -> None:
    """Instructions per task by strategy, each against its baseline when that was counted."""
    rows = []
    for name, count in counts.items():
        baseline = STRATEGIES[name].baseline
        ratio = round(count / counts[baseline], 2) if baseline and baseline in counts else "-"
        rows.append((name, STRATEGIES[name].label, round(count), baseline or "-", ratio))
    headers = ("strategy", "how", "instructions/task", "baseline", "x baseline")
    print(table(title, headers, rows))


if __name__ == "__main__":
    raise SystemExit(main())
