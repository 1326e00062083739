"""Queue asset keys: one key per queue, so observations and checks of two queues never mix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import dagster as dg
import pytest

from dagster_leasequeue import (
    LeaseQueue,
    LeaseQueueResource,
    build_queue_asset_checks,
    build_sweeper_sensor,
    queue_asset_key,
    queue_asset_specs,
)

from .helpers import expire

# sha1("a-b") begins 34fafddd: the suffix that keeps "a-b" apart from "a_b".
A_DASH_B = dg.AssetKey(["leasequeue", "a_b_34fafddd"])
A_UNDERSCORE_B = dg.AssetKey(["leasequeue", "a_b"])


@pytest.fixture
def resources(dsn: str, schema_name: str, queue: LeaseQueue) -> dict[str, Any]:
    return {"leasequeue": LeaseQueueResource(dsn=dsn, schema_name=schema_name)}


def test_a_name_that_is_a_valid_key_part_keeps_its_key() -> None:
    for name in ["documents", "a_b", "Reports_2", "_", "0"]:
        assert queue_asset_key(name) == dg.AssetKey(["leasequeue", name])
    assert queue_asset_key("a_b", ("ops", "queues")) == dg.AssetKey(["ops", "queues", "a_b"])


def test_queues_whose_names_differ_only_in_replaced_characters_get_distinct_keys() -> None:
    assert queue_asset_key("a-b") == A_DASH_B
    assert queue_asset_key("a_b") == A_UNDERSCORE_B
    names = ["a-b", "a_b", "a.b", "a b", "a/b", "ü", "ö", "_", "-", "--"]
    keys = [queue_asset_key(name) for name in names]
    assert len(set(keys)) == len(names)
    # Still clean key parts: letters, digits and underscores, as Dagster names are.
    assert all(re.fullmatch(r"[A-Za-z0-9_]+", key.path[-1]) for key in keys)


def test_the_keys_are_the_same_in_every_process() -> None:
    code = (
        "from dagster_leasequeue import queue_asset_key;"
        "print(queue_asset_key('a-b').path[-1], queue_asset_key('ü').path[-1])"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {"a_b_34fafddd __94a759fd"}


def test_asset_specs_of_such_queues_have_distinct_keys() -> None:
    specs = queue_asset_specs(["a-b", "a_b"])
    assert [spec.key for spec in specs] == [A_DASH_B, A_UNDERSCORE_B]
    assert [spec.metadata["queue"] for spec in specs] == ["a-b", "a_b"]
    dg.Definitions(assets=specs).get_repository_def()
    # A queue named twice is declared once.
    assert [spec.key for spec in queue_asset_specs(["a-b", "a-b"])] == [A_DASH_B]


def test_two_queues_with_one_key_are_refused_naming_both() -> None:
    # A name chosen to be another queue's replaced key: the one collision left possible.
    clash = ["a-b", "a_b_34fafddd"]
    with pytest.raises(ValueError, match=r"'a-b'.*'a_b_34fafddd'"):
        queue_asset_specs(clash)
    with pytest.raises(ValueError, match=r"'a-b'.*'a_b_34fafddd'"):
        build_queue_asset_checks(clash)


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
