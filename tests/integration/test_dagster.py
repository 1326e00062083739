"""The Dagster layer: resource, sweeper sensor ticks stored by the daemon's code path, example."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.definitions.sensor_definition import SensorExecutionData
from dagster._core.test_utils import freeze_time

from dagster_leasequeue import (
    ConfigurationError,
    LeaseQueue,
    LeaseQueueResource,
    build_sweeper_sensor,
)
from example_repo.definitions import SUMMARIES_PER_SECOND, defs, process_documents
from example_repo.ticks import run_sensor_tick

from ..helpers import expire, run_sql
from ..own_server import OwnServer

ROOT = Path(__file__).resolve().parents[2]
ASSET = dg.AssetKey(["leasequeue", "documents"])
FAST = {"ops": {"process_documents_op": {"config": {"page_seconds": 0.001}}}}


@pytest.fixture
def example_env(
    dsn: str, schema_name: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LeaseQueue]:
    """The example's settings come from the environment, as a user would set them."""
    monkeypatch.setenv("LEASEQUEUE_DSN", dsn)
    monkeypatch.setenv("LEASEQUEUE_SCHEMA_NAME", schema_name)
    with LeaseQueue(dsn, schema=schema_name) as queue:
        queue.install()
        yield queue


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test(temp_dir=str(tmp_path)) as test_instance:
        yield test_instance


def summaries(queue: LeaseQueue) -> list[tuple[str, int]]:
    return [
        (row[0], int(row[1]))
        for row in run_sql(
            queue,
            "SELECT document, count(*) FROM {schema}.document_summaries GROUP BY 1 ORDER BY 1",
        )
    ]


def observations(instance: dg.DagsterInstance, event: str) -> list[dict[str, object]]:
    records = instance.fetch_observations(ASSET, limit=1000, ascending=True).records
    found = []
    for record in records:
        observation = record.asset_observation
        assert observation is not None
        metadata = {key: value.value for key, value in observation.metadata.items()}
        if metadata["event"] == event:
            found.append(metadata)
    return found


def test_example_jobs_run_in_process(example_env: LeaseQueue, instance: dg.DagsterInstance) -> None:
    result = defs.get_job_def("enqueue_documents").execute_in_process(instance=instance)
    assert result.success and len(result.output_for_node("enqueue_documents_op")) == 6
    # The summarisation model's rate limit is on the queue, for every worker's claims.
    flow = example_env.flow("documents")
    assert (flow.per_second, flow.burst) == (SUMMARIES_PER_SECOND, SUMMARIES_PER_SECOND)
    # Enqueueing again adds nothing: every document is still waiting under its key.
    defs.get_job_def("enqueue_documents").execute_in_process(instance=instance)
    assert example_env.stats("documents").counts["enqueued"] == 6
    result = defs.get_job_def("process_documents").execute_in_process(
        instance=instance, run_config=FAST
    )
    assert result.success
    assert result.output_for_node("process_documents_op") == {"processed": 6, "skipped": 0}
    assert [count for _, count in summaries(example_env)] == [1] * 6
    info = example_env.get(1)
    assert info.status == "done" and info.result is not None and info.result["words"] > 0
    assert info.worker_id is not None
    assert info.worker_id.startswith(f"dagster-run:{result.run_id}:process_documents_op@")


def test_example_jobs_run_with_the_multiprocess_executor(
    example_env: LeaseQueue, instance: dg.DagsterInstance
) -> None:
    enqueue = dg.execute_job(
        dg.reconstructable(_enqueue_documents_job), instance=instance, raise_on_error=True
    )
    assert enqueue.success
    result = dg.execute_job(
        dg.reconstructable(_process_documents_job),
        instance=instance,
        run_config=FAST,
        raise_on_error=True,
    )
    assert result.success
    assert [count for _, count in summaries(example_env)] == [1] * 6
    run = instance.get_run_by_id(result.run_id)
    assert run is not None
    assert "multiprocess" in str(instance.all_logs(result.run_id)).lower()


