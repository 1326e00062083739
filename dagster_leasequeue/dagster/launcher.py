"""The worker launcher sensor: starts worker runs while tasks wait, up to a concurrency limit."""

from __future__ import annotations

import logging
import math

import dagster as dg

from .keys import LAUNCH_TAG, LAUNCHER_TAG, QUEUE_TAG
from .resource import LeaseQueueResource

logger = logging.getLogger(__name__)

# A run in one of these statuses holds (or will hold) a slot: it may claim tasks.
IN_PROGRESS_STATUSES = (
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
)


def build_worker_launcher_sensor(
    job: dg.JobDefinition | dg.UnresolvedAssetJobDefinition,
    *,
    name: str = "leasequeue_worker_launcher",
    resource_key: str = "leasequeue",
    queue: str | None = None,
    max_concurrent_runs: int = 2,
    minimum_interval_seconds: int = 30,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
    tasks_per_run: int = 100,
) -> dg.SensorDefinition:
    """A sensor that launches runs of a worker job while tasks wait, never too many at once.

    Every tick reads the queue's counts and the number of runs of ``job`` this sensor
    launched that are still in progress (queued, not started, starting, started or
    canceling), then requests ``min(max_concurrent_runs - in_progress,
    ceil(waiting / tasks_per_run))`` runs. Otherwise it skips and says why: no task is
    waiting, or the limit is reached. The runs it launches are tagged
    ``leasequeue/launcher=<name>`` and ``leasequeue/queue=<queue>``; only runs with that
    launcher tag count against ``max_concurrent_runs``. The cursor counts the runs requested
    so far, which makes every run key unique.

    ``job`` should claim tasks until the queue is empty (as ``process_documents`` in the
    example does), so one run serves many tasks and the runs stop by themselves.

    Args:
        job: The worker job to launch.
        name: The sensor's name, also the value of its launcher tag.
        resource_key: The key of the :class:`LeaseQueueResource` in the Definitions.
        queue: The queue to watch (default: the resource's ``queue``).
        max_concurrent_runs: The most runs of this sensor in progress at once.
        minimum_interval_seconds: The least time between two ticks.
        default_status: Whether the sensor runs when first loaded (default: stopped).
        tasks_per_run: How many waiting tasks call for one more run.

    Example:
        .. code-block:: python

            import dagster as dg
            from dagster_leasequeue import LeaseQueueResource, build_worker_launcher_sensor

            @dg.job
            def process_documents() -> None:
                process_documents_op()  # claims until the queue is empty

            defs = dg.Definitions(
                jobs=[process_documents],
                sensors=[
                    build_worker_launcher_sensor(
                        process_documents, max_concurrent_runs=4, tasks_per_run=50
                    )
                ],
                resources={"leasequeue": LeaseQueueResource(queue="documents")},
            )
    """
    if max_concurrent_runs < 1:
        raise dg.DagsterInvalidDefinitionError("max_concurrent_runs must be 1 or more")
    if tasks_per_run < 1:
        raise dg.DagsterInvalidDefinitionError("tasks_per_run must be 1 or more")
    job_name = job.name

    @dg.sensor(
        name=name,
        job=job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        required_resource_keys={resource_key},
        description=(
            f"Launches runs of {job_name!r} while tasks wait in the queue, at most "
            f"{max_concurrent_runs} in progress at once, one per {tasks_per_run} waiting tasks."
        ),
    )
    def _launcher(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        resource: LeaseQueueResource = getattr(context.resources, resource_key)
        queue_name = queue or resource.queue
        stats = resource.get_queue().stats(queue_name, finished=False)
        # Tasks delayed into the future are enqueued but not due: no run would find them.
        waiting = stats.due
        delayed = stats.counts["enqueued"] - waiting
        in_progress = context.instance.get_runs_count(
            dg.RunsFilter(
                job_name=job_name,
                statuses=list(IN_PROGRESS_STATUSES),
                tags={LAUNCHER_TAG: name},
            )
        )
        launched = _cursor_position(context, name, job_name)
        free = max(0, max_concurrent_runs - in_progress)
        wanted = math.ceil(waiting / tasks_per_run)
        count = min(free, wanted)
        where = (
            f"queue {queue_name!r}: {waiting} task(s) waiting"
            + (f" ({delayed} more delayed)" if delayed else "")
            + f", {stats.counts['processing']} processing; "
            f"{in_progress} of {max_concurrent_runs} run(s) of {job_name!r} in progress"
        )
        if count == 0:
            reason = "no waiting tasks" if wanted == 0 else "concurrency limit reached"
            return dg.SensorResult(skip_reason=f"{reason}: {where}", cursor=str(launched))
        run_requests = [
            dg.RunRequest(
                run_key=f"{name}-{number}",
                tags={LAUNCHER_TAG: name, QUEUE_TAG: queue_name, LAUNCH_TAG: str(number)},
            )
            for number in range(launched + 1, launched + count + 1)
        ]
        context.log.info(f"requesting {count} run(s): {where}")
        return dg.SensorResult(run_requests=run_requests, cursor=str(launched + count))

    return _launcher


def _cursor_position(context: dg.SensorEvaluationContext, name: str, job_name: str) -> int:
    """Runs requested so far. Without a readable cursor (reset in the UI), count this
    sensor's runs instead, so fresh run keys do not collide with those already used."""
    if context.cursor:
        try:
            return int(context.cursor)
        except ValueError:
            logger.warning("launcher sensor cursor %r is not a count; recounting", context.cursor)
    return context.instance.get_runs_count(
        dg.RunsFilter(job_name=job_name, tags={LAUNCHER_TAG: name})
    )
