"""Flow control in the claim: concurrency limits per key, rate limits, pausing a queue."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from dagster_leasequeue import ConfigurationError, Lease, LeaseQueue, sql

from ..helpers import expire, run_sql


@pytest.fixture
def rate_seconds(chaos_long: bool) -> float:
    """How long the rate test claims: 30 s in the long form (``--chaos-long``), else 6."""
    return 30.0 if chaos_long else 6.0


@pytest.fixture
def limit_tasks(chaos_long: bool) -> int:
    """The tasks of the 16-claimer test: 5,000 in the long form (``--chaos-long``), else 600."""
    return 5000 if chaos_long else 600


def running_per_key(queue: LeaseQueue, name: str) -> Counter[str]:
    return Counter(
        dict(
            run_sql(
                queue,
                "SELECT concurrency_key, count(*) FROM {schema}.tasks"
                " WHERE queue = %(queue)s AND status = 'processing' GROUP BY 1",
                {"queue": name},
            )
        )
    )


def drain(queue: LeaseQueue, name: str, claimers: int, work: Any = None) -> None:
    """Claim and ack with many threads until the queue has nothing left to claim."""

    def claimer() -> None:
        while True:
            lease = queue.claim(queue=name, wait=0.5)
            if lease is None:
                if queue.stats(name, finished=False).counts["enqueued"] == 0:
                    return
                continue
            if work is not None:
                work(lease)
            lease.ack()

    threads = [threading.Thread(target=claimer) for _ in range(claimers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)


def many_keys_with_rows(queue: LeaseQueue) -> None:
    """2,000 tasks over 1,000 keys at 5 running each, every key's row made beforehand."""
    queue.enqueue_many(
        ({"n": n} for n in range(2000)), concurrency_key=lambda p: f"customer-{p['n'] % 1000}"
    )
    queue.set_concurrency_limit("default", 5)
    run_sql(
        queue,
        "INSERT INTO {schema}.flow_keys (queue, key) SELECT 'default', 'customer-' || g"
        " FROM generate_series(0, 999) AS g",
    )


@pytest.mark.slow
def test_a_concurrency_limit_holds_under_16_claimers(make_queue: Any, limit_tasks: int) -> None:
    queue = make_queue(pool_size=20)
    queue.install()
    keys = ("customer-1", "customer-2", "customer-3")
    queue.enqueue_many(
        ({"n": n} for n in range(limit_tasks)),
        queue="api",
        concurrency_key=lambda p: keys[p["n"] % 3],
    )
    queue.set_concurrency_limit("api", 2)
    highest: Counter[str] = Counter()
    samples = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal samples
        while not stop.is_set():
            for key, count in running_per_key(queue, "api").items():
                highest[key] = max(highest[key], count)
            samples += 1

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        drain(queue, "api", 16, work=lambda lease: time.sleep(0.001))
    finally:
        stop.set()
        sampler.join()
    assert queue.stats("api").counts["done"] == limit_tasks
    assert samples > 50
    assert set(highest) == set(keys)
    assert max(highest.values()) == 2, highest
    # The running counts came back to zero with the last ack.
    assert run_sql(queue, "SELECT sum(running) FROM {schema}.flow_keys") == [(0,)]


def test_a_key_at_its_limit_does_not_hold_back_the_tasks_behind_it(queue: LeaseQueue) -> None:
    # 300 tasks of one key first: more than a claim looks at in claim order.
    queue.enqueue_many([{"key": "big"}] * 300, queue="api", concurrency_key="big")
    small = queue.enqueue_many([{"key": "small"}] * 3, queue="api", concurrency_key="small")
    keyless = queue.enqueue_many([{"key": None}] * 2, queue="api")
    queue.set_concurrency_limit("api", 1, key="big")
    first = queue.claim(queue="api")
    assert first is not None and first.payload == {"key": "big"}
    leases = queue.claim_many(10, queue="api")
    assert [lease.task_id for lease in leases] == small + keyless
    assert queue.claim(queue="api") is None
    first.ack()
    again = queue.claim(queue="api")
    assert again is not None and again.payload == {"key": "big"}


def test_priority_and_order_hold_among_the_tasks_that_may_run(queue: LeaseQueue) -> None:
    queue.set_concurrency_limit("api", 1)
    low = queue.enqueue({"n": 1}, queue="api", concurrency_key="a")
    high = queue.enqueue({"n": 2}, queue="api", concurrency_key="a", priority=5)
    other = queue.enqueue({"n": 3}, queue="api", concurrency_key="b")
    leases = queue.claim_many(5, queue="api")
    assert [lease.task_id for lease in leases] == [high, other]
    leases[0].ack()
    lease = queue.claim(queue="api")
    assert lease is not None and lease.task_id == low


