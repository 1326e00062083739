"""Concluding a task and claiming the next in one statement: ack_and_claim and
ack_many_and_claim, on plain and controlled queues."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from dagster_leasequeue import (
    Attempt,
    ConfigurationError,
    DatabaseUnavailable,
    Lease,
    LeaseLost,
    LeaseQueue,
    LeaseQueueError,
    LeaseQueueSettings,
    run_worker,
)

from ..helpers import (
    break_the_session_reset,
    expire,
    on_claiming,
    run_sql,
    start_blocked,
    wait_for_a_lock_waiter,
)


def statuses(queue: LeaseQueue) -> dict[str, int]:
    return {k: v for k, v in queue.stats().counts.items() if v}


def test_ack_and_claim_acks_and_leases_the_next_task_in_claim_order(queue: LeaseQueue) -> None:
    low = queue.enqueue({"n": "low"})
    high = queue.enqueue({"n": "high"}, priority=5)
    other = queue.enqueue({"n": "other queue"}, queue="other")
    first = queue.claim(worker_id="w1")
    assert first is not None and first.task_id == high
    second = first.ack_and_claim({"ok": 1})
    assert first.finished
    assert queue.get(high).status == "done" and queue.get(high).result == {"ok": 1}
    assert second is not None and second.task_id == low
    assert (second.queue, second.worker_id, second.attempt) == ("default", "w1", 1)
    assert second.token > first.token
    assert queue.get(low).status == "processing"
    # The last one: acked, and nothing to claim.
    assert second.ack_and_claim() is None
    assert queue.get(low).status == "done"
    assert queue.get(other).status == "enqueued"


def test_a_zombie_whose_lease_was_swept_gets_lease_lost_and_claims_nothing(
    queue: LeaseQueue,
) -> None:
    stuck = queue.enqueue({"n": 1})
    waiting = queue.enqueue({"n": 2})
    zombie = queue.claim(worker_id="zombie")
    assert zombie is not None and zombie.task_id == stuck
    expire(queue, stuck)
    assert [r.task_id for r in queue.sweep()] == [stuck]
    with pytest.raises(LeaseLost, match="nothing was changed"):
        zombie.ack_and_claim()
    assert queue.get(waiting).status == "enqueued"
    assert queue.get(stuck).status == "enqueued"
    assert not zombie.finished


def test_a_zombie_whose_lease_is_taken_while_its_statement_waits_claims_nothing(
    queue: LeaseQueue, dsn: str
) -> None:
    # The ack and the claim are one UPDATE: the acked row's fence is checked when its row
    # is reached, here after the claim's row was moved. The statement must undo the claim.
    stuck = queue.enqueue({"n": 1})
    waiting = queue.enqueue({"n": 2})
    zombie = queue.claim(worker_id="zombie")
    assert zombie is not None and zombie.task_id == stuck

    def conclude() -> BaseException | None:
        try:
            zombie.ack_and_claim()
        except LeaseLost as exc:
            return exc
        return None

    tasks = f'"{queue.schema}".tasks'
    with psycopg.connect(dsn) as sweeper:
        # A recovery of the task, not yet committed: the zombie's statement waits for it.
        sweeper.execute(
            f"UPDATE {tasks} SET status = 'enqueued', lease_token = NULL,"
            " lease_expires_at = NULL WHERE id = %s",
            (stuck,),
        )
        finish = start_blocked(dsn, queue.schema, conclude)
    assert isinstance(finish(), LeaseLost)
    assert queue.get(waiting).status == "enqueued"
    assert queue.get(stuck).status == "enqueued"
    # Both tasks are there for the next claimer, under new tokens.
    taken = [queue.claim(worker_id="next"), queue.claim(worker_id="next")]
    assert sorted(lease.task_id for lease in taken if lease) == [stuck, waiting]


def test_a_batch_drained_by_ack_and_claim_counts_each_task_once(queue: LeaseQueue) -> None:
    # Each statement sets finished_at on the row it claims too (to what it was): the batch
    # trigger looks at the claimed task and counts nothing for it.
    batch = queue.enqueue_batch(({"n": n} for n in range(30)), queue="docs")
    lease = queue.claim(queue="docs")
    drained = 0
    while lease is not None:
        assert queue.batch(batch.id).processing == 1
        drained += 1
        lease = lease.ack_and_claim({"n": drained})
    info = queue.wait_batch(batch.id, timeout=10)
    assert (drained, info.done, info.enqueued, info.processing) == (30, 30, 0, 0)
    assert info.finished


def test_ack_and_claim_holds_a_concurrency_limit_and_frees_its_slot_for_the_next(
    queue: LeaseQueue,
) -> None:
    for n in range(3):
        queue.enqueue({"n": n}, concurrency_key="customer-1")
    queue.enqueue({"n": "other"}, concurrency_key="customer-2")
    queue.set_concurrency_limit("default", 1)
    lease = queue.claim()
    assert lease is not None and lease.payload == {"n": 0}
    seen = [lease.payload]
    while (lease := lease.ack_and_claim()) is not None:
        seen.append(lease.payload)
        running = run_sql(
            queue,
            "SELECT key, running FROM {schema}.flow_keys WHERE running > 0 ORDER BY key",
        )
        assert running == [(lease.payload.get("key", _key_of(lease.payload)), 1)]
    assert sorted(map(str, seen)) == sorted(
        map(str, [{"n": 0}, {"n": 1}, {"n": 2}, {"n": "other"}])
    )
    assert statuses(queue) == {"done": 4}
    assert run_sql(queue, "SELECT sum(running) FROM {schema}.flow_keys") == [(0,)]


def _key_of(payload: dict[str, Any]) -> str:
    return "customer-2" if payload["n"] == "other" else "customer-1"


def test_ack_and_claim_on_a_paused_queue_acks_and_claims_nothing(queue: LeaseQueue) -> None:
    first = queue.enqueue({"n": 1})
    queue.enqueue({"n": 2})
    lease = queue.claim()
    assert lease is not None
    queue.pause("default")
    assert lease.ack_and_claim() is None
    assert queue.get(first).status == "done"
    queue.resume("default")
    assert queue.claim() is not None


def refuse_to_claim_boom(queue: LeaseQueue) -> None:
    """Any claim of a task whose payload has ``boom`` fails."""
    on_claiming(queue, "boom", "RAISE EXCEPTION 'this task cannot be claimed'")


@pytest.mark.parametrize("many", [False, True], ids=["ack_and_claim", "ack_many_and_claim"])
def test_a_claim_that_fails_after_the_ack_on_a_controlled_queue_keeps_the_ack(
    queue: LeaseQueue, many: bool
) -> None:
    # On a controlled queue the ack and claim_flow() share a transaction: a claim that
    # fails (here a trigger; a lock or statement timeout alike) must not take the ack with
    # it, or a finished task would be run again.
    refuse_to_claim_boom(queue)
    first = queue.enqueue({"n": 1}, concurrency_key="customer-1")
    boom = queue.enqueue({"boom": True}, concurrency_key="customer-2")
    queue.set_concurrency_limit("default", 1)
    lease = queue.claim()
    assert lease is not None and lease.task_id == first
    if many:
        assert queue.ack_many_and_claim([lease], [{"ok": True}], limit=5) == []
    else:
        assert lease.ack_and_claim({"ok": True}) is None
    assert lease.finished
    assert queue.get(first).status == "done" and queue.get(first).result == {"ok": True}
    assert queue.get(boom).status == "enqueued"
    assert run_sql(queue, "SELECT key, running FROM {schema}.flow_keys ORDER BY key") == [
        ("customer-1", 0),
        ("customer-2", 0),
    ]


@pytest.mark.parametrize("many", [False, True], ids=["ack_and_claim", "ack_many_and_claim"])
def test_a_session_lost_in_the_claim_after_the_ack_on_a_controlled_queue_is_reported(
    queue: LeaseQueue, many: bool
) -> None:
    # The ack and claim_flow() share a transaction: a session that dies in the claim takes
    # the ack with it. The caller is told, and the lease stays unfinished, to ack again.
    on_claiming(queue, "die", "PERFORM pg_terminate_backend(pg_backend_pid())")
    first = queue.enqueue({"n": 1}, concurrency_key="customer-1")
    dying = queue.enqueue({"die": True}, concurrency_key="customer-2")
    queue.set_concurrency_limit("default", 1)
    lease = queue.claim()
    assert lease is not None and lease.task_id == first
    with pytest.raises(DatabaseUnavailable):
        if many:
            queue.ack_many_and_claim([lease], [{"ok": True}], limit=5)
        else:
            lease.ack_and_claim({"ok": True})
    assert not lease.finished
    assert queue.get(first).status == "processing"
    lease.ack({"ok": True})
    assert queue.get(first).status == "done" and queue.get(dying).status == "enqueued"


def test_ack_many_and_claim_acks_a_batch_and_claims_the_next(queue: LeaseQueue) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(250)])
    leases = queue.claim_many(100, worker_id="w")
    rounds = 0
    while leases:
        rounds += 1
        leases = queue.ack_many_and_claim(
            leases, [{"n": lease.payload["n"]} for lease in leases], limit=100
        )
        assert all(lease.worker_id == "w" for lease in leases)
    assert rounds == 3
    assert statuses(queue) == {"done": 250}
    assert queue.get(ids[7]).result == {"n": 7}


def test_acks_of_many_store_each_result_given_and_none_where_none_was(
    queue: LeaseQueue,
) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(6)])
    leases = queue.ack_many_and_claim(queue.claim_many(2), limit=2)  # no results at all
    leases = queue.ack_many_and_claim(leases, [None, {"n": 3}], limit=2)
    queue.ack_many(leases, [{"n": 4}, None])
    assert [queue.get(i).result for i in ids] == [None, None, None, {"n": 3}, {"n": 4}, None]
    assert statuses(queue) == {"done": 6}


def test_ack_many_and_claim_with_a_lost_lease_acks_the_rest_and_claims_nothing(
    queue: LeaseQueue,
) -> None:
    queue.enqueue_many([{"n": n} for n in range(5)])
    leases = queue.claim_many(3)
    expire(queue, leases[1].task_id)
    queue.sweep()
    with pytest.raises(LeaseLost, match=rf"\[{leases[1].task_id}\].*nothing was claimed"):
        queue.ack_many_and_claim(leases, limit=10)
    assert leases[0].finished and leases[2].finished and not leases[1].finished
    assert statuses(queue) == {"done": 2, "enqueued": 3}


def test_ack_many_and_claim_refuses_what_it_cannot_do_and_changes_nothing(
    queue: LeaseQueue,
) -> None:
    queue.enqueue_many([{"n": n} for n in range(4)])
    queue.enqueue({"n": "x"}, queue="other")
    leases = queue.claim_many(2) + queue.claim_many(1, queue="other")
    with pytest.raises(ConfigurationError, match="one queue and one worker"):
        queue.ack_many_and_claim(leases, limit=5)
    with pytest.raises(ConfigurationError, match="at least one lease"):
        queue.ack_many_and_claim([], limit=5)
    with pytest.raises(ConfigurationError, match="one result per lease"):
        queue.ack_many_and_claim(leases[:2], [None], limit=5)
    assert statuses(queue) == {"processing": 3, "enqueued": 2}


def test_batch_tasks_acked_by_either_are_counted_and_finish_the_batch(queue: LeaseQueue) -> None:
    batch = queue.enqueue_batch([{"n": n} for n in range(30)])
    lease = queue.claim()
    while lease is not None and lease.payload["n"] < 10:
        lease = lease.ack_and_claim()
    leases = [lease] if lease is not None else []
    while leases:
        leases = queue.ack_many_and_claim(leases, limit=7)
    info = queue.batch(batch.id)
    assert (info.done, info.finished) == (30, True)


def test_an_ack_and_claim_rolled_back_by_a_deadlock_is_sent_again_and_goes_through(
    queue: LeaseQueue, dsn: str, settings: LeaseQueueSettings
) -> None:
    leased = queue.enqueue({"n": "leased"}, priority=2)
    waiting = queue.enqueue({"n": "next"}, priority=1)
    # The worker looks for a deadlock 5 s into a wait, the holder only after a minute: the
    # cycle is made well within the first, and the worker's statement is the one rolled
    # back.
    worker = LeaseQueue(
        make_conninfo(dsn, options="-c deadlock_timeout=5s"), schema=queue.schema, settings=settings
    )
    lease = worker.claim()
    assert lease is not None and lease.task_id == leased

    def conclude() -> object:
        try:
            return lease.ack_and_claim()
        except BaseException as exc:  # reported below, in the test's thread
            return exc

    tasks = f'"{queue.schema}".tasks'
    with psycopg.connect(dsn) as holder:
        holder.execute("SET deadlock_timeout = '60s'")
        holder.execute(f"SELECT 1 FROM {tasks} WHERE id = %s FOR UPDATE", (leased,))
        # The statement has locked the next task and waits for the leased one...
        finish = start_blocked(dsn, queue.schema, conclude)
        # ...which the holder now waits for: a deadlock, which the worker's session
        # finds and ends.
        holder.execute(f"SELECT 1 FROM {tasks} WHERE id = %s FOR UPDATE", (waiting,))
        # Sent again, the statement passes over the next task, the holder's now, and waits
        # for the leased one until the holder lets go.
        wait_for_a_lock_waiter(dsn, queue.schema, timeout=30)
        holder.rollback()
    outcome = finish()
    worker.close()
    assert outcome is None
    assert queue.get(leased).status == "done"
    assert queue.get(waiting).status == "enqueued"


@pytest.mark.usefixtures("conflicts_not_retried")
@pytest.mark.parametrize("keyed_every", [1, 2], ids=["all keyed", "every other keyed"])
def test_workers_crossing_keys_never_deadlock_and_keep_counts_right(
    queue: LeaseQueue, keyed_every: int
) -> None:
    # Each statement frees a slot of one key and takes one of another: their rows are
    # written in key order, so two crossing workers cannot each wait for the other. With
    # every other task keyed, a keyless ack's leaner statement (one key taken, by the
    # claim's trigger) runs among them.
    queue.enqueue_many(
        ({"n": n} for n in range(1200)),
        concurrency_key=lambda p: f"key-{p['n'] % 3}" if p["n"] % keyed_every == 0 else None,
    )
    errors: list[BaseException] = []

    def worker(batched: bool) -> None:
        try:
            leases = queue.claim_many(5 if batched else 1)
            while leases:
                if batched:
                    leases = queue.ack_many_and_claim(leases, limit=5)
                else:
                    nxt = leases[0].ack_and_claim()
                    leases = [nxt] if nxt is not None else []
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n % 2 == 0,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    assert statuses(queue) == {"done": 1200}
    assert run_sql(queue, "SELECT sum(running) FROM {schema}.flow_keys") == [(0,)]


def test_a_lease_without_concurrency_key_acks_and_claims_without_the_keys_table(
    queue: LeaseQueue, dsn: str
) -> None:
    plain = queue.enqueue({"n": "plain"}, priority=3)
    other = queue.enqueue({"n": "other plain"}, priority=2)
    keyed = queue.enqueue({"n": "keyed"}, priority=1, concurrency_key="customer-1")
    first = queue.claim()
    assert first is not None and first.task_id == plain
    # The keys' table locked against every other statement: a task without a key acked,
    # and one without a key claimed, go on without it. The statement that counts keys in
    # bulk would wait, whether or not it had a key to count.
    claimed: list[Lease | None] = []
    with psycopg.connect(dsn) as holder:
        holder.execute(f'LOCK TABLE "{queue.schema}".flow_keys IN ACCESS EXCLUSIVE MODE')
        thread = threading.Thread(target=lambda: claimed.append(first.ack_and_claim()))
        thread.start()
        thread.join(timeout=5)
        waited = thread.is_alive()
    thread.join(timeout=30)
    assert not waited
    (second,) = claimed
    assert second is not None and second.task_id == other
    # A keyed task claimed after a keyless ack, then acked: its key counted both ways.
    third = second.ack_and_claim()
    assert third is not None and third.task_id == keyed
    assert run_sql(queue, "SELECT key, running FROM {schema}.flow_keys") == [("customer-1", 1)]
    assert third.ack_and_claim() is None
    assert run_sql(queue, "SELECT key, running FROM {schema}.flow_keys") == [("customer-1", 0)]
    assert statuses(queue) == {"done": 3}


def test_an_attempt_concludes_and_claims_the_next_task_in_one_round_trip(
    queue: LeaseQueue,
) -> None:
    run_sql(queue, "CREATE TABLE {schema}.effects (task_id bigint PRIMARY KEY)")
    ids = queue.enqueue_many([{"n": n} for n in range(3)])
    lease = queue.claim(worker_id="w")
    done = []
    while lease is not None:
        with lease, queue.attempt(lease=lease, claim_next=True) as attempt:
            attempt.connection.execute(
                f'INSERT INTO "{queue.schema}".effects VALUES (%s)', (lease.task_id,)
            )
            attempt.result = {"n": lease.payload["n"]}
        done.append(lease.task_id)
        assert lease.finished
        lease = attempt.claimed
        assert lease is None or (lease.worker_id, lease.queue) == ("w", "default")
    assert done == ids
    assert statuses(queue) == {"done": 3}
    assert run_sql(queue, "SELECT count(*) FROM {schema}.effects") == [(3,)]
    assert queue.get(ids[1]).result == {"n": 1}


def test_an_attempt_whose_lease_was_lost_writes_nothing_and_claims_nothing(
    queue: LeaseQueue,
) -> None:
    run_sql(queue, "CREATE TABLE {schema}.effects (task_id bigint PRIMARY KEY)")
    first, waiting = queue.enqueue_many([{"n": 1}, {"n": 2}])
    zombie = queue.claim()
    assert zombie is not None
    with pytest.raises(LeaseLost), queue.attempt(lease=zombie, claim_next=True) as attempt:
        attempt.connection.execute(
            f'INSERT INTO "{queue.schema}".effects VALUES (%s)', (zombie.task_id,)
        )
        expire(queue, first)
        queue.sweep()
    assert attempt.claimed is None
    assert queue.get(waiting).status == "enqueued"
    assert run_sql(queue, "SELECT count(*) FROM {schema}.effects") == [(0,)]


def test_an_attempt_claims_the_next_task_of_a_controlled_queue_within_its_limit(
    queue: LeaseQueue,
) -> None:
    for n in range(3):
        queue.enqueue({"n": n}, concurrency_key="customer-1")
    queue.set_concurrency_limit("default", 1)
    lease = queue.claim()
    seen = 0
    while lease is not None:
        with lease, queue.attempt(lease=lease, claim_next=True) as attempt:
            pass
        seen += 1
        lease = attempt.claimed
    assert seen == 3
    assert statuses(queue) == {"done": 3}
    assert run_sql(queue, "SELECT sum(running) FROM {schema}.flow_keys") == [(0,)]
    with (
        pytest.raises(ConfigurationError, match="needs a lease"),
        queue.attempt("key", claim_next=True),
    ):
        pass


def test_an_attempt_commits_with_the_next_claim_when_its_task_has_no_key(
    queue: LeaseQueue,
) -> None:
    # One commit to wait for, not two, whether the work ran a statement or not.
    run_sql(queue, "CREATE TABLE {schema}.effects (task_id bigint PRIMARY KEY, xact bigint)")
    _record_transactions(queue)
    ids = queue.enqueue_many([{"n": n} for n in range(3)])
    lease = queue.claim()
    assert lease is not None and lease.keyless
    with queue.attempt(lease=lease, claim_next=True) as attempt:
        pass  # no statement: the attempt's transaction never began
    second = attempt.claimed
    assert second is not None and second.task_id == ids[1] and second.keyless
    assert len(set(_last_commits(queue, ids[:2]))) == 1
    with queue.attempt(lease=second, claim_next=True) as attempt:
        attempt.connection.execute(
            f'INSERT INTO "{queue.schema}".effects VALUES (%s, txid_current())', (second.task_id,)
        )
    third = attempt.claimed
    assert third is not None and third.task_id == ids[2]
    (effect,) = run_sql(queue, "SELECT xact FROM {schema}.effects")
    assert _last_commits(queue, ids[1:]) == [effect[0], effect[0]]


def _record_transactions(queue: LeaseQueue) -> None:
    """Log each task's changes of status with the (top-level) transaction that made them."""
    run_sql(
        queue,
        """
        CREATE TABLE {schema}.changes (task_id bigint, status text, xact bigint);
        CREATE FUNCTION {schema}.log_change() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO {schema}.changes VALUES (NEW.id, NEW.status, txid_current());
            RETURN NULL;
        END $$;
        CREATE TRIGGER log_change AFTER UPDATE OF status ON {schema}.tasks FOR EACH ROW
            EXECUTE FUNCTION {schema}.log_change();
        """,
    )


