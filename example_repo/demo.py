"""The end-to-end demo: a batch fanned out from an asset, a worker killed mid-task and its
task recovered by the sweeper sensor, then the fan-in: the report asset materialized once
the batch has finished.

    python -m example_repo.demo          # the whole story, step by step
    python -m example_repo.demo worker   # one worker run (the demo starts and kills one)

It uses the ``LEASEQUEUE_*`` settings (with no ``LEASEQUEUE_DSN``: the embedded server),
always in its own schema ``leasequeue_demo``, which it empties first, with 3-second leases
unless ``LEASEQUEUE_LEASE_SECONDS`` says otherwise, and a throwaway Dagster instance whose
runs requested by a sensor run in the demo's own process, as the daemon would launch them.
"""

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
from psycopg import sql

from dagster_leasequeue import LeaseQueue
from dagster_leasequeue.models import STATUSES
from example_repo.definitions import QUEUE, defs, document_batch
from example_repo.documents import DOCUMENTS, results_table
from example_repo.ticks import run_sensor_tick

QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
CONTRACT = "master-services-agreement.pdf"
FAN_IN_SENSOR = "document_report_when_batch_finished"
# Runs that a sensor requests are launched in the ticking process: the demo needs no
# daemon or code server left running.
INSTANCE_SETTINGS = """\
telemetry:
  enabled: false
run_coordinator:
  module: dagster._core.run_coordinator
  class: DefaultRunCoordinator
run_launcher:
  module: dagster._core.launcher.sync_in_memory_run_launcher
  class: SyncInMemoryRunLauncher
"""


def say(step: str, text: str = "") -> None:
    print(f"\n== {step}" if not text else f"   {text}", flush=True)


def process_config(page_seconds: float) -> dict[str, Any]:
    return {**QUIET, "ops": {"process_documents_op": {"config": {"page_seconds": page_seconds}}}}


def run_worker(page_seconds: float) -> None:
    instance = dg.DagsterInstance.get()
    result = defs.get_job_def("process_documents").execute_in_process(
        instance=instance, run_config=process_config(page_seconds)
    )
    print(f"worker run {result.run_id}: {result.output_for_node('process_documents_op')}")