def test_a_limit_of_a_key_of_its_own_overrides_the_default_and_can_be_removed(
    queue: LeaseQueue,
) -> None:
    queue.enqueue_many([{"n": n} for n in range(6)], queue="api", concurrency_key="vip")
    queue.set_concurrency_limit("api", 1)
    queue.set_concurrency_limit("api", 3, key="vip")
    assert len(queue.claim_many(10, queue="api")) == 3
    flow = queue.flow("api")
    assert (flow.max_running, [(k.key, k.running, k.max_running) for k in flow.keys]) == (
        1,
        [("vip", 3, 3)],
    )
    queue.set_concurrency_limit("api", None, key="vip")
    queue.set_concurrency_limit("api", None)
    assert not queue.flow("api").limited
    assert len(queue.claim_many(10, queue="api")) == 3


def test_a_paused_queue_is_not_claimed_but_takes_enqueues_and_sweeps(queue: LeaseQueue) -> None:
    queue.enqueue_many([{"n": n} for n in range(3)], queue="api")
    held = queue.claim(queue="api")
    assert held is not None
    queue.pause("api")
    assert queue.claim(queue="api") is None
    assert queue.stats("api").paused
    queue.enqueue({"n": 3}, queue="api")
    expire(queue, held.task_id)
    assert [task.task_id for task in queue.sweep()] == [held.task_id]
    assert queue.stats("api").counts["enqueued"] == 4
    assert queue.claim(queue="other") is None  # other queues are not paused
    # A claimer waiting on the paused queue is woken by the resume.
    threading.Timer(0.3, queue.resume, ["api"]).start()
    started = time.monotonic()
    lease = queue.claim(queue="api", wait=10)
    assert lease is not None and time.monotonic() - started < 0.9
    assert not queue.stats("api").paused


def test_pause_and_resume_under_load(make_queue: Any) -> None:
    queue = make_queue(pool_size=8)
    queue.install()
    queue.enqueue_many([{"n": n} for n in range(600)], queue="api")
    done_while_paused: list[int] = []

    def work(lease: Any) -> None:
        time.sleep(0.002)

    drainer = threading.Thread(target=drain, args=(queue, "api", 4, work))
    drainer.start()
    while queue.stats("api").counts["done"] < 100:
        time.sleep(0.01)
    queue.pause("api")
    time.sleep(0.2)  # the claims already sent finish; nothing more is claimed
    settled = queue.stats("api").counts
    for _ in range(5):
        time.sleep(0.1)
        counts = queue.stats("api").counts
        done_while_paused.append(counts["done"] - settled["done"])
        assert counts["processing"] == 0
    assert done_while_paused == [0] * 5
    assert 0 < settled["enqueued"] < 500
    queue.resume("api")
    drainer.join(timeout=120)
    assert queue.stats("api").counts["done"] == 600


