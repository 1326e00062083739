"""The `leasequeue` command line, against a real PostgreSQL.

Most commands run in-process through click's CliRunner; the worker (signals, a real
process) and `embedded start` (a server that must outlive its command) run as real
subprocesses of `python -m dagster_leasequeue.cli`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner, Result

from dagster_leasequeue import LeaseQueue
from dagster_leasequeue.cli import main

from ..helpers import expire, run_sql, waits_for_a_lock

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "dagster_leasequeue.cli"]

Invoke = Callable[..., Result]


@pytest.fixture
def cli(dsn: str, schema_name: str) -> Invoke:
    """Run the CLI in-process against the test database and schema."""
    runner = CliRunner()

    def invoke(*args: str, stdin: str | None = None) -> Result:
        return runner.invoke(
            main,
            ["--dsn", dsn, "--schema", schema_name, *args],
            input=stdin,
            catch_exceptions=False,
        )

    return invoke


def cli_env(dsn: str, schema_name: str) -> dict[str, str]:
    """The environment of a CLI subprocess: configured by variables, as in production."""
    return {**os.environ, "LEASEQUEUE_DSN": dsn, "LEASEQUEUE_SCHEMA_NAME": schema_name}


def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def one_line_error(result: Result) -> str:
    """The stderr of a failed command, checked to be a single 'Error: ...' line."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


# -- general -------------------------------------------------------------------------------


def test_help_lists_every_command() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in [
        "install",
        "enqueue",
        "stats",
        "list",
        "show",
        "batches",
        "batch",
        "retry-dead",
        "cancel",
        "cancel-batch",
        "pause",
        "resume",
        "flow",
        "sweep",
        "purge",
        "worker",
        "embedded",
    ]:
        assert f"  {command} " in result.output


def test_the_cli_does_not_import_dagster() -> None:
    probe = "import sys, dagster_leasequeue.cli; sys.exit('dagster' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], timeout=60).returncode == 0


def test_install_prints_the_version_and_is_idempotent(
    cli: Invoke, make_queue: Callable[..., LeaseQueue]
) -> None:
    not_installed = cli("stats")
    assert not_installed.exit_code == 1
    assert "leasequeue install" in one_line_error(not_installed)

    first, second = cli("install"), cli("install")
    version = make_queue().installed_version()
    assert first.exit_code == 0 and second.exit_code == 0
    assert f"at version {version} (" in first.output
    assert "(0 migration(s) applied)" in second.output


def test_database_errors_are_one_line_and_hide_the_password() -> None:
    result = CliRunner().invoke(
        main, ["--dsn", "postgresql://postgres:s3cret-pw@127.0.0.1:1/test", "stats"]
    )
    assert result.exit_code == 1
    assert "cannot connect" in one_line_error(result)
    assert "s3cret-pw" not in result.output


# -- enqueue -------------------------------------------------------------------------------


def test_pause_resume_and_flow(cli: Invoke, queue: LeaseQueue) -> None:
    queue.enqueue_many([{"n": 1}, {"n": 2}], queue="api")
    queue.set_concurrency_limit("api", 2, key="acme")
    queue.set_rate_limit("api", per_second=5)
    result = cli("pause", "api")
    assert result.exit_code == 0
    assert result.stdout == "paused queue 'api'; 2 enqueued, 0 processing\n"
    assert queue.claim(queue="api") is None
    result = cli("flow", "api")
    assert result.stdout.splitlines() == [
        "queue 'api': PAUSED",
        "  concurrency limit per key: none",
        "  rate limit: 5/s (burst 5)",
        "  key 'acme': 0 running, limit 2",
    ]
    assert cli("resume", "api").stdout == "resumed queue 'api'; 2 enqueued, 0 processing\n"
    assert json.loads(cli("flow", "api", "--json").stdout)["paused"] is False
    assert queue.claim(queue="api") is not None


def test_enqueue_from_an_argument_with_options(cli: Invoke, queue: LeaseQueue) -> None:
    result = cli(
        "enqueue",
        '{"document": "invoice-17.pdf"}',
        "--queue",
        "docs",
        "--priority",
        "7",
        "--idempotency-key",
        "invoice-17",
        "--max-attempts",
        "2",
    )
    assert result.exit_code == 0
    task = queue.get(int(result.stdout))
    assert task.payload == {"document": "invoice-17.pdf"}
    assert (task.queue, task.priority, task.max_attempts) == ("docs", 7, 2)
    assert task.idempotency_key == "invoice-17"
    # The same key while the task is unfinished gives the same task.
    again = cli("enqueue", '{"other": 1}', "--queue", "docs", "--idempotency-key", "invoice-17")
    assert again.stdout == result.stdout

    delayed = cli("enqueue", '{"later": true}', "--delay", "1h")
    assert delayed.exit_code == 0
    assert queue.claim() is None  # held back an hour


