"""The ``leasequeue`` command line: install, enqueue, inspect, steer, purge and run workers.

It is a thin layer over the public API of :class:`LeaseQueue` and :class:`Lease`, configured
by the same ``LEASEQUEUE_*`` settings, and it never imports Dagster. Every
:class:`LeaseQueueError` becomes a one-line message on stderr and exit code 1; bad usage
exits with 2 (click's convention).
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

import click

from dagster_leasequeue import (
    DatabaseUnavailable,
    Lease,
    LeaseLost,
    LeaseQueue,
    LeaseQueueError,
    LeaseQueueSettings,
    PayloadError,
    QueueStats,
    SchemaNotInstalled,
    TaskInfo,
    __version__,
)
from dagster_leasequeue.embedded import server_status, start_server, stop_server
from dagster_leasequeue.limits import MAX_LEASE_SECONDS
from dagster_leasequeue.models import FINISHED, STATUSES
from dagster_leasequeue.payloads import encode_object

logger = logging.getLogger("dagster_leasequeue.cli")

# enqueue --file sends this many payloads per enqueue_many statement.
ENQUEUE_CHUNK = 1000
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?[smhd])+|\d+(?:\.\d+)?")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


# -- configuration and errors --------------------------------------------------------------


@dataclass
class _Config:
    """The global options, and the queue opened for this invocation (on first use)."""

    dsn: str | None
    schema: str | None
    data_dir: Path | None = None
    queue: LeaseQueue | None = None


class _Group(click.Group):
    """A click group that turns every LeaseQueueError into a one-line error and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except LeaseQueueError as exc:
            message = _one_line(str(exc))
            if isinstance(exc, SchemaNotInstalled):
                message += " (from the command line: leasequeue install)"
            raise click.ClickException(message) from None


def _one_line(text: str) -> str:
    # Driver messages can span lines (DETAIL, HINT); a shell user wants one line per error.
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _open_queue(ctx: click.Context) -> LeaseQueue:
    """The queue named by the global options and settings, opened once per invocation."""
    config = ctx.find_object(_Config)
    assert config is not None, "the root command sets the configuration"
    if config.queue is None:
        queue = LeaseQueue(config.dsn, schema=config.schema, settings=LeaseQueueSettings())
        config.queue = ctx.find_root().with_resource(queue)
    return config.queue


