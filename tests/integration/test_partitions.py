"""Workers on other hosts: network cuts and a bad network, tested with network namespaces.

Each worker runs in a namespace of the test's own and reaches PostgreSQL through a
forwarder on this host's end of a veth pair; the test takes that end down. Packets are
then dropped silently, so only the connections' TCP timeouts bound the worker's calls.
The scenarios (issue 14):

1. a cut mid-task, longer than the lease: the worker learns its lease is lost in time,
   its task is done once by another;
2. a cut shorter than a third of the lease: the worker keeps its lease and acks;
3. a drain by `leasequeue worker` processes over lossy, slow links, cut five times.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dagster_leasequeue import LeaseQueue, LeaseQueueError

from ..helpers import run_sql
from ..netns import Impairment, NetnsHost, missing

pytestmark = pytest.mark.skipif(missing() is not None, reason=f"no network namespaces: {missing()}")

REPO = Path(__file__).resolve().parents[2]
LEASE_SECONDS = 4.0
CONNECT_TIMEOUT = 2.0
SWEEP_INTERVAL = 0.5


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


def _wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


class Sweeper(threading.Thread):
    """Sweeps from this host every SWEEP_INTERVAL seconds, as the sensor or a cron would."""

    def __init__(self, queue: LeaseQueue) -> None:
        super().__init__(daemon=True)
        self.queue = queue
        self.stopped = threading.Event()
        self.errors = 0

    def run(self) -> None:
        while not self.stopped.wait(SWEEP_INTERVAL):
            try:
                self.queue.sweep()
            except LeaseQueueError:
                self.errors += 1

    def stop(self) -> None:
        self.stopped.set()
        self.join()


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


# -- 2. a cut shorter than a third of the lease --------------------------------------------

SHORT_CUT_LEASE = 6.0  # renewed every 2 s; the network timeout is the lease's 6 s
SHORT_CUT = 1.5


def _lease_expiry(queue: LeaseQueue, task_id: int) -> Any:
    rows = run_sql(
        queue, "SELECT lease_expires_at FROM {schema}.tasks WHERE id = %(id)s", {"id": task_id}
    )
    return rows[0][0]


@pytest.mark.slow
def test_a_cut_shorter_than_a_third_of_the_lease_costs_the_worker_nothing(
    far_host: NetnsHost, queue: LeaseQueue, tmp_path: Path, figures: dict[str, dict[str, object]]
) -> None:
    run_sql(queue, "CREATE TABLE {schema}.effects (task_id bigint, by text)")
    task_id = queue.enqueue({"doc": "near.pdf"})
    worker = subprocess.Popen(
        far_host.command(
            sys.executable,
            "-m",
            "tests.netns_holder",
            far_host.dsn(),
            queue.schema,
            str(SHORT_CUT_LEASE),
            str(SHORT_CUT_LEASE + 1),  # work on for more than a lease after the heal
            str(tmp_path),
        ),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sweeper = Sweeper(queue)
    sweeper.start()
    try:
        _wait_for(tmp_path / "claimed")
        # Cut so that a renewal falls inside the cut: the renewer waits a third of the lease
        # after each renewal, so the next one goes out 2 s after the last one landed.
        claimed_expiry = _lease_expiry(queue, task_id)
        _wait_until(lambda: _lease_expiry(queue, task_id) != claimed_expiry, 10, "a first renewal")
        time.sleep(SHORT_CUT_LEASE / 3 - 1.0)
        far_host.cut()
        (tmp_path / "cut").write_text("")
        time.sleep(SHORT_CUT)
        far_host.heal()
        (tmp_path / "healed").write_text("")
        out, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        sweeper.stop()
    assert worker.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    # Whether the cut held a renewal up (it should, unless this machine was too slow to
    # time the cut): the gap across the cut is then longer than the renewal interval.
    held_up = report.get("longest_gap_between_renewals_s", 0) > SHORT_CUT_LEASE / 3 + 0.25
    figures["partition_short_cut"] = {
        "lease_s": SHORT_CUT_LEASE,
        **report,
        "a_renewal_was_held_up_by_the_cut": held_up,
    }
    # The worker never thought its lease lost, worked on past a whole lease after the heal,
    # and its ack went through.
    assert report["ever_lost"] is False, report
    assert report["ack"] == "ok", report
    assert report["worked_after_heal_s"] > SHORT_CUT_LEASE, report
    # The renewal the cut held up got through once the link was back, with the lease to spare.
    assert report["renewals_during_cut"] == 0, report
    assert report["first_renewal_after_heal_s"] is not None, report
    assert report["longest_gap_between_renewals_s"] < SHORT_CUT_LEASE, report
    # The database agrees: done on the first attempt, never recovered, one effect.
    info = queue.get(task_id)
    assert (info.status, info.attempts) == ("done", 1)
    assert [e for e in queue.recovery_events() if e.task_id == task_id] == []
    assert run_sql(queue, "SELECT task_id, by FROM {schema}.effects") == [
        (task_id, "the worker that rode the cut out")
    ]


# -- 3. a chaos drain over lossy, slow links, cut five times -------------------------------

CHAOS_LEASE = 4.0  # the workers' lease, and so their network timeout
CHAOS_LINK = Impairment(loss=0.2, delay=0.1)  # netem loss 20% delay 100ms on the host's end
CHAOS_CUTS = 5
# (tasks, shortest cut, longest cut): the form under --chaos-long; by default fewer
# tasks and shorter cuts, so that the module stays within its time (about 3.5 tasks/s here).
CHAOS_LONG = (2000, 3.0, 10.0)
CHAOS_SHORT = (150, 2.0, 4.0)
HANDLER = "tests.cli_handlers:effect_through_attempt"


@pytest.fixture
def bad_hosts(dsn: str, tmp_path: Path) -> Iterator[list[NetnsHost]]:
    hosts: list[NetnsHost] = []
    try:
        for index in (1, 2):
            host = NetnsHost(index, dsn, CHAOS_LINK, tmp_path / f"forwarder-{index}.log")
            hosts.append(host)
            host.start()
        yield hosts
    finally:
        for host in hosts:
            host.stop()


def _start_cli_worker(host: NetnsHost, schema: str, log: Path) -> subprocess.Popen[bytes]:
    """`leasequeue worker` in the namespace, configured as in production: by variables."""
    env = {
        **os.environ,
        "LEASEQUEUE_DSN": host.dsn(),
        "LEASEQUEUE_SCHEMA_NAME": schema,
        "LEASEQUEUE_LEASE_SECONDS": str(CHAOS_LEASE),
        "LEASEQUEUE_CONNECT_TIMEOUT": "2",
        "LEASEQUEUE_POOL_SIZE": "2",  # the server may be shared: few connections each
    }
    command = [sys.executable, "-m", "dagster_leasequeue.cli", "worker"]
    command += [HANDLER, "--poll-interval", "0.2"]
    with log.open("ab") as output:
        return subprocess.Popen(
            host.command(*command), cwd=REPO, env=env, stdout=output, stderr=output
        )


def _start_cli_workers(
    hosts: list[NetnsHost], schema: str, logs: list[Path]
) -> tuple[list[subprocess.Popen[bytes]], int]:
    """Two workers per host, each started again, as a supervisor would, if it exits before
    it runs: `leasequeue worker` gives up when its first connection is not made within the
    connect timeout, which on these links happens now and then. Returns the workers, all
    running, and how many starts failed."""
    workers = [_start_cli_worker(hosts[i // 2], schema, log) for i, log in enumerate(logs)]
    failed_starts = 0
    deadline = time.monotonic() + 120
    try:
        while not all(f" runs {HANDLER}" in log.read_text() for log in logs):
            for index, worker in enumerate(workers):
                if worker.poll() is not None and f" runs {HANDLER}" not in logs[index].read_text():
                    failed_starts += 1
                    assert failed_starts <= 20, logs[index].read_text()[-3000:]
                    workers[index] = _start_cli_worker(hosts[index // 2], schema, logs[index])
            assert time.monotonic() < deadline, "the workers never all started"
            time.sleep(0.1)
    except BaseException:
        for worker in workers:
            worker.kill()
            worker.wait()
        raise
    return workers, failed_starts


def _attempts_logged(log: Path) -> list[dict[str, Any]]:
    """The ATTEMPT records tests.cli_handlers:effect_through_attempt wrote to a worker's log
    (for the figures only: a line another thread's output broke into is left out)."""
    records = []
    for line in log.read_text().splitlines():
        if line.startswith("ATTEMPT "):
            with contextlib.suppress(ValueError):
                records.append(json.loads(line.split(" ", 1)[1]))
    return records


def _finished(queue: LeaseQueue) -> int:
    counts = queue.stats().counts
    return counts["done"] + counts["dead"] + counts["cancelled"]


def _cut_while_draining(
    queue: LeaseQueue, hosts: list[NetnsHost], tasks: int, shortest: float, longest: float
) -> list[dict[str, Any]]:
    """Cut CHAOS_CUTS times, spread over the drain by its progress: the k-th cut once
    k/(CHAOS_CUTS + 1) of the tasks are finished. The cuts take turns on the two hosts; the
    middle one cuts both at once. Returns when the last cut has healed."""
    cuts = []
    for k in range(1, CHAOS_CUTS + 1):
        _wait_until(
            lambda k=k: _finished(queue) >= tasks * k / (CHAOS_CUTS + 1),
            900,
            f"{k}/{CHAOS_CUTS + 1} of the tasks to finish",
        )
        victims = hosts if k == (CHAOS_CUTS + 1) // 2 else [hosts[k % 2]]
        seconds = random.uniform(shortest, longest)
        cut_at = time.time()
        for host in victims:
            host.cut()
        time.sleep(seconds)
        for host in victims:
            host.heal()
        healed = time.time()
        left = tasks - _finished(queue)
        cuts.append(
            {"hosts": [hosts.index(h) for h in victims], "at": cut_at, "healed": healed}
            | {"tasks_left": left}
        )
    return cuts


def _call_figures(logged: list[list[dict[str, Any]]], cuts: list[dict[str, Any]]) -> dict[str, Any]:
    """How long the workers' calls took, and how soon each cut host worked again."""
    calls = [call for per_worker in logged for call in per_worker]

    def after_a_cut(call: dict[str, Any]) -> bool:
        # Under way during a cut, or begun within a lease after its heal.
        began = call["started"] - call["claim_s"]
        return any(
            began < cut["healed"] + CHAOS_LEASE and call["ended"] > cut["at"] for cut in cuts
        )

    near_cuts = [call for call in calls if after_a_cut(call)]
    resumed = []
    for cut in cuts:
        for host in cut["hosts"]:
            written = [
                call["ended"]
                for worker, per_worker in enumerate(logged)
                if worker // 2 == host
                for call in per_worker
                if call["outcome"] == "written" and call["ended"] > cut["healed"]
            ]
            if written:
                resumed.append(min(written) - cut["healed"])

    def longest(values: list[float]) -> float:
        return round(max(values, default=0.0), 3)

    return {
        "attempts_raised": sum(c["outcome"] not in ("written", "duplicate") for c in calls),
        "longest_claim_s": longest([c["claim_s"] for c in calls]),
        "longest_attempt_s": longest([c["ended"] - c["started"] for c in calls]),
        "longest_claim_after_a_cut_s": longest([c["claim_s"] for c in near_cuts]),
        "longest_attempt_after_a_cut_s": longest([c["ended"] - c["started"] for c in near_cuts]),
        "longest_resume_after_heal_s": longest(resumed),
    }


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_drain_over_lossy_slow_links_cut_five_times_loses_and_repeats_nothing(
    bad_hosts: list[NetnsHost],
    make_queue: Callable[..., LeaseQueue],
    tmp_path: Path,
    chaos_long: bool,
    figures: dict[str, dict[str, object]],
) -> None:
    tasks, shortest_cut, longest_cut = CHAOS_LONG if chaos_long else CHAOS_SHORT
    queue = make_queue(pool_size=4)
    queue.install()
    # No unique constraint: a duplicated effect must show up as a second row.
    run_sql(queue, "CREATE TABLE {schema}.effects (task_id bigint NOT NULL, pid int NOT NULL)")
    # Cuts are not the tasks' fault: enough attempts that none dies of them.
    ids = queue.enqueue_many([{"n": n} for n in range(tasks)], max_attempts=1000)
    logs = [tmp_path / f"worker-{h}-{w}.log" for h in range(len(bad_hosts)) for w in range(2)]
    started = time.time()
    workers, failed_starts = _start_cli_workers(bad_hosts, queue.schema, logs)
    sweeper = Sweeper(queue)
    sweeper.start()
    try:
        cuts = _cut_while_draining(queue, bad_hosts, tasks, shortest_cut, longest_cut)
        _wait_until(lambda: _finished(queue) == tasks, 1200, "every task to finish")
        drained = time.time() - started
        survived = [worker.poll() is None for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
        for worker in workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        sweeper.stop()

    counts = queue.stats().counts
    rows = run_sql(queue, "SELECT task_id, count(*) FROM {schema}.effects GROUP BY 1")
    effects = {int(task_id): int(count) for task_id, count in rows}
    texts = [log.read_text() for log in logs]
    ((claims,),) = run_sql(queue, "SELECT sum(attempts) FROM {schema}.tasks")
    figures["partition_chaos"] = {
        "tasks": tasks,
        "workers": len(workers),
        "hosts": len(bad_hosts),
        "link": {
            "loss": CHAOS_LINK.loss,
            "delay_s": CHAOS_LINK.delay,
            "both_ways": CHAOS_LINK.both_ways,
            "made_by": bad_hosts[0].impaired_by,
        },
        "lease_s": CHAOS_LEASE,
        "sweep_interval_s": SWEEP_INTERVAL,
        "cuts_s": [round(cut["healed"] - cut["at"], 2) for cut in cuts],
        "cut_hosts": [cut["hosts"] for cut in cuts],
        "tasks_left_after_cuts": [cut["tasks_left"] for cut in cuts],
        "drain_s": round(drained, 2),
        "throughput_tasks_per_s": round(tasks / drained, 2),
        "claims": int(claims),
        "recoveries": len(queue.recovery_events(limit=100_000)),
        "packets_dropped": sum(host.packets_dropped() for host in bad_hosts),
        "worker_starts_failed": failed_starts,
        "cannot_claim_logged": sum(text.count("cannot claim") for text in texts),
        **_call_figures([_attempts_logged(log) for log in logs], cuts),
        "sweeper_errors": sweeper.errors,
    }
    # Once running, the workers rode everything out, and stopped cleanly when asked.
    tails = [text[-3000:] for text in texts]
    assert all(survived), [tail for tail, alive in zip(tails, survived, strict=True) if not alive]
    assert [worker.returncode for worker in workers] == [0] * len(workers), tails
    # Every cut came while there was work left.
    assert len(cuts) == CHAOS_CUTS and all(cut["tasks_left"] > 0 for cut in cuts), cuts
    # Nothing lost, nothing dead, nothing done twice.
    assert counts == {"enqueued": 0, "processing": 0, "done": tasks, "dead": 0, "cancelled": 0}
    assert sorted(effects) == ids, "a task finished without its effect"
    assert set(effects.values()) == {1}, "an effect was written twice"
