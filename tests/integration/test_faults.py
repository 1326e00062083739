"""Faults within one process: races at the lease boundary, concurrent sweepers, a server
crash and restart, a terminated connection, and a load of concurrent claimers."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest

from dagster_leasequeue import (
    DatabaseUnavailable,
    Lease,
    LeaseLost,
    LeaseQueue,
    LeaseQueueError,
    LeaseQueueSettings,
)

from ..helpers import expire, run_sql
from ..own_server import OwnServer

pytestmark = pytest.mark.slow


def race_renew_and_sweep(
    queue: LeaseQueue, lease: Lease, renew_delay: float
) -> tuple[bool, list[int]]:
    """Start a renew and a sweep at the same moment; return (renewed, swept task ids)."""
    start = threading.Barrier(2)
    renewed: list[bool] = []
    swept: list[int] = []

    def renew() -> None:
        start.wait()
        time.sleep(renew_delay)
        try:
            lease.renew(5)
            renewed.append(True)
        except LeaseLost:
            renewed.append(False)

    def sweep() -> None:
        start.wait()
        swept.extend(r.task_id for r in queue.sweep())

    threads = [threading.Thread(target=renew), threading.Thread(target=sweep)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return renewed == [True], swept


def test_renew_racing_the_sweeper_at_expiry_has_one_winner(
    make_queue,
    figures: dict[str, dict[str, object]],  # type: ignore[no-untyped-def]
) -> None:
    queue: LeaseQueue = make_queue(pool_size=6)
    queue.install()
    outcomes: Counter[str] = Counter()
    for trial in range(40):
        task_id = queue.enqueue({"trial": trial})
        lease = queue.claim(lease_seconds=0.2)
        assert lease is not None
        time.sleep(0.2 + random.uniform(0, 0.02))  # just past the expiry
        renewed, swept = race_renew_and_sweep(queue, lease, renew_delay=random.uniform(0, 0.004))
        status = queue.get(task_id).status
        if renewed:
            assert task_id not in swept and status == "processing"
            outcomes["renew won"] += 1
            lease.ack()
        else:
            assert swept == [task_id] and status == "enqueued"
            outcomes["sweep won"] += 1
            again = queue.claim()
            assert again is not None
            again.ack()
    assert sum(outcomes.values()) == 40
    figures["renew_vs_sweep"] = dict(outcomes)


def test_a_worker_whose_renewal_lost_stops(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    lease = queue.claim(lease_seconds=0.6)
    assert lease is not None
    steps = 0
    with pytest.raises(LeaseLost), lease:
        expire(queue, task_id)
        queue.sweep()
        for steps in range(1, 100):  # noqa: B007 - counted for the assertion below
            time.sleep(0.05)
            lease.raise_if_lost()
    assert steps < 20  # it stopped within a renewal period, not at the end of its work
    assert queue.get(task_id).status == "enqueued"


def test_four_sweepers_and_workers_recover_each_expiry_once(
    make_queue,
    chaos_long: bool,
    figures: dict[str, dict[str, object]],  # type: ignore[no-untyped-def]
) -> None:
    queue: LeaseQueue = make_queue(pool_size=12, sweep_batch_size=10)
    queue.install()
    tasks = 3000 if chaos_long else 400
    queue.enqueue_many([{"n": n} for n in range(tasks)], max_attempts=50)
    stop = threading.Event()
    abandoned: list[tuple[int, int]] = []
    lock = threading.Lock()

    def sweeper() -> int:
        sweeps = 0
        while not stop.is_set():
            queue.sweep()
            sweeps += 1
        return sweeps

    def worker() -> None:
        while (leases := queue.claim_many(random.randint(1, 5), lease_seconds=0.05)) or (
            queue.stats().counts["processing"] > 0
        ):
            for lease in leases:
                if random.random() < 0.3:
                    with lock:
                        abandoned.append((lease.task_id, lease.attempt))  # left to expire
                    continue
                try:
                    lease.ack()
                except LeaseLost:
                    with lock:
                        abandoned.append((lease.task_id, lease.attempt))
            if not leases:
                time.sleep(0.01)

    with ThreadPoolExecutor(8) as pool:
        sweepers = [pool.submit(sweeper) for _ in range(4)]
        workers = [pool.submit(worker) for _ in range(4)]
        for future in workers:
            future.result(timeout=300)
        stop.set()
        sweep_counts = [future.result(timeout=60) for future in sweepers]
    events = queue.recovery_events(limit=1_000_000)
    recovered = [(e.task_id, e.attempt) for e in events]
    assert len(recovered) == len(set(recovered)), "an expiry was recovered twice"
    assert sorted(recovered) == sorted(abandoned)
    assert queue.stats().counts["done"] == tasks
    figures["concurrent_sweepers"] = {
        "tasks": tasks,
        "sweeps": sum(sweep_counts),
        "expiries": len(abandoned),
        "recovered_twice": 0,
    }


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[OwnServer]:
    server = OwnServer(tmp_path)
    server.start()
    yield server
    with contextlib.suppress(Exception):
        server.stop()


def test_a_server_crash_loses_no_acknowledged_enqueue(
    own_server: OwnServer, chaos_long: bool, figures: dict[str, dict[str, object]]
) -> None:
    settings = LeaseQueueSettings(
        pool_size=6, connect_timeout=2, lease_seconds=2, schema_name="crash", _env_file=None
    )
    queue = LeaseQueue(own_server.dsn, settings=settings)
    queue.install()
    run_sql(queue, "CREATE TABLE {schema}.effects (task_id bigint)")
    acknowledged: list[int] = []
    done_after_restart: list[int] = []
    restarted = threading.Event()
    stop = threading.Event()
    errors: Counter[str] = Counter()
    unexpected: list[BaseException] = []

    def producer() -> None:
        n = 0
        while not stop.is_set():
            try:
                acknowledged.append(queue.enqueue({"n": n}))
                n += 1
            except LeaseQueueError as exc:
                errors[type(exc).__name__] += 1
                time.sleep(0.05)

    def worker() -> None:
        while not stop.is_set() or queue_has_work():
            try:
                lease = queue.claim()
                if lease is None:
                    time.sleep(0.02)
                    continue
                with lease, queue.attempt(lease=lease) as attempt:
                    attempt.connection.execute(
                        'INSERT INTO "crash".effects VALUES (%s)', (lease.task_id,)
                    )
                if restarted.is_set():
                    done_after_restart.append(lease.task_id)
            except (LeaseQueueError, psycopg.Error) as exc:
                # The effect's own statement meets the crash as a psycopg error.
                errors[type(exc).__name__] += 1
                time.sleep(0.05)
            except BaseException as exc:
                unexpected.append(exc)
                raise

    def queue_has_work() -> bool:
        try:
            counts = queue.stats().counts
            return counts["enqueued"] + counts["processing"] > 0
        except LeaseQueueError:
            return True

    def sweeper() -> None:
        while not stop.wait(0.5):
            with contextlib.suppress(LeaseQueueError):
                queue.sweep()

    threads = [threading.Thread(target=f) for f in (producer, worker, worker, sweeper)]
    for thread in threads:
        thread.start()
    crashes = 3 if chaos_long else 1
    for _ in range(crashes):
        time.sleep(1.5)
        own_server.crash()
        time.sleep(1.0)
        own_server.start()
        restarted.set()
    time.sleep(1.5)
    stop.set()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a thread is stuck after the restart"
    # The sweeper thread has stopped: recover what the crash left under lease, then finish.
    deadline = time.monotonic() + 60
    while queue_has_work() and time.monotonic() < deadline:
        queue.sweep()
        while (lease := queue.claim()) is not None:
            with lease, queue.attempt(lease=lease) as attempt:
                attempt.connection.execute(
                    'INSERT INTO "crash".effects VALUES (%s)', (lease.task_id,)
                )
        time.sleep(0.3)
    stored = {row[0] for row in run_sql(queue, "SELECT id FROM {schema}.tasks")}
    lost = [task_id for task_id in acknowledged if task_id not in stored]
    effects = Counter(row[0] for row in run_sql(queue, "SELECT task_id FROM {schema}.effects"))
    queue.close()
    figures["server_crash"] = {
        "crashes": crashes,
        "acknowledged_enqueues": len(acknowledged),
        "lost": len(lost),
        "errors_seen_during_outage": dict(errors),
        "tasks_done_after_restart": len(done_after_restart),
        "duplicated_effects": sum(c - 1 for c in effects.values()),
    }
    assert lost == []
    assert unexpected == [], "a worker thread died"
    assert done_after_restart, "the workers did not recover after the restart"
    assert set(effects.values()) == {1}
    assert sorted(effects) == sorted(stored)
    assert errors["DatabaseUnavailable"] > 0, "the crash went unnoticed"


def test_a_terminated_connection_is_not_success_and_the_pool_recovers(queue: LeaseQueue) -> None:
    run_sql(queue, "CREATE TABLE {schema}.effects (task_id bigint)")
    task_id = queue.enqueue({"n": 1})
    lease = queue.claim(lease_seconds=1)
    assert lease is not None
    with pytest.raises(DatabaseUnavailable), queue.attempt(lease=lease) as attempt:
        attempt.connection.execute(f'INSERT INTO "{queue.schema}".effects VALUES (%s)', (task_id,))
        run_sql(
            queue,
            "SELECT pg_terminate_backend(%(pid)s)",
            {"pid": attempt.connection.info.backend_pid},
        )
    assert run_sql(queue, "SELECT count(*) FROM {schema}.effects") == [(0,)]
    assert queue.get(task_id).status == "processing"
    time.sleep(1.1)
    assert [r.task_id for r in queue.sweep()] == [task_id]
    # The broken connection was discarded: the pool serves every call that follows.
    for _ in range(3 * queue.settings.pool_size):
        again = queue.claim()
        if again is not None:
            with again, queue.attempt(lease=again) as attempt:
                attempt.connection.execute(
                    f'INSERT INTO "{queue.schema}".effects VALUES (%s)', (again.task_id,)
                )
        queue.enqueue({"more": 1})
    effects = Counter(row[0] for row in run_sql(queue, "SELECT task_id FROM {schema}.effects"))
    assert effects[task_id] == 1 and set(effects.values()) == {1}
    assert queue.get(task_id).status == "done"


def test_sixteen_concurrent_claimers(
    make_queue,
    chaos_long: bool,
    figures: dict[str, dict[str, object]],  # type: ignore[no-untyped-def]
) -> None:
    queue: LeaseQueue = make_queue(pool_size=16)
    queue.install()
    tasks = 20000 if chaos_long else 4000
    ids = queue.enqueue_many([{"n": n} for n in range(tasks)])
    seen: list[int] = []
    violations: list[tuple[int, int]] = []
    lock = threading.Lock()
    deadline = time.monotonic() + (120 if chaos_long else 40)
    start = threading.Barrier(16)

    def claimer(index: int) -> int:
        start.wait()
        claims = 0
        while time.monotonic() < deadline:
            limit = random.randint(1, 25)
            leases = queue.claim_many(limit)
            if not leases:
                return claims
            claims += 1
            if len(leases) > limit:
                with lock:
                    violations.append((limit, len(leases)))
            with lock:
                seen.extend(lease.task_id for lease in leases)
            if index % 2:
                queue.ack_many(leases)
            else:
                for lease in leases:
                    lease.ack()
        return claims

    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        claims = sum(pool.map(claimer, range(16)))
    elapsed = time.monotonic() - started
    assert violations == []
    assert len(seen) == len(set(seen)) == tasks
    assert sorted(seen) == ids
    figures["sixteen_claimers"] = {
        "tasks": tasks,
        "claim_statements": claims,
        "seconds": round(elapsed, 2),
        "limit_violations": 0,
        "double_claims": 0,
    }
