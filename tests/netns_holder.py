"""A worker that rides out a short network cut, run inside a namespace by the partition tests.

It claims one task and holds it under ``with lease:`` (renewing in the background), writes
``claimed``, then works on until ``WORK_SECONDS`` after the test's ``healed`` file appeared,
checking its lease between steps as long work should; then it writes its effect through an
attempt, whose commit acks the task. Meanwhile a watcher notes, on this process's monotonic
clock, every renewal that got through (the lease's expiry moved), the test's ``cut`` and
``healed`` files, and whether ``lease.lost`` was ever true. It prints a JSON report:

    python -m tests.netns_holder DSN SCHEMA LEASE_SECONDS WORK_SECONDS FOLDER
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from psycopg import sql

from dagster_leasequeue import Lease, LeaseQueue, LeaseQueueError, LeaseQueueSettings


class Watcher(threading.Thread):
    """Polls the lease and the test's files every 10 ms until stopped."""

    def __init__(self, lease: Lease, folder: Path) -> None:
        super().__init__(daemon=True)
        self.lease = lease
        self.folder = folder
        self.claimed_at = time.monotonic()
        self.renewals: list[float] = []
        self.cut_at: float | None = None
        self.healed_at: float | None = None
        self.ever_lost = False
        self.stopped = threading.Event()

    def run(self) -> None:
        expires_at = self.lease.expires_at
        while not self.stopped.wait(0.01):
            now = time.monotonic()
            if self.lease.expires_at != expires_at:
                expires_at = self.lease.expires_at
                self.renewals.append(now)
            self.ever_lost = self.ever_lost or self.lease.lost
            if self.cut_at is None and (self.folder / "cut").exists():
                self.cut_at = now
            if self.healed_at is None and (self.folder / "healed").exists():
                self.healed_at = now

    def report(self) -> dict[str, Any]:
        if self.cut_at is None or self.healed_at is None:
            return {"ever_lost": self.ever_lost}
        healed = self.healed_at
        after_heal = [t - healed for t in self.renewals if t > healed]
        marks = [self.claimed_at, *self.renewals]
        return {
            "cut_seconds": round(healed - self.cut_at, 3),
            "renewals_relative_to_heal_s": [round(t - healed, 3) for t in self.renewals],
            "renewals_during_cut": sum(self.cut_at <= t <= healed for t in self.renewals),
            "first_renewal_after_heal_s": round(after_heal[0], 3) if after_heal else None,
            "longest_gap_between_renewals_s": round(
                max((b - a for a, b in itertools.pairwise(marks)), default=0.0), 3
            ),
            "ever_lost": self.ever_lost,
        }


def main() -> None:
    dsn, schema, lease_text, work_text, folder_text = sys.argv[1:6]
    folder = Path(folder_text)
    work_seconds = float(work_text)
    settings = LeaseQueueSettings(lease_seconds=float(lease_text), _env_file=None)
    report: dict[str, Any] = {}
    with LeaseQueue(dsn, schema=schema, settings=settings) as queue:
        lease = queue.claim()
        assert lease is not None
        with lease:
            watcher = Watcher(lease, folder)
            watcher.start()
            (folder / "claimed").write_text(str(lease.task_id))
            deadline = None
            while deadline is None or time.monotonic() < deadline:
                if lease.lost:  # checked between steps of the work, as raise_if_lost() does
                    report["stopped_work_on_a_lost_lease"] = True
                    break
                time.sleep(0.05)
                if deadline is None and watcher.healed_at is not None:
                    deadline = watcher.healed_at + work_seconds
            if watcher.healed_at is not None:
                report["worked_after_heal_s"] = round(time.monotonic() - watcher.healed_at, 3)
            started = time.monotonic()
            try:
                with queue.attempt(lease=lease) as attempt:
                    attempt.connection.execute(
                        sql.SQL("INSERT INTO {} (task_id, by) VALUES (%s, %s)").format(
                            sql.Identifier(schema, "effects")
                        ),
                        (lease.task_id, "the worker that rode the cut out"),
                    )
                report["ack"] = "ok"
            except LeaseQueueError as exc:
                report["ack"] = type(exc).__name__
            report["ack_seconds"] = round(time.monotonic() - started, 3)
            watcher.stopped.set()
            watcher.join()
            report |= watcher.report()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
