"""Workers on another host: a network cut mid-task, tested with a real network namespace.

The worker runs in a namespace of the test's own and reaches PostgreSQL through a
forwarder on this host's end of a veth pair; the test takes that end down. Packets are
then dropped silently, so only the connections' TCP timeouts bound the worker's calls.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dagster_leasequeue import LeaseQueue

from ..helpers import run_sql
from ..netns import NetnsHost, missing

REPO = Path(__file__).resolve().parents[2]
LEASE_SECONDS = 4.0
CONNECT_TIMEOUT = 2.0


@pytest.fixture
def far_host(dsn: str) -> Iterator[NetnsHost]:
    reason = missing()
    if reason:
        pytest.skip(reason)
    host = NetnsHost(0, dsn)
    host.start()
    try:
        yield host
    finally:
        host.stop()


def _wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"timed out waiting for {path.name}"
        time.sleep(0.05)


def test_a_worker_cut_off_mid_task_stops_in_time_and_its_task_is_done_once(
    far_host: NetnsHost, queue: LeaseQueue, tmp_path: Path, figures: dict[str, dict[str, object]]
) -> None:
    run_sql(queue, "CREATE TABLE {schema}.effects (task_id bigint, by text)")
    task_id = queue.enqueue({"doc": "far.pdf"})
    worker = subprocess.Popen(
        far_host.command(
            sys.executable,
            "-m",
            "tests.netns_worker",
            far_host.dsn(),
            queue.schema,
            str(LEASE_SECONDS),
            str(tmp_path),
        ),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(tmp_path / "claimed")
        far_host.cut()
        (tmp_path / "cut").write_text("")
        # A connected worker: once the lease has passed, the sweeper recovers the task and
        # this worker does it, its effect and ack in one attempt.
        deadline = time.monotonic() + LEASE_SECONDS + 10
        while not queue.sweep():
            assert time.monotonic() < deadline, "the lease was never swept"
            time.sleep(0.2)
        lease = queue.claim()
        assert lease is not None and lease.task_id == task_id
        with lease, queue.attempt(lease=lease) as attempt:
            attempt.connection.execute(
                f'INSERT INTO "{queue.schema}".effects VALUES (%s, %s)', (task_id, "survivor")
            )
        # The link stays down until the cut-off worker's calls on it have ended.
        bound = LEASE_SECONDS + CONNECT_TIMEOUT + 5
        _wait_for(tmp_path / "calls_done", timeout=LEASE_SECONDS + 2 * bound)
        far_host.heal()
        (tmp_path / "healed").write_text("")
        out, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    figures["partition_cut_mid_task"] = report
    # It knew its lease lost no later than the lease's end.
    assert report["lost_after_cut"] <= LEASE_SECONDS
    # Its calls on the dead path returned (raised) within the bound.
    for call in ("ack_while_cut", "renew_while_cut"):
        assert report[call]["outcome"] in ("DatabaseUnavailable", "LeaseLost"), report
        assert report[call]["seconds"] <= bound, report
    # After the link came back, its write was refused.
    assert report["ack_after_heal"]["outcome"] == "LeaseLost", report
    assert run_sql(queue, "SELECT by FROM {schema}.effects") == [("survivor",)]
    assert queue.get(task_id).status == "done"