def _enqueue_documents_job() -> dg.JobDefinition:
    return defs.get_job_def("enqueue_documents")


def _process_documents_job() -> dg.JobDefinition:
    return defs.get_job_def("process_documents")


def test_sensor_tick_reports_recoveries_in_the_event_log(
    example_env: LeaseQueue, instance: dg.DagsterInstance
) -> None:
    queue = example_env
    ids = queue.enqueue_many(
        [{"document": f"d{n}.pdf", "pages": 1} for n in range(3)], queue="documents"
    )
    queue.claim_many(2, queue="documents", worker_id="crashed-worker")
    expire(queue, ids[0], ids[1])
    assert [s.value for s in run_sensor_tick(instance, "leasequeue_sweeper")] == ["SKIPPED"]
    recovered = observations(instance, "lease_recovered")
    assert sorted(m["task_id"] for m in recovered) == ids[:2]
    assert {(m["action"], m["attempt"], m["worker_id"]) for m in recovered} == {
        ("requeued", 1, "crashed-worker")
    }
    assert all(float(m["seconds_overdue"]) >= 1 for m in recovered)  # type: ignore[arg-type]
    (counts,) = observations(instance, "queue_counts")
    assert (counts["enqueued"], counts["processing"]) == (3, 0)
    # The next tick (past the sensor's minimum interval) reports neither the recoveries
    # again nor the counts, which have not changed.
    with freeze_time(time.time() + 60):
        run_sensor_tick(instance, "leasequeue_sweeper")
    assert len(observations(instance, "lease_recovered")) == 2
    assert len(observations(instance, "queue_counts")) == 1


def test_a_dropped_tick_loses_nothing(
    example_env: LeaseQueue, instance: dg.DagsterInstance
) -> None:
    queue = example_env
    task_id = queue.enqueue({"document": "x.pdf", "pages": 1}, queue="documents")
    queue.claim(queue="documents")
    expire(queue, task_id)
    # A preview ("Test sensor" in the UI) sweeps but its events are thrown away.
    sensor = build_sweeper_sensor()
    with dg.build_sensor_context(
        instance=instance, resources={"leasequeue": LeaseQueueResource()}
    ) as context:
        preview = sensor.evaluate_tick(context)
    assert len(preview.asset_events) == 2
    assert observations(instance, "lease_recovered") == []
    # The daemon's next tick starts from the stored cursor and reports the recovery.
    run_sensor_tick(instance, "leasequeue_sweeper")
    assert [m["task_id"] for m in observations(instance, "lease_recovered")] == [task_id]


def test_the_cursor_reports_each_recovery_once(example_env: LeaseQueue) -> None:
    queue = example_env
    ids = queue.enqueue_many([{"n": n} for n in range(3)], queue="documents", max_attempts=1)
    queue.claim_many(3, queue="documents")
    expire(queue, *ids)
    queue.sweep()  # recovered elsewhere: the sensor still reports them
    sensor = build_sweeper_sensor()
    resources = {"leasequeue": LeaseQueueResource()}

    def tick(cursor: str | None) -> SensorExecutionData:
        with dg.build_sensor_context(cursor=cursor, resources=resources) as context:
            return sensor.evaluate_tick(context)

    def recovered(result: SensorExecutionData) -> list[int]:
        return [
            int(event.metadata["task_id"].value)  # type: ignore[arg-type]
            for event in result.asset_events
            if event.metadata["event"].value == "lease_recovered"
        ]

    with freeze_time(time.time()):  # the cursor holds when the counts were recorded
        first, again = tick(None), tick(None)
    assert recovered(first) == recovered(again) == ids
    assert first.cursor == again.cursor
    following = tick(first.cursor)
    assert recovered(following) == [] and following.cursor == first.cursor
    assert "swept 0 expired lease(s)" in str(following.skip_message)
    assert "3 dead" in str(first.skip_message)


