"""`dagster dev -w workspace.yaml` shows the example, its sensors observe and fan in."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg.conninfo import make_conninfo

from dagster_leasequeue import LeaseQueue

from ..helpers import expire

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = {"repositoryLocationName": "example_repo", "repositoryName": "__repository__"}
SWEEPER = "leasequeue_sweeper"
PASSWORD = "Dev-S3cret-Pw"
START_SENSOR = (
    "mutation($s: SensorSelector!) { startSensor(sensorSelector: $s) {"
    " ... on Sensor { sensorState { status } } ... on Error { message } } }"
)
METADATA_ENTRIES = (
    "metadataEntries { label ... on IntMetadataEntry { intValue }"
    " ... on TextMetadataEntry { text } ... on JsonMetadataEntry { jsonString } }"
)


def graphql(port: int, query: str, variables: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": query, "variables": variables or {}}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        body = json.load(response)
    if body.get("errors"):
        raise AssertionError(f"GraphQL errors: {body['errors']}")
    return body["data"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.timeout(240)
def test_dagster_dev_shows_the_example_and_the_sensor_observes(
    dsn: str, schema_name: str, tmp_path: Path
) -> None:
    with LeaseQueue(dsn, schema=schema_name) as queue:
        queue.install()
        task_id = queue.enqueue({"document": "x.pdf", "pages": 1}, queue="documents")
        queue.claim(queue="documents", worker_id="killed-worker")
        expire(queue, task_id)

    with _dagster_dev(dsn, schema_name, tmp_path) as port:
        repository = _wait_for_repository(port)
        assert {"enqueue_documents", "process_documents"} <= {j["name"] for j in repository["jobs"]}
        sensors = {s["name"]: s["sensorState"]["status"] for s in repository["sensors"]}
        assert sensors == {
            "leasequeue_sweeper": "STOPPED",
            "leasequeue_worker_launcher": "STOPPED",
            "document_report_when_batch_finished": "STOPPED",
        }
        assert {"path": ["leasequeue", "documents"]} in [
            node["assetKey"] for node in repository["assetNodes"]
        ]
        _start_sensor(port, SWEEPER)
        recovered = _wait_for_recovery_observation(port)
        assert recovered["task_id"] == task_id and recovered["worker_id"] == "killed-worker"
        resource = graphql(
            port,
            "query($s: ResourceSelector!) { topLevelResourceDetailsOrError(resourceSelector: $s)"
            " { ... on ResourceDetails { name configuredValues { key value type } } } }",
            {"s": {**REPOSITORY, "resourceName": "leasequeue"}},
        )
        assert resource["topLevelResourceDetailsOrError"]["name"] == "leasequeue"
        assert PASSWORD not in json.dumps(resource)


@pytest.mark.timeout(240)
def test_dagster_dev_fans_out_and_in(dsn: str, schema_name: str, tmp_path: Path) -> None:
    """As in the UI: materialize document_batch, start the launcher and the batch sensor,
    and document_report is materialized once, from the batch the workers drained."""
    with LeaseQueue(dsn, schema=schema_name) as queue:
        queue.install()

    with _dagster_dev(dsn, schema_name, tmp_path) as port:
        _wait_for_repository(port)
        run_id = _launch_asset_run(
            port, "document_batch", {"ops": {"document_batch": {"config": {"copies": 1}}}}
        )
        _wait_for_run(port, run_id)
        [batch_materialization] = _materializations(port, "document_batch")
        batch_id = batch_materialization["leasequeue/batch_id"]
        assert batch_materialization["leasequeue/batch_total"] == 6

        _start_sensor(port, "leasequeue_worker_launcher")
        _start_sensor(port, "document_report_when_batch_finished")
        report = _wait_for_materialization(port, "document_report")
        _wait_for_run(port, report["runId"])  # its asset check too
        # One run per batch: the sensor's ticks since requested nothing more.
        ticks = _ticks_after_last_request(port, "document_report_when_batch_finished")
        assert [run for tick in ticks for run in tick["runIds"]] == [report["runId"]]
        assert len(_materializations(port, "document_report")) == 1
        tags = graphql(
            port,
            "query($id: ID!) { runOrError(runId: $id) { ... on Run { tags { key value } } } }",
            {"id": report["runId"]},
        )["runOrError"]["tags"]
        assert {"key": "leasequeue/batch", "value": str(batch_id)} in tags

    with LeaseQueue(dsn, schema=schema_name) as queue:
        info = queue.batch(batch_id)
    assert info.finished
    assert report["batch_id"] == batch_id
    assert report["documents"] == info.total == 6
    assert report["summarised"] == info.done == 6
    assert report["dead"] == info.dead == 0
    assert report["cancelled"] == info.cancelled == 0


@contextlib.contextmanager
def _dagster_dev(dsn: str, schema_name: str, tmp_path: Path) -> Iterator[int]:
    """`dagster dev -w workspace.yaml` on the queue's schema; yields its port, then stops it."""
    port = free_port()
    env = {
        **os.environ,
        "DAGSTER_HOME": str(tmp_path),
        # trust authentication ignores the password; the UI must never show it
        "LEASEQUEUE_DSN": make_conninfo(dsn, password=PASSWORD),
        "LEASEQUEUE_SCHEMA_NAME": schema_name,
    }
    with (tmp_path / "dev.log").open("w") as log:
        dev = subprocess.Popen(
            [sys.executable, "-m", "dagster", "dev", "-w", "workspace.yaml", "-p", str(port)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, stopped as a whole below
        )
        try:
            yield port
        finally:
            _stop_group(dev)


def _start_sensor(port: int, name: str) -> None:
    started = graphql(port, START_SENSOR, {"s": {**REPOSITORY, "sensorName": name}})
    assert started["startSensor"].get("sensorState", {}).get("status") == "RUNNING", started


def _launch_asset_run(port: int, asset: str, run_config: dict[str, Any]) -> str:
    """Materialize one asset as the UI does: a run of the implicit asset job, subset to it."""
    launched = graphql(
        port,
        "mutation($p: ExecutionParams!) { launchRun(executionParams: $p) { __typename"
        " ... on LaunchRunSuccess { run { runId } } ... on Error { message } } }",
        {
            "p": {
                "selector": {
                    **REPOSITORY,
                    "pipelineName": "__ASSET_JOB",
                    "assetSelection": [{"path": [asset]}],
                },
                "runConfigData": run_config,
            }
        },
    )["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    return str(launched["run"]["runId"])


def _wait_for_run(port: int, run_id: str, timeout: float = 60) -> None:
    query = "query($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }"
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        status = graphql(port, query, {"id": run_id})["runOrError"]["status"]
        if status == "SUCCESS":
            return
        assert status not in ("FAILURE", "CANCELING", "CANCELED"), f"run {run_id}: {status}"
        time.sleep(1)
    raise AssertionError(f"run {run_id} did not succeed in time (status {status})")


def _ticks_after_last_request(port: int, sensor: str, timeout: float = 60) -> list[Any]:
    """The sensor's ticks, newest first, once a tick after its last run request is done."""
    query = (
        "query($s: SensorSelector!) { sensorOrError(sensorSelector: $s) { ... on Sensor {"
        " sensorState { ticks(limit: 20) { status timestamp runIds } } } } }"
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = graphql(port, query, {"s": {**REPOSITORY, "sensorName": sensor}})
        ticks = sorted(
            state["sensorOrError"]["sensorState"]["ticks"], key=lambda tick: -tick["timestamp"]
        )
        requests = [index for index, tick in enumerate(ticks) if tick["runIds"]]
        if requests and requests[0] > 0 and ticks[0]["status"] != "STARTED":
            assert {tick["status"] for tick in ticks[: requests[0]]} == {"SKIPPED"}, ticks
            return ticks
        time.sleep(2)
    raise AssertionError(f"{sensor} had no tick after its last run request in time")


def _materializations(port: int, asset: str) -> list[dict[str, Any]]:
    """The asset's materializations, newest first: their metadata values and runId."""
    query = (
        "query($key: AssetKeyInput!) { assetOrError(assetKey: $key) { ... on Asset {"
        f" assetMaterializations(limit: 10) {{ runId {METADATA_ENTRIES} }} }} }} }}"
    )
    asset_or_error = graphql(port, query, {"key": {"path": [asset]}})["assetOrError"]
    return [
        {**_metadata_values(event["metadataEntries"]), "runId": event["runId"]}
        for event in asset_or_error.get("assetMaterializations", [])
    ]


def _wait_for_materialization(port: int, asset: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        materializations = _materializations(port, asset)
        if materializations:
            return materializations[0]
        time.sleep(2)
    runs = graphql(
        port,
        "{ runsOrError { ... on Runs { results { jobName status tags { key value } } } } }",
    )
    raise AssertionError(f"{asset} was not materialized in time; runs: {runs}")


def _metadata_values(entries: list[dict[str, Any]]) -> dict[str, Any]:
    values = {}
    for entry in entries:
        if "jsonString" in entry:
            values[entry["label"]] = json.loads(entry["jsonString"])
        else:
            values[entry["label"]] = entry.get("intValue", entry.get("text"))
    return values


def _stop_group(dev: subprocess.Popen[bytes]) -> None:
    """Ctrl-C for dagster dev, then make sure no process of its group is left."""
    os.killpg(dev.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        dev.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(dev.pid, signal.SIGKILL)
    dev.wait()


def _wait_for_repository(port: int) -> dict[str, Any]:
    query = (
        "{ repositoriesOrError { ... on RepositoryConnection { nodes { name jobs { name }"
        " sensors { name sensorState { status } } assetNodes { assetKey { path } } } } } }"
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            nodes = graphql(port, query)["repositoriesOrError"]["nodes"]
            if nodes:
                return dict(nodes[0])
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError("dagster dev did not serve the example in time")


def _wait_for_recovery_observation(port: int) -> dict[str, Any]:
    query = (
        '{ assetOrError(assetKey: {path: ["leasequeue", "documents"]}) { ... on Asset {'
        " assetObservations(limit: 20) { metadataEntries { label"
        " ... on IntMetadataEntry { intValue } ... on TextMetadataEntry { text } } } } } }"
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for observation in graphql(port, query)["assetOrError"]["assetObservations"]:
            values = _metadata_values(observation["metadataEntries"])
            if values.get("event") == "lease_recovered":
                return values
        time.sleep(2)
    raise AssertionError("the sweeper sensor recorded no recovery observation in time")
