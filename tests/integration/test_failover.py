"""Issue 14: the primary dies mid-drain and a streaming standby is promoted.

A primary and a standby of the test's own (tests/standby.py). Four worker threads, each
with its own LeaseQueue on a two-host DSN (``target_session_attrs=read-write``), drain the
queue through attempts (effect, success mark and fenced ack in one commit) while a producer
enqueues more and a sweeper sweeps. Mid-drain the primary is killed with SIGKILL, the
standby promoted and its inherited ``synchronous_standby_names`` cleared, as a failover
manager would. The workers go on claiming on the new primary; the sweeper recovers the
leases that were in flight.

- Synchronous replication (scenario 4): nothing acknowledged to a client before the kill
  is lost, every task ends done with its effect written exactly once, and every token
  claimed on the new primary is above every token seen before the kill: the token
  sequence is WAL-logged 32 values ahead (SEQ_LOG_VALS), so the standby's copy of it is
  already past every value handed out, which the test reads on the standby.
- Asynchronous replication (scenario 5): measured, not pass/fail: how many acknowledged
  enqueues and successes the failover lost. A lost success was lost with its effect (one
  commit), so the task is done again on the new primary: each task's effect is still
  there exactly once.

Figures go to the ``figures`` fixture (``failover`` and ``failover_async``).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import psycopg
import pytest

from dagster_leasequeue import (
    DatabaseUnavailable,
    LeaseQueue,
    LeaseQueueError,
    LeaseQueueSettings,
)

from ..standby import ReplicatedPair, Server, find_binaries

pytestmark = pytest.mark.slow

BINARIES, NO_BINARIES = find_binaries()
SCHEMA = "failover"
LEASE_SECONDS = 2.0
WORKERS = 4
# The default form: 2,000 tasks (1,500 enqueued up front, 500 by the producer during the
# drain), about 8 s a scenario on two cores; --chaos-long: 10,000 (about 22 s).
TASKS, TASKS_LONG = 2000, 10000
PRODUCED_SHARE = 0.25
KILL_AT_SHARE = 0.35  # the kill comes once this share of the tasks is done
DRAIN_DEADLINE = 90.0


def _settings(**overrides: Any) -> LeaseQueueSettings:
    values: dict[str, Any] = {
        "pool_size": 2,
        "connect_timeout": 2,
        "lease_seconds": LEASE_SECONDS,
        "max_attempts": 20,
        "schema_name": SCHEMA,
        "_env_file": None,
    }
    values.update(overrides)
    return LeaseQueueSettings(**values)


@pytest.fixture
def make_pair(tmp_path: Path) -> Iterator[Callable[[bool], ReplicatedPair]]:
    if BINARIES is None:
        pytest.skip(NO_BINARIES)
    pairs: list[ReplicatedPair] = []

    def make(synchronous: bool) -> ReplicatedPair:
        assert BINARIES is not None
        pair = ReplicatedPair(tmp_path, synchronous=synchronous, binaries=BINARIES)
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        pair.close()


class Event(NamedTuple):
    """One call that returned: when it was sent and when it returned (time.monotonic()),
    the task, and the token (a claim, a success) or the payload's n (an enqueue)."""

    sent: float
    returned: float
    task_id: int
    value: int


@dataclass
class WorkerRecord:
    """What one worker saw acknowledged."""

    claims: list[Event] = field(default_factory=list)
    successes: list[Event] = field(default_factory=list)  # sent: when its claim was sent
    duplicates: list[int] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)


