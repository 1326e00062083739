"""Fault injection with real processes: SIGKILL chaos, a paused zombie, a poison task."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dagster_leasequeue import LeaseQueue

from ..helpers import run_sql

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SWEEP_INTERVAL = 0.5
SLACK = 1.5  # process scheduling on a loaded 2-core machine


def start_worker(dsn: str, queue: LeaseQueue, mode: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.chaos_worker",
            mode,
            "--dsn",
            dsn,
            "--schema",
            queue.schema,
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def create_effects(queue: LeaseQueue) -> None:
    # No unique constraint: a duplicated effect must show up as a second row.
    run_sql(queue, "CREATE TABLE {schema}.effects (task_id bigint NOT NULL, pid int NOT NULL)")


def effects_per_task(queue: LeaseQueue) -> dict[int, int]:
    rows = run_sql(queue, "SELECT task_id, count(*) FROM {schema}.effects GROUP BY 1")
    return {int(task_id): int(count) for task_id, count in rows}


def finished(queue: LeaseQueue) -> int:
    counts = queue.stats().counts
    return counts["done"] + counts["dead"] + counts["cancelled"]


def holding_a_lease(
    queue: LeaseQueue, pool: list[subprocess.Popen[str]]
) -> list[subprocess.Popen[str]]:
    """The workers that hold a task right now: killing one of them leaves a lease to recover."""
    rows = run_sql(queue, "SELECT worker_id FROM {schema}.tasks WHERE status = 'processing'")
    holders = {str(worker_id).rsplit(":", 1)[-1] for (worker_id,) in rows}
    return [worker for worker in pool if str(worker.pid) in holders]


def kill_one(
    dsn: str, queue: LeaseQueue, pool: list[subprocess.Popen[str]], mode: str, work: tuple[str, ...]
) -> tuple[int, float]:
    """SIGKILL a worker (one that holds a lease, if any) and start another in its place;
    return the victim's pid and when it was killed."""
    victim = random.choice(holding_a_lease(queue, pool) or pool)
    victim.send_signal(signal.SIGKILL)
    killed_at = time.time()
    victim.wait()
    pool[pool.index(victim)] = start_worker(dsn, queue, mode, *work)
    return victim.pid, killed_at


def stop(pool: list[subprocess.Popen[str]], sweeper: Sweeper) -> None:
    for worker in pool:
        worker.kill()
        worker.wait()
    sweeper.stop()


class Sweeper(threading.Thread):
    """Sweeps every SWEEP_INTERVAL seconds until stopped, as the sensor or a cron would."""

    def __init__(self, queue: LeaseQueue) -> None:
        super().__init__(daemon=True)
        self.queue = queue
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(SWEEP_INTERVAL):
            self.queue.sweep()

    def stop(self) -> None:
        self.stopped.set()
        self.join()