def _last_commits(queue: LeaseQueue, ids: list[int]) -> list[int]:
    """The transaction that last changed each task's status."""
    rows = run_sql(queue, "SELECT task_id, xact FROM {schema}.changes ORDER BY xact")
    commits = dict(rows)
    return [commits[task_id] for task_id in ids]


def test_an_attempt_on_a_task_with_a_key_commits_apart_from_the_next_claim(
    queue: LeaseQueue,
) -> None:
    # In one transaction, the claim would wait for another key's row while the ack holds
    # its own: two workers crossing keys would deadlock.
    _record_transactions(queue)
    first = queue.enqueue({"n": 1}, concurrency_key="customer-1")
    second = queue.enqueue({"n": 2})
    lease = queue.claim()
    assert lease is not None and lease.task_id == first and not lease.keyless
    with queue.attempt(lease=lease, claim_next=True) as attempt:
        pass
    assert attempt.claimed is not None and attempt.claimed.task_id == second
    assert len(set(_last_commits(queue, [first, second]))) == 2


def test_a_deferred_trigger_of_the_work_runs_with_the_borrowers_settings(
    queue: LeaseQueue,
) -> None:
    # The session is reset after the commit, as at the end of any attempt.
    run_sql(
        queue,
        """
        CREATE TABLE {schema}.effects (task_id bigint PRIMARY KEY, seen text);
        CREATE FUNCTION {schema}.note_setting() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            UPDATE {schema}.effects SET seen = current_setting('app.note', true)
            WHERE task_id = NEW.task_id;
            RETURN NULL;
        END $$;
        CREATE CONSTRAINT TRIGGER note_setting AFTER INSERT ON {schema}.effects
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {schema}.note_setting();
        """,
    )
    queue.enqueue_many([{"n": 1}, {"n": 2}])
    lease = queue.claim()
    assert lease is not None and lease.keyless
    attempt = _conclude_with_an_effect(queue, lease, "SET app.note = 'borrowed'")
    assert attempt.claimed is not None
    assert run_sql(queue, "SELECT seen FROM {schema}.effects") == [("borrowed",)]
    with queue.connection() as conn:
        assert conn.execute("SELECT current_setting('app.note', true)").fetchone() in (
            ("",),
            (None,),
        )


