"""The Dagster layer: the resource, the sweeper, worker launcher and batch sensors, the checks.

Importing this package imports Dagster; :mod:`dagster_leasequeue` itself imports it only
when one of these names is first used. Every module here imports the Dagster library as
``import dagster as dg``: an absolute import, so it is the installed ``dagster``, never this
package.
"""

from dagster_leasequeue.dagster.batches import (
    batch_id_from_run as batch_id_from_run,
    batch_metadata as batch_metadata,
    build_batch_sensor as build_batch_sensor,
)
from dagster_leasequeue.dagster.checks import build_queue_asset_checks as build_queue_asset_checks
from dagster_leasequeue.dagster.keys import queue_asset_key as queue_asset_key
from dagster_leasequeue.dagster.launcher import (
    build_worker_launcher_sensor as build_worker_launcher_sensor,
)
from dagster_leasequeue.dagster.resource import LeaseQueueResource as LeaseQueueResource
from dagster_leasequeue.dagster.sensors import (
    build_sweeper_sensor as build_sweeper_sensor,
    queue_asset_specs as queue_asset_specs,
)

__all__ = [
    "LeaseQueueResource",
    "batch_id_from_run",
    "batch_metadata",
    "build_batch_sensor",
    "build_queue_asset_checks",
    "build_sweeper_sensor",
    "build_worker_launcher_sensor",
    "queue_asset_key",
    "queue_asset_specs",
]
