"""dagster-leasequeue: a durable, fenced, leased task queue in PostgreSQL, for Dagster.

The core queue (:class:`LeaseQueue`) needs only psycopg. The Dagster layer
(:class:`LeaseQueueResource`, :func:`build_sweeper_sensor`, :func:`queue_asset_specs`) is
imported on first use, so a plain worker process never pays for importing Dagster.
"""

from dagster_leasequeue.attempts import Attempt as Attempt
from dagster_leasequeue.errors import (
    ConfigurationError as ConfigurationError,
    DatabaseUnavailable as DatabaseUnavailable,
    LeaseLost as LeaseLost,
    LeaseQueueError as LeaseQueueError,
    PayloadError as PayloadError,
    SchemaNotInstalled as SchemaNotInstalled,
    TaskNotFound as TaskNotFound,
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
