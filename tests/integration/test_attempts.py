"""Attempts: effects, success mark and fenced ack in one commit; duplicates skipped."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import TypeVar

import psycopg
import pytest

from dagster_leasequeue import (
    Attempt,
    ConfigurationError,
    DatabaseUnavailable,
    Lease,
    LeaseLost,
    LeaseQueue,
    LeaseQueueError,
    LeaseQueueSettings,
    migrations,
    sql,
)
from dagster_leasequeue.attempts import attempt_target

from ..helpers import expire, run_sql, start_blocked
from ..relay import CommitCutter

T = TypeVar("T")


@pytest.fixture
def results(queue: LeaseQueue) -> LeaseQueue:
    run_sql(queue, "CREATE TABLE {schema}.results (doc text PRIMARY KEY, pages int)")
    return queue


def write_result(attempt: Attempt, doc: str, pages: int) -> None:
    schema = _schema[0]
    attempt.connection.execute(f'INSERT INTO "{schema}".results VALUES (%s, %s)', (doc, pages))


_schema: list[str] = []


@pytest.fixture(autouse=True)
def _remember_schema(schema_name: str) -> None:
    _schema[:] = [schema_name]


def count_results(queue: LeaseQueue) -> int:
    return int(run_sql(queue, "SELECT count(*) FROM {schema}.results")[0][0])


def test_effect_success_and_ack_commit_together(results: LeaseQueue) -> None:
    queue = results
    task_id = queue.enqueue({"doc": "invoice.pdf"}, idempotency_key="invoice.pdf")
    lease = queue.claim()
    assert lease is not None
    with lease, queue.attempt(lease=lease) as attempt:
        assert not attempt.duplicate and attempt.number == 1
        assert attempt.key == "invoice.pdf"
        write_result(attempt, "invoice.pdf", 2)
        attempt.result = {"pages": 2}
    info = queue.get(task_id)
    assert info.status == "done" and info.result == {"pages": 2}
    assert count_results(queue) == 1
    (record,) = queue.attempts("invoice.pdf", queue="default")
    assert (record.outcome, record.attempt, record.task_id) == ("succeeded", 1, task_id)
    assert record.finished_at is not None and record.worker_id == lease.worker_id


def test_a_duplicate_is_skipped_and_acked_with_the_first_result(results: LeaseQueue) -> None:
    queue = results
    with queue.attempt("contract-9") as attempt:
        write_result(attempt, "contract-9", 200)
        attempt.result = {"pages": 200}
    task_id = queue.enqueue({"doc": "contract-9"})
    lease = queue.claim()
    assert lease is not None
    with queue.attempt("contract-9", lease=lease) as attempt:
        assert attempt.duplicate and attempt.result == {"pages": 200}
    assert queue.get(task_id).status == "done"
    assert queue.get(task_id).result == {"pages": 200}
    assert count_results(queue) == 1
    assert [r.outcome for r in queue.attempts("contract-9")] == ["succeeded", "skipped"]


def test_an_error_rolls_back_the_effect_and_keeps_the_key_open(results: LeaseQueue) -> None:
    queue = results
    task_id = queue.enqueue({"doc": "scan.pdf"})
    lease = queue.claim()
    assert lease is not None
    with pytest.raises(RuntimeError, match="ocr"), lease, queue.attempt(lease=lease) as attempt:
        write_result(attempt, "scan.pdf", 1)
        raise RuntimeError("ocr crashed")
    assert count_results(queue) == 0
    info = queue.get(task_id)
    assert info.status == "enqueued" and info.last_error == "RuntimeError: ocr crashed"
    run_sql(queue, "UPDATE {schema}.tasks SET run_at = clock_timestamp()")
    lease = queue.claim()
    assert lease is not None and lease.attempt == 2
    with queue.attempt(lease=lease) as attempt:
        assert not attempt.duplicate and attempt.number == 2
        write_result(attempt, "scan.pdf", 1)
    assert count_results(queue) == 1
    outcomes = [(r.outcome, r.error) for r in queue.attempts(task_id=task_id)]
    assert outcomes == [("failed", "RuntimeError: ocr crashed"), ("succeeded", None)]


def test_a_transaction_block_as_the_first_statement_commits_with_the_attempt(
    results: LeaseQueue,
) -> None:
    # psycopg would make the block the outer transaction and commit it at its end.
    queue = results
    queue.enqueue({"doc": "first.pdf"})
    lease = queue.claim()
    assert lease is not None
    with pytest.raises(RuntimeError, match="after"), queue.attempt(lease=lease) as attempt:
        with attempt.connection.transaction():
            write_result(attempt, "first.pdf", 1)
        raise RuntimeError("failed after the block")
    assert count_results(queue) == 0
    run_sql(queue, "UPDATE {schema}.tasks SET run_at = clock_timestamp()")
    lease = queue.claim()
    assert lease is not None
    with queue.attempt(lease=lease) as attempt:
        # A block that fails inside the attempt is a savepoint: only it is rolled back.
        with pytest.raises(RuntimeError), attempt.connection.transaction():
            write_result(attempt, "draft.pdf", 1)
            raise RuntimeError("discard the draft")
        with attempt.connection.transaction():
            write_result(attempt, "first.pdf", 1)
    assert run_sql(queue, "SELECT doc FROM {schema}.results") == [("first.pdf",)]
    assert [r.outcome for r in queue.attempts(task_id=lease.task_id)] == [
        "failed",
        "succeeded",
    ]


def test_a_lost_lease_rolls_back_the_effect(results: LeaseQueue) -> None:
    queue = results
    task_id = queue.enqueue({"doc": "report.pdf"})
    stale = queue.claim()
    assert stale is not None
    with (
        pytest.raises(LeaseLost, match=r"cannot ack .* claimed again under token"),
        queue.attempt(lease=stale) as attempt,
    ):
        write_result(attempt, "report.pdf", 5)
        expire(queue, task_id)
        queue.sweep()
        fresh = queue.claim()
    assert count_results(queue) == 0
    assert [r.outcome for r in queue.attempts(task_id=task_id)] == ["failed"]
    assert fresh is not None
    with queue.attempt(lease=fresh) as attempt:
        assert not attempt.duplicate
        write_result(attempt, "report.pdf", 5)
    assert count_results(queue) == 1 and queue.get(task_id).status == "done"


def test_an_attempt_that_runs_no_statement_acks_in_one_round_trip(queue: LeaseQueue) -> None:
    # Its result is written, its success marked and its lease acked without a transaction
    # opened for the purpose; a lost lease still writes nothing.
    notices: list[str] = []
    done_id = queue.enqueue({"n": 1})
    lease = queue.claim()
    assert lease is not None
    with queue.attempt(lease=lease) as attempt:
        attempt.connection.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        attempt.result = {"computed": True}
    assert queue.get(done_id).status == "done"
    assert queue.get(done_id).result == {"computed": True}
    assert [r.outcome for r in queue.attempts(task_id=done_id)] == ["succeeded"]
    assert notices == []  # no "there is no transaction in progress"

    lost_id = queue.enqueue({"n": 2})
    stale = queue.claim()
    assert stale is not None
    with (
        pytest.raises(LeaseLost, match="claimed again"),
        queue.attempt(lease=stale) as attempt,
    ):
        expire(queue, lost_id)
        queue.sweep()
        fresh = queue.claim()
        attempt.result = {"computed": True}
    assert fresh is not None and queue.get(lost_id).status == "processing"
    assert queue.get(lost_id).result is None
    assert [r.outcome for r in queue.attempts(task_id=lost_id)] == ["failed"]


def test_a_unique_violation_of_the_callers_own_at_commit_is_an_error_not_a_duplicate(
    queue: LeaseQueue,
) -> None:
    # A deferred constraint is checked by the COMMIT that ends the attempt, in the same
    # round trip as the success mark; only the package's success index means "duplicate".
    run_sql(
        queue,
        "CREATE TABLE {schema}.ledger (entry text UNIQUE DEFERRABLE INITIALLY DEFERRED)",
    )
    run_sql(queue, "INSERT INTO {schema}.ledger VALUES ('taken')")
    task_id = queue.enqueue({"entry": "taken"})
    lease = queue.claim()
    assert lease is not None
    with (
        pytest.raises(LeaseQueueError, match="UniqueViolation"),
        queue.attempt(lease=lease) as attempt,
    ):
        attempt.connection.execute(f'INSERT INTO "{queue.schema}".ledger VALUES (%s)', ("taken",))
    assert [r.outcome for r in queue.attempts(task_id=task_id)] == ["failed"]
    assert queue.get(task_id).status == "enqueued"  # failed back, to be retried
    assert run_sql(queue, "SELECT count(*) FROM {schema}.ledger")[0][0] == 1


def test_a_stale_lease_cannot_start_an_attempt_after_its_renewal_failed(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    lease = queue.claim(lease_seconds=0.3)
    assert lease is not None
    with pytest.raises(LeaseLost), lease:
        queue.cancel(task_id)
        time.sleep(0.5)
        with queue.attempt(lease=lease):
            pytest.fail("the attempt should not start")


@pytest.mark.parametrize("lost", ["cancelled", "swept", "claimed_again"])
def test_an_attempt_on_a_lease_lost_since_its_last_renewal_is_refused_before_its_work(
    queue: LeaseQueue, lost: str
) -> None:
    # The lease does not know yet (no renewal has come back since): the start finds that
    # the lease no longer holds its task, and the work never runs. An earlier attempt's
    # record left running (its worker died) is not marked by the refused start either.
    task_id = queue.enqueue({"n": 1})
    stale = queue.claim()
    assert stale is not None
    if lost == "cancelled":
        assert queue.cancel(task_id)
        reason = r"recovered or cancelled \(now cancelled\)"
    else:
        _begun_by_a_worker_that_dies(queue, stale)
        expire(queue, task_id)
        queue.sweep()
        reason = r"recovered or cancelled \(now enqueued\)"
        if lost == "claimed_again":
            assert queue.claim() is not None
            reason = r"claimed again under token"
    before = [(a.id, a.outcome) for a in queue.attempts(task_id=task_id)]
    with (
        pytest.raises(LeaseLost, match=rf"cannot begin an attempt on task {task_id} .*{reason}"),
        queue.attempt(lease=stale),
    ):
        pytest.fail("the work ran on a lost lease")
    assert [(a.id, a.outcome) for a in queue.attempts(task_id=task_id)] == before


def test_an_abandoned_attempt_is_marked_and_retried(queue: LeaseQueue) -> None:
    run_sql(
        queue,
        "INSERT INTO {schema}.attempts (identity, key, attempt, outcome)"
        " VALUES ('key:k', 'k', 1, 'running')",
    )
    with queue.attempt("k") as attempt:
        assert attempt.number == 2 and attempt.abandoned == 1 and not attempt.duplicate
    assert [r.outcome for r in queue.attempts("k")] == ["abandoned", "succeeded"]


def test_concurrent_attempts_of_one_key_commit_one_success(results: LeaseQueue) -> None:
    queue = results
    entered = threading.Event()
    outcomes: list[tuple[str, bool]] = []

    def slow_first() -> None:
        with queue.attempt("shared") as attempt:
            entered.set()
            time.sleep(0.5)
            write_result(attempt, "shared-slow", 1)
        outcomes.append(("slow", attempt.duplicate))

    first = threading.Thread(target=slow_first)
    first.start()
    entered.wait()
    # No lock is held across the work: this attempt runs at once and commits first.
    with queue.attempt("shared") as attempt:
        assert not attempt.duplicate
        write_result(attempt, "shared-fast", 2)
    outcomes.append(("fast", attempt.duplicate))
    first.join()
    assert outcomes == [("fast", False), ("slow", True)]
    assert run_sql(queue, "SELECT pages FROM {schema}.results") == [(2,)]
    assert sorted(r.outcome for r in queue.attempts("shared")) == ["skipped", "succeeded"]


def test_a_paused_attempt_does_not_hold_up_its_replacement(results: LeaseQueue) -> None:
    """A zombie inside an attempt (here: a thread that waits) must not block the new holder."""
    queue = results
    task_id = queue.enqueue({"doc": "z.pdf"})
    zombie = queue.claim(lease_seconds=2)
    assert zombie is not None
    resume = threading.Event()
    errors: list[BaseException] = []

    def zombie_worker() -> None:
        try:
            with queue.attempt(lease=zombie) as attempt:
                write_result(attempt, "z.pdf", 666)
                resume.wait()
        except BaseException as exc:
            errors.append(exc)

    paused = threading.Thread(target=zombie_worker)
    paused.start()
    time.sleep(0.2)
    expire(queue, task_id)
    queue.sweep()
    fresh = queue.claim()
    assert fresh is not None
    started = time.monotonic()
    # The zombie's open transaction holds the row "z.pdf" until the server ends its idle
    # session, after the zombie's lease length.
    with queue.attempt(lease=fresh) as attempt:
        write_result(attempt, "z.pdf", 1)
    assert time.monotonic() - started < 6
    resume.set()
    paused.join()
    assert len(errors) == 1 and isinstance(errors[0], LeaseLost)
    assert run_sql(queue, "SELECT pages FROM {schema}.results") == [(1,)]
    assert queue.get(task_id).status == "done"


def test_an_attempt_keeps_its_lease_alive_with_a_pool_of_one(make_queue) -> None:  # type: ignore[no-untyped-def]
    queue = make_queue(pool_size=1)
    queue.install()
    task_id = queue.enqueue({"n": 1})
    lease = queue.claim(lease_seconds=0.6)
    assert lease is not None
    started = time.monotonic()
    with lease, queue.attempt(lease=lease):
        time.sleep(1.5)  # the only pooled connection is busy; renewals must still land
    assert time.monotonic() - started < 5
    assert queue.get(task_id).status == "done" and not lease.lost


def test_an_attempt_key_cannot_block_the_sweeper(queue: LeaseQueue) -> None:
    with queue.attempt("sweep"):
        started = time.monotonic()
        queue.sweep()
        assert time.monotonic() - started < 1


def test_attempt_needs_a_key_or_a_lease(queue: LeaseQueue) -> None:
    with pytest.raises(ConfigurationError, match="needs a key"), queue.attempt():
        pass


def session_setting(queue: LeaseQueue, name: str) -> str:
    with queue.connection() as conn:
        return str(conn.execute(f"SELECT current_setting('{name}')").fetchone()[0])  # type: ignore[index]


@pytest.mark.parametrize("claim_next", [False, True], ids=["alone", "claim_next"])
def test_an_attempt_whose_work_used_no_connection_concludes_in_one_prepared_statement(
    make_queue: Callable[..., LeaseQueue], claim_next: bool
) -> None:
    # Nothing in the session to reset: the conclusion (with the next claim) is one
    # statement, prepared once per connection as the worker loop's, not a script the
    # server parses and plans each time.
    queue = make_queue(pool_size=1)
    queue.install()
    first, second = queue.enqueue_many([{"n": 1}, {"n": 2}])
    lease = queue.claim()
    assert lease is not None and lease.task_id == first
    with queue.attempt(lease=lease, claim_next=claim_next) as attempt:
        attempt.result = {"computed": True}
    assert queue.get(first).status == "done" and queue.get(first).result == {"computed": True}
    assert [r.outcome for r in queue.attempts(task_id=first)] == ["succeeded"]
    if claim_next:
        assert attempt.claimed is not None and attempt.claimed.task_id == second
        assert queue.get(second).status == "processing"
    with queue.connection() as conn:
        prepared = conn.execute(
            "SELECT statement FROM pg_prepared_statements WHERE NOT from_sql"
        ).fetchall()
    function = "conclude_claim_and_begin" if claim_next else "conclude_attempt"
    assert [text for (text,) in prepared if f".{function}(" in text]


@pytest.mark.parametrize("ending", ["success", "error", "duplicate", "committed"])
def test_settings_made_in_an_attempt_do_not_outlive_it(
    make_queue: Callable[..., LeaseQueue], ending: str
) -> None:
    # A pool of one: the next borrower gets the attempt's own connection.
    queue = make_queue(pool_size=1)
    queue.install()
    default_work_mem = session_setting(queue, "work_mem")
    default_idle_timeout = session_setting(queue, "idle_in_transaction_session_timeout")
    default_synchronous_commit = session_setting(queue, "synchronous_commit")
    if ending == "duplicate":
        with queue.attempt("report") as first:
            assert not first.duplicate
    expected_error = pytest.raises(RuntimeError) if ending == "error" else nullcontext()
    with expected_error, queue.attempt("report") as attempt:
        assert attempt.duplicate == (ending == "duplicate")
        attempt.connection.execute("SET work_mem = '7MB'")
        if ending == "error":
            raise RuntimeError("the work failed")
        if ending == "committed":
            # The work commits itself: no transaction is left, but the setting is.
            attempt.connection.commit()
    assert session_setting(queue, "work_mem") == default_work_mem
    # Nor does the attempt's own idle-in-transaction timeout.
    idle_timeout = session_setting(queue, "idle_in_transaction_session_timeout")
    assert idle_timeout == default_idle_timeout
    # The start record's asynchronous commit was for its own transaction only.
    assert session_setting(queue, "synchronous_commit") == default_synchronous_commit


def _drain_with_attempts(queue: LeaseQueue, queue_name: str) -> list[bool]:
    """Claim and run every task of ``queue_name`` through an attempt; the duplicate flags."""
    duplicates = []
    while (lease := queue.claim(queue=queue_name)) is not None:
        with lease, queue.attempt(lease=lease) as attempt:
            duplicates.append(attempt.duplicate)
            if not attempt.duplicate:
                write_result(attempt, f"{queue_name}:{lease.payload['to']}", 1)
    return duplicates


def test_the_same_idempotency_key_in_two_queues_is_two_pieces_of_work(
    results: LeaseQueue,
) -> None:
    queue = results
    email = queue.enqueue({"to": "user-42"}, queue="email", idempotency_key="user-42")
    sms = queue.enqueue({"to": "user-42"}, queue="sms", idempotency_key="user-42")
    assert _drain_with_attempts(queue, "email") == [False]
    assert _drain_with_attempts(queue, "sms") == [False]
    assert sorted(doc for (doc,) in run_sql(queue, "SELECT doc FROM {schema}.results")) == [
        "email:user-42",
        "sms:user-42",
    ]
    assert queue.get(email).status == queue.get(sms).status == "done"
    assert len(queue.attempts("user-42", queue="email")) == 1
    assert len(queue.attempts("user-42", queue="sms")) == 1
    # Within one queue the key still names one piece of work.
    queue.enqueue({"to": "user-42"}, queue="email", idempotency_key="user-42")
    assert _drain_with_attempts(queue, "email") == [True]


def test_a_chosen_key_never_meets_a_keyless_task(results: LeaseQueue) -> None:
    queue = results
    keyless = queue.enqueue({"to": "keyless"}, queue="mail")
    # The string a keyless task's attempts were once recorded under.
    queue.enqueue({"to": "keyed"}, queue="mail", idempotency_key=f"mail:{keyless}")
    assert _drain_with_attempts(queue, "mail") == [False, False]
    with queue.attempt(f"mail:{keyless}") as attempt:
        assert not attempt.duplicate
    assert [r.outcome for r in queue.attempts(task_id=keyless)] == ["succeeded"]


def test_a_key_of_your_own_is_shared_across_queues_and_tasks(results: LeaseQueue) -> None:
    queue = results
    with queue.attempt("monthly-report") as attempt:
        attempt.result = {"sent": True}
    queue.enqueue({"to": "x"}, queue="reports", idempotency_key="monthly-report")
    lease = queue.claim(queue="reports")
    assert lease is not None
    with queue.attempt("monthly-report", lease=lease) as attempt:
        assert attempt.duplicate and attempt.result == {"sent": True}
    # The task's own idempotency key is another space: its work was never done.
    assert queue.attempts("monthly-report", queue="reports") == []
    assert [r.outcome for r in queue.attempts("monthly-report")] == ["succeeded", "skipped"]


def test_attempts_needs_a_key_or_a_task(queue: LeaseQueue) -> None:
    with pytest.raises(ConfigurationError, match="key or a task_id"):
        queue.attempts()
    with pytest.raises(ConfigurationError, match="not both"):
        queue.attempts("k", task_id=1)


def test_the_migration_keeps_what_attempt_records_mean(
    dsn: str, schema_name: str, make_queue: Callable[..., LeaseQueue]
) -> None:
    import psycopg

    from dagster_leasequeue import migrations, sql as statements

    # A schema at version 4, holding records written under the old key scheme.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statements.compose(statements.CREATE_SCHEMA, schema_name))
        conn.execute(statements.compose(statements.CREATE_VERSION_TABLE, schema_name))
        for migration in migrations.MIGRATIONS[:4]:
            for statement in migration.statements:
                conn.execute(statements.compose(statement, schema_name))
            conn.execute(
                statements.compose(statements.RECORD_VERSION, schema_name),
                {"version": migration.version, "description": migration.description},
            )
        tasks = f'"{schema_name}".tasks'
        keyed, keyless, gone, gone_keyed = (
            conn.execute(
                f"INSERT INTO {tasks} (queue, payload, idempotency_key, max_attempts, status)"
                " VALUES (%s, '{}', %s, 3, 'done') RETURNING id",
                (queue_name, key),
            ).fetchone()[0]  # type: ignore[index]
            for queue_name, key in [
                ("email", "user-42"),
                ("email", None),
                ("email", None),
                ("billing", "invoice-7"),
            ]
        )
        conn.execute(f"DELETE FROM {tasks} WHERE id = ANY(%s)", ([gone, gone_keyed],))
        old_records = [
            ("user-42", keyed),  # a task's idempotency key
            (f"email:{keyless}", keyless),  # a keyless task's default key
            ("chosen", None),  # a key of the caller's own
            ("chosen-with-lease", keyed),  # a key of the caller's own, given with a lease
            (f"email:{gone}", gone),  # a keyless task since purged
            ("invoice-7", gone_keyed),  # a keyed task since purged
        ]
        for key, task_id in old_records:
            conn.execute(
                f'INSERT INTO "{schema_name}".attempts (key, attempt, task_id, outcome)'
                " VALUES (%s, 1, %s, 'succeeded')",
                (key, task_id),
            )
    queue = make_queue()
    assert queue.install() == migrations.LATEST_VERSION - 4
    assert [r.outcome for r in queue.attempts("user-42", queue="email")] == ["succeeded"]
    assert queue.attempts("user-42", queue="sms") == []
    assert queue.attempts("user-42") == []
    assert [r.key for r in queue.attempts(task_id=keyless)] == [None]
    assert queue.attempts(f"email:{keyless}") == []
    assert [r.task_id for r in queue.attempts("chosen")] == [None]
    assert [r.task_id for r in queue.attempts("chosen-with-lease")] == [keyed]
    assert [r.key for r in queue.attempts(f"email:{gone}")] == [f"email:{gone}"]
    # A record whose task is gone keeps its old meaning: the key's work, in every queue.
    for queue_name in ("billing", "reports"):
        queue.enqueue({"to": "x"}, queue=queue_name, idempotency_key="invoice-7")
        old_lease = queue.claim(queue=queue_name)
        assert old_lease is not None
        with queue.attempt(lease=old_lease) as attempt:
            assert attempt.duplicate
    with queue.attempt("invoice-7") as attempt:
        assert attempt.duplicate
    # A worker of the earlier release, during a rolling upgrade, still records attempts.
    run_sql(
        queue,
        "INSERT INTO {schema}.attempts (key, attempt, outcome) VALUES ('old-worker', 1, 'running')",
    )
    assert [r.outcome for r in queue.attempts("old-worker")] == ["running"]
    # The migrated success still makes a new task of the same queue and key a duplicate.
    queue.enqueue({"to": "user-42"}, queue="email", idempotency_key="user-42")
    lease = queue.claim(queue="email")
    assert lease is not None
    with queue.attempt(lease=lease) as attempt:
        assert attempt.duplicate


@pytest.mark.parametrize("begun", ["apart", "with_the_claim"])
def test_a_running_record_of_an_earlier_release_is_counted_not_marked_abandoned(
    queue: LeaseQueue, begun: str
) -> None:
    # The start reads the key's records of an earlier release (migration 5) beside those of
    # its own identity, but marks abandoned only running records of its own: a worker of
    # the earlier release may still be at work on its record during a rolling upgrade.
    run_sql(
        queue,
        "INSERT INTO {schema}.attempts (key, attempt, outcome) VALUES ('invoice-7', 1, 'running')",
    )
    if begun == "apart":
        queue.enqueue({"n": 1}, idempotency_key="invoice-7")
        lease = queue.claim()
    else:
        _, lease = _chain_to_second(queue, idempotency_key="invoice-7")
    assert lease is not None
    with queue.attempt(lease=lease) as attempt:
        assert (attempt.number, attempt.abandoned, attempt.duplicate) == (2, 0, False)
    assert [r.outcome for r in queue.attempts("invoice-7")] == ["running"]
    assert [r.outcome for r in queue.attempts(task_id=lease.task_id)] == ["running", "succeeded"]


def test_a_connection_lost_inside_an_attempt_raises_database_unavailable(
    queue: LeaseQueue, dsn: str
) -> None:
    """A server that drops the attempt's connection (a restart, a failover) is the
    database's failure, not the caller's SQL: it surfaces as DatabaseUnavailable."""
    queue.enqueue({"n": 1})
    lease = queue.claim()
    assert lease is not None
    with pytest.raises(DatabaseUnavailable) as raised, queue.attempt(lease=lease) as attempt:
        row = attempt.connection.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (row[0],))
        attempt.connection.execute("SELECT 1")
    assert "lost or could not open the connection" in str(raised.value)
    # Nothing concluded the task; the queue's other connections still work.
    assert not lease.finished
    lease.release()
    again = queue.claim()
    assert again is not None
    with queue.attempt(lease=again) as attempt:
        attempt.connection.execute("SELECT 1")
    assert queue.get(again.task_id).status == "done"


@pytest.mark.parametrize("keyed", [False, True], ids=["keyless", "keyed"])
@pytest.mark.parametrize("claim_next", [False, True], ids=["alone", "claim_next"])
def test_a_connection_cut_right_after_the_commit_leaves_the_attempt_concluded(
    dsn: str, schema_name: str, settings: LeaseQueueSettings, claim_next: bool, keyed: bool
) -> None:
    """The server committed the conclusion, and the connection went before its reply came:
    the attempt asks the database, finds its success, and reports none of it as a failure."""
    with (
        CommitCutter(dsn) as relay,
        LeaseQueue(relay.dsn, schema=schema_name, settings=settings) as queue,
    ):
        queue.install()
        first = queue.enqueue({"n": 1}, concurrency_key="k" if keyed else None)
        queue.enqueue({"n": 2})
        lease = queue.claim()
        assert lease is not None and lease.task_id == first
        relay.arm()
        with queue.attempt(lease=lease, claim_next=claim_next) as attempt:
            attempt.connection.execute("SELECT 1")
            attempt.result = {"n": 1}
        assert relay.cut.is_set()
        assert lease.finished and attempt.claimed is None
        info = queue.get(first)
        assert (info.status, info.result) == ("done", {"n": 1})
        assert [a.outcome for a in queue.attempts(task_id=first)] == ["succeeded"]


def test_the_attempts_start_reads_its_records_by_index_whatever_the_tables_size(
    queue: LeaseQueue, dsn: str
) -> None:
    # The start (begin_attempt(), migration 30) keeps its statements' plans for the session,
    # and their generic plans are made while the table is nearly empty; with no ANALYZE after
    # (autovacuum off, or not yet run) those plans stay. A sequential read of every record
    # would then make each attempt slower than the one before. Each statement that reads
    # records (the probe, the look-ups with and without an earlier release's identity, the
    # running records marked abandoned) is prepared here with its parameters' types, as
    # PL/pgSQL prepares it.
    for key in ("a", "b", "c", "d", "e"):  # the table when the start is first planned
        with queue.attempt(key):
            pass
    reads = re.findall(
        r"^ *(PERFORM FROM .*?|SELECT count\(\*\).*?|UPDATE .*?);$",
        migrations._BEGIN_ATTEMPT_STATEMENTS,
        flags=re.DOTALL | re.MULTILINE,
    )
    assert len(reads) == 4, reads
    with psycopg.connect(dsn) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        for number, read in enumerate(reads):
            query = re.sub(r"^ *INTO .*$", "", read, flags=re.MULTILINE)
            query = re.sub(r"^PERFORM\b", "SELECT", query)  # as PL/pgSQL runs it
            for parameter, name in enumerate(("p_identity", "p_legacy_identity", "v_running")):
                query = re.sub(rf"\b{name}\b", f"${parameter + 1}", query)
            conn.execute(
                f"PREPARE read_{number} (text, text, bigint[]) AS "
                + query.replace("{schema}", f'"{queue.schema}"')
            )
            plan = "\n".join(
                row[0] for row in conn.execute(f"EXPLAIN EXECUTE read_{number}(NULL, NULL, NULL)")
            )
            assert "Index" in plan and "Seq Scan on attempts" not in plan, plan
        conn.rollback()


def _chain_to_second(queue: LeaseQueue, **second: object) -> tuple[int, Lease]:
    """Enqueue two tasks and run the first's attempt with claim_next: the first task's id
    and the lease its conclusion claimed (the second task, ``second`` its enqueue options)."""
    first = queue.enqueue({"n": 1})
    queue.enqueue({"n": 2}, **second)  # type: ignore[arg-type]
    lease = queue.claim()
    assert lease is not None and lease.task_id == first
    with queue.attempt(lease=lease, claim_next=True) as attempt:
        attempt.result = {"n": 1}
    assert attempt.claimed is not None
    return first, attempt.claimed


def test_the_commit_that_claims_a_task_with_an_attempt_begins_its_attempt(
    queue: LeaseQueue,
) -> None:
    # The claimed task's start record commits with its claim; the attempt on its lease takes
    # it instead of beginning one of its own (one round trip a task in the loop, not two).
    _, claimed = _chain_to_second(queue)
    (begun,) = queue.attempts(task_id=claimed.task_id)
    assert (begun.outcome, begun.attempt, begun.worker_id) == ("running", 1, claimed.worker_id)
    with queue.attempt(lease=claimed) as attempt:
        assert (attempt.id, attempt.number, attempt.duplicate) == (begun.id, 1, False)
        attempt.result = {"n": 2}
    assert [(a.id, a.outcome) for a in queue.attempts(task_id=claimed.task_id)] == [
        (begun.id, "succeeded")
    ]
    assert queue.get(claimed.task_id).result == {"n": 2}


def test_a_task_whose_work_succeeded_is_claimed_with_its_attempt_a_duplicate(
    results: LeaseQueue,
) -> None:
    # The start record made with the claim reads the work's success, as a start made apart:
    # the identity the claim gives the task's work is the one attempts() looks up.
    queue = results
    earlier = queue.enqueue({"to": "a"}, idempotency_key="report")
    lease = queue.claim()
    assert lease is not None and lease.task_id == earlier
    with queue.attempt(lease=lease) as attempt:
        write_result(attempt, "report", 1)
        attempt.result = {"pages": 1}
    _, claimed = _chain_to_second(queue, idempotency_key="report")
    with queue.attempt(lease=claimed) as attempt:
        assert attempt.duplicate and attempt.result == {"pages": 1}
        assert attempt.key == "report"
    assert count_results(queue) == 1
    outcomes = [a.outcome for a in queue.attempts("report", queue=claimed.queue)]
    assert outcomes == ["succeeded", "skipped"]


def test_an_attempt_that_names_another_worker_records_it(queue: LeaseQueue) -> None:
    # The start record made with the claim names the claim's worker: an attempt on the
    # lease under another worker id makes its own record, and the claim's is taken back.
    _, claimed = _chain_to_second(queue)
    with queue.attempt(lease=claimed, worker_id="another-worker") as attempt:
        assert attempt.number == 1
    records = queue.attempts(task_id=claimed.task_id)
    assert [(r.worker_id, r.outcome) for r in records] == [("another-worker", "succeeded")]


@pytest.mark.parametrize("ending", ["ack", "fail", "release", "ack_many", "keyed attempt"])
def test_a_start_record_that_its_lease_did_not_use_is_taken_back(
    queue: LeaseQueue, ending: str
) -> None:
    # A lease claimed with an attempt's conclusion but ended otherwise: its task's attempts
    # list only the attempts made.
    _, claimed = _chain_to_second(queue)
    if ending == "ack":
        claimed.ack({"n": 2})
    elif ending == "fail":
        claimed.fail("no", retry_in=0)
    elif ending == "release":
        claimed.release()
    elif ending == "ack_many":
        queue.ack_many([claimed])
    else:
        with queue.attempt("a key of my own", lease=claimed):
            pass
        assert [a.outcome for a in queue.attempts("a key of my own")] == ["succeeded"]
    assert queue.attempts(task_id=claimed.task_id) == []


def test_a_start_record_whose_worker_died_is_marked_abandoned_by_the_next_attempt(
    queue: LeaseQueue,
) -> None:
    _, claimed = _chain_to_second(queue)
    expire(queue, claimed.task_id)
    assert len(queue.sweep()) == 1
    again = queue.claim()
    assert again is not None and again.task_id == claimed.task_id
    with queue.attempt(lease=again) as attempt:
        assert (attempt.number, attempt.abandoned) == (2, 1)
    outcomes = [a.outcome for a in queue.attempts(task_id=claimed.task_id)]
    assert outcomes == ["abandoned", "succeeded"]


def _begun_by_a_worker_that_dies(queue: LeaseQueue, lease: Lease) -> int:
    """The start of an attempt on ``lease``, as a worker commits it before its work, and
    then the worker is gone: the id of its running record."""
    target = attempt_target(None, lease)
    rows = run_sql(
        queue,
        "SELECT attempt_id FROM {schema}.begin_attempt(%(identity)s, %(legacy)s, %(queue)s,"
        " %(key)s, %(task_id)s, 'gone')",
        {
            "identity": target.identity,
            "legacy": target.legacy_identity,
            "queue": target.queue,
            "key": target.key,
            "task_id": lease.task_id,
        },
    )
    return int(rows[0][0])


def _while_a_conclusion_holds(
    dsn: str,
    queue: LeaseQueue,
    lease: Lease,
    record: int,
    action: Callable[[], T],
    what: str,
) -> T:
    """``action``'s result, run while another session concludes ``lease``'s attempt: it has
    marked ``record`` (not yet committed) and comes to the task's row next. ``action`` must
    not wait for the record; the holder's fenced ack then fails, the lease ended."""
    results: list[T] = []
    with psycopg.connect(dsn) as holder:
        holder.execute(
            f'UPDATE "{queue.schema}".attempts SET outcome = %s WHERE id = %s',
            ("succeeded", record),
        )
        runner = threading.Thread(target=lambda: results.append(action()))
        runner.start()
        runner.join(timeout=10)
        assert not runner.is_alive(), f"{what} waited for the concluding holder's record"
        acked = holder.execute(
            f'UPDATE "{queue.schema}".tasks SET status = %s'
            " WHERE id = %s AND lease_token = %s AND status = 'processing'",
            ("done", lease.task_id, lease.token),
        ).rowcount
        assert acked == 0
        holder.rollback()
    (result,) = results
    return result