def test_work_under_repeatable_read_concludes_and_claims_the_next_task_apart(
    queue: LeaseQueue,
) -> None:
    run_sql(queue, "CREATE TABLE {schema}.effects (task_id bigint PRIMARY KEY)")
    _record_transactions(queue)
    first, second = queue.enqueue_many([{"n": 1}, {"n": 2}])
    lease = queue.claim()
    assert lease is not None and lease.keyless
    attempt = _conclude_with_an_effect(
        queue, lease, "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"
    )
    assert attempt.claimed is not None and attempt.claimed.task_id == second
    assert queue.get(first).status == "done"
    assert len(set(_last_commits(queue, [first, second]))) == 2


def _conclude_with_an_effect(queue: LeaseQueue, lease: Lease, statement: str) -> Attempt:
    """An attempt with claim_next that runs ``statement``, then writes the task's effect."""
    with queue.attempt(lease=lease, claim_next=True) as attempt:
        attempt.connection.execute(statement)
        attempt.connection.execute(
            f'INSERT INTO "{queue.schema}".effects VALUES (%s)', (lease.task_id,)
        )
    return attempt


@pytest.mark.parametrize(
    "work", [None, "SET LOCAL statement_timeout = '50ms'"], ids=["no statement", "a timeout"]
)
def test_a_claim_that_would_wait_for_a_keys_row_leaves_the_conclusion_to_commit(
    queue: LeaseQueue, dsn: str, work: str | None
) -> None:
    # The claim made with the conclusion waits for a lock briefly (or until the work's
    # statement timeout cuts it), then is made apart: the attempt's commit does not wait
    # for whoever holds the next task's key, nor fail for it.
    first = queue.enqueue({"n": 1})
    keyed = queue.enqueue({"n": 2}, concurrency_key="customer-1")
    run_sql(queue, "INSERT INTO {schema}.flow_keys (queue, key) VALUES ('default', 'customer-1')")
    holder = psycopg.connect(dsn)
    holder.execute(
        f'SELECT * FROM "{queue.schema}".flow_keys WHERE key = %s FOR UPDATE', ("customer-1",)
    )
    seen: list[str] = []

    def release_once_concluded() -> None:
        # Poll from a connection of its own until the first task is done, then let go.
        with psycopg.connect(dsn, autocommit=True) as watcher:
            for _ in range(200):
                row = watcher.execute(
                    f'SELECT status FROM "{queue.schema}".tasks WHERE id = %s', (first,)
                ).fetchone()
                if row and row[0] == "done":
                    seen.append("done while the key was held")
                    break
                threading.Event().wait(0.05)
        holder.rollback()

    releaser = threading.Thread(target=release_once_concluded)
    releaser.start()
    try:
        lease = queue.claim()
        assert lease is not None and lease.task_id == first and lease.keyless
        with queue.attempt(lease=lease, claim_next=True) as attempt:
            if work is not None:
                attempt.connection.execute(work)
    finally:
        releaser.join(timeout=30)
        holder.close()
    assert seen == ["done while the key was held"]
    assert attempt.claimed is not None and attempt.claimed.task_id == keyed