def test_enqueue_reads_the_payload_from_stdin(cli: Invoke, queue: LeaseQueue) -> None:
    result = cli("enqueue", "-", "--queue", "piped", stdin='{"n": 1, "tags": ["a", "b"]}\n')
    assert result.exit_code == 0
    assert queue.get(int(result.stdout)).payload == {"n": 1, "tags": ["a", "b"]}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('{"x": NaN}', "NaN is not a JSON value"),
        ('{"text": "a\\u0000b"}', "NUL character"),
    ],
)
def test_a_bad_payload_is_refused_and_nothing_is_stored(
    cli: Invoke, queue: LeaseQueue, payload: str, message: str
) -> None:
    result = cli("enqueue", payload)
    assert result.exit_code == 1
    assert message in one_line_error(result)
    assert queue.stats().total == 0


def test_enqueue_usage_errors(cli: Invoke, queue: LeaseQueue, tmp_path: Path) -> None:
    lines = tmp_path / "tasks.jsonl"
    lines.write_text('{"n": 1}\n')
    assert cli("enqueue").exit_code == 2
    assert cli("enqueue", '{"n": 1}', "--file", str(lines)).exit_code == 2
    assert cli("enqueue", "--file", str(lines), "--delay", "1m").exit_code == 2
    assert cli("enqueue", '{"n": 1}', "--priority", "high").exit_code == 2
    assert queue.stats().total == 0


def test_enqueue_a_file_in_chunks(cli: Invoke, queue: LeaseQueue, tmp_path: Path) -> None:
    lines = tmp_path / "tasks.jsonl"
    lines.write_text("".join(f'{{"n": {n}}}\n' for n in range(2500)) + "\n")
    result = cli("enqueue", "--file", str(lines), "--queue", "bulk", "--priority", "2")
    assert result.exit_code == 0, result.output
    assert "enqueued 2500 task(s) in queue 'bulk'" in result.stdout
    assert queue.stats("bulk").counts["enqueued"] == 2500
    first = queue.claim(queue="bulk")
    assert first is not None and first.payload == {"n": 0} and first.priority == 2

    # Every line is checked first: a bad line late in the file stores nothing at all.
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(f'{{"n": {n}}}\n' for n in range(1499)) + "[1]\n")
    refused = cli("enqueue", "--file", str(bad), "--queue", "bad")
    assert refused.exit_code == 1
    assert "line 1500" in one_line_error(refused)
    nul = tmp_path / "nul.jsonl"
    nul.write_text('{"n": 1}\n{"text": "a\\u0000b"}\n')
    refused = cli("enqueue", "--file", str(nul), "--queue", "bad")
    assert refused.exit_code == 1
    assert "line 2" in one_line_error(refused) and "NUL" in refused.stderr
    assert queue.stats("bad").total == 0


def test_enqueue_a_file_that_can_be_read_only_once(
    cli: Invoke, queue: LeaseQueue, tmp_path: Path
) -> None:
    """A pipe (``--file <(...)``, /dev/stdin, a FIFO) is read once: the file is checked
    whole before the first write and read again to enqueue, which found a pipe empty and
    enqueued nothing, or waited for ever on a FIFO."""
    fifo = tmp_path / "tasks.fifo"
    os.mkfifo(fifo)
    lines = "".join(f'{{"n": {n}}}\n' for n in range(1500))

    def write() -> None:
        with fifo.open("w") as pipe:
            pipe.write(lines)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    result = cli("enqueue", "--file", str(fifo), "--queue", "piped")
    writer.join(timeout=10)
    assert result.exit_code == 0, result.output
    assert "enqueued 1500 task(s) in queue 'piped'" in result.stdout
    assert queue.stats("piped").counts["enqueued"] == 1500

    fifo.unlink()
    os.mkfifo(fifo)
    writer = threading.Thread(target=write, daemon=True)
    lines = '{"n": 1}\n[2]\n'
    writer.start()
    refused = cli("enqueue", "--file", str(fifo), "--queue", "refused")
    writer.join(timeout=10)
    assert refused.exit_code == 1
    assert f"line 2 of {fifo}" in one_line_error(refused)
    assert queue.stats("refused").total == 0


