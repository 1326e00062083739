"""Fan out from an asset, fan in to an asset: batches in Dagster.

An asset enqueues a batch and records it in its materialization's metadata
(:func:`batch_metadata`); workers drain it; :func:`build_batch_sensor` requests one run of
the downstream target once the batch has finished, tagged with the batch's id, which
:func:`batch_id_from_run` reads back inside that run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import dagster as dg

from ..errors import BatchNotFound, ConfigurationError
from ..models import Batch, BatchInfo
from ..queue import LeaseQueue
from .keys import BATCH_TAG, key_prefix, queue_asset_key
from .resource import LeaseQueueResource

# The materialization metadata that names a batch; the sensor finds batches by it.
BATCH_ID_KEY = "leasequeue/batch_id"

# Materializations of the upstream asset read per tick; the rest wait for the next tick.
MATERIALIZATIONS_PER_TICK = 500


def batch_metadata(batch: Batch) -> dict[str, Any]:
    """Materialization metadata recording which batch an asset made.

    Return it from the fan-out asset (``dg.MaterializeResult(metadata=...)``) so that
    :func:`build_batch_sensor` finds the batch.
    """
    return {
        BATCH_ID_KEY: dg.MetadataValue.int(batch.id),
        "leasequeue/batch_name": dg.MetadataValue.text(batch.name or ""),
        "leasequeue/queue": dg.MetadataValue.text(batch.queue),
        "leasequeue/batch_total": dg.MetadataValue.int(batch.total),
    }


def batch_id_from_run(context: dg.OpExecutionContext | dg.AssetExecutionContext) -> int:
    """The id of the batch whose finish requested this run (see :func:`build_batch_sensor`)."""
    value = context.run.tags.get(BATCH_TAG)
    if value is None:
        raise ConfigurationError(
            f"run {context.run.run_id} has no {BATCH_TAG!r} tag: it was not requested by a "
            "batch sensor (launch it with that tag to name the batch)"
        )
    if not (value.isascii() and value.isdigit() and int(value) > 0):
        raise ConfigurationError(
            f"run {context.run.run_id} has {BATCH_TAG!r} tag {value!r}, which is not a "
            "batch id (a positive integer)"
        )
    return int(value)


def build_batch_sensor(
    *,
    name: str,
    upstream: dg.AssetKey | str | Sequence[str] | dg.AssetsDefinition | dg.AssetSpec,
    asset_selection: dg.AssetSelection
    | Sequence[dg.AssetKey]
    | Sequence[dg.AssetsDefinition]
    | Sequence[str]
    | None = None,
    job: dg.JobDefinition | dg.UnresolvedAssetJobDefinition | None = None,
    resource_key: str = "leasequeue",
    minimum_interval_seconds: int = 30,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
    asset_key_prefix: str | Sequence[str] = ("leasequeue",),
) -> dg.SensorDefinition:
    """A sensor that requests one run of a downstream target per finished batch.

    It finds the batches made by ``upstream``'s materializations (their metadata, from
    :func:`batch_metadata`; ``upstream`` is an asset key, or the asset or spec itself), and
    when one has finished (no task enqueued or processing; dead tasks included: the
    downstream asset decides what they mean) requests one run of ``asset_selection`` or
    ``job`` (exactly one of them). The run key names the batch (``leasequeue-batch-<id>``),
    so a tick whose result was thrown away, or a second tick, never requests it twice; the
    run's ``leasequeue/batch`` tag holds the id (:func:`batch_id_from_run`). It also
    records an observation on the queue's asset with the batch's counts, duration and
    throughput.

    Example:
        .. code-block:: python

            report_sensor = build_batch_sensor(
                name="report_when_batch_done",
                upstream=dg.AssetKey("document_batch"),
                asset_selection=[document_report],
            )
    """
    if (asset_selection is None) == (job is None):
        raise ConfigurationError("build_batch_sensor needs exactly one of asset_selection and job")
    if isinstance(asset_selection, Sequence) and not asset_selection:
        raise ConfigurationError("build_batch_sensor's asset_selection names no asset")
    upstream = _asset_key(upstream)
    prefix = key_prefix(asset_key_prefix)

    @dg.sensor(
        name=name,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        required_resource_keys={resource_key},
        asset_selection=asset_selection,
        job=job,
        description=(
            f"Requests a run once each batch made by {upstream.to_user_string()} has finished."
        ),
    )
    def _batch_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        resource: LeaseQueueResource = getattr(context.resources, resource_key)
        queue = resource.get_queue()
        after, pending = _read_cursor(context.cursor)
        records = context.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=upstream, after_storage_id=after or None),
            limit=MATERIALIZATIONS_PER_TICK,
            ascending=True,
        ).records
        read: dict[int, BatchInfo] = {}
        for record in records:
            after = max(after, record.storage_id)
            recorded = _recorded_batch(record, upstream, context.log)
            if recorded is None or recorded.id in pending:
                continue
            info = _find_batch(queue, recorded.id, context.log)
            if info is not None and recorded.names(info, queue.schema, context.log):
                read[recorded.id] = info
                pending.append(recorded.id)
        requests: list[dg.RunRequest] = []
        observations: list[dg.AssetObservation] = []
        waiting: list[int] = []
        for batch_id in pending:
            info = read.get(batch_id) or _find_batch(queue, batch_id, context.log)
            if info is None:
                continue
            if not info.finished:
                waiting.append(batch_id)
                continue
            requests.append(
                dg.RunRequest(
                    run_key=f"leasequeue-batch-{batch_id}", tags={BATCH_TAG: str(batch_id)}
                )
            )
            observations.append(_finished_observation(info, prefix))
        summary = f"{len(requests)} batch(es) finished, {len(waiting)} still running" + (
            f": {waiting[:10]}" if waiting else ""
        )
        context.log.info(summary)
        return dg.SensorResult(
            skip_reason=None if requests else summary,
            run_requests=requests,
            asset_events=observations,
            cursor=json.dumps({"after": after, "pending": waiting}),
        )

    return _batch_sensor


def _read_cursor(cursor: str | None) -> tuple[int, list[int]]:
    if not cursor:
        return 0, []
    state = json.loads(cursor)
    return int(state["after"]), [int(batch_id) for batch_id in state["pending"]]


def _asset_key(upstream: object) -> dg.AssetKey:
    if isinstance(upstream, dg.AssetKey):
        return upstream
    if isinstance(upstream, (dg.AssetsDefinition, dg.AssetSpec)):
        return upstream.key
    if isinstance(upstream, str) or (
        isinstance(upstream, Sequence) and upstream and all(isinstance(p, str) for p in upstream)
    ):
        return dg.AssetKey.from_coercible(upstream)
    raise ConfigurationError(
        "build_batch_sensor's upstream must be the fan-out asset's key (an AssetKey, a name "
        f"or a list of names), or the asset itself; got {upstream!r}"
    )


class _RecordedBatch(NamedTuple):
    """The batch a materialization recorded (see :func:`batch_metadata`)."""

    storage_id: int
    id: int
    queue: str | None
    name: str | None

    def names(self, info: BatchInfo, schema: str, log: Any) -> bool:
        """Whether ``info`` is the batch recorded: the same queue and name, where the
        metadata has them. Another schema's or database's batch may have the same id."""
        if self.queue in (None, info.queue) and self.name in (None, info.name or ""):
            return True
        log.warning(
            f"materialization {self.storage_id} recorded batch {self.id} of queue "
            f"{self.queue!r} named {self.name!r}, but batch {self.id} of schema {schema!r} is "
            f"of queue {info.queue!r} named {info.name or ''!r}: skipped (is the resource on "
            "another schema or database than the asset that made the batch?)"
        )
        return False


def _recorded_batch(
    record: dg.EventLogRecord, upstream: dg.AssetKey, log: Any
) -> _RecordedBatch | None:
    materialization = record.asset_materialization
    if materialization is None or (value := materialization.metadata.get(BATCH_ID_KEY)) is None:
        return None
    batch_id = value.value
    if type(batch_id) is not int or batch_id < 1:
        log.warning(
            f"materialization {record.storage_id} of {upstream.to_user_string()} has "
            f"{BATCH_ID_KEY!r} {batch_id!r}, which is not a batch id (batch_metadata() "
            "writes it): skipped"
        )
        return None

    def text(key: str) -> str | None:
        entry = materialization.metadata.get(key)
        return entry.value if entry is not None and isinstance(entry.value, str) else None

    return _RecordedBatch(
        record.storage_id, batch_id, text("leasequeue/queue"), text("leasequeue/batch_name")
    )


def _find_batch(queue: LeaseQueue, batch_id: int, log: Any) -> BatchInfo | None:
    try:
        return queue.batch(batch_id)
    except BatchNotFound as exc:
        log.warning(f"{exc}: skipped")
        return None


def _finished_observation(info: BatchInfo, prefix: Sequence[str]) -> dg.AssetObservation:
    assert info.finished_at is not None
    seconds = max((info.finished_at - info.created_at).total_seconds(), 0.0)
    return dg.AssetObservation(
        asset_key=queue_asset_key(info.queue, prefix),
        description=(
            f"batch {info.id} finished: {info.done} done, {info.dead} dead, "
            f"{info.cancelled} cancelled in {seconds:.1f} s"
        ),
        metadata={
            "event": "batch_finished",
            "batch_id": info.id,
            "batch_name": info.name or "",
            "total": info.total,
            "done": info.done,
            "dead": info.dead,
            "cancelled": info.cancelled,
            "created_at": dg.MetadataValue.timestamp(info.created_at),
            "finished_at": dg.MetadataValue.timestamp(info.finished_at),
            "duration_seconds": round(seconds, 3),
            "tasks_per_second": round(info.total / seconds, 1) if seconds else 0.0,
        },
    )
