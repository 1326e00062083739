"""Functions run in child processes by the tests (importable, so they work with spawn)."""

from __future__ import annotations

from dagster_leasequeue import LeaseQueue, LeaseQueueSettings


def drain_claims(dsn: str, schema: str, batch: int) -> list[int]:
    """Claim and ack until the queue is empty; return the claimed task ids."""
    claimed: list[int] = []
    settings = LeaseQueueSettings(pool_size=2, _env_file=None)
    with LeaseQueue(dsn, schema=schema, settings=settings) as queue:
        while leases := queue.claim_many(batch):
            assert len(leases) <= batch
            for lease in leases:
                claimed.append(lease.task_id)
                lease.ack()
    return claimed
