"""Queue asset keys: one key per queue, so observations and checks of two queues never mix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dagster as dg
import pytest

from dagster_leasequeue import (
    LeaseQueue,
    LeaseQueueResource,
    build_queue_asset_checks,
    build_sweeper_sensor,
    queue_asset_specs,
)

from ..helpers import expire

# sha1("a-b") begins 34fafddd: the suffix that keeps "a-b" apart from "a_b".
A_DASH_B = dg.AssetKey(["leasequeue", "a_b_34fafddd"])
A_UNDERSCORE_B = dg.AssetKey(["leasequeue", "a_b"])


@pytest.fixture
def resources(dsn: str, schema_name: str, queue: LeaseQueue) -> dict[str, Any]:
    return {"leasequeue": LeaseQueueResource(dsn=dsn, schema_name=schema_name)}


def evaluate(
    checks: Sequence[dg.AssetChecksDefinition], queues: Sequence[str], resources: dict[str, Any]
) -> dict[tuple[str, str], dg.AssetCheckEvaluation]:
    """Run every check; the evaluations by (queue, check name), the queue read from its spec."""
    specs = queue_asset_specs(queues)
    defs = dg.Definitions(assets=specs, asset_checks=checks, resources=resources)
    dg.Definitions.validate_loadable(defs)
    queue_of = {spec.key: str(spec.metadata["queue"]) for spec in specs}
    job = defs.resolve_implicit_global_asset_job_def()
    result = job.execute_in_process(instance=dg.DagsterInstance.ephemeral())
    assert result.success
    return {
        (queue_of[evaluation.asset_key], evaluation.check_name): evaluation
        for evaluation in result.get_asset_check_evaluations()
    }


def test_checks_of_such_queues_load_and_each_checks_its_own_queue(
    queue: LeaseQueue, resources: dict[str, Any]
) -> None:
    dead = queue.enqueue_many([{"n": n} for n in range(2)], queue="a-b", max_attempts=1)
    for lease in queue.claim_many(2, queue="a-b"):
        lease.fail("boom")
    queue.enqueue_many([{"n": n} for n in range(3)], queue="a_b")
    checks = build_queue_asset_checks(["a-b", "a_b"])
    assert len({checks_def.node_def.name for checks_def in checks}) == 2
    assert [{key.asset_key for key in c.check_keys} for c in checks] == [
        {A_DASH_B},
        {A_UNDERSCORE_B},
    ]
    evaluations = evaluate(checks, ["a-b", "a_b"], resources)
    assert len(evaluations) == 6
    dash = evaluations["a-b", "dead_tasks_within_limit"]
    assert not dash.passed
    assert dash.metadata["dead"].value == 2
    assert dash.metadata["dead_task_ids"].value == dead
    underscore = evaluations["a_b", "dead_tasks_within_limit"]
    assert underscore.passed and underscore.metadata["dead"].value == 0
    assert evaluations["a_b", "oldest_waiting_within_limit"].metadata["enqueued"].value == 3
    assert evaluations["a-b", "oldest_waiting_within_limit"].metadata["enqueued"].value == 0


def test_the_sweeper_reports_such_queues_under_distinct_keys(
    queue: LeaseQueue, resources: dict[str, Any]
) -> None:
    dash = queue.enqueue_many([{"n": n} for n in range(2)], queue="a-b")
    queue.enqueue_many([{"n": n} for n in range(3)], queue="a_b")
    (lease,) = queue.claim_many(1, queue="a-b", worker_id="gone")
    expire(queue, lease.task_id)
    sensor = build_sweeper_sensor()
    with dg.build_sensor_context(resources=resources) as context:
        result = sensor.evaluate_tick(context)
    counts = {
        event.asset_key: event.metadata["enqueued"].value
        for event in result.asset_events
        if event.metadata["event"].value == "queue_counts"
    }
    assert counts == {A_DASH_B: 2, A_UNDERSCORE_B: 3}
    recovered = [
        (event.asset_key, event.metadata["task_id"].value)
        for event in result.asset_events
        if event.metadata["event"].value == "lease_recovered"
    ]
    assert recovered == [(A_DASH_B, dash[0])]
    # The keys are the ones the specs declare: the observations land on the catalog's assets.
    assert {spec.key for spec in queue_asset_specs(["a-b", "a_b"])} == set(counts)


def test_the_sweeper_warns_when_two_queues_share_a_key(
    queue: LeaseQueue, resources: dict[str, Any], capfd: pytest.CaptureFixture[str]
) -> None:
    queue.enqueue({"n": 1}, queue="a-b")
    queue.enqueue({"n": 2}, queue="a_b_34fafddd")
    sensor = build_sweeper_sensor()
    with dg.build_sensor_context(resources=resources) as context:
        sensor.evaluate_tick(context)
    # The tick's log (the sensor's page in the UI; the console here).
    warnings = [line for line in capfd.readouterr().err.splitlines() if " - WARNING - " in line]
    assert len(warnings) == 1
    assert "'a-b', 'a_b_34fafddd' on 'leasequeue/a_b_34fafddd'" in warnings[0]
