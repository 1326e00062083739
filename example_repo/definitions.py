"""The example's Dagster definitions: load them with ``dagster dev -w workspace.yaml``.

The resource reads every setting from the ``LEASEQUEUE_*`` environment (``LEASEQUEUE_DSN``,
``LEASEQUEUE_SCHEMA_NAME``, ``LEASEQUEUE_LEASE_SECONDS``, ...) and starts an embedded
PostgreSQL when no DSN is set.
"""

from typing import Any

import dagster as dg

from dagster_leasequeue import (
    Lease,
    LeaseQueueResource,
    batch_id_from_run,
    batch_metadata,
    build_batch_sensor,
    build_queue_asset_checks,
    build_sweeper_sensor,
    build_worker_launcher_sensor,
    queue_asset_specs,
)
from example_repo.documents import DOCUMENTS, create_results_table, summarise, write_summary

QUEUE = "documents"

# The summarisation model behind the workers takes at most this many documents a second,
# however many workers and machines claim: the queue's claims hold to it (a token bucket
# in the database; see LeaseQueue.set_rate_limit).
SUMMARIES_PER_SECOND = 20.0


def limit_summaries(leasequeue: LeaseQueueResource) -> None:
    """Put the model's rate limit on the queue, once (a bucket set again starts full)."""
    queue = leasequeue.get_queue()
    if queue.flow(QUEUE).per_second != SUMMARIES_PER_SECOND:
        queue.set_rate_limit(QUEUE, per_second=SUMMARIES_PER_SECOND)


class EnqueueConfig(dg.Config):
    copies: int = 1
    """How many times to enqueue the document set (each copy under its own keys)."""


class ProcessConfig(dg.Config):
    page_seconds: float = 0.02
    """Simulated reading time per page: a 200-page contract takes 200 times this."""
    max_tasks: int = 0
    """Stop after this many tasks (0: until the queue is empty)."""


@dg.op
def enqueue_documents_op(
    context: dg.OpExecutionContext, config: EnqueueConfig, leasequeue: LeaseQueueResource
) -> list[int]:
    """Enqueue the documents; a document already waiting or in progress is not added twice."""
    limit_summaries(leasequeue)
    ids = []
    for copy in range(config.copies):
        for document in DOCUMENTS:
            key = document["document"] if copy == 0 else f"{document['document']}#{copy}"
            ids.append(leasequeue.enqueue(document, idempotency_key=key))
    context.log.info(f"enqueued {len(ids)} documents: task ids {ids}")
    return ids


@dg.op
def process_documents_op(
    context: dg.OpExecutionContext, config: ProcessConfig, leasequeue: LeaseQueueResource
) -> dict[str, int]:
    """Claim and summarise documents until the queue is empty.

    Each summary is written through an attempt: the row, the attempt's success mark and
    the task's ack commit together, so a run after a crash writes every summary once. The
    lease renews itself while a long document is read; if it is lost anyway, the work stops.
    The worker loop outlives a database restart or failover: it logs, backs off, reconnects
    and goes on.
    """
    queue = leasequeue.get_queue()
    with queue.connection() as conn:
        create_results_table(conn, queue.schema)
    counts = {"processed": 0, "skipped": 0}

    def summarise_document(document: dict[str, Any], lease: Lease) -> None:
        with leasequeue.attempt(lease=lease) as attempt:
            if attempt.duplicate:
                counts["skipped"] += 1
                context.log.info(f"{document['document']}: already summarised, skipped")
                return
            words = summarise(document, config.page_seconds, lease.raise_if_lost)
            write_summary(
                attempt.connection, queue.schema, document, words, lease.task_id, lease.worker_id
            )
            attempt.result = {"words": words}
        counts["processed"] += 1
        context.log.info(
            f"{document['document']}: {document['pages']} pages, {words} words "
            f"(task {lease.task_id}, attempt {lease.attempt})"
        )

    leasequeue.run_worker(summarise_document, max_tasks=config.max_tasks or None)
    return counts


@dg.job(description="Enqueue the example documents.")
def enqueue_documents() -> None:
    enqueue_documents_op()


@dg.job(description="Claim and summarise documents until the queue is empty.")
def process_documents() -> None:
    process_documents_op()


# -- fan out and fan in: a batch of documents, and a report once all are summarised -------

# The report's check fails when more than this share of the batch ended dead.
MAX_DEAD_SHARE = 0.1


@dg.asset(description="Fans the documents out as one batch of tasks for the workers.")
def document_batch(
    context: dg.AssetExecutionContext, config: EnqueueConfig, leasequeue: LeaseQueueResource
) -> dg.MaterializeResult:
    limit_summaries(leasequeue)
    payloads = (document for _ in range(config.copies) for document in DOCUMENTS)
    # Named after the run: a retry of this step finds the batch it made instead of a second.
    batch = leasequeue.enqueue_batch(
        payloads, queue=QUEUE, name=f"document_batch:{context.run.run_id}"
    )
    context.log.info(f"batch {batch.id}: {batch.total} documents enqueued")
    return dg.MaterializeResult(metadata=batch_metadata(batch))


@dg.asset(
    deps=[document_batch],
    description="Words per document kind, from every summary of a finished batch.",
    check_specs=[dg.AssetCheckSpec("few_dead_documents", asset="document_report")],
)
def document_report(
    context: dg.AssetExecutionContext, leasequeue: LeaseQueueResource
) -> dg.MaterializeResult:
    batch_id = batch_id_from_run(context)
    info = leasequeue.batch(batch_id)
    words: dict[str, int] = {}
    for task in leasequeue.batch_results(batch_id):
        kind = task.payload["kind"]
        words[kind] = words.get(kind, 0) + int((task.result or {}).get("words", 0))
    dead_share = info.dead / info.total if info.total else 0.0
    return dg.MaterializeResult(
        metadata={
            "batch_id": batch_id,
            "documents": info.total,
            "summarised": info.done,
            "dead": info.dead,
            "cancelled": info.cancelled,
            "words_by_kind": dg.MetadataValue.json(words),
        },
        check_results=[
            dg.AssetCheckResult(
                check_name="few_dead_documents",
                passed=dead_share <= MAX_DEAD_SHARE,
                metadata={"dead_share": round(dead_share, 4), "limit": MAX_DEAD_SHARE},
            )
        ],
    )


defs = dg.Definitions(
    jobs=[enqueue_documents, process_documents],
    assets=[*queue_asset_specs([QUEUE]), document_batch, document_report],
    asset_checks=build_queue_asset_checks(
        [QUEUE], stuck_after_seconds=120, max_oldest_waiting_seconds=600
    ),
    sensors=[
        build_sweeper_sensor(minimum_interval_seconds=15),
        build_batch_sensor(
            name="document_report_when_batch_finished",
            upstream=document_batch.key,
            asset_selection=[document_report],
            # A batch read per tick is one query on the batch's counters: cheap to ask often.
            minimum_interval_seconds=5,
        ),
        build_worker_launcher_sensor(
            process_documents, max_concurrent_runs=2, tasks_per_run=3, minimum_interval_seconds=15
        ),
    ],
    resources={"leasequeue": LeaseQueueResource(queue=QUEUE)},
)