def test_the_lease_claimed_after_a_keyed_conclusion_knows_it_has_no_key(
    queue: LeaseQueue,
) -> None:
    # So that a loop that once concluded apart commits its next claims with it again.
    queue.enqueue({"n": 1}, concurrency_key="customer-1")
    queue.enqueue({"n": 2})
    lease = queue.claim()
    assert lease is not None and not lease.keyless
    with queue.attempt(lease=lease, claim_next=True) as attempt:
        pass
    assert attempt.claimed is not None and attempt.claimed.keyless


def test_a_task_enqueued_while_the_claim_after_a_conclusion_runs_is_not_lost(
    queue: LeaseQueue,
) -> None:
    # claim_one() claims with a snapshot newer than its statement's: here it enqueues a
    # task itself first, as a producer could in between, and claims that one.
    run_sql(
        queue,
        """
        ALTER FUNCTION {schema}.claim_one(text, text, double precision, double precision)
            RENAME TO claim_one_as_installed;
        CREATE FUNCTION {schema}.claim_one(
            p_queue text, p_worker text, p_lease double precision, p_default_lease double precision
        ) RETURNS TABLE (
            id bigint, payload jsonb, priority integer, attempts integer,
            max_attempts integer, lease_token bigint, lease_expires_at timestamptz,
            idempotency_key text, lease_seconds double precision, run_at timestamptz,
            next_token_in double precision
        ) LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO {schema}.tasks (queue, payload, priority, max_attempts)
            VALUES (p_queue, '{"late": true}', 10, 3);
            RETURN QUERY SELECT * FROM {schema}.claim_one_as_installed(
                p_queue, p_worker, p_lease, p_default_lease);
        END $$;
        """,
    )
    queue.enqueue({"n": 1}, concurrency_key="customer-1")  # concluded apart from its claim
    lease = queue.claim()
    assert lease is not None and not lease.keyless
    with queue.attempt(lease=lease, claim_next=True) as attempt:
        pass
    assert attempt.claimed is not None and attempt.claimed.payload == {"late": True}
    assert statuses(queue) == {"done": 1, "processing": 1}


