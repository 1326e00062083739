"""Asset checks on the queue assets, run by Dagster against a real queue."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dagster as dg
import pytest

from dagster_leasequeue import LeaseQueue, LeaseQueueResource, queue_asset_specs
from dagster_leasequeue.dagster import checks as checks_module
from dagster_leasequeue.dagster.checks import build_queue_asset_checks

from ..helpers import run_sql

WARN, ERROR = dg.AssetCheckSeverity.WARN, dg.AssetCheckSeverity.ERROR
CHECK_NAMES = {"no_stuck_leases", "dead_tasks_within_limit", "oldest_waiting_within_limit"}


def backdate_lease(queue: LeaseQueue, seconds: float, *task_ids: int) -> None:
    run_sql(
        queue,
        "UPDATE {schema}.tasks SET lease_expires_at = clock_timestamp()"
        " - make_interval(secs => %(s)s) WHERE id = ANY(%(ids)s)",
        {"s": seconds, "ids": list(task_ids)},
    )


def backdate_run_at(queue: LeaseQueue, seconds: float, *task_ids: int) -> None:
    run_sql(
        queue,
        "UPDATE {schema}.tasks SET run_at = clock_timestamp() - make_interval(secs => %(s)s)"
        " WHERE id = ANY(%(ids)s)",
        {"s": seconds, "ids": list(task_ids)},
    )


def make_dead(queue: LeaseQueue, name: str, count: int) -> list[int]:
    ids = queue.enqueue_many([{"n": n} for n in range(count)], queue=name, max_attempts=1)
    for lease in queue.claim_many(count, queue=name):
        lease.fail(f"boom | {lease.task_id}")
    assert {queue.get(task_id).status for task_id in ids} == {"dead"}
    return ids


def evaluate(
    checks: Sequence[dg.AssetChecksDefinition],
    resources: dict[str, Any],
    queues: Sequence[str] = ("documents",),
    prefix: Sequence[str] = ("leasequeue",),
    selection: dg.AssetSelection | None = None,
) -> dict[tuple[str, str], dg.AssetCheckEvaluation]:
    """Run the checks as the UI's "Execute" does; the evaluations by (queue, check name)."""
    jobs = [] if selection is None else [dg.define_asset_job("selected", selection=selection)]
    defs = dg.Definitions(
        assets=queue_asset_specs(queues, asset_key_prefix=prefix),
        asset_checks=checks,
        jobs=jobs,
        resources=resources,
    )
    job = (
        defs.resolve_implicit_global_asset_job_def()
        if selection is None
        else defs.resolve_job_def("selected")
    )
    result = job.execute_in_process(instance=dg.DagsterInstance.ephemeral())
    assert result.success
    return {
        (evaluation.asset_key.path[-1], evaluation.check_name): evaluation
        for evaluation in result.get_asset_check_evaluations()
    }


def values(evaluation: dg.AssetCheckEvaluation) -> dict[str, object]:
    return {key: value.value for key, value in evaluation.metadata.items()}


@pytest.fixture
def resources(dsn: str, schema_name: str, queue: LeaseQueue) -> dict[str, Any]:
    return {"leasequeue": LeaseQueueResource(dsn=dsn, schema_name=schema_name)}


def test_a_healthy_queue_passes_every_check(queue: LeaseQueue, resources: dict[str, Any]) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(4)], queue="documents")
    held, late = queue.claim_many(2, queue="documents", worker_id="w")
    backdate_lease(queue, 60, late.task_id)  # expired, but a sweeper has time to come
    make_dead(queue, "other", 2)  # another queue's trouble is not this queue's
    backdate_run_at(queue, 600, ids[2])
    evaluations = evaluate(build_queue_asset_checks(["documents"]), resources)
    assert set(evaluations) == {("documents", name) for name in CHECK_NAMES}
    assert all(e.passed and e.severity == WARN for e in evaluations.values())
    assert values(evaluations["documents", "no_stuck_leases"]) == {
        "processing": 2,
        "expired_leases": 1,
        "stuck": 0,
        "stuck_after_seconds": 600.0,
        "stuck_task_ids": [],
        "most_overdue_seconds": 0.0,
    }
    assert values(evaluations["documents", "dead_tasks_within_limit"]) == {
        "dead": 0,
        "max_dead": 0,
        "dead_task_ids": [],
    }
    waiting = values(evaluations["documents", "oldest_waiting_within_limit"])
    assert waiting["enqueued"] == 2 and waiting["max_oldest_waiting_seconds"] == 3600.0
    assert 600 <= float(waiting["oldest_waiting_seconds"]) < 700  # type: ignore[arg-type]
    assert held.task_id == ids[0]


