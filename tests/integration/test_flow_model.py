"""Property-based test of concurrency limits: the claims of a controlled queue against an
in-memory model, while limits are set and removed, tasks of several keys enqueued, acked,
failed, swept, and claimed by several at a time or one after an ack."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dagster_leasequeue import Lease, LeaseQueue

from ..helpers import expire, run_model, run_sql, stored_tasks

QUEUE = "default"
KEYS = (None, "a", "b", "c")
LIMITS = st.sampled_from((None, 0, 1, 2, 3))


@dataclass
class ModelTask:
    key: str | None
    status: str
    attempts: int
    ready: int  # when it last became claimable, in model time (stands for run_at)


def machine_for(queue: LeaseQueue) -> type[RuleBasedStateMachine]:
    class FlowMachine(RuleBasedStateMachine):
        """A claim takes the first tasks in claim order whose keys have room, never more of a
        key than its limit (its own, else the queue's default), counted across claims."""

        @initialize()
        def empty_queue(self) -> None:
            run_sql(
                queue,
                "TRUNCATE {schema}.tasks, {schema}.recovery_events, {schema}.flow_keys,"
                " {schema}.queue_flow",
            )
            self.model: dict[int, ModelTask] = {}
            self.leases: dict[int, Lease] = {}
            self.limits: dict[str | None, int] = {}  # None: the queue's default
            self.clock = itertools.count()

        def limit_of(self, key: str) -> int | None:
            return self.limits.get(key, self.limits.get(None))

        def running(self, key: str) -> int:
            return sum(1 for t in self.model.values() if t.key == key and t.status == "processing")

        def expected_claim(self, wanted: int) -> list[int]:
            """The model's answer: the first due tasks in claim order that their keys admit."""
            taken: list[int] = []
            due = sorted((t.ready, i) for i, t in self.model.items() if t.status == "enqueued")
            for _, task_id in due:
                if len(taken) == wanted:
                    break
                key = self.model[task_id].key
                if key is not None:
                    limit = self.limit_of(key)
                    ours = sum(1 for i in taken if self.model[i].key == key)
                    if limit is not None and self.running(key) + ours >= limit:
                        continue
                taken.append(task_id)
            return taken

        def took(self, leases: list[Lease], expected: list[int]) -> None:
            assert [lease.task_id for lease in leases] == expected
            for lease in leases:
                task = self.model[lease.task_id]
                task.status, task.attempts = "processing", task.attempts + 1
                self.leases[lease.task_id] = lease

        def give_back(self, task_id: int) -> None:
            task = self.model[task_id]
            task.status = "dead" if task.attempts >= 3 else "enqueued"
            task.ready = next(self.clock)
            del self.leases[task_id]

        @rule(key=st.sampled_from(KEYS), count=st.integers(1, 3))
        def enqueue(self, key: str | None, count: int) -> None:
            ready = next(self.clock)
            for task_id in queue.enqueue_many(
                [{}] * count, queue=QUEUE, concurrency_key=key, max_attempts=3
            ):
                self.model[task_id] = ModelTask(key, "enqueued", 0, ready)

        @rule(key=st.sampled_from(KEYS), limit=LIMITS)
        def set_limit(self, key: str | None, limit: int | None) -> None:
            queue.set_concurrency_limit(QUEUE, limit, key=key)
            if limit is None:
                self.limits.pop(key, None)
            else:
                self.limits[key] = limit

        @rule(wanted=st.integers(1, 5))
        def claim(self, wanted: int) -> None:
            expected = self.expected_claim(wanted)
            self.took(queue.claim_many(wanted, queue=QUEUE), expected)

        @precondition(lambda self: self.leases)
        @rule(data=st.data(), action=st.sampled_from(["ack", "fail", "ack_and_claim"]))
        def conclude(self, data: st.DataObject, action: str) -> None:
            task_id = data.draw(st.sampled_from(sorted(self.leases)))
            lease = self.leases[task_id]
            if action == "fail":
                lease.fail("x", retry_in=0)
                self.give_back(task_id)
                return
            if action == "ack":
                lease.ack()
            self.model[task_id].status = "done"
            del self.leases[task_id]
            if action == "ack_and_claim":
                expected = self.expected_claim(1)
                nxt = lease.ack_and_claim()
                self.took([] if nxt is None else [nxt], expected)

        @precondition(lambda self: self.leases)
        @rule(data=st.data())
        def expire_and_sweep(self, data: st.DataObject) -> None:
            task_id = data.draw(st.sampled_from(sorted(self.leases)))
            expire(queue, task_id)
            assert [r.task_id for r in queue.sweep()] == [task_id]
            self.give_back(task_id)

        @invariant()
        def database_matches_the_model(self) -> None:
            if not hasattr(self, "model"):
                return
            assert {
                i: (status, attempts) for i, (status, attempts, _) in stored_tasks(queue).items()
            } == {i: (t.status, t.attempts) for i, t in self.model.items()}
            counted = dict(run_sql(queue, "SELECT key, running FROM {schema}.flow_keys"))
            for key in KEYS[1:]:
                assert counted.get(key, 0) == self.running(key), key

    return FlowMachine


def test_claims_of_a_controlled_queue_follow_their_model(
    queue: LeaseQueue, chaos_long: bool
) -> None:
    run_model(machine_for(queue), chaos_long)