# -- inspection ----------------------------------------------------------------------------


def test_stats_as_a_table_and_as_json(cli: Invoke, queue: LeaseQueue) -> None:
    assert cli("stats").stdout.strip() == "no tasks"
    queue.enqueue_many([{"n": n} for n in range(3)], queue="alpha")
    queue.enqueue({"n": 1}, queue="beta")
    lease = queue.claim(queue="alpha")
    assert lease is not None
    lease.ack()

    table = cli("stats").stdout.splitlines()
    assert table[0].split() == [
        "QUEUE",
        "ENQUEUED",
        "PROCESSING",
        "DONE",
        "DEAD",
        "CANCELLED",
        "TOTAL",
        "OLDEST",
        "WAITING",
    ]
    assert table[1].split()[:7] == ["alpha", "2", "0", "1", "0", "0", "3"]
    assert table[2].split()[:7] == ["beta", "1", "0", "0", "0", "0", "1"]

    stats = json.loads(cli("stats", "--json").stdout)
    assert stats["alpha"]["counts"] == {
        "enqueued": 2,
        "processing": 0,
        "done": 1,
        "dead": 0,
        "cancelled": 0,
    }
    assert stats["alpha"]["total"] == 3
    assert stats["beta"]["oldest_enqueued_seconds"] >= 0


def test_list_filters_pages_and_prints_json(cli: Invoke, queue: LeaseQueue) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(5)], queue="alpha")
    other = queue.enqueue({"n": 99}, queue="beta")
    queue.cancel(ids[0])

    table = cli("list", "--queue", "alpha", "--status", "enqueued").stdout.splitlines()
    assert table[0].split()[:3] == ["ID", "QUEUE", "STATUS"]
    assert [int(line.split()[0]) for line in table[1:]] == ids[1:]

    page = cli("list", "--after-id", str(ids[1]), "--limit", "2")
    assert [int(line.split()[0]) for line in page.stdout.splitlines()[1:]] == ids[2:4]
    assert f"--after-id {ids[3]}" in page.stderr  # the page was full: where the next starts

    listed = json.loads(cli("list", "--json", "--queue", "beta").stdout)
    assert [(task["task_id"], task["payload"]) for task in listed] == [(other, {"n": 99})]
    assert cli("list", "--queue", "nowhere").stdout.strip() == "no tasks"
    assert cli("list", "--status", "sleeping").exit_code == 2


def test_show_prints_every_field(cli: Invoke, queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"document": "a.pdf"}, idempotency_key="doc-a")
    lease = queue.claim(worker_id="worker-7")
    assert lease is not None
    lease.ack({"pages": 3})

    text = cli("show", str(task_id)).stdout
    for expected in ["status:           done", "idempotency key:  doc-a", "worker-7", '"pages": 3']:
        assert expected in text

    shown = json.loads(cli("show", str(task_id), "--json").stdout)
    assert shown["status"] == "done" and shown["result"] == {"pages": 3}
    assert shown["payload"] == {"document": "a.pdf"}
    assert shown["finished_at"] is not None and shown["attempts"] == 1

    missing = cli("show", "999999")
    assert missing.exit_code == 1
    assert "no task with id 999999" in one_line_error(missing)


def finish_one(queue: LeaseQueue, name: str, outcome: str) -> int:
    """Claim the next task of queue ``name`` and ack it ("done") or fail it (dead, when it
    has one attempt); return its id."""
    lease = queue.claim(queue=name)
    assert lease is not None
    if outcome == "done":
        lease.ack()
    else:
        assert lease.fail("boom") == outcome
    return lease.task_id