def test_a_session_reset_that_fails_after_the_commit_keeps_the_task_it_claimed(
    queue: LeaseQueue,
) -> None:
    first, second = queue.enqueue_many([{"n": 1}, {"n": 2}])
    lease = queue.claim()
    assert lease is not None and lease.keyless
    break_the_session_reset(queue)
    with queue.attempt(lease=lease, claim_next=True) as attempt:
        pass
    assert queue.get(first).status == "done"
    assert attempt.claimed is not None and attempt.claimed.task_id == second
    attempt.claimed.ack()
    assert statuses(queue) == {"done": 2}


def test_a_failed_claim_and_reset_after_the_attempts_commit_leave_it_concluded(
    queue: LeaseQueue,
) -> None:
    # The claim with the conclusion fails (its row of NULLs), then the session's reset after
    # the commit: the attempt still concludes, its task done, and claims nothing apart on a
    # session it could not reset.
    refuse_to_claim_boom(queue)
    first, boom = queue.enqueue_many([{"n": 1}, {"boom": True}])
    lease = queue.claim()
    assert lease is not None and lease.keyless
    break_the_session_reset(queue)
    with queue.attempt(lease=lease, claim_next=True) as attempt:
        attempt.result = {"ok": True}
    assert attempt.claimed is None and lease.finished
    assert queue.get(first).status == "done" and queue.get(boom).status == "enqueued"
    assert [a.outcome for a in queue.attempts(task_id=first)] == ["succeeded"]