def _running_record_of_other_work(queue: LeaseQueue) -> None:
    """A running record of a key of the caller's: other work, which neither the sweep nor
    a cancel of a task touches."""
    with queue.attempt("other-work") as other:
        pass
    run_sql(
        queue,
        "UPDATE {schema}.attempts SET outcome = 'running' WHERE id = %(id)s",
        {"id": other.id},
    )


def _held_with_a_running_record(queue: LeaseQueue, begun: str, **task: object) -> Lease:
    """A lease on a new task (``task`` its enqueue options) whose work has a running record,
    begun ``with_the_claim`` (claim_next) or ``apart`` by a worker that then died."""
    if begun == "with_the_claim":
        _, lease = _chain_to_second(queue, **task)
    else:
        queue.enqueue({"n": 1}, **task)  # type: ignore[arg-type]
        claimed = queue.claim()
        assert claimed is not None
        lease = claimed
        _begun_by_a_worker_that_dies(queue, lease)
    assert [a.outcome for a in queue.attempts(task_id=lease.task_id)] == ["running"]
    return lease


@pytest.mark.parametrize("key", [None, "invoice-7"], ids=["keyless", "keyed"])
@pytest.mark.parametrize("begun", ["with_the_claim", "apart"])
def test_the_sweep_that_makes_a_task_dead_marks_its_running_record_abandoned(
    queue: LeaseQueue, key: str | None, begun: str
) -> None:
    # The task's worker died mid-attempt and the task has no attempts left: no next attempt
    # will come to mark its record, so the sweep that makes the task dead does. A record
    # of other work (here a key of the caller's) is left running.
    _running_record_of_other_work(queue)
    lease = _held_with_a_running_record(queue, begun, idempotency_key=key, max_attempts=1)
    expire(queue, lease.task_id)
    (event,) = queue.sweep()
    assert event.action == "dead"
    assert [a.outcome for a in queue.attempts(task_id=lease.task_id)] == ["abandoned"]
    assert [a.outcome for a in queue.attempts("other-work")] == ["running"]