def test_batches_lists_newest_first_as_a_table_and_json(cli: Invoke, queue: LeaseQueue) -> None:
    assert cli("batches").stdout.strip() == "no batches"
    running = queue.enqueue_batch(
        [{"n": n} for n in range(4)], queue="alpha", name="nightly run", max_attempts=1
    )
    finish_one(queue, "alpha", "done")
    finish_one(queue, "alpha", "dead")
    lease = queue.claim(queue="alpha")  # one processing, one enqueued: two pending
    assert lease is not None
    empty = queue.enqueue_batch([], queue="beta")  # finished as it is made

    table = cli("batches").stdout.splitlines()
    assert table[0].split() == [
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
    # Newest first; CREATED and FINISHED are a date and a time each.
    assert table[1].split()[:9] == [str(empty.id), "-", "beta", "0", "0", "0", "0", "0", "finished"]
    assert len(table[1].split()) == 13
    assert table[2].split()[:10] == [
        str(running.id),
        "nightly",
        "run",
        "alpha",
        "4",
        "1",
        "1",
        "0",
        "2",
        "running",
    ]
    assert table[2].split()[-1] == "-"  # not finished

    only_alpha = cli("batches", "--queue", "alpha").stdout.splitlines()
    assert [int(line.split()[0]) for line in only_alpha[1:]] == [running.id]
    assert cli("batches", "--queue", "nowhere").stdout.strip() == "no batches"
    page = cli("batches", "--limit", "1")
    assert [int(line.split()[0]) for line in page.stdout.splitlines()[1:]] == [empty.id]
    assert "older batches may exist" in page.stderr  # the page was full
    assert cli("batches").stderr == ""

    listed = json.loads(cli("batches", "--json").stdout)
    assert [batch["id"] for batch in listed] == [empty.id, running.id]
    newest, oldest = listed
    assert newest["finished"] is True and newest["duration_seconds"] >= 0
    assert oldest["name"] == "nightly run" and oldest["queue"] == "alpha"
    assert oldest["counts"] == {
        "enqueued": 1,
        "processing": 1,
        "done": 1,
        "dead": 1,
        "cancelled": 0,
    }
    assert (oldest["total"], oldest["pending"], oldest["finished"]) == (4, 2, False)
    assert oldest["finished_at"] is None and oldest["duration_seconds"] is None
    assert cli("batches", "--limit", "0").exit_code == 2


def test_batch_shows_every_field_and_its_duration(cli: Invoke, queue: LeaseQueue) -> None:
    made = queue.enqueue_batch([{"n": n} for n in range(3)], queue="docs", name="scans\nmonday")
    finish_one(queue, "docs", "done")

    running = cli("batch", str(made.id)).stdout
    for expected in [
        f"id:               {made.id}",
        'name:             "scans\\nmonday"',  # a name with a newline, kept on one line
        "queue:            docs",
        "state:            running",
        "total:            3",
        "enqueued:         2",
        "processing:       0",
        "done:             1",
        "dead:             0",
        "cancelled:        0",
        "finished at:      -",
        "duration:         -",
    ]:
        assert expected in running.splitlines(), (expected, running)

    for _ in range(2):
        finish_one(queue, "docs", "done")
    finished = cli("batch", str(made.id)).stdout
    assert "state:            finished" in finished and "done:             3" in finished
    [duration] = [line for line in finished.splitlines() if line.startswith("duration:")]
    assert duration.endswith("s") and duration.split()[1] != "-"

    shown = json.loads(cli("batch", str(made.id), "--json").stdout)
    assert (shown["id"], shown["name"], shown["queue"]) == (made.id, "scans\nmonday", "docs")
    assert shown["counts"] == {
        "enqueued": 0,
        "processing": 0,
        "done": 3,
        "dead": 0,
        "cancelled": 0,
    }
    assert shown["finished"] is True and shown["pending"] == 0 and shown["total"] == 3
    assert shown["duration_seconds"] >= 0 and shown["finished_at"] >= shown["created_at"]

    missing = cli("batch", "999999")
    assert missing.exit_code == 1
    assert "no batch with id 999999" in one_line_error(missing)
    assert cli("batch", "0").exit_code == 2


def test_a_missing_batch_exits_with_1_in_a_real_process(
    dsn: str, schema_name: str, queue: LeaseQueue
) -> None:
    for args in (["batch", "424242", "--json"], ["cancel-batch", "424242"]):
        result = subprocess.run(
            [*CLI, *args],
            cwd=REPO,
            env=cli_env(dsn, schema_name),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1, result.stderr
        assert result.stdout == ""
        assert result.stderr.strip() == (
            f"Error: no batch with id 424242 in schema {schema_name!r}"
        )


# -- steering ------------------------------------------------------------------------------


def test_cancel(cli: Invoke, queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    assert cli("cancel", str(task_id)).stdout.strip() == f"cancelled task {task_id}"
    assert queue.get(task_id).status == "cancelled"

    again = cli("cancel", str(task_id))
    assert again.exit_code == 1
    assert "already finished (cancelled)" in one_line_error(again)
    missing = cli("cancel", "999999")
    assert missing.exit_code == 1
    assert "no task with id 999999" in one_line_error(missing)


def kill_task(queue: LeaseQueue, payload: dict[str, int], name: str = "default") -> int:
    """Enqueue a task with one attempt and fail it: it is dead."""
    task_id = queue.enqueue(payload, queue=name, max_attempts=1)
    lease = queue.claim(queue=name)
    assert lease is not None and lease.task_id == task_id
    assert lease.fail("boom") == "dead"
    return task_id


def test_retry_dead_by_id_by_queue_and_all(cli: Invoke, queue: LeaseQueue) -> None:
    first, second = kill_task(queue, {"n": 1}), kill_task(queue, {"n": 2})
    in_other = kill_task(queue, {"n": 3}, name="other")

    assert cli("retry-dead", str(first)).stdout.strip() == "enqueued 1 dead task(s) again"
    assert queue.get(first).status == "enqueued" and queue.get(second).status == "dead"
    assert "enqueued 1 " in cli("retry-dead", "--queue", "other").stdout
    assert queue.get(in_other).status == "enqueued"
    assert "enqueued 1 " in cli("retry-dead").stdout
    assert queue.get(second).status == "enqueued"
    assert "enqueued 0 " in cli("retry-dead").stdout


def test_retry_dead_by_batch(cli: Invoke, queue: LeaseQueue) -> None:
    first = queue.enqueue_batch([{"n": 1}, {"n": 2}], queue="first", max_attempts=1)
    second = queue.enqueue_batch([{"n": 3}], queue="second", max_attempts=1)
    dead_in_first = [finish_one(queue, "first", "dead") for _ in range(2)]
    dead_in_second = finish_one(queue, "second", "dead")
    dead_alone = kill_task(queue, {"n": 4})
    assert queue.batch(first.id).finished

    retried = cli("retry-dead", "--batch", str(first.id))
    assert retried.stdout.strip() == "enqueued 2 dead task(s) again"
    assert {queue.get(task_id).status for task_id in dead_in_first} == {"enqueued"}
    assert queue.get(dead_in_second).status == "dead" and queue.get(dead_alone).status == "dead"
    assert queue.batch(first.id).counts["enqueued"] == 2  # running again

    # --batch narrows the other filters, and they narrow it.
    assert "enqueued 0 " in cli("retry-dead", "--batch", str(second.id), "--queue", "first").stdout
    assert "enqueued 0 " in cli("retry-dead", str(dead_alone), "--batch", str(second.id)).stdout
    assert "enqueued 1 " in cli("retry-dead", "--batch", str(second.id)).stdout
    assert queue.get(dead_in_second).status == "enqueued"
    assert queue.get(dead_alone).status == "dead"

    missing = cli("retry-dead", "--batch", "999999")
    assert missing.exit_code == 1
    assert "no batch with id 999999" in one_line_error(missing)
    assert cli("retry-dead", "--batch", "first").exit_code == 2


def test_cancel_batch(cli: Invoke, queue: LeaseQueue) -> None:
    made = queue.enqueue_batch([{"n": n} for n in range(3)], queue="docs")
    other = queue.enqueue_batch([{"n": 9}], queue="docs")
    done = finish_one(queue, "docs", "done")
    lease = queue.claim(queue="docs")  # the batch's second task, held by a worker
    assert lease is not None

    result = cli("cancel-batch", str(made.id))
    assert result.stdout.strip() == f"cancelled 2 task(s) of batch {made.id}"
    info = queue.batch(made.id)
    assert info.finished and (info.done, info.cancelled) == (1, 2)
    assert queue.get(done).status == "done"
    assert queue.get(lease.task_id).status == "cancelled"
    assert queue.batch(other.id).counts["enqueued"] == 1  # another batch is left alone

    # A finished batch: nothing to cancel, and no error (unlike cancel of a finished task).
    again = cli("cancel-batch", str(made.id))
    assert again.exit_code == 0
    assert again.stdout.strip() == f"cancelled 0 task(s) of batch {made.id}"
    missing = cli("cancel-batch", "999999")
    assert missing.exit_code == 1
    assert "no batch with id 999999" in one_line_error(missing)


def test_sweep_prints_each_recovered_task(cli: Invoke, queue: LeaseQueue) -> None:
    assert cli("sweep").stdout.strip() == "recovered 0 task(s)"
    task_id = queue.enqueue({"n": 1}, queue="docs")
    lease = queue.claim(queue="docs", worker_id="doomed-worker")
    assert lease is not None
    expire(queue, task_id)

    output = cli("sweep").stdout
    assert f"task {task_id} in queue 'docs': requeued" in output
    assert "doomed-worker" in output and "recovered 1 task(s)" in output
    assert queue.get(task_id).status == "enqueued"

    second = queue.claim(queue="docs")
    assert second is not None
    expire(queue, task_id)
    [recovered] = json.loads(cli("sweep", "--json").stdout)
    assert recovered["task_id"] == task_id and recovered["attempt"] == 2
    assert recovered["action"] == "requeued"


# -- purge ---------------------------------------------------------------------------------


def finished_task(queue: LeaseQueue, status: str, hours_ago: float) -> int:
    """A task finished (done, cancelled or dead) ``hours_ago`` hours ago."""
    if status == "dead":
        task_id = kill_task(queue, {"status": 0})
    else:
        task_id = queue.enqueue({"status": 1})
        if status == "done":
            lease = queue.claim()
            assert lease is not None and lease.task_id == task_id
            lease.ack()
        else:
            queue.cancel(task_id)
    run_sql(
        queue,
        "UPDATE {schema}.tasks SET finished_at = clock_timestamp() - make_interval(hours => %(h)s)"
        " WHERE id = %(id)s",
        {"h": hours_ago, "id": task_id},
    )
    return task_id


def test_purge_by_age_status_and_queue(cli: Invoke, queue: LeaseQueue) -> None:
    old_done, old_cancelled = finished_task(queue, "done", 2), finished_task(queue, "cancelled", 2)
    old_dead, recent_done = finished_task(queue, "dead", 2), finished_task(queue, "done", 0)
    waiting = queue.enqueue({"n": 1})

    assert cli("purge", "--older-than", "3h").stdout.strip() == "deleted 0 task(s)"
    assert cli("purge", "--older-than", "90m").stdout.strip() == "deleted 2 task(s)"
    remaining = {task.task_id for task in queue.list_tasks()}
    assert remaining == {old_dead, recent_done, waiting}
    assert {old_done, old_cancelled}.isdisjoint(remaining)

    # Dead tasks only when asked; the progress display goes to stderr.
    assert "deleted 0 " in cli("purge", "--older-than", "1h", "--queue", "elsewhere").stdout
    dead = cli("purge", "--older-than", "1h", "--status", "dead", "--progress")
    assert dead.stdout.strip() == "deleted 1 task(s)"
    assert "purging: 1 deleted" in dead.stderr
    assert cli("purge", "--older-than", "0s", "--batch-size", "1").stdout.strip() == (
        "deleted 1 task(s)"
    )
    assert [task.task_id for task in queue.list_tasks()] == [waiting]


def test_purge_usage_errors(cli: Invoke, queue: LeaseQueue) -> None:
    assert cli("purge").exit_code == 2  # --older-than is required
    bad = cli("purge", "--older-than", "7x")
    assert bad.exit_code == 2 and "is not a duration" in bad.stderr
    assert cli("purge", "--older-than", "1d", "--status", "enqueued").exit_code == 2


# -- worker --------------------------------------------------------------------------------


def test_worker_with_burst_in_a_real_process(dsn: str, schema_name: str, queue: LeaseQueue) -> None:
    ok = queue.enqueue_many([{"n": n} for n in range(3)], queue="w")
    failing = queue.enqueue({"n": 9, "fail": True}, queue="w", max_attempts=1)
    other = queue.enqueue({"n": 5}, queue="elsewhere")

    worker = subprocess.run(
        [*CLI, "worker", "tests.cli_handlers:double", "--queue", "w", "--burst"],
        cwd=REPO,
        env=cli_env(dsn, schema_name),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert worker.returncode == 0, worker.stderr
    assert "worker stopped after 4 task(s) (3 done, 1 failed)" in worker.stderr
    for n, task_id in enumerate(ok):
        task = queue.get(task_id)
        assert task.status == "done" and task.result == {"doubled": 2 * n, "attempt": 1}
    dead = queue.get(failing)
    assert dead.status == "dead" and dead.last_error == "ValueError: asked to fail: 9"
    assert queue.get(other).status == "enqueued"


def test_worker_in_process_with_a_payload_only_handler(cli: Invoke, queue: LeaseQueue) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(3)])
    result = cli("worker", "tests.cli_handlers:count_only", "--max-tasks", "2")
    assert result.exit_code == 0
    assert [queue.get(task_id).status for task_id in ids] == ["done", "done", "enqueued"]
    assert queue.get(ids[0]).result is None

    refused = cli("worker", "tests.cli_handlers:not_a_dict", "--burst")
    assert refused.exit_code == 0
    task = queue.get(ids[2])
    assert task.status == "enqueued" and task.attempts == 1  # failed, to be retried
    assert "returned list" in (task.last_error or "")


@pytest.mark.parametrize(
    "handler", ["tests.cli_handlers", "tests.no_such_module:f", "tests.cli_handlers:nothing"]
)
def test_worker_refuses_a_bad_handler(cli: Invoke, handler: str) -> None:
    result = cli("worker", handler)
    assert result.exit_code == 2
    assert "Invalid value for 'HANDLER'" in result.stderr


@pytest.fixture
def start_worker(dsn: str, schema_name: str) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [*CLI, "worker", *args],
            cwd=REPO,
            env=cli_env(dsn, schema_name),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(process)
        return process

    yield start
    for process in started:  # a failed test must not leave a worker behind
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sigterm_lets_the_current_task_finish(
    queue: LeaseQueue, tmp_path: Path, start_worker: Callable[..., subprocess.Popen[str]]
) -> None:
    marker = tmp_path / "started"
    current = queue.enqueue({"marker": str(marker), "seconds": 1.5}, queue="slow")
    following = queue.enqueue({"marker": str(tmp_path / "next"), "seconds": 0}, queue="slow")
    worker = start_worker("tests.cli_handlers:slow", "--queue", "slow")
    wait_for(marker.exists)

    worker.send_signal(signal.SIGTERM)
    _, stderr = worker.communicate(timeout=30)
    assert worker.returncode == 0, stderr
    assert "SIGTERM received" in stderr
    finished = queue.get(current)
    assert finished.status == "done" and finished.result == {"slept": 1.5}
    untouched = queue.get(following)
    assert untouched.status == "enqueued" and untouched.attempts == 0


def test_a_second_signal_releases_the_current_task_without_using_an_attempt(
    queue: LeaseQueue, tmp_path: Path, start_worker: Callable[..., subprocess.Popen[str]]
) -> None:
    marker = tmp_path / "started"
    # Its last attempt: a release that counted as one would leave it dead.
    task_id = queue.enqueue({"marker": str(marker), "seconds": 60}, queue="slow", max_attempts=1)
    worker = start_worker("tests.cli_handlers:slow", "--queue", "slow")
    wait_for(marker.exists)

    worker.send_signal(signal.SIGTERM)
    wait_for(lambda: queue.get(task_id).status == "processing", timeout=5)
    time.sleep(0.3)  # let the first signal be handled before the second one
    worker.send_signal(signal.SIGTERM)
    _, stderr = worker.communicate(timeout=15)
    assert worker.returncode == 0, stderr
    task = queue.get(task_id)
    assert (task.status, task.attempts, task.last_error) == ("enqueued", 0, None)
    # Released with no backoff: another worker claims it at once, and finishes it.
    queue.enqueue({}, queue="slow")  # nothing else may be claimed first
    lease = queue.claim(queue="slow")
    assert lease is not None and lease.task_id == task_id and lease.attempt == 1
    lease.ack({"by": "another worker"})
    assert queue.get(task_id).status == "done"


def test_a_stop_during_a_claim_hands_the_task_back_unused(
    dsn: str, queue: LeaseQueue, start_worker: Callable[..., subprocess.Popen[str]]
) -> None:
    task_id = queue.enqueue({"marker": "/dev/null", "seconds": 0}, queue="slow", max_attempts=1)
    with psycopg.connect(dsn) as locker:
        # The worker's claim waits for this lock: the SIGTERM arrives while it is on its way.
        locker.execute(f'LOCK TABLE "{queue.schema}".tasks IN EXCLUSIVE MODE')
        worker = start_worker("tests.cli_handlers:slow", "--queue", "slow")
        wait_for(lambda: waits_for_a_lock(dsn, queue.schema))
        worker.send_signal(signal.SIGTERM)
        time.sleep(0.5)
    _, stderr = worker.communicate(timeout=15)
    assert worker.returncode == 0, stderr
    assert "released for another worker" in stderr
    task = queue.get(task_id)
    assert (task.status, task.attempts) == ("enqueued", 0)


@pytest.mark.slow
def test_a_rolling_restart_finishes_every_task_and_kills_none(
    queue: LeaseQueue, start_worker: Callable[..., subprocess.Popen[str]]
) -> None:
    """A fleet of workers drains 300 tasks while a deploy stops and replaces them one by one,
    half of them impatiently (a second SIGTERM while a task runs)."""
    # Each task on its last attempt: one that a stop counted as an attempt would be dead.
    task_ids = queue.enqueue_many(
        [{"seconds": 0.1 + 0.05 * (n % 3)} for n in range(300)], queue="deploy", max_attempts=1
    )
    worker_args = ("tests.cli_handlers:nap", "--queue", "deploy", "--poll-interval", "0.1")
    fleet = [start_worker(*worker_args) for _ in range(4)]
    for restart in range(10):
        time.sleep(0.8)
        stopped = fleet.pop(0)
        stopped.send_signal(signal.SIGTERM)
        if restart % 2:
            time.sleep(0.02)
            stopped.send_signal(signal.SIGTERM)
        fleet.append(start_worker(*worker_args))
    finished = ("done", "dead")
    wait_for(lambda: sum(queue.stats("deploy").counts[s] for s in finished) == 300, timeout=120)
    for worker in fleet:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=15)
    statuses = {queue.get(task_id).status for task_id in task_ids}
    assert statuses == {"done"}


def test_an_idle_worker_stops_at_once_on_sigint(
    tmp_path: Path, queue: LeaseQueue, start_worker: Callable[..., subprocess.Popen[str]]
) -> None:
    worker = start_worker("tests.cli_handlers:slow", "--queue", "empty", "--poll-interval", "30")
    # Its first (empty) claim has been made once it is listed as waiting.
    time.sleep(1.0)
    started = time.monotonic()
    worker.send_signal(signal.SIGINT)
    _, stderr = worker.communicate(timeout=15)
    assert worker.returncode == 0, stderr
    assert "waiting for tasks" in stderr
    assert time.monotonic() - started < 5  # not after the 30 s poll interval


# -- the embedded server -------------------------------------------------------------------


def test_embedded_start_status_dsn_and_stop(tmp_path: Path) -> None:
    data_dir = (tmp_path / "pgdata").resolve()
    env = {"LEASEQUEUE_DATA_DIR": str(data_dir)}
    runner = CliRunner()

    def embedded(*args: str) -> Result:
        return runner.invoke(main, ["embedded", *args], env=env)

    assert embedded("status").stdout.splitlines() == ["stopped", f"data dir: {data_dir}"]
    assert embedded("dsn").exit_code == 1
    # A real process: the server must outlive the command that started it.
    started = subprocess.run(
        [*CLI, "embedded", "start"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert started.returncode == 0, started.stderr
        status = embedded("status").stdout.splitlines()
        assert status[0].startswith("running (pid ") and status[1] == f"data dir: {data_dir}"
        uri = embedded("dsn").stdout.strip()
        assert uri.startswith("postgresql://") and str(data_dir) in uri
        with psycopg.connect(uri) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        # With no DSN configured, commands use the running server and leave it running.
        installed = runner.invoke(main, ["--schema", "lq_embedded", "install"], env=env)
        assert installed.exit_code == 0 and "on socket" in installed.stdout
        assert embedded("status").stdout.startswith("running")
    finally:
        stopped = embedded("stop")
    assert stopped.exit_code == 0 and "stopped the embedded PostgreSQL" in stopped.stdout
    assert embedded("status").stdout.startswith("stopped")
    assert "not running" in embedded("stop").stdout


def test_a_worker_started_while_the_database_is_down_waits_for_it(tmp_path: Path) -> None:
    from dagster_leasequeue import LeaseQueueSettings

    from ..own_server import OwnServer

    server = OwnServer(tmp_path)
    server.start()
    settings = LeaseQueueSettings(data_dir=tmp_path / "unused", _env_file=None)
    try:
        with LeaseQueue(server.dsn, schema="lq", settings=settings) as queue:
            queue.install()
            task_id = queue.enqueue({"n": 21})
        server.stop()
        worker = subprocess.Popen(
            [*CLI, "worker", "tests.cli_handlers:count_only", "--burst", "--poll-interval", "0.5"],
            cwd=REPO,
            env={**cli_env(server.dsn, "lq"), "LEASEQUEUE_CONNECT_TIMEOUT": "2"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(3)
        assert worker.poll() is None  # still waiting, not exited
        server.start()
        _, stderr = worker.communicate(timeout=60)
        assert worker.returncode == 0, stderr
        assert "cannot connect" in stderr
        with LeaseQueue(server.dsn, schema="lq", settings=settings) as queue:
            assert queue.get(task_id).status == "done"
    finally:
        with contextlib.suppress(Exception):
            server.stop()