def test_a_claim_that_fails_after_the_attempt_committed_costs_the_attempt_nothing(
    queue: LeaseQueue,
) -> None:
    refuse_to_claim_boom(queue)
    first, boom = queue.enqueue_many([{"n": 1}, {"boom": True}])
    lease = queue.claim()
    assert lease is not None
    with queue.attempt(lease=lease, claim_next=True) as attempt:
        attempt.result = {"ok": True}
    assert attempt.claimed is None
    assert lease.finished
    assert queue.get(first).status == "done" and queue.get(first).result == {"ok": True}
    assert queue.get(boom).status == "enqueued"
    assert [a.outcome for a in queue.attempts(task_id=first)] == ["succeeded"]


def test_a_worker_whose_handler_raises_after_its_attempt_strands_no_task(
    queue: LeaseQueue,
) -> None:
    queue.enqueue_many([{"n": n} for n in range(3)], max_attempts=1)

    def handler(payload: dict[str, Any], lease: Any) -> None:
        with queue.attempt(lease=lease):
            pass  # concluded, and the next task claimed with it
        raise ValueError("after the attempt")

    summary = run_worker(queue, handler, burst=True)
    assert summary.outcomes == {"failed": 3}
    assert statuses(queue) == {"done": 3}


def test_ack_many_and_claim_refuses_a_lease_given_twice(queue: LeaseQueue) -> None:
    queue.enqueue_many([{"n": n} for n in range(3)])
    leases = queue.claim_many(2)
    with pytest.raises(ConfigurationError, match="same lease twice"):
        queue.ack_many_and_claim([leases[0], leases[0], leases[1]], limit=1)
    assert statuses(queue) == {"processing": 2, "enqueued": 1}


