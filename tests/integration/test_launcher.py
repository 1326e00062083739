"""The worker launcher sensor: how many runs it requests, and the concurrency limit."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.definitions.sensor_definition import SensorExecutionData
from dagster._core.remote_origin import InProcessCodeLocationOrigin
from dagster._core.test_utils import (
    create_run_for_test,
    create_test_daemon_workspace_context,
    freeze_time,
)
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget
from dagster._daemon.sensor import execute_sensor_iteration

from dagster_leasequeue import LeaseQueue, LeaseQueueResource
from dagster_leasequeue.dagster.keys import LAUNCHER_TAG, QUEUE_TAG
from dagster_leasequeue.dagster.launcher import build_worker_launcher_sensor

from ..helpers import run_sql

ROOT = Path(__file__).resolve().parents[2]
NAME = "leasequeue_worker_launcher"


@dg.op
def claim_until_empty() -> None:
    """Stands in for a worker; the tests never execute it."""


@dg.job
def worker() -> None:
    claim_until_empty()


# Loaded as a code location by the daemon test; the resource reads LEASEQUEUE_* from the env.
daemon_defs = dg.Definitions(
    jobs=[worker],
    sensors=[build_worker_launcher_sensor(worker, queue="documents", tasks_per_run=10)],
    resources={"leasequeue": LeaseQueueResource()},
)


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as test_instance:
        yield test_instance


@pytest.fixture
def resources(dsn: str, schema_name: str, queue: LeaseQueue) -> dict[str, object]:
    return {"leasequeue": LeaseQueueResource(dsn=dsn, schema_name=schema_name, queue="documents")}


def tick(
    sensor: dg.SensorDefinition,
    instance: dg.DagsterInstance,
    resources: Mapping[str, object],
    cursor: str | None = None,
) -> SensorExecutionData:
    with dg.build_sensor_context(
        instance=instance, resources=resources, cursor=cursor, sensor_name=sensor.name
    ) as context:
        return sensor.evaluate_tick(context)


def fake_run(
    instance: dg.DagsterInstance,
    status: dg.DagsterRunStatus,
    *,
    launcher: str | None = NAME,
    job_name: str = "worker",
) -> None:
    tags = {LAUNCHER_TAG: launcher} if launcher else {}
    create_run_for_test(instance, job_name=job_name, status=status, tags=tags)


def test_no_waiting_task_skips(
    queue: LeaseQueue, instance: dg.DagsterInstance, resources: dict[str, object]
) -> None:
    sensor = build_worker_launcher_sensor(worker)
    result = tick(sensor, instance, resources)
    assert not result.run_requests
    assert str(result.skip_message).startswith("no waiting tasks: queue 'documents': 0 task(s)")
    # Tasks delayed into the future, or waiting in another queue, call for no run either.
    queue.enqueue({"n": 1}, queue="documents", delay=3600)
    queue.enqueue({"n": 2}, queue="other")
    result = tick(sensor, instance, resources)
    assert not result.run_requests
    assert "no waiting tasks" in str(result.skip_message)
    assert "(1 more delayed)" in str(result.skip_message)
    assert result.cursor == "0"


def test_requests_one_run_per_batch_of_tasks_up_to_the_limit(
    queue: LeaseQueue, instance: dg.DagsterInstance, resources: dict[str, object]
) -> None:
    queue.enqueue_many([{"n": n} for n in range(15)], queue="documents")
    sensor = build_worker_launcher_sensor(worker, max_concurrent_runs=3, tasks_per_run=10)
    result = tick(sensor, instance, resources)
    requests = result.run_requests or []
    assert [r.run_key for r in requests] == [f"{NAME}-1", f"{NAME}-2"]  # ceil(15 / 10)
    for request, number in zip(requests, ["1", "2"], strict=True):
        assert request.tags[LAUNCHER_TAG] == NAME and request.tags[QUEUE_TAG] == "documents"
        assert request.tags["leasequeue/launch"] == number
    assert result.cursor == "2"
    # More tasks than the limit allows: only max_concurrent_runs runs, fresh keys.
    queue.enqueue_many([{"n": n} for n in range(100)], queue="documents")
    result = tick(sensor, instance, resources, cursor="2")
    assert [r.run_key for r in result.run_requests or []] == [f"{NAME}-{n}" for n in (3, 4, 5)]
    assert result.cursor == "5"


def test_in_progress_runs_count_against_the_limit(
    queue: LeaseQueue, instance: dg.DagsterInstance, resources: dict[str, object]
) -> None:
    queue.enqueue_many([{"n": n} for n in range(500)], queue="documents")
    sensor = build_worker_launcher_sensor(worker, max_concurrent_runs=3)
    # Runs that hold no slot: finished, of another launcher, of another job, untagged.
    fake_run(instance, dg.DagsterRunStatus.SUCCESS)
    fake_run(instance, dg.DagsterRunStatus.FAILURE)
    fake_run(instance, dg.DagsterRunStatus.STARTED, launcher="another_launcher")
    fake_run(instance, dg.DagsterRunStatus.STARTED, job_name="other_job")
    fake_run(instance, dg.DagsterRunStatus.STARTED, launcher=None)
    fake_run(instance, dg.DagsterRunStatus.STARTING)  # QUEUED runs: the daemon test
    fake_run(instance, dg.DagsterRunStatus.STARTED)
    result = tick(sensor, instance, resources, cursor="7")
    assert [r.run_key for r in result.run_requests or []] == [f"{NAME}-8"]
    fake_run(instance, dg.DagsterRunStatus.NOT_STARTED)
    result = tick(sensor, instance, resources, cursor="8")
    assert not result.run_requests and result.cursor == "8"
    assert str(result.skip_message) == (
        "concurrency limit reached: queue 'documents': 500 task(s) waiting, 0 processing; "
        "3 of 3 run(s) of 'worker' in progress"
    )


def test_a_lost_cursor_does_not_reuse_run_keys(
    queue: LeaseQueue, instance: dg.DagsterInstance, resources: dict[str, object]
) -> None:
    queue.enqueue({"n": 1}, queue="documents")
    for _ in range(3):
        fake_run(instance, dg.DagsterRunStatus.SUCCESS)
    sensor = build_worker_launcher_sensor(worker)
    for cursor in (None, "garbage"):
        result = tick(sensor, instance, resources, cursor=cursor)
        assert [r.run_key for r in result.run_requests or []] == [f"{NAME}-4"]


def test_custom_resource_key_and_queue(
    queue: LeaseQueue, instance: dg.DagsterInstance, dsn: str, schema_name: str
) -> None:
    queue.enqueue_many([{"n": n} for n in range(3)], queue="reports")
    sensor = build_worker_launcher_sensor(
        worker, name="reports_launcher", resource_key="queues", queue="reports", tasks_per_run=1
    )
    assert sensor.required_resource_keys == {"queues"}
    resources = {"queues": LeaseQueueResource(dsn=dsn, schema_name=schema_name)}
    result = tick(sensor, instance, resources)
    requests = result.run_requests or []
    assert [r.run_key for r in requests] == ["reports_launcher-1", "reports_launcher-2"]
    assert requests[0].tags[QUEUE_TAG] == "reports"
    with pytest.raises(dg.DagsterInvalidDefinitionError):
        build_worker_launcher_sensor(worker, max_concurrent_runs=0)


def test_daemon_ticks_never_exceed_the_limit(
    queue: LeaseQueue, dsn: str, schema_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real daemon ticks: the runs requested by one tick are counted by the next."""
    monkeypatch.setenv("LEASEQUEUE_DSN", dsn)
    monkeypatch.setenv("LEASEQUEUE_SCHEMA_NAME", schema_name)
    queue.enqueue_many([{"n": n} for n in range(50)], queue="documents")
    # Queued runs stay queued (no run-queue daemon here): they hold their slots.
    overrides = {
        "run_coordinator": {
            "module": "dagster._core.run_coordinator",
            "class": "QueuedRunCoordinator",
        }
    }
    origin = InProcessCodeLocationOrigin(
        LoadableTargetOrigin(
            module_name="tests.integration.test_launcher",
            attribute="daemon_defs",
            working_directory=str(ROOT),
        ),
        location_name="launcher_test",
    )
    with (
        dg.instance_for_test(overrides=overrides) as instance,
        create_test_daemon_workspace_context(
            InProcessWorkspaceLoadTarget(origin), instance
        ) as workspace,
    ):
        location = next(
            entry.code_location
            for entry in workspace.create_request_context().get_code_location_entries().values()
        )
        assert location is not None
        (repository,) = location.get_repositories().values()
        sensor = repository.get_sensor(NAME)
        instance.start_sensor(sensor)

        def daemon_tick() -> None:
            logger = logging.getLogger("leasequeue.tick")
            list(execute_sensor_iteration(workspace, logger, None, None))

        daemon_tick()
        runs = instance.get_runs()
        assert sorted(run.tags["dagster/run_key"] for run in runs) == [f"{NAME}-1", f"{NAME}-2"]
        assert {run.status for run in runs} == {dg.DagsterRunStatus.QUEUED}
        assert all(run.tags[LAUNCHER_TAG] == NAME for run in runs)
        with freeze_time(time.time() + 60):
            daemon_tick()
        assert len(instance.get_runs()) == 2  # limit reached: skipped
        # One run finishes: the next tick fills its slot, under a fresh run key.
        instance.report_run_canceled(runs[0])
        with freeze_time(time.time() + 120):
            daemon_tick()
        keys = sorted(run.tags["dagster/run_key"] for run in instance.get_runs())
        assert keys == [f"{NAME}-1", f"{NAME}-2", f"{NAME}-3"]
        ticks = instance.get_ticks(sensor.get_remote_origin_id(), sensor.selector_id)
        assert "concurrency limit reached" in str(ticks[1].skip_reason)
    assert run_sql(queue, "SELECT count(*) FROM {schema}.tasks")[0][0] == 50