def test_sensor_with_a_job_requests_a_worker_run(example_env: LeaseQueue) -> None:
    queue = example_env
    task_id = queue.enqueue({"n": 1}, queue="documents")
    queue.claim(queue="documents")
    expire(queue, task_id)
    sensor = build_sweeper_sensor(name="with_job", job=process_documents)
    with dg.build_sensor_context(resources={"leasequeue": LeaseQueueResource()}) as context:
        result = sensor.evaluate_tick(context)
    (request,) = result.run_requests or []
    last_event = queue.recovery_events()[-1].id
    assert request.run_key == f"with_job-recovered-{last_event}"


def test_a_queue_that_emptied_is_reported_once_more_with_zeros(example_env: LeaseQueue) -> None:
    queue = example_env
    queue.enqueue({"document": "a.pdf", "pages": 1}, queue="documents")
    sensor = build_sweeper_sensor(counts_every_seconds=0)
    resources = {"leasequeue": LeaseQueueResource()}

    def tick(cursor: str | None) -> SensorExecutionData:
        with dg.build_sensor_context(cursor=cursor, resources=resources) as context:
            return sensor.evaluate_tick(context)

    def counts(result: SensorExecutionData) -> dict[str, object]:
        return {
            event.asset_key.path[-1]: event.metadata["enqueued"].value
            for event in result.asset_events
            if event.metadata["event"].value == "queue_counts"
        }

    first = tick(None)
    assert counts(first) == {"documents": 1}
    lease = queue.claim(queue="documents")
    assert lease is not None
    lease.ack()
    emptied = tick(first.cursor)
    assert counts(emptied) == {"documents": 0}
    assert counts(tick(emptied.cursor)) == {}


def test_a_cursor_of_an_earlier_version_is_read(example_env: LeaseQueue) -> None:
    queue = example_env
    task_id = queue.enqueue({"n": 1}, queue="documents")
    queue.claim(queue="documents")
    expire(queue, task_id)
    queue.sweep()
    (event,) = queue.recovery_events()
    sensor = build_sweeper_sensor()
    resources = {"leasequeue": LeaseQueueResource()}
    with dg.build_sensor_context(cursor=str(event.id), resources=resources) as context:
        result = sensor.evaluate_tick(context)
    assert [e for e in result.asset_events if e.metadata["event"].value == "lease_recovered"] == []


def sweeper_tick(sensor: dg.SensorDefinition, cursor: str | None, at: float) -> SensorExecutionData:
    """One tick of the sensor, evaluated here as if at the time ``at``."""
    resources = {"leasequeue": LeaseQueueResource()}
    with freeze_time(at), dg.build_sensor_context(cursor=cursor, resources=resources) as context:
        return sensor.evaluate_tick(context)


def recorded_counts(result: SensorExecutionData) -> dict[str, dict[str, object]]:
    """The task counts each queue_counts observation of the tick records, by queue."""
    return {
        event.asset_key.path[-1]: {
            key: event.metadata[key].value for key in ("enqueued", "processing", "dead", "due")
        }
        for event in result.asset_events
        if event.metadata["event"].value == "queue_counts"
    }


def recovered_ids(result: SensorExecutionData) -> list[object]:
    return [
        event.metadata["task_id"].value
        for event in result.asset_events
        if event.metadata["event"].value == "lease_recovered"
    ]


def waiting(enqueued: int) -> dict[str, object]:
    return {"enqueued": enqueued, "processing": 0, "dead": 0, "due": enqueued}


def test_unchanged_counts_are_not_recorded_again(example_env: LeaseQueue) -> None:
    example_env.enqueue({"document": "a.pdf", "pages": 1}, queue="documents")
    sensor = build_sweeper_sensor()
    start = time.time()
    first = sweeper_tick(sensor, None, start)
    assert recorded_counts(first) == {"documents": waiting(1)}
    soon = sweeper_tick(sensor, first.cursor, start + 30)
    assert recorded_counts(soon) == {}
    assert recorded_counts(sweeper_tick(sensor, soon.cursor, start + 3600)) == {}