def test_a_statement_timeout_that_cuts_the_ack_of_a_conclusion_is_not_waited_out(
    queue: LeaseQueue, dsn: str
) -> None:
    # The ack made with the claim waits for its row, which another session holds, until the
    # work's statement timeout cuts it. The conclusion then fails at once (the ack made
    # again alone keeps the claim's lock timeout), not when the row is let go: the work's
    # timeout holds, and nothing is written.
    run_sql(queue, "CREATE TABLE {schema}.effects (task_id bigint PRIMARY KEY)")
    first, _ = queue.enqueue_many([{"n": 1}, {"n": 2}])
    lease = queue.claim()
    assert lease is not None and lease.task_id == first and lease.keyless
    errors: list[BaseException] = []

    def conclude() -> None:
        try:
            _conclude_with_an_effect(queue, lease, "SET LOCAL statement_timeout = '50ms'")
        except LeaseQueueError as exc:
            errors.append(exc)

    concluding = f"%{queue.schema}%conclude_claim_and_begin%"

    def concluding_now(watcher: psycopg.Connection[Any]) -> bool:
        row = watcher.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE %s",
            (concluding,),
        ).fetchone()
        return row != (0,)

    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as watcher:
        holder.execute(f'SELECT 1 FROM "{queue.schema}".tasks WHERE id = %s FOR UPDATE', (first,))
        worker = threading.Thread(target=conclude, daemon=True)
        worker.start()
        for _ in range(200):  # until the conclusion runs (or has already ended)
            if concluding_now(watcher):
                break
            threading.Event().wait(0.02)
        ended = False
        for _ in range(100):  # up to 5 s, where the lease's bound on the wait is 30 s
            if not concluding_now(watcher):
                ended = True
                break
            threading.Event().wait(0.05)
        holder.rollback()
        worker.join(timeout=60)
    assert ended, "the conclusion waited for the row after the work's timeout cut it"
    assert errors, "the conclusion failed"
    assert run_sql(queue, "SELECT count(*) FROM {schema}.effects") == [(0,)]