def wait_until(check, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_sigkill_chaos_loses_nothing_and_writes_each_effect_once(
    dsn: str,
    make_queue,
    chaos_long: bool,
    figures: dict[str, dict[str, object]],  # type: ignore[no-untyped-def]
) -> None:
    # Enough work (about 80 ms a task) that the queue outlasts the kills: every kill then
    # hits a worker mid-task.
    tasks, kills_wanted, workers = (4000, 150, 4) if chaos_long else (600, 20, 3)
    lease = 1.0
    work = ("--lease", str(lease), "--work-min", "0.05", "--work-max", "0.11")
    queue: LeaseQueue = make_queue(pool_size=4)
    queue.install()
    create_effects(queue)
    # A task may be hit by several kills: it must come back each time, not die.
    ids = queue.enqueue_many([{"n": n} for n in range(tasks)], max_attempts=1000)
    pool = [start_worker(dsn, queue, "drain", *work) for _ in range(workers)]
    kill_times: dict[int, float] = {}
    sweeper = Sweeper(queue)
    sweeper.start()
    try:
        while len(kill_times) < kills_wanted:
            time.sleep(random.uniform(0.2, 0.6))
            pid, killed_at = kill_one(dsn, queue, pool, "drain", work)
            kill_times[pid] = killed_at
        wait_until(lambda: finished(queue) == tasks, 600, "every task to finish")
    finally:
        stop(pool, sweeper)

    counts = queue.stats().counts
    assert counts == {"enqueued": 0, "processing": 0, "done": tasks, "dead": 0, "cancelled": 0}
    effects = effects_per_task(queue)
    assert sorted(effects) == ids, "a task finished without its effect"
    assert set(effects.values()) == {1}, "an effect was written twice"
    events = queue.recovery_events(limit=100_000)
    recovery_times = []
    for event in events:
        pid = int(str(event.worker_id).rsplit(":", 1)[1])
        if pid in kill_times:
            recovery_times.append(event.recovered_at.timestamp() - kill_times[pid])
    worst_overdue = max((e.seconds_overdue for e in events), default=0.0)
    bound = lease + SWEEP_INTERVAL + SLACK
    figures["sigkill_chaos"] = {
        "tasks": tasks,
        "workers": workers,
        "kills": len(kill_times),
        "recoveries": len(events),
        "lost": tasks - counts["done"],
        "duplicated_effects": sum(c - 1 for c in effects.values()),
        "worst_recovery_after_kill_s": round(max(recovery_times, default=0.0), 3),
        "worst_overdue_s": round(worst_overdue, 3),
        "bound_s": bound,
    }
    assert len(kill_times) >= kills_wanted
    assert events, "killing workers mid-task should have left leases to recover"
    assert max(recovery_times) <= bound
    assert worst_overdue <= SWEEP_INTERVAL + SLACK


def test_sigkill_chaos_through_the_worker_loop_loses_nothing(
    dsn: str,
    make_queue,
    chaos_long: bool,  # type: ignore[no-untyped-def]
) -> None:
    # run_worker acks each task in the statement that claims the next: a kill between
    # those statements leaves the next task leased to a dead worker, for the sweeper.
    tasks, kills_wanted, workers = (2000, 60, 4) if chaos_long else (300, 10, 3)
    work = ("--lease", "1.0", "--work-min", "0.02", "--work-max", "0.06")
    queue: LeaseQueue = make_queue(pool_size=4)
    queue.install()
    create_effects(queue)
    ids = queue.enqueue_many([{"n": n} for n in range(tasks)], max_attempts=1000)
    pool = [start_worker(dsn, queue, "loop", *work) for _ in range(workers)]
    sweeper = Sweeper(queue)
    sweeper.start()
    kills = 0
    try:
        while kills < kills_wanted and finished(queue) < tasks:
            time.sleep(random.uniform(0.1, 0.3))
            # Only a worker that holds a lease: on a slow machine a worker takes over a
            # second to start, and killing only starting ones would leave nothing to sweep.
            if holding_a_lease(queue, pool):
                kill_one(dsn, queue, pool, "loop", work)
                kills += 1
        wait_until(lambda: finished(queue) == tasks, 300, "every task to finish")
    finally:
        stop(pool, sweeper)
    counts = queue.stats().counts
    assert counts == {"enqueued": 0, "processing": 0, "done": tasks, "dead": 0, "cancelled": 0}
    assert sorted(effects_per_task(queue)) == ids, "a task finished without its effect"
    assert kills >= min(kills_wanted, 3)
    assert queue.recovery_events(limit=100_000), "kills should have left leases to recover"


def test_a_paused_zombie_is_refused_everything(
    dsn: str, queue: LeaseQueue, figures: dict[str, dict[str, object]]
) -> None:
    create_effects(queue)
    task_id = queue.enqueue({"document": "contract.pdf"})
    zombie = start_worker(dsn, queue, "zombie", "--lease", "1", "--hold", "1")
    try:
        assert zombie.stdout is not None
        assert zombie.stdout.readline().strip() == f"HOLDING {task_id}"
        zombie.send_signal(signal.SIGSTOP)
        wait_until(lambda: queue.sweep() != [], 30, "the zombie's lease to expire")
        replacement = queue.claim()
        assert replacement is not None and replacement.task_id == task_id
        with replacement, queue.attempt(lease=replacement) as attempt:
            attempt.connection.execute(
                f'INSERT INTO "{queue.schema}".effects VALUES (%s, %s)', (task_id, os.getpid())
            )
        zombie.send_signal(signal.SIGCONT)
        refused = json.loads(zombie.stdout.readline())
        zombie.wait(30)
    finally:
        zombie.kill()
        zombie.wait()
    assert refused == {"attempt": "LeaseLost", "renew": "LeaseLost", "ack": "LeaseLost"}
    assert run_sql(queue, "SELECT pid FROM {schema}.effects") == [(os.getpid(),)]
    assert queue.get(task_id).status == "done"
    figures["zombie"] = {"zombie_writes_refused": 3, "zombie_effects_kept": 0}


def test_a_poison_task_dies_after_max_attempts_and_the_rest_flows(
    dsn: str,
    make_queue,
    figures: dict[str, dict[str, object]],  # type: ignore[no-untyped-def]
) -> None:
    queue: LeaseQueue = make_queue(pool_size=3)
    queue.install()
    create_effects(queue)
    poison = queue.enqueue({"poison": True}, max_attempts=3)
    normal = queue.enqueue_many([{"n": n} for n in range(40)])
    pool = [start_worker(dsn, queue, "drain", "--lease", "0.6") for _ in range(2)]
    sweeper = Sweeper(queue)
    sweeper.start()
    crashes = 0
    try:

        def settled() -> bool:
            nonlocal crashes
            for index, worker in enumerate(pool):
                if (
                    worker.poll() is not None
                ):  # the poison killed it: restart, as a supervisor would
                    crashes += 1
                    pool[index] = start_worker(dsn, queue, "drain", "--lease", "0.6")
            counts = queue.stats().counts
            return counts["done"] == len(normal) and counts["dead"] == 1

        wait_until(settled, 120, "the poison task to die and the others to finish")
    finally:
        for worker in pool:
            worker.kill()
            worker.wait()
        sweeper.stop()
    info = queue.get(poison)
    assert info.status == "dead" and info.attempts == 3
    actions = [e.action for e in queue.recovery_events() if e.task_id == poison]
    assert actions == ["requeued", "requeued", "dead"]
    assert crashes == 3
    assert sorted(effects_per_task(queue)) == normal
    figures["poison"] = {"claims_before_dead": info.attempts, "worker_crashes": crashes}