def demo() -> int:
    # Dagster's own definitions of the implicit asset job use a parameter it calls beta.
    warnings.filterwarnings("ignore", category=dg.BetaWarning)
    # Set before any resource starts; the worker process inherits them.
    os.environ["LEASEQUEUE_SCHEMA_NAME"] = "leasequeue_demo"
    os.environ.setdefault("LEASEQUEUE_LEASE_SECONDS", "3")
    home = Path(tempfile.mkdtemp(prefix="leasequeue-demo-"))
    (home / "dagster.yaml").write_text(INSTANCE_SETTINGS)
    os.environ["DAGSTER_HOME"] = str(home)
    instance = dg.DagsterInstance.get()

    say("1. PostgreSQL")
    queue = LeaseQueue()
    where = f"embedded server in {queue.settings.data_dir}" if queue.embedded else queue.location
    say("", f"using the {where}, schema {queue.schema!r}")
    with queue.connection() as conn:
        conn.execute(
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(queue.schema))
        )
    queue.install()

    say("2. Fan out: materialize the asset document_batch")
    result = (
        defs.resolve_implicit_global_asset_job_def()
        .get_subset(asset_selection={document_batch.key})
        .execute_in_process(instance=instance, run_config=QUIET)
    )
    (batch,) = queue.batches(queue=QUEUE)
    say("", f"batch {batch.id} ({batch.name}): {batch.total} documents, one task each")
    for task in queue.batch_results(batch.id, statuses=("enqueued",)):
        pages = task.payload["pages"]
        say(
            "",
            f"task {task.task_id}: {task.payload['document']} ({pages} page{'s' * (pages != 1)})",
        )
    say("", f"materialization metadata: {materialization_metadata(instance, result.run_id)}")
    flow = queue.flow(QUEUE)
    say("", f"rate limit: {flow.per_second:g} documents a second, across every worker")

    say("3. Job process_documents in a worker process, killed mid-task with SIGKILL")
    log = home / "worker.log"
    with log.open("w") as output:
        worker = subprocess.Popen(
            [sys.executable, "-m", "example_repo.demo", "worker", "--page-seconds", "0.05"],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    contract = wait_for(lambda: processing(queue, CONTRACT), "the worker to start the contract")
    time.sleep(2)  # let it read a good part of the contract
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    held = queue.get(contract)
    say("", f"killed worker pid {worker.pid} while it held task {contract} ({CONTRACT}, 200 pages)")
    say("", f"lease held by {held.worker_id}")
    say("", f"lease expires at {held.lease_expires_at:%H:%M:%S.%f} (database clock)")
    say("", f"queue now: {format_counts(queue.stats(QUEUE).counts)}")

    say("4. The lease runs out; the sweeper sensor ticks, as the Dagster daemon runs it")
    wait_for(lambda: lease_passed(queue, contract), "the lease to expire", timeout=600)
    with logged_to(home / "dagster.log"):
        statuses = run_sensor_tick(instance, "leasequeue_sweeper")
    say("", f"tick status: {statuses[0].value}")
    records = instance.fetch_observations(dg.AssetKey(["leasequeue", QUEUE]), limit=50).records
    for record in reversed(records):
        observation = record.asset_observation
        assert observation is not None
        meta = {key: value.value for key, value in observation.metadata.items()}
        if meta["event"] == "lease_recovered":
            say(
                "",
                f"observation on leasequeue/{QUEUE}: task {meta['task_id']} {meta['action']}, "
                f"attempt {meta['attempt']}, {meta['seconds_overdue']} s overdue, "
                f"was held by {meta['worker_id']}",
            )
        else:
            say("", f"observation on leasequeue/{QUEUE}: counts {format_meta_counts(meta)}")

    say("5. The fan-in sensor ticks: the batch is not finished, so no report yet")
    with logged_to(home / "dagster.log"):
        run_sensor_tick(instance, FAN_IN_SENSOR)
    say("", f"tick skipped: {last_tick(instance, FAN_IN_SENSOR).skip_reason}")

    say("6. Job process_documents again: finishes the batch, the contract included")
    run_worker(page_seconds=0.005)
    rows = summary_counts(queue)
    for document, count in rows:
        say("", f"{document}: {count} summary row(s)")
    attempts = [f"{a.outcome} by {a.worker_id}" for a in queue.attempts(task_id=contract)]
    say("", f"attempts for {CONTRACT}: " + "; ".join(attempts))

    info = queue.batch(batch.id)
    say("", f"batch {batch.id}: {format_counts(info.counts)}, finished {info.finished}")

    say("7. Fan in: the sensor ticks again and requests one run of document_report")
    # The daemon ticks a sensor no sooner than its minimum interval after the last tick.
    time.sleep(max(0.0, last_tick(instance, FAN_IN_SENSOR).timestamp + 5.5 - time.time()))
    with logged_to(home / "dagster.log"):
        run_sensor_tick(instance, FAN_IN_SENSOR)
    (run_id,) = last_tick(instance, FAN_IN_SENSOR).run_ids
    run = instance.get_run_by_id(run_id)
    assert run is not None
    say("", f"run {run_id}: {run.status.value}, tags {dict(sorted(run.tags.items()))}")
    report = materialization_metadata(instance, run_id)
    say("", f"document_report metadata: {report}")

    ok = (
        [count for _, count in rows] == [1] * len(DOCUMENTS)
        and queue.stats(QUEUE).counts["done"] == len(DOCUMENTS)
        and [a.outcome for a in queue.attempts(task_id=contract)] == ["abandoned", "succeeded"]
        and run.status == dg.DagsterRunStatus.SUCCESS
        and report.get("summarised") == len(DOCUMENTS)
    )
    say("8. Result")
    say(
        "",
        "every document summarised exactly once, the killed worker's task recovered, "
        "and the report materialized once, after the batch's last task"
        if ok
        else "UNEXPECTED: see above",
    )
    say("", f"Dagster instance (with the observations) kept in {home}")
    say("", f"the sensors' and the report run's log: {home / 'dagster.log'}")
    queue.close()
    return 0 if ok else 1


@contextlib.contextmanager
def logged_to(path: Path) -> Iterator[None]:
    """Send this process's output, and its children's (code servers, run steps), to a file."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with path.open("a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, original in zip((1, 2), saved, strict=True):
                os.dup2(original, fd)
                os.close(original)


def processing(queue: LeaseQueue, document: str) -> int | None:
    for task in queue.list_tasks(status="processing", queue=QUEUE):
        if task.payload.get("document") == document:
            return task.task_id
    return None


def lease_passed(queue: LeaseQueue, task_id: int) -> bool:
    expires = queue.get(task_id).lease_expires_at
    with queue.connection() as conn:
        row = conn.execute("SELECT clock_timestamp() > %s", (expires,)).fetchone()
    return bool(row and row[0])


def summary_counts(queue: LeaseQueue) -> list[tuple[str, int]]:
    with queue.connection() as conn:
        rows = conn.execute(
            sql.SQL("SELECT document, count(*) FROM {} GROUP BY 1 ORDER BY 1").format(
                results_table(queue.schema)
            )
        ).fetchall()
    return [(str(document), int(count)) for document, count in rows]


def format_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{count} {status}" for status, count in counts.items() if count)


def last_tick(instance: dg.DagsterInstance, sensor_name: str) -> Any:
    """The sensor's newest tick."""
    (state,) = [s for s in instance.all_instigator_state() if s.instigator_name == sensor_name]
    return instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=1)[0]


def materialization_metadata(instance: dg.DagsterInstance, run_id: str) -> dict[str, Any]:
    """The metadata of the asset the run materialized (one asset per run here)."""
    records = instance.get_records_for_run(
        run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION
    ).records
    materialization = records[-1].event_log_entry.asset_materialization
    assert materialization is not None
    return {key: value.value for key, value in materialization.metadata.items()}


def format_meta_counts(meta: dict[str, Any]) -> str:
    return ", ".join(f"{meta[s]} {s}" for s in STATUSES if meta.get(s))


def wait_for(check: Any, what: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("mode", nargs="?", choices=["demo", "worker"], default="demo")
    parser.add_argument("--page-seconds", type=float, default=0.05)
    args = parser.parse_args(argv)
    if args.mode == "worker":
        run_worker(args.page_seconds)
        return 0
    return demo()


if __name__ == "__main__":
    sys.exit(main())