# -- durations, JSON and tables ------------------------------------------------------------


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``30s``, ``15m``, ``12h``, ``7d`` or ``1h30m``.

    A bare number counts seconds.
    """
    compact = text.strip().lower().replace(" ", "")
    if not _DURATION.fullmatch(compact):
        raise ValueError(
            f"{text!r} is not a duration: use a number and a unit (s, m, h or d), "
            "for example 30s, 15m, 12h, 7d or 1h30m"
        )
    if compact[-1].isdigit():
        return float(compact)
    return sum(float(number) * _UNITS[unit] for number, unit in _DURATION_PART.findall(compact))


if TYPE_CHECKING:
    _DurationBase = click.ParamType[float]
else:  # click before 8.2 has no generic ParamType
    _DurationBase = click.ParamType


class _Duration(_DurationBase):
    """A click parameter type for :func:`parse_duration`."""

    name = "duration"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = _Duration()


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=_json_default, ensure_ascii=False))


def _parse_object(text: str, what: str) -> dict[str, Any]:
    """Parse a JSON object, or stop with a one-line error before anything is written."""

    def refuse_constant(name: str) -> Any:
        # json accepts NaN and Infinity, which are not JSON and which jsonb refuses.
        raise ValueError(f"{name} is not a JSON value")

    try:
        value = json.loads(text, parse_constant=refuse_constant)
    except ValueError as exc:
        raise click.ClickException(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise click.ClickException(
            f"{what} must be a JSON object, got {type(value).__name__}: "
            'wrap it, for example {"value": ...}'
        )
    return value


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], numeric: set[int]) -> str:
    """A plain text table; the columns in ``numeric`` are right-aligned."""
    body = [list(row) for row in rows]
    widths = [
        max([len(header), *(len(row[i]) for row in body)]) for i, header in enumerate(headers)
    ]

    def line(cells: Sequence[str]) -> str:
        padded = (
            cell.rjust(width) if i in numeric else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        )
        return "  ".join(padded).rstrip()

    return "\n".join([line(headers), *(line(row) for row in body)])


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(sep=" ", timespec="seconds")


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


# -- the root command ----------------------------------------------------------------------


@click.group(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "--dsn",
    metavar="DSN",
    help="PostgreSQL connection string; overrides LEASEQUEUE_DSN. Prefer the variable: "
    "other users of the machine can read a command line.",
)
@click.option(
    "--schema",
    metavar="NAME",
    help="Schema of the queue's tables; overrides LEASEQUEUE_SCHEMA_NAME.",
)
@click.version_option(__version__, prog_name="leasequeue")
@click.pass_context
def main(ctx: click.Context, dsn: str | None, schema: str | None) -> None:
    """Operate a dagster-leasequeue task queue in PostgreSQL.

    Settings come from the LEASEQUEUE_* environment variables and a .env file, as for
    LeaseQueueSettings; with no DSN anywhere, the embedded server under LEASEQUEUE_DATA_DIR
    is used.
    """
    ctx.obj = _Config(dsn=dsn, schema=schema)


@main.command()
@click.pass_context
def install(ctx: click.Context) -> None:
    """Create or migrate the schema; print its version.

    Creates the queue's tables, or migrates them to this release. Idempotent, and safe
    to run from several machines at once.
    """
    queue = _open_queue(ctx)
    applied = queue.install()
    click.echo(
        f"schema {queue.schema!r} on {queue.location} is at version "
        f"{queue.installed_version()} ({applied} migration(s) applied)"
    )


# -- enqueue -------------------------------------------------------------------------------


@main.command()
@click.argument("payload", required=False)
@click.option(
    "--file",
    "file_",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Enqueue one task per line of this JSON-lines file (blank lines are skipped).",
)
@click.option("--queue", "queue_name", default="default", show_default=True, help="Queue name.")
@click.option("--priority", type=int, default=0, show_default=True, help="Higher runs first.")
@click.option("--delay", type=DURATION, help="Hold the task back this long (30s, 15m, 2h).")
@click.option("--idempotency-key", help="Enqueue nothing if an unfinished task has this key.")
@click.option(
    "--max-attempts", type=click.IntRange(1, 10_000), help="Claims before the task is dead."
)
@click.pass_context
def enqueue(
    ctx: click.Context,
    payload: str | None,
    file_: Path | None,
    queue_name: str,
    priority: int,
    delay: float | None,
    idempotency_key: str | None,
    max_attempts: int | None,
) -> None:
    """Add a task, or many from a file.

    The payload is the JSON object PAYLOAD ("-": read it from stdin); prints the task's
    id. With --file, adds one task per line in chunks of 1000 (every line is checked
    before anything is written) and prints how many were added.

    \b
    Examples:
      leasequeue enqueue '{"document": "invoice-17.pdf"}' --priority 5
      echo '{"n": 1}' | leasequeue enqueue - --queue thumbnails
      leasequeue enqueue --file tasks.jsonl --queue bulk
    """
    if file_ is not None:
        if payload is not None:
            raise click.UsageError("give a PAYLOAD or --file, not both")
        if delay is not None or idempotency_key is not None:
            raise click.UsageError("--delay and --idempotency-key apply to a single PAYLOAD")
        _enqueue_file(
            ctx, file_, queue_name=queue_name, priority=priority, max_attempts=max_attempts
        )
        return
    if payload is None:
        raise click.UsageError("missing PAYLOAD: a JSON object, or - to read it from stdin")
    text = sys.stdin.read() if payload == "-" else payload
    parsed = _parse_object(text, "the payload")
    task_id = _open_queue(ctx).enqueue(
        parsed,
        queue=queue_name,
        priority=priority,
        delay=delay,
        idempotency_key=idempotency_key,
        max_attempts=max_attempts,
    )
    click.echo(task_id)


def _file_payloads(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, payload) for every non-blank line of a JSON-lines file."""
    with path.open(encoding="utf-8") as lines:
        try:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    yield number, _parse_object(line, f"line {number} of {path}")
        except UnicodeDecodeError as exc:
            raise click.ClickException(f"{path} is not UTF-8 text: {exc}") from None


