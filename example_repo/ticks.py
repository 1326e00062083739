"""Run a sensor tick exactly as the Dagster daemon does, so its asset events are stored.

``dagster dev`` runs the daemon for you; this is for the demo and the tests, which need a
real tick without a long-running daemon.
"""

import logging
from pathlib import Path

import dagster as dg
from dagster._core.scheduler.instigation import TickStatus
from dagster._core.test_utils import create_test_daemon_workspace_context
from dagster._core.workspace.load_target import WorkspaceFileTarget
from dagster._daemon.sensor import execute_sensor_iteration

WORKSPACE = Path(__file__).resolve().parent.parent / "workspace.yaml"


def run_sensor_tick(instance: dg.DagsterInstance, sensor_name: str) -> list[TickStatus]:
    """Start the sensor if needed, run one daemon tick for it, return the statuses of its ticks."""
    target = WorkspaceFileTarget(paths=[str(WORKSPACE)])
    with create_test_daemon_workspace_context(target, instance) as workspace:
        request = workspace.create_request_context()
        sensor = next(
            repository.get_sensor(sensor_name)
            for entry in request.get_code_location_entries().values()
            if entry.code_location is not None
            for repository in entry.code_location.get_repositories().values()
            if repository.has_sensor(sensor_name)
        )
        state = instance.get_instigator_state(sensor.get_remote_origin_id(), sensor.selector_id)
        if state is None or not state.is_running:
            instance.start_sensor(sensor)
        list(execute_sensor_iteration(workspace, logging.getLogger("leasequeue.tick"), None, None))
        ticks = instance.get_ticks(sensor.get_remote_origin_id(), sensor.selector_id)
    return [tick.status for tick in ticks]