def test_the_sweep_does_not_wait_for_a_record_a_concluding_zombie_holds(
    queue: LeaseQueue, dsn: str
) -> None:
    # A zombie's conclusion marks its record, then waits for its task's row, which the
    # sweep making the task dead holds: were the sweep to wait for the record, the two would
    # deadlock. The sweep leaves that record to its holder, whose fence then fails.
    queue.enqueue({"n": 1}, max_attempts=1)
    lease = queue.claim()
    assert lease is not None
    record = _begun_by_a_worker_that_dies(queue, lease)
    expire(queue, lease.task_id)
    swept = _while_a_conclusion_holds(dsn, queue, lease, record, queue.sweep, "the sweep")
    assert [event.action for event in swept] == ["dead"]
    assert queue.get(lease.task_id).status == "dead"


def test_the_sweep_reads_running_records_by_index_whatever_the_tables_size(
    queue: LeaseQueue, dsn: str
) -> None:
    # The sweep keeps its plan for the session (a prepared statement), made while the
    # attempts table may be nearly empty: its look-up of the dead tasks' running records
    # must read the identity index, not every record.
    for key in ("a", "b", "c", "d", "e"):
        with queue.attempt(key):
            pass
    assert "attempts_identity_idx" in _generic_plan(dsn, queue, sql.SWEEP_BATCH)


