"""The worker: claim tasks, run a handler on each, and stop without harming any task.

:func:`run_worker` is what ``leasequeue worker`` runs, and what a Python program or a
Dagster op can call::

    from dagster_leasequeue import LeaseQueue, run_worker

    def summarise(payload):
        return {"pages": len(payload["text"]) // 3000}

    with LeaseQueue() as queue:
        run_worker(queue, summarise, queue_name="documents", burst=True)

Stopping: on SIGTERM or SIGINT the worker stops claiming and lets the current task finish.
A second signal while the handler runs interrupts it, and the task is released (given back
without using up one of its attempts), as is a task whose claim was on its way when the
first signal came. A deploy therefore never kills a task on its last attempt.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any, TypeAlias

from .errors import (
    ConfigurationError,
    DatabaseUnavailable,
    LeaseLost,
    LeaseQueueError,
    PayloadError,
)
from .lease import Lease
from .queue import LeaseQueue
from .validation import MAX_LEASE_SECONDS, check_count, check_seconds

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Handler:
    """A task function, and whether it also takes the lease.

    The function takes the payload, and the :class:`Lease` too when it accepts a second
    positional argument; it returns a dict (stored as the task's result) or None.
    """

    function: Callable[..., Any]
    takes_lease: bool
    name: str

    @classmethod
    def wrap(cls, function: Callable[..., Any]) -> Handler:
        if isinstance(function, Handler):
            return function
        if not callable(function):
            raise ConfigurationError(f"a handler must be callable, got {function!r}")
        name = getattr(function, "__qualname__", None) or repr(function)
        return cls(function, _takes_lease(function), name)

    def __call__(self, lease: Lease) -> dict[str, Any] | None:
        result = (
            self.function(lease.payload, lease)
            if self.takes_lease
            else self.function(lease.payload)
        )
        if result is None:
            return None
        if not isinstance(result, Mapping):
            raise PayloadError(
                f"the handler {self.name} returned {type(result).__name__}; "
                "it must return a dict (the task's result) or None"
            )
        return dict(result)


def _takes_lease(function: Callable[..., Any]) -> bool:
    """True when ``function`` accepts a second positional argument (the lease)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature
        return False
    positional = [
        p
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    variadic = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)
    return len(positional) >= 2 or variadic


def load_handler(spec: str) -> Handler:
    """Import a handler named ``"package.module:function"``; ConfigurationError if it fails."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"expected package.module:function, got {spec!r}")
    # A console script puts its own directory first on sys.path, not the working directory
    # as `python -m` does; add it so a handler module beside the user is found either way.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r}: {exc}") from None
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigurationError(f"{module_name!r} has no attribute {attribute!r}")
    if not callable(target):
        raise ConfigurationError(f"{spec} is not callable")
    return Handler(target, _takes_lease(target), spec)


@dataclass
class WorkerSummary:
    """What became of the tasks a worker claimed: a count per outcome."""

    outcomes: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.outcomes.values())

    def add(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def __str__(self) -> str:
        details = ", ".join(f"{count} {name}" for name, count in sorted(self.outcomes.items()))
        return f"{self.total} task(s)" + (f" ({details})" if details else "")


# Where the worker logs: a logger, or an adapter such as a Dagster op's ``context.log``.
Log: TypeAlias = "logging.Logger | logging.LoggerAdapter[Any]"

# While the database is unreachable the wait between tries doubles up to this.
MAX_OUTAGE_WAIT = 30.0


def run_worker(
    queue: LeaseQueue,
    handler: Callable[..., Any],
    *,
    queue_name: str = "default",
    lease_seconds: float | None = None,
    poll_interval: float = 1.0,
    max_tasks: int | None = None,
    burst: bool = False,
    worker_id: str | None = None,
    logger: Log | None = None,
) -> WorkerSummary:
    """Claim tasks of ``queue_name`` and run ``handler`` on each until stopped.

    Each task runs inside ``with lease:``: the lease is renewed in the background, the task
    is acked with the handler's result, or failed when the handler raises (retried after a
    backoff, or dead when out of attempts). The worker stops on SIGTERM or SIGINT (see the
    module's docstring; signals are handled only when called from the main thread), after
    ``max_tasks`` tasks, or with ``burst`` once no task is due.

    The worker outlives the database going away (a restart, a failover, a cut network): it
    logs it, waits ``poll_interval`` doubled on each failed try up to 30 s, and goes on
    claiming once it is back. A task whose work the outage broke is given back as failed
    as soon as the database answers, to be retried at once; a lease that ran out in the
    meantime is left to the sweeper. ``logger`` receives the worker's messages (in a Dagster
    op, pass ``context.log``); by default they go to the ``dagster_leasequeue.worker`` logger.
    """
    work = Handler.wrap(handler)
    if lease_seconds is not None:
        check_seconds("lease_seconds", lease_seconds, maximum=MAX_LEASE_SECONDS)
    check_seconds("poll_interval", poll_interval)
    if max_tasks is not None:
        check_count("max_tasks", max_tasks)
    log = logger if logger is not None else _logger
    with _Shutdown(log) as shutdown:
        summary = WorkerSummary()
        outage = _Outage(log, poll_interval)
        unfinished: _Unfinished | None = None
        waiting = False
        # The next task, claimed by the statement that acked the last one.
        claimed: Lease | None = None

        def wants_next() -> bool:
            more = max_tasks is None or summary.total + 1 < max_tasks
            return more and not shutdown.requested.is_set()

        while not shutdown.requested.is_set() or claimed is not None:
            if max_tasks is not None and summary.total >= max_tasks:
                break
            try:
                if unfinished is not None:
                    unfinished = unfinished.give_back()
                lease, claimed = claimed, None
                if lease is None:
                    lease = queue.claim(
                        queue=queue_name, worker_id=worker_id, lease_seconds=lease_seconds
                    )
            except DatabaseUnavailable as exc:
                shutdown.wait(outage.failed(exc))
                continue
            outage.ended()
            if lease is None:
                if burst:
                    log.info("no task is due: stopping (burst)")
                    break
                if not waiting:
                    log.info("waiting for tasks")
                waiting = True
                shutdown.wait(poll_interval)
                continue
            waiting = False
            if shutdown.requested.is_set():
                # The stop came while this claim was on its way: hand the task straight
                # back, without using up one of its attempts.
                summary.add(_release(lease, log))
                break
            outcome, claimed = _process(lease, work, shutdown, log, wants_next, lease_seconds)
            summary.add(outcome)
            if outcome == "unreachable" and not lease.finished:
                unfinished = _Unfinished(lease, log)
    return summary


def _process(
    lease: Lease,
    handler: Handler,
    shutdown: _Shutdown,
    log: Log,
    wants_next: Callable[[], bool],
    lease_seconds: float | None,
) -> tuple[str, Lease | None]:
    """Run the handler on one claimed task inside ``with lease:``; return the outcome,
    and the next task when the worker wants one and the ack could claim it.

    The next task is returned whatever the outcome: a handler whose attempt concluded the
    task (and claimed the next) may raise afterwards, and the task claimed for this worker
    must not be left to run out its lease (and one of its attempts) unworked.
    """
    log.info("task %s started (attempt %s of %s)", lease.task_id, lease.attempt, lease.max_attempts)
    started = time.monotonic()
    if wants_next():
        # The ack (or the handler's attempt) claims the next task in the same round trip.
        lease.want_next(lease_seconds=lease_seconds)
    try:
        # `with lease` renews in the background and fails the task if the block raises.
        with lease:
            result = shutdown.run_handler(handler, lease)
            if not lease.finished:  # the handler may have concluded it (an attempt acks)
                lease.want_next(wants_next(), lease_seconds=lease_seconds)
                lease.ack(result)
    except _Aborted:
        log.warning("task %s released for another worker", lease.task_id)
        return "released", lease.next_lease
    except LeaseLost as exc:
        log.warning("task %s: %s", lease.task_id, exc)
        return "lost", lease.next_lease
    except DatabaseUnavailable as exc:
        log.warning("task %s interrupted: %s", lease.task_id, exc)
        return "unreachable", lease.next_lease
    except Exception as exc:
        ending = "now dead" if lease.attempt >= lease.max_attempts else "will be retried"
        log.error(
            "task %s failed (attempt %s of %s, %s): %s: %s",
            lease.task_id,
            lease.attempt,
            lease.max_attempts,
            ending,
            type(exc).__name__,
            exc,
            exc_info=not isinstance(exc, LeaseQueueError),
        )
        return "failed", lease.next_lease
    log.info("task %s done in %.2f s", lease.task_id, time.monotonic() - started)
    return "done", lease.next_lease


def _release(lease: Lease, log: Log) -> str:
    try:
        lease.release()
    except LeaseQueueError as exc:
        # Not released: the sweeper recovers it once its lease ends.
        log.warning("task %s could not be released: %s", lease.task_id, exc)
        return "lost"
    log.info("task %s released for another worker: the worker is stopping", lease.task_id)
    return "released"


class _Outage:
    """The waits between tries while the database is unreachable, and their log lines."""

    def __init__(self, log: Log, poll_interval: float) -> None:
        self._log = log
        self._first_wait = poll_interval
        self._wait = poll_interval
        self._since: float | None = None

    def failed(self, exc: DatabaseUnavailable) -> float:
        """Note a failed try; return how long to wait before the next one."""
        if self._since is None:
            self._since = time.monotonic()
        wait = self._wait
        self._log.warning("cannot claim: %s (trying again in %.3g s)", exc, wait)
        self._wait = min(max(self._first_wait, MAX_OUTAGE_WAIT), wait * 2)
        return wait

    def ended(self) -> None:
        if self._since is not None:
            self._log.info(
                "the database answers again after %.1f s", time.monotonic() - self._since
            )
        self._since = None
        self._wait = self._first_wait


class _Unfinished:
    """A task whose work an outage broke, to give back once the database answers.

    The outage is not the task's fault, but the queue cannot tell it from a crash the task
    caused, so, like a lapsed lease, it counts as one of the task's attempts. Giving it
    back at once (fenced, so only while this worker still holds it) spares the wait for the
    lease to run out and for a sweeper.
    """

    def __init__(self, lease: Lease, log: Log) -> None:
        self._lease = lease
        self._log = log

    def give_back(self) -> _Unfinished | None:
        """Try once: None once done; DatabaseUnavailable while the database is still away."""
        try:
            status = self._lease.fail(
                "DatabaseUnavailable: the database was unreachable during the work", retry_in=0
            )
        except LeaseLost:
            self._log.info("task %s was recovered by a sweeper meanwhile", self._lease.task_id)
            return None
        self._log.info("task %s given back after the outage: %s", self._lease.task_id, status)
        return None


class _Aborted(KeyboardInterrupt):
    """Raised inside the handler by a second signal.

    A KeyboardInterrupt, so a handler's ``except Exception`` lets it by, psycopg cancels a
    query the handler is waiting on, an attempt rolls back without failing the task, and
    ``with lease`` releases the task rather than failing it.
    """


class _Shutdown:
    """Graceful stop on SIGTERM and SIGINT (see the module's docstring).

    Signal handlers can only be installed from the main thread; elsewhere the worker runs
    until its other limits stop it.
    """

    def __init__(self, log: Log) -> None:
        self._log = log
        self.requested = threading.Event()
        self.aborted = False
        self._signals = 0
        self._in_handler = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Shutdown:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)

    def wait(self, seconds: float) -> None:
        """Sleep between polls, waking at once when a stop is requested."""
        self.requested.wait(seconds)

    def run_handler(self, handler: Handler, lease: Lease) -> dict[str, Any] | None:
        """Run the handler where a second signal can interrupt it (and only there)."""
        self._in_handler = True
        try:
            return handler(lease)
        finally:
            self._in_handler = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals += 1
        self.requested.set()
        name = signal.Signals(signum).name
        if self._signals == 1:
            self._log.warning(
                "%s received: stopping once the current task, if any, is finished "
                "(send it again to release a running task at once)",
                name,
            )
        elif self._in_handler and not self.aborted:
            self._log.warning("%s received again: releasing the current task", name)
            self._in_handler = False
            self.aborted = True
            raise _Aborted
        # Otherwise the worker is between tasks and already stopping.