def test_a_pause_is_observed_at_once_with_the_limits_in_force(example_env: LeaseQueue) -> None:
    queue = example_env
    queue.enqueue({"document": "a.pdf", "pages": 1}, queue="documents")
    queue.set_concurrency_limit("documents", 3)
    queue.set_rate_limit("documents", per_second=2, key="acme")
    sensor = build_sweeper_sensor()
    start = time.time()
    first = sweeper_tick(sensor, None, start)

    def observed(result: SensorExecutionData) -> list[dict[str, object]]:
        return [
            {key: value.value for key, value in event.metadata.items()}
            for event in result.asset_events
            if event.metadata["event"].value == "queue_counts"
        ]

    (limits,) = observed(first)
    assert (limits["paused"], limits["max_running_per_key"]) == (False, 3)
    assert limits["key_limits"] == {"acme": {"running": 0, "max_running": None, "per_second": 2.0}}
    queue.pause("documents")
    # Within the counts' interval, a pause is recorded all the same, and so is the resume.
    (paused,) = observed(paused_tick := sweeper_tick(sensor, first.cursor, start + 30))
    assert paused["paused"] is True and paused["enqueued"] == 1
    queue.resume("documents")
    (resumed,) = observed(sweeper_tick(sensor, paused_tick.cursor, start + 60))
    assert resumed["paused"] is False


def test_a_paused_queue_keeps_the_interval_of_every_queue(example_env: LeaseQueue) -> None:
    # A paused queue's recorded counts carry its pause: the next tick must read them back,
    # or it forgets every queue's record and records them all again, every tick.
    queue = example_env
    queue.enqueue({"document": "a.pdf", "pages": 1}, queue="documents")
    queue.enqueue({"n": 1}, queue="reports")
    queue.pause("reports")
    sensor = build_sweeper_sensor()
    start = time.time()
    first = sweeper_tick(sensor, None, start)
    assert set(recorded_counts(first)) == {"documents", "reports"}
    queue.enqueue({"document": "b.pdf", "pages": 1}, queue="documents")
    result = sweeper_tick(sensor, first.cursor, start + 30)
    assert recorded_counts(result) == {}
    result = sweeper_tick(sensor, result.cursor, start + 300)
    assert recorded_counts(result) == {"documents": waiting(2)}


def test_changed_counts_wait_until_the_interval_has_passed(example_env: LeaseQueue) -> None:
    queue = example_env
    queue.enqueue({"document": "a.pdf", "pages": 1}, queue="documents")
    sensor = build_sweeper_sensor()
    start = time.time()
    first = sweeper_tick(sensor, None, start)
    assert recorded_counts(first) == {"documents": waiting(1)}
    queue.enqueue({"document": "b.pdf", "pages": 1}, queue="documents")
    queue.enqueue({"n": 1}, queue="reports")
    # Each queue has its own interval: one not recorded yet is recorded at once.
    result = sweeper_tick(sensor, first.cursor, start + 60)
    assert recorded_counts(result) == {"reports": waiting(1)}
    result = sweeper_tick(sensor, result.cursor, start + 299)
    assert recorded_counts(result) == {}
    result = sweeper_tick(sensor, result.cursor, start + 300)
    assert recorded_counts(result) == {"documents": waiting(2)}


def test_changed_counts_after_the_interval_are_recorded(example_env: LeaseQueue) -> None:
    queue = example_env
    queue.enqueue({"document": "a.pdf", "pages": 1}, queue="documents")
    sensor = build_sweeper_sensor(counts_every_seconds=120)
    start = time.time()
    first = sweeper_tick(sensor, None, start)
    queue.enqueue({"document": "b.pdf", "pages": 1}, queue="documents")
    result = sweeper_tick(sensor, first.cursor, start + 400)
    assert recorded_counts(result) == {"documents": waiting(2)}
    # The interval runs from that record.
    queue.enqueue({"document": "c.pdf", "pages": 1}, queue="documents")
    result = sweeper_tick(sensor, result.cursor, start + 500)
    assert recorded_counts(result) == {}
    result = sweeper_tick(sensor, result.cursor, start + 520)
    assert recorded_counts(result) == {"documents": waiting(3)}