@dataclass
class Drain:
    """The outcome of one drain across a failover, and what the new primary holds.

    A call that returned before the kill began was answered by the old primary; a call
    sent once the old primary's processes were all dead was answered by the new one. A
    call in between (a thread may note a return a little late) counts as neither, but
    the checks that hold for every call cover it too.
    """

    workers: list[WorkerRecord]
    enqueued: list[Event]
    kill_started: float
    killed_at: float
    timings: dict[str, float]
    inherited_sync_names: str
    standby_sequence_at_kill: int
    recovered_after_kill: int
    recovery_events: int  # in the log on the new primary, once drained
    errors: Counter[str]
    error_example: str | None
    unexpected: list[BaseException]
    # On the new primary, once drained:
    tasks: dict[int, tuple[str, int | None, int]]  # id -> (status, lease_token, payload n)
    effects: dict[int, list[int]]  # task id -> tokens of its effects
    successes_recorded: Counter[int]  # task id -> succeeded attempt records

    def claims(self) -> list[Event]:
        return sorted((c for w in self.workers for c in w.claims), key=lambda e: e.returned)

    def successes(self) -> list[Event]:
        return sorted((s for w in self.workers for s in w.successes), key=lambda e: e.returned)

    def before_kill(self, events: list[Event]) -> list[Event]:
        """Acknowledged by the old primary before the kill began."""
        return [e for e in events if e.returned < self.kill_started]

    def after_kill(self, events: list[Event]) -> list[Event]:
        """Sent (for a success: claimed) once the old primary was dead: the new primary's."""
        return [e for e in events if e.sent >= self.killed_at]

    def lost_enqueues(self, events: list[Event]) -> list[int]:
        """Acknowledged enqueues whose task is not on the new primary (with its payload)."""
        return [
            e.task_id
            for e in events
            if e.task_id not in self.tasks or self.tasks[e.task_id][2] != e.value
        ]

    def lost_successes(self, events: list[Event]) -> list[int]:
        """Acknowledged successes the new primary does not hold: the task is not done under
        that token, or its effect is not the one that attempt wrote, or no success record."""
        lost = []
        for _, _, task_id, token in events:
            status, final_token, _ = self.tasks.get(task_id, ("missing", None, -1))
            if (
                status != "done"
                or final_token != token
                or self.effects.get(task_id) != [token]
                or self.successes_recorded[task_id] != 1
            ):
                lost.append(task_id)
        return lost


