"""A worker run inside a network namespace by the partition tests.

It claims one task and holds it under ``with lease:`` (renewing in the background), then
waits for the test's files: ``cut`` (the link is down), ``healed`` (it is back); it writes
``claimed`` once it holds the task and ``calls_done`` once its calls on the cut link ended. It
records, as JSON on stdout, when its lease was known lost and how long each call took.

    python -m tests.netns_worker DSN SCHEMA LEASE_SECONDS FOLDER
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from dagster_leasequeue import LeaseQueue, LeaseQueueError, LeaseQueueSettings


def _timed(call: Any) -> dict[str, Any]:
    started = time.monotonic()
    try:
        call()
        outcome = "ok"
    except LeaseQueueError as exc:
        outcome = type(exc).__name__
    return {"outcome": outcome, "seconds": round(time.monotonic() - started, 3)}


def _wait_for(path: Path) -> float:
    while not path.exists():
        time.sleep(0.02)
    return time.monotonic()


def main() -> None:
    dsn, schema, lease_text, folder_text = sys.argv[1:5]
    folder = Path(folder_text)
    lease_seconds = float(lease_text)
    settings = LeaseQueueSettings(lease_seconds=lease_seconds, connect_timeout=2, _env_file=None)
    report: dict[str, Any] = {}
    with LeaseQueue(dsn, schema=schema, settings=settings) as queue:
        lease = queue.claim()
        assert lease is not None
        with contextlib.suppress(LeaseQueueError), lease:
            (folder / "claimed").write_text(str(lease.task_id))
            cut_at = _wait_for(folder / "cut")
            while not lease.lost:
                time.sleep(0.02)
            report["lost_after_cut"] = round(time.monotonic() - cut_at, 3)
            report["ack_while_cut"] = _timed(lambda: lease.ack({"by": "the cut-off worker"}))
            report["renew_while_cut"] = _timed(lease.renew)
            (folder / "calls_done").write_text("")
            _wait_for(folder / "healed")
            report["ack_after_heal"] = _timed(lambda: lease.ack({"by": "the cut-off worker"}))
            print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