@pytest.mark.parametrize("key", [None, "invoice-7"], ids=["keyless", "keyed"])
@pytest.mark.parametrize("begun", ["with_the_claim", "apart"])
def test_a_cancel_marks_the_running_record_of_its_task_abandoned(
    queue: LeaseQueue, key: str | None, begun: str
) -> None:
    # A cancelled task never runs again: no next attempt will come to mark the running
    # record of its work (begun with its claim and never used, or left by a worker that
    # died), so the cancel does.
    _running_record_of_other_work(queue)
    lease = _held_with_a_running_record(queue, begun, idempotency_key=key)
    assert queue.cancel(lease.task_id)
    assert [a.outcome for a in queue.attempts(task_id=lease.task_id)] == ["abandoned"]
    assert [a.outcome for a in queue.attempts("other-work")] == ["running"]


@pytest.mark.parametrize("begun", ["with_the_claim", "apart"])
def test_a_batch_cancel_marks_the_running_records_of_its_tasks_abandoned(
    queue: LeaseQueue, begun: str
) -> None:
    _running_record_of_other_work(queue)
    batch = queue.enqueue_batch([{"n": 1}, {"n": 2}, {"n": 3}], idempotency_keys=["k1", "k2", "k3"])
    first = queue.claim()
    assert first is not None
    if begun == "with_the_claim":
        with queue.attempt(lease=first, claim_next=True) as attempt:
            pass
        assert attempt.claimed is not None
        held = [attempt.claimed]
    else:
        second = queue.claim()
        assert second is not None
        held = [first, second]
        for lease in held:
            _begun_by_a_worker_that_dies(queue, lease)
    assert queue.cancel_batch(batch.id) == len(held) + 1
    for lease in held:
        assert [a.outcome for a in queue.attempts(task_id=lease.task_id)] == ["abandoned"]
    assert [a.outcome for a in queue.attempts("other-work")] == ["running"]