def test_an_unhealthy_queue_fails_each_check(dsn: str, schema_name: str, queue: LeaseQueue) -> None:
    dead = make_dead(queue, "documents", 3)
    ids = queue.enqueue_many([{"n": n} for n in range(5)], queue="documents")
    leases = queue.claim_many(3, queue="documents", worker_id="gone-worker")
    backdate_lease(queue, 700, leases[0].task_id)
    backdate_lease(queue, 7200, leases[1].task_id)  # the worst: first in the list
    backdate_run_at(queue, 4000, ids[3])
    backdate_run_at(queue, 9000, ids[4])
    checks = build_queue_asset_checks(
        ["documents"],
        resource_key="queues",
        asset_key_prefix=("ops", "queues"),
        stuck_after_seconds=300,
        max_dead=2,
        max_oldest_waiting_seconds=1800,
        severity=ERROR,
    )
    (checks_def,) = checks
    assert "queues" in checks_def.required_resource_keys
    resources = {"queues": LeaseQueueResource(dsn=dsn, schema_name=schema_name)}
    evaluations = evaluate(checks, resources, prefix=("ops", "queues"))
    assert {e.asset_key for e in evaluations.values()} == {
        dg.AssetKey(["ops", "queues", "documents"])
    }
    assert not any(e.passed for e in evaluations.values())
    assert {e.severity for e in evaluations.values()} == {ERROR}

    stuck = values(evaluations["documents", "no_stuck_leases"])
    assert stuck["stuck_task_ids"] == [leases[1].task_id, leases[0].task_id]
    assert (stuck["processing"], stuck["expired_leases"], stuck["stuck"]) == (3, 2, 2)
    assert stuck["stuck_after_seconds"] == 300.0
    assert 7200 <= float(stuck["most_overdue_seconds"]) < 7300  # type: ignore[arg-type]
    assert "gone-worker" in str(stuck["stuck_tasks"])
    assert "sweeper" in str(evaluations["documents", "no_stuck_leases"].description)

    dead_result = values(evaluations["documents", "dead_tasks_within_limit"])
    assert (dead_result["dead"], dead_result["max_dead"]) == (3, 2)
    assert dead_result["dead_task_ids"] == dead
    assert f"boom \\| {dead[0]}" in str(dead_result["dead_tasks"])  # pipes escaped

    waiting = values(evaluations["documents", "oldest_waiting_within_limit"])
    assert waiting["longest_waiting_task_ids"] == [ids[4], ids[3]]
    assert waiting["max_oldest_waiting_seconds"] == 1800.0
    assert 9000 <= float(waiting["oldest_waiting_seconds"]) < 9100  # type: ignore[arg-type]


def test_one_check_runs_alone_and_each_queue_has_its_own(
    queue: LeaseQueue, resources: dict[str, Any]
) -> None:
    make_dead(queue, "reports", 1)
    checks = build_queue_asset_checks(["documents", "reports"])
    assert len(checks) == 2
    key = dg.AssetCheckKey(dg.AssetKey(["leasequeue", "reports"]), "dead_tasks_within_limit")
    evaluations = evaluate(
        checks, resources, queues=["documents", "reports"], selection=dg.AssetSelection.checks(key)
    )
    assert list(evaluations) == [("reports", "dead_tasks_within_limit")]
    assert not evaluations["reports", "dead_tasks_within_limit"].passed
    everything = evaluate(checks, resources, queues=["documents", "reports"])
    assert len(everything) == 6
    assert [name for (q, name), e in everything.items() if not e.passed] == [
        "dead_tasks_within_limit"
    ]


def test_stuck_leases_are_found_across_pages(
    queue: LeaseQueue, resources: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checks_module, "_PAGE", 2)
    queue.enqueue_many([{"n": n} for n in range(5)], queue="documents")
    leases = queue.claim_many(5, queue="documents")
    backdate_lease(queue, 1000, leases[1].task_id, leases[4].task_id)
    evaluations = evaluate(build_queue_asset_checks(["documents"]), resources)
    stuck = values(evaluations["documents", "no_stuck_leases"])
    assert (stuck["processing"], stuck["stuck"]) == (5, 2)
    assert set(stuck["stuck_task_ids"]) == {leases[1].task_id, leases[4].task_id}  # type: ignore[call-overload]


def test_bad_thresholds_are_refused() -> None:
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="max_dead"):
        build_queue_asset_checks(["documents"], max_dead=-1)


def test_a_key_held_at_its_limit_fails_the_optional_check(
    queue: LeaseQueue, resources: dict[str, Any]
) -> None:
    queue.enqueue_many(
        [{"n": n} for n in range(3)], queue="documents", concurrency_key=lambda p: "acme"
    )
    queue.enqueue({"n": 9}, queue="documents", concurrency_key="globex")
    queue.set_concurrency_limit("documents", 1)
    leases = queue.claim_many(5, queue="documents")
    assert len(leases) == 2  # one of each key
    checks = build_queue_asset_checks(["documents"], key_at_limit_after_seconds=300)
    evaluations = evaluate(checks, resources)
    assert evaluations["documents", "no_key_held_at_limit"].passed
    waiting = [task.task_id for task in queue.list_tasks(status="enqueued", queue="documents")]
    backdate_run_at(queue, 600, *waiting)
    failed = evaluate(checks, resources)["documents", "no_key_held_at_limit"]
    assert not failed.passed
    held = values(failed)["keys_held"]
    assert list(held) == ["acme"]  # type: ignore[call-overload]
    assert held["acme"]["running"] == 1 and held["acme"]["waited_seconds"] >= 600  # type: ignore[index]
    # Left out unless asked for.
    assert ("documents", "no_key_held_at_limit") not in evaluate(
        build_queue_asset_checks(["documents"]), resources
    )
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="key_at_limit_after_seconds"):
        build_queue_asset_checks(["documents"], key_at_limit_after_seconds=-1)
