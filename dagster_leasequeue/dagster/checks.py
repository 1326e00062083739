"""Asset checks on the queue assets: stuck leases, dead tasks and how long tasks wait."""

# No ``from __future__ import annotations``: Dagster checks the type of ``context`` at runtime.

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import dagster as dg

from ..models import QueueStats, TaskInfo
from ..queue import LeaseQueue
from .keys import key_prefix, queue_asset_key, refuse_shared_keys
from .resource import LeaseQueueResource

NO_STUCK_LEASES = "no_stuck_leases"
DEAD_TASKS_WITHIN_LIMIT = "dead_tasks_within_limit"
OLDEST_WAITING_WITHIN_LIMIT = "oldest_waiting_within_limit"
NO_KEY_HELD_AT_LIMIT = "no_key_held_at_limit"

# How many offending task ids a check result names; the counts cover every task.
WORST_OFFENDERS = 10
# Page size when reading the processing tasks of a queue (workers x batch: few).
_PAGE = 500
# Waiting tasks sampled (lowest ids first) to name the longest waiting ones.
_WAITING_SAMPLE = 200

_OP_NAME_PART = re.compile(r"[^A-Za-z0-9_]")


def build_queue_asset_checks(
    queues: Sequence[str],
    *,
    resource_key: str = "leasequeue",
    asset_key_prefix: str | Sequence[str] = ("leasequeue",),
    stuck_after_seconds: float = 600,
    max_dead: int = 0,
    max_oldest_waiting_seconds: float = 3600,
    key_at_limit_after_seconds: float | None = None,
    severity: dg.AssetCheckSeverity = dg.AssetCheckSeverity.WARN,
) -> list[dg.AssetChecksDefinition]:
    """Asset checks on each queue asset, for operators: is the queue healthy?

    For every queue, three checks on its asset (the key :func:`queue_asset_key` gives, the
    one :func:`queue_asset_specs` declares):

    - ``no_stuck_leases``: no ``processing`` task whose lease expired more than
      ``stuck_after_seconds`` ago (by the database's clock). Such a task means no sweeper
      is running: enable the sweeper sensor.
    - ``dead_tasks_within_limit``: at most ``max_dead`` tasks are ``dead`` (their attempts
      used up). Retry them with ``retry_dead`` once the cause is fixed.
    - ``oldest_waiting_within_limit``: no due task has waited longer than
      ``max_oldest_waiting_seconds``. A long wait means too few workers.
    - ``no_key_held_at_limit``, with ``key_at_limit_after_seconds``: no concurrency key is
      at its limit while its oldest due task has waited longer than that. Such a key's
      tasks run slower than they come in: raise its limit, or find what holds its tasks.

    Each queue's checks are one op, named after its asset key (``leasequeue_documents_checks``);
    queues whose names differ only in characters an asset key replaces (``a-b``, ``a_b``)
    have distinct keys, so distinct ops. A queue named twice is checked once; two queues
    with one asset key raise ``ValueError`` naming both.

    A failed check has the given ``severity``. Each result's metadata holds the counts, the
    thresholds and the ids of the worst offending tasks. The checks of one queue share one
    definition (one op, ``can_subset``), so any one of them can be run on its own. They use
    the :class:`LeaseQueueResource` under ``resource_key``.

    Args:
        queues: The names of the queues to check.
        resource_key: The key of the :class:`LeaseQueueResource` in the Definitions.
        asset_key_prefix: The prefix of the queue asset keys, as given to
            :func:`queue_asset_specs`.
        stuck_after_seconds: How long past its lease a processing task may stay unswept.
        max_dead: The most dead tasks a healthy queue may hold.
        max_oldest_waiting_seconds: The longest a due task may wait to be claimed.
        key_at_limit_after_seconds: How long a key's due task may wait while the key is at
            its concurrency limit; None (the default) leaves that check out.
        severity: The severity of a failed check.

    Example:
        .. code-block:: python

            import dagster as dg
            from dagster_leasequeue import (
                LeaseQueueResource,
                build_queue_asset_checks,
                build_sweeper_sensor,
                queue_asset_specs,
            )

            defs = dg.Definitions(
                assets=queue_asset_specs(["documents"]),
                asset_checks=build_queue_asset_checks(
                    ["documents"], max_dead=5, max_oldest_waiting_seconds=900
                ),
                sensors=[build_sweeper_sensor()],
                resources={"leasequeue": LeaseQueueResource(dsn=dg.EnvVar("LEASEQUEUE_DSN"))},
            )
    """
    if stuck_after_seconds < 0:
        raise dg.DagsterInvalidDefinitionError("stuck_after_seconds must be 0 or more")
    if max_dead < 0:
        raise dg.DagsterInvalidDefinitionError("max_dead must be 0 or more")
    if max_oldest_waiting_seconds < 0:
        raise dg.DagsterInvalidDefinitionError("max_oldest_waiting_seconds must be 0 or more")
    if key_at_limit_after_seconds is not None and key_at_limit_after_seconds < 0:
        raise dg.DagsterInvalidDefinitionError(
            "key_at_limit_after_seconds must be 0 or more, or None"
        )
    thresholds = _Thresholds(
        float(stuck_after_seconds),
        int(max_dead),
        float(max_oldest_waiting_seconds),
        severity,
        None if key_at_limit_after_seconds is None else float(key_at_limit_after_seconds),
    )
    prefix = key_prefix(asset_key_prefix)
    return [
        _queue_checks(queue, resource_key, prefix, thresholds)
        for queue in refuse_shared_keys(queues, prefix)
    ]


