"""No call of the worker loop waits without bound on a server that holds it up.

The TCP timeouts end a call whose network path died (test_partitions.py); these are the
holds a live server keeps: a row lock another session took, a table lock, a commit that
waits for a synchronous standby that is gone, a server that stopped running. Each claim,
ack, renewal and attempt conclusion gives up after network_timeout (bounded.py), nothing
is written twice, and the task is still there for the next try.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from dagster_leasequeue import DatabaseUnavailable, LeaseQueue, LeaseQueueSettings, attempts

from ..helpers import run_sql, wait_for_a_lock_waiter
from ..own_server import OwnServer

BOUND = 1.0  # network_timeout's least value, in seconds
# A bounded call returns within its bound, a cancel and the cancel's own bound.
WITHIN = 2 * BOUND + 2.0


@pytest.fixture
def bounded(make_queue: Callable[..., LeaseQueue]) -> LeaseQueue:
    queue = make_queue(network_timeout=BOUND)
    queue.install()
    return queue


@contextlib.contextmanager
def row_locked(dsn: str, schema: str, task_id: int) -> Iterator[None]:
    """Another session holds the task's row, as a SELECT ... FOR UPDATE left open would."""
    with psycopg.connect(dsn) as holder:
        holder.execute(f'SELECT 1 FROM "{schema}".tasks WHERE id = %s FOR UPDATE', (task_id,))
        yield
        holder.rollback()


def timed(call: Callable[[], object]) -> tuple[float, Exception | None]:
    started = time.monotonic()
    try:
        call()
    except Exception as exc:  # returned for the test to check
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


def test_an_ack_held_up_by_a_row_lock_gives_up_and_the_lease_stays(
    bounded: LeaseQueue, dsn: str, schema_name: str
) -> None:
    task_id = bounded.enqueue({"n": 1})
    lease = bounded.claim()
    assert lease is not None
    with row_locked(dsn, schema_name, task_id):
        # The ack on the fast path; the others through cursors (release and fail on the
        # pool's connections, renew on the renewals' own): each cancelled, not cut off.
        release, fail = (lambda: lease.release(delay=0)), (lambda: lease.fail("x"))
        for call in (lease.ack, lease.renew, release, fail):
            took, error = timed(call)
            assert isinstance(error, DatabaseUnavailable), error
            assert "cancelled the statement" in str(error)
            assert took < WITHIN
    assert bounded.get(task_id).status == "processing"
    lease.ack()  # the lease was never lost: the ack goes through once the lock is gone
    assert bounded.get(task_id).status == "done"


def test_a_claim_held_up_by_a_table_lock_gives_up_and_claims_nothing(
    bounded: LeaseQueue, dsn: str, schema_name: str
) -> None:
    task_id = bounded.enqueue({"n": 1})
    with psycopg.connect(dsn) as holder:
        holder.execute(f'LOCK TABLE "{schema_name}".tasks IN ACCESS EXCLUSIVE MODE')
        took, error = timed(bounded.claim)
        assert isinstance(error, DatabaseUnavailable), error
        assert took < WITHIN
        holder.rollback()
    assert bounded.get(task_id).status == "enqueued"
    lease = bounded.claim()
    assert lease is not None and lease.task_id == task_id


def test_an_attempt_held_up_at_its_conclusion_writes_nothing_and_runs_once_later(
    bounded: LeaseQueue, dsn: str, schema_name: str
) -> None:
    run_sql(bounded, "CREATE TABLE {schema}.effects (task_id bigint)")
    task_id = bounded.enqueue({"n": 1}, max_attempts=5)
    lease = bounded.claim()
    assert lease is not None

    def attempt() -> None:
        with bounded.attempt(lease=lease) as running:
            running.connection.execute(
                f'INSERT INTO "{schema_name}".effects VALUES (%s)', (task_id,)
            )

    with row_locked(dsn, schema_name, task_id):
        took, error = timed(attempt)
        assert isinstance(error, DatabaseUnavailable), error
        # The conclusion, then the failure it leads to (held up by the same lock), each
        # within its bound.
        assert took < 2 * WITHIN
    assert run_sql(bounded, "SELECT count(*) FROM {schema}.effects") == [(0,)]
    assert bounded.get(task_id).status == "processing"
    with bounded.attempt(lease=lease) as running:
        running.connection.execute(f'INSERT INTO "{schema_name}".effects VALUES (%s)', (task_id,))
    assert run_sql(bounded, "SELECT count(*) FROM {schema}.effects") == [(1,)]
    assert bounded.get(task_id).status == "done"


def test_the_callers_own_statements_are_not_bounded(
    bounded: LeaseQueue, dsn: str, schema_name: str
) -> None:
    """A statement of the caller's may wait as long as it needs: only the package's are
    bounded."""
    task_id = bounded.enqueue({"n": 1})
    result: list[object] = []

    def update() -> None:
        with bounded.connection() as conn:
            conn.execute(
                f'UPDATE "{schema_name}".tasks SET payload = \'{{"n": 2}}\' WHERE id = %s',
                (task_id,),
            )
            result.append("updated")

    with row_locked(dsn, schema_name, task_id):
        waiting = threading.Thread(target=update)
        waiting.start()
        wait_for_a_lock_waiter(dsn, schema_name)
        time.sleep(WITHIN)
        assert waiting.is_alive()
    waiting.join(timeout=10)
    assert result == ["updated"]
    assert bounded.get(task_id).payload == {"n": 2}


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[OwnServer]:
    server = OwnServer(tmp_path / "server")
    server.start()
    try:
        yield server
    finally:
        with contextlib.suppress(Exception):
            server.stop()


