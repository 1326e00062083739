"""The ``leasequeue`` command line: install, enqueue, inspect, steer, purge and run workers.

It is a thin layer over the public API of :class:`LeaseQueue` and :class:`Lease`, configured
by the same ``LEASEQUEUE_*`` settings, and it never imports Dagster. Every
:class:`LeaseQueueError` becomes a one-line message on stderr and exit code 1; bad usage
exits with 2 (click's convention).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from dagster_leasequeue import (
    BatchInfo,
    ConfigurationError,
    DatabaseUnavailable,
    LeaseQueue,
    LeaseQueueError,
    LeaseQueueSettings,
    PayloadError,
    QueueStats,
    SchemaNotInstalled,
    TaskInfo,
    __version__,
)
from dagster_leasequeue.cli_format import (
    DURATION,
    age,
    echo_json,
    elapsed,
    flat,
    parse_object,
    shorten,
    table,
    when,
)
from dagster_leasequeue.embedded import server_status, start_server, stop_server
from dagster_leasequeue.models import FINISHED, STATUSES
from dagster_leasequeue.payloads import encode_object
from dagster_leasequeue.validation import MAX_ATTEMPTS, MAX_LEASE_SECONDS
from dagster_leasequeue.worker import Handler, load_handler, run_worker

# Named, not __name__: run as `python -m dagster_leasequeue.cli` this module is __main__,
# whose logger would not reach the package's handler.
logger = logging.getLogger("dagster_leasequeue.cli")

# enqueue --file sends this many payloads per enqueue_many statement.
ENQUEUE_CHUNK = 1000


# -- configuration and errors --------------------------------------------------------------


@dataclass
class _Config:
    """The global options, and the queue opened for this invocation (on first use)."""

    dsn: str | None = field(repr=False)  # it may hold a password
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
    "--max-attempts", type=click.IntRange(1, MAX_ATTEMPTS), help="Claims before the task is dead."
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
    parsed = parse_object(text, "the payload")
    task_id = _open_queue(ctx).enqueue(
        parsed,
        queue=queue_name,
        priority=priority,
        delay=delay,
        idempotency_key=idempotency_key,
        max_attempts=max_attempts,
    )
    click.echo(task_id)


def _file_payloads(path: Path, name: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, payload) for every non-blank line of a JSON-lines file; ``name`` is
    the file as the user gave it, for messages."""
    with path.open(encoding="utf-8") as lines:
        try:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    yield number, parse_object(line, f"line {number} of {name}")
        except UnicodeDecodeError as exc:
            raise click.ClickException(f"{name} is not UTF-8 text: {exc}") from None


@contextmanager
def _readable_twice(path: Path) -> Iterator[Path]:
    """``path``, or a copy of what it holds when it can be read only once (a pipe, a FIFO,
    /dev/stdin): the file is read once to check it and once to enqueue it."""
    if path.is_file():
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="leasequeue-enqueue-") as folder:
        copy = Path(folder) / "payloads.jsonl"
        with path.open("rb") as source, copy.open("wb") as target:
            shutil.copyfileobj(source, target)
        yield copy


def _check_file(path: Path, name: Path, max_bytes: int) -> int:
    """Check every line before the first write; return how many payloads the file holds.

    Chunks are separate statements, so a bad line found mid-way would leave the chunks
    before it stored; the queue's own encoder does the checking.
    """
    count = 0
    for number, payload in _file_payloads(path, name):
        try:
            encode_object(payload, what=f"line {number} of {name}", max_bytes=max_bytes)
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
    with _readable_twice(path) as readable:
        _enqueue_lines(queue, readable, path, queue_name, priority, max_attempts)


def _enqueue_lines(
    queue: LeaseQueue,
    path: Path,
    name: Path,
    queue_name: str,
    priority: int,
    max_attempts: int | None,
) -> None:
    total = _check_file(path, name, queue.settings.payload_max_bytes)
    ids: list[int] = []
    payloads = (payload for _, payload in _file_payloads(path, name))
    with click.progressbar(length=total, label=f"enqueueing {name.name}", file=sys.stderr) as bar:
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
        echo_json({name: _stats_dict(queue_stats) for name, queue_stats in per_queue.items()})
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
            age(queue_stats.oldest_enqueued_seconds),
        ]
        for name, queue_stats in per_queue.items()
    ]
    return table(headers, rows, numeric=set(range(1, len(headers))))


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
        echo_json([asdict(task) for task in tasks])
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
            when(task.created_at),
            shorten(json.dumps(task.payload, ensure_ascii=False), 60),
        ]
        for task in tasks
    ]
    return table(headers, rows, numeric={0, 3})