@pytest.mark.parametrize("cancel", ["task", "batch"])
def test_a_cancel_marks_the_record_a_claim_it_waited_for_began(
    queue: LeaseQueue, dsn: str, cancel: str
) -> None:
    # A conclusion that claims the next task begins its attempt in the same commit. A
    # cancel of that task made meanwhile waits for its row, then cancels it once the claim
    # commits: the start record committed with the claim, which the cancel's first snapshot
    # did not hold, is marked too.
    batch = queue.enqueue_batch([{"n": 1}, {"n": 2}])
    lease = queue.claim()
    assert lease is not None
    with psycopg.connect(dsn) as claimer:
        ((second, begun),) = claimer.execute(
            f'SELECT id, attempt_id FROM "{queue.schema}".conclude_claim_and_begin('
            "NULL, %s, %s, NULL, 'default', 'claimer', NULL, 60)",
            (lease.task_id, lease.token),
        ).fetchall()
        assert second != lease.task_id and begun is not None
        if cancel == "task":
            finish = start_blocked(dsn, queue.schema, lambda: int(queue.cancel(second)))
        else:
            finish = start_blocked(dsn, queue.schema, lambda: queue.cancel_batch(batch.id))
        claimer.commit()
        assert finish() == 1
    assert queue.get(second).status == "cancelled"
    assert [(a.id, a.outcome) for a in queue.attempts(task_id=second)] == [(begun, "abandoned")]


