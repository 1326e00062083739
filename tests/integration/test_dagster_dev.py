"""`dagster dev -w workspace.yaml` shows the example, and the sensor, once enabled, observes."""

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
from pathlib import Path
from typing import Any

import pytest
from psycopg.conninfo import make_conninfo

from dagster_leasequeue import LeaseQueue

from ..helpers import expire

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = {"repositoryLocationName": "example_repo", "repositoryName": "__repository__"}
SENSOR = {**REPOSITORY, "sensorName": "leasequeue_sweeper"}
PASSWORD = "Dev-S3cret-Pw"


def graphql(port: int, query: str, variables: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": query, "variables": variables or {}}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)["data"]


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

    port = free_port()
    env = {
        **os.environ,
        "DAGSTER_HOME": str(tmp_path),
        # trust authentication ignores the password; the UI must never show it
        "LEASEQUEUE_DSN": make_conninfo(dsn, password=PASSWORD),
        "LEASEQUEUE_SCHEMA_NAME": schema_name,
    }
    log = (tmp_path / "dev.log").open("w")
    dev = subprocess.Popen(
        [sys.executable, "-m", "dagster", "dev", "-w", "workspace.yaml", "-p", str(port)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, stopped as a whole below
    )
    try:
        repository = _wait_for_repository(port)
        assert {"enqueue_documents", "process_documents"} <= {j["name"] for j in repository["jobs"]}
        sensors = {s["name"]: s["sensorState"]["status"] for s in repository["sensors"]}
        assert sensors == {
            "leasequeue_sweeper": "STOPPED",
            "leasequeue_worker_launcher": "STOPPED",
        }
        assert {"path": ["leasequeue", "documents"]} in [
            node["assetKey"] for node in repository["assetNodes"]
        ]
        started = graphql(
            port,
            "mutation($s: SensorSelector!) { startSensor(sensorSelector: $s) {"
            " ... on Sensor { sensorState { status } } } }",
            {"s": SENSOR},
        )
        assert started["startSensor"]["sensorState"]["status"] == "RUNNING"
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
    finally:
        _stop_group(dev)
        log.close()


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
            values = {
                entry["label"]: entry.get("intValue", entry.get("text"))
                for entry in observation["metadataEntries"]
            }
            if values.get("event") == "lease_recovered":
                return values
        time.sleep(2)
    raise AssertionError("the sweeper sensor recorded no recovery observation in time")