def own_queue(server: OwnServer, tmp_path: Path) -> LeaseQueue:
    settings = LeaseQueueSettings(
        network_timeout=BOUND, connect_timeout=2, data_dir=tmp_path / "unused", _env_file=None
    )
    queue = LeaseQueue(server.dsn, settings=settings)
    queue.install()
    return queue


def wait_until_commits_wait(dsn: str) -> None:
    """Until a commit waits for the standby: the checkpointer takes a reloaded setting in
    its own time. A probe's commit that waits is released by a cancel, with a warning (a
    statement timeout ends before the commit)."""
    warnings: list[str] = []
    deadline = time.monotonic() + 10
    with psycopg.connect(dsn, autocommit=True) as probe:
        probe.add_notice_handler(lambda notice: warnings.append(notice.message_primary or ""))
        while not any("synchronous replication" in text for text in warnings):
            assert time.monotonic() < deadline, "commits never came to wait for the standby"
            canceller = threading.Timer(0.3, probe.cancel_safe)
            canceller.start()
            probe.execute("DROP TABLE IF EXISTS probe; CREATE TABLE probe ()")  # WAL to flush
            canceller.join()


def test_a_commit_waiting_for_a_missing_standby_is_released(
    own_server: OwnServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With synchronous_standby_names naming a standby that is not there, every commit
    waits for it: the ack's wait is cancelled, and the ack, committed on this server, is
    done (the server warns that the standby has not confirmed it)."""
    queue = own_queue(own_server, tmp_path)
    try:
        task_id = queue.enqueue({"n": 1})
        lease = queue.claim()
        assert lease is not None
        with psycopg.connect(own_server.dsn, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM SET synchronous_standby_names = 'gone'")
            admin.execute("SELECT pg_reload_conf()")
        wait_until_commits_wait(own_server.dsn)
        with caplog.at_level(logging.WARNING, logger="dagster_leasequeue.bounded"):
            took, error = timed(lease.ack)
        assert error is None, error
        assert took < WITHIN
        assert "cancelling it" in caplog.text  # the ack's commit did wait, and was released
        assert queue.get(task_id).status == "done"
    finally:
        with psycopg.connect(own_server.dsn, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
            admin.execute("SELECT pg_reload_conf()")
        queue.close()


def server_processes(server: OwnServer) -> list[int]:
    """The server's postmaster and its children (each backend is a session of its own)."""
    postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # The parent's pid is the second field after the command's closing parenthesis.
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                children.append(int(stat.parent.name))
    return [postmaster, *children]


def signal_all(processes: list[int], signal_number: int) -> None:
    for pid in processes:
        with contextlib.suppress(ProcessLookupError):  # a worker that ended meanwhile
            os.kill(pid, signal_number)


def test_a_stopped_server_costs_a_bounded_wait_and_the_connection(
    own_server: OwnServer, tmp_path: Path
) -> None:
    """A server that stops running (SIGSTOP: a frozen VM, a debugger) keeps its sockets
    open, so TCP sees nothing wrong; it answers neither the ack nor its cancel, and the
    connection is closed under the call."""
    queue = own_queue(own_server, tmp_path)
    try:
        task_id = queue.enqueue({"n": 1})
        lease = queue.claim()
        assert lease is not None
        processes = server_processes(own_server)
        try:
            signal_all(processes, signal.SIGSTOP)
            took, error = timed(lease.ack)
        finally:
            signal_all(processes, signal.SIGCONT)
        assert isinstance(error, DatabaseUnavailable), error
        assert "nor to the cancel" in str(error)
        assert took < WITHIN + 2 * BOUND
        lease.ack()  # on a new connection, once the server runs again
        assert queue.get(task_id).status == "done"
    finally:
        queue.close()


def test_an_interrupted_attempt_leaves_no_bound_on_the_next_caller(
    bounded: LeaseQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C while an attempt's session was reset must not leave the package's bound
    on the connection the next caller borrows: the caller's own statements may run long."""
    task_id = bounded.enqueue({"n": 1})
    lease = bounded.claim()
    assert lease is not None
    reset = attempts.reset_session

    def reset_then_interrupt(*args: object) -> None:
        reset(*args)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    monkeypatch.setattr(attempts, "reset_session", reset_then_interrupt)
    with pytest.raises(KeyboardInterrupt), bounded.attempt(lease=lease):
        raise RuntimeError("the work failed")
    monkeypatch.undo()
    with bounded.connection() as conn:
        conn.execute("SELECT pg_sleep(%s)", (BOUND + 0.5,))
    assert bounded.get(task_id).status == "enqueued"
