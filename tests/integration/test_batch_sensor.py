"""The fan-in: one downstream run per finished batch, never before its last task ends."""

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster._core.definitions.sensor_definition import SensorExecutionData

from dagster_leasequeue import (
    ConfigurationError,
    LeaseQueue,
    LeaseQueueResource,
    batch_id_from_run,
    batch_metadata,
    build_batch_sensor,
    run_worker,
)

TASKS = 2000


@pytest.fixture
def resource(dsn: str, schema_name: str) -> LeaseQueueResource:
    return LeaseQueueResource(dsn=dsn, schema_name=schema_name, queue="docs")


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test(temp_dir=str(tmp_path)) as test_instance:
        yield test_instance


@dg.asset
def fan_out(leasequeue: LeaseQueueResource) -> dg.MaterializeResult:
    batch = leasequeue.enqueue_batch(
        ({"n": n} for n in range(TASKS)), name="fan-out-once", max_attempts=1
    )
    return dg.MaterializeResult(metadata=batch_metadata(batch))


@dg.asset(deps=[fan_out])
def fan_in(context: dg.AssetExecutionContext, leasequeue: LeaseQueueResource) -> dict[str, int]:
    batch_id = batch_id_from_run(context)
    total = sum(task.result["n"] for task in leasequeue.batch_results(batch_id))  # type: ignore[index]
    return {"batch_id": batch_id, "sum": total}


SENSOR = build_batch_sensor(name="fan_in_when_done", upstream=fan_out.key, asset_selection=[fan_in])


def tick(
    instance: dg.DagsterInstance, resource: LeaseQueueResource, cursor: str | None
) -> SensorExecutionData:
    """One evaluation, as the daemon makes it."""
    with dg.build_sensor_context(
        instance=instance,
        cursor=cursor,
        resources={"leasequeue": resource},
        definitions=dg.Definitions(
            assets=[fan_out, fan_in], sensors=[SENSOR], resources={"leasequeue": resource}
        ),
    ) as context:
        return SENSOR.evaluate_tick(context)


def test_the_fan_in_is_requested_once_after_the_last_task(
    instance: dg.DagsterInstance, resource: LeaseQueueResource, dsn: str, schema_name: str
) -> None:
    assert dg.materialize([fan_out], instance=instance, resources={"leasequeue": resource}).success
    # A retried fan-out finds its batch by name: one batch, not two.
    assert dg.materialize([fan_out], instance=instance, resources={"leasequeue": resource}).success
    with LeaseQueue(dsn, schema=schema_name) as queue:
        (info,) = queue.batches()
        assert info.total == TASKS
        # The test holds one task, so the batch cannot finish while 4 workers drain the rest.
        held = queue.claim(queue="docs", lease_seconds=300)
        assert held is not None

        workers = [
            threading.Thread(
                target=run_worker,
                args=(queue, lambda payload: {"n": payload["n"]}),
                kwargs={"queue_name": "docs", "burst": True},
            )
            for _ in range(4)
        ]
        for worker in workers:
            worker.start()
        cursor = None
        ticks = 0
        while any(worker.is_alive() for worker in workers):
            result = tick(instance, resource, cursor)
            assert result.run_requests == [], "requested while the batch was running"
            cursor = result.cursor
            ticks += 1
            time.sleep(0.25)
        assert ticks >= 2  # it ticked during the drain
        assert tick(instance, resource, cursor).run_requests == []
        assert queue.batch(info.id).done == TASKS - 1

        held.ack({"n": held.payload["n"]})
        before = cursor
        result = tick(instance, resource, cursor)
        (request,) = result.run_requests or []
        assert request.run_key == f"leasequeue-batch-{info.id}"
        assert request.tags["leasequeue/batch"] == str(info.id)
        (observation,) = result.asset_events or []
        assert isinstance(observation, dg.AssetObservation)
        assert observation.asset_key == dg.AssetKey(["leasequeue", "docs"])
        metadata = {key: value.value for key, value in observation.metadata.items()}
        assert (metadata["event"], metadata["done"], metadata["dead"]) == (
            "batch_finished",
            TASKS,
            0,
        )
        assert isinstance(metadata["tasks_per_second"], float)
        # The next tick requests nothing; a tick whose result was thrown away requests the
        # same run key again, which Dagster runs once.
        assert tick(instance, resource, result.cursor).run_requests == []
        (again,) = tick(instance, resource, before).run_requests or []
        assert again.run_key == request.run_key

    report = dg.materialize(
        [fan_in], instance=instance, resources={"leasequeue": resource}, tags=request.tags
    )
    assert report.output_for_node("fan_in") == {
        "batch_id": info.id,
        "sum": sum(range(TASKS)),
    }