@pytest.mark.slow
def test_a_rate_limit_holds_across_8_claimers_and_its_burst_after_idle(
    make_queue: Any, rate_seconds: float
) -> None:
    queue = make_queue(pool_size=10)
    queue.install()
    rate, burst = 20.0, 5.0
    queue.enqueue_many([{"n": n} for n in range(int(rate * rate_seconds * 2) + 100)], queue="api")
    queue.set_rate_limit("api", per_second=rate, burst=burst)
    claimed: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + rate_seconds

    def claimer() -> None:
        while time.monotonic() < deadline:
            leases = queue.claim_many(3, queue="api", wait=deadline - time.monotonic())
            with lock:
                claimed.extend(time.monotonic() for _ in leases)
            queue.ack_many(leases)

    threads = [threading.Thread(target=claimer) for _ in range(8)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.monotonic() - started
    assert len(claimed) <= rate * seconds + burst
    in_window = sum(1 for at in claimed if at <= deadline)
    assert in_window >= 0.95 * rate * rate_seconds, (in_window, rate * rate_seconds)
    # Idle, the bucket fills to its burst, and no further.
    time.sleep(burst / rate + 0.3)
    assert len(queue.claim_many(20, queue="api")) == burst


_HOLD_AND_DIE = """
import os, signal, sys
from dagster_leasequeue import LeaseQueue
with LeaseQueue(sys.argv[1], schema=sys.argv[2]) as queue:
    lease = queue.claim(queue="api", lease_seconds=60)
    assert lease is not None
    print(lease.task_id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_workers_slot_comes_back_when_its_lease_is_swept(
    queue: LeaseQueue, dsn: str
) -> None:
    first, second = queue.enqueue_many([{"n": 1}, {"n": 2}], queue="api", concurrency_key="k")
    queue.set_concurrency_limit("api", 1)
    worker = subprocess.run(
        [sys.executable, "-c", _HOLD_AND_DIE, dsn, queue.schema],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert worker.returncode == -signal.SIGKILL
    assert int(worker.stdout) == first
    # The dead worker's lease still counts until the sweeper recovers its task.
    assert queue.claim(queue="api") is None
    expire(queue, first)
    assert [task.task_id for task in queue.sweep()] == [first]
    lease = queue.claim(queue="api")
    assert lease is not None  # the slot is back: one of the two, and not both
    assert queue.claim(queue="api") is None
    lease.ack()
    last = queue.claim(queue="api")
    assert last is not None and {lease.task_id, last.task_id} == {first, second}


def test_bad_limits_and_keys_are_refused_and_change_nothing(queue: LeaseQueue) -> None:
    with pytest.raises(ConfigurationError, match="max_running must be a whole number"):
        queue.set_concurrency_limit("api", -1)
    with pytest.raises(ConfigurationError, match="per_second must be a number above 0"):
        queue.set_rate_limit("api", per_second=0)
    with pytest.raises(ConfigurationError, match="burst needs a rate"):
        queue.set_rate_limit("api", per_second=None, burst=3)
    with pytest.raises(ConfigurationError, match="burst must be a number of 1 or more"):
        queue.set_rate_limit("api", per_second=2, burst=0.5)
    with pytest.raises(ConfigurationError, match="concurrency_key"):
        queue.enqueue({"n": 1}, queue="api", concurrency_key="a\x00b")
    with pytest.raises(ConfigurationError, match="concurrency key of payload #1"):
        queue.enqueue_many(
            [{"n": 1}, {"n": 2}], queue="api", concurrency_key=lambda p: "a" if p["n"] == 1 else 2
        )
    assert not queue.flow("api").limited
    assert queue.stats("api").total == 0


def test_batch_tasks_carry_their_concurrency_keys(queue: LeaseQueue) -> None:
    queue.set_concurrency_limit("api", 1)
    batch = queue.enqueue_batch(
        ({"tenant": t} for t in ("a", "a", "b", "c\tt")),
        queue="api",
        concurrency_key=lambda p: p["tenant"],
    )
    keyed = queue.enqueue_batch(
        [{"n": 1}, {"n": 2}], queue="api", idempotency_keys=["x", "y"], concurrency_key="a"
    )
    assert (batch.total, keyed.total) == (4, 2)
    leases = queue.claim_many(10, queue="api")
    assert sorted(lease.payload.get("tenant", "") for lease in leases) == ["a", "b", "c\tt"]
    rows = run_sql(
        queue, "SELECT concurrency_key, count(*) FROM {schema}.tasks GROUP BY 1 ORDER BY 1"
    )
    assert rows == [("a", 4), ("b", 1), ("c\tt", 1)]


def test_the_resource_passes_the_concurrency_key_through(dsn: str, schema_name: str) -> None:
    from dagster_leasequeue import LeaseQueueResource

    resource = LeaseQueueResource(dsn=dsn, schema_name=schema_name, queue="api")
    queue = resource.get_queue()
    queue.install()
    resource.enqueue({"n": 1}, concurrency_key="a")
    resource.enqueue_many([{"n": 2}], concurrency_key=lambda p: "b")
    resource.enqueue_batch([{"n": 3}], concurrency_key="c")
    rows = run_sql(queue, "SELECT concurrency_key FROM {schema}.tasks ORDER BY id")
    assert rows == [("a",), ("b",), ("c",)]


def crossing_an_open_ack(
    queue: LeaseQueue, dsn: str, first: Lease, then: Lease, statement: Callable[[], object]
) -> list[BaseException]:
    """Run ``statement`` in a thread while an open transaction acks ``first`` (holding its
    key's row), waits for ``statement`` to block on that row, then acks ``then`` (taking the
    other key's row) and commits: what the statement raised, a deadlock above all."""
    ack = sql.compose(sql.ACK, queue.schema)

    def params(lease: Lease) -> dict[str, Any]:
        return {"task_id": lease.task_id, "token": lease.token, "result": None}

    errors: list[BaseException] = []

    def run() -> None:
        try:
            statement()
        except BaseException as error:  # returned to the test
            errors.append(error)

    with psycopg.connect(dsn) as holder:
        holder.execute(ack, params(first))  # holds first's key row until it commits
        running = threading.Thread(target=run)
        running.start()
        time.sleep(0.5)  # the statement now waits for that row
        holder.execute(ack, params(then))  # and this for the other key's, if it held it
        holder.commit()
        running.join(timeout=30)
    return errors


def _two_keys_claimed(queue: LeaseQueue) -> tuple[list[int], dict[int, Lease]]:
    """Two tasks of key b, then two of key a, all claimed: their ids, and leases by id."""
    ids = queue.enqueue_many(
        [{"k": "b"}, {"k": "b"}, {"k": "a"}, {"k": "a"}],
        queue="api",
        concurrency_key=lambda p: p["k"],
    )
    return ids, {lease.task_id: lease for lease in queue.claim_many(4, queue="api")}


@pytest.mark.usefixtures("conflicts_not_retried")
def test_statements_finishing_tasks_of_shared_keys_never_deadlock(
    queue: LeaseQueue, dsn: str
) -> None:
    """An open transaction holds key a's count and then takes key b's, while ack_many
    acks tasks of b and a: counted row by row, the two would each hold one key's row
    while waiting for the other's, and PostgreSQL would abort one."""
    # Key b's tasks first: a statement over many rows changes them in id order.
    (b1, b2, a1, a2), leases = _two_keys_claimed(queue)

    def ack_many() -> None:
        queue.ack_many([leases[b1], leases[a2]])

    assert crossing_an_open_ack(queue, dsn, leases[a1], leases[b2], ack_many) == []
    assert queue.stats("api").counts["done"] == 4
    assert run_sql(queue, "SELECT sum(running) FROM {schema}.flow_keys") == [(0,)]


@pytest.mark.usefixtures("conflicts_not_retried")
def test_a_sweep_and_an_ack_sharing_keys_never_deadlock(queue: LeaseQueue, dsn: str) -> None:
    """An open transaction holds key a's count and then takes key b's, while a sweep
    recovers an expired task of b and then one of a: counted row by row, in expiry order,
    the sweep would hold b's row while waiting for a's, and PostgreSQL would abort one."""
    (b1, b2, a1, a2), leases = _two_keys_claimed(queue)
    run_sql(
        queue,
        "UPDATE {schema}.tasks SET lease_expires_at = clock_timestamp()"
        " - make_interval(secs => CASE WHEN id = %(b1)s THEN 2 ELSE 1 END)"
        " WHERE id IN (%(b1)s, %(a2)s)",
        {"b1": b1, "a2": a2},
    )
    swept: list[int] = []

    def sweep() -> None:
        swept.extend(task.task_id for task in queue.sweep())

    assert crossing_an_open_ack(queue, dsn, leases[a1], leases[b2], sweep) == []
    assert sorted(swept) == sorted([b1, a2])
    assert queue.stats("api").counts == {"done": 2, "enqueued": 2} | {
        status: 0 for status in ("processing", "dead", "cancelled")
    }
    assert run_sql(queue, "SELECT sum(running) FROM {schema}.flow_keys") == [(0,)]


@pytest.mark.usefixtures("conflicts_not_retried")
def test_a_cancel_and_an_ack_sharing_keys_never_deadlock(queue: LeaseQueue, dsn: str) -> None:
    """As above, with cancel_batch taking a batch's running tasks of key b and then of key a
    out of processing, while an open transaction holds key a's count and then takes b's."""
    batch = queue.enqueue_batch(
        [{"k": "b"}, {"k": "a"}], queue="api", concurrency_key=lambda p: p["k"]
    )
    a1, b2 = queue.enqueue_many(
        [{"k": "a"}, {"k": "b"}], queue="api", concurrency_key=lambda p: p["k"]
    )
    leases = {lease.task_id: lease for lease in queue.claim_many(4, queue="api")}
    assert len(leases) == 4
    cancelled: list[int] = []

    def cancel() -> None:
        cancelled.append(queue.cancel_batch(batch.id))

    assert crossing_an_open_ack(queue, dsn, leases[a1], leases[b2], cancel) == []
    assert cancelled == [2]
    assert queue.batch(batch.id).cancelled == 2
    assert run_sql(queue, "SELECT sum(running) FROM {schema}.flow_keys") == [(0,)]


def test_a_claim_locks_the_keys_it_needs_not_every_key_it_looks_at(
    queue: LeaseQueue, dsn: str
) -> None:
    many_keys_with_rows(queue)
    claim = f'SELECT id FROM "{queue.schema}".claim_flow(%s, 100, %s, NULL, 30)'
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn) as other:
        assert len(holder.execute(claim, ("default", "holder")).fetchall()) == 100
        free = other.execute(
            f'SELECT count(*) FROM (SELECT key FROM "{queue.schema}".flow_keys'
            " FOR UPDATE SKIP LOCKED) AS free"
        ).fetchone()
        other.rollback()
        # The claim's scan looks at the first 464 tasks (464 keys); it holds only 100.
        assert free == (900,)
        # A claimer beside it gets the next tasks, not the held keys' or nothing.
        second = [row[0] for row in other.execute(claim, ("default", "other")).fetchall()]
        assert len(second) == 100
        holder.rollback()
        other.rollback()


def test_a_claim_that_waited_on_another_claims_key_rows_still_gets_the_next_tasks(
    queue: LeaseQueue, dsn: str
) -> None:
    # Two claims start together on a key with no row yet; the second waits for the first's
    # new row, and by then the tasks it looked at are the first's.
    queue.enqueue_many(({"n": n} for n in range(30)), concurrency_key="customer-1")
    queue.set_concurrency_limit("default", 50)
    claim = f'SELECT id FROM "{queue.schema}".claim_flow(%s, 10, %s, NULL, 30)'
    second: list[int] = []
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn) as other:
        first = [row[0] for row in holder.execute(claim, ("default", "holder")).fetchall()]
        assert len(first) == 10
        pid = other.info.backend_pid
        waiting = threading.Thread(
            target=lambda: second.extend(
                row[0] for row in other.execute(claim, ("default", "other")).fetchall()
            )
        )
        waiting.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and run_sql(
            queue, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %(pid)s", {"pid": pid}
        ) != [("Lock",)]:
            time.sleep(0.02)
        holder.commit()
        waiting.join(timeout=30)
        other.commit()
    assert len(second) == 10
    assert set(second).isdisjoint(first)
    assert queue.stats("default").counts["processing"] == 20