@dataclass(frozen=True)
class _Thresholds:
    stuck_after_seconds: float
    max_dead: int
    max_oldest_waiting_seconds: float
    severity: dg.AssetCheckSeverity
    key_at_limit_after_seconds: float | None = None


def _queue_checks(
    queue: str, resource_key: str, prefix: tuple[str, ...], limits: _Thresholds
) -> dg.AssetChecksDefinition:
    asset_key = queue_asset_key(queue, prefix)
    specs = [
        dg.AssetCheckSpec(
            NO_STUCK_LEASES,
            asset=asset_key,
            description=(
                f"No processing task of queue {queue!r} whose lease expired more than "
                f"{limits.stuck_after_seconds:g} s ago; such a task means no sweeper is running."
            ),
            metadata={"stuck_after_seconds": limits.stuck_after_seconds},
        ),
        dg.AssetCheckSpec(
            DEAD_TASKS_WITHIN_LIMIT,
            asset=asset_key,
            description=f"At most {limits.max_dead} dead task(s) in queue {queue!r}.",
            metadata={"max_dead": limits.max_dead},
        ),
        dg.AssetCheckSpec(
            OLDEST_WAITING_WITHIN_LIMIT,
            asset=asset_key,
            description=(
                f"No due task of queue {queue!r} has waited longer than "
                f"{limits.max_oldest_waiting_seconds:g} s to be claimed."
            ),
            metadata={"max_oldest_waiting_seconds": limits.max_oldest_waiting_seconds},
        ),
    ]
    if limits.key_at_limit_after_seconds is not None:
        specs.append(
            dg.AssetCheckSpec(
                NO_KEY_HELD_AT_LIMIT,
                asset=asset_key,
                description=(
                    f"No concurrency key of queue {queue!r} at its limit while its oldest "
                    f"due task has waited longer than {limits.key_at_limit_after_seconds:g} s."
                ),
                metadata={"key_at_limit_after_seconds": limits.key_at_limit_after_seconds},
            )
        )

    # The queue's key part has only letters, digits and underscores: distinct keys under one
    # prefix give distinct op names.
    @dg.multi_asset_check(
        name="_".join(_OP_NAME_PART.sub("_", part) for part in asset_key.path) + "_checks",
        specs=specs,
        can_subset=True,
        required_resource_keys={resource_key},
        description=f"Health checks of the {queue!r} task queue.",
    )
    def _checks(context: dg.AssetCheckExecutionContext) -> Iterator[dg.AssetCheckResult]:
        resource: LeaseQueueResource = getattr(context.resources, resource_key)
        lease_queue = resource.get_queue()
        selected = {key.name for key in context.selected_asset_check_keys}
        if NO_STUCK_LEASES in selected:
            yield _no_stuck_leases(lease_queue, queue, asset_key, limits)
        if NO_KEY_HELD_AT_LIMIT in selected:
            yield _keys_at_limit(lease_queue, queue, asset_key, limits)
        if selected & {DEAD_TASKS_WITHIN_LIMIT, OLDEST_WAITING_WITHIN_LIMIT}:
            stats = lease_queue.stats(queue, finished=False)
            if DEAD_TASKS_WITHIN_LIMIT in selected:
                yield _dead_tasks(lease_queue, queue, asset_key, stats, limits)
            if OLDEST_WAITING_WITHIN_LIMIT in selected:
                yield _oldest_waiting(lease_queue, queue, asset_key, stats, limits)

    return _checks


def _tasks(queue: LeaseQueue, name: str, status: str) -> Iterator[TaskInfo]:
    after_id = 0
    while True:
        page = queue.list_tasks(status=status, queue=name, after_id=after_id, limit=_PAGE)
        yield from page
        if len(page) < _PAGE:
            return
        after_id = page[-1].task_id


