"""dagster-leasequeue: a durable, fenced, leased task queue in PostgreSQL, for Dagster.

The core queue (:class:`LeaseQueue`) needs only psycopg. The Dagster layer
(:class:`LeaseQueueResource`, :func:`build_sweeper_sensor`, :func:`queue_asset_specs`) is
imported on first use, so a plain worker process never pays for importing Dagster.
"""

import importlib
from typing import TYPE_CHECKING, Any

from dagster_leasequeue.attempts import Attempt as Attempt
from dagster_leasequeue.errors import (
    ConfigurationError as ConfigurationError,
    DatabaseUnavailable as DatabaseUnavailable,
    LeaseLost as LeaseLost,
    LeaseQueueError as LeaseQueueError,
    PayloadError as PayloadError,
    SchemaNotInstalled as SchemaNotInstalled,
    TaskNotFound as TaskNotFound,
    TransactionAbandoned as TransactionAbandoned,
)
from dagster_leasequeue.lease import Lease as Lease
from dagster_leasequeue.models import (
    AttemptRecord as AttemptRecord,
    QueueStats as QueueStats,
    RecoveredTask as RecoveredTask,
    RecoveryEvent as RecoveryEvent,
    TaskInfo as TaskInfo,
)
from dagster_leasequeue.queue import LeaseQueue as LeaseQueue
from dagster_leasequeue.settings import LeaseQueueSettings as LeaseQueueSettings
from dagster_leasequeue.version import __version__ as __version__

if TYPE_CHECKING:
    from dagster_leasequeue.checks import build_queue_asset_checks as build_queue_asset_checks
    from dagster_leasequeue.launcher import (
        build_worker_launcher_sensor as build_worker_launcher_sensor,
    )
    from dagster_leasequeue.resource import LeaseQueueResource as LeaseQueueResource
    from dagster_leasequeue.sensors import (
        build_sweeper_sensor as build_sweeper_sensor,
        queue_asset_key as queue_asset_key,
        queue_asset_specs as queue_asset_specs,
    )

# The Dagster layer, imported on first use: a worker that only needs the queue skips Dagster.
_DAGSTER_EXPORTS = {
    "LeaseQueueResource": "dagster_leasequeue.resource",
    "build_queue_asset_checks": "dagster_leasequeue.checks",
    "build_worker_launcher_sensor": "dagster_leasequeue.launcher",
    "build_sweeper_sensor": "dagster_leasequeue.sensors",
    "queue_asset_key": "dagster_leasequeue.sensors",
    "queue_asset_specs": "dagster_leasequeue.sensors",
}


def __getattr__(name: str) -> Any:
    module = _DAGSTER_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dagster_leasequeue' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "Attempt",
    "AttemptRecord",
    "ConfigurationError",
    "DatabaseUnavailable",
    "Lease",
    "LeaseLost",
    "LeaseQueue",
    "LeaseQueueError",
    "LeaseQueueResource",
    "LeaseQueueSettings",
    "PayloadError",
    "QueueStats",
    "RecoveredTask",
    "RecoveryEvent",
    "SchemaNotInstalled",
    "TaskInfo",
    "TaskNotFound",
    "TransactionAbandoned",
    "__version__",
    "build_queue_asset_checks",
    "build_sweeper_sensor",
    "build_worker_launcher_sensor",
    "queue_asset_key",
    "queue_asset_specs",
]