def test_a_batch_cancel_leaves_the_records_of_a_live_task_that_took_a_cancelled_key(
    queue: LeaseQueue,
) -> None:
    # A key is free again once its task is finished: a task outside the batch took the key
    # of a batch task cancelled before. Cancelling the rest of the batch marks the records
    # of the tasks it cancels, not that live task's.
    batch = queue.enqueue_batch([{"n": 1}, {"n": 2}], idempotency_keys=["k1", "k2"])
    (cancelled_before, _) = [task.task_id for task in queue.list_tasks()]
    assert queue.cancel(cancelled_before)
    queue.enqueue({"n": 3}, idempotency_key="k1")
    claimed = [queue.claim(), queue.claim()]
    (live,) = [lease for lease in claimed if lease is not None and lease.idempotency_key == "k1"]
    _begun_by_a_worker_that_dies(queue, live)
    assert queue.cancel_batch(batch.id) == 1
    assert [a.outcome for a in queue.attempts(task_id=live.task_id)] == ["running"]


def test_a_cancel_marks_the_record_left_before_its_task_was_enqueued_again(
    queue: LeaseQueue,
) -> None:
    # The worker died, the sweep enqueued the task again (its attempts not used up) and left
    # the record to the next attempt; the task is cancelled before one comes.
    lease = _held_with_a_running_record(queue, "apart")
    expire(queue, lease.task_id)
    assert [event.action for event in queue.sweep()] == ["requeued"]
    assert queue.cancel(lease.task_id)
    assert [a.outcome for a in queue.attempts(task_id=lease.task_id)] == ["abandoned"]


