"""dagster-leasequeue: a durable, fenced, leased task queue in PostgreSQL, for Dagster.

The core queue (:class:`LeaseQueue`) needs only psycopg. The Dagster layer
(:mod:`dagster_leasequeue.dagster`: :class:`LeaseQueueResource`, :func:`build_sweeper_sensor`,
:func:`queue_asset_specs` and the rest) is imported on first use, so a plain worker process
never pays for importing Dagster.
"""

import importlib
from typing import TYPE_CHECKING, Any

from dagster_leasequeue.attempts import Attempt as Attempt
from dagster_leasequeue.errors import (
    BatchNotFound as BatchNotFound,
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
    Batch as Batch,
    BatchInfo as BatchInfo,
    KeyAtLimit as KeyAtLimit,
    KeyFlow as KeyFlow,
    QueueFlow as QueueFlow,
    QueueStats as QueueStats,
    RecoveredTask as RecoveredTask,
    RecoveryEvent as RecoveryEvent,
    TaskInfo as TaskInfo,
    TaskResult as TaskResult,
)
from dagster_leasequeue.queue import LeaseQueue as LeaseQueue
from dagster_leasequeue.settings import LeaseQueueSettings as LeaseQueueSettings
from dagster_leasequeue.version import __version__ as __version__
from dagster_leasequeue.worker import (
    WorkerSummary as WorkerSummary,
    run_worker as run_worker,
)

if TYPE_CHECKING:
    from dagster_leasequeue.dagster.batches import (
        batch_id_from_run as batch_id_from_run,
        batch_metadata as batch_metadata,
        build_batch_sensor as build_batch_sensor,
    )
    from dagster_leasequeue.dagster.checks import (
        build_queue_asset_checks as build_queue_asset_checks,
    )
    from dagster_leasequeue.dagster.keys import queue_asset_key as queue_asset_key
    from dagster_leasequeue.dagster.launcher import (
        build_worker_launcher_sensor as build_worker_launcher_sensor,
    )
    from dagster_leasequeue.dagster.resource import LeaseQueueResource as LeaseQueueResource
    from dagster_leasequeue.dagster.sensors import (
        build_sweeper_sensor as build_sweeper_sensor,
        queue_asset_specs as queue_asset_specs,
    )

# The Dagster layer (dagster_leasequeue.dagster), imported on first use: a worker that only
# needs the queue skips Dagster.
_DAGSTER_EXPORTS = {
    "LeaseQueueResource": "dagster_leasequeue.dagster.resource",
    "batch_id_from_run": "dagster_leasequeue.dagster.batches",
    "batch_metadata": "dagster_leasequeue.dagster.batches",
    "build_batch_sensor": "dagster_leasequeue.dagster.batches",
    "build_queue_asset_checks": "dagster_leasequeue.dagster.checks",
    "build_worker_launcher_sensor": "dagster_leasequeue.dagster.launcher",
    "build_sweeper_sensor": "dagster_leasequeue.dagster.sensors",
    "queue_asset_key": "dagster_leasequeue.dagster.keys",
    "queue_asset_specs": "dagster_leasequeue.dagster.sensors",
}


def __getattr__(name: str) -> Any:
    module = _DAGSTER_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dagster_leasequeue' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "Attempt",
    "AttemptRecord",
    "Batch",
    "BatchInfo",
    "BatchNotFound",
    "ConfigurationError",
    "DatabaseUnavailable",
    "KeyAtLimit",
    "KeyFlow",
    "Lease",
    "LeaseLost",
    "LeaseQueue",
    "LeaseQueueError",
    "LeaseQueueResource",
    "LeaseQueueSettings",
    "PayloadError",
    "QueueFlow",
    "QueueStats",
    "RecoveredTask",
    "RecoveryEvent",
    "SchemaNotInstalled",
    "TaskInfo",
    "TaskNotFound",
    "TaskResult",
    "TransactionAbandoned",
    "WorkerSummary",
    "__version__",
    "batch_id_from_run",
    "batch_metadata",
    "build_batch_sensor",
    "build_queue_asset_checks",
    "build_sweeper_sensor",
    "build_worker_launcher_sensor",
    "queue_asset_key",
    "queue_asset_specs",
    "run_worker",
]