def _check_file(path: Path, max_bytes: int) -> int:
    """Check every line before the first write; return how many payloads the file holds.

    Chunks are separate statements, so a bad line found mid-way would leave the chunks
    before it stored; the queue's own encoder does the checking.
    """
    count = 0
    for number, payload in _file_payloads(path):
        try:
            encode_object(payload, what=f"line {number} of {path}", max_bytes=max_bytes)
        except PayloadError as exc:
            raise click.ClickException(str(exc)) from None
        count += 1
    return count


def _chunks(items: Iterable[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _enqueue_file(
    ctx: click.Context, path: Path, *, queue_name: str, priority: int, max_attempts: int | None
) -> None:
    queue = _open_queue(ctx)
    total = _check_file(path, queue.settings.payload_max_bytes)
    ids: list[int] = []
    payloads = (payload for _, payload in _file_payloads(path))
    with click.progressbar(length=total, label=f"enqueueing {path.name}", file=sys.stderr) as bar:
        for chunk in _chunks(payloads, ENQUEUE_CHUNK):
            try:
                ids += queue.enqueue_many(
                    chunk, queue=queue_name, priority=priority, max_attempts=max_attempts
                )
            except LeaseQueueError as exc:
                raise click.ClickException(
                    f"{_one_line(str(exc))} (in the chunk after the first {len(ids)} payloads, "
                    f"which were enqueued; that chunk and the rest were not)"
                ) from None
            bar.update(len(chunk))
    span = f" (ids {min(ids)} to {max(ids)})" if ids else ""
    click.echo(f"enqueued {len(ids)} task(s) in queue {queue_name!r}{span}")


# -- inspection ----------------------------------------------------------------------------


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    """Task counts per queue and status.

    Also shows how long each queue's oldest waiting task has waited.
    """
    per_queue = _open_queue(ctx).stats_by_queue()
    if as_json:
        _echo_json({name: _stats_dict(queue_stats) for name, queue_stats in per_queue.items()})
    elif not per_queue:
        click.echo("no tasks")
    else:
        click.echo(_stats_table(per_queue))


def _stats_dict(queue_stats: QueueStats) -> dict[str, Any]:
    return {
        "counts": queue_stats.counts,
        "total": queue_stats.total,
        "oldest_enqueued_seconds": queue_stats.oldest_enqueued_seconds,
    }


def _stats_table(per_queue: Mapping[str, QueueStats]) -> str:
    headers = ["QUEUE", *(status.upper() for status in STATUSES), "TOTAL", "OLDEST WAITING"]
    rows = [
        [
            name,
            *(str(queue_stats.counts.get(status, 0)) for status in STATUSES),
            str(queue_stats.total),
            _age(queue_stats.oldest_enqueued_seconds),
        ]
        for name, queue_stats in per_queue.items()
    ]
    return _table(headers, rows, numeric=set(range(1, len(headers))))


@main.command("list")
@click.option("--status", type=click.Choice(STATUSES), help="Only tasks in this status.")
@click.option("--queue", "queue_name", help="Only tasks of this queue.")
@click.option(
    "--after-id", type=click.IntRange(min=0), default=0, help="Start after this id (paging)."
)
@click.option(
    "--limit", type=click.IntRange(1, 100_000), default=100, show_default=True, help="Most rows."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (every field) instead.")
@click.pass_context
def list_command(
    ctx: click.Context,
    status: str | None,
    queue_name: str | None,
    after_id: int,
    limit: int,
    as_json: bool,
) -> None:
    """List tasks, filtered by status and queue.

    Tasks come in id order. When the page is full, the id to pass to --after-id for the
    next page is printed on stderr.
    """
    tasks = _open_queue(ctx).list_tasks(
        status=status, queue=queue_name, after_id=after_id, limit=limit
    )
    if as_json:
        _echo_json([asdict(task) for task in tasks])
    elif not tasks:
        click.echo("no tasks")
    else:
        click.echo(_tasks_table(tasks))
    if len(tasks) == limit:
        click.echo(f"more tasks may follow: --after-id {tasks[-1].task_id}", err=True)


def _tasks_table(tasks: Sequence[TaskInfo]) -> str:
    headers = ["ID", "QUEUE", "STATUS", "PRIORITY", "ATTEMPTS", "CREATED", "PAYLOAD"]
    rows = [
        [
            str(task.task_id),
            task.queue,
            task.status,
            str(task.priority),
            f"{task.attempts}/{task.max_attempts}",
            _when(task.created_at),
            _shorten(json.dumps(task.payload, ensure_ascii=False), 60),
        ]
        for task in tasks
    ]
    return _table(headers, rows, numeric={0, 3})


@main.command()
@click.argument("task_id", type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead.")
@click.pass_context
def show(ctx: click.Context, task_id: int, as_json: bool) -> None:
    """Show every field of the task TASK_ID."""
    task = _open_queue(ctx).get(task_id)
    if as_json:
        _echo_json(asdict(task))
    else:
        click.echo(_describe_task(task))


def _describe_task(task: TaskInfo) -> str:
    fields = [
        ("id", str(task.task_id)),
        ("queue", task.queue),
        ("status", task.status),
        ("priority", str(task.priority)),
        ("attempts", f"{task.attempts} of {task.max_attempts}"),
        ("idempotency key", task.idempotency_key or "-"),
        ("worker", task.worker_id or "-"),
        ("run at", _when(task.run_at)),
        ("lease expires at", _when(task.lease_expires_at)),
        ("created at", _when(task.created_at)),
        ("updated at", _when(task.updated_at)),
        ("finished at", _when(task.finished_at)),
        ("last error", task.last_error or "-"),
    ]
    lines = [f"{name + ':':<18}{value}" for name, value in fields]
    for name, document in (("payload", task.payload), ("result", task.result)):
        text = "-" if document is None else json.dumps(document, indent=2, ensure_ascii=False)
        lines.append(f"{name}:")
        lines.extend(f"  {line}" for line in text.splitlines())
    return "\n".join(lines)


# -- steering ------------------------------------------------------------------------------


@main.command("retry-dead")
@click.argument("task_ids", nargs=-1, type=click.IntRange(min=1))
@click.option("--queue", "queue_name", help="Only dead tasks of this queue.")
@click.pass_context
def retry_dead(ctx: click.Context, task_ids: tuple[int, ...], queue_name: str | None) -> None:
    """Enqueue dead tasks again; print how many.

    Each gets a fresh budget of attempts. With TASK_IDS, only those; with --queue, only
    that queue's; with neither, every dead task. A dead task whose idempotency key an
    unfinished task has taken stays dead.
    """
    count = _open_queue(ctx).retry_dead(list(task_ids) if task_ids else None, queue=queue_name)
    click.echo(f"enqueued {count} dead task(s) again")


@main.command()
@click.argument("task_id", type=click.IntRange(min=1))
@click.pass_context
def cancel(ctx: click.Context, task_id: int) -> None:
    """Cancel a task that has not finished.

    A worker holding the task TASK_ID loses its lease. Exits with 1 when the task had
    already finished.
    """
    queue = _open_queue(ctx)
    if queue.cancel(task_id):
        click.echo(f"cancelled task {task_id}")
        return
    status = queue.get(task_id).status
    raise click.ClickException(f"task {task_id} had already finished ({status}); nothing changed")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the recovered tasks as JSON.")
@click.pass_context
def sweep(ctx: click.Context, as_json: bool) -> None:
    """Recover tasks whose lease expired.

    Their worker died or stalled. Each such task, in every queue, is enqueued again, or
    marked dead when it used all its attempts; each recovery is printed (and written to the
    recovery-event log). Safe to run alongside other sweepers.
    """
    recovered = _open_queue(ctx).sweep()
    if as_json:
        _echo_json([asdict(task) for task in recovered])
        return
    for task in recovered:
        click.echo(
            f"task {task.task_id} in queue {task.queue!r}: {task.action} "
            f"(attempt {task.attempt}, worker {task.worker_id or '-'}, "
            f"lease expired at {_when(task.lease_expires_at)})"
        )
    click.echo(f"recovered {len(recovered)} task(s)")


@main.command()
@click.option(
    "--older-than",
    type=DURATION,
    required=True,
    help="Only tasks finished longer ago than this (30s, 15m, 12h, 7d).",
)
@click.option(
    "--status",
    "statuses",
    type=click.Choice(FINISHED),
    multiple=True,
    default=("done", "cancelled"),
    show_default=True,
    help="Statuses to delete; repeat the option for several.",
)
@click.option("--queue", "queue_name", help="Only tasks of this queue.")
@click.option(
    "--batch-size",
    type=click.IntRange(1, 100_000),
    default=1000,
    show_default=True,
    help="Tasks deleted per transaction.",
)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Show a running count on stderr. Default: when stderr is a terminal.",
)
@click.pass_context
def purge(
    ctx: click.Context,
    older_than: float,
    statuses: tuple[str, ...],
    queue_name: str | None,
    batch_size: int,
    progress: bool | None,
) -> None:
    """Delete old finished tasks; print how many.

    Deletes the tasks that finished longer ago than --older-than, in batches (one
    transaction each), so a large purge never holds many locks and an interrupted one keeps
    what it deleted. Dead tasks are kept unless --status dead is given: they usually need a
    look first.

    \b
    Example:
      leasequeue purge --older-than 7d --status done --status dead
    """
    queue = _open_queue(ctx)
    show = progress if progress is not None else _is_terminal(sys.stderr)
    deleted = queue.purge(
        older_than,
        statuses=statuses,
        queue=queue_name,
        batch_size=batch_size,
        on_batch=_show_purged if show else None,
    )
    if show:
        click.echo(err=True)
    click.echo(f"deleted {deleted} task(s)")


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _show_purged(deleted: int) -> None:
    click.echo(f"\rpurging: {deleted} deleted so far", err=True, nl=False)


# -- worker --------------------------------------------------------------------------------


class _Aborted(KeyboardInterrupt):
    """Raised inside the handler by a second signal.

    A KeyboardInterrupt, so a handler's ``except Exception`` lets it by and psycopg cancels
    a query the handler is waiting on.
    """


@dataclass(frozen=True)
class _Handler:
    """The user's task function, and whether it also takes the lease."""

    function: Callable[..., Any]
    takes_lease: bool
    name: str

    def __call__(self, lease: Lease) -> dict[str, Any] | None:
        result = (
            self.function(lease.payload, lease)
            if self.takes_lease
            else self.function(lease.payload)
        )
        if result is None:
            return None
        if not isinstance(result, Mapping):
            raise TypeError(
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


def _load_handler(ctx: click.Context, param: click.Parameter, spec: str) -> _Handler:
    """Import "package.module:function" (a click callback: a bad one is a usage error)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise click.BadParameter("expected package.module:function", ctx, param)
    # A console script puts its own directory first on sys.path, not the working directory
    # as `python -m` does; add it so a handler module beside the user is found either way.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise click.BadParameter(f"cannot import {module_name!r}: {exc}", ctx, param) from None
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise click.BadParameter(f"{module_name!r} has no attribute {attribute!r}", ctx, param)
    if not callable(target):
        raise click.BadParameter(f"{spec} is not callable", ctx, param)
    return _Handler(target, _takes_lease(target), spec)


class _Shutdown:
    """Graceful stop on SIGTERM and SIGINT.

    The first signal stops claiming and lets the current task finish; a second one, while
    the handler runs, raises :class:`_Aborted` in it so the task is released at once.
    """

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.aborted = False
        self._signals = 0
        self._in_handler = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Shutdown:
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

    def run_handler(self, handler: _Handler, lease: Lease) -> dict[str, Any] | None:
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
            logger.warning(
                "%s received: stopping once the current task, if any, is finished "
                "(send it again to release a running task at once)",
                name,
            )
        elif self._in_handler and not self.aborted:
            logger.warning("%s received again: releasing the current task", name)
            self._in_handler = False
            self.aborted = True
            raise _Aborted
        # Otherwise the worker is between tasks and already stopping.


@dataclass
class _Tally:
    """What became of the tasks this worker claimed."""

    outcomes: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.outcomes.values())

    def add(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def __str__(self) -> str:
        details = ", ".join(f"{count} {name}" for name, count in sorted(self.outcomes.items()))
        return f"{self.total} task(s)" + (f" ({details})" if details else "")


@dataclass(frozen=True)
class _WorkerOptions:
    queue: str
    worker_id: str | None
    lease_seconds: float | None
    poll_interval: float
    max_tasks: int | None
    burst: bool


@main.command()
@click.argument("handler", metavar="HANDLER", callback=_load_handler)
@click.option("--queue", "queue_name", default="default", show_default=True, help="Queue name.")
@click.option(
    "--lease-seconds",
    type=click.FloatRange(min=0, min_open=True, max=MAX_LEASE_SECONDS),
    help="Lease of each claim (default: the task's, else LEASEQUEUE_LEASE_SECONDS).",
)
@click.option(
    "--poll-interval",
    type=click.FloatRange(min=0.01),
    default=1.0,
    show_default=True,
    help="Seconds to wait when no task is due.",
)
@click.option("--max-tasks", type=click.IntRange(min=1), help="Stop after this many tasks.")
@click.option("--burst", is_flag=True, help="Stop when no task is due instead of waiting.")
@click.option("--worker-id", help="Recorded on claimed tasks (default: host:pid).")
@click.pass_context
def worker(
    ctx: click.Context,
    handler: _Handler,
    queue_name: str,
    lease_seconds: float | None,
    poll_interval: float,
    max_tasks: int | None,
    burst: bool,
    worker_id: str | None,
) -> None:
    """Run a worker: claim tasks and run HANDLER on each.

    HANDLER is "package.module:function". The function takes the payload dict, and the
    Lease too if it accepts two arguments; it returns a dict (stored as the task's result)
    or None. While it runs the lease is renewed in the background; when it returns the task
    is acked, and when it raises the task is failed (retried after a backoff, or dead when
    out of attempts).

    SIGTERM or Ctrl-C stops claiming and lets the current task finish; a second signal
    releases the current task at once (for another worker to claim). Exits with 0.

    \b
    Example:
      leasequeue worker myapp.tasks:summarise --queue documents --burst
    """
    options = _WorkerOptions(queue_name, worker_id, lease_seconds, poll_interval, max_tasks, burst)
    queue = _open_queue(ctx)
    with _worker_logging(), _Shutdown() as shutdown:
        logger.info(
            "worker %s on queue %r (schema %r at %s) runs %s",
            worker_id or queue.default_worker_id,
            queue_name,
            queue.schema,
            queue.location,
            handler.name,
        )
        tally = _work(queue, handler, options, shutdown)
        logger.info("worker stopped after %s", tally)


@contextmanager
def _worker_logging() -> Iterator[None]:
    """Log the worker's and the package's messages (renewal warnings) to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    package_logger = logging.getLogger("dagster_leasequeue")
    level = package_logger.level
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        # Removed again: an in-process caller (a test, say) keeps its logging as it was.
        package_logger.removeHandler(handler)
        package_logger.setLevel(level)


def _work(
    queue: LeaseQueue, handler: _Handler, options: _WorkerOptions, shutdown: _Shutdown
) -> _Tally:
    """Claim and process tasks until stopped, out of tasks (--burst) or at --max-tasks."""
    tally = _Tally()
    waiting = False
    while not shutdown.requested.is_set():
        if options.max_tasks is not None and tally.total >= options.max_tasks:
            break
        try:
            lease = queue.claim(
                queue=options.queue,
                worker_id=options.worker_id,
                lease_seconds=options.lease_seconds,
            )
        except DatabaseUnavailable as exc:
            # The database may be restarting: keep polling rather than exit.
            logger.warning("cannot claim: %s", exc)
            shutdown.wait(options.poll_interval)
            continue
        if lease is None:
            if options.burst:
                logger.info("no task is due: stopping (--burst)")
                break
            if not waiting:
                logger.info("waiting for tasks")
            waiting = True
            shutdown.wait(options.poll_interval)
            continue
        waiting = False
        if shutdown.requested.is_set():
            # The stop came while this claim was on its way: hand the task straight back,
            # without using up one of its attempts.
            lease.release()
            logger.info(
                "task %s released for another worker: the worker is stopping", lease.task_id
            )
            tally.add("released")
            break
        tally.add(_process(lease, handler, shutdown))
    return tally


def _process(lease: Lease, handler: _Handler, shutdown: _Shutdown) -> str:
    """Run the handler on one claimed task inside ``with lease:``; return the outcome."""
    logger.info(
        "task %s started (attempt %s of %s)", lease.task_id, lease.attempt, lease.max_attempts
    )
    started = time.monotonic()
    try:
        # `with lease` renews in the background and fails the task if the block raises.
        with lease:
            lease.ack(_run_interruptibly(lease, handler, shutdown))
    except _Aborted:
        logger.warning("task %s released for another worker", lease.task_id)
        return "released"
    except LeaseLost as exc:
        logger.warning("task %s: %s", lease.task_id, exc)
        return "lost"
    except Exception as exc:
        ending = "now dead" if lease.attempt >= lease.max_attempts else "will be retried"
        logger.error(
            "task %s failed (attempt %s of %s, %s): %s: %s",
            lease.task_id,
            lease.attempt,
            lease.max_attempts,
            ending,
            type(exc).__name__,
            exc,
            exc_info=not isinstance(exc, LeaseQueueError),
        )
        return "failed"
    logger.info("task %s done in %.2f s", lease.task_id, time.monotonic() - started)
    return "done"


def _run_interruptibly(
    lease: Lease, handler: _Handler, shutdown: _Shutdown
) -> dict[str, Any] | None:
    try:
        return shutdown.run_handler(handler, lease)
    except _Aborted:
        # Nothing is wrong with the task: it is due again at once, and this claim does not
        # count against its attempts (a fail would, and would kill it on its last one).
        lease.release()
        raise


# -- the embedded server -------------------------------------------------------------------


def _data_dir(ctx: click.Context) -> Path:
    config = ctx.find_object(_Config)
    assert config is not None
    return config.data_dir or LeaseQueueSettings().data_dir


@main.group()
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Data directory of the server; overrides LEASEQUEUE_DATA_DIR.",
)
@click.pass_context
def embedded(ctx: click.Context, data_dir: Path | None) -> None:
    """Manage the embedded PostgreSQL server.

    It is used when no DSN is configured, and listens only on a Unix socket inside its
    data directory.
    """
    config = ctx.find_object(_Config)
    assert config is not None
    config.data_dir = data_dir


@embedded.command()
@click.pass_context
def start(ctx: click.Context) -> None:
    """Start the server and leave it running.

    Finds it running if it is, and leaves it running after this command exits. Other
    processes then use it until `leasequeue embedded stop`.
    """
    status = start_server(_data_dir(ctx))
    click.echo(f"embedded PostgreSQL running in {status.data_dir} (pid {status.pid})")


@embedded.command()
@click.pass_context
def stop(ctx: click.Context) -> None:
    """Stop the server: sessions are ended, committed work is kept."""
    data_dir = _data_dir(ctx)
    if stop_server(data_dir):
        click.echo(f"stopped the embedded PostgreSQL in {data_dir}")
    else:
        click.echo(f"embedded PostgreSQL in {data_dir} is not running")


@embedded.command()
@click.pass_context
def status(ctx: click.Context) -> None:
    """Say whether the server runs, and where its data is."""
    current = server_status(_data_dir(ctx))
    if not current.running:
        click.echo("stopped")
    else:
        state = "" if current.state == "ready" else f", {current.state}"
        click.echo(f"running (pid {current.pid}{state})")
    click.echo(f"data dir: {current.data_dir}")


@embedded.command()
@click.pass_context
def dsn(ctx: click.Context) -> None:
    """Print the running server's connection URI.

    It names a Unix socket and holds no password.
    """
    current = server_status(_data_dir(ctx))
    if current.uri is None:
        raise click.ClickException(
            f"the embedded PostgreSQL in {current.data_dir} is not running: "
            "start it with `leasequeue embedded start`"
        )
    click.echo(current.uri)


if __name__ == "__main__":
    main(prog_name="leasequeue")