@main.command()
@click.argument("task_id", type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead.")
@click.pass_context
def show(ctx: click.Context, task_id: int, as_json: bool) -> None:
    """Show every field of the task TASK_ID."""
    task = _open_queue(ctx).get(task_id)
    if as_json:
        echo_json(asdict(task))
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
        ("run at", when(task.run_at)),
        ("lease expires at", when(task.lease_expires_at)),
        ("created at", when(task.created_at)),
        ("updated at", when(task.updated_at)),
        ("finished at", when(task.finished_at)),
        ("last error", task.last_error or "-"),
    ]
    lines = [f"{name + ':':<18}{value}" for name, value in fields]
    for name, document in (("payload", task.payload), ("result", task.result)):
        text = "-" if document is None else json.dumps(document, indent=2, ensure_ascii=False)
        lines.append(f"{name}:")
        lines.extend(f"  {line}" for line in text.splitlines())
    return "\n".join(lines)


@main.command()
@click.option("--queue", "queue_name", help="Only batches of this queue.")
@click.option(
    "--limit", type=click.IntRange(1, 100_000), default=100, show_default=True, help="Most rows."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (every field) instead.")
@click.pass_context
def batches(ctx: click.Context, queue_name: str | None, limit: int, as_json: bool) -> None:
    """List batches, newest first.

    Each with its task counts (pending: enqueued or processing) and whether it has
    finished. When the page is full, a note that older batches may exist is printed on
    stderr.
    """
    infos = _open_queue(ctx).batches(queue=queue_name, limit=limit)
    if as_json:
        echo_json([_batch_dict(info) for info in infos])
    elif not infos:
        click.echo("no batches")
    else:
        click.echo(_batches_table(infos))
    if len(infos) == limit:
        click.echo(f"older batches may exist: these are the newest {limit} (--limit)", err=True)


def _batch_state(info: BatchInfo) -> str:
    return "finished" if info.finished else "running"


def _batch_duration(info: BatchInfo) -> float | None:
    """Seconds from the batch's creation to its last task's finish; None while running."""
    if info.finished_at is None:
        return None
    return (info.finished_at - info.created_at).total_seconds()


def _batch_dict(info: BatchInfo) -> dict[str, Any]:
    return {
        **asdict(info),
        "pending": info.enqueued + info.processing,
        "finished": info.finished,
        "duration_seconds": _batch_duration(info),
        "counts": info.counts,
    }


def _batches_table(infos: Sequence[BatchInfo]) -> str:
    headers = [
        "ID",
        "NAME",
        "QUEUE",
        "TOTAL",
        "DONE",
        "DEAD",
        "CANCELLED",
        "PENDING",
        "STATE",
        "CREATED",
        "FINISHED",
    ]
    rows = [
        [
            str(info.id),
            "-" if info.name is None else shorten(flat(info.name), 40),
            info.queue,
            str(info.total),
            str(info.done),
            str(info.dead),
            str(info.cancelled),
            str(info.enqueued + info.processing),
            _batch_state(info),
            when(info.created_at),
            when(info.finished_at),
        ]
        for info in infos
    ]
    return table(headers, rows, numeric={0, 3, 4, 5, 6, 7})


@main.command()
@click.argument("batch_id", type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead.")
@click.pass_context
def batch(ctx: click.Context, batch_id: int, as_json: bool) -> None:
    """Show every field of the batch BATCH_ID.

    Its tasks per status, whether it has finished, and when finished, how long it took
    from its creation to its last task's finish.
    """
    info = _open_queue(ctx).batch(batch_id)
    if as_json:
        echo_json(_batch_dict(info))
    else:
        click.echo(_describe_batch(info))


def _batch_name(name: str | None) -> str:
    if name is None:
        return "-"
    # A name with newlines or tabs is shown as a JSON string, on one line and exactly.
    return name if name == flat(name) else json.dumps(name, ensure_ascii=False)


def _describe_batch(info: BatchInfo) -> str:
    fields = [
        ("id", str(info.id)),
        ("name", _batch_name(info.name)),
        ("queue", info.queue),
        ("state", _batch_state(info)),
        ("total", str(info.total)),
        *((status, str(count)) for status, count in info.counts.items()),
        ("created at", when(info.created_at)),
        ("finished at", when(info.finished_at)),
        ("duration", elapsed(_batch_duration(info))),
    ]
    return "\n".join(f"{name + ':':<18}{value}" for name, value in fields)


# -- steering ------------------------------------------------------------------------------


@main.command("retry-dead")
@click.argument("task_ids", nargs=-1, type=click.IntRange(min=1))
@click.option("--queue", "queue_name", help="Only dead tasks of this queue.")
@click.option(
    "--batch", "batch_id", type=click.IntRange(min=1), help="Only dead tasks of this batch."
)
@click.pass_context
def retry_dead(
    ctx: click.Context, task_ids: tuple[int, ...], queue_name: str | None, batch_id: int | None
) -> None:
    """Enqueue dead tasks again; print how many.

    Each gets a fresh budget of attempts. With TASK_IDS, only those; with --queue, only
    that queue's; with --batch, only that batch's (exit code 1 if there is no such batch);
    with none of them, every dead task. A dead task whose idempotency key an unfinished
    task has taken stays dead.
    """
    queue = _open_queue(ctx)
    count = queue.retry_dead(list(task_ids) if task_ids else None, queue=queue_name, batch=batch_id)
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


@main.command("cancel-batch")
@click.argument("batch_id", type=click.IntRange(min=1))
@click.pass_context
def cancel_batch(ctx: click.Context, batch_id: int) -> None:
    """Cancel the unfinished tasks of a batch; print how many.

    Workers holding tasks of the batch BATCH_ID lose their lease; its finished tasks are
    left as they are (a finished batch: 0 cancelled, exit code 0).
    """
    count = _open_queue(ctx).cancel_batch(batch_id)
    click.echo(f"cancelled {count} task(s) of batch {batch_id}")


@main.command()
@click.argument("queue_name", metavar="QUEUE")
@click.pass_context
def pause(ctx: click.Context, queue_name: str) -> None:
    """Stop claims from QUEUE until `leasequeue resume QUEUE`.

    Enqueues still land and expired leases are still swept; tasks already claimed run on.
    """
    queue = _open_queue(ctx)
    queue.pause(queue_name)
    click.echo(f"paused queue {queue_name!r}; {_flow_summary(queue, queue_name)}")


@main.command()
@click.argument("queue_name", metavar="QUEUE")
@click.pass_context
def resume(ctx: click.Context, queue_name: str) -> None:
    """Let QUEUE's tasks be claimed again; waiting workers look at once."""
    queue = _open_queue(ctx)
    queue.resume(queue_name)
    click.echo(f"resumed queue {queue_name!r}; {_flow_summary(queue, queue_name)}")


@main.command()
@click.argument("queue_name", metavar="QUEUE")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.pass_context
def flow(ctx: click.Context, queue_name: str, as_json: bool) -> None:
    """The flow controls in force on QUEUE: pause, concurrency and rate limits, and the
    keys with limits of their own (with their running tasks)."""
    controls = _open_queue(ctx).flow(queue_name)
    if as_json:
        echo_json(asdict(controls))
        return
    rate = (
        f"{controls.per_second:g}/s (burst {controls.burst:g})"
        if controls.per_second is not None
        else "none"
    )
    limit = "none" if controls.max_running is None else str(controls.max_running)
    click.echo(f"queue {queue_name!r}: {'PAUSED' if controls.paused else 'running'}")
    click.echo(f"  concurrency limit per key: {limit}")
    click.echo(f"  rate limit: {rate}")
    for key in controls.keys:
        own = [f"{key.running} running"]
        if key.max_running is not None:
            own.append(f"limit {key.max_running}")
        if key.per_second is not None:
            own.append(f"rate {key.per_second:g}/s (burst {key.burst:g})")
        click.echo(f"  key {key.key!r}: " + ", ".join(own))


def _flow_summary(queue: LeaseQueue, queue_name: str) -> str:
    counts = queue.stats(queue_name, finished=False).counts
    return f"{counts['enqueued']} enqueued, {counts['processing']} processing"


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
        echo_json([asdict(task) for task in recovered])
        return
    for task in recovered:
        click.echo(
            f"task {task.task_id} in queue {task.queue!r}: {task.action} "
            f"(attempt {task.attempt}, worker {task.worker_id or '-'}, "
            f"lease expired at {when(task.lease_expires_at)})"
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


def _load_handler(ctx: click.Context, param: click.Parameter, spec: str) -> Handler:
    """Import "package.module:function" (a click callback: a bad one is a usage error)."""
    try:
        return load_handler(spec)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


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
    handler: Handler,
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
    with _worker_logging():
        queue = _open_queue_when_reachable(ctx, poll_interval)
        logger.info(
            "worker %s on queue %r (schema %r at %s) runs %s",
            worker_id or queue.default_worker_id,
            queue_name,
            queue.schema,
            queue.location,
            handler.name,
        )
        summary = run_worker(
            queue,
            handler,
            queue_name=queue_name,
            lease_seconds=lease_seconds,
            poll_interval=poll_interval,
            max_tasks=max_tasks,
            burst=burst,
            worker_id=worker_id,
        )
        logger.info("worker stopped after %s", summary)


def _open_queue_when_reachable(ctx: click.Context, poll_interval: float) -> LeaseQueue:
    """Open the queue, waiting while the database cannot be reached: a worker started
    while it restarts, or behind a slow network, waits for it as it does between tasks."""
    while True:
        try:
            return _open_queue(ctx)
        except DatabaseUnavailable as exc:
            logger.warning("cannot connect: %s (trying again in %g s)", exc, poll_interval)
            time.sleep(poll_interval)


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