def test_a_batch_with_dead_tasks_still_fans_in(
    instance: dg.DagsterInstance, resource: LeaseQueueResource
) -> None:
    queue = resource.get_queue()
    queue.install()
    batch = queue.enqueue_batch([{"n": 1}, {"n": 2}], queue="docs", max_attempts=1)
    dg.materialize([_recording(batch.id)], instance=instance)
    for _ in range(2):
        lease = queue.claim(queue="docs")
        assert lease is not None
        lease.fail("unreadable")
    (request,) = tick(instance, resource, None).run_requests or []
    assert request.tags["leasequeue/batch"] == str(batch.id)
    queue.close()


def _recording(batch_id: object, **metadata: object) -> dg.AssetsDefinition:
    """An upstream asset of the sensor's key that records a batch id (and ``metadata``)."""

    @dg.asset(name="fan_out")
    def recorded() -> dg.MaterializeResult:
        return dg.MaterializeResult(metadata={"leasequeue/batch_id": batch_id, **metadata})

    return recorded


def test_a_materialization_that_names_no_batch_is_skipped_and_the_rest_fan_in(
    instance: dg.DagsterInstance, resource: LeaseQueueResource
) -> None:
    queue = resource.get_queue()
    queue.install()
    batch = queue.enqueue_batch([], queue="docs")  # finished at once
    dg.materialize([_recording("batch-7")], instance=instance)
    dg.materialize([_recording(0)], instance=instance)
    dg.materialize([_recording(batch.id)], instance=instance)
    (request,) = tick(instance, resource, None).run_requests or []
    assert request.tags["leasequeue/batch"] == str(batch.id)
    queue.close()


def test_a_batch_of_the_same_id_in_another_queue_is_not_the_one_recorded(
    instance: dg.DagsterInstance, resource: LeaseQueueResource
) -> None:
    # The asset made batch 1 of queue "invoices" elsewhere (another schema or database);
    # this schema's batch 1, of queue "docs", has finished: it must not fan in for it.
    queue = resource.get_queue()
    queue.install()
    batch = queue.enqueue_batch([], queue="docs", name="docs-batch")
    elsewhere = {"leasequeue/queue": "invoices", "leasequeue/batch_name": "docs-batch"}
    dg.materialize([_recording(batch.id, **elsewhere)], instance=instance)
    assert tick(instance, resource, None).run_requests == []
    named = {"leasequeue/queue": "docs", "leasequeue/batch_name": "docs-batch"}
    dg.materialize([_recording(batch.id, **named)], instance=instance)
    (request,) = tick(instance, resource, None).run_requests or []
    assert request.tags["leasequeue/batch"] == str(batch.id)
    queue.close()


@pytest.mark.parametrize("targets", [{}, {"asset_selection": [fan_in], "job": "x"}])
def test_the_batch_sensor_needs_exactly_one_target(targets: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match="exactly one of asset_selection and job"):
        build_batch_sensor(name="bad", upstream=fan_out.key, **targets)


def test_the_batch_sensor_says_what_to_give_it() -> None:
    with pytest.raises(ConfigurationError, match="asset_selection names no asset"):
        build_batch_sensor(name="bad", upstream=fan_out.key, asset_selection=[])
    with pytest.raises(ConfigurationError, match="upstream must be the fan-out asset's key"):
        build_batch_sensor(name="bad", upstream=5, asset_selection=[fan_in])  # type: ignore[arg-type]
    for upstream in ("fan_out", ["fan_out"], fan_out, dg.AssetSpec("fan_out")):
        sensor = build_batch_sensor(name="ok", upstream=upstream, asset_selection=[fan_in])
        assert "fan_out has finished" in (sensor.description or "")


def test_batch_id_from_run_says_what_is_missing(
    instance: dg.DagsterInstance, resource: LeaseQueueResource
) -> None:
    resource.get_queue().install()
    with pytest.raises(Exception, match="leasequeue/batch"):
        dg.materialize([fan_in], instance=instance, resources={"leasequeue": resource})


@pytest.mark.parametrize("value", ["abc", "-3", "0", "1.5"])
def test_batch_id_from_run_says_when_the_tag_is_not_a_batch_id(
    instance: dg.DagsterInstance, resource: LeaseQueueResource, value: str
) -> None:
    resource.get_queue().install()
    with pytest.raises(Exception, match=f"tag '{value}', which is not a batch id"):
        dg.materialize(
            [fan_in],
            instance=instance,
            resources={"leasequeue": resource},
            tags={"leasequeue/batch": value},
        )
