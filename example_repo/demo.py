"""The end-to-end demo: a worker killed mid-task, its task recovered by the sweeper sensor.

    python -m example_repo.demo          # the whole story, step by step
    python -m example_repo.demo worker   # one worker run (the demo starts and kills one)

It uses the ``LEASEQUEUE_*`` settings (with no ``LEASEQUEUE_DSN``: the embedded server),
always in its own schema ``leasequeue_demo``, which it empties first, with 3-second leases
unless ``LEASEQUEUE_LEASE_SECONDS`` says otherwise, and a throwaway Dagster instance.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import dagster as dg
from psycopg import sql

from dagster_leasequeue import LeaseQueue
from dagster_leasequeue.models import STATUSES
from example_repo.definitions import QUEUE, defs
from example_repo.documents import DOCUMENTS, results_table
from example_repo.ticks import run_sensor_tick

QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
CONTRACT = "master-services-agreement.pdf"


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
    # Set before any resource starts; the worker process inherits them.
    os.environ["LEASEQUEUE_SCHEMA_NAME"] = "leasequeue_demo"
    os.environ.setdefault("LEASEQUEUE_LEASE_SECONDS", "3")
    home = Path(tempfile.mkdtemp(prefix="leasequeue-demo-"))
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
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

    say("2. Job enqueue_documents")
    result = defs.get_job_def("enqueue_documents").execute_in_process(
        instance=instance, run_config=QUIET
    )
    for task_id, document in zip(
        result.output_for_node("enqueue_documents_op"), DOCUMENTS, strict=True
    ):
        pages = document["pages"]
        say("", f"task {task_id}: {document['document']} ({pages} page{'s' * (pages != 1)})")

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
    say("", f"queue now: {format_counts(queue)}")

    say("4. The lease runs out; the sweeper sensor ticks, as the Dagster daemon runs it")
    wait_for(lambda: lease_passed(queue, contract), "the lease to expire", timeout=600)
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

    say("5. Job process_documents again: finishes the queue, the contract included")
    run_worker(page_seconds=0.005)
    rows = summary_counts(queue)
    for document, count in rows:
        say("", f"{document}: {count} summary row(s)")
    attempts = [f"{a.outcome} by {a.worker_id}" for a in queue.attempts(CONTRACT, queue=QUEUE)]
    say("", f"attempts for {CONTRACT}: " + "; ".join(attempts))

    ok = (
        [count for _, count in rows] == [1] * len(DOCUMENTS)
        and queue.stats(QUEUE).counts["done"] == len(DOCUMENTS)
        and [a.outcome for a in queue.attempts(CONTRACT, queue=QUEUE)] == ["abandoned", "succeeded"]
    )
    say("6. Result")
    say(
        "",
        "every document summarised exactly once, the killed worker's task recovered"
        if ok
        else "UNEXPECTED: see above",
    )
    say("", f"Dagster instance (with the observations) kept in {home}")
    queue.close()
    return 0 if ok else 1


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


def format_counts(queue: LeaseQueue) -> str:
    counts = queue.stats(QUEUE).counts
    return ", ".join(f"{count} {status}" for status, count in counts.items() if count)


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
