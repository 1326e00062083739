"""Exclusive claims under contention, from threads and from processes."""

from __future__ import annotations

import multiprocessing
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from dagster_leasequeue import LeaseQueue

from ..workers import drain_claims


def test_threads_never_share_a_task(make_queue) -> None:  # type: ignore[no-untyped-def]
    queue: LeaseQueue = make_queue(pool_size=10)
    queue.install()
    ids = queue.enqueue_many([{"n": n} for n in range(1500)])
    start = threading.Barrier(8)

    def worker(batch: int) -> list[int]:
        start.wait()
        claimed = []
        while leases := queue.claim_many(batch) if batch > 1 else [queue.claim()]:
            if leases == [None]:
                break
            assert len(leases) <= batch
            for lease in leases:
                assert lease is not None
                claimed.append(lease.task_id)
                lease.ack()
        return claimed

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(worker, [1, 1, 3, 7, 10, 25, 1, 50]))
    claimed = [task_id for result in results for task_id in result]
    assert Counter(claimed).most_common(1)[0][1] == 1
    assert sorted(claimed) == ids
    assert queue.stats().counts["done"] == 1500


def test_processes_never_share_a_task(dsn: str, queue: LeaseQueue) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(1200)])
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        results = pool.starmap(drain_claims, [(dsn, queue.schema, b) for b in (1, 5, 20, 64)])
    claimed = [task_id for result in results for task_id in result]
    assert len(claimed) == len(set(claimed)) == 1200
    assert sorted(claimed) == ids


def test_claim_many_never_exceeds_its_limit_under_contention(make_queue) -> None:  # type: ignore[no-untyped-def]
    queue: LeaseQueue = make_queue(pool_size=10)
    queue.install()
    queue.enqueue_many([{"n": n} for n in range(3000)])
    sizes: list[tuple[int, int]] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def worker(limit: int) -> None:
        start.wait()
        while leases := queue.claim_many(limit):
            with lock:
                sizes.append((limit, len(leases)))
            for lease in leases:
                lease.ack()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(worker, [2, 3, 5, 8, 13, 21, 34, 55]))
    assert all(got <= limit for limit, got in sizes)
    assert sum(got for _, got in sizes) == 3000
    # Fewer than the limit only when fewer tasks were left: most batches are full.
    assert sum(got == limit for limit, got in sizes) >= len(sizes) - 8 * 2