def test_an_attempt_whose_task_is_cancelled_under_it_records_its_failure(
    queue: LeaseQueue,
) -> None:
    # The cancel marks the record of an attempt still at work; its conclusion then fails
    # the fence, and the attempt records its own outcome over the mark.
    queue.enqueue({"n": 1})
    lease = queue.claim()
    assert lease is not None
    with pytest.raises(LeaseLost), queue.attempt(lease=lease) as attempt:
        assert queue.cancel(lease.task_id)
        assert [a.outcome for a in queue.attempts(task_id=lease.task_id)] == ["abandoned"]
    assert [(a.id, a.outcome) for a in queue.attempts(task_id=lease.task_id)] == [
        (attempt.id, "failed")
    ]


def test_a_cancel_does_not_wait_for_a_record_a_concluding_holder_holds(
    queue: LeaseQueue, dsn: str
) -> None:
    # A holder's conclusion has marked its record and comes to its task's row, which the
    # cancel holds: were the cancel to wait for the record, the two would deadlock. The
    # cancel leaves that record to its holder, whose fence then fails.
    queue.enqueue({"n": 1})
    lease = queue.claim()
    assert lease is not None
    record = _begun_by_a_worker_that_dies(queue, lease)

    def cancel() -> bool:
        return queue.cancel(lease.task_id)

    assert _while_a_conclusion_holds(dsn, queue, lease, record, cancel, "the cancel") is True
    assert queue.get(lease.task_id).status == "cancelled"
    assert [a.outcome for a in queue.attempts(task_id=lease.task_id)] == ["running"]