def _no_stuck_leases(
    queue: LeaseQueue, name: str, asset_key: dg.AssetKey, limits: _Thresholds
) -> dg.AssetCheckResult:
    now = queue.database_now()
    processing = expired = 0
    stuck: list[tuple[float, TaskInfo]] = []
    for task in _tasks(queue, name, "processing"):
        processing += 1
        if task.lease_expires_at is None:
            continue
        overdue = (now - task.lease_expires_at).total_seconds()
        if overdue > 0:
            expired += 1
        if overdue > limits.stuck_after_seconds:
            stuck.append((overdue, task))
    stuck.sort(key=lambda item: (-item[0], item[1].task_id))
    worst = stuck[:WORST_OFFENDERS]
    metadata: dict[str, dg.RawMetadataValue] = {
        "processing": processing,
        "expired_leases": expired,
        "stuck": len(stuck),
        "stuck_after_seconds": limits.stuck_after_seconds,
        "stuck_task_ids": [task.task_id for _, task in worst],
        "most_overdue_seconds": round(worst[0][0], 3) if worst else 0.0,
    }
    if worst:
        metadata["stuck_tasks"] = dg.MetadataValue.md(
            _table(
                ["task", "attempt", "worker", "seconds overdue"],
                [
                    [str(t.task_id), str(t.attempts), t.worker_id or "", f"{overdue:.0f}"]
                    for overdue, t in worst
                ],
            )
        )
    passed = not stuck
    return dg.AssetCheckResult(
        asset_key=asset_key,
        check_name=NO_STUCK_LEASES,
        passed=passed,
        severity=limits.severity,
        description=(
            f"{processing} processing, {expired} with an expired lease, none stuck"
            if passed
            else f"{len(stuck)} processing task(s) more than {limits.stuck_after_seconds:g} s "
            "past their lease: is a sweeper running? (enable the sweeper sensor)"
        ),
        metadata=metadata,
    )


def _dead_tasks(
    queue: LeaseQueue,
    name: str,
    asset_key: dg.AssetKey,
    stats: QueueStats,
    limits: _Thresholds,
) -> dg.AssetCheckResult:
    dead = stats.counts["dead"]
    examples = queue.list_tasks(status="dead", queue=name, limit=WORST_OFFENDERS) if dead else []
    metadata: dict[str, dg.RawMetadataValue] = {
        "dead": dead,
        "max_dead": limits.max_dead,
        "dead_task_ids": [task.task_id for task in examples],
    }
    if examples:
        metadata["dead_tasks"] = dg.MetadataValue.md(
            _table(
                ["task", "attempts", "last error"],
                [[str(t.task_id), str(t.attempts), t.last_error or ""] for t in examples],
            )
        )
    passed = dead <= limits.max_dead
    return dg.AssetCheckResult(
        asset_key=asset_key,
        check_name=DEAD_TASKS_WITHIN_LIMIT,
        passed=passed,
        severity=limits.severity,
        description=(
            f"{dead} dead task(s), limit {limits.max_dead}"
            if passed
            else f"{dead} dead task(s), more than the limit of {limits.max_dead}; "
            "fix the cause, then retry them with retry_dead"
        ),
        metadata=metadata,
    )


def _oldest_waiting(
    queue: LeaseQueue,
    name: str,
    asset_key: dg.AssetKey,
    stats: QueueStats,
    limits: _Thresholds,
) -> dg.AssetCheckResult:
    oldest = stats.oldest_enqueued_seconds or 0.0
    passed = oldest <= limits.max_oldest_waiting_seconds
    metadata: dict[str, dg.RawMetadataValue] = {
        "enqueued": stats.counts["enqueued"],
        "processing": stats.counts["processing"],
        "oldest_waiting_seconds": round(oldest, 3),
        "max_oldest_waiting_seconds": limits.max_oldest_waiting_seconds,
        "longest_waiting_task_ids": [],
    }
    if not passed:
        # Named from a sample: the waiting tasks with the lowest ids, as a rule the oldest.
        now = queue.database_now()
        sample = queue.list_tasks(status="enqueued", queue=name, limit=_WAITING_SAMPLE)
        waits = [((now - task.run_at).total_seconds(), task.task_id) for task in sample]
        overdue = sorted(
            (item for item in waits if item[0] > limits.max_oldest_waiting_seconds),
            key=lambda item: (-item[0], item[1]),
        )
        metadata["longest_waiting_task_ids"] = [task_id for _, task_id in overdue[:WORST_OFFENDERS]]
    return dg.AssetCheckResult(
        asset_key=asset_key,
        check_name=OLDEST_WAITING_WITHIN_LIMIT,
        passed=passed,
        severity=limits.severity,
        description=(
            f"oldest due task has waited {oldest:.0f} s, limit "
            f"{limits.max_oldest_waiting_seconds:g} s"
            + ("" if passed else ": are enough workers running?")
        ),
        metadata=metadata,
    )


def _keys_at_limit(
    queue: LeaseQueue, name: str, asset_key: dg.AssetKey, limits: _Thresholds
) -> dg.AssetCheckResult:
    after = limits.key_at_limit_after_seconds or 0.0
    held = queue.keys_at_limit(name, waiting_longer_than=after, limit=WORST_OFFENDERS)
    return dg.AssetCheckResult(
        asset_key=asset_key,
        check_name=NO_KEY_HELD_AT_LIMIT,
        passed=not held,
        severity=limits.severity,
        description=(
            f"no key held at its limit longer than {after:g} s"
            if not held
            else f"{len(held)} key(s) at their limit with tasks waiting longer than {after:g} s"
        ),
        metadata={
            "key_at_limit_after_seconds": after,
            "keys_held": dg.MetadataValue.json(
                {
                    key.key: {
                        "running": key.running,
                        "max_running": key.max_running,
                        "waited_seconds": round(key.waited_seconds, 1),
                    }
                    for key in held
                }
            ),
        },
    )


def _short(text: str, limit: int = 120) -> str:
    line = " ".join(text.split()).replace("|", "\\|")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_short(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