def test_a_queue_that_emptied_within_the_interval_gets_its_zeros_after_it(
    example_env: LeaseQueue,
) -> None:
    queue = example_env
    queue.enqueue({"document": "a.pdf", "pages": 1}, queue="documents")
    sensor = build_sweeper_sensor()
    start = time.time()
    first = sweeper_tick(sensor, None, start)
    lease = queue.claim(queue="documents")
    assert lease is not None
    lease.ack()
    result = sweeper_tick(sensor, first.cursor, start + 60)
    assert recorded_counts(result) == {}
    result = sweeper_tick(sensor, result.cursor, start + 300)
    assert recorded_counts(result) == {"documents": waiting(0)}
    assert recorded_counts(sweeper_tick(sensor, result.cursor, start + 900)) == {}


def test_recovered_tasks_are_reported_on_every_tick(example_env: LeaseQueue) -> None:
    queue = example_env
    ids = queue.enqueue_many([{"n": n} for n in range(3)], queue="documents")
    queue.claim_many(3, queue="documents", worker_id="crashed-worker")
    sensor = build_sweeper_sensor()
    start = time.time()
    result = sweeper_tick(sensor, None, start)
    assert recovered_ids(result) == []
    assert recorded_counts(result)["documents"]["processing"] == 3
    for tick, task_id in enumerate(ids, start=1):
        expire(queue, task_id)
        result = sweeper_tick(sensor, result.cursor, start + tick)
        assert recovered_ids(result) == [task_id]
        assert recorded_counts(result) == {}


def test_a_cursor_without_recorded_counts_records_every_queue_once(
    example_env: LeaseQueue,
) -> None:
    queue = example_env
    task_id = queue.enqueue({"n": 1}, queue="documents")
    queue.claim(queue="documents")
    expire(queue, task_id)
    queue.sweep()
    (event,) = queue.recovery_events()
    # The cursor of the previous version: "reports" had live tasks at its last tick.
    cursor = json.dumps({"event": event.id, "queues": ["documents", "reports"]})
    sensor = build_sweeper_sensor()
    start = time.time()
    result = sweeper_tick(sensor, cursor, start)
    assert recovered_ids(result) == []
    assert recorded_counts(result) == {"documents": waiting(1), "reports": waiting(0)}
    assert recorded_counts(sweeper_tick(sensor, result.cursor, start + 30)) == {}


@pytest.mark.parametrize("every", [-1, "300", True, float("nan"), None])
def test_counts_every_seconds_is_checked(every: object) -> None:
    with pytest.raises(ConfigurationError, match="counts_every_seconds"):
        build_sweeper_sensor(counts_every_seconds=every)  # type: ignore[arg-type]


