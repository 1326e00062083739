"""Property-based tests: the queue against an in-memory model, and schema-name fuzzing."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from dagster_leasequeue import ConfigurationError, Lease, LeaseLost, LeaseQueue, sql
from dagster_leasequeue.validation import SCHEMA_NAME_PATTERN

from ..helpers import expire, run_model, run_sql, stored_tasks


@dataclass
class ModelTask:
    status: str
    attempts: int
    max_attempts: int
    token: int | None
    ready: int  # when it last became claimable, in model time (stands for run_at)


def machine_for(queue: LeaseQueue) -> type[RuleBasedStateMachine]:
    class QueueMachine(RuleBasedStateMachine):
        """Enqueue, claim, renew, ack, ack-and-claim, fail, expire-and-sweep and cancel,
        checked step by step."""

        @initialize()
        def empty_queue(self) -> None:
            run_sql(queue, "TRUNCATE {schema}.tasks, {schema}.recovery_events")
            self.model: dict[int, ModelTask] = {}
            self.leases: list[Lease] = []
            self.clock = itertools.count()
            self.stale_writes_refused = 0

        def is_current(self, lease: Lease) -> bool:
            task = self.model[lease.task_id]
            return task.status == "processing" and task.token == lease.token

        def release(self, task_id: int) -> None:
            task = self.model[task_id]
            task.status = "dead" if task.attempts >= task.max_attempts else "enqueued"
            task.ready = next(self.clock)

        @rule(max_attempts=st.integers(1, 3))
        def enqueue(self, max_attempts: int) -> None:
            task_id = queue.enqueue({}, max_attempts=max_attempts)
            self.model[task_id] = ModelTask("enqueued", 0, max_attempts, None, next(self.clock))

        @rule()
        def claim(self) -> None:
            self.claimed(queue.claim())

        def claimed(self, lease: Lease | None) -> None:
            """Check a claim's lease against the model's next task, and take it."""
            waiting = [(t.ready, i) for i, t in self.model.items() if t.status == "enqueued"]
            if not waiting:
                assert lease is None
                return
            assert lease is not None and lease.task_id == min(waiting)[1]
            task = self.model[lease.task_id]
            task.status, task.attempts, task.token = "processing", task.attempts + 1, lease.token
            assert lease.attempt == task.attempts <= task.max_attempts
            self.leases.append(lease)

        @precondition(lambda self: self.leases)
        @rule(data=st.data())
        def ack_and_claim(self, data: st.DataObject) -> None:
            lease = data.draw(st.sampled_from(self.leases))
            if not self.is_current(lease):
                with pytest.raises(LeaseLost):
                    lease.ack_and_claim()
                self.stale_writes_refused += 1
                return
            nxt = lease.ack_and_claim()
            self.model[lease.task_id].status = "done"
            self.claimed(nxt)

        @precondition(lambda self: self.leases)
        @rule(data=st.data(), action=st.sampled_from(["ack", "fail", "renew"]))
        def conclude(self, data: st.DataObject, action: str) -> None:
            lease = data.draw(st.sampled_from(self.leases))
            run = {
                "ack": lease.ack,
                "renew": lease.renew,
                "fail": lambda: lease.fail("x", retry_in=0),
            }
            if not self.is_current(lease):
                with pytest.raises(LeaseLost):
                    run[action]()
                self.stale_writes_refused += 1
                return
            run[action]()
            if action == "ack":
                self.model[lease.task_id].status = "done"
            elif action == "fail":
                self.release(lease.task_id)

        @precondition(lambda self: any(t.status == "processing" for t in self.model.values()))
        @rule(data=st.data())
        def expire_and_sweep(self, data: st.DataObject) -> None:
            held = sorted(i for i, t in self.model.items() if t.status == "processing")
            task_id = data.draw(st.sampled_from(held))
            expire(queue, task_id)
            recovered = queue.sweep()
            assert [r.task_id for r in recovered] == [task_id]
            self.model[task_id].token = None
            self.release(task_id)
            assert recovered[0].action == (
                "dead" if self.model[task_id].status == "dead" else "requeued"
            )

        @precondition(lambda self: self.model)
        @rule(data=st.data())
        def cancel(self, data: st.DataObject) -> None:
            task_id = data.draw(st.sampled_from(sorted(self.model)))
            task = self.model[task_id]
            unfinished = task.status in ("enqueued", "processing")
            assert queue.cancel(task_id) is unfinished
            if unfinished:
                task.status, task.token = "cancelled", None

        @invariant()
        def database_matches_the_model(self) -> None:
            if not hasattr(self, "model"):
                return
            stored = stored_tasks(queue)
            assert {i: (status, attempts) for i, (status, attempts, _) in stored.items()} == {
                i: (t.status, t.attempts) for i, t in self.model.items()
            }, "a task was lost, added or changed behind the model's back"
            assert all(attempts <= maximum for _, attempts, maximum in stored.values())

    return QueueMachine


def test_the_queue_follows_its_model(queue: LeaseQueue, chaos_long: bool) -> None:
    run_model(machine_for(queue), chaos_long)


def schemas(conn: psycopg.Connection[Any], keep: str) -> set[str]:
    """The database's schemas, ``keep`` and those of no other test or benchmark included.

    Other tests and benchmarks on the same server make schemas meanwhile (with their own
    prefixes), and so does every session that uses a temporary table.
    """
    rows = conn.execute("SELECT nspname FROM pg_namespace").fetchall()
    others = ("lq_test_", "bench_", "pg_temp_", "pg_toast_temp_")
    names = {str(row[0]) for row in rows}
    return {n for n in names if n == keep or not n.startswith(others)}


NAMES = st.one_of(
    st.from_regex(SCHEMA_NAME_PATTERN, fullmatch=True),
    st.text(min_size=0, max_size=80),
    st.text(alphabet="abcxyz_09 \"'-;.ÄéЖ漢\\", min_size=1, max_size=70),
)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(name=NAMES)
def test_schema_names_are_refused_or_safely_quoted(dsn: str, name: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = schemas(conn, name)
        if "\x00" not in name:
            # Whatever the name, composing it can only ever produce one quoted identifier.
            quoted = conn.execute(
                "SELECT '\"' || replace(%s, '\"', '\"\"') || '\"'", (name,)
            ).fetchone()
            assert quoted is not None and sql.compose("{schema}", name) == quoted[0]
        accepted = SCHEMA_NAME_PATTERN.match(name) is not None
        try:
            queue = LeaseQueue(dsn, schema=name)
        except ConfigurationError:
            assert not accepted
            assert schemas(conn, name) - before == set(), "a refused name changed the database"
            return
        assert accepted and len(name.encode()) <= 63
        with queue:
            queue.install()
            after = schemas(conn, name)
            assert name in after and after - before <= {name}, "a name made another schema"
        conn.execute(f'DROP SCHEMA "{name}" CASCADE')
