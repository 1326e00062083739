"""The queue: enqueue, claim, inspect and steer tasks stored in PostgreSQL."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from datetime import datetime
from types import TracebackType
from typing import Any

import psycopg
from psycopg.rows import class_row

from . import (
    batches as batch_module,
    bulk,
    flow as flow_module,
    schema as schema_module,
    sql,
)
from .attempts import Attempt, AttemptTarget, attempt_target, run_attempt
from .connection import reset_session
from .driver import QueueDriver
from .dsn import describe
from .embedded import embedded_dsn
from .errors import ConfigurationError, LeaseLost, LeaseQueueError, TaskNotFound
from .fastpath import bigint_array
from .flow import ConcurrencyKey, encode_payloads
from .lease import Lease, discard_begun_attempts, leases_from_rows
from .models import (
    FINISHED,
    LIVE,
    STATUSES,
    AttemptRecord,
    Batch,
    BatchInfo,
    KeyAtLimit,
    QueueFlow,
    QueueStats,
    RecoveredTask,
    RecoveryEvent,
    TaskInfo,
    TaskResult,
)
from .notify import Listener
from .payloads import encode_object
from .settings import LeaseQueueSettings
from .sweeper import sweep_expired
from .validation import (
    MAX_ATTEMPTS,
    MIN_POLL_SECONDS,
    check_batch_name,
    check_count,
    check_id,
    check_iterable,
    check_key,
    check_lease_seconds,
    check_limit,
    check_priority,
    check_queue,
    check_rate,
    check_run_at,
    check_seconds,
    check_worker_id,
    validate_schema_name,
)

logger = logging.getLogger(__name__)

# An idempotent enqueue can race with the task it collides with finishing; a retry settles it.
_ENQUEUE_RETRIES = 5
_POLL_SECONDS = 1.0
# enqueue_many calls with more tasks than this stream them through COPY: a statement's
# arrays of payloads cost more to send and unpack than COPY's rows.
COPY_FROM_TASKS = 1000


class LeaseQueue:
    """A durable task queue in PostgreSQL, with leases that recover tasks of dead workers.

    Example:
        .. code-block:: python

            from dagster_leasequeue import LeaseQueue

            with LeaseQueue("postgresql://app@db/app") as queue:
                queue.install()
                queue.enqueue({"document": "invoice-17.pdf"})
                lease = queue.claim()
                if lease is not None:
                    with lease:  # renews in the background, acks on success, fails on error
                        handle(lease.payload)

    With no DSN here nor in ``LEASEQUEUE_DSN``, it starts or attaches to an embedded
    PostgreSQL under ``LEASEQUEUE_DATA_DIR``.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        schema: str | None = None,
        settings: LeaseQueueSettings | None = None,
    ) -> None:
        self.settings = settings if settings is not None else LeaseQueueSettings()
        self.schema = validate_schema_name(
            schema if schema is not None else self.settings.schema_name
        )
        dsn = dsn or self.settings.dsn_value()
        self.embedded = not dsn
        if not dsn:
            dsn = embedded_dsn(self.settings.data_dir)
        self.location = describe(dsn)
        self.default_worker_id = f"{socket.gethostname()}:{os.getpid()}"
        self._driver = QueueDriver(dsn, self.schema, self.settings)
        self._listener = Listener(dsn, self.schema, self._driver.options)
        self._notify = {
            "notify": self.settings.notify,
            "channel": sql.notify_channel(self.schema),
        }

    @classmethod
    def from_settings(cls, settings: LeaseQueueSettings | None = None) -> LeaseQueue:
        """Build a queue from settings (by default read from the ``LEASEQUEUE_*`` environment)."""
        return cls(settings=settings if settings is not None else LeaseQueueSettings())

    def __repr__(self) -> str:
        return f"LeaseQueue(location={self.location!r}, schema={self.schema!r})"

    def __enter__(self) -> LeaseQueue:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool. Leases still held simply expire and are swept."""
        if not self._driver.closed:
            self._driver.close()
            self._listener.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._driver.closed

    # -- schema ----------------------------------------------------------------------------

    def install(self) -> int:
        """Create the schema or migrate it to this release; return how many migrations ran.

        Idempotent and safe to call from several processes at once.
        """
        with self._driver.connection() as conn:
            return schema_module.install(conn, self.schema)

    def grant_worker(self, role: str) -> None:
        """Grant ``role`` what producing, working and sweeping need, and nothing more.

        The role can enqueue, claim, ack, fail, renew, record attempts, sweep and read; it
        cannot delete, truncate or change the schema. Run this as the schema's owner.
        """
        if not isinstance(role, str) or not role or len(role.encode()) > 63:
            raise ConfigurationError(f"role must be a PostgreSQL role name, got {role!r}")
        with self._driver.connection() as conn, conn.transaction():
            for template in sql.WORKER_GRANTS:
                conn.execute(sql.compose_grant(template, self.schema, role))

    def check_installed(self) -> None:
        """Raise SchemaNotInstalled unless the schema is at this release's version."""
        with self._driver.connection() as conn:
            schema_module.require_installed(conn, self.schema)

    def installed_version(self) -> int:
        """The schema's migration version in the database (0: not installed)."""
        with self._driver.connection() as conn:
            return schema_module.installed_version(conn, self.schema)

    # -- producing -------------------------------------------------------------------------

    def enqueue(
        self,
        payload: Mapping[str, Any],
        *,
        queue: str = "default",
        priority: int = 0,
        run_at: datetime | None = None,
        delay: float | None = None,
        idempotency_key: str | None = None,
        max_attempts: int | None = None,
        lease_seconds: float | None = None,
        concurrency_key: str | None = None,
    ) -> int:
        """Add a task and return its id.

        ``run_at`` (timezone-aware) or ``delay`` (seconds, database clock) postpone it.
        With an ``idempotency_key`` that an unfinished task of the same queue already has,
        nothing is inserted and that task's id is returned. Once that task is finished
        (done, dead or cancelled) the key is free again and a new task is created: use
        :meth:`attempt` to make the work itself happen once.

        A ``concurrency_key`` (a customer, a tenant, an endpoint) puts the task under the
        key's concurrency and rate limits: see :meth:`set_concurrency_limit`.
        """
        params = {
            "queue": check_queue(queue),
            "priority": check_priority(priority),
            "payload": encode_object(
                payload, what="payload", max_bytes=self.settings.payload_max_bytes
            ),
            "idempotency_key": check_key(idempotency_key),
            "max_attempts": self._max_attempts(max_attempts),
            "lease_seconds": check_lease_seconds(lease_seconds),
            "run_at": check_run_at(run_at, delay),
            "delay": None if delay is None else check_seconds("delay", delay, allow_zero=True),
            "concurrency_key": check_key(concurrency_key, "concurrency_key"),
        } | self._notify
        with self._driver.statements() as conn:
            for _ in range(_ENQUEUE_RETRIES):
                row = conn.execute(self._driver.statement(sql.ENQUEUE), params).fetchone()
                if row is None:
                    row = conn.execute(
                        self._driver.statement(sql.FIND_UNFINISHED_BY_KEY), params
                    ).fetchone()
                if row is not None:
                    return int(row[0])
        raise ConfigurationError(  # pragma: no cover - needs a task finishing at every retry
            f"could not enqueue with idempotency key {idempotency_key!r}: it kept changing hands"
        )

    def enqueue_many(
        self,
        payloads: Iterable[Mapping[str, Any]],
        *,
        queue: str = "default",
        priority: int = 0,
        max_attempts: int | None = None,
        concurrency_key: ConcurrencyKey = None,
    ) -> list[int]:
        """Add many tasks, all or none; return their ids in the payloads' order.

        Every payload is checked before the call commits: one bad payload stores none.
        ``concurrency_key`` is one key for every task, or a function of each payload that
        returns its key (or None). A few go in one statement; more than
        ``COPY_FROM_TASKS`` stream through COPY, in one transaction.
        """
        columns = {
            "queue": check_queue(queue),
            "priority": check_priority(priority),
            "max_attempts": self._max_attempts(max_attempts),
        }
        check_iterable("payloads", payloads, "dicts")
        items = payloads if isinstance(payloads, Collection) else list(payloads)
        encoded_rows = encode_payloads(items, concurrency_key, self.settings.payload_max_bytes)
        if len(items) > COPY_FROM_TASKS:
            return self._copy_many(encoded_rows, len(items), columns)
        rows = list(encoded_rows)
        if not rows:
            return []
        encoded, keys = (list(column) for column in zip(*rows, strict=True))
        params = columns | {"payloads": encoded, "keys": keys} | self._notify
        with self._driver.statements() as conn:
            rows = conn.execute(self._driver.statement(sql.ENQUEUE_MANY), params).fetchall()
        # Identity values are drawn in the order the rows were inserted.
        return sorted(int(row[0]) for row in rows)

    def _copy_many(
        self, rows: Iterator[tuple[str, str | None]], count: int, columns: dict[str, Any]
    ) -> list[int]:
        """enqueue_many's ``count`` tasks through COPY, under ids drawn for them first.

        Each payload is encoded as COPY sends it, so the server writes while the client
        encodes; one that fails its check rolls the whole call back.
        """
        with self._driver.connection() as conn, conn.transaction():
            ids = bulk.reserve_ids(conn, self._driver, count)
            bulk.copy_tasks(conn, self._driver, rows, columns | {"batch_id": None}, iter(ids))
            if self.settings.notify:
                conn.execute(
                    sql.NOTIFY, {"channel": self._notify["channel"], "payload": columns["queue"]}
                )
        return ids

    # -- batches ---------------------------------------------------------------------------

    def enqueue_batch(
        self,
        payloads: Iterable[Mapping[str, Any]],
        *,
        queue: str = "default",
        name: str | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        idempotency_keys: Iterable[str] | None = None,
        concurrency_key: ConcurrencyKey = None,
    ) -> Batch:
        """Add a batch of tasks, and the batch, in one transaction: all or none.

        ``payloads`` may be any iterable, a generator of millions included: it is streamed
        through ``COPY`` a few thousand rows at a time, so memory stays flat. A bad payload
        stops it with a PayloadError naming its position, and nothing is stored.

        With ``name``, a batch of that name that already exists is returned (with
        ``created=False``) and nothing is added, so a retried fan-out does not fan out
        twice. With ``idempotency_keys`` (one per payload), a key an unfinished task of the
        queue holds is skipped, as :meth:`enqueue` skips it, and the batch counts only the
        tasks it added; the tasks then go in by chunked statements instead of ``COPY``.
        ``concurrency_key`` works as in :meth:`enqueue_many`.
        """
        return batch_module.enqueue_batch(
            self._driver,
            check_iterable("payloads", payloads, "dicts"),
            queue=check_queue(queue),
            name=check_batch_name(name),
            priority=check_priority(priority),
            max_attempts=self._max_attempts(max_attempts),
            idempotency_keys=(
                None
                if idempotency_keys is None
                else check_iterable("idempotency_keys", idempotency_keys, "keys")
            ),
            concurrency_key=concurrency_key,
            notify=self._notify,
        )

    def batch(self, batch_id: int) -> BatchInfo:
        """A batch's state: its tasks per status, and whether and when it finished.

        Read from counters, so it costs the same at 10 tasks or a million. A batch finishes
        when its last task is done, dead or cancelled, whichever way (ack, fail, sweep,
        cancel); a task put back by :meth:`retry_dead` makes it unfinished again.
        Raises BatchNotFound for an unknown id.
        """
        return batch_module.batch_info(self._driver, check_id("batch_id", batch_id))

    def batches(self, *, queue: str | None = None, limit: int = 100) -> list[BatchInfo]:
        """The newest batches (of ``queue``, or of every queue), newest first."""
        return batch_module.list_batches(
            self._driver, queue=queue, limit=check_count("limit", limit)
        )

    def batch_results(
        self, batch_id: int, *, statuses: Iterable[str] = ("done",)
    ) -> Iterator[TaskResult]:
        """Yield the batch's tasks of these statuses with their results and last errors.

        A status at a time, in the order given, each in the order the tasks were enqueued.
        Read through a server-side cursor a page at a time: a million results stream with
        flat memory. The iterator holds a pooled connection (and a transaction) until it is
        exhausted or closed: use it in a ``for`` loop, or close it.
        """
        checked = batch_module.checked_statuses(statuses)
        return batch_module.batch_results(self._driver, check_id("batch_id", batch_id), checked)

    def wait_batch(
        self, batch_id: int, *, timeout: float | None = None, poll_interval: float = 5.0
    ) -> BatchInfo:
        """Wait until the batch has finished and return its state.

        Woken by a NOTIFY when its last tasks finish; reads its state every
        ``poll_interval`` seconds too. With ``timeout``, returns after that many seconds
        even if the batch has not finished: check ``finished`` on the result.
        """
        if timeout is not None:
            check_seconds("timeout", timeout, allow_zero=True)
        if check_seconds("poll_interval", poll_interval) < MIN_POLL_SECONDS:
            raise ConfigurationError(
                f"poll_interval must be at least {MIN_POLL_SECONDS} s (each poll is a query), "
                f"got {poll_interval!r}"
            )
        return batch_module.wait_batch(
            self._driver,
            self._listener,
            check_id("batch_id", batch_id),
            timeout=timeout,
            poll_interval=float(poll_interval),
        )

    def cancel_batch(self, batch_id: int) -> int:
        """Cancel every unfinished task of the batch; return how many were cancelled.

        Workers holding one of them lose their lease, and the running attempt records of
        their work are marked abandoned, as with :meth:`cancel`.
        """
        return batch_module.cancel_batch(
            self._driver, check_id("batch_id", batch_id), sql.notify_channel(self.schema)
        )

    # -- flow control ----------------------------------------------------------------------

    def pause(self, queue: str) -> None:
        """Stop claims from the queue until :meth:`resume`.

        Enqueues still land, and the sweeper still recovers the queue's expired leases;
        tasks already claimed run on. Takes effect at the next claim of every worker.
        """
        flow_module.set_paused(self._driver, check_queue(queue), True, self._notify)

    def resume(self, queue: str) -> None:
        """Let the queue's tasks be claimed again; waiting claimers look at once."""
        flow_module.set_paused(self._driver, check_queue(queue), False, self._notify)

    def set_concurrency_limit(
        self, queue: str, max_running: int | None, *, key: str | None = None
    ) -> None:
        """Let at most ``max_running`` tasks of a concurrency key be processing at once.

        With ``key=None``, the default for every key of the queue; with a key, that key's
        own limit (over the default). ``None`` removes the limit; 0 holds the key's tasks
        back. Counted across every worker, process and host, by the claim itself. A task
        without a concurrency key is not limited. A task whose lease has expired still
        counts until the sweeper recovers it: its worker may still be running it.
        """
        flow_module.set_concurrency_limit(
            self._driver,
            check_queue(queue),
            check_limit(max_running),
            check_key(key, "key"),
            self._notify,
        )

    def set_rate_limit(
        self,
        queue: str,
        *,
        per_second: float | None,
        burst: float | None = None,
        key: str | None = None,
    ) -> None:
        """Let claims take at most ``per_second`` tasks a second from the queue (with
        ``key``, of that concurrency key), counted across every worker.

        A token bucket: it holds up to ``burst`` tokens (default: one second's worth, at
        least 1), refills at the rate, and starts full. Each claimed task takes a token in
        the claim's own statement; with none left, ``claim(wait=...)`` waits for the next.
        ``per_second=None`` removes the limit.
        """
        rate, bucket = check_rate(per_second, burst)
        flow_module.set_rate_limit(
            self._driver, check_queue(queue), rate, bucket, check_key(key, "key"), self._notify
        )

    def flow(self, queue: str) -> QueueFlow:
        """The controls in force on a queue: pause, limits, rates, keys with their own."""
        with self._driver.connection() as conn:
            return flow_module.queue_flow(conn, self._driver, check_queue(queue))

    def flows(self) -> dict[str, QueueFlow]:
        """The controls of every queue that has any in force, by queue name."""
        return flow_module.controlled_queues(self._driver)

    def keys_at_limit(
        self, queue: str, *, waiting_longer_than: float = 0, limit: int = 100
    ) -> list[KeyAtLimit]:
        """Keys of the queue at their concurrency limit whose oldest due task has waited
        longer than ``waiting_longer_than`` seconds, longest first."""
        return flow_module.keys_at_limit(
            self._driver,
            check_queue(queue),
            check_seconds("waiting_longer_than", waiting_longer_than, allow_zero=True),
            check_count("limit", limit),
        )

    # -- consuming -------------------------------------------------------------------------

    def claim(
        self,
        *,
        queue: str = "default",
        worker_id: str | None = None,
        lease_seconds: float | None = None,
        wait: float = 0,
    ) -> Lease | None:
        """Claim the next due task (highest priority, then oldest); None when there is none.

        With ``wait``, an empty queue is waited on for up to that many seconds: an enqueue's
        notification wakes the claim at once, and it also looks again every second.
        """
        leases = self.claim_many(
            1, queue=queue, worker_id=worker_id, lease_seconds=lease_seconds, wait=wait
        )
        return leases[0] if leases else None

    def claim_many(
        self,
        limit: int,
        *,
        queue: str = "default",
        worker_id: str | None = None,
        lease_seconds: float | None = None,
        wait: float = 0,
    ) -> list[Lease]:
        """Claim up to ``limit`` due tasks in one statement, in claim order.

        ``wait`` works as in :meth:`claim`.
        """
        check_count("limit", limit)
        check_seconds("wait", wait, allow_zero=True)
        queue = check_queue(queue)
        worker = check_worker_id(worker_id) or self.default_worker_id
        claims = self._driver.claims
        params = claims.params(queue, worker, check_lease_seconds(lease_seconds))
        deadline = time.monotonic() + wait
        if wait:
            with self._driver.errors:
                mark = self._listener.listen(wait)
        while True:
            sent = time.monotonic()
            with self._driver.statements() as conn:
                rows = claims.claim(conn, limit, params)
            # A rate-limited queue without a token answers with a row saying when the
            # next one is due, and no task.
            next_token = min((row[10] for row in rows if row[0] is None), default=None)
            leases = leases_from_rows(self._driver, rows, queue=queue, worker_id=worker, sent=sent)
            if leases or not wait:
                return leases
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return leases
            with self._driver.errors:
                # Delayed and retried tasks send no notification: look again each second,
                # or when the queue's next token is due.
                pause = min(remaining, _POLL_SECONDS, next_token or _POLL_SECONDS)
                mark = self._listener.wait(pause, mark)

    # -- maintenance -----------------------------------------------------------------------

    def sweep(self, *, limit: int | None = None) -> list[RecoveredTask]:
        """Recover every task whose lease has expired (at most ``limit``), in all queues.

        A recovered task is enqueued again at once, or is ``dead`` when it used all its
        attempts. Each recovery is also written to the recovery-event log. Several sweepers
        may run at once: each expiry is recovered exactly once.
        """
        if limit is not None:
            check_count("limit", limit)
        with self._driver.connection() as conn:
            return sweep_expired(
                conn, self.schema, batch_size=self.settings.sweep_batch_size, limit=limit
            )

    def recovery_events(self, after_id: int = 0, *, limit: int = 1000) -> list[RecoveryEvent]:
        """Recovery events with an id above ``after_id``, oldest first.

        Ids only grow in commit order, so a reader that remembers the last id it saw reads
        every event exactly once.
        """
        params = {
            "after_id": check_count("after_id", after_id, minimum=0, maximum=2**63 - 1),
            "limit": check_count("limit", limit),
        }
        with self._driver.connection() as conn:
            cursor = conn.cursor(row_factory=class_row(RecoveryEvent))
            return cursor.execute(
                self._driver.statement(sql.RECOVERY_EVENTS_AFTER), params
            ).fetchall()

    # -- inspecting and steering -----------------------------------------------------------

    def get(self, task_id: int) -> TaskInfo:
        """The task with this id; raise TaskNotFound if there is none."""
        with self._driver.connection() as conn:
            cursor = conn.cursor(row_factory=class_row(TaskInfo))
            task = cursor.execute(
                self._driver.statement(sql.GET_TASK), {"task_id": task_id}
            ).fetchone()
        if task is None:
            raise TaskNotFound(f"no task with id {task_id} in schema {self.schema!r}")
        return task

    def list_tasks(
        self,
        *,
        status: str | None = None,
        queue: str | None = None,
        after_id: int = 0,
        limit: int = 100,
    ) -> list[TaskInfo]:
        """Tasks in id order, filtered by status and queue; page on with ``after_id``."""
        if status is not None and status not in STATUSES:
            raise ConfigurationError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        params = {
            "status": status,
            "queue": queue,
            "after_id": check_count("after_id", after_id, minimum=0, maximum=2**63 - 1),
            "limit": check_count("limit", limit),
        }
        with self._driver.connection() as conn:
            cursor = conn.cursor(row_factory=class_row(TaskInfo))
            return cursor.execute(self._driver.statement(sql.LIST_TASKS), params).fetchall()

    def stats(self, queue: str | None = None, *, finished: bool = True) -> QueueStats:
        """Counts per status (every status, zeros included) for one queue or all of them.

        Counting ``done`` and ``cancelled`` tasks reads every finished row. With
        ``finished=False`` they are left out of ``counts``, and the rest (``enqueued``,
        ``processing``, ``dead``, ``due``, the oldest waiting task) is read through partial
        indexes, at a cost that does not grow with the finished rows: use it for anything
        that runs on every tick.
        """
        with self._driver.connection() as conn:
            per_queue = self._stats_rows(conn, queue, finished).values()
            flow = None if queue is None else flow_module.queue_flow(conn, self._driver, queue)
        counts: dict[str, int] = dict.fromkeys(STATUSES if finished else LIVE, 0)
        for stats in per_queue:
            for status, count in stats.counts.items():
                counts[status] += count
        ages = [
            s.oldest_enqueued_seconds for s in per_queue if s.oldest_enqueued_seconds is not None
        ]
        return QueueStats(
            queue=queue,
            counts=counts,
            oldest_enqueued_seconds=max(ages, default=None),
            due=sum(s.due for s in per_queue),
            flow=flow,
        )

    def stats_by_queue(self, *, finished: bool = True) -> dict[str, QueueStats]:
        """:meth:`stats` for every queue that holds tasks (live tasks, when not ``finished``)."""
        with self._driver.connection() as conn:
            return self._stats_rows(conn, None, finished)

    def _stats_rows(
        self, conn: psycopg.Connection[Any], queue: str | None, finished: bool
    ) -> dict[str, QueueStats]:
        statement = sql.STATS if finished else sql.LIVE_STATS
        statuses = STATUSES if finished else LIVE
        rows = conn.execute(self._driver.statement(statement), {"queue": queue}).fetchall()
        per_queue: dict[str, QueueStats] = {}
        for name, status, count, due, age in rows:
            stats = per_queue.setdefault(
                name, QueueStats(queue=name, counts=dict.fromkeys(statuses, 0))
            )
            stats.counts[status] = int(count)
            if status == "enqueued":
                oldest = float(age) if age is not None else None
                per_queue[name] = replace(stats, oldest_enqueued_seconds=oldest, due=int(due))
        return dict(sorted(per_queue.items()))

    def database_now(self) -> datetime:
        """The database's clock now (``clock_timestamp()``): the clock every lease is read by."""
        with self._driver.connection() as conn:
            row = conn.execute(self._driver.statement(sql.DATABASE_NOW)).fetchone()
        assert row is not None
        now: datetime = row[0]
        return now

    def queues(self) -> list[str]:
        """The names of the queues that hold tasks."""
        with self._driver.connection() as conn:
            rows = conn.execute(self._driver.statement(sql.QUEUE_NAMES)).fetchall()
        return [str(row[0]) for row in rows]

    def ack_many(
        self, leases: Iterable[Lease], results: Iterable[Mapping[str, Any] | None] | None = None
    ) -> list[int]:
        """Ack many leases in one statement, each fenced by its own token.

        Every lease still held is acked (and the ids returned); if any was lost, the others
        are acked all the same and :class:`LeaseLost` is then raised naming the lost ones.
        """
        held = list(leases)
        params = self._ack_many_params("ack_many", held, results)
        if not held:
            return []
        with self._driver.statements() as conn:
            discard_begun_attempts(conn, held)
            acked = {
                int(row[0]) for row in conn.execute(self._driver.statement(sql.ACK_MANY), params)
            }
        self._conclude_acked("ack_many", held, acked, "")
        return sorted(acked)

    def ack_many_and_claim(
        self,
        leases: Iterable[Lease],
        results: Iterable[Mapping[str, Any] | None] | None = None,
        *,
        limit: int,
        lease_seconds: float | None = None,
    ) -> list[Lease]:
        """Ack many leases and claim up to ``limit`` more, in one statement and one commit.

        The leases must be of one queue and one worker; the new ones are too. Each ack is
        fenced by its own token, as in :meth:`ack_many`: if any lease was lost, the others
        are acked all the same, nothing is claimed, and :class:`LeaseLost` names the lost
        ones. Returns the new leases in claim order (none when the queue has nothing due).
        """
        check_count("limit", limit)
        held = list(leases)
        params = self._ack_many_params("ack_many_and_claim", held, results)
        if not held:
            raise ConfigurationError(
                "ack_many_and_claim needs at least one lease; claim the first with claim_many"
            )
        if len({lease.task_id for lease in held}) < len(held):
            raise ConfigurationError("ack_many_and_claim was given the same lease twice")
        if len({(lease.queue, lease.worker_id) for lease in held}) > 1:
            raise ConfigurationError(
                "ack_many_and_claim needs leases of one queue and one worker; "
                "use ack_many for a mix"
            )
        queue, worker = held[0].queue, held[0].worker_id or self.default_worker_id
        claims = self._driver.claims
        claim_params = claims.params(queue, worker, check_lease_seconds(lease_seconds))
        with self._driver.statements() as conn:
            discard_begun_attempts(conn, held)
            sent = time.monotonic()
            acked, rows = claims.ack_and_claim(conn, params, limit, claim_params, leases=len(held))
        self._conclude_acked("ack_many_and_claim", held, acked, "; nothing was claimed")
        return leases_from_rows(self._driver, rows, queue=queue, worker_id=worker, sent=sent)

    def _ack_many_params(
        self, action: str, held: list[Lease], results: Iterable[Mapping[str, Any] | None] | None
    ) -> dict[str, Any]:
        encoded = [self._driver.encode_result(r) for r in (results or [None] * len(held))]
        if len(encoded) != len(held):
            raise ConfigurationError(f"{action} needs one result per lease (or no results)")
        return {
            "task_ids": bigint_array([lease.task_id for lease in held]),
            "tokens": bigint_array([lease.token for lease in held]),
            # No results: a NULL array, which unnest() reads as a NULL for every task,
            # not an array of NULLs to write out.
            "results": None if all(r is None for r in encoded) else encoded,
            "channel": sql.notify_channel(self.schema),
        }

    @staticmethod
    def _conclude_acked(action: str, held: list[Lease], acked: set[int], then: str) -> None:
        """Mark the acked leases finished; raise LeaseLost naming any that were not."""
        for lease in held:
            if lease.task_id in acked:
                lease._mark_acked()
        lost = [lease.task_id for lease in held if lease.task_id not in acked]
        if lost:
            raise LeaseLost(
                f"{action}: tasks {lost} are no longer held by these leases (swept, claimed "
                f"again, cancelled or already concluded); the other {len(acked)} were "
                f"acked{then}"
            )

    def purge(
        self,
        older_than: float,
        *,
        statuses: Iterable[str] = ("done", "cancelled"),
        queue: str | None = None,
        batch_size: int = 1000,
        on_batch: Callable[[int], None] | None = None,
    ) -> int:
        """Delete finished tasks that finished more than ``older_than`` seconds ago.

        Deletes in batches of ``batch_size`` (one transaction each) so a large purge never
        holds many locks; returns how many tasks were deleted, and calls ``on_batch`` with
        the running total after each batch. Dead tasks are kept unless ``statuses`` names
        them: they usually need a look first.
        """
        chosen = list(statuses)
        if not chosen or not set(chosen) <= set(FINISHED):
            raise ConfigurationError(
                f"purge statuses must be among {sorted(FINISHED)}, got {chosen}"
            )
        params = {
            "statuses": chosen,
            "older_than": check_seconds("older_than", older_than, allow_zero=True),
            "queue": queue,
            "limit": check_count("batch_size", batch_size),
        }
        deleted = 0
        with self._driver.connection() as conn:
            while True:
                row = conn.execute(self._driver.statement(sql.PURGE_BATCH), params).fetchone()
                picked, count = (int(row[0]), int(row[1])) if row else (0, 0)
                deleted += count
                if on_batch is not None:
                    on_batch(deleted)
                if picked < batch_size:
                    return deleted

    def cancel(self, task_id: int) -> bool:
        """Cancel a task not yet finished; False if it had already finished.

        A worker holding it loses its lease: its ack, fail and renew raise LeaseLost. The
        running attempt records of its work are marked abandoned (one whose conclusion is
        under way is left to it, and records its own outcome).
        """
        params = {"task_id": task_id}
        with self._driver.connection() as conn, conn.transaction():
            if conn.execute(self._driver.statement(sql.CANCEL), params).fetchone():
                abandon = self._driver.statement(sql.ABANDON_RECORDS_OF_CANCELLED_TASKS)
                conn.execute(abandon, {"task_ids": [task_id]})
                return True
            if conn.execute(self._driver.statement(sql.TASK_EXISTS), params).fetchone():
                return False
        raise TaskNotFound(f"no task with id {task_id} in schema {self.schema!r}")

    def retry_dead(
        self,
        task_ids: Iterable[int] | None = None,
        *,
        queue: str | None = None,
        batch: int | None = None,
    ) -> int:
        """Enqueue dead tasks again with a fresh budget of attempts; return how many.

        ``task_ids``, ``queue`` and ``batch`` (a batch id) narrow the tasks retried; a
        ``batch`` that does not exist raises BatchNotFound.

        A dead task whose idempotency key an unfinished task holds stays dead (the key is
        unique among unfinished tasks), as do all but the newest of dead tasks sharing a
        key; each one left dead that way is logged.
        """
        params = {
            "task_ids": None
            if task_ids is None
            else [
                check_id("each of task_ids", task_id)
                for task_id in check_iterable("task_ids", task_ids, "task ids")
            ],
            "queue": None if queue is None else check_queue(queue),
            "batch_id": None if batch is None else check_id("batch", batch),
        }
        with self._driver.connection() as conn:
            for _ in range(_ENQUEUE_RETRIES):
                try:
                    with conn.transaction():
                        retried = conn.execute(
                            self._driver.statement(sql.RETRY_DEAD), params
                        ).fetchall()
                    break
                except psycopg.errors.UniqueViolation:
                    # An enqueue took one of the keys after this statement looked: look
                    # again, and that task now stays dead while the others are retried.
                    continue
            else:  # pragma: no cover - needs a new enqueue of a key at every try
                raise LeaseQueueError("retry_dead: the keys of these tasks kept changing hands")
            if batch is not None and not retried:  # a mistyped id is an error, not 0
                batch_module.require_batch(conn, self._driver, batch)
            for task_id, key in conn.execute(
                self._driver.statement(sql.DEAD_WITH_KEY_TAKEN), params
            ):
                logger.warning(
                    "retry_dead: task %s stays dead: an unfinished task of its queue holds "
                    "its idempotency key %r",
                    task_id,
                    key,
                )
        return len(retried)

    # -- attempts --------------------------------------------------------------------------

    def attempt(
        self,
        key: str | None = None,
        *,
        lease: Lease | None = None,
        worker_id: str | None = None,
        claim_next: bool = False,
        next_lease_seconds: float | None = None,
    ) -> AbstractContextManager[Attempt]:
        """Do a piece of work at most once per key, its effects and its ack in one transaction.

        ``attempt.connection`` is inside the attempt's transaction: effects written through
        it, the success mark and, with a lease, the fenced ack commit together or not at
        all. ``attempt.duplicate`` is true when the work already succeeded: skip it.

        With a lease and no key, the work is the task's: two tasks are the same work only
        when they share their queue and idempotency key, and a task without an idempotency
        key is work of its own. A ``key`` you choose names the work instead, in a space of
        its own: the same key is the same work whatever the queue or task, and no task's
        idempotency key is ever taken for it.

        With a lease, the attempt raises LeaseLost as it starts when the lease no longer
        holds its task (cancelled, or recovered, since its last renewal), unless its start
        record was made with its claim; the conclusion's fence then does.

        Example:
            .. code-block:: python

                with queue.attempt(lease=lease) as attempt:
                    if not attempt.duplicate:
                        attempt.connection.execute("INSERT INTO results ...")
                        attempt.result = {"rows": 1}

        With ``claim_next=True`` (and a lease), the round trip that concludes the attempt
        also claims the next task of the lease's queue for its worker, in the attempt's
        commit (after it, when the task has or may have a concurrency key, the queue has
        flow control, or the work runs above READ COMMITTED); a claim that fails costs the
        attempt nothing. After the block, ``attempt.claimed`` holds its lease (None when
        no task was due or the attempt did not conclude). ``next_lease_seconds`` is that
        lease's length, as ``lease_seconds`` is a claim's. A lease whose ``want_next()``
        was called concludes this way without being told.
        """
        if claim_next and lease is None:
            raise ConfigurationError("attempt(claim_next=True) needs a lease")
        if lease is not None and lease.wants_next:
            claim_next = True
            if next_lease_seconds is None:
                next_lease_seconds = lease.next_lease_seconds
        target = attempt_target(key, lease)
        if lease is not None:
            lease.raise_if_lost()
        worker = (
            check_worker_id(worker_id)
            or (lease.worker_id if lease else None)
            or self.default_worker_id
        )
        return run_attempt(
            self._driver,
            target=target,
            lease=lease,
            worker_id=worker,
            idle_timeout=max(lease.lease_seconds if lease else self.settings.lease_seconds, 2),
            claim_next=claim_next,
            next_lease_seconds=check_lease_seconds(next_lease_seconds),
        )

    def attempts(
        self, key: str | None = None, *, queue: str | None = None, task_id: int | None = None
    ) -> list[AttemptRecord]:
        """Every recorded attempt at one piece of work, oldest first.

        ``attempts(key)``: the attempts made with a key you chose. ``attempts(key,
        queue=...)``: the attempts at the tasks of that queue with that idempotency key.
        ``attempts(task_id=...)``: the attempts at that task's work (its queue and
        idempotency key, or the task itself when it has none).
        """
        with self._driver.connection() as conn:
            if task_id is not None:
                if key is not None or queue is not None:
                    raise ConfigurationError("give attempts() a task_id, or a key, not both")
                row = conn.execute(
                    self._driver.statement(sql.TASK_ATTEMPT_KEY), {"task_id": task_id}
                ).fetchone()
                # A purged task is looked up as a task without idempotency key: by its id.
                queue, key = (row[0], row[1]) if row else (None, None)
                target = AttemptTarget(queue=queue, key=key, task_id=task_id)
            elif key is None:
                raise ConfigurationError("attempts() needs a key or a task_id")
            else:
                target = AttemptTarget(queue=queue, key=check_key(key), task_id=None)
            cursor = conn.cursor(row_factory=class_row(AttemptRecord))
            return cursor.execute(
                self._driver.statement(sql.ATTEMPTS_FOR_IDENTITY),
                {"identity": target.identity, "legacy_identity": target.legacy_identity},
            ).fetchall()

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """Lend a pooled autocommit connection for your own SQL (tables beside the queue, say).

        Errors of your statements pass through as psycopg raised them. Before the
        connection goes back to the pool, an open transaction is rolled back and what you
        changed is undone: settings (``SET``), the role, session advisory locks, LISTENs,
        cursors ``WITH HOLD``, temporary tables and the statements you ``PREPARE``d in the
        session; and on the client, psycopg's attributes (``autocommit``, ``row_factory``,
        ``read_only``, ``isolation_level``, ``prepare_threshold``, ...), its adapters and
        the notice and notification handlers you added.
        """
        with self._driver.lent_connection() as cached:
            try:
                yield cached.conn
            finally:
                reset_session(cached.conn, self._driver.statement(sql.RESET_SESSION))

    def _max_attempts(self, value: int | None) -> int:
        if value is None:
            return self.settings.max_attempts
        return check_count("max_attempts", value, maximum=MAX_ATTEMPTS)