def test_a_cancel_reads_running_records_by_index_whatever_the_tables_size(
    queue: LeaseQueue, dsn: str
) -> None:
    # As the sweep's (above): a cancel's plan is kept for the session, perhaps made while
    # the attempts table was nearly empty.
    for key in ("a", "b", "c", "d", "e"):
        with queue.attempt(key):
            pass
    plan = _generic_plan(dsn, queue, sql.ABANDON_RECORDS_OF_CANCELLED_TASKS)
    assert "attempts_identity_idx" in plan


def _generic_plan(dsn: str, queue: LeaseQueue, template: str) -> str:
    """The generic plan of ``template`` in the queue's schema, its parameters NULL (a limit
    10)."""
    names: list[str] = []

    def placeholder(match: re.Match[str]) -> str:
        names.append(match.group(1))
        return f"${len(names)}"

    statement = re.sub(r"%\((\w+)\)s", placeholder, sql.compose(template, queue.schema))
    with psycopg.connect(dsn) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE planned AS {statement}")
        arguments = ", ".join("10" if name == "limit" else "NULL" for name in names)
        plan = "\n".join(row[0] for row in conn.execute(f"EXPLAIN EXECUTE planned({arguments})"))
        conn.rollback()
    assert "Seq Scan on attempts" not in plan, plan
    return plan


def test_a_start_that_fails_in_the_claiming_commit_is_made_apart(queue: LeaseQueue) -> None:
    # A trigger of the caller's refuses start records made in the claiming commit: the
    # conclusion still commits, the next task is claimed apart, and its attempt begins on
    # its own.
    run_sql(
        queue,
        """
        CREATE FUNCTION {schema}.refuse_in_claims() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF strpos(current_query(), 'conclude_claim_and_begin') > 0 THEN
                RAISE EXCEPTION 'no start records here';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER refuse_in_claims BEFORE INSERT ON {schema}.attempts
            FOR EACH ROW EXECUTE FUNCTION {schema}.refuse_in_claims();
        """,
    )
    first, claimed = _chain_to_second(queue)
    assert queue.get(first).status == "done"
    assert queue.get(claimed.task_id).status == "processing"
    assert queue.attempts(task_id=claimed.task_id) == []
    with queue.attempt(lease=claimed) as attempt:
        assert attempt.number == 1
    assert [a.outcome for a in queue.attempts(task_id=claimed.task_id)] == ["succeeded"]


def test_a_start_record_is_taken_back_only_under_the_lease_that_holds_its_task(
    queue: LeaseQueue,
) -> None:
    _, claimed = _chain_to_second(queue)
    (begun,) = queue.attempts(task_id=claimed.task_id)
    run_sql(
        queue,
        "SELECT {schema}.discard_begun_attempt(%(attempt)s, %(task)s, %(token)s)",
        {"attempt": begun.id, "task": claimed.task_id, "token": claimed.token + 1},
    )
    assert [a.id for a in queue.attempts(task_id=claimed.task_id)] == [begun.id]


def test_a_start_that_waits_for_a_lock_in_the_claiming_commit_gives_way(
    queue: LeaseQueue, dsn: str
) -> None:
    # Another session holds the running record of the next task's work (a paused attempt
    # of an earlier claim, say). The start made with the claim would wait for it, holding
    # the attempt's locks: it gives up after the claim's lock timeout, the conclusion
    # commits, and the next task is claimed apart.
    first = queue.enqueue({"n": 1})
    second = queue.enqueue({"n": 2})
    run_sql(
        queue,
        "INSERT INTO {schema}.attempts (identity, attempt, task_id, worker_id, outcome)"
        " VALUES (%(identity)s, 1, %(task)s, 'paused', 'running')",
        {"identity": f"task:{second}", "task": second},
    )
    lease = queue.claim()
    assert lease is not None and lease.task_id == first
    with psycopg.connect(dsn) as holder:
        holder.execute(
            f'SELECT 1 FROM "{queue.schema}".attempts WHERE task_id = %s FOR UPDATE', (second,)
        )
        concluded: list[Attempt] = []

        def conclude() -> None:
            with queue.attempt(lease=lease, claim_next=True) as attempt:
                pass
            concluded.append(attempt)

        thread = threading.Thread(target=conclude, daemon=True)
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), "the conclusion waited for the record's lock"
        holder.rollback()
    (attempt,) = concluded
    assert queue.get(first).status == "done"
    assert attempt.claimed is not None and attempt.claimed.task_id == second
