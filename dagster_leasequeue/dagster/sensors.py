"""The sweeper sensor, which recovers expired leases on every tick and reports them to
Dagster, and the specs of the queue assets it reports on."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

import dagster as dg
from dagster._time import get_current_timestamp

from ..models import LIVE, QueueStats, RecoveryEvent
from ..validation import check_seconds
from .keys import (
    RECOVERED_THROUGH_EVENT_TAG,
    key_prefix,
    queue_asset_key,
    refuse_shared_keys,
)
from .resource import LeaseQueueResource

logger = logging.getLogger(__name__)


def queue_asset_specs(
    queues: Sequence[str],
    *,
    asset_key_prefix: str | Sequence[str] = ("leasequeue",),
    group_name: str = "leasequeue",
) -> list[dg.AssetSpec]:
    """Asset specs for queues, so they appear in the catalog with the sweeper's observations.

    Each queue's key is the one :func:`queue_asset_key` gives; a queue named twice is
    declared once. Raises ``ValueError`` naming both queues if two of them have one key.

    Example:
        .. code-block:: python

            defs = dg.Definitions(
                assets=queue_asset_specs(["documents"]),
                sensors=[build_sweeper_sensor()],
                resources={"leasequeue": LeaseQueueResource()},
            )
    """
    return [
        dg.AssetSpec(
            key=queue_asset_key(queue, asset_key_prefix),
            description=(
                f"The {queue!r} task queue. The sweeper sensor observes it: every task "
                "recovered from an expired lease, and its live task counts when they change."
            ),
            group_name=group_name,
            kinds={"postgres"},
            metadata={"queue": queue},
        )
        for queue in refuse_shared_keys(queues, asset_key_prefix)
    ]


def build_sweeper_sensor(
    *,
    name: str = "leasequeue_sweeper",
    resource_key: str = "leasequeue",
    minimum_interval_seconds: int = 30,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
    asset_key_prefix: str | Sequence[str] = ("leasequeue",),
    job: dg.JobDefinition | dg.UnresolvedAssetJobDefinition | None = None,
    events_per_tick: int = 1000,
    counts_every_seconds: float = 300,
) -> dg.SensorDefinition:
    """A sensor that sweeps expired leases and reports each recovery as an asset observation.

    Every tick recovers every expired lease, then reports every recovery event after its
    cursor (recoveries made by other sweepers included) as an ``AssetObservation`` on the
    queue's asset. It also reads each queue's live task counts (``enqueued``,
    ``processing``, ``dead``, ``due``, the oldest waiting task) through partial indexes, so
    that a tick costs the same however many finished tasks the table holds, and records
    them as a ``queue_counts`` observation when they differ from the counts last recorded
    for that queue, at most once every ``counts_every_seconds`` (default 300; 0 records
    every change) per queue: a change within that time is recorded by the first tick after
    it. The age of the oldest waiting task grows by itself and is not compared. The first
    tick records every queue with live tasks; a queue whose last live task finished is
    recorded once more, with zeros, by the same rule.

    The cursor holds the id of the last event reported and the counts last recorded for
    each queue, with when, so a tick whose result was thrown away (a preview, "Test
    sensor") loses nothing: the next real tick reports it. Time is the tick's
    (``dagster._time``). With ``job``, a run of it is requested when recovered tasks are
    waiting. Raises ``ConfigurationError`` (a ``ValueError``) if ``counts_every_seconds``
    is not a number of seconds, 0 or more.

    Example:
        .. code-block:: python

            defs = dg.Definitions(
                sensors=[build_sweeper_sensor(minimum_interval_seconds=15)],
                resources={"leasequeue": LeaseQueueResource()},
            )
    """
    prefix = key_prefix(asset_key_prefix)
    counts_every = check_seconds("counts_every_seconds", counts_every_seconds, allow_zero=True)

    @dg.sensor(
        name=name,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        required_resource_keys={resource_key},
        job=job,
        description=(
            "Recovers tasks whose lease expired (their worker died) and reports each "
            "recovery, and each queue's task counts when they change, as asset observations."
        ),
    )
    def _sweeper(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        resource: LeaseQueueResource = getattr(context.resources, resource_key)
        queue = resource.get_queue()
        now = get_current_timestamp()
        swept = queue.sweep()
        after, reported = _read_cursor(context.cursor)
        recorded = _read_recorded(context.cursor)
        events = queue.recovery_events(after, limit=events_per_tick)
        flows = queue.flows()
        live = {
            name: replace(stats, flow=flows.get(name))
            for name, stats in queue.stats_by_queue(finished=False).items()
        }
        # A queue whose last live task finished is reported once more, with zeros, so its
        # asset does not keep showing the old counts.
        emptied = {
            gone: QueueStats(gone, dict.fromkeys(LIVE, 0))
            for gone in (reported | recorded.keys()) - live.keys()
            if gone not in recorded or any(recorded[gone][1].values())
        }
        per_queue = dict(sorted((live | emptied).items()))
        observations = [_recovery_observation(event, prefix) for event in events]
        for queue_name, stats in per_queue.items():
            counts = _counted(stats)
            last = recorded.get(queue_name)
            paused_changed = last is not None and counts.get("paused") != last[1].get("paused")
            if paused_changed or _to_record(counts, last, now, counts_every):
                observations.append(_counts_observation(stats, prefix))
                recorded[queue_name] = (now, counts)
        # Zeros recorded long enough ago are as good as nothing recorded: forget them.
        recorded = {
            queue_name: (at, counts)
            for queue_name, (at, counts) in recorded.items()
            if queue_name in live or any(counts.values()) or now - at < counts_every
        }
        last_event = events[-1].id if events else after
        cursor = _write_cursor(last_event, live.keys(), recorded)
        summary = _summary(len(swept), events, per_queue)
        context.log.info(summary)
        shared = _shared_keys({event.queue for event in events} | per_queue.keys(), prefix)
        if shared:
            context.log.warning(shared)

        requeued_waiting = any(event.action == "requeued" for event in events) and any(
            stats.counts["enqueued"] for stats in per_queue.values()
        )
        if job is not None and requeued_waiting:
            run_request = dg.RunRequest(
                run_key=f"{name}-recovered-{last_event}",
                tags={RECOVERED_THROUGH_EVENT_TAG: str(last_event)},
            )
            return dg.SensorResult(
                run_requests=[run_request], asset_events=observations, cursor=cursor
            )
        return dg.SensorResult(skip_reason=summary, asset_events=observations, cursor=cursor)

    return _sweeper


def _shared_keys(queues: set[str], prefix: Sequence[str]) -> str | None:
    """A warning naming the queues whose observations share an asset key, if any do.

    Only a queue named after another's replaced key (``a_b_34fafddd`` beside ``a-b``) can.
    """
    by_key: dict[dg.AssetKey, list[str]] = {}
    for queue in sorted(queues):
        by_key.setdefault(queue_asset_key(queue, prefix), []).append(queue)
    clashes = [
        f"{', '.join(map(repr, names))} on {key.to_user_string()!r}"
        for key, names in by_key.items()
        if len(names) > 1
    ]
    if not clashes:
        return None
    return (
        "queues report their observations on one asset key, so they mix: "
        + "; ".join(clashes)
        + "; rename one of them"
    )


def _counted(stats: QueueStats) -> dict[str, int]:
    """The counts compared with those last recorded: the live statuses and ``due``, and
    whether the queue is paused (when it is)."""
    counted = {status: stats.counts.get(status, 0) for status in LIVE} | {"due": stats.due}
    return counted | ({"paused": 1} if stats.paused else {})


def _to_record(
    counts: dict[str, int], last: tuple[float, dict[str, int]] | None, now: float, every: float
) -> bool:
    """Whether a queue's counts are recorded: they differ from the last recorded (or none
    were), and that record is ``every`` seconds old (or from the future: the clock was set
    back, and waiting for it could take long)."""
    if last is None:
        return True
    at, recorded = last
    return counts != recorded and not 0 <= now - at < every


def _write_cursor(
    event: int, live: Iterable[str], recorded: Mapping[str, tuple[float, dict[str, int]]]
) -> str:
    return json.dumps(
        {
            "event": event,
            "queues": sorted(live),
            "counts": {
                name: {"at": at, **counts} for name, (at, counts) in sorted(recorded.items())
            },
        }
    )


def _read_cursor(cursor: str | None) -> tuple[int, set[str]]:
    """The last event id reported, and the queues that had live tasks at that tick.

    The cursor is ``{"event": id, "queues": [...], "counts": {...}}`` (see
    :func:`_read_recorded` for ``counts``); an older cursor lacks ``counts``, and an older
    one still is a bare event id.
    """
    if not cursor:
        return 0, set()
    try:
        state = json.loads(cursor)
    except ValueError:
        state = None
    if type(state) is int:
        return state, set()
    if isinstance(state, dict):
        event, queues = state.get("event"), state.get("queues")
        if (
            type(event) is int
            and isinstance(queues, list)
            and all(isinstance(name, str) for name in queues)
        ):
            return event, set(queues)
    # Reporting again beats skipping: an unreadable cursor starts from the beginning.
    logger.warning("sweeper sensor cursor %r is not readable; starting over", cursor)
    return 0, set()


def _read_recorded(cursor: str | None) -> dict[str, tuple[float, dict[str, int]]]:
    """The counts last recorded per queue, each with when (a Unix timestamp).

    They are the cursor's ``counts``: ``{queue: {"at": timestamp, "enqueued": n,
    "processing": n, "dead": n, "due": n}}``, with ``"paused": 1`` for a paused queue (see
    :func:`_counted`). A cursor without them (of an earlier version) or with unreadable
    ones has nothing recorded, so the next tick records every queue.
    """
    if not cursor:
        return {}
    try:
        state = json.loads(cursor)
    except ValueError:
        return {}  # _read_cursor warns
    if not isinstance(state, dict) or "counts" not in state:
        return {}
    entries = state["counts"]
    counted = {*LIVE, "due"}
    if isinstance(entries, dict) and all(
        isinstance(entry, dict)
        and entry.keys() - {"paused"} == {"at", *counted}
        and type(entry["at"]) in (int, float)
        and math.isfinite(entry["at"])
        and all(type(value) is int for key, value in entry.items() if key != "at")
        for entry in entries.values()
    ):
        return {
            name: (float(entry["at"]), {key: value for key, value in entry.items() if key != "at"})
            for name, entry in entries.items()
        }
    logger.warning("sweeper sensor cursor %r has unreadable counts; recording them again", cursor)
    return {}


def _recovery_observation(event: RecoveryEvent, prefix: Sequence[str]) -> dg.AssetObservation:
    return dg.AssetObservation(
        asset_key=queue_asset_key(event.queue, prefix),
        description=(
            f"task {event.task_id} {event.action} after its lease expired "
            f"({event.seconds_overdue:.1f} s overdue, held by {event.worker_id})"
        ),
        metadata={
            "event": "lease_recovered",
            "event_id": event.id,
            "task_id": event.task_id,
            "attempt": event.attempt,
            "worker_id": event.worker_id or "",
            "lease_expires_at": dg.MetadataValue.timestamp(event.lease_expires_at),
            "recovered_at": dg.MetadataValue.timestamp(event.recovered_at),
            "seconds_overdue": round(event.seconds_overdue, 3),
            "action": event.action,
        },
    )


def _counts_observation(stats: QueueStats, prefix: Sequence[str]) -> dg.AssetObservation:
    metadata: dict[str, dg.RawMetadataValue] = {"event": "queue_counts"}
    metadata.update(stats.counts)
    metadata["due"] = stats.due
    metadata["oldest_enqueued_seconds"] = (
        round(stats.oldest_enqueued_seconds, 3) if stats.oldest_enqueued_seconds else 0.0
    )
    flow = stats.flow
    if flow is not None:  # the controls in force, where the queue has any
        metadata["paused"] = flow.paused
        if flow.max_running is not None:
            metadata["max_running_per_key"] = flow.max_running
        if flow.per_second is not None:
            metadata["per_second"] = flow.per_second
            metadata["burst"] = flow.burst
        if flow.keys:
            metadata["key_limits"] = dg.MetadataValue.json(
                {
                    key.key: {
                        "running": key.running,
                        "max_running": key.max_running,
                        "per_second": key.per_second,
                    }
                    for key in flow.keys[:50]
                }
            )
    return dg.AssetObservation(
        asset_key=queue_asset_key(stats.queue or "", prefix), metadata=metadata
    )


def _summary(swept: int, events: list[RecoveryEvent], per_queue: dict[str, QueueStats]) -> str:
    dead = sum(event.action == "dead" for event in events)
    depth = ", ".join(
        f"{name}: {stats.counts['enqueued']} waiting, {stats.counts['processing']} processing, "
        f"{stats.counts['dead']} dead"
        for name, stats in per_queue.items()
    )
    return (
        f"swept {swept} expired lease(s); reported {len(events)} recovery event(s)"
        f" ({len(events) - dead} requeued, {dead} dead); queues: {depth or 'none'}"
    )