def test_a_claim_on_a_table_never_analysed_looks_each_key_up_by_its_index(
    queue: LeaseQueue,
) -> None:
    # A long backlog of one key held at its limit, many keys behind it, and no statistics
    # yet (a table just filled, before autovacuum's first ANALYZE): the claim looks each
    # waiting key's tasks up through the key index, never by walking the backlog.
    backlog = 20_000
    queue.enqueue_many([{"n": n} for n in range(backlog)], queue="api", concurrency_key="hot")
    queue.enqueue_many(
        [{"n": n} for n in range(400)], queue="api", concurrency_key=lambda p: f"k{p['n'] % 200}"
    )
    queue.set_concurrency_limit("api", 2)
    assert len(queue.claim_many(2, queue="api")) == 2  # "hot" at its limit
    (analysed,) = run_sql(
        queue,
        "SELECT last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL"
        " FROM pg_stat_user_tables WHERE relid = '{schema}.tasks'::regclass",
    )
    with queue.connection() as conn, conn.transaction(force_rollback=True):
        (plan,) = conn.execute(
            f'EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM "{queue.schema}"'
            ".claim_flow('api', 100, 'w', NULL, 30)"
        ).fetchone()
    scan = plan[0]["Plan"]
    assert scan["Actual Rows"] == 100  # the first tasks of 50 of the 200 keys
    buffers = scan["Shared Hit Blocks"] + scan["Shared Read Blocks"]
    assert buffers < backlog / 2, (analysed, buffers)


