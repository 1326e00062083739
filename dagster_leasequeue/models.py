"""The plain records the queue returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

Status = Literal["enqueued", "processing", "done", "dead", "cancelled"]
STATUSES: tuple[Status, ...] = ("enqueued", "processing", "done", "dead", "cancelled")
FINISHED: tuple[Status, ...] = ("done", "dead", "cancelled")
# What LeaseQueue.stats(finished=False) counts: the statuses a partial index covers.
LIVE: tuple[Status, ...] = ("enqueued", "processing", "dead")

RecoveryAction = Literal["requeued", "dead"]


@dataclass(frozen=True)
class TaskInfo:
    """A task as stored, returned by :meth:`LeaseQueue.get`."""

    task_id: int
    queue: str
    status: Status
    priority: int
    attempts: int
    max_attempts: int
    payload: dict[str, Any]
    result: dict[str, Any] | None
    last_error: str | None
    idempotency_key: str | None
    run_at: datetime
    lease_expires_at: datetime | None
    worker_id: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True)
class QueueStats:
    """Task counts per status (zeros included) and the age of the oldest waiting task.

    ``due`` counts the enqueued tasks that can be claimed now (the others are delayed or
    waiting for a retry). ``oldest_enqueued_seconds`` counts from when the oldest claimable
    task became due; it is None when no task is due.
    """

    queue: str | None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATUSES, 0))
    oldest_enqueued_seconds: float | None = None
    due: int = 0
    flow: QueueFlow | None = None
    """The controls in force on the queue (for the stats of one queue)."""

    @property
    def paused(self) -> bool:
        return self.flow is not None and self.flow.paused

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True)
class KeyFlow:
    """A concurrency key with limits of its own, and its tasks running now."""

    key: str
    running: int
    max_running: int | None = None
    per_second: float | None = None
    burst: float | None = None


@dataclass(frozen=True)
class QueueFlow:
    """The flow controls in force on a queue (see :meth:`LeaseQueue.flow`).

    ``max_running`` is the limit of every concurrency key without one of its own;
    ``per_second`` and ``burst`` the queue's token bucket; ``keys`` the keys with limits of
    their own. A task without a concurrency key is held back only by the pause and the
    queue's rate.
    """

    queue: str
    paused: bool = False
    max_running: int | None = None
    per_second: float | None = None
    burst: float | None = None
    keys: tuple[KeyFlow, ...] = ()

    @property
    def limited(self) -> bool:
        """Whether anything holds the queue's claims back."""
        return (
            self.paused
            or self.max_running is not None
            or self.per_second is not None
            or bool(self.keys)
        )


@dataclass(frozen=True)
class KeyAtLimit:
    """A key at its concurrency limit, and how long its oldest due task has waited."""

    key: str
    running: int
    max_running: int
    waited_seconds: float


@dataclass(frozen=True)
class RecoveredTask:
    """A task whose lease had expired, as the sweeper found and recovered it."""

    task_id: int
    queue: str
    attempt: int
    worker_id: str | None
    lease_expires_at: datetime
    action: RecoveryAction


@dataclass(frozen=True)
class RecoveryEvent:
    """A row of the durable recovery-event log; ``id`` only grows, in commit order."""

    id: int
    task_id: int
    queue: str
    action: RecoveryAction
    attempt: int
    worker_id: str | None
    lease_expires_at: datetime
    recovered_at: datetime

    @property
    def seconds_overdue(self) -> float:
        """How long after its lease expired the task was recovered."""
        return (self.recovered_at - self.lease_expires_at).total_seconds()


@dataclass(frozen=True)
class AttemptRecord:
    """One row of the attempts (idempotency) table."""

    id: int
    key: str | None
    attempt: int
    task_id: int | None
    worker_id: str | None
    outcome: str
    error: str | None
    result: dict[str, Any] | None
    started_at: datetime
    finished_at: datetime | None
    # The task's queue when the attempt was at a task's work; None for a key of your own.
    queue: str | None = None


@dataclass(frozen=True)
class Batch:
    """A batch as :meth:`LeaseQueue.enqueue_batch` made it, or found it under its name.

    ``created`` is False when a batch of that name already existed: nothing was added.
    """

    id: int
    name: str | None
    queue: str
    total: int
    created_at: datetime
    created: bool = True


@dataclass(frozen=True)
class BatchInfo:
    """A batch's state, read from its counters (see :meth:`LeaseQueue.batch`).

    ``finished`` once no task of it is enqueued or processing; ``finished_at`` is when its
    last task finished (None while unfinished).
    """

    id: int
    name: str | None
    queue: str
    total: int
    enqueued: int
    processing: int
    done: int
    dead: int
    cancelled: int
    created_at: datetime
    finished_at: datetime | None

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    @property
    def counts(self) -> dict[str, int]:
        """Tasks per status, every status included."""
        return {
            "enqueued": self.enqueued,
            "processing": self.processing,
            "done": self.done,
            "dead": self.dead,
            "cancelled": self.cancelled,
        }


@dataclass(frozen=True)
class TaskResult:
    """One task of a batch as :meth:`LeaseQueue.batch_results` yields it."""

    task_id: int
    payload: dict[str, Any]
    status: Status
    result: dict[str, Any] | None
    last_error: str | None
