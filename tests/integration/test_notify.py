"""The LISTEN connection: it wakes waiters at once, ignores stale notifications, and a
process that stopped waiting stops listening, so it cannot clog the server's NOTIFY queue."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable

import psycopg
import pytest

from dagster_leasequeue import LeaseQueue, notify, sql
from dagster_leasequeue.lease import Lease

# Enqueues one by one, each its own transaction and so its own notification.
_ENQUEUER = """
import sys
from dagster_leasequeue import LeaseQueue, LeaseQueueSettings
dsn, schema, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
with LeaseQueue(dsn, schema=schema, settings=LeaseQueueSettings(_env_file=None)) as queue:
    for n in range(count):
        queue.enqueue({"n": n})
"""


def _listening_backends(dsn: str, schema: str) -> list[tuple[int, str | None]]:
    """Backends whose last statement was this schema's LISTEN, with what they wait on."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid, wait_event FROM pg_stat_activity WHERE query = %s",
            (sql.listen_statement(schema),),
        ).fetchall()
    return [(int(pid), event) for pid, event in rows]


def _queue_usage(dsn: str) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_notification_queue_usage()").fetchone()
    assert row is not None
    return float(row[0])


def _claim_after_enqueue(
    waiter: LeaseQueue, enqueuer: LeaseQueue, queue_name: str, *, waiters: int = 1
) -> tuple[list[Lease | None], float]:
    """``waiters`` threads claim with a long wait; 0.3 s later one enqueue_many adds one
    task for each (one notification in all). Return the leases and the time from the
    enqueue to the last claim's return."""
    results: list[Lease | None] = []
    returned: list[float] = []
    lock = threading.Lock()

    def claim() -> None:
        lease = waiter.claim(queue=queue_name, wait=5)
        with lock:
            results.append(lease)
            returned.append(time.monotonic())

    threads = [threading.Thread(target=claim) for _ in range(waiters)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    enqueued = time.monotonic()
    enqueuer.enqueue_many([{"n": n} for n in range(waiters)], queue=queue_name)
    for thread in threads:
        thread.join(10)
    assert len(returned) == waiters
    return results, max(returned) - enqueued


@pytest.mark.slow
def test_a_process_that_stopped_waiting_stops_listening(
    dsn: str,
    schema_name: str,
    make_queue: Callable[..., LeaseQueue],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # raising=False: against a Listener without the idle timeout the test fails on its
    # assertions, not on the patch.
    monkeypatch.setattr(notify, "IDLE_SECONDS", 1.0, raising=False)
    queue = make_queue()
    queue.install()
    baseline = _queue_usage(dsn)

    assert queue.claim(wait=0.1) is None  # waits once, then never again
    assert len(_listening_backends(dsn, schema_name)) == 1

    # Many notifications, none read by this process: its listening backend, if it stayed,
    # would fill its socket, block ("ClientWrite") and hold back the server's queue.
    subprocess.run(
        [sys.executable, "-c", _ENQUEUER, dsn, schema_name, "20000"], check=True, timeout=240
    )

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        backends = _listening_backends(dsn, schema_name)
        usage = _queue_usage(dsn)
        if not backends and usage <= baseline:
            break
        time.sleep(0.1)
    assert backends == [], f"the listener still listens ({backends}) long after its last wait"
    assert usage <= baseline, f"notification queue usage {usage} stays above {baseline}"

    # Listening starts again with the next wait, and an enqueue still wakes it at once,
    # well before the one-second poll would find the task.
    (lease,), latency = _claim_after_enqueue(queue, make_queue(), "after-idle")
    assert lease is not None
    assert latency < 0.5, f"the claim returned {latency:.2f} s after the enqueue"


def test_a_stale_notification_does_not_wake_a_wait(
    dsn: str, schema_name: str, queue: LeaseQueue
) -> None:
    # Count the claim statements (UPDATEs of tasks) with a statement-level trigger.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{schema_name}".updates_seen (n int)')
        conn.execute(
            f'CREATE FUNCTION "{schema_name}".count_update() RETURNS trigger LANGUAGE plpgsql'
            f' AS $$ BEGIN INSERT INTO "{schema_name}".updates_seen VALUES (1); RETURN NULL;'
            " END $$"
        )
        conn.execute(
            f'CREATE TRIGGER count_updates AFTER UPDATE ON "{schema_name}".tasks'
            f' FOR EACH STATEMENT EXECUTE FUNCTION "{schema_name}".count_update()'
        )

    def updates() -> int:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(f'SELECT count(*) FROM "{schema_name}".updates_seen').fetchone()
        assert row is not None
        return int(row[0])

    assert queue.claim(wait=0.1) is None  # now listening
    # A task comes and goes without a wait: its notification stays unread on the listener.
    queue.enqueue({"n": 1})
    lease = queue.claim()
    assert lease is not None
    lease.ack()
    time.sleep(0.2)  # let the notification reach the listener's socket

    before = updates()
    started = time.monotonic()
    assert queue.claim(wait=0.5) is None
    elapsed = time.monotonic() - started
    claims = updates() - before

    assert elapsed >= 0.45, f"the wait returned after {elapsed:.2f} s"
    # One claim before the wait and one when it ends; a stale wake adds a useless one.
    assert claims == 2, f"{claims} claim statements for one wait on an empty queue"


def test_threads_sharing_a_listener_all_wake(make_queue: Callable[..., LeaseQueue]) -> None:
    # One notification for two tasks: the thread that reads it wakes, and so must the
    # other, which was waiting for its turn on the shared connection.
    queue = make_queue()
    queue.install()
    leases, latency = _claim_after_enqueue(queue, make_queue(), "shared", waiters=2)
    assert all(lease is not None for lease in leases)
    assert latency < 0.5, f"the last claim returned {latency:.2f} s after the enqueue"


def test_close_stops_the_idle_timer(make_queue: Callable[..., LeaseQueue]) -> None:
    queue = make_queue()
    queue.install()
    assert queue.claim(wait=0.1) is None
    queue.close()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and _idle_threads(queue.schema):
        time.sleep(0.05)
    assert _idle_threads(queue.schema) == []


def _idle_threads(schema: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"leasequeue-listener-{schema}"]


def test_a_waiting_claim_is_not_held_up_by_another_threads_long_wait(
    make_queue: Callable[..., LeaseQueue],
) -> None:
    """The listener is shared by the queue's threads: one waiting for a batch with a long
    poll interval held it for that long, and a claim(wait=0.5) in another thread waited
    for its turn just to start listening."""
    queue = make_queue()
    queue.install()
    batch = queue.enqueue_batch([{"n": 1}], queue="batched")
    waiter = threading.Thread(
        target=queue.wait_batch, args=(batch.id,), kwargs={"timeout": 6, "poll_interval": 6}
    )
    waiter.start()
    time.sleep(0.3)  # the waiter now holds the listener for its wait
    started = time.monotonic()
    assert queue.claim(queue="empty", wait=0.5) is None
    elapsed = time.monotonic() - started
    lease = queue.claim(queue="batched")
    assert lease is not None
    lease.ack()
    waiter.join(timeout=10)
    assert elapsed < 2.0, f"claim(wait=0.5) returned after {elapsed:.2f} s"