def test_a_claim_over_keys_with_room_reads_only_the_tasks_it_leases(
    queue: LeaseQueue, dsn: str
) -> None:
    # Every key has its row and room: the claim takes the first tasks in claim order in one
    # statement, as the plain claim does, not a scan of 64 + 4 per task wanted first.
    many_keys_with_rows(queue)
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            f'SELECT id FROM "{queue.schema}".claim_flow(%s, 100, %s, NULL, 30)',
            ("default", "w"),
        ).fetchall()
        read = conn.execute(
            "SELECT sum(pg_stat_get_xact_tuples_returned(indexrelid)) FROM pg_stat_user_indexes"
            " WHERE schemaname = %s AND indexrelname IN ('tasks_claim_idx', 'tasks_key_claim_idx')",
            (queue.schema,),
        ).fetchone()
        conn.commit()
    assert len(rows) == 100
    assert read is not None and read[0] <= 101, read
    assert run_sql(queue, "SELECT sum(running) FROM {schema}.flow_keys") == [(100,)]


def test_one_claim_over_keys_of_every_kind_takes_each_what_it_may(queue: LeaseQueue) -> None:
    # The first statement of claim_flow leases what it can, the rounds after it the rest,
    # and together they count every key once. In claim order: a key out of room, a key
    # with room, a key with no row yet, a key with a bucket of its own (one token), a task
    # without a key, a key with a limit of its own.
    queue.set_concurrency_limit("api", 2)
    queue.enqueue_many([{"k": "full"}] * 3, queue="api", concurrency_key="full")
    held = queue.claim_many(2, queue="api")
    queue.enqueue_many([{"k": "room"}] * 3, queue="api", concurrency_key="room")
    queue.enqueue_many([{"k": "new"}] * 3, queue="api", concurrency_key="new")
    queue.enqueue_many([{"k": "bucket"}] * 3, queue="api", concurrency_key="bucket")
    queue.enqueue_many([{"k": None}] * 3, queue="api")
    queue.enqueue_many([{"k": "vip"}] * 5, queue="api", concurrency_key="vip")
    queue.set_rate_limit("api", per_second=0.001, burst=1, key="bucket")
    queue.set_concurrency_limit("api", 4, key="vip")
    assert len(held) == 2 and {lease.payload["k"] for lease in held} == {"full"}

    leases = queue.claim_many(100, queue="api")
    taken = Counter(lease.payload["k"] for lease in leases)
    assert taken == {"room": 2, "new": 2, "bucket": 1, None: 3, "vip": 4}
    assert running_per_key(queue, "api") == {
        "full": 2,
        "room": 2,
        "new": 2,
        "bucket": 1,
        "vip": 4,
        None: 3,
    }
    assert dict(run_sql(queue, "SELECT key, running FROM {schema}.flow_keys")) == {
        "full": 2,
        "room": 2,
        "new": 2,
        "bucket": 1,
        "vip": 4,
    }
    queue.ack_many(held + leases)
    assert run_sql(queue, "SELECT sum(running) FROM {schema}.flow_keys") == [(0,)]