@pytest.mark.slow
def test_killed_worker_is_recovered_by_a_tick_and_its_result_written_once(
    example_env: LeaseQueue, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = example_env
    monkeypatch.setenv("LEASEQUEUE_LEASE_SECONDS", "2")
    defs.get_job_def("enqueue_documents").execute_in_process(instance=instance)
    worker = subprocess.Popen(
        [sys.executable, "-m", "example_repo.demo", "worker", "--page-seconds", "0.05"],
        cwd=ROOT,
        env={**os.environ, "DAGSTER_HOME": instance.root_directory},
    )
    try:
        contract = _wait_for(lambda: _processing_contract(queue), timeout=60)
        os.kill(worker.pid, signal.SIGKILL)
    finally:
        worker.wait(30)
    held = queue.get(contract)
    assert held.status == "processing" and held.lease_expires_at is not None
    _wait_for(
        lambda: run_sql(queue, "SELECT clock_timestamp() > %(t)s", {"t": held.lease_expires_at})[0][
            0
        ]
    )
    run_sensor_tick(instance, "leasequeue_sweeper")
    recovered = observations(instance, "lease_recovered")
    assert [m["task_id"] for m in recovered] == [contract]
    assert str(recovered[0]["worker_id"]).startswith("dagster-run:")
    result = defs.get_job_def("process_documents").execute_in_process(
        instance=instance, run_config=FAST
    )
    assert result.success
    assert [count for _, count in summaries(queue)] == [1] * 6
    outcomes = [
        a.outcome for a in queue.attempts("master-services-agreement.pdf", queue="documents")
    ]
    assert outcomes == ["abandoned", "succeeded"]


def _processing_contract(queue: LeaseQueue) -> int | None:
    """The contract's task once its work has begun: leased, its attempt recorded running
    (the worker claims it in the statement that concludes the task before it)."""
    rows = run_sql(
        queue,
        "SELECT t.id FROM {schema}.tasks AS t JOIN {schema}.attempts AS a ON a.task_id = t.id"
        " WHERE t.status = 'processing' AND t.payload->>'kind' = 'contract'"
        " AND a.outcome = 'running'",
    )
    return int(rows[0][0]) if rows else None


def _wait_for(check, timeout: float = 30):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


def test_every_sensor_has_its_resources() -> None:
    resources = set(defs.resources or {})
    for sensor in defs.sensors or []:
        assert sensor.required_resource_keys <= resources  # type: ignore[union-attr]


def test_workspace_validates(example_env: LeaseQueue, tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "dagster", "definitions", "validate", "-w", "workspace.yaml"],
        cwd=ROOT,
        env={**os.environ, "DAGSTER_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "All code locations passed validation" in completed.stdout + completed.stderr


PASSWORD = "Sup3r-S3cret-pw"


def test_a_wrong_dsn_fails_at_setup_without_the_password(instance: dg.DagsterInstance) -> None:
    @dg.op
    def needs_queue(leasequeue: LeaseQueueResource) -> None:
        leasequeue.claim()

    @dg.job(
        resource_defs={
            "leasequeue": LeaseQueueResource(dsn=f"postgresql://app:{PASSWORD}@127.0.0.1:1/app")
        }
    )
    def broken() -> None:
        needs_queue()

    result = broken.execute_in_process(instance=instance, raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.is_failure)
    error_text = str(failure.event_specific_data)
    assert "cannot connect to PostgreSQL at 127.0.0.1:1/app" in error_text
    assert PASSWORD not in error_text
    logs = str(instance.all_logs(result.run_id))
    assert PASSWORD not in logs


def test_a_missing_dsn_variable_is_named(
    instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LEASEQUEUE_DSN", raising=False)

    @dg.op
    def needs_queue(leasequeue: LeaseQueueResource) -> None:
        leasequeue.claim()

    @dg.job(resource_defs={"leasequeue": LeaseQueueResource(dsn=dg.EnvVar("LEASEQUEUE_DSN"))})
    def unset() -> None:
        needs_queue()

    with pytest.raises(Exception, match="LEASEQUEUE_DSN"):
        unset.execute_in_process(instance=instance)


@pytest.mark.parametrize(
    "statement",
    [
        "import dagster_leasequeue",
        "import dagster_leasequeue.cli",
        "from dagster_leasequeue import LeaseQueue",
    ],
)
def test_importing_the_package_does_not_import_dagster(statement: str) -> None:
    # A fresh interpreter: this one imported Dagster long ago.
    code = (
        f"{statement}\n"
        "import sys\n"
        "print(sorted(name for name in sys.modules if name == 'dagster'"
        " or name.startswith(('dagster.', 'dagster_leasequeue.dagster'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


def test_the_top_level_dagster_names_are_those_of_the_dagster_subpackage() -> None:
    import dagster_leasequeue
    import dagster_leasequeue.dagster

    exported = set(dagster_leasequeue._DAGSTER_EXPORTS)
    assert exported == set(dagster_leasequeue.dagster.__all__)
    assert exported <= set(dagster_leasequeue.__all__)
    for name in exported:
        assert getattr(dagster_leasequeue, name) is getattr(dagster_leasequeue.dagster, name)
    # The subpackage imports the Dagster library, not itself, under the name "dagster".
    assert dagster_leasequeue.dagster.resource.dg is dg


def test_a_run_tagged_with_a_queue_works_that_queue(
    example_env: LeaseQueue, instance: dg.DagsterInstance
) -> None:
    task_id = example_env.enqueue({"n": 1}, queue="reports")

    @dg.op
    def take(leasequeue: LeaseQueueResource) -> int:
        lease = leasequeue.claim()
        assert lease is not None
        lease.ack()
        return lease.task_id

    @dg.job(resource_defs={"leasequeue": LeaseQueueResource(queue="documents")})
    def tagged() -> None:
        take()

    result = tagged.execute_in_process(instance=instance, tags={"leasequeue/queue": "reports"})
    assert result.output_for_node("take") == task_id


def test_the_example_op_outlives_a_database_restart(
    tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server crashes while the op reads the 200-page contract and is back eight seconds
    later: the op logs it, backs off, reconnects and finishes; every summary is written once.

    Eight, not less: the op notices the crash up to three seconds in (the contract's two
    seconds of reading, then a network timeout of one), and a call then waits up to two
    seconds for a connection. A shorter outage can end inside that wait, and the op then
    carries on without a failed call to log."""
    server = OwnServer(tmp_path / "server")
    server.start()
    monkeypatch.setenv("LEASEQUEUE_DSN", server.dsn)
    monkeypatch.setenv("LEASEQUEUE_SCHEMA_NAME", "lq")
    monkeypatch.setenv("LEASEQUEUE_CONNECT_TIMEOUT", "1")
    monkeypatch.setenv("LEASEQUEUE_NETWORK_TIMEOUT", "1")
    try:
        with LeaseQueue(server.dsn, schema="lq") as queue:
            queue.install()
            enqueue = defs.get_job_def("enqueue_documents").execute_in_process(
                instance=instance,
                run_config={"ops": {"enqueue_documents_op": {"config": {"copies": 2}}}},
            )
            assert enqueue.success

            def crash_once_a_summary_is_written() -> None:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not _summary_count(queue):
                    time.sleep(0.05)
                server.crash()
                time.sleep(8)
                server.start()

            outage = threading.Thread(target=crash_once_a_summary_is_written)
            outage.start()
            result = defs.get_job_def("process_documents").execute_in_process(
                instance=instance,
                run_config={"ops": {"process_documents_op": {"config": {"page_seconds": 0.01}}}},
            )
            outage.join(timeout=60)
            assert result.success
        with LeaseQueue(server.dsn, schema="lq") as queue:  # a pool made after the restart
            assert result.output_for_node("process_documents_op") == {
                "processed": 12,
                "skipped": 0,
            }
            # Two copies of each document, each summarised once.
            assert [count for _, count in summaries(queue)] == [2] * 6
            assert queue.stats("documents").counts["done"] == 12
            logged = "\n".join(
                str(entry.user_message) for entry in instance.all_logs(result.run_id)
            )
            assert "cannot claim" in logged
            assert "the database answers again" in logged
    finally:
        with contextlib.suppress(Exception):
            server.stop()


def _summary_count(queue: LeaseQueue) -> int:
    try:
        rows = run_sql(queue, "SELECT count(*) FROM {schema}.document_summaries")
    except Exception:  # the table is made by the op
        return 0
    return int(rows[0][0])


def test_an_empty_queue_name_given_to_the_resource_is_refused(example_env: LeaseQueue) -> None:
    """An empty name was taken for "no name", and the task went to the default queue."""
    leasequeue = LeaseQueueResource(queue="documents")
    example_env.enqueue({"n": 1}, queue="documents")
    with pytest.raises(ConfigurationError, match=r"^queue must be"):
        leasequeue.enqueue({"n": 2}, queue="")
    with pytest.raises(ConfigurationError, match=r"^queue must be"):
        leasequeue.claim(queue="")
    assert example_env.stats("documents").counts["enqueued"] == 1
