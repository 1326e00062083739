"""The Dagster resource: a LeaseQueue whose pool lives as long as the run or the tick."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import dagster as dg
from dagster._core.libraries import DagsterLibraryRegistry
from pydantic import Field, PrivateAttr

from ..attempts import Attempt
from ..flow import ConcurrencyKey
from ..lease import Lease
from ..models import (
    Batch,
    BatchInfo,
    QueueStats,
    RecoveredTask,
    RecoveryEvent,
    TaskInfo,
    TaskResult,
)
from ..queue import LeaseQueue
from ..settings import LeaseQueueSettings
from ..version import __version__
from ..worker import WorkerSummary, run_worker
from .keys import QUEUE_TAG

DagsterLibraryRegistry.register("dagster-leasequeue", __version__, is_dagster_package=False)


class LeaseQueueResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """A durable task queue in PostgreSQL for ops, assets and sensors.

    Every field left unset falls back to the ``LEASEQUEUE_*`` environment settings; with no
    DSN anywhere, an embedded PostgreSQL is started. Claims made in a run record a worker id
    naming the run and step, so the database shows which run holds each lease.

    Example:
        .. code-block:: python

            import dagster as dg
            from dagster_leasequeue import LeaseQueueResource

            @dg.op
            def work(leasequeue: LeaseQueueResource) -> None:
                lease = leasequeue.claim()
                while lease is not None:
                    # The attempt's conclusion also claims the next task, in one round trip.
                    with lease, leasequeue.attempt(lease=lease, claim_next=True) as attempt:
                        if not attempt.duplicate:
                            handle(lease.payload, attempt.connection)
                    lease = attempt.claimed

            defs = dg.Definitions(
                jobs=[dg.job(work)],
                resources={"leasequeue": LeaseQueueResource(dsn=dg.EnvVar("LEASEQUEUE_DSN"))},
            )
    """

    dsn: str | None = Field(
        default=None,
        description=(
            "PostgreSQL connection string; pass dg.EnvVar('LEASEQUEUE_DSN') so the password "
            "never appears in the Dagster UI. Unset: LEASEQUEUE_DSN, else the embedded server."
        ),
        repr=False,
    )
    schema_name: str | None = Field(
        default=None, description="Schema of the queue's tables (default: leasequeue)."
    )
    queue: str = Field(
        default="default", description="Queue used by claim and enqueue unless told otherwise."
    )
    lease_seconds: float | None = Field(
        default=None, description="Default lease of a claim in seconds (default: 300)."
    )
    max_attempts: int | None = Field(
        default=None, description="Default number of claims before a task is dead (default: 5)."
    )
    pool_size: int | None = Field(
        default=None, description="Largest number of pooled connections (default: 4)."
    )
    install_schema: bool = Field(
        default=True,
        description=(
            "Create or migrate the schema when the resource starts. Turn off for a role "
            "without DDL rights once the schema is installed."
        ),
    )

    _queue: LeaseQueue | None = PrivateAttr(default=None)
    _run_worker_id: str | None = PrivateAttr(default=None)
    _run_queue: str | None = PrivateAttr(default=None)

    @classmethod
    def _is_dagster_maintained(cls) -> bool:
        return False

    # -- life cycle ------------------------------------------------------------------------

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        # InitResourceContext.run replaced dagster_run in Dagster 1.11.
        run = (
            getattr(context, "run", None) if hasattr(type(context), "run") else context.dagster_run
        )
        if run is not None:
            self._run_worker_id = f"dagster-run:{run.run_id}"
            # A run launched for a queue (by the worker launcher sensor) works that queue.
            self._run_queue = run.tags.get(QUEUE_TAG)
        self.get_queue()

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        queue, self._queue = self._queue, None
        if queue is not None:
            queue.close()

    def settings(self) -> LeaseQueueSettings:
        """The effective settings: this resource's fields over the ``LEASEQUEUE_*`` environment."""
        overrides: dict[str, Any] = {
            name: value
            for name, value in {
                "dsn": self.dsn,
                "schema_name": self.schema_name,
                "lease_seconds": self.lease_seconds,
                "max_attempts": self.max_attempts,
                "pool_size": self.pool_size,
            }.items()
            if value is not None
        }
        return LeaseQueueSettings(**overrides)

    def get_queue(self) -> LeaseQueue:
        """The underlying :class:`LeaseQueue`, opened on first use."""
        if self._queue is None:
            queue = LeaseQueue.from_settings(self.settings())
            try:
                if self.install_schema:
                    queue.install()
                else:
                    queue.check_installed()  # fail at start-up, not at the first claim
            except BaseException:
                queue.close()
                raise
            self._queue = queue
        return self._queue

    # -- delegation ------------------------------------------------------------------------

    def default_queue(self) -> str:
        """The queue used when none is named: the run's ``leasequeue/queue`` tag, else ``queue``."""
        return self._run_queue or self.queue

    def worker_id(self) -> str:
        """Who is claiming: the run and step when called in a run, else host and process."""
        where = f"{socket.gethostname()}:{os.getpid()}"
        context = _op_context()
        if context is not None:
            step_key = context.get_step_execution_context().step.key
            return f"dagster-run:{context.run_id}:{step_key}@{where}"
        if self._run_worker_id:
            return f"{self._run_worker_id}@{where}"
        return where

    def claim(
        self, *, queue: str | None = None, lease_seconds: float | None = None, wait: float = 0
    ) -> Lease | None:
        """Claim the next due task of ``queue`` (default: this resource's queue).

        ``wait``: seconds to wait for a task when none is due; see :meth:`LeaseQueue.claim`.
        """
        return self.get_queue().claim(
            queue=self.default_queue() if queue is None else queue,
            worker_id=self.worker_id(),
            lease_seconds=lease_seconds,
            wait=wait,
        )

    def run_worker(
        self,
        handler: Callable[..., Any],
        *,
        queue: str | None = None,
        lease_seconds: float | None = None,
        poll_interval: float = 1.0,
        max_tasks: int | None = None,
        burst: bool = True,
    ) -> WorkerSummary:
        """Claim tasks of ``queue`` and run ``handler`` on each; see :func:`run_worker`.

        Unlike the plain function it stops once no task is due (``burst``), so a run ends
        when its queue is drained, and in an op it logs to the op's ``context.log``. It
        outlives the database going away and coming back (a restart, a failover).
        """
        context = _op_context()
        return run_worker(
            self.get_queue(),
            handler,
            queue_name=self.default_queue() if queue is None else queue,
            lease_seconds=lease_seconds,
            poll_interval=poll_interval,
            max_tasks=max_tasks,
            burst=burst,
            worker_id=self.worker_id(),
            logger=context.log if context is not None else None,
        )

    def claim_many(
        self,
        limit: int,
        *,
        queue: str | None = None,
        lease_seconds: float | None = None,
        wait: float = 0,
    ) -> list[Lease]:
        """Claim up to ``limit`` due tasks of ``queue`` (default: this resource's queue)."""
        return self.get_queue().claim_many(
            limit,
            queue=self.default_queue() if queue is None else queue,
            worker_id=self.worker_id(),
            lease_seconds=lease_seconds,
            wait=wait,
        )

    def ack_many(
        self, leases: Iterable[Lease], results: Iterable[Mapping[str, Any] | None] | None = None
    ) -> list[int]:
        """Ack many leases in one statement; see :meth:`LeaseQueue.ack_many`."""
        return self.get_queue().ack_many(leases, results)

    def ack_many_and_claim(
        self,
        leases: Iterable[Lease],
        results: Iterable[Mapping[str, Any] | None] | None = None,
        *,
        limit: int,
        lease_seconds: float | None = None,
    ) -> list[Lease]:
        """Ack many leases and claim the next ones in one statement and one commit; see
        :meth:`LeaseQueue.ack_many_and_claim`."""
        return self.get_queue().ack_many_and_claim(
            leases, results, limit=limit, lease_seconds=lease_seconds
        )

    def enqueue(
        self,
        payload: Mapping[str, Any],
        *,
        queue: str | None = None,
        priority: int = 0,
        run_at: datetime | None = None,
        delay: float | None = None,
        idempotency_key: str | None = None,
        max_attempts: int | None = None,
        lease_seconds: float | None = None,
        concurrency_key: str | None = None,
    ) -> int:
        """Add a task; see :meth:`LeaseQueue.enqueue`."""
        return self.get_queue().enqueue(
            payload,
            queue=self.default_queue() if queue is None else queue,
            priority=priority,
            run_at=run_at,
            delay=delay,
            idempotency_key=idempotency_key,
            max_attempts=max_attempts,
            lease_seconds=lease_seconds,
            concurrency_key=concurrency_key,
        )

    def enqueue_many(
        self,
        payloads: Iterable[Mapping[str, Any]],
        *,
        queue: str | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        concurrency_key: ConcurrencyKey = None,
    ) -> list[int]:
        """Add many tasks in one statement; see :meth:`LeaseQueue.enqueue_many`."""
        return self.get_queue().enqueue_many(
            payloads,
            queue=self.default_queue() if queue is None else queue,
            priority=priority,
            max_attempts=max_attempts,
            concurrency_key=concurrency_key,
        )

    @contextmanager
    def attempt(
        self,
        key: str | None = None,
        *,
        lease: Lease | None = None,
        claim_next: bool = False,
        next_lease_seconds: float | None = None,
    ) -> Iterator[Attempt]:
        """Record an attempt and skip duplicate work; see :meth:`LeaseQueue.attempt`."""
        with self.get_queue().attempt(
            key,
            lease=lease,
            worker_id=self.worker_id(),
            claim_next=claim_next,
            next_lease_seconds=next_lease_seconds,
        ) as attempt:
            yield attempt

    def enqueue_batch(
        self,
        payloads: Iterable[Mapping[str, Any]],
        *,
        queue: str | None = None,
        name: str | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        idempotency_keys: Iterable[str] | None = None,
        concurrency_key: ConcurrencyKey = None,
    ) -> Batch:
        """Add a batch of tasks in one transaction; see :meth:`LeaseQueue.enqueue_batch`.

        Return ``batch_metadata(batch)`` in the asset's materialization so that a batch
        sensor finds it.
        """
        return self.get_queue().enqueue_batch(
            payloads,
            queue=self.default_queue() if queue is None else queue,
            name=name,
            priority=priority,
            max_attempts=max_attempts,
            idempotency_keys=idempotency_keys,
            concurrency_key=concurrency_key,
        )

    def batch(self, batch_id: int) -> BatchInfo:
        """A batch's state; see :meth:`LeaseQueue.batch`."""
        return self.get_queue().batch(batch_id)

    def batch_results(
        self, batch_id: int, *, statuses: Iterable[str] = ("done",)
    ) -> Iterator[TaskResult]:
        """A batch's tasks with their results; see :meth:`LeaseQueue.batch_results`."""
        return self.get_queue().batch_results(batch_id, statuses=statuses)

    def wait_batch(
        self, batch_id: int, *, timeout: float | None = None, poll_interval: float = 5.0
    ) -> BatchInfo:
        """Wait for a batch to finish; see :meth:`LeaseQueue.wait_batch`."""
        return self.get_queue().wait_batch(batch_id, timeout=timeout, poll_interval=poll_interval)

    def cancel_batch(self, batch_id: int) -> int:
        """Cancel a batch's unfinished tasks; see :meth:`LeaseQueue.cancel_batch`."""
        return self.get_queue().cancel_batch(batch_id)

    def sweep(self, *, limit: int | None = None) -> list[RecoveredTask]:
        """Recover expired leases in every queue; see :meth:`LeaseQueue.sweep`."""
        return self.get_queue().sweep(limit=limit)

    def recovery_events(self, after_id: int = 0, *, limit: int = 1000) -> list[RecoveryEvent]:
        """Recovery events after ``after_id``; see :meth:`LeaseQueue.recovery_events`."""
        return self.get_queue().recovery_events(after_id, limit=limit)

    def stats(self, queue: str | None = None, *, finished: bool = True) -> QueueStats:
        """Counts per status for one queue, or all queues; see :meth:`LeaseQueue.stats`."""
        return self.get_queue().stats(queue, finished=finished)

    def get(self, task_id: int) -> TaskInfo:
        """The task with this id."""
        return self.get_queue().get(task_id)

    def cancel(self, task_id: int) -> bool:
        """Cancel a task not yet finished."""
        return self.get_queue().cancel(task_id)

    def retry_dead(
        self,
        task_ids: Iterable[int] | None = None,
        *,
        queue: str | None = None,
        batch: int | None = None,
    ) -> int:
        """Enqueue dead tasks again with a fresh budget of attempts."""
        return self.get_queue().retry_dead(task_ids, queue=queue, batch=batch)


def _op_context() -> dg.OpExecutionContext | None:
    """The context of the op being executed in this thread, if any."""
    try:
        return dg.OpExecutionContext.get()
    except dg.DagsterInvariantViolationError:
        return None