def test_a_key_whose_row_another_claimer_holds_is_passed_over(queue: LeaseQueue, dsn: str) -> None:
    queue.enqueue_many([{"k": "held"}] * 3, queue="api", concurrency_key="held")
    queue.enqueue_many([{"k": "free"}] * 3, queue="api", concurrency_key="free")
    queue.set_concurrency_limit("api", 5)
    run_sql(
        queue,
        "INSERT INTO {schema}.flow_keys (queue, key) VALUES ('api', 'held'), ('api', 'free')"
        " ON CONFLICT DO NOTHING",
    )
    with psycopg.connect(dsn) as holder:
        holder.execute(f"SELECT 1 FROM \"{queue.schema}\".flow_keys WHERE key = 'held' FOR UPDATE")
        leases = queue.claim_many(100, queue="api")
        assert {lease.payload["k"] for lease in leases} == {"free"} and len(leases) == 3
        holder.rollback()
    assert dict(run_sql(queue, "SELECT key, running FROM {schema}.flow_keys")) == {
        "held": 0,
        "free": 3,
    }
    assert len(queue.claim_many(100, queue="api")) == 3


def test_a_claim_leaves_the_key_trigger_counting_for_the_rest_of_its_transaction(
    queue: LeaseQueue, dsn: str
) -> None:
    queue.enqueue_many([{"n": n} for n in range(4)], queue="api", concurrency_key="k")
    queue.set_concurrency_limit("api", 5)
    assert len(queue.claim_many(1, queue="api")) == 1  # the key's row made
    claim = f'SELECT id, lease_token FROM "{queue.schema}".claim_flow(%s, 2, %s, NULL, 30)'
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(claim, ("api", "w")).fetchall()
        assert len(rows) == 2
        # An ack in the same transaction, row by row: the trigger counts it.
        conn.execute(
            sql.compose(sql.ACK, queue.schema),
            {"task_id": rows[0][0], "token": rows[0][1], "result": None},
        )
        conn.commit()
    assert run_sql(queue, "SELECT running FROM {schema}.flow_keys") == [(2,)]