def drain_across_failover(pair: ReplicatedPair, tasks: int) -> Drain:
    """Start the pair, drain ``tasks`` tasks with four workers, fail over mid-drain."""
    pair.start_primary()
    setup = LeaseQueue(pair.dsn, settings=_settings())
    setup.install()
    with setup.connection() as conn:
        conn.execute(
            f"CREATE TABLE {SCHEMA}.effects (task_id bigint NOT NULL, token bigint NOT NULL,"
            " worker text NOT NULL, written_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
    setup.close()
    pair.start_standby()  # the schema and the effects table are in its base backup

    queues = [LeaseQueue(pair.dsn, settings=_settings()) for _ in range(WORKERS)]
    producer_queue = LeaseQueue(pair.dsn, settings=_settings(pool_size=1))
    sweeper_queue = LeaseQueue(pair.dsn, settings=_settings(pool_size=1))
    monitor = LeaseQueue(pair.dsn, settings=_settings(pool_size=1))
    try:
        return _drain(pair, tasks, queues, producer_queue, sweeper_queue, monitor)
    finally:
        for queue in [*queues, producer_queue, sweeper_queue, monitor]:
            queue.close()


def _drain(
    pair: ReplicatedPair,
    tasks: int,
    queues: list[LeaseQueue],
    producer_queue: LeaseQueue,
    sweeper_queue: LeaseQueue,
    monitor: LeaseQueue,
) -> Drain:
    produced = int(tasks * PRODUCED_SHARE)
    upfront = tasks - produced
    # describe() with two hosts: their hosts, then their ports (see the report on issue 14).
    assert monitor.location == (
        f"127.0.0.1:{pair.primary.port},127.0.0.1:{pair.standby.port}/postgres"
    )

    enqueued: list[Event] = []
    sent = time.monotonic()
    ids = producer_queue.enqueue_many([{"n": n} for n in range(upfront)])
    returned = time.monotonic()
    enqueued.extend(Event(sent, returned, task_id, n) for n, task_id in enumerate(ids))

    records = [WorkerRecord() for _ in range(WORKERS)]
    stop = threading.Event()
    producer_done = threading.Event()
    killed = threading.Event()
    errors: Counter[str] = Counter()
    error_example: list[str] = []
    unexpected: list[BaseException] = []
    recovered: list[tuple[float, int]] = []
    killed_at_box = [0.0]  # when the old primary was dead; set before `killed`

    def note(counter: Counter[str], exc: BaseException) -> None:
        counter[type(exc).__name__] += 1
        if isinstance(exc, DatabaseUnavailable) and not error_example:
            error_example.append(str(exc))

    def worker(index: int) -> None:
        queue, record = queues[index], records[index]
        # Odd workers wait for tasks: their LISTEN connection lives across the failover.
        wait = 0.5 if index % 2 else 0
        # Workers 0 and 1 work inside `with lease:` (renewed; failed when the attempt
        # raises, which after the kill reaches the new primary once the pool reconnects).
        # Workers 2 and 3 leave a lease whose attempt failed to expire: the sweeper
        # recovers it on the new primary.
        guarded = index < 2
        try:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    lease = queue.claim(
                        worker_id=f"worker-{index}", lease_seconds=LEASE_SECONDS, wait=wait
                    )
                except LeaseQueueError as exc:
                    note(record.errors, exc)
                    stop.wait(0.05)
                    continue
                if lease is None:
                    stop.wait(0.02)
                    continue
                record.claims.append(Event(sent, time.monotonic(), lease.task_id, lease.token))
                try:
                    with (
                        lease if guarded else contextlib.nullcontext(),
                        queue.attempt(lease=lease) as attempt,
                    ):
                        if attempt.duplicate:
                            record.duplicates.append(lease.task_id)
                            continue
                        attempt.connection.execute(
                            f"INSERT INTO {SCHEMA}.effects (task_id, token, worker)"
                            " VALUES (%s, %s, %s)",
                            (lease.task_id, lease.token, f"worker-{index}"),
                        )
                except (LeaseQueueError, psycopg.Error) as exc:
                    # The effect's own statement meets the failover as a psycopg error.
                    note(record.errors, exc)
                    stop.wait(0.05)
                    continue
                record.successes.append(Event(sent, time.monotonic(), lease.task_id, lease.token))
        except BaseException as exc:
            unexpected.append(exc)
            raise

    def every_worker_claimed_since_the_kill() -> bool:
        return killed.is_set() and all(
            record.claims and record.claims[-1].sent >= killed_at_box[0] for record in records
        )

    def producer() -> None:
        n = upfront
        # Spread over the drain, so that enqueues are acknowledged up to the kill and after.
        # It goes on past its share until every worker has claimed on the new primary: a
        # worker still reconnecting when the last task was taken would otherwise have had
        # nothing left to show that it came back.
        pace = 0.004
        while (n < tasks or not every_worker_claimed_since_the_kill()) and not stop.is_set():
            sent = time.monotonic()
            try:
                task_id = producer_queue.enqueue({"n": n})
            except LeaseQueueError as exc:
                # Maybe committed, maybe not: enqueue it again; a duplicate is one more task.
                note(errors, exc)
                stop.wait(0.05)
                continue
            enqueued.append(Event(sent, time.monotonic(), task_id, n))
            n += 1
            stop.wait(pace * (3 if not killed.is_set() else 1))
        producer_done.set()

    def sweeper() -> None:
        while not stop.wait(0.2):
            try:
                swept = sweeper_queue.sweep()
            except LeaseQueueError as exc:
                note(errors, exc)
                continue
            if killed.is_set():
                recovered.extend((time.monotonic(), r.task_id) for r in swept)

    threads = [
        threading.Thread(target=worker, args=(i,), name=f"worker-{i}") for i in range(WORKERS)
    ]
    threads += [threading.Thread(target=producer), threading.Thread(target=sweeper)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    timings: dict[str, float] = {}
    try:
        kill_at = int(tasks * KILL_AT_SHARE)
        deadline = started + DRAIN_DEADLINE
        while sum(len(r.successes) for r in records) < kill_at:
            assert time.monotonic() < deadline, "the drain stalled before the kill"
            assert not unexpected, f"a worker died: {unexpected!r}"
            time.sleep(0.01)
        timings["drain_before_kill_s"] = time.monotonic() - started
        kill_started = time.monotonic()
        pair.kill_primary()
        killed_at = killed_at_box[0] = time.monotonic()
        killed.set()
        # What the standby holds of the token sequence once it replayed all it received:
        # WAL-logged ahead of the values handed out, so above every token claimed.
        standby_sequence = read_standby_sequence(pair.standby)
        read_at = time.monotonic()
        pair.promote()
        promoted_at = time.monotonic()
        inherited = pair.clear_synchronous_standby_names()
        cleared_at = time.monotonic()
        timings |= {
            "kill_s": killed_at - kill_started,
            "standby_sequence_read_s": read_at - killed_at,
            "kill_to_promoted_s": promoted_at - killed_at,
            "promotion_s": promoted_at - read_at,
            "kill_to_sync_names_cleared_s": cleared_at - killed_at,
        }
        while not producer_done.is_set() or has_work(monitor):
            assert time.monotonic() < deadline, "the drain did not finish after the failover"
            assert not unexpected, f"a worker died: {unexpected!r}"
            time.sleep(0.1)
        timings["kill_to_drained_s"] = time.monotonic() - killed_at
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a thread is stuck"

    with pair.standby.connect() as conn:
        tasks_now = {
            row[0]: (row[1], row[2], int(row[3]))
            for row in conn.execute(
                f"SELECT id, status, lease_token, payload->>'n' FROM {SCHEMA}.tasks"
            )
        }
        effects: dict[int, list[int]] = {}
        for task_id, token in conn.execute(
            f"SELECT task_id, token FROM {SCHEMA}.effects ORDER BY written_at"
        ):
            effects.setdefault(task_id, []).append(token)
        row = conn.execute(f"SELECT count(*) FROM {SCHEMA}.recovery_events").fetchone()
        recovery_events = int(row[0]) if row else 0
        successes_recorded = Counter(
            row[0]
            for row in conn.execute(
                f"SELECT task_id FROM {SCHEMA}.attempts WHERE outcome = 'succeeded'"
            )
        )
    return Drain(
        workers=records,
        enqueued=sorted(enqueued, key=lambda e: e.returned),
        kill_started=kill_started,
        killed_at=killed_at,
        timings=timings,
        inherited_sync_names=inherited,
        standby_sequence_at_kill=standby_sequence,
        recovered_after_kill=len(recovered),
        recovery_events=recovery_events,
        errors=errors + sum((r.errors for r in records), Counter()),
        error_example=error_example[0] if error_example else None,
        unexpected=unexpected,
        tasks=tasks_now,
        effects=effects,
        successes_recorded=successes_recorded,
    )


def read_standby_sequence(standby: Server) -> int:
    """The token sequence's last_value on the standby, once it replayed all it will.

    That is all it received, but for a tail the killed primary had flushed in the middle of
    a record: WAL is flushed by pages, and the standby never replays a record it holds only
    part of. So replay that stops short of the received WAL for a second is taken as done.
    """
    with standby.connect() as conn:
        deadline = time.monotonic() + 30
        replayed, since = "", time.monotonic()
        while True:
            row = conn.execute(
                "SELECT pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn(),"
                " pg_last_wal_replay_lsn()::text"
            ).fetchone()
            assert row is not None
            if row[0] or time.monotonic() - since > 1:
                break
            if row[1] != replayed:
                replayed, since = row[1], time.monotonic()
            assert time.monotonic() < deadline, "the standby's replay did not settle"
            time.sleep(0.005)
        value = conn.execute(f"SELECT last_value FROM {SCHEMA}.lease_tokens").fetchone()
    assert value is not None
    return int(value[0])


def has_work(queue: LeaseQueue) -> bool:
    try:
        counts = queue.stats(finished=False).counts
    except LeaseQueueError:
        return True
    return counts["enqueued"] + counts["processing"] > 0


def summary(drain: Drain, tasks: int) -> dict[str, object]:
    """The figures both scenarios report."""
    claims, successes = drain.claims(), drain.successes()
    before, after = drain.before_kill(claims), drain.after_kill(claims)
    concluded = {(e.task_id, e.value) for e in successes}
    concluded |= {
        (e.task_id, e.value) for w in drain.workers for e in w.claims if e.task_id in w.duplicates
    }
    in_flight = sum((e.task_id, e.value) not in concluded for e in before)
    return {
        "tasks": len(drain.tasks),
        "tasks_planned": tasks,
        "workers": WORKERS,
        "lease_seconds": LEASE_SECONDS,
        **{name: round(value, 3) for name, value in drain.timings.items()},
        "kill_to_first_claim_s": round(after[0].returned - drain.killed_at, 3),
        "kill_to_first_success_s": round(
            drain.after_kill(successes)[0].returned - drain.killed_at, 3
        ),
        "acknowledged_before_kill": {
            "enqueues": len(drain.before_kill(drain.enqueued)),
            "claims": len(before),
            "successes": len(drain.before_kill(successes)),
        },
        "enqueues_acknowledged_after_kill": len(drain.after_kill(drain.enqueued)),
        "lost_after_failover": {
            "enqueues": len(drain.lost_enqueues(drain.before_kill(drain.enqueued))),
            "successes": len(drain.lost_successes(drain.before_kill(successes))),
        },
        "tokens": {
            "max_before_kill": max(e.value for e in before),
            "standby_sequence_last_value_at_kill": drain.standby_sequence_at_kill,
            "min_after_failover": min(e.value for e in after),
            "max_after_failover": max(e.value for e in after),
        },
        "in_flight_at_kill": in_flight,
        "recovered_by_sweeper_after_kill": drain.recovered_after_kill,
        "recovery_events_on_new_primary": drain.recovery_events,
        "duplicate_attempts": sum(len(w.duplicates) for w in drain.workers),
        "effects_per_task": sorted(Counter(len(e) for e in drain.effects.values()).items()),
        "errors_seen_during_failover": dict(drain.errors),
        "inherited_synchronous_standby_names": drain.inherited_sync_names,
        "error_example": drain.error_example,
    }


def assert_drained_once(drain: Drain) -> None:
    """Every task done, its effect written exactly once, every worker alive after the kill."""
    assert drain.unexpected == [], "a worker thread died"
    statuses = Counter(status for status, _, _ in drain.tasks.values())
    assert statuses == {"done": len(drain.tasks)}, statuses
    counts = {task_id: len(tokens) for task_id, tokens in drain.effects.items()}
    assert set(counts) == set(drain.tasks), "a task has no effect, or an effect no task"
    twice = {task_id: n for task_id, n in counts.items() if n != 1}
    assert twice == {}, f"effects written more than once: {twice}"
    # The effect is the one of the attempt that acked the task.
    assert all(drain.effects[i] == [token] for i, (_, token, _) in drain.tasks.items())
    for index, record in enumerate(drain.workers):
        assert drain.after_kill(record.claims), f"worker {index} never claimed after the failover"
        assert drain.after_kill(record.successes), f"worker {index} never succeeded after it"
    assert drain.errors["DatabaseUnavailable"] > 0, "the failover went unnoticed"


def test_failover_mid_drain_with_synchronous_replication_loses_nothing(
    make_pair: Callable[[bool], ReplicatedPair],
    chaos_long: bool,
    figures: dict[str, dict[str, object]],
) -> None:
    tasks = TASKS_LONG if chaos_long else TASKS
    pair = make_pair(True)
    drain = drain_across_failover(pair, tasks)
    report = summary(drain, tasks)
    figures["failover"] = {"replication": "synchronous", **report}
    print(report)
    assert_drained_once(drain)
    assert drain.inherited_sync_names == "*", "the standby did not inherit the setting"

    # Nothing acknowledged by the old primary is missing on the new one.
    assert drain.lost_enqueues(drain.enqueued) == []
    assert len(drain.tasks) >= tasks
    successes = drain.successes()
    assert drain.before_kill(successes), "the kill came before any success"
    assert drain.lost_successes(successes) == []
    assert sum(len(w.duplicates) for w in drain.workers) == 0

    # Tokens: the standby's copy of the sequence (WAL-logged 32 values ahead) was already
    # past every token the old primary handed out, so every claim on the new primary has a
    # greater token than any claim before the kill, and no token was handed out twice.
    claims = drain.claims()
    before = [e.value for e in drain.before_kill(claims)]
    after = [e.value for e in drain.after_kill(claims)]
    assert max(before) <= drain.standby_sequence_at_kill
    assert max(after) > max(before)
    assert min(after) > drain.standby_sequence_at_kill
    assert len({e.value for e in claims}) == len(claims), "a token was handed out twice"

    check_package_on_two_hosts(pair)


def test_failover_mid_drain_with_asynchronous_replication_is_measured(
    make_pair: Callable[[bool], ReplicatedPair],
    chaos_long: bool,
    figures: dict[str, dict[str, object]],
) -> None:
    tasks = TASKS_LONG if chaos_long else TASKS
    pair = make_pair(False)
    drain = drain_across_failover(pair, tasks)
    report = summary(drain, tasks)
    claims = drain.claims()
    max_before = max(e.value for e in drain.before_kill(claims))
    report["tokens_after_failover_not_above_every_earlier_one"] = sum(
        e.value <= max_before for e in drain.after_kill(claims)
    )
    report["tokens_handed_out_twice"] = len(claims) - len({e.value for e in claims})
    figures["failover_async"] = {"replication": "asynchronous", **report}
    print(report)
    # Measured, not asserted: what the failover lost of what was acknowledged (often
    # nothing on loopback). Asserted: on the new primary every task is done and its effect
    # is there exactly once: a lost success was lost together with its effect, and the
    # task, recovered by the sweeper, was done again there.
    assert drain.inherited_sync_names == ""
    assert_drained_once(drain)


def test_standby_sequence_is_read_when_the_primary_died_mid_record(
    make_pair: Callable[[bool], ReplicatedPair],
) -> None:
    """A primary killed while it writes a large record leaves its standby holding part of
    it, which the standby never replays: the scenarios' read of the token sequence must
    not wait for its replay to reach what it received."""
    pair = make_pair(False)
    pair.start_primary()
    setup = LeaseQueue(pair.dsn, settings=_settings())
    setup.install()
    setup.close()
    pair.start_standby()

    def write_a_large_record() -> None:
        with contextlib.suppress(psycopg.Error), pair.primary.connect() as conn:
            conn.execute("SELECT pg_logical_emit_message(false, 'lq', repeat('x', 200000000))")

    writer = threading.Thread(target=write_a_large_record)
    writer.start()
    behind = "SELECT pg_wal_lsn_diff(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())"
    with pair.standby.connect() as conn:
        deadline = time.monotonic() + 30
        while (row := conn.execute(behind).fetchone()) is None or row[0] < 4 * 1024 * 1024:
            assert time.monotonic() < deadline, "the standby received no part of the record"
            time.sleep(0.01)
    pair.kill_primary()
    writer.join()
    with pair.standby.connect() as conn:
        time.sleep(0.5)
        row = conn.execute(behind).fetchone()
    assert row is not None and row[0] > 0, "the standby replayed all it received"

    started = time.monotonic()
    assert read_standby_sequence(pair.standby) >= 1
    assert time.monotonic() - started < 5


def check_package_on_two_hosts(pair: ReplicatedPair) -> None:
    """The rest of the package on the two-host DSN, after the failover: the first host is
    dead, the second is the primary. LISTEN wakes a waiting claim, the CLI and the Dagster
    resource work, and errors describe the DSN without failing on it."""
    queue = LeaseQueue(pair.dsn, settings=_settings())
    producer = LeaseQueue(pair.dsn, settings=_settings(pool_size=1))
    try:
        assert repr(queue) == f"LeaseQueue(location={queue.location!r}, schema='failover')"
        # A waiting claim is woken by the enqueue's NOTIFY, not by its once-a-second poll:
        # the enqueue comes 0.2 s after a poll, so the next poll would find it 0.8 s later.
        got: list[tuple[float, int | None]] = []

        def wait_for_a_task() -> None:
            lease = queue.claim(queue="listen", wait=5)
            got.append((time.monotonic(), lease.task_id if lease is not None else None))

        waiter = threading.Thread(target=wait_for_a_task)
        waiter.start()
        time.sleep(1.2)
        task_id = producer.enqueue({"wake": 1}, queue="listen")
        enqueued_at = time.monotonic()
        waiter.join(10)
        assert got and got[0][1] == task_id
        assert got[0][0] - enqueued_at < 0.6, "woken by the poll, not by NOTIFY"
    finally:
        queue.close()
        producer.close()

    cli = subprocess.run(
        [sys.executable, "-m", "dagster_leasequeue.cli", "--dsn", pair.dsn, "--schema", SCHEMA,
         "stats", "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert '"done"' in cli.stdout

    from dagster_leasequeue import LeaseQueueResource

    resource = LeaseQueueResource(dsn=pair.dsn, schema_name=SCHEMA, queue="resource")
    try:
        resource.enqueue({"via": "resource"})
        lease = resource.claim()
        assert lease is not None
        lease.ack()
    finally:
        with contextlib.suppress(Exception):
            resource.get_queue().close()
